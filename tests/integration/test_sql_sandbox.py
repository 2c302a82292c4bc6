"""The read-only SQL endpoint: what it refuses, its row cap and timeout, and ``rollbook query``
through the server and straight on the file (including acknowledged rows still in the log after
a kill -9), in every output format.

Run: ``python -m pytest tests/integration/test_sql_sandbox.py -q``.
"""

from __future__ import annotations

import csv
import io
import json
import math
import pathlib

import duckdb
import grpc
import pyarrow.parquet as pq
import pytest

from rollbook.cli import main as cli
from tests.integration.conftest import (
    MODEL,
    count,
    query_file,
    register,
    rollbook_cli,
    rows,
    rpc_error,
    start_store,
    traj,
)

SEQUENCE = "rollbook_test_seq"
# 10^13 rows streamed through an aggregate in constant memory: never finishes, so only the timeout
# can end it (a cross join would meet the sandbox's memory limit first).
ENDLESS = "SELECT sum(hash(range)) FROM range(10000000000000)"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("sandbox")


@pytest.fixture(scope="module")
def store(workdir):
    db = workdir / "rollbook.duckdb"
    con = duckdb.connect(str(db))  # a sequence, so that nextval() has something to try to advance
    con.execute(f"CREATE SEQUENCE {SEQUENCE}")
    con.close()
    s = start_store(db)
    with s.client() as client:
        register(client)
        client.submit([traj(f"sql-{i}", n=8) for i in range(30)] + [traj("sql-bad", output_logprobs=[0.5] * 16)])
    yield s
    s.kill()


def _refused(workdir) -> dict[str, str]:
    return {
        "drop-table": "DROP TABLE trajectories",
        "delete": "DELETE FROM trajectories",
        "update": "UPDATE trajectories SET reward = 0",
        "insert": "INSERT INTO models VALUES ('evil', 1, 0)",
        "create-table": "CREATE TABLE evil AS SELECT 1",
        "copy-to": f"COPY trajectories TO '{workdir}/stolen.csv'",
        "copy-select-to": f"COPY (SELECT * FROM trajectories) TO '{workdir}/stolen.parquet' (FORMAT parquet)",
        "export": f"EXPORT DATABASE '{workdir}/exported'",
        "attach": f"ATTACH '{workdir}/other.duckdb' AS other",
        "read-csv": "SELECT * FROM read_csv('/etc/passwd')",
        "read-text": "SELECT * FROM read_text('/etc/passwd')",
        "glob": "SELECT * FROM glob('/etc/*')",
        "install": "INSTALL httpfs",
        "load": "LOAD httpfs",
        "set": "SET enable_external_access = true",
        "reset": "RESET threads",
        "pragma": "PRAGMA enable_profiling",
        "multi-statement": "SELECT 1; DROP TABLE trajectories",
        "two-selects": "SELECT 1; SELECT 2",
        "nextval": f"SELECT nextval('{SEQUENCE}')",
        "checkpoint": "CHECKPOINT",
    }


REFUSED_IDS = list(_refused("X"))


def _snapshot(client) -> dict:
    tables = sorted(r["name"] for r in rows(client, "SHOW TABLES"))
    return {
        "tables": tables,
        "counts": {t: count(client, t) for t in tables},
        "sequence": rows(client, f"SELECT last_value FROM duckdb_sequences() WHERE sequence_name = '{SEQUENCE}'"),
    }


@pytest.fixture(scope="module")
def before(store):
    with store.client() as client:
        return _snapshot(client)


@pytest.mark.parametrize("case", REFUSED_IDS)
def test_query_refuses_writes_files_and_settings_with_invalid_argument(store, workdir, before, case):
    sql = _refused(workdir)[case]
    with store.client() as client:
        err = rpc_error(lambda: client.query(sql))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        assert err.details().strip()
        assert _snapshot(client) == before
    assert not any((workdir / name).exists() for name in ("stolen.csv", "stolen.parquet", "exported", "other.duckdb"))


@pytest.mark.parametrize("case", REFUSED_IDS)
def test_rollbook_query_server_refuses_the_same_with_an_error_and_nonzero_exit(store, workdir, before, case, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["query", "--server", store.address, _refused(workdir)[case]])
    assert exited.value.code not in (0, None)
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("rollbook query: error: ")
    with store.client() as client:
        assert _snapshot(client) == before


