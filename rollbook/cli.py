"""The ``rollbook`` command.

    rollbook serve  --db runs/demo/rollbook.duckdb --port 0     # the store (gRPC)
    rollbook query  --server 127.0.0.1:50551 "SELECT count(*) FROM trajectories"
    rollbook query  --db runs/demo/rollbook.duckdb "SHOW TABLES"  # file, read-only, server down
    rollbook stats  --server 127.0.0.1:50551
    rollbook demo   --run-dir runs/demo                          # store + generated workload + SQL

Keys travel in the environment (ROLLBOOK_WORKER_KEY, ROLLBOOK_TRAINER_KEY, ROLLBOOK_READER_KEY,
ROLLBOOK_ADMIN_KEY), TLS files in flags or ROLLBOOK_TLS_* (docs/security.md).

Each subcommand imports what it needs only when it runs: ``rollbook --help`` stays instant and no
subcommand here imports torch.
"""

from __future__ import annotations

import argparse
import os
import sys

DEFAULT_SERVER = "127.0.0.1:50551"


def _serve(args: argparse.Namespace) -> int:
    from rollbook.logs import setup_logging
    from rollbook.store.server import StoreConfig, serve

    setup_logging(args.log_level)
    config = StoreConfig.from_env(db=args.db, host=args.host, port=args.port, admin_key=args.admin_key,
                                  trainer_key=args.trainer_key, worker_key=args.worker_key, reader_key=args.reader_key,
                                  tls_cert=args.tls_cert, tls_key=args.tls_key, tls_client_ca=args.tls_client_ca,
                                  insecure=args.insecure or None, stream_idle_timeout_s=args.stream_idle_timeout,
                                  max_submit_streams_per_host=args.max_submit_streams_per_host)
    serve(config)
    return 0


def _client(args: argparse.Namespace, **kwargs):
    """A ``StoreClient`` with the keys of the environment and the TLS files of the flags (or env)."""
    from rollbook.client import StoreClient
    from rollbook.tls import ClientTLS

    tls = ClientTLS.from_env()
    if args.tls_ca or args.tls_client_cert or args.tls_client_key:
        tls = ClientTLS(args.tls_ca or (tls and tls.ca), args.tls_client_cert or (tls and tls.cert),
                        args.tls_client_key or (tls and tls.key), tls and tls.server_name)
    return StoreClient.from_env(args.server, reader_key=getattr(args, "reader_key", None), tls=tls, **kwargs)


def _client_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reader-key", default=None, help="reader (or admin) key (default: env ROLLBOOK_READER_KEY, else ROLLBOOK_ADMIN_KEY)")
    p.add_argument("--tls-ca", default=None, help="PEM CA that signed the store's certificate: connect with TLS (env ROLLBOOK_TLS_CA)")
    p.add_argument("--tls-client-cert", default=None, help="PEM client certificate, for a store that requires one (env ROLLBOOK_TLS_CLIENT_CERT)")
    p.add_argument("--tls-client-key", default=None, help="PEM key of --tls-client-cert (env ROLLBOOK_TLS_CLIENT_KEY)")


def _query(args: argparse.Namespace) -> int:
    from rollbook.query_cli import run_query_command

    return run_query_command(args)


def _stats(args: argparse.Namespace) -> int:
    import json

    with _client(args) as client:
        response = client.stats()
    # the fields as plain JSON numbers (protobuf's JSON mapping would write the uint64 counters as strings)
    stats = {f.name: dict(getattr(response, f.name)) if f.message_type is not None else getattr(response, f.name)
             for f in response.DESCRIPTOR.fields}
    stats["stats_json"] = json.loads(response.stats_json or "{}")
    print(json.dumps(stats, indent=2, sort_keys=True))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from rollbook.demo import run_demo

    return run_demo(args)


def _run(args: argparse.Namespace, overrides: list[str]) -> int:
    from rollbook.config import RunConfig, load_config
    from rollbook.logs import setup_logging

    config = load_config(RunConfig, args.config, overrides)  # validated before torch is imported
    setup_logging(args.log_level)
    from rollbook.run import run

    run(config)
    return 0


def _train(args: argparse.Namespace, overrides: list[str]) -> int:
    from rollbook.config import load_config, write_resolved
    from rollbook.logs import setup_logging
    from rollbook.trainer.config import TrainerConfig

    config = load_config(TrainerConfig, args.config, overrides)
    if config.trainer_key is None:
        config.trainer_key = os.environ.get("ROLLBOOK_TRAINER_KEY")
    setup_logging(args.log_level)
    write_resolved(config, config.run_dir)
    from rollbook.trainer.main import train

    train(config)
    return 0


