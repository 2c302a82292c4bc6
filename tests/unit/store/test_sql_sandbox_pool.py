"""The SQL sandbox (rollbook.store.sandbox) on its own: real worker processes over a real DuckDB
snapshot, without the gRPC server.

The sandbox must hold with the statement fence switched off (the fence is defense in depth; the
guarantee is what the worker's DuckDB can reach); caps, the queue, timeouts and respawns; and the
ledger's snapshots (taken only when the ledger changed, deleted when no query uses them).

Run: ``python -m pytest tests/unit/store/test_sql_sandbox_pool.py -q``.
"""

from __future__ import annotations

import io
import math
import os
import threading
import time

import duckdb
import pyarrow as pa
import pytest

from rollbook.store.ledger import Ledger
from rollbook.store.sandbox import FixedSnapshot, SandboxPool, Snapshots
from rollbook.store.sql import INVALID, RESOURCES, QueryError, QueryLimits
from tests.unit.store.test_ledger import open_ledger, row


def table(chunks) -> tuple[pa.Table, bool]:
    tables, truncated = [], False
    for ipc, cut in chunks:
        truncated = truncated or cut
        if ipc:
            tables.append(pa.ipc.open_stream(io.BytesIO(ipc)).read_all())
    return pa.concat_tables(tables), truncated


@pytest.fixture
def files(tmp_path):
    """A snapshot file, and next to the sandbox a 'ledger' and a secret it must not reach."""
    snap = tmp_path / "snap" / "snapshot.duckdb"
    snap.parent.mkdir()
    con = duckdb.connect(str(snap))
    con.execute("CREATE TABLE t AS SELECT range AS i, 'row-' || range AS s FROM range(1000)")
    con.close()
    ledger = tmp_path / "ledger.duckdb"
    con = duckdb.connect(str(ledger))
    con.execute("CREATE TABLE secret AS SELECT 'SECRET-LEDGER' AS s")
    con.close()
    (tmp_path / "secret.csv").write_text("s\nSECRET-CSV\n")
    return snap, ledger, tmp_path


def make_pool(tmp_path, snap, **limits) -> SandboxPool:
    return SandboxPool(
        QueryLimits(**{"memory_limit_mb": 256, "process_headroom_mb": 512, "workers": 1, **limits}),
        tmp_path / "workers",
        FixedSnapshot(snap),
    )


@pytest.fixture
def unfenced(files):
    snap, _, tmp_path = files
    pool = make_pool(tmp_path, snap, fence=False)
    yield pool
    pool.close()


def test_a_plain_query_answers(unfenced):
    got, cut = table(unfenced.run("SELECT count(*) AS n, max(s) AS m FROM t"))
    assert got.to_pylist() == [{"n": 1000, "m": "row-999"}] and not cut


def test_without_the_fence_nothing_outside_the_snapshot_is_reachable(files, unfenced):
    """The guarantee does not depend on the deny-list: the worker's DuckDB has external access
    off, its configuration locked, and the snapshot opened read-only."""
    snap, ledger, tmp_path = files
    before = {p: p.stat().st_size for p in (snap, ledger)}
    for sql in [
        f"SELECT * FROM read_blob('{ledger}')",
        f"SELECT * FROM read_csv('{tmp_path}/secret.csv')",
        f"SELECT * FROM '{tmp_path}/secret.csv'",
        f"SELECT * FROM glob('{tmp_path}/*')",
        f"SELECT * FROM query('SELECT * FROM read_text(''{tmp_path}/secret.csv'')')",
        f"SELECT * FROM json_execute_serialized_sql(json_serialize_sql('SELECT * FROM read_blob(''{ledger}'')'))",
        f"COPY t TO '{tmp_path}/out.csv'",
        f"ATTACH '{ledger}' AS l",
        "INSTALL httpfs",
        "LOAD httpfs",
        "SET memory_limit = '100GB'",
        "SET enable_external_access = true",
        "RESET memory_limit",
        "CREATE TABLE x AS SELECT 1",
        "DELETE FROM t",
        "DROP TABLE t",
        "PRAGMA threads=8",
        "SELECT * FROM read_csv('https://example.com/x.csv')",
    ]:
        with pytest.raises(QueryError) as err:
            table(unfenced.run(sql))
        assert "SECRET" not in str(err.value), sql
    for sql in ["SELECT * FROM checkpoint()", "SELECT * FROM force_checkpoint()", "CHECKPOINT", "SELECT * FROM glob('*')"]:
        try:
            table(unfenced.run(sql))
        except QueryError:
            pass
    assert {p: p.stat().st_size for p in (snap, ledger)} == before
    assert not (tmp_path / "out.csv").exists()
    got, _ = table(unfenced.run("SELECT current_setting('memory_limit') AS m, current_setting('threads') AS t"))
    assert got.to_pylist()[0]["t"] == 2