def test_rollbook_query_process_exits_nonzero_on_a_refused_statement(store, before):
    done = rollbook_cli("query", "--server", store.address, "DROP TABLE trajectories")
    assert done.returncode != 0
    assert "DROP statements are not allowed" in done.stderr and done.stdout == ""
    with store.client() as client:
        assert _snapshot(client) == before


def test_the_messages_say_why(store, workdir):
    with store.client() as client:
        assert "not allowed" in rpc_error(lambda: client.query("DROP TABLE trajectories")).details()
        assert "exactly one statement" in rpc_error(lambda: client.query("SELECT 1; SELECT 2")).details()
        assert "read_csv() is not allowed" in rpc_error(lambda: client.query("SELECT * FROM read_csv('/etc/passwd')")).details()
        assert "read-only" in rpc_error(lambda: client.query(f"SELECT nextval('{SEQUENCE}')")).details()


def test_the_ledgers_own_files_cannot_be_read(store):
    """DuckDB lets a locked-down database read its own files; the syntax-tree fence refuses them."""
    db = str(store.db)
    with store.client() as client:
        for sql in (
            f"SELECT * FROM read_blob('{db}')",
            f"SELECT * FROM '{db}'",
            f"SELECT * FROM read_text('{db}.wal')",
            f"SELECT (SELECT size FROM read_blob('{db}')) AS s",
            f"EXPLAIN SELECT * FROM read_blob('{db}')",
        ):
            assert rpc_error(lambda: client.query(sql)).code() == grpc.StatusCode.INVALID_ARGUMENT, sql


def test_reads_of_every_documented_kind_are_allowed(store):
    with store.client() as client:
        assert client.query("SELECT count(*) AS n FROM trajectories").to_pylist() == [{"n": 30}]
        assert client.query("WITH t AS (SELECT 1 AS x) SELECT x FROM t").to_pylist() == [{"x": 1}]
        assert client.query("FROM rejections SELECT reason").to_pylist() == [{"reason": "POSITIVE_LOGPROB"}]
        assert client.query("DESCRIBE trajectories").num_rows > 20
        assert "trajectories" in client.query("SHOW TABLES").column("name").to_pylist()
        assert client.query("EXPLAIN SELECT 1").num_rows >= 1
        assert client.query("SUMMARIZE models").num_rows == 3


