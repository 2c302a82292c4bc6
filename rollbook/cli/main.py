"""The ``rollbook`` command.

    rollbook serve  --db runs/demo/rollbook.duckdb --port 0     # the store (gRPC)
    rollbook serve  --config configs/store.toml --validator.norm.mode group_mean   # store policies
    rollbook query  --server 127.0.0.1:50551 "SELECT count(*) FROM trajectories"
    rollbook query  --db runs/demo/rollbook.duckdb "SHOW TABLES"  # file, read-only, server down
    rollbook stats  --server 127.0.0.1:50551
    rollbook admin  register-model tiny                          # admin key from ROLLBOOK_ADMIN_KEY
    rollbook admin  rollback tiny 12 --run-dir runs/demo         # back to version 12 (run stopped; docs/gate.md)
    rollbook store  age --db runs/demo/rollbook.duckdb --older-than 7d  # trained rows into Parquet (store stopped)
    rollbook replay reward --db runs/demo/rollbook.duckdb --reward math --name math-v2  # re-score (store stopped)
    rollbook replay step 12 --run runs/demo                      # rerun step 12, compare bit for bit
    rollbook run    --config configs/quickstart.toml --run_dir runs/offline --replay.ledger runs/quickstart/rollbook.duckdb  # stored rows
    rollbook proxy  --server 127.0.0.1:50551 --port 8000         # OpenAI-compatible endpoint (docs/online.md)
    rollbook demo   --run-dir runs/demo                          # store + generated workload + SQL
    rollbook export runs/demo/checkpoints/step-000040 --to out/  # a checkpoint as a Hugging Face directory

``run``, ``train``, ``rollout``, ``proxy`` and ``serve`` take ``--config FILE`` and any config field as a
dotted flag; ``--help-config`` lists the fields. Environment variables are read in rollbook/environment.py
(keys, TLS files, ROLLBOOK_SERVER; docs/security.md).

Errors: a configuration error (``ConfigError``, exit 2) and a condition the user must fix
(``CommandError``, exit 1: store down, port taken, ledger held) print one line; anything else keeps
its traceback. Each subcommand imports what it needs only when it runs: ``rollbook --help`` stays
instant and no subcommand here imports torch.
"""

from __future__ import annotations

import argparse
import sys

from rollbook.cli.age import add_parser as add_age_parser
from rollbook.cli.export_data import add_parser as add_export_data_parser
from rollbook.cli.govern import add_lineage_parsers
from rollbook.cli.govern import add_parser as add_govern_parser
from rollbook.cli.replay import add_parser as add_replay_parser
from rollbook.cli.store_flags import client_flags, store_client
from rollbook.environment import DEFAULT_SERVER
from rollbook.errors import CommandError, ConfigError, unreachable

# serve's flags -> StoreConfig fields (flags given win over --config and dotted overrides)
_SERVE_FLAGS = {
    "db": "db",
    "host": "host",
    "port": "port",
    "worker_key": "worker_key",
    "trainer_key": "trainer_key",
    "reader_key": "reader_key",
    "admin_key": "admin_key",
    "keys_file": "keys_file",
    "tls_cert": "tls_cert",
    "tls_key": "tls_key",
    "tls_client_ca": "tls_client_ca",
    "insecure": "insecure",
    "stream_idle_timeout": "stream_idle_timeout_s",
    "max_submit_streams_per_host": "max_submit_streams_per_host",
}
_KEY_FIELDS = ("worker_key", "trainer_key", "reader_key", "admin_key")


def load_store_config(path: str | None, overrides: list[str], flags: dict | None = None):
    """StoreConfig from the environment, then ``path``, then dotted overrides, then ``flags``."""
    from rollbook.config import StoreConfig, load_config, read_config_file
    from rollbook.store.server import env_values

    if path:
        in_file = sorted(set(_KEY_FIELDS) & read_config_file(path).keys())
        if in_file:
            raise ConfigError(f"{in_file[0]} in {path}: keys come from the environment (ROLLBOOK_*_KEY), never a config file")
    given = {k: v for k, v in (flags or {}).items() if v is not None}
    return load_config(StoreConfig, path, overrides, base=env_values(), final=given)