def test_pointer_taking_scans_fail_in_the_sandbox_and_the_next_query_is_served(unfenced):
    """The Python client's pointer-taking scans (arrow_scan, pandas_scan) are refused by name; with
    the fence off they fail to bind, and were one to crash, it would be the sandbox process
    (``test_a_killed_worker_is_replaced``), never the server's."""
    for sql in ["SELECT * FROM arrow_scan(1, 2, 3)", "SELECT * FROM pandas_scan(1)", "SELECT * FROM python_map_function(1)"]:
        with pytest.raises(QueryError):
            table(unfenced.run(sql))
        assert table(unfenced.run("SELECT 7 AS x"))[0].to_pylist() == [{"x": 7}]


def test_the_fence_refuses_nested_sql_and_writing_functions_by_name(files):
    snap, ledger, tmp_path = files
    pool = make_pool(tmp_path, snap)
    try:
        for sql in [
            "SELECT * FROM query('SELECT 1')",
            "SELECT * FROM query_table('t')",
            "SELECT json_execute_serialized_sql(json_serialize_sql('SELECT 1'))",
            "SELECT * FROM checkpoint()",
            "SELECT * FROM truncate_duckdb_logs()",
            "SELECT write_log('x')",
            "SeLeCt * FrOm ReAd_CsV('/etc/passwd')",
            "SELECT /* c */ * FROM \"read_text\"('/etc/passwd')",
        ]:
            with pytest.raises(QueryError, match="not allowed") as err:
                table(pool.run(sql))
            assert err.value.code == INVALID
    finally:
        pool.close()


def test_timeouts_the_caller_asks_for_are_validated():
    limits = QueryLimits(timeout_s=30.0)
    for asked in (0.0, -1.0, float("nan"), float("inf"), -float("inf"), 1e300, 31.0):
        assert limits.timeout(asked) == 30.0, asked
    assert limits.timeout(2.5) == 2.5
    assert limits.rows(0) == limits.max_rows and limits.rows(10) == 10 and limits.rows(10**9) == limits.max_rows
    assert not math.isnan(limits.timeout(float("nan")))


def test_the_byte_cap_cuts_the_result_and_says_so(files):
    snap, _, tmp_path = files
    pool = make_pool(tmp_path, snap, max_result_bytes=1 << 20, chunk_bytes=256 << 10)
    try:
        got, cut = table(pool.run("SELECT repeat('x', 1000) AS s FROM range(10000)"))
        assert cut and 0 < got.num_rows < 10000
        assert got.nbytes <= 1 << 20
        exact, cut = table(pool.run("SELECT repeat('x', 10) AS s FROM range(100)"))
        assert exact.num_rows == 100 and not cut
        with pytest.raises(QueryError, match="first row alone") as err:
            table(pool.run("SELECT repeat('x', 2000000) AS s"))
        assert err.value.code == RESOURCES
    finally:
        pool.close()


def test_the_row_cap_cuts_exactly(files):
    snap, _, tmp_path = files
    pool = make_pool(tmp_path, snap, max_rows=50, batch_rows=16)
    try:
        assert table(pool.run("SELECT * FROM range(1000)"))[0].num_rows == 50
        assert table(pool.run("SELECT * FROM range(1000)"))[1]
        assert table(pool.run("SELECT * FROM range(50)"))[1] is False
        assert table(pool.run("SELECT * FROM range(10)", max_rows=5))[0].num_rows == 5
    finally:
        pool.close()


def test_excess_queries_are_refused_with_resource_exhausted(files):
    snap, _, tmp_path = files
    pool = make_pool(tmp_path, snap, queue=0, timeout_s=5.0)
    try:
        started = threading.Event()

        def long_query():
            started.set()
            with pytest.raises(QueryError):
                table(pool.run("SELECT sum(hash(range)) FROM range(10000000000000)", timeout_s=3.0))

        t = threading.Thread(target=long_query)
        t.start()
        started.wait()
        time.sleep(0.5)
        with pytest.raises(QueryError, match="too many concurrent queries") as err:
            table(pool.run("SELECT 1"))
        assert err.value.code == RESOURCES
        t.join()
        assert table(pool.run("SELECT 1 AS x"))[0].to_pylist() == [{"x": 1}]
    finally:
        pool.close()