def _rollout(args: argparse.Namespace, overrides: list[str]) -> int:
    from rollbook.config import load_config
    from rollbook.logs import setup_logging
    from rollbook.rollout.standalone import WorkerConfig

    config = load_config(WorkerConfig, args.config, overrides)
    setup_logging(args.log_level)
    from rollbook.rollout.standalone import run_worker

    run_worker(config)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollbook", description="A durable, queryable trajectory store for RL on language models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("serve", help="run the trajectory store (gRPC) on a DuckDB file")
    p.add_argument("--db", default="runs/default/rollbook.duckdb", help="DuckDB ledger file (default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s); non-loopback needs all four keys and TLS")
    p.add_argument("--port", type=int, default=50551, help="port, 0 = any free one, printed as 'listening on HOST:PORT' (default: %(default)s)")
    p.add_argument("--worker-key", default=None, help="Submit/SetReward key (default: env ROLLBOOK_WORKER_KEY; prefer the env: flags show in ps)")
    p.add_argument("--trainer-key", default=None, help="PullBatch/AckBatch/PublishVersion/ReportTrainStep key (default: env ROLLBOOK_TRAINER_KEY)")
    p.add_argument("--reader-key", default=None, help="Query/GetStats key (default: env ROLLBOOK_READER_KEY)")
    p.add_argument("--admin-key", default=None, help="key for every RPC incl. RegisterModel (default: env ROLLBOOK_ADMIN_KEY)")
    p.add_argument("--tls-cert", default=None, help="PEM server certificate: serve TLS (default: env ROLLBOOK_TLS_CERT)")
    p.add_argument("--tls-key", default=None, help="PEM key of --tls-cert (default: env ROLLBOOK_TLS_KEY)")
    p.add_argument("--tls-client-ca", default=None, help="PEM CA of client certificates: require one (mutual TLS; env ROLLBOOK_TLS_CLIENT_CA)")
    p.add_argument("--insecure", action="store_true", help="allow a non-loopback --host without TLS (keys cross the network in clear text)")
    p.add_argument("--stream-idle-timeout", type=float, default=None, help="close a Submit stream idle this many seconds (default: 120)")
    p.add_argument("--max-submit-streams-per-host", type=int, default=None, help="open Submit streams one client host may hold (default: 256)")
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=_serve)

    p = sub.add_parser("query", help="run read-only SQL through the server, or on the file when the server is down")
    p.add_argument("sql", help="one read-only statement (SELECT/WITH/DESCRIBE/SHOW/SUMMARIZE/EXPLAIN)")
    p.add_argument("--server", default=None, help=f"store address HOST:PORT (default: env ROLLBOOK_SERVER, else {DEFAULT_SERVER} when --db is not given)")
    p.add_argument("--db", default=None, help="DuckDB file to open read-only when the server is not reachable")
    p.add_argument("--format", choices=["table", "csv", "json", "parquet"], default="table", help="output format (default: %(default)s)")
    p.add_argument("--output", "-o", default=None, help="write to this file instead of stdout (required for parquet on a terminal)")
    p.add_argument("--max-rows", type=int, default=0, help="row cap (0 = server default, 100000)")
    p.add_argument("--timeout", type=float, default=0.0, help="query timeout in seconds (0 = server default, 30)")
    _client_flags(p)
    p.set_defaults(func=_query)

    p = sub.add_parser("stats", help="print the store's counters as JSON")
    p.add_argument("--server", default=os.environ.get("ROLLBOOK_SERVER", DEFAULT_SERVER))
    _client_flags(p)
    p.set_defaults(func=_stats)

    p = sub.add_parser("run", help="the whole loop on one machine: store + rollout + trainer on RUN_DIR/rollbook.duckdb",
                       description="Run store, rollout and trainer on one machine. Any config field can be overridden "
                       "with a dotted flag, e.g. --num_steps 10 --trainer.lr 1e-3 --rollout.group_size 4.")
    p.add_argument("--config", default=None, help="TOML run config (see configs/); defaults apply without one")
    p.add_argument("--log-level", default="WARNING")
    p.set_defaults(func=_run, takes_overrides=True)

    p = sub.add_parser("train", help="run the trainer against a store: pull, update, checkpoint, ack, publish",
                       description="Train on validated batches from a running store. Dotted overrides set any "
                       "TrainerConfig field, e.g. --server 127.0.0.1:50551 --num_steps 20 --loss.eps_clip 0.1.")
    p.add_argument("--config", default=None, help="TOML trainer config; defaults apply without one")
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=_train, takes_overrides=True)

    p = sub.add_parser("rollout", help="run a rollout worker: weights from a channel, generation, spooled submission",
                       description="Run a rollout worker against a store. Dotted overrides set any WorkerConfig field, "
                       "e.g. --server 127.0.0.1:50551 --weights shm:NAME --rollout.group_size 4.")
    p.add_argument("--config", default=None, help="TOML or JSON worker config")
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=_rollout, takes_overrides=True)

    p = sub.add_parser("demo", help="start a store in a run directory, feed it a generated workload, print SQL answers")
    p.add_argument("--run-dir", default="runs/demo", help="run directory; the ledger is RUN_DIR/rollbook.duckdb (default: %(default)s)")
    p.add_argument("--num-trajectories", type=int, default=2000, help="how many trajectories to generate (default: %(default)s)")
    p.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "takes_overrides", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args, extra) if getattr(args, "takes_overrides", False) else args.func(args)
    except KeyboardInterrupt:
        return 130
    except ValueError as exc:  # user-facing configuration errors, one line each
        print(f"rollbook {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return 2


def _one_line(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)  # a pydantic ValidationError: its messages, not its report
    if callable(errors):
        try:
            return "; ".join(str(e.get("msg", "")).removeprefix("Value error, ") for e in errors())
        except Exception:  # noqa: BLE001 - fall back to the plain text
            pass
    return " ".join(str(exc).split())


if __name__ == "__main__":
    sys.exit(main())