def _serve(args: argparse.Namespace, overrides: list[str]) -> int:
    from rollbook.lifetime import stop_event
    from rollbook.logs import setup_logging
    from rollbook.store.server import serve

    flags = {field: getattr(args, flag) for flag, field in _SERVE_FLAGS.items()}
    flags["insecure"] = args.insecure or None
    config = load_store_config(args.config, overrides, flags)
    setup_logging(args.log_level)
    serve(config, stop_event())  # SIGINT, SIGTERM, or the run that started it gone
    return 0


def _query(args: argparse.Namespace) -> int:
    from rollbook.cli.query import run_query_command

    return run_query_command(args)


def _stats(args: argparse.Namespace) -> int:
    import json

    with store_client(args) as client:
        try:
            response = client.stats()
        except Exception as exc:
            reason = unreachable(exc, args.server)
            if reason is None:
                raise
            raise CommandError(reason) from None
    # stats_json holds every counter; the typed fields repeat some of them: print each once
    stats = json.loads(response.stats_json or "{}")
    for f in response.DESCRIPTOR.fields:
        if f.name != "stats_json" and f.name not in stats:
            value = getattr(response, f.name)
            stats[f.name] = dict(value) if f.message_type is not None else value
    print(json.dumps(stats, indent=2, sort_keys=True))
    return 0


def _admin(args: argparse.Namespace) -> int:
    from rollbook.client import StoreClient

    if args.action == "rollback":
        return _rollback(args)
    admin_key = args.admin_key or None
    with StoreClient.from_env(args.server, admin_key=admin_key) as client:
        if client.admin_key is None:
            raise CommandError(
                "admin commands need the admin key: set ROLLBOOK_ADMIN_KEY (rollbook run keeps it in RUN_DIR/keys.json)"
            )
        try:
            if args.action == "register-model":
                vocab = args.vocab_size
                if vocab is None:
                    from rollbook.tasks import TOKENIZER

                    vocab = TOKENIZER.vocab_size
                client.register_model(args.model_id, vocab_size=vocab)
                print(f"registered model {args.model_id!r} (vocab_size {vocab}) at {args.server}")
            else:
                latest = client.publish_version(args.model_id, args.version, checksum=args.checksum)
                print(f"published version {args.version} of {args.model_id!r}; latest is {latest}")
        except Exception as exc:
            reason = unreachable(exc, args.server)
            if reason is None:
                details = getattr(exc, "details", None)
                if callable(details):  # another gRPC status: the store's own words
                    raise CommandError(f"{exc.code().name}: {details()}") from None  # type: ignore[attr-defined]  # a grpc.RpcError
                raise
            raise CommandError(reason) from None
    return 0


def _rollback(args: argparse.Namespace) -> int:
    """``rollbook admin rollback MODEL VERSION``: on a stopped run's directory and ledger (rollbook/run/gate.py)."""
    import pathlib

    from rollbook.run.gate import roll_back_run

    run_dir = pathlib.Path(args.run_dir)
    db = pathlib.Path(args.db) if args.db else run_dir / "rollbook.duckdb"
    done = roll_back_run(run_dir, db, args.model_id, args.version)
    marked = ", ".join(str(v) for v in done.marked) or "none"
    print(
        f"rolled back {args.model_id!r} to version {done.version}: versions after it marked rolled_back ({marked}); "
        f"its weights and optimizer state are version {done.new_version}, promoted, in {done.checkpoint}; "
        f"the next `rollbook run` with --run_dir {run_dir} resumes from them at step {done.step}"
    )
    return 0


def _demo(args: argparse.Namespace) -> int:
    from rollbook.cli.demo import run_demo

    return run_demo(args)


def _report(args: argparse.Namespace) -> int:
    import pathlib

    from rollbook.cli.report import write_report

    for run_dir in args.run_dirs:
        if not (pathlib.Path(run_dir) / "metrics.jsonl").exists() or not (pathlib.Path(run_dir) / "rollbook.duckdb").exists():
            raise CommandError(f"{run_dir} is not a finished run directory (needs metrics.jsonl and rollbook.duckdb)")
    write_report([pathlib.Path(d) for d in args.run_dirs], pathlib.Path(args.out) if args.out else None)
    return 0


