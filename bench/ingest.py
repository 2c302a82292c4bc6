"""Ingest throughput: Rollbook's durable ``Submit`` path against a Ray queue and an fsync'd Arrow log.

Every system gets the same records, 1,000-output-token trajectories (plus a 128-token prompt),
sent in batches of 64 from N separate client processes (default 2), and is reported in output
tokens per second:

- ``rollbook_tok_s``: validated, durable, acknowledged tokens through a real ``rollbook serve``
  subprocess (port 0, fresh DuckDB file in a temporary run dir, model registered and versions
  published first). Clients use ``StoreClient.submit``; every verdict must be ``ACCEPTED`` and the
  store's counters must hold every token, or the run fails.
- ``rollbook_novalidate_tok_s``: the same with the evidence rules off (the server runs with
  ``ROLLBOOK_BENCH_NOVALIDATE=1``). A probe with a NaN log-prob is sent afterwards: if the store
  still rejects it, the store has no such switch and the field is ``null``.
- ``arrow_ipc_fsync_tok_s``: the same records, already converted to Arrow batches in the store's
  schema, each process appending to its own IPC stream file with an fsync per batch: the practical
  ceiling of a durable append (no network, no decode, no validation).
- ``ray_queue_tok_s``: the same records as dicts of numpy arrays, one ``put`` per batch, through one
  ``ray.util.queue.Queue`` from N producer actors to one consumer actor that drains it: what peers
  use; in memory, not durable.
- ``rollbook_over_ray`` (target >= 1.5), ``rollbook_over_ceiling``, ``validation_cost``
  (``1 - rollbook / novalidate``).
- ``pull_tok_s``: after the validated run, every stored row leased through ``PullBatch`` (whole
  groups, 512 samples a batch, normalized, acked), beside ``duckdb_scan_tok_s``, the same rows and
  columns read straight from the DuckDB file into Arrow once the store has stopped (the raw limit),
  and ``pull_over_scan``: medians over the validated rounds (the ratio is each round's pull over
  its own scan; ``pull_over_scan_all`` lists them).

Timing runs from the moment every client has its records built and its connection open (a
barrier) to the last acknowledgement; server start, ``ray.init`` and record generation are not
timed. Runs on a loaded machine are noisy: compare the ratios, which come from the same run.

The store acknowledges after its fsync'd log append and folds the log into DuckDB in the background
(every 256 MiB, after 10 s, or when ingest pauses), so a default run (6,000 trajectories, ~80 MB)
measures the acknowledgement path. With ``--num-trajectories 30000`` folds happen during the run
and compete for the same cores: the sustained rate.

    python bench/ingest.py --json                      # one JSON line on stdout, progress on stderr
    python bench/ingest.py --num-trajectories 6000 --num-processes 4 --systems rollbook,ray_queue
    python bench/ingest.py --profile runs/profile      # also py-spy the server (collapsed stacks)
    python bench/ingest.py --json --secure             # also rollbook with all four role keys and TLS
    python bench/ingest.py --json --governed --systems rollbook   # also rollbook with tenants and ingest-time rules

``--secure`` adds ``rollbook_secure_tok_s``: the validated rollbook run again, measured in the same
rounds, against a store with all four role keys and a TLS certificate (a throwaway CA made with
``openssl``; the clients send the worker key over TLS), and ``security_cost``
(``1 - rollbook_secure / rollbook``).

``--governed`` adds ``rollbook_governed_tok_s``: the validated run again, in the same rounds, against
a store with a key file (the clients send a worker key bound to a tenant and the model: every row is
checked against the key's models and stamped with its tenant) and a policy on the model that allows
that tenant and requires consent (the ingest rules check every row's tenant and its
``metadata['consent']``, which each row carries), and ``governance_cost``
(``1 - rollbook_governed / rollbook``; docs/governance.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import multiprocessing as mp
import os
import pathlib
import queue
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from rollbook.v1 import rollbook_pb2 as pb

SYSTEMS = ("rollbook", "rollbook_novalidate", "arrow_ipc_fsync", "ray_queue")
PULL_SAMPLES: dict[str, list[float]] = {"pull": [], "scan": [], "ratio": []}  # one each per validated round
MODEL_ID = "bench-model"
VOCAB_SIZE = 151_936
VERSIONS = (0, 1, 2, 3)
NUM_PROMPT_TOKENS = 128
GROUP_SIZE = 8
BARRIER_TIMEOUT_S = 300.0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        raise SystemExit(f"unknown system(s) {unknown}; choose from {','.join(SYSTEMS)}")
    if min(args.num_processes, args.batch_size, args.num_tokens, args.repeats) < 1:
        raise SystemExit("--num-processes, --batch-size, --num-tokens and --repeats must be >= 1")
    if args.num_trajectories < args.num_processes:
        raise SystemExit("--num-trajectories must be >= --num-processes")
    counts = split(args.num_trajectories, args.num_processes)
    run = secrets.token_hex(4)
    _progress(
        f"ingest bench {run}: {args.num_trajectories} x {args.num_tokens} tokens, "
        f"{args.num_processes} processes, batches of {args.batch_size}, {os.cpu_count()} cpus"
    )
    # one measurement of each system in turn, `repeats` rounds, so that a slow spell of the machine
    # hits every system alike (Ray runs its repeats last, inside one ray.init)
    measure: dict[str, Callable[[], float | None]] = {
        "rollbook": lambda: run_rollbook(args, counts, run, validate=True),
        "rollbook_novalidate": lambda: run_rollbook(args, counts, run, validate=False),
        "rollbook_secure": lambda: run_rollbook(args, counts, run, validate=True, secure=True),
        "rollbook_governed": lambda: run_rollbook(args, counts, run, validate=True, governed=True),
        "arrow_ipc_fsync": lambda: run_arrow_ipc(args, counts, run),
    }
    samples: dict[str, list[float] | None] = {name: [] if name in systems else None for name in SYSTEMS}
    if args.secure:
        samples["rollbook_secure"] = []
    if args.governed:
        samples["rollbook_governed"] = []
    for _ in range(args.repeats):
        for name, once in measure.items():
            if samples.get(name) is not None:
                value = once()
                samples[name] = None if value is None else samples[name] + [value]
    if "ray_queue" in systems:
        samples["ray_queue"] = run_ray_queue(args, counts, run)  # last: Ray leaves processes behind for a while
    tok_s = {name: float(np.median(v)) if v else None for name, v in samples.items()}
    report = summarize(tok_s, args)
    if "rollbook" in systems:
        report.update(pull_report())
    if args.json:
        print(json.dumps(report), flush=True)
    else:
        print(json.dumps(report, indent=2))
    return 0


def summarize(tok_s: dict[str, float | None], args: argparse.Namespace) -> dict[str, Any]:
    """The flat JSON report: tokens/s per system, then the ratios (null where a side is missing)."""

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a and b else None

    rb, nv = tok_s["rollbook"], tok_s["rollbook_novalidate"]
    secure = (
        {"security_cost": round(1 - tok_s["rollbook_secure"] / rb, 3) if rb and tok_s["rollbook_secure"] else None}
        if "rollbook_secure" in tok_s
        else {}
    )
    governed = (
        {"governance_cost": round(1 - tok_s["rollbook_governed"] / rb, 3) if rb and tok_s["rollbook_governed"] else None}
        if "rollbook_governed" in tok_s
        else {}
    )
    return {
        **{f"{name}_tok_s": round(v) if v is not None else None for name, v in tok_s.items()},
        **secure,
        **governed,
        "rollbook_over_ray": ratio(rb, tok_s["ray_queue"]),
        "rollbook_over_ceiling": ratio(rb, tok_s["arrow_ipc_fsync"]),
        "validation_cost": round(1 - rb / nv, 3) if rb and nv else None,
        "num_trajectories": args.num_trajectories,
        "num_output_tokens": args.num_tokens,
        "num_processes": args.num_processes,
        "batch_size": args.batch_size,
        "repeats": args.repeats,
        "num_cpus": os.cpu_count(),
    }


def pull_report() -> dict[str, Any]:
    """Medians over the validated rounds: the pull, the scan of the same file, and the per-round ratio."""
    if not PULL_SAMPLES["ratio"]:
        return {}
    return {
        "pull_tok_s": round(float(np.median(PULL_SAMPLES["pull"]))),
        "duckdb_scan_tok_s": round(float(np.median(PULL_SAMPLES["scan"]))),
        "pull_over_scan": round(float(np.median(PULL_SAMPLES["ratio"])), 3),
        "pull_over_scan_all": [round(r, 3) for r in PULL_SAMPLES["ratio"]],
    }


def split(total: int, parts: int) -> list[int]:
    return [total // parts + (i < total % parts) for i in range(parts)]


def make_trajectories(num: int, num_tokens: int, *, worker: int, run: str, consent: bool = False) -> list[pb.Trajectory]:
    """Valid evidence: in-vocabulary tokens, finite negative log-probs, one version switch mid-sequence
    between published versions, sampling parameters and a reward (``consent``: and metadata
    ``{"consent": "true"}``)."""
    rng = np.random.default_rng(worker)
    prompts = rng.integers(0, VOCAB_SIZE, (num, NUM_PROMPT_TOKENS), dtype=np.int32)
    tokens = rng.integers(0, VOCAB_SIZE, (num, num_tokens), dtype=np.int32)
    logprobs = (-rng.exponential(1.0, (num, num_tokens))).astype(np.float32)
    first = rng.integers(VERSIONS[0], VERSIONS[-1], num)
    switch = rng.integers(0, num_tokens, num)
    versions = first[:, None] + (np.arange(num_tokens)[None, :] >= switch[:, None])
    rewards = (rng.random(num) < 0.5).astype(float)
    return [
        pb.Trajectory(
            trajectory_id=f"{run}-w{worker}-{i}",
            session_id=f"{run}-w{worker}-s{i}",
            group_id=f"{run}-w{worker}-g{i // GROUP_SIZE}",
            group_size=min(GROUP_SIZE, num - i // GROUP_SIZE * GROUP_SIZE),  # the last group may be short
            request_id=f"{run}-w{worker}-r{i}",
            consumed=True,
            task_id=f"task-{i // GROUP_SIZE}",
            domain="math",
            model_id=MODEL_ID,
            prompt_token_ids=prompts[i].tolist(),
            output_token_ids=tokens[i].tolist(),
            output_logprobs=logprobs[i].tolist(),
            output_versions=versions[i].tolist(),
            temperature=1.0,
            top_p=1.0,
            finish_reason="length",
            reward=rewards[i],
            worker_id=f"worker-{worker}",
            created_at=time.time(),
            metadata={"consent": "true"} if consent else None,
        )
        for i in range(num)
    ]


# ---- rollbook ------------------------------------------------------------------------------------


def run_rollbook(
    args: argparse.Namespace, counts: list[int], run: str, *, validate: bool, secure: bool = False, governed: bool = False
) -> float | None:
    """Tokens/s through ``rollbook serve``; None when asked not to validate and the store validates anyway.
    ``secure``: all four role keys and TLS (the clients send the worker key and check the certificate).
    ``governed``: a tenant-bound worker key and a consent policy on the model (rows carry consent)."""
    label = (
        "rollbook_secure" if secure else "rollbook_governed" if governed else "rollbook" if validate else "rollbook_novalidate"
    )
    with running_store(args.work_dir, label, novalidate=not validate, secure=secure, governed=governed) as (
        server,
        address,
        client,
    ):
        profiler = _py_spy(server.pid, args.profile, label) if args.profile else None
        server_cpu = _cpu_seconds(server.pid)
        try:
            access = (client.worker_key, client.tls.ca if secure else None, governed) if secure or governed else None
            seconds, client_cpu = run_clients(_rollbook_client, counts, (address, args.num_tokens, run, args.batch_size, access))
        finally:
            _stop_py_spy(profiler)
        server_cpu = _cpu_seconds(server.pid) - server_cpu
        tokens = sum(counts) * args.num_tokens
        stats = client.stats()
        if stats.accepted != sum(counts) or stats.accepted_tokens != tokens:
            raise RuntimeError(
                f"{label}: store holds {stats.accepted} trajectories / {stats.accepted_tokens} tokens, "
                f"expected {sum(counts)} / {tokens}"
            )
        _progress(f"{label}: counters checked")
        if governed:
            held = client.stats().stats_json
            if json.loads(held).get("held"):
                raise RuntimeError(f"{label}: the ingest rules held rows that carry consent")
        if validate and not secure and not governed:
            PULL_SAMPLES["pull"].append(measure_pull(client, tokens))
        if _probe_validates(client, run) != validate:
            if validate:
                raise RuntimeError("the store accepted a NaN log-prob in the validated run")
            _progress(
                f"{label}: not measured, the store ignores ROLLBOOK_BENCH_NOVALIDATE (a NaN log-prob was "
                "still REJECTED); reporting null"
            )
            return None
    return _report(label, tokens, seconds, f"CPU s: server {server_cpu:.2f}, clients {client_cpu:.2f}")


@contextlib.contextmanager
def running_store(
    work_dir: str | None, label: str, *, novalidate: bool, secure: bool = False, governed: bool = False
) -> Iterator[tuple[subprocess.Popen, str, Any]]:
    """A ``rollbook serve`` on a fresh DuckDB file with the bench model registered and its versions
    published; yields the process, its address and a ``StoreClient`` holding every key. ``secure``:
    all four role keys and TLS with a throwaway CA (otherwise the admin and trainer keys only)."""
    from rollbook.client import StoreClient
    from rollbook.tls import make_test_certificates

    roles = ("worker", "trainer", "reader", "admin") if secure else ("trainer", "admin")
    keys = {f"{role}_key": secrets.token_hex(16) for role in roles}
    env = {
        k: v
        for k, v in os.environ.items()
        if k != "ROLLBOOK_BENCH_NOVALIDATE"
        and not k.startswith("ROLLBOOK_TLS_")
        and not (k.startswith("ROLLBOOK_") and k.endswith("_KEY"))
    }
    env.update({f"ROLLBOOK_{name.upper()}": key for name, key in keys.items()})
    if novalidate:
        env["ROLLBOOK_BENCH_NOVALIDATE"] = "1"
    with tempfile.TemporaryDirectory(prefix=f"{label}-", dir=work_dir) as tmp:
        tls = None
        worker_key = None
        if governed:  # a key file: the clients' worker key, bound to a tenant and the bench model
            worker_key = secrets.token_hex(16)
            key_file = pathlib.Path(tmp) / "keys.toml"
            key_file.write_text(
                f'[[keys]]\nname = "bench-worker"\nrole = "worker"\ntenant = "bench"\nmodels = ["{MODEL_ID}"]\n'
                f'key = "{worker_key}"\n'
            )
            key_file.chmod(0o600)
            env["ROLLBOOK_KEYS_FILE"] = str(key_file)
        if secure:
            certs = make_test_certificates(pathlib.Path(tmp) / "certs")
            env.update(ROLLBOOK_TLS_CERT=certs.server_cert, ROLLBOOK_TLS_KEY=certs.server_key)
            tls = certs.client()
        server, address = start_store(pathlib.Path(tmp) / "rollbook.duckdb", env)
        _progress(f"{label}: store up at {address}" + (" (TLS, four role keys)" if secure else ""))
        try:
            with StoreClient(address, tls=tls, **keys) as client:
                client.register_model(MODEL_ID, vocab_size=VOCAB_SIZE)
                for v in VERSIONS:
                    client.publish_version(MODEL_ID, v, checksum=f"bench-{v}")
                if governed:
                    client.govern("policy", model_id=MODEL_ID, tenants=["bench"], require_consent=True)
                    client.worker_key = worker_key
                yield server, address, client
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=120)
            _progress(f"{label}: store stopped")
        if not novalidate and not secure and not governed and server.returncode == 0:  # the run whose pull was measured
            scan = measure_duckdb_scan(pathlib.Path(tmp) / "rollbook.duckdb")
            PULL_SAMPLES["scan"].append(scan)
            PULL_SAMPLES["ratio"].append(PULL_SAMPLES["pull"][-1] / scan)


def start_store(db: pathlib.Path, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollbook.cli", "serve", "--db", str(db), "--port", "0", "--log-level", "WARNING"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    line = proc.stdout.readline().strip()
    if not line.startswith("listening on "):
        proc.kill()
        raise RuntimeError(f"store did not start: {line!r}")
    return proc, line.removeprefix("listening on ")


def _rollbook_client(
    worker: int,
    num: int,
    address: str,
    num_tokens: int,
    run: str,
    batch_size: int,
    access: tuple[str, str | None, bool] | None,
    barrier,
    results,
) -> None:
    import grpc

    from rollbook.client import StoreClient
    from rollbook.tls import ClientTLS

    worker_key, ca, governed = access or (None, None, False)
    msgs = make_trajectories(num, num_tokens, worker=worker, run=run, consent=governed)
    with StoreClient(address, worker_key=worker_key, tls=ClientTLS(ca) if ca else None) as client:
        grpc.channel_ready_future(client.channel).result(timeout=30)
        barrier.wait(BARRIER_TIMEOUT_S)
        t0, cpu = time.time(), time.process_time()
        result = client.submit(msgs, batch_size=batch_size)
        t1, cpu = time.time(), time.process_time() - cpu
    if result.accepted != num or len(result.verdicts) != num:
        raise RuntimeError(
            f"worker {worker}: {result.accepted}/{num} ACCEPTED, {result.duplicates} duplicates, "
            f"rejected by reason {result.rejected_by_reason()}"
        )
    results.put((t0, t1, cpu))


def measure_pull(client, tokens: int) -> float:
    """Lease every stored row through ``PullBatch`` (whole groups, 512 samples a batch) and ack it:
    validated, normalized, leased tokens per second."""
    t0, pulled, step = time.perf_counter(), 0, 0
    while True:
        batch = client.pull_batch(
            trainer_id="bench",
            trainer_version=VERSIONS[-1],
            max_staleness=len(VERSIONS),
            num_samples=512,
            step=step,
            model_id=MODEL_ID,
        )
        if batch.num_rows == 0:
            break
        pulled += int(pa_list_lengths(batch.table.column("output_token_ids")))
        client.ack_batch(batch.lease_id, "bench")
        step += 1
    seconds = time.perf_counter() - t0
    if pulled != tokens:
        raise RuntimeError(f"pulled {pulled} tokens, stored {tokens}")
    return _report("pull", pulled, seconds, f"{step} batches")


def pa_list_lengths(column) -> int:
    import pyarrow.compute as pc

    return pc.sum(pc.list_value_length(column)).as_py() or 0


def measure_duckdb_scan(db: pathlib.Path) -> float:
    """The same rows and columns read straight from the DuckDB file into Arrow: the raw limit."""
    import duckdb

    con = duckdb.connect(str(db), read_only=True)
    t0 = time.perf_counter()
    table = con.sql(
        "SELECT trajectory_id, group_id, domain, prompt_token_ids, output_token_ids, output_logprobs, "
        "output_versions, original_reward, reward FROM trajectories"
    ).to_arrow_table()
    seconds = time.perf_counter() - t0
    con.close()
    return _report("duckdb_scan", int(pa_list_lengths(table.column("output_token_ids"))), seconds)


def _probe_validates(client, run: str) -> bool:
    """Does the store run the evidence rules? A NaN log-prob is REJECTED if it does."""
    probe = make_trajectories(1, 4, worker=10_000, run=f"{run}-probe")[0]
    probe.output_logprobs[0] = float("nan")
    verdict = client.submit([probe]).verdicts[probe.trajectory_id]
    return verdict.status == pb.Verdict.REJECTED


# ---- baselines -----------------------------------------------------------------------------------


def run_arrow_ipc(args: argparse.Namespace, counts: list[int], run: str) -> float:
    with tempfile.TemporaryDirectory(prefix="arrow-ipc-", dir=args.work_dir) as tmp:
        seconds, cpu = run_clients(_arrow_client, counts, (tmp, args.num_tokens, run, args.batch_size))
    return _report("arrow_ipc_fsync", sum(counts) * args.num_tokens, seconds, f"CPU s: writers {cpu:.2f}")


def _arrow_client(worker: int, num: int, directory: str, num_tokens: int, run: str, batch_size: int, barrier, results) -> None:
    import pyarrow as pa

    from rollbook.store.schema import TRAJECTORY_SCHEMA
    from rollbook.store.tables import trajectories_table
    from rollbook.trajectories import decode_messages

    msgs = make_trajectories(num, num_tokens, worker=worker, run=run)
    now = time.time()
    batches = [
        trajectories_table(decode_messages(msgs[i : i + batch_size]), now).combine_chunks().to_batches()[0]
        for i in range(0, num, batch_size)
    ]
    with open(pathlib.Path(directory) / f"worker-{worker}.arrow", "wb") as f:
        writer = pa.ipc.new_stream(f, TRAJECTORY_SCHEMA)
        barrier.wait(BARRIER_TIMEOUT_S)
        t0, cpu = time.time(), time.process_time()
        for batch in batches:
            writer.write_batch(batch)
            f.flush()
            os.fsync(f.fileno())
        t1, cpu = time.time(), time.process_time() - cpu
        writer.close()
    results.put((t0, t1, cpu))


def run_ray_queue(args: argparse.Namespace, counts: list[int], run: str) -> list[float]:
    import ray
    from ray.util.queue import Queue

    _progress("ray_queue: ray.init (not timed)")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    try:
        q = Queue(maxsize=4 * len(counts), actor_options={"num_cpus": 0})
        producers = [
            ray.remote(num_cpus=0)(_RayProducer).remote(w, n, args.num_tokens, run, args.batch_size) for w, n in enumerate(counts)
        ]
        consumer = ray.remote(num_cpus=0)(_RayConsumer).remote()
        ray.get([p.ready.remote() for p in producers] + [consumer.ready.remote()])
        q.size()  # the queue actor is up
        num_batches = sum(-(-n // args.batch_size) for n in counts)
        out = []
        for _ in range(args.repeats):
            t0 = time.time()
            drained = consumer.drain.remote(q, num_batches)
            ray.get([p.produce.remote(q) for p in producers])
            t1, tokens = ray.get(drained)
            if tokens != sum(counts) * args.num_tokens:
                raise RuntimeError(f"ray_queue: drained {tokens} tokens, expected {sum(counts) * args.num_tokens}")
            out.append(_report("ray_queue", tokens, t1 - t0))
    finally:
        ray.shutdown()
    return out


class _RayProducer:
    """Holds its records as dicts of numpy arrays (built before timing); puts one list per batch."""

    def __init__(self, worker: int, num: int, num_tokens: int, run: str, batch_size: int):
        records = [_as_record(m) for m in make_trajectories(num, num_tokens, worker=worker, run=run)]
        self.batches = [records[i : i + batch_size] for i in range(0, num, batch_size)]

    def ready(self) -> bool:
        return True

    def produce(self, q) -> None:
        for batch in self.batches:
            q.put(batch)


class _RayConsumer:
    def ready(self) -> bool:
        return True

    def drain(self, q, num_batches: int) -> tuple[float, int]:
        tokens = 0
        for _ in range(num_batches):
            tokens += sum(len(r["output_token_ids"]) for r in q.get())
        return time.time(), tokens


def _as_record(msg: pb.Trajectory) -> dict[str, Any]:
    dtypes = {
        "prompt_token_ids": np.int32,
        "output_token_ids": np.int32,
        "output_logprobs": np.float32,
        "output_versions": np.int64,
    }
    record: dict[str, Any] = {}
    for f in msg.DESCRIPTOR.fields:
        value = getattr(msg, f.name)
        if f.name in dtypes:
            value = np.asarray(value, dtype=dtypes[f.name])
        elif f.message_type is not None and f.message_type.GetOptions().map_entry:
            value = dict(value)  # a protobuf map (metadata) does not pickle
        record[f.name] = value
    return record


# ---- processes, profiling, output ----------------------------------------------------------------


def run_clients(target: Callable, counts: list[int], extra: tuple) -> tuple[float, float]:
    """Start one spawned process per count, release them together once all are ready, and return the
    seconds from the first start to the last finish and the CPU seconds the clients used meanwhile."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(len(counts) + 1), ctx.Queue()
    procs = [
        ctx.Process(target=_client_main, args=(target, w, n, *extra, barrier, results), daemon=True) for w, n in enumerate(counts)
    ]
    for p in procs:
        p.start()
    try:
        try:
            barrier.wait(BARRIER_TIMEOUT_S)
        except threading.BrokenBarrierError:
            raise RuntimeError("a client process failed while preparing (its traceback is above)") from None
        _progress(f"{len(procs)} client processes ready, records built: go")
        spans = []
        while len(spans) < len(procs):
            try:
                spans.append(results.get(timeout=1.0))
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(f"a client process failed (exit codes {[p.exitcode for p in procs]})") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    seconds = max(t1 for _, t1, _ in spans) - min(t0 for t0, _, _ in spans)
    return seconds, sum(cpu for _, _, cpu in spans)


