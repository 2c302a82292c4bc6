"""The read-only SQL endpoint: what it refuses, its row cap and timeout, and ``rollbook query``
through the server and straight on the file (including acknowledged rows still in the log after
a kill -9), in every output format.

Run: ``python -m pytest tests/integration/test_sql_sandbox.py -q``.
"""

from __future__ import annotations

import csv
import io
import json

import duckdb
import grpc
import pyarrow.parquet as pq
import pytest

from rollbook import cli
from tests.integration.conftest import (
    count, query_file, register, rollbook_cli, rows, rpc_error, start_store, traj,
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
        for sql in (f"SELECT * FROM read_blob('{db}')", f"SELECT * FROM '{db}'", f"SELECT * FROM read_text('{db}.wal')",
                    f"SELECT (SELECT size FROM read_blob('{db}')) AS s", f"EXPLAIN SELECT * FROM read_blob('{db}')"):
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
    assert "Parser Error: syntax error at or near \"SELEC\"" in err.details()
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


def test_a_query_past_its_timeout_is_interrupted_and_the_server_keeps_serving(store):
    with store.client() as client:
        err = rpc_error(lambda: client.query(ENDLESS, timeout_s=1.0))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "exceeded its timeout of 1 s" in err.details()
        assert client.query("SELECT count(*) AS n FROM trajectories").to_pylist() == [{"n": 30}]
    done = rollbook_cli("query", "--server", store.address, "--timeout", "1", ENDLESS)
    assert done.returncode != 0 and "exceeded its timeout" in done.stderr


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


SQL_OFFLINE = ("SELECT trajectory_id, num_output_tokens, output_versions, reward FROM trajectories "
               "ORDER BY trajectory_id")
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
    for sql in ("DROP TABLE trajectories", f"COPY trajectories TO '{tmp_path}/x.csv'", f"SELECT nextval('{SEQUENCE}')",
                f"ATTACH '{tmp_path}/y.duckdb'", "SELECT * FROM read_csv('/etc/passwd')", "SELECT 1; SELECT 2",
                "SET enable_external_access = true", "INSTALL httpfs"):
        assert cli.main(["query", "--db", str(offline_db), sql]) != 0, sql
        out, err = capsys.readouterr()
        assert out == "" and "rollbook query: error:" in err, sql
        assert "does not exist" not in err, sql  # refused, not merely missing
    assert not (tmp_path / "x.csv").exists() and not (tmp_path / "y.duckdb").exists()
    assert len(query_file(offline_db, "SELECT * FROM trajectories")) == 3


def test_query_db_sees_acknowledged_rows_the_killed_server_had_not_folded(tmp_path, stores):
    db = tmp_path / "rollbook.duckdb"
    acked: list[str] = []
    rejected: list[str] = []
    for attempt in range(4):  # the fold could win the race with SIGKILL; then submit and kill again
        stores.append(s := start_store(db))
        with s.client() as client:
            if attempt == 0:
                register(client)
            batch = [traj(f"unfolded-{attempt}-{i}") for i in range(50)] + [traj(f"unfolded-{attempt}-nan", output_logprobs=[float("nan")] * 16)]
            result = client.submit(batch, batch_size=10)
        s.kill()  # SIGKILL right after the acknowledgement: the folder waits for an idle pause first
        acked += [t for t, v in result.verdicts.items() if v.reason == ""]
        rejected += [t for t, v in result.verdicts.items() if v.reason]
        done = rollbook_cli("query", "--db", str(db), "--format", "json",
                            "SELECT count(*) AS n, count(DISTINCT trajectory_id) AS d FROM trajectories")
        assert done.returncode == 0, done.stderr
        if "not yet folded" in done.stderr:
            break
    else:
        pytest.fail("every SIGKILL came after the fold; the log overlay was never exercised")
    assert json.loads(done.stdout) == {"n": len(acked), "d": len(acked)}
    assert {r["trajectory_id"] for r in query_file(db, "SELECT trajectory_id FROM trajectories")} == set(acked)
    assert {r["trajectory_id"]: r["reason"] for r in query_file(db, "SELECT trajectory_id, reason FROM rejections")} == {
        t: "NONFINITE_LOGPROB" for t in rejected}

    # the restarted store replays the same log batches exactly once
    stores.append(s := start_store(db))
    with s.client() as client:
        assert rows(client, "SELECT count(*) AS n, count(DISTINCT trajectory_id) AS d FROM trajectories") == [
            {"n": len(acked), "d": len(acked)}]
        assert client.submit([traj(acked[0])]).duplicates == 1
    assert s.terminate() == 0
    done = rollbook_cli("query", "--db", str(db), "--format", "json", "SELECT count(*) AS n FROM trajectories")
    assert json.loads(done.stdout) == {"n": len(acked)} and "not yet folded" not in done.stderr