def test_a_killed_worker_is_replaced(files):
    snap, _, tmp_path = files
    pool = make_pool(tmp_path, snap)
    try:
        table(pool.run("SELECT 1"))
        worker = pool._idle[0]
        os.kill(worker.proc.pid, 9)
        worker.proc.wait()
        assert table(pool.run("SELECT 2 AS x"))[0].to_pylist() == [{"x": 2}]
        assert pool.respawns == 1
    finally:
        pool.close()


def test_worker_processes_end_with_the_pool(files):
    snap, _, tmp_path = files
    pool = make_pool(tmp_path, snap, workers=2)
    table(pool.run("SELECT 1"))
    procs = [w.proc for w in pool._idle if w is not None]
    pool.close()
    assert procs and all(p.poll() is not None for p in procs)


# ---- snapshots of a real ledger ---------------------------------------------------------------------


def test_a_snapshot_is_taken_only_when_the_ledger_changed(tmp_path):
    ledger: Ledger = open_ledger(tmp_path / "l.duckdb")
    try:
        snaps = Snapshots(ledger, tmp_path / "snaps")
        ledger.submit([row("a")])
        first = snaps.acquire()
        snaps.release(first)
        again = snaps.acquire()
        assert again is first and snaps.taken == 1  # nothing changed
        ledger.submit([row("b")])  # acknowledged, not folded yet: still a change
        newer = snaps.acquire()
        assert newer is not first and snaps.taken == 2
        assert first.path.exists()  # still in use
        snaps.release(again)
        assert not first.path.exists()  # retired and released: deleted
        con = duckdb.connect(str(newer.path), read_only=True)
        assert con.execute("SELECT count(*) FROM trajectories").fetchone()[0] == 2
        con.close()
        snaps.release(newer)
        snaps.close()
        assert not newer.path.exists()
    finally:
        ledger.close()


def test_snapshots_are_reused_until_their_max_age(tmp_path):
    ledger: Ledger = open_ledger(tmp_path / "l.duckdb")
    try:
        snaps = Snapshots(ledger, tmp_path / "snaps", max_age_s=3600)
        snaps.release(first := snaps.acquire())
        ledger.submit([row("c")])
        snaps.release(second := snaps.acquire())
        assert second is first and snaps.taken == 1
        snaps.close()
    finally:
        ledger.close()


# Distinct strings in a hash table: about 330 MiB resident at its peak under a 256 MiB memory limit
# and a 768 MiB process limit; it succeeds in a fresh worker.
MEMORY_HEAVY = "SELECT count(*) AS n FROM (SELECT DISTINCT range::VARCHAR || 'abcdefghijklmnop' AS s FROM range(4000000))"


def test_a_query_gets_the_same_answer_after_memory_heavy_queries_in_its_worker(files):
    """What earlier queries left in a worker process (memory its allocator keeps) never turns a
    query that succeeds in a fresh worker into RESOURCE_EXHAUSTED."""
    snap, _, tmp_path = files
    pool = make_pool(tmp_path, snap)  # one worker: every query runs after the ones before it
    try:
        for _ in range(3):
            assert table(pool.run(MEMORY_HEAVY))[0].to_pylist() == [{"n": 4000000}]
    finally:
        pool.close()


def test_a_query_past_its_timeout_is_deadline_exceeded(files):
    snap, _, tmp_path = files
    pool = make_pool(tmp_path, snap)
    try:
        with pytest.raises(QueryError, match="exceeded its timeout of 0.5 s") as err:
            table(pool.run("SELECT sum(hash(range)) FROM range(10000000000000)", timeout_s=0.5))
        assert err.value.code == "DEADLINE_EXCEEDED"
        assert table(pool.run("SELECT 1 AS x"))[0].to_pylist() == [{"x": 1}]
    finally:
        pool.close()


def test_running_out_of_memory_in_a_used_worker_is_decided_by_a_fresh_one(files):
    """A query that runs out of memory in a worker that served queries before runs once more in a
    fresh worker, whose answer stands; in a fresh worker the first answer stands."""
    snap, _, tmp_path = files
    pool = make_pool(tmp_path, snap)
    bomb = "SELECT length(repeat('x', 4000000000)) AS n"
    try:
        table(pool.run("SELECT 1"))
        with pytest.raises(QueryError, match="memory limit") as err:
            table(pool.run(bomb))
        assert err.value.code == RESOURCES
        assert pool.respawns == 2  # the fresh worker for the second run, and its replacement
        with pytest.raises(QueryError, match="memory limit"):
            table(pool.run(bomb))  # a fresh worker already: no second run
        assert pool.respawns == 3
    finally:
        pool.close()