def _client_main(target: Callable, *args) -> None:
    barrier = args[-2]
    try:
        target(*args)
    except BaseException:
        barrier.abort()  # the parent and the other clients stop waiting
        raise


def _py_spy(pid: int, directory: str, label: str) -> subprocess.Popen:
    """Sample the server while the clients run; collapsed stacks per thread, one line per stack."""
    out = pathlib.Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    py_spy = pathlib.Path(sys.executable).with_name("py-spy")
    return subprocess.Popen(
        [
            str(py_spy),
            "record",
            "--pid",
            str(pid),
            "--rate",
            "1000",
            "--threads",
            "--gil",
            "--format",
            "raw",
            "--output",
            str(out / f"server-{label}.txt"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _stop_py_spy(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        proc.wait(timeout=60)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc; NaN elsewhere)."""
    try:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _report(label: str, tokens: int, seconds: float, note: str = "") -> float:
    tok_s = tokens / seconds
    _progress(f"{label}: {tokens:,} tokens in {seconds:.2f} s = {tok_s / 1e6:.2f} M tok/s" + (f" ({note})" if note else ""))
    return tok_s


_T0 = time.monotonic()


def _progress(message: str) -> None:
    print(f"[{time.monotonic() - _T0:6.1f}s] {message}", file=sys.stderr, flush=True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print exactly one JSON line on stdout")
    p.add_argument(
        "--secure",
        action="store_true",
        help="also measure rollbook with all four role keys and TLS (rollbook_secure_tok_s, security_cost), in the same rounds",
    )
    p.add_argument(
        "--governed",
        action="store_true",
        help="also measure rollbook with a tenant-bound key and a consent policy on the model "
        "(rollbook_governed_tok_s, governance_cost), in the same rounds",
    )
    p.add_argument(
        "--num-trajectories",
        type=int,
        default=6000,
        help="trajectories per system, split over the processes (default: %(default)s)",
    )
    p.add_argument("--num-processes", type=int, default=2, help="client / producer processes (default: %(default)s)")
    p.add_argument(
        "--batch-size", type=int, default=64, help="trajectories per submitted batch, fsync or put (default: %(default)s)"
    )
    p.add_argument("--num-tokens", type=int, default=1000, help="output tokens per trajectory (default: %(default)s)")
    p.add_argument(
        "--repeats", type=int, default=5, help="measurements per system; the median is reported (default: %(default)s)"
    )
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of %(default)s")
    p.add_argument(
        "--work-dir",
        default=None,
        help="where the temporary run dirs go (default: the system temp dir); fsync cost depends on its disk",
    )
    p.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="py-spy the server during each rollbook run (the last repeat) into DIR/server-*.txt: "
        "collapsed stacks of the thread holding the GIL, i.e. where a GIL-bound server spends its time",
    )
    return p


if __name__ == "__main__":
    sys.exit(main())
