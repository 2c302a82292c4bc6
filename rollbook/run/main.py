"""``rollbook run``: the whole loop on one machine — store, rollout, trainer — on an embedded DuckDB
file in a run directory.

    rollbook run --config configs/quickstart.toml [--num_steps 30 --trainer.lr 1e-3 ...]

1. starts ``rollbook serve`` on ``RUN_DIR/rollbook.duckdb`` (a real gRPC store process);
2. registers the model and warm-starts a tiny student (and, for MOPD, a better teacher);
3. ``colocated``: alternates rollout (the native engine samples task groups, verifiers reward them,
   the batch is submitted) and training (pull the validated batch, decoupled PPO / MOPD, checkpoint,
   ack, publish the next version to the engine) in this process.
   ``separated``: a ``rollbook rollout`` worker process generates asynchronously under the staleness
   gate and receives weights over shared memory, while this process trains;
4. evaluates greedy held-out reward every ``eval_every`` steps, writes ``metrics.jsonl`` and prints
   SQL answers about the run;
5. writes the run report (``rollbook report``, rollbook/cli/report.py): report.md, PNG plots, summary.json.
Kill it and run the same command again: the trainer resumes from its checkpoint. A run directory
already past ``num_steps`` is refused in one line (and its config.json left as it is). The ``[store]``
section reaches the store process as RUN_DIR/store.json (``rollbook serve --config``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pathlib
import secrets
import signal
import sys
import threading

from rollbook import environment as rollbook_env
from rollbook.config import RunConfig, write_resolved
from rollbook.errors import CommandError
from rollbook.run.driving import steps_done
from rollbook.run.inputs import check_inputs
from rollbook.run.store_process import StoreProcess

log = logging.getLogger("rollbook.run")

SUMMARY_SQL = [
    (
        "Reward and staleness per trainer step (train_steps)",
        "SELECT step, version, round((stats->>'$.\"reward/mean\"')::DOUBLE, 3) AS reward, "
        "round((stats->>'$.\"loss/total\"')::DOUBLE, 4) AS loss, stats->>'$.\"batch/staleness_max\"' AS max_staleness "
        "FROM train_steps ORDER BY step DESC LIMIT 5",
    ),
    (
        "Which trajectories trained the last step, under which versions, with what rewards",
        "SELECT l.step, t.domain, t.output_versions, t.original_reward, round(t.reward, 3) AS normalized "
        "FROM leases l JOIN trajectories t USING (trajectory_id) "
        "WHERE l.acked_at IS NOT NULL AND l.step = (SELECT max(step) FROM leases WHERE acked_at IS NOT NULL) LIMIT 5",
    ),
    ("Evidence that will never train, by reason", "SELECT reason, count(*) AS n FROM rejections GROUP BY reason ORDER BY n DESC"),
]


def run(config: RunConfig) -> dict:
    import torch

    run_dir = pathlib.Path(config.run_dir)
    done = steps_done(run_dir)
    if done > config.num_steps:
        raise CommandError(
            f"{run_dir} is already past step {config.num_steps}: its checkpoint holds {done} steps "
            f"(train_steps rows 0..{done - 1}); ask for --num_steps above {done} to train on, or "
            "use a new --run_dir"
        )
    if done == config.num_steps:
        print(f"{run_dir} has already finished its {done} steps: nothing to train (raise --num_steps to go on)", flush=True)
    vocab = check_inputs(config)  # before the store starts: a missing file is one line, and no ledger is made
    if config.replay is not None:  # its ledger is seeded from the source's rows before its store opens it
        from rollbook.run.from_ledger import prepare_ledger

        prepare_ledger(config, vocab)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    write_resolved(config, run_dir)
    keys = _run_keys(run_dir)
    _exit_on_sigterm()
    with contextlib.ExitStack() as stack:
        store = _start_store(config, run_dir, keys, stack)
        try:
            summary = _run_with_store(config, store, keys)
        finally:
            store.stop()
    _report(run_dir)
    return summary


def _start_store(config: RunConfig, run_dir: pathlib.Path, keys: dict, stack: contextlib.ExitStack):
    """The run's store: a child process here, or, with ``ray.store_resources`` under the ray placement,
    under a Ray actor on the node those resources name. Under the ray placement Ray is started (or
    joined) first, on ``stack``: a placement the cluster cannot hold is refused before any store starts."""
    db, store_config = run_dir / "rollbook.duckdb", write_store_config(config, run_dir)
    if config.placement == "ray" and config.online is None:
        from rollbook.run.ray_cluster import ray_session

        stack.enter_context(ray_session(config))
    if config.placement == "ray" and config.online is None and config.ray.store_resources:
        from rollbook.run.ray_cluster import RayStore

        on_ray = RayStore(config, db.resolve(), keys, store_config.resolve())
        print(f"store: {on_ray.address} on Ray node {on_ray.node_id}, ledger {db} on that node", flush=True)
        return on_ray
    store = StoreProcess(db, **keys, config_file=store_config)
    print(f"store: {store.address}, ledger {db}", flush=True)
    return store


def _run_with_store(config: RunConfig, store, keys: dict) -> dict:
    """Register the model, run the placement against ``store``, print the summary's SQL answers."""
    from rollbook.client import StoreClient
    from rollbook.rollout.worker import use_model_stops

    client = StoreClient.from_env(store.address, **keys)
    client.register_model(config.trainer.model_id, vocab_size=_vocab_size(config))
    use_model_stops(config.rollout, config.trainer.model)  # the model's own eos ids end completions too
    if config.online is not None:  # learn from an agent through rollbook proxy (docs/online.md)
        from rollbook.run.online import run_online

        summary = run_online(config, client, store.address, keys)
    elif config.replay is not None:  # train from a finished run's ledger (docs/replay.md)
        from rollbook.run.from_ledger import run_from_ledger

        summary = run_from_ledger(config, client)
    elif config.placement == "colocated":
        from rollbook.run.colocated import run_colocated

        summary = run_colocated(config, client)
    elif config.placement == "ray":
        from rollbook.run.ray_cluster import run_ray

        summary = run_ray(config, store.address, keys)
        summary["store_node_id"] = getattr(store, "node_id", None)  # None: beside the driver
    else:
        from rollbook.run.separated import run_separated

        summary = run_separated(config, client, store.address, keys)
    _print_sql(client)
    client.close()
    return summary