def _run(args: argparse.Namespace, overrides: list[str]) -> int:
    from rollbook.config import RunConfig, load_config
    from rollbook.logs import setup_logging

    config = load_config(RunConfig, args.config, overrides)  # validated before torch is imported
    if not (config.placement == "ray" and config.ray.address):  # on a cluster the actors' nodes check
        _check_engine(config.rollout.engine, config.trainer.model.path, device=config.rollout.device)
    setup_logging(args.log_level)
    from rollbook.run.main import run

    run(config)
    return 0


def _train(args: argparse.Namespace, overrides: list[str]) -> int:
    from rollbook import environment as env
    from rollbook.config import TrainerConfig, load_config, write_resolved
    from rollbook.logs import setup_logging

    config = load_config(TrainerConfig, args.config, overrides)
    _check_device(config.device, config.dtype)
    if config.trainer_key is None:
        config.trainer_key = env.role_key("trainer")
    setup_logging(args.log_level)
    write_resolved(config, config.run_dir)
    from rollbook.trainer.main import train

    train(config)
    return 0


def _rollout(args: argparse.Namespace, overrides: list[str]) -> int:
    from rollbook.config import WorkerConfig, load_config
    from rollbook.lifetime import stop_event
    from rollbook.logs import setup_logging

    if args.config is None and not overrides:
        raise ConfigError("rollbook rollout needs a worker config: --config configs/worker.toml (or --weights shm:NAME ...)")
    config = load_config(WorkerConfig, args.config, overrides)
    _check_engine(config.rollout.engine, config.model.path, device=config.rollout.device)
    from rollbook.rollout.engines import check_fits

    check_fits(config.model, config.rollout)  # the longest request fits the model: one line, exit 2
    if config.rollout.engine == "native":  # vLLM places its model itself
        _check_device(config.rollout.device, config.rollout.dtype)
    setup_logging(args.log_level)
    from rollbook.rollout.main import run_worker

    run_worker(config, stop_event())
    return 0


def _export(args: argparse.Namespace) -> int:
    from rollbook.trainer.export import export_checkpoint

    out = export_checkpoint(args.checkpoint, args.to, tokenizer_dir=args.tokenizer)
    print(f"exported {args.checkpoint} to {out} (load with AutoModelForCausalLM / AutoTokenizer.from_pretrained)")
    return 0


def _proxy(args: argparse.Namespace, overrides: list[str]) -> int:
    from rollbook.config import ProxyConfig, load_config
    from rollbook.lifetime import stop_event
    from rollbook.logs import setup_logging

    config = load_config(ProxyConfig, args.config, overrides)
    _check_engine(config.engine, config.model.path, field="engine", device=config.device)
    from rollbook.rollout.engines import check_proxy_fits

    check_proxy_fits(config)  # max_context_tokens fits the model: one line, exit 2
    if config.engine == "native":  # vLLM places its model itself
        _check_device(config.device, config.dtype)
    setup_logging(args.log_level)
    from rollbook.rollout.proxy.server import serve as serve_proxy

    serve_proxy(config, stop_event())
    return 0


def _check_device(device: str, dtype: str) -> None:
    """A device that is not there, or a dtype it cannot compute in: one line, exit 2, before anything starts."""
    from rollbook.devices import check

    check(device, dtype)


def _check_engine(engine: str, model_path: str | None, *, field: str = "rollout.engine", device: str = "auto") -> None:
    """An engine this machine cannot build (vllm not installed, or no model directory for it): one line,
    exit 2, before anything starts; vllm itself is not imported."""
    from rollbook.rollout.engines import check_engine

    check_engine(engine, model_path, field=field, device=device)


def _config_model(command: str):
    if command == "proxy":
        from rollbook.config import ProxyConfig

        return ProxyConfig
    if command == "run":
        from rollbook.config import RunConfig

        return RunConfig
    if command == "train":
        from rollbook.config import TrainerConfig

        return TrainerConfig
    if command == "rollout":
        from rollbook.config import WorkerConfig

        return WorkerConfig
    from rollbook.config import StoreConfig

    return StoreConfig


