"""Pull latency and ingest rate against the ledger's trained history: does a store that has served a
long run answer as fast as an empty one?

    python bench/pull_history.py --json                                        # 0, 1e5 and 1e6 stored
    python bench/pull_history.py --json --histories 0 100000 1000000 10000000  # to 1e7 (about 4 GB of disk)

For each history size N it fabricates a valid ledger of N trained trajectories (``fabricate``: one
DuckDB ``INSERT ... SELECT`` from ``range(N)``, the store's own schema, 64 output tokens each by
default: groups of 8 of one model, rewarded, normalized, each row leased once and acked, as a run
leaves them; seconds per million rows). Its ids are hex digests, spread over the whole range the
fresh rows' ids fall in (as uuids are), so no query skips the history by an id's zone map. It then
starts a real ``rollbook serve`` on each file (the file synced to disk first, so its writeback does
not land on the store's fsyncs; every history's store up at once) and, ``--repeats`` rounds, each
history in turn, a different one first each round (so a stretch in which the machine is slower
slows every history's pulls alike): submits ``--batch`` fresh rewarded trajectories (whole groups,
through the client) and times the ``PullBatch`` that leases exactly them (settle, stale rules, whole
groups, normalization, the lease rows, Arrow over gRPC) and its ``AckBatch``. Then, one history
after another, the ingest rate: ``--ingest`` more fresh trajectories streamed by one client as a
worker does (batches of 64, a few in flight): ``ingest_tok_s`` until every batch is acknowledged
(validated, durable), ``ingest_folded_tok_s`` until a ``GetStats`` after them has folded the rest
into DuckDB, settled them and counted every row (the count must match).

Reported per history: ``pull_ms`` and ``ack_ms`` (medians), the two ingest rates; and across histories
``pull_ms_per_10x`` (the largest ratio of pull latency between a history and one a tenth of it, the
target <= 1.2) and ``ingest_over_empty`` / ``ingest_folded_over_empty`` (ingest at the largest
history over the empty ledger's, target >= 0.8). A benchmark, not a test: it asserts nothing about time; it fails only when a pull
does not return exactly the rows submitted.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import signal
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
KEYS = {"trainer_key": "bench-trainer", "admin_key": "bench-admin"}
_T0 = time.monotonic()


def _progress(message: str) -> None:
    print(f"[{time.monotonic() - _T0:7.1f}s] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--histories", type=int, nargs="+", default=[0, 100_000, 1_000_000], help="trained rows per ledger")
    p.add_argument("--output-tokens", type=int, default=64, help="output tokens of every trajectory")
    p.add_argument("--batch", type=int, default=512, help="trajectories per pull (whole groups of 8)")
    p.add_argument("--repeats", type=int, default=5, help="timed pulls per history (median)")
    p.add_argument("--ingest", type=int, default=32768, help="trajectories of the ingest measurement")
    p.add_argument("--work-dir", default=None, help="where the ledgers go (default: a temporary directory)")
    p.add_argument("--json", action="store_true", help="one JSON line on stdout")
    args = p.parse_args(argv)
    if args.batch % 8 or args.ingest % 64:
        p.error("--batch must be a multiple of 8 (whole groups) and --ingest of 64 (the submit batches)")
    return args


def fabricate(db: pathlib.Path, num: int, output_tokens: int, *, model_id: str, vocab_size: int, versions) -> None:
    """A ledger of ``num`` trained trajectories in ``db``: the store's DDL, the model registered, its
    versions published, and every row leased once (lease per 512 rows, one step each) and acked."""
    import duckdb

    from rollbook.store.schema import DDL

    con = duckdb.connect(str(db))
    for ddl in DDL:
        con.execute(ddl)
    now = time.time()
    con.execute("INSERT INTO models VALUES (?, ?, ?)", [model_id, vocab_size, now])
    for v in versions:
        con.execute(
            "INSERT INTO policy_versions (model_id, version, checksum, published_at) VALUES (?, ?, ?, ?)",
            [model_id, v, f"bench-{v}", now],
        )
    last = versions[-1]
    chunk = 1_000_000
    for start in range(0, num, chunk):
        stop = min(num, start + chunk)
        con.execute(
            f"""INSERT INTO trajectories BY NAME
                SELECT md5('t' || i) AS trajectory_id, md5('s' || i) AS session_id, md5('g' || (i // 8)) AS group_id,
                       8::UINTEGER AS group_size, 'turn-0' AS request_id, 0::UINTEGER AS attempt, true AS consumed,
                       'task-' || (i // 8) AS task_id, 'math' AS domain, $model AS model_id,
                       [1, 2, 3, 4]::INTEGER[] AS prompt_token_ids,
                       list_transform(range({output_tokens}), lambda x: ((x * 7 + i) % {vocab_size})::INTEGER) AS output_token_ids,
                       list_transform(range({output_tokens}), lambda x: (-0.5 - (x % 5) * 0.1)::FLOAT) AS output_logprobs,
                       list_transform(range({output_tokens}), lambda x: {last}::BIGINT) AS output_versions,
                       4 AS num_prompt_tokens, {output_tokens} AS num_output_tokens,
                       {last}::BIGINT AS min_version, {last}::BIGINT AS max_version,
                       1.0::FLOAT AS temperature, 1.0::FLOAT AS top_p, 0 AS top_k, 'length' AS finish_reason,
                       (i % 2)::DOUBLE - 0.5 AS reward, (i % 2)::DOUBLE AS original_reward, 'worker-hist' AS worker_id,
                       $t + i * 1e-3 AS created_at, $t + i * 1e-3 AS received_at, '' AS parent_request_id, false AS branched,
                       'default' AS tenant, 'eligible' AS eligibility, 'trained' AS status
                FROM range({start}, {stop}) t(i)""",
            {"model": model_id, "t": now - num * 1e-3},
        )
        con.execute(
            f"""INSERT INTO leases BY NAME
                SELECT md5('l' || (i // 512)) AS lease_id, md5('t' || i) AS trajectory_id, 'bench' AS trainer_id,
                       i // 512 AS step, {last}::BIGINT AS trainer_version, $t AS issued_at, $t + 600 AS expires_at,
                       $t + 1 AS acked_at, (i % 512)::INTEGER AS position, ((i % 2) - 0.5)::FLOAT AS advantage
                FROM range({start}, {stop}) t(i)""",
            {"t": now - 3600},
        )
        _progress(f"history {num:,}: {stop:,} rows fabricated")
    con.execute("CHECKPOINT")
    con.close()


class History:
    """One fabricated ledger served by its own ``rollbook serve``, and what was measured on it."""

    def __init__(self, num: int, args: argparse.Namespace, work: pathlib.Path) -> None:
        from bench.ingest import MODEL_ID, VERSIONS, VOCAB_SIZE, start_store

        self.num = num
        self.run_dir = work / f"history-{num}"
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.run_dir.mkdir(parents=True)
        self.db = self.run_dir / "rollbook.duckdb"
        t0 = time.perf_counter()
        fabricate(self.db, num, args.output_tokens, model_id=MODEL_ID, vocab_size=VOCAB_SIZE, versions=VERSIONS)
        self.fabricate_s = time.perf_counter() - t0
        os.sync()  # the fabricated file on disk: its writeback would otherwise land on the store's fsyncs
        env = {k: v for k, v in os.environ.items() if not (k.startswith("ROLLBOOK_") and k.endswith("_KEY"))}
        env.update({f"ROLLBOOK_{k.upper()}": v for k, v in KEYS.items()})
        self.server, self.address = start_store(self.db, env)
        _progress(f"history {num:,}: store up at {self.address} ({self.db.stat().st_size / 2**20:,.0f} MiB file)")
        self.pulls: list[float] = []
        self.acks: list[float] = []
        self.row: dict = {}

    def pull(self, r: int, args: argparse.Namespace) -> None:
        """Submit a batch of fresh rewarded groups, then time the pull that leases exactly them and its
        ack (``r`` 0 warms up and is not kept)."""
        from bench.ingest import MODEL_ID, VERSIONS, make_trajectories
        from rollbook.client import StoreClient

        with StoreClient(self.address, **KEYS) as client:
            fresh = make_trajectories(args.batch, args.output_tokens, worker=r, run=f"pull-{r}")
            result = client.submit(fresh)
            if result.accepted != args.batch:
                raise RuntimeError(f"history {self.num}: {result.accepted}/{args.batch} accepted")
            started = time.perf_counter()
            batch = client.pull_batch(
                trainer_id="bench",
                trainer_version=VERSIONS[-1],
                max_staleness=len(VERSIONS),
                num_samples=args.batch,
                step=1_000_000 + r,
                model_id=MODEL_ID,
            )
            pulled = time.perf_counter()
            client.ack_batch(batch.lease_id, "bench")
            acked = time.perf_counter()
        served = set(batch.table.column("trajectory_id").to_pylist())
        if served != {t.trajectory_id for t in fresh}:
            raise RuntimeError(f"history {self.num}: the pull served {len(served)} rows, not the {args.batch} submitted")
        if r:
            self.pulls.append(pulled - started)
            self.acks.append(acked - pulled)

    def ingest(self, args: argparse.Namespace) -> None:
        """Stream ``--ingest`` fresh trajectories as a worker does; then stop the store and report."""
        from bench.ingest import make_trajectories
        from rollbook.client import StoreClient

        try:
            with StoreClient(self.address, **KEYS) as client:
                fresh = make_trajectories(args.ingest, args.output_tokens, worker=10_000, run="ingest")
                started = time.perf_counter()
                result = client.submit(fresh, batch_size=64)  # as a worker streams: batches of 64, a few in flight
                acked_s = time.perf_counter() - started
                if result.accepted != args.ingest:
                    raise RuntimeError(f"history {self.num}: {result.accepted}/{args.ingest} accepted")
                stats = client.stats()  # folds what is left of them into DuckDB and settles, then counts
                folded_s = time.perf_counter() - started
                expected = self.num + (args.repeats + 1) * args.batch + args.ingest
                if stats.accepted != expected:
                    raise RuntimeError(f"history {self.num}: the store counts {stats.accepted} accepted rows, not {expected}")
        finally:
            self.stop()
        size_mib = self.db.stat().st_size / 2**20
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.row = {
            "history": self.num,
            "file_mib": round(size_mib),
            "fabricate_s": round(self.fabricate_s, 1),
            "pull_ms": round(statistics.median(self.pulls) * 1000, 1),
            "pull_ms_all": [round(p * 1000, 1) for p in self.pulls],
            "ack_ms": round(statistics.median(self.acks) * 1000, 1),
            "ingest_tok_s": round(args.ingest * args.output_tokens / acked_s),
            "ingest_folded_tok_s": round(args.ingest * args.output_tokens / folded_s),
        }
        _progress(f"history {self.num:,}: {json.dumps(self.row)}")

    def stop(self) -> None:
        if self.server.poll() is None:
            self.server.send_signal(signal.SIGTERM)
            self.server.wait(timeout=300)


def measure(args: argparse.Namespace, work: pathlib.Path) -> list[dict]:
    """Every history's store up at once; the pulls go round the histories, round after round, so a
    machine that is slower for a while slows every history's pulls alike; then each ingest in turn."""
    histories: list[History] = []
    try:
        for num in sorted(args.histories):
            histories.append(History(num, args, work))
        for r in range(args.repeats + 1):  # round 0 warms up
            for h in histories[r % len(histories) :] + histories[: r % len(histories)]:  # each takes its turn first
                h.pull(r, args)
            if r:
                _progress(f"round {r}/{args.repeats}: " + ", ".join(f"{h.num:,}: {1000 * h.pulls[-1]:.1f} ms" for h in histories))
        for h in histories:
            h.ingest(args)
    finally:
        for h in histories:
            h.stop()
    return [h.row for h in histories]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sys.path.insert(0, str(ROOT))  # bench.ingest
    with tempfile.TemporaryDirectory(prefix="pull-history-", dir=args.work_dir) as tmp:
        rows = measure(args, pathlib.Path(tmp))
    by_history = {r["history"]: r for r in rows}
    ratios = [
        by_history[n]["pull_ms"] / by_history[n // 10]["pull_ms"] for n in by_history if n and n // 10 in by_history and n // 10
    ]
    largest, empty = max(by_history), by_history.get(0)
    report = {
        "bench": "pull_history",
        "output_tokens": args.output_tokens,
        "batch": args.batch,
        "repeats": args.repeats,
        "histories": rows,
        "pull_ms_per_10x": round(max(ratios), 3) if ratios else None,
        "ingest_over_empty": round(by_history[largest]["ingest_tok_s"] / empty["ingest_tok_s"], 3) if empty and largest else None,
        "ingest_folded_over_empty": (
            round(by_history[largest]["ingest_folded_tok_s"] / empty["ingest_folded_tok_s"], 3) if empty and largest else None
        ),
        "num_cpus": os.cpu_count(),
    }
    if args.json:
        print(json.dumps(report))
    else:
        for r in rows:
            print(r)
        print({k: v for k, v in report.items() if k != "histories"})


if __name__ == "__main__":
    main()