def test_a_syntax_error_returns_duckdbs_message(store, capsys):
    with store.client() as client:
        err = rpc_error(lambda: client.query("SELEC count(*) FROM trajectories"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert 'Parser Error: syntax error at or near "SELEC"' in err.details()
    with pytest.raises(SystemExit):
        cli.main(["query", "--server", store.address, "SELEC 1"])
    assert "syntax error" in capsys.readouterr().err


def test_the_row_cap_cuts_and_says_so(store):
    with store.client() as client:
        cut = client.query("SELECT * FROM range(1000)", max_rows=10)
        exact = client.query("SELECT * FROM range(10)", max_rows=10)
        under = client.query("SELECT * FROM range(3)", max_rows=10)
    assert cut.num_rows == 10 and cut.schema.metadata[b"rollbook.truncated"] == b"true"
    assert exact.num_rows == 10 and exact.schema.metadata[b"rollbook.truncated"] == b"false"
    assert under.num_rows == 3 and under.schema.metadata[b"rollbook.truncated"] == b"false"
    done = rollbook_cli("query", "--server", store.address, "--max-rows", "5", "--format", "json", "SELECT * FROM range(100)")
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) == 5
    assert "result cut at 5 rows" in done.stderr


def test_a_query_past_its_timeout_is_deadline_exceeded_and_the_server_keeps_serving(store):
    with store.client() as client:
        err = rpc_error(lambda: client.query(ENDLESS, timeout_s=1.0))
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.details()
        assert err.details() == "query exceeded its timeout of 1 s"
        assert client.query("SELECT count(*) AS n FROM trajectories").to_pylist() == [{"n": 30}]
    done = rollbook_cli("query", "--server", store.address, "--timeout", "1", ENDLESS)
    assert done.returncode != 0 and "query exceeded its timeout of 1 s" in done.stderr, done.stderr
    assert "not reachable" not in done.stderr and "Traceback" not in done.stderr, done.stderr


# ---- rollbook query --db: the server is down --------------------------------------------------


@pytest.fixture(scope="module")
def offline_db(tmp_path_factory):
    """A ledger file whose server has shut down cleanly."""
    db = tmp_path_factory.mktemp("offline") / "rollbook.duckdb"
    con = duckdb.connect(str(db))
    con.execute(f"CREATE SEQUENCE {SEQUENCE}")
    con.close()
    s = start_store(db)
    with s.client() as client:
        register(client)
        client.submit([traj("off-0", n=2, reward=0.5), traj("off-1", n=3, reward=None), traj("off-2", n=10)])
    assert s.terminate() == 0
    return db


SQL_OFFLINE = "SELECT trajectory_id, num_output_tokens, output_versions, reward FROM trajectories ORDER BY trajectory_id"
EXPECTED = [
    {"trajectory_id": "off-0", "num_output_tokens": 2, "output_versions": [0, 0], "reward": 0.5},
    {"trajectory_id": "off-1", "num_output_tokens": 3, "output_versions": [0, 0, 0], "reward": None},
    {"trajectory_id": "off-2", "num_output_tokens": 10, "output_versions": [0] * 10, "reward": 1.0},
]


def test_query_db_format_table(offline_db):
    done = rollbook_cli("query", "--db", str(offline_db), SQL_OFFLINE)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split(" | ")[0].strip() == "trajectory_id" and "reward" in lines[0]
    assert lines[2].startswith("off-0") and "NULL" in lines[3]
    assert "[0, 0, 0, 0, 0, 0, 0, 0, ... (10)]" in lines[4]
    assert lines[-1] == "(3 rows)"


def test_query_db_format_csv(offline_db):
    done = rollbook_cli("query", "--db", str(offline_db), "--format", "csv", SQL_OFFLINE)
    assert done.returncode == 0, done.stderr
    got = list(csv.DictReader(io.StringIO(done.stdout)))
    assert [r["trajectory_id"] for r in got] == ["off-0", "off-1", "off-2"]
    assert [json.loads(r["output_versions"]) for r in got] == [e["output_versions"] for e in EXPECTED]
    assert [r["reward"] for r in got] == ["0.5", "", "1"]


def test_query_db_format_json(offline_db):
    assert query_file(offline_db, SQL_OFFLINE) == EXPECTED


def test_query_db_format_parquet_to_a_file(offline_db, tmp_path):
    out = tmp_path / "answer.parquet"
    done = rollbook_cli("query", "--db", str(offline_db), "--format", "parquet", "--output", str(out), SQL_OFFLINE)
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    assert pq.read_table(out).to_pylist() == EXPECTED


def test_query_db_is_sandboxed_too(offline_db, tmp_path, capsys):
    for sql in (
        "DROP TABLE trajectories",
        f"COPY trajectories TO '{tmp_path}/x.csv'",
        f"SELECT nextval('{SEQUENCE}')",
        f"ATTACH '{tmp_path}/y.duckdb'",
        "SELECT * FROM read_csv('/etc/passwd')",
        "SELECT 1; SELECT 2",
        "SET enable_external_access = true",
        "INSTALL httpfs",
    ):
        assert cli.main(["query", "--db", str(offline_db), sql]) != 0, sql
        out, err = capsys.readouterr()
        assert out == "" and "rollbook query: error:" in err, sql
        assert "does not exist" not in err, sql  # refused, not merely missing
    assert not (tmp_path / "x.csv").exists() and not (tmp_path / "y.duckdb").exists()
    assert len(query_file(offline_db, "SELECT * FROM trajectories")) == 3


def test_query_db_runs_in_the_same_sandbox_and_leaves_the_file_alone(offline_db):
    """``rollbook query --db`` queries a private copy in a sandbox process: a memory bomb meets the
    sandbox's limit, nested SQL is refused, and the ledger's files do not change."""
    before = _ledger_files(offline_db)
    done = rollbook_cli("query", "--db", str(offline_db), "SELECT length(repeat('x', 4000000000))")
    assert done.returncode != 0 and "memory limit" in done.stderr, done.stderr
    done = rollbook_cli("query", "--db", str(offline_db), "SELECT * FROM checkpoint()")
    assert done.returncode != 0 and "not allowed" in done.stderr, done.stderr
    done = rollbook_cli("query", "--db", str(offline_db), f"SELECT * FROM query('SELECT * FROM read_blob(''{offline_db}'')')")
    assert done.returncode != 0 and "not allowed" in done.stderr, done.stderr
    assert _ledger_files(offline_db) == before


def test_query_db_sees_acknowledged_rows_the_killed_server_had_not_folded(tmp_path, stores):
    db = tmp_path / "rollbook.duckdb"
    acked: list[str] = []
    rejected: list[str] = []
    for attempt in range(4):  # the fold could win the race with SIGKILL; then submit and kill again
        stores.append(s := start_store(db))
        with s.client() as client:
            if attempt == 0:
                register(client)
            batch = [traj(f"unfolded-{attempt}-{i}") for i in range(50)] + [
                traj(f"unfolded-{attempt}-nan", output_logprobs=[float("nan")] * 16)
            ]
            result = client.submit(batch, batch_size=10)
        s.kill()  # SIGKILL right after the acknowledgement: the folder waits for an idle pause first
        acked += [t for t, v in result.verdicts.items() if v.reason == ""]
        rejected += [t for t, v in result.verdicts.items() if v.reason]
        done = rollbook_cli(
            "query",
            "--db",
            str(db),
            "--format",
            "json",
            "SELECT count(*) AS n, count(DISTINCT trajectory_id) AS d FROM trajectories",
        )
        assert done.returncode == 0, done.stderr
        if "not yet folded" in done.stderr:
            break
    else:
        pytest.fail("every SIGKILL came after the fold; the log overlay was never exercised")
    assert json.loads(done.stdout) == {"n": len(acked), "d": len(acked)}
    assert {r["trajectory_id"] for r in query_file(db, "SELECT trajectory_id FROM trajectories")} == set(acked)
    assert {r["trajectory_id"]: r["reason"] for r in query_file(db, "SELECT trajectory_id, reason FROM rejections")} == {
        t: "NONFINITE_LOGPROB" for t in rejected
    }

    # the restarted store replays the same log batches exactly once
    stores.append(s := start_store(db))
    with s.client() as client:
        assert rows(client, "SELECT count(*) AS n, count(DISTINCT trajectory_id) AS d FROM trajectories") == [
            {"n": len(acked), "d": len(acked)}
        ]
        assert client.submit([traj(acked[0])]).duplicates == 1
    assert s.terminate() == 0
    done = rollbook_cli("query", "--db", str(db), "--format", "json", "SELECT count(*) AS n FROM trajectories")
    assert json.loads(done.stdout) == {"n": len(acked)} and "not yet folded" not in done.stderr


# ---- a query cannot hurt the store ---------------------------------------------------------------
# A store with tight sandbox limits (env ROLLBOOK_QUERY_*, read by store/server.py env_values).

LIMITED_TIMEOUT_S = 3.0
LIMITED_GRACE_S = 1.0
LIMITED_ENV = {
    "ROLLBOOK_QUERY_TIMEOUT_S": str(LIMITED_TIMEOUT_S),
    "ROLLBOOK_QUERY_KILL_GRACE_S": str(LIMITED_GRACE_S),
    "ROLLBOOK_QUERY_MEMORY_LIMIT_MB": "512",
    "ROLLBOOK_QUERY_PROCESS_HEADROOM_MB": "512",
    "ROLLBOOK_QUERY_DUCKDB_THREADS": "2",
    "ROLLBOOK_QUERY_WORKERS": "2",
    "ROLLBOOK_QUERY_TEMP_LIMIT_MB": "64",
}
# The documented bound (docs/sql.md): query engine <= workers x (memory limit + headroom)
ENGINE_BOUND_MB = 2 * (512 + 512)
SLACK_MB = 300  # the server's own buffers while it streams answers and errors
# Finishing in this long past the timeout counts as "not overrunning it" (a loaded 2-core machine).
OVERRUN_S = LIMITED_GRACE_S + 4.0
RECURSIVE_CTE = "WITH RECURSIVE t(s) AS (SELECT 'x' UNION ALL SELECT s || s FROM t) SELECT count(*) FROM t"
# One long call that never checks for interrupts (~13 s of CPU): only the kill can end it on time.
UNINTERRUPTIBLE = "SELECT length(regexp_replace(repeat('ab', 50000000), 'a', 'xyz', 'g')) AS n"


def tree_rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` and all its descendants (the sandbox processes), in MiB."""
    import os

    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
    return total / 1024


class RssSampler:
    """Samples ``tree_rss_mb(pid)`` every 20 ms in a thread; ``peak`` is the highest seen."""

    def __init__(self, pid: int):
        import threading

        self.pid, self.peak, self._stop = pid, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_rss_mb(self.pid))
            self._stop.wait(0.02)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def raw_query(store, sql: str, timeout_seconds: float = 0.0, max_rows: int = 0, deadline: float = 60.0):
    """``Query`` through the generated stub (any ``timeout_seconds``, NaN included); the table, or
    the RpcError it raised, and the seconds it took."""
    import time

    from rollbook.client import read_query_chunks
    from rollbook.v1 import rollbook_pb2 as pb
    from rollbook.v1 import rollbook_pb2_grpc as pb_grpc

    t0 = time.monotonic()
    with grpc.insecure_channel(store.address) as channel:
        stub = pb_grpc.TrajectoryStoreStub(channel)
        try:
            result = read_query_chunks(
                stub.Query(pb.QueryRequest(sql=sql, max_rows=max_rows, timeout_seconds=timeout_seconds), timeout=deadline)
            )
        except grpc.RpcError as exc:
            result = exc
    return result, time.monotonic() - t0


def start_limited_store(tmp_path_factory, name: str, num_rows: int):
    """A store with the tight sandbox limits of ``LIMITED_ENV``, a registered model and
    ``num_rows`` stored trajectories."""
    from tests.integration.conftest import clean_env

    s = start_store(tmp_path_factory.mktemp(name) / "rollbook.duckdb", env=clean_env(**LIMITED_ENV))
    with s.client() as client:
        register(client)
        client.submit([traj(f"{name}-{i}", n=8) for i in range(num_rows)])
    return s


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    s = start_limited_store(tmp_path_factory, "limited", 40)
    yield s
    s.kill()


def _serving(store, expect_rows: int = 40) -> None:
    """Every read RPC still answers: GetStats, Query, PullBatch (then the lease is acked)."""
    with store.client() as client:
        assert client.stats().accepted == expect_rows
        assert client.query("SELECT count(*) AS n FROM trajectories").to_pylist() == [{"n": expect_rows}]
        batch = client.pull_batch(trainer_id="t-sql", trainer_version=0, max_staleness=4, model_id=MODEL, num_samples=1)
        assert batch.num_rows == 1
        assert client.ack_batch(batch.lease_id, "t-sql") == 1


def test_an_internal_error_in_a_query_never_reaches_the_ledger(limited):
    """A recursive CTE cannot invalidate the ledger's DuckDB instance: it only meets its sandbox's
    memory limit, and every read RPC keeps working without a restart."""
    result, took = raw_query(limited, RECURSIVE_CTE)
    assert isinstance(result, grpc.RpcError), result
    assert result.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT), result.details()
    assert "invalidated" not in result.details()
    _serving(limited)
    assert limited.alive


MEMORY_BOMBS = [
    "SELECT len(list(range)) AS n FROM range(500000000)",  # first: ~4 GB on a store without a bound
    "SELECT len(list(range)) AS n FROM range(2000000000)",
    "SELECT sum(x) AS s FROM (SELECT unnest(range(1000000000)) AS x)",
    "SELECT length(repeat('x', 4000000000)) AS n",
    "SELECT length(string_agg(repeat('x', 1000), '')) AS n FROM range(10000000)",
    "SELECT count(DISTINCT repeat(range::VARCHAR, 100)) AS n FROM range(100000000)",
    RECURSIVE_CTE,
]


def test_memory_bombs_stay_within_the_documented_bound(limited):
    """A single query cannot take the host's memory: the server and its
    sandbox processes together stay under the server's own size plus the documented engine bound,
    and each bomb ends with a clear error (the memory cap, or the timeout where it grows slowly)."""
    import concurrent.futures

    base = tree_rss_mb(limited.proc.pid)
    bound = base + ENGINE_BOUND_MB + SLACK_MB
    with RssSampler(limited.proc.pid) as sampler:
        for sql in MEMORY_BOMBS:
            result, took = raw_query(limited, sql)
            assert sampler.peak < bound, (sql, sampler.peak, bound)
            assert isinstance(result, grpc.RpcError), (sql, result)
            # whichever limit it reaches first ends it: the memory cap, or on a loaded machine, where a
            # bomb grows slower, the timeout (a fresh-clone run beside learning probes, 2026-12-01:
            # count(DISTINCT repeat(...)) at 3 s);
            # the bound on memory above holds either way
            ended = (result.code(), result.details())
            assert (ended[0] == grpc.StatusCode.RESOURCE_EXHAUSTED and "memory" in ended[1]) or (
                ended[0] == grpc.StatusCode.DEADLINE_EXCEEDED and f"exceeded its timeout of {LIMITED_TIMEOUT_S:g} s" in ended[1]
            ), (sql, ended)
            assert took < LIMITED_TIMEOUT_S + OVERRUN_S, (sql, took)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:  # three at once: two run, one waits
            outcomes = list(pool.map(lambda _: raw_query(limited, "SELECT length(repeat('x', 4000000000)) AS n"), range(3)))
        for result, _took in outcomes:
            assert isinstance(result, grpc.RpcError), result
            # the memory cap; or, for the one that waited on a loaded machine, its timeout ran out first
            assert result.code() == grpc.StatusCode.RESOURCE_EXHAUSTED or (
                result.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "exceeded its timeout" in result.details()
            ), (result.code(), result.details())
    assert sampler.peak < bound, (sampler.peak, bound)
    print(f"\nserver + sandboxes: {base:.0f} MiB at rest, peak {sampler.peak:.0f} MiB, bound {bound:.0f} MiB")
    _serving(limited)


@pytest.mark.parametrize("asked", [-1.0, float("nan"), float("inf"), 0.0, 1e9, -float("inf")])
def test_the_caller_cannot_switch_off_the_timeout(limited, asked):
    """A timeout_seconds of -1, NaN or any other non-finite or non-positive value cannot disable the
    limit: such a value is refused before the query runs (the request field check), and the sandbox itself treats any
    value that is not a finite positive number up to the server's as the server's
    (``test_timeouts_the_caller_asks_for_are_validated``): either way nothing runs past it."""
    result, took = raw_query(limited, ENDLESS, timeout_seconds=asked, deadline=30.0)
    assert isinstance(result, grpc.RpcError), result
    if "timeout_seconds" in result.details():  # refused before it runs by the request field check
        assert result.code() == grpc.StatusCode.INVALID_ARGUMENT, result.details()
        assert asked < 0 or not math.isfinite(asked) or asked > 3600, result.details()
    else:  # run, under the server's timeout
        assert result.code() == grpc.StatusCode.DEADLINE_EXCEEDED, result.details()
        assert f"exceeded its timeout of {LIMITED_TIMEOUT_S:g} s" in result.details(), result.details()
    assert took < LIMITED_TIMEOUT_S + OVERRUN_S, took


def test_f3_a_call_that_ignores_interrupts_is_killed_at_the_timeout(limited):
    """A single long function call never checks DuckDB's interrupt; the server kills its sandbox
    process, answers, and a fresh process serves the next query."""
    result, took = raw_query(limited, UNINTERRUPTIBLE, timeout_seconds=1.0)
    assert isinstance(result, grpc.RpcError), result
    assert result.code() == grpc.StatusCode.DEADLINE_EXCEEDED, result.details()
    assert "exceeded its timeout of 1 s" in result.details(), result.details()
    assert took < 1.0 + OVERRUN_S, took
    _serving(limited)


def test_nested_and_serialized_sql_cannot_reach_files(limited, tmp_path):
    """Nested query(), json_execute_serialized_sql, SUMMARIZE over query(), read_csv and glob cannot
    read the ledger file or other files: none answers with a file's bytes."""
    secret = limited.db.parent / "secret.csv"
    secret.write_text("marker\nSECRET-f6\n")
    db = str(limited.db)
    tricks = [
        f"SELECT * FROM query('SELECT * FROM read_blob(''{db}'')')",
        f"SELECT * FROM query('SELECT * FROM query(''SELECT * FROM read_text(''''{secret}'''')'')')",
        f"SELECT json_execute_serialized_sql(json_serialize_sql('SELECT * FROM read_blob(''{db}'')'))",
        f"SELECT * FROM json_execute_serialized_sql(json_serialize_sql('SELECT content FROM read_text(''{secret}'')'))",
        f"SUMMARIZE SELECT * FROM query('SELECT * FROM read_blob(''{db}'')')",
        f"SELECT * FROM query('SELECT * FROM read_csv(''{secret}'')')",
        f"SELECT * FROM query_table('{secret}')",
        f"SELECT * FROM query('SELECT * FROM glob(''{limited.db.parent}/*'')')",
        f"SELECT * FROM query('FROM ''{secret}''')",
    ]
    for sql in tricks:
        result, _ = raw_query(limited, sql)
        assert isinstance(result, grpc.RpcError), (sql, result.to_pylist()[:2])
        assert result.code() == grpc.StatusCode.INVALID_ARGUMENT, (sql, result.details())
        assert "SECRET-f6" not in result.details()


def _ledger_files(db) -> dict[str, tuple[int, int]]:
    files = [db, db.with_name(db.name + ".wal")] + sorted(db.with_name(db.name + ".log").glob("*"))
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in files if p.exists()}


def test_table_functions_that_write_cannot_touch_the_ledger(tmp_path):
    """No query changes any ledger file, whatever it calls (``SELECT * FROM checkpoint()`` would
    write the ledger outside the sandbox)."""
    from tests.integration.conftest import clean_env

    s = start_store(tmp_path / "rollbook.duckdb", env=clean_env(**LIMITED_ENV))
    try:
        with s.client() as client:
            register(client)
            client.submit([traj(f"f7-{i}", n=64) for i in range(200)])
            client.query("SELECT count(*) FROM trajectories")  # the store's own snapshot checkpoint
            before = _ledger_files(s.db)
            for sql in (
                "SELECT * FROM checkpoint()",
                "SELECT * FROM force_checkpoint()",
                "SELECT * FROM checkpoint('memory')",
                "SELECT * FROM truncate_duckdb_logs()",
                "SELECT write_log('x')",
                "SELECT setseed(0.5)",
                "CHECKPOINT",
                "FORCE CHECKPOINT",
                "SELECT * FROM pragma_database_size()",
            ):
                raw_query(s, sql)  # refused by the fence, or harmless on the sandbox's read-only snapshot
                assert _ledger_files(s.db) == before, sql
            assert count(client, "trajectories") == 200
    finally:
        s.kill()


@pytest.mark.parametrize("terms", [1000, 5000])
def test_a_deeply_nested_expression_is_invalid_argument(limited, terms):
    """``SELECT 1+1+...+1`` with 1,000 terms is INVALID_ARGUMENT with a message that says why, never
    UNKNOWN from a Python recursion error."""
    result, _ = raw_query(limited, "SELECT " + "+".join(["1"] * terms) + " AS n")
    assert isinstance(result, grpc.RpcError), result
    assert result.code() == grpc.StatusCode.INVALID_ARGUMENT, (result.code(), result.details())
    assert "depth" in result.details() or "nested" in result.details(), result.details()
    _serving(limited)


def test_sandbox_processes_do_not_outlive_a_killed_server(tmp_path):
    """A SIGKILLed server leaves no sandbox process behind burning CPU on a query."""
    import os
    import threading
    import time

    s = start_store(tmp_path / "rollbook.duckdb")
    try:
        with s.client() as client:
            client.query("SELECT 1")
            threading.Thread(target=lambda: raw_query(s, ENDLESS), daemon=True).start()  # busy when the server dies
            time.sleep(1.0)
        kids = [int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == s.proc.pid]
        assert kids, "no sandbox process was running"
    finally:
        s.kill()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{k}") and _ppid(k) is not None for k in kids):
        time.sleep(0.1)
    assert not [k for k in kids if os.path.exists(f"/proc/{k}") and _ppid(k) is not None]


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[1])


def test_a_store_on_a_relative_ledger_path_answers_queries(tmp_path, monkeypatch):
    """`rollbook run` starts its store on `runs/NAME/rollbook.duckdb`, relative to the working
    directory; the sandbox workers run in their own directories, so every path they get is absolute."""
    from rollbook.run.store_process import StoreProcess

    monkeypatch.chdir(tmp_path)
    store = StoreProcess(pathlib.Path("runs/rel/rollbook.duckdb"))
    try:
        with store.client() as client:
            assert client.query("SELECT 41 + 1 AS answer").column("answer").to_pylist() == [42]
            assert client.query("SELECT count(*) AS n FROM trajectories").column("n").to_pylist() == [0]
    finally:
        store.stop()