class _HelpConfig(argparse.Action):
    """``--help-config``: print every config field (dotted name, type, default, description) and exit."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        from rollbook.config import field_help

        command = parser.prog.split()[-1]
        model = _config_model(command)
        print(
            f"Config fields of `rollbook {command}` ({model.__name__}): set them in the --config TOML file "
            f"(sections for the dotted parts) or as flags, e.g. --{_example(command)}.\n"
        )
        print("\n".join(field_help(model)))
        parser.exit(0)


def _example(command: str) -> str:
    return {
        "run": "trainer.lr 3e-4",
        "train": "loss.eps_clip 0.1",
        "rollout": "rollout.group_size 4",
        "serve": "validator.norm.mode group_mean",
        "proxy": "max_concurrent 16",
    }[command]


def _config_flags(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--config", default=None, help=f"TOML (or .json) {what}; defaults apply without one")
    p.add_argument(
        "--help-config", action=_HelpConfig, help="list every config field (dotted flag, type, default, description) and exit"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollbook", description="A durable, queryable trajectory store for RL on language models."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "serve",
        help="run the trajectory store (gRPC) on a DuckDB file",
        description="Run the store. Every StoreConfig field (validator and ingest policies, SQL and "
        "stream limits) can be set in --config FILE or as a dotted flag, e.g. "
        "--validator.norm.mode group_mean --query_max_rows 1000; --help-config lists them. "
        "The flags below win over both.",
    )
    _config_flags(p, "store config (StoreConfig fields at the top level)")
    p.add_argument("--db", default=None, help="DuckDB ledger file (default: runs/default/rollbook.duckdb)")
    p.add_argument("--host", default=None, help="bind address (default: 127.0.0.1); non-loopback needs all four keys and TLS")
    p.add_argument(
        "--port", type=int, default=None, help="port, 0 = any free one, printed as 'listening on HOST:PORT' (default: 50551)"
    )
    p.add_argument(
        "--worker-key",
        default=None,
        help="Submit/SetReward key (default: env ROLLBOOK_WORKER_KEY; prefer the env: flags show in ps)",
    )
    p.add_argument(
        "--trainer-key",
        default=None,
        help="PullBatch/AckBatch/PublishVersion/ReportTrainStep key (default: env ROLLBOOK_TRAINER_KEY)",
    )
    p.add_argument("--reader-key", default=None, help="Query/GetStats key (default: env ROLLBOOK_READER_KEY)")
    p.add_argument("--admin-key", default=None, help="key for every RPC incl. RegisterModel (default: env ROLLBOOK_ADMIN_KEY)")
    p.add_argument(
        "--keys-file",
        default=None,
        help="TOML key file (mode 0600): keys bound to a role, a tenant and models (default: env ROLLBOOK_KEYS_FILE; "
        "docs/governance.md)",
    )
    p.add_argument("--tls-cert", default=None, help="PEM server certificate: serve TLS (default: env ROLLBOOK_TLS_CERT)")
    p.add_argument("--tls-key", default=None, help="PEM key of --tls-cert (default: env ROLLBOOK_TLS_KEY)")
    p.add_argument(
        "--tls-client-ca",
        default=None,
        help="PEM CA of client certificates: require one (mutual TLS; env ROLLBOOK_TLS_CLIENT_CA)",
    )
    p.add_argument(
        "--insecure", action="store_true", help="allow a non-loopback --host without TLS (keys cross the network in clear text)"
    )
    p.add_argument(
        "--stream-idle-timeout", type=float, default=None, help="close a Submit stream idle this many seconds (default: 120)"
    )
    p.add_argument(
        "--max-submit-streams-per-host",
        type=int,
        default=None,
        help="open Submit streams one client host may hold (default: 256)",
    )
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=_serve, takes_overrides=True)

    p = sub.add_parser("query", help="run read-only SQL through the server, or on the file when the server is down")
    p.add_argument("sql", help="one read-only statement (SELECT/WITH/DESCRIBE/SHOW/SUMMARIZE/EXPLAIN)")
    p.add_argument(
        "--server",
        default=None,
        help=f"store address HOST:PORT (default: env ROLLBOOK_SERVER, else {DEFAULT_SERVER} when --db is not given)",
    )
    p.add_argument("--db", default=None, help="DuckDB file to open read-only when the server is not reachable")
    p.add_argument(
        "--format", choices=["table", "csv", "json", "parquet"], default="table", help="output format (default: %(default)s)"
    )
    p.add_argument(
        "--output", "-o", default=None, help="write to this file instead of stdout (required for parquet on a terminal)"
    )
    p.add_argument("--max-rows", type=int, default=0, help="row cap (0 = server default, 100000)")
    p.add_argument("--timeout", type=float, default=0.0, help="query timeout in seconds (0 = server default, 30)")
    client_flags(p)
    p.set_defaults(func=_query)

    p = sub.add_parser("stats", help="print the store's counters as JSON")
    p.add_argument(
        "--server", default=None, help=f"store address HOST:PORT (default: env ROLLBOOK_SERVER, else {DEFAULT_SERVER})"
    )
    client_flags(p)
    p.set_defaults(func=_stats)

    p = sub.add_parser(
        "admin",
        help="register a model, publish a policy version (admin key: env ROLLBOOK_ADMIN_KEY), roll a stopped run back",
        description="Prepare a fresh store for `rollbook train`: register the model (admin key), "
        "optionally publish a version (the trainer publishes its own on start). `rollback` works on a "
        "stopped run's files instead (no store, no key).",
    )
    asub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    a = asub.add_parser("register-model", help="register MODEL_ID with its vocabulary size")
    a.add_argument("model_id")
    a.add_argument(
        "--vocab-size", type=int, default=None, help="vocabulary size (default: the task tokenizer's, rollbook/tasks.py)"
    )
    a = asub.add_parser("publish-version", help="publish VERSION of MODEL_ID (normally the trainer does this)")
    a.add_argument("model_id")
    a.add_argument("version", type=int)
    a.add_argument("--checksum", default="", help="checksum of the weights (the trainer's state_checksum)")
    for a in asub.choices.values():
        a.add_argument(
            "--server", default=None, help=f"store address HOST:PORT (default: env ROLLBOOK_SERVER, else {DEFAULT_SERVER})"
        )
        a.add_argument("--admin-key", default=None, help="admin key (default: env ROLLBOOK_ADMIN_KEY; prefer the env)")
    a = asub.add_parser(
        "rollback",
        help="roll a stopped run back to VERSION: later versions marked rolled_back, the next run resumes from it",
        description="Roll a stopped run back to a kept version (docs/gate.md). In the ledger every version of "
        "MODEL_ID after VERSION that no gate refused is marked rolled_back and the next free version number "
        "is recorded promoted; in RUN_DIR the latest checkpoint becomes VERSION's weights and optimizer state "
        "under that number (the step count kept). The next `rollbook run` with this run directory resumes "
        "from it and rollout generates with it. VERSION needs a kept checkpoint (RUN_DIR/checkpoints, or the "
        "gate's last promoted version). The run and its store must be stopped: a held ledger is refused.",
    )
    a.add_argument("model_id")
    a.add_argument("version", type=int)
    a.add_argument("--run-dir", required=True, metavar="RUN_DIR", help="the run directory (checkpoints/, gate/)")
    a.add_argument("--db", default=None, metavar="PATH", help="the ledger (default: RUN_DIR/rollbook.duckdb)")
    p.set_defaults(func=_admin)

    add_age_parser(sub)  # rollbook store age (rollbook/cli/age.py)
    add_replay_parser(sub)  # rollbook replay reward (rollbook/cli/replay.py)
    add_govern_parser(sub)  # rollbook govern hold/release/policy (rollbook/cli/govern.py)
    add_lineage_parsers(sub)  # rollbook lineage, rollbook forget (rollbook/cli/govern.py)
    add_export_data_parser(sub)  # rollbook export-data (rollbook/cli/export_data.py)

    p = sub.add_parser(
        "run",
        help="the whole loop on one machine: store + rollout + trainer on RUN_DIR/rollbook.duckdb",
        description="Run store, rollout and trainer on one machine. Any config field can be overridden "
        "with a dotted flag, e.g. --num_steps 10 --trainer.lr 1e-3 --rollout.group_size 4 "
        "--store.validator.norm.mode group_mean; --help-config lists them. With --replay.ledger "
        "RUN/rollbook.duckdb (a [replay] section: --replay.where, --replay.reward_version, --replay.epochs) "
        "it generates nothing and trains a new policy on a finished run's stored groups (docs/replay.md).",
    )
    _config_flags(p, "run config (see configs/)")
    p.add_argument("--log-level", default="WARNING")
    p.set_defaults(func=_run, takes_overrides=True)

    p = sub.add_parser(
        "train",
        help="run the trainer against a store: pull, update, checkpoint, ack, publish",
        description="Train on validated batches from a running store (register the model first: "
        "`rollbook admin register-model`). Dotted overrides set any TrainerConfig field, e.g. "
        "--server 127.0.0.1:50551 --num_steps 20 --loss.eps_clip 0.1; --help-config lists them.",
    )
    _config_flags(p, "trainer config")
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=_train, takes_overrides=True)

    p = sub.add_parser(
        "rollout",
        help="run a rollout worker: weights from a channel, generation, spooled submission",
        description="Run a rollout worker against a store. Dotted overrides set any WorkerConfig field, "
        "e.g. --server 127.0.0.1:50551 --weights shm:NAME --rollout.group_size 4; --help-config lists them.",
    )
    _config_flags(p, "worker config (example: configs/worker.toml)")
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=_rollout, takes_overrides=True)

    p = sub.add_parser(
        "export",
        help="write a kept checkpoint as a Hugging Face directory (model + tokenizer)",
        description="Convert a rollbook checkpoint (RUN_DIR/checkpoints/step-NNNNNN, or a run directory: "
        "its LATEST) into a directory that AutoModelForCausalLM and AutoTokenizer.from_pretrained load. "
        "The tokenizer is the run's (model.path's files, else the task tokenizer) unless --tokenizer.",
    )
    p.add_argument("checkpoint", help="checkpoint directory, RUN_DIR/checkpoints, or RUN_DIR (then the LATEST checkpoint)")
    p.add_argument("--to", required=True, metavar="DIR", help="output directory (must not exist or be empty)")
    p.add_argument("--tokenizer", default=None, metavar="DIR", help="copy the tokenizer files from this directory instead")
    p.set_defaults(func=_export)
    p = sub.add_parser(
        "proxy",
        help="serve an OpenAI-compatible endpoint that records an agent's calls as trajectories",
        description="Serve /v1/chat/completions and /v1/completions for agents (a session key as the API "
        "key) and record every completion in the store (docs/online.md). Dotted overrides set any ProxyConfig "
        "field, e.g. --server 127.0.0.1:50551 --port 8000 --model_id tiny; --help-config lists them. Keys: "
        "ROLLBOOK_ADMIN_KEY (control endpoints), ROLLBOOK_WORKER_KEY (starting sessions).",
    )
    _config_flags(p, "proxy config")
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=_proxy, takes_overrides=True)
    p = sub.add_parser(
        "report",
        help="report.md, PNG plots and summary.json of finished runs (several: one plot)",
        description="Write RUN_DIR/summary.json for each run (held-out reward per domain at start and "
        "end, steps, wall time, rows accepted, rejected by reason, trained) and report.md with PNG plots "
        "(held-out and training reward per domain, teacher gap, staleness, rejections, throughput) in "
        "--out, one line per run. Reads metrics.jsonl and a read-only copy of the ledger.",
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="finished run directories (metrics.jsonl, rollbook.duckdb)")
    p.add_argument("--out", default=None, help="folder for report.md and the PNGs (default: the first RUN_DIR)")
    p.set_defaults(func=_report)

    p = sub.add_parser("demo", help="start a store in a run directory, feed it a generated workload, print SQL answers")
    p.add_argument(
        "--run-dir", default="runs/demo", help="run directory; the ledger is RUN_DIR/rollbook.duckdb (default: %(default)s)"
    )
    p.add_argument("--num-trajectories", type=int, default=2000, help="how many trajectories to generate (default: %(default)s)")
    p.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    from rollbook import environment as env
    from rollbook.lifetime import tie_to_parent

    tie_to_parent()  # a child of `rollbook run` stops when it dies, even by SIGKILL
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "takes_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if hasattr(args, "server") and args.command != "query" and args.server is None:
        args.server = env.server()
    try:
        return args.func(args, extra) if getattr(args, "takes_overrides", False) else args.func(args)
    except KeyboardInterrupt:
        return 130
    except ConfigError as exc:  # the configuration: one line, exit 2
        print(f"rollbook {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except CommandError as exc:  # a condition the user must fix: one line, exit 1
        print(f"rollbook {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