def _exit_on_sigterm() -> None:
    """SIGTERM (``kill PID``, a scheduler's cancel) becomes ``SystemExit(143)``, as Ctrl-C becomes
    KeyboardInterrupt: the ``finally`` blocks run and stop the store, the rollout process and the
    proxy this run started. Python's default would end the process at once and leave them orphaned,
    holding the ledger and its port."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def _vocab_size(config: RunConfig) -> int:
    """The vocabulary the store checks token ids against: the model's (``rollbook.language_models.student_vocab_size``
    through rollout/worker.py ``registered_vocab_size``). A tiny model for a dataset's own tokenizer takes
    that tokenizer's size."""
    from rollbook.rollout.worker import registered_vocab_size, use_model_tokenizer

    use_model_tokenizer(config.rollout, config.trainer.model)  # a dataset without its own tokenizer: the model's
    vocab = registered_vocab_size(config.rollout, config.trainer.model)
    model = config.trainer.model
    if config.rollout.dataset is not None and model.path is None and model.vocab_size is None:
        model.vocab_size = vocab
    return vocab


def _report(run_dir: pathlib.Path) -> None:
    """report.md, the plots and summary.json (rollbook/cli/report.py); a failed report costs no training."""
    try:
        from rollbook.cli.report import write_report

        write_report([run_dir])
    except Exception as exc:  # the run's evidence and checkpoints are already safe
        print(
            f"report: not written ({type(exc).__name__}: {exc}); retry with `rollbook report {run_dir}`",
            file=sys.stderr,
            flush=True,
        )


def write_store_config(config: RunConfig, run_dir: pathlib.Path) -> pathlib.Path:
    """The ``[store]`` section as RUN_DIR/store.json, for ``rollbook serve --config`` (no key, db,
    host or port in it: the run gives those)."""
    path = run_dir / "store.json"
    path.write_text(json.dumps(config.store.model_dump(mode="json", exclude={"db", "host", "port"}), indent=2) + "\n")
    return path


def _run_keys(run_dir: pathlib.Path) -> dict:
    """Per-run keys of the four roles, kept in RUN_DIR/keys.json (mode 0600, never in config.json) so
    a restart reuses them; ``ROLLBOOK_<ROLE>_KEY`` in the environment overrides them."""
    path = run_dir / "keys.json"
    keys = json.loads(path.read_text()) if path.exists() else {}
    missing = [f"{role}_key" for role in ("worker", "trainer", "reader", "admin") if f"{role}_key" not in keys]
    if missing:  # a keys.json of an older run held only admin and trainer keys
        keys.update({name: secrets.token_hex(16) for name in missing})
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(keys))
        path.chmod(0o600)
    from_env = rollbook_env.keys()
    return {name: from_env.get(name) or key for name, key in keys.items()}


def _print_sql(client) -> None:
    from rollbook.cli.query import format_table

    for title, sql in SUMMARY_SQL:
        print(f"\n== {title}\n   {sql}\n", flush=True)
        print(format_table(client.query(sql)), flush=True)
