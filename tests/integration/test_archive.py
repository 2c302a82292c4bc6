"""The archive end to end: a real ``rollbook run`` answers every SQL question of ``rollbook report``
and of the README the same after ``rollbook store age`` moved 90% of its trained rows into Parquet;
polars reads those rows in place; a mover killed with SIGKILL at each point of its two-phase move
loses and doubles nothing; a running store ages its ledger on its ``[ageing]`` schedule (and survives
a kill -9 mid-move), while the command refuses the ledger it holds.

Run: ``python -m pytest tests/integration/test_archive.py -q``.
"""

from __future__ import annotations

import json
import math
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollbook.store.archive import CRASH_POINTS
from tests.integration.conftest import MODEL, clean_env, register, rollbook_cli, start_store, traj

ROOT = pathlib.Path(__file__).resolve().parents[2]

# The README's example queries (its command list and its query --db examples), and schema.md's step query.
README_QUERIES = [
    """SELECT step, version, stats->>'$."reward/mean"' AS reward FROM train_steps ORDER BY step""",
    """SELECT step, stats->>'$."kl/mean"' AS kl FROM train_steps ORDER BY step""",
    "SELECT domain, avg(reward) FROM trajectories GROUP BY ALL",
    "SHOW TABLES",
    "SELECT count(*) FROM trajectories",
    "SELECT reason, count(*) FROM rejections GROUP BY ALL",
    "SELECT t.trajectory_id, t.output_versions, t.original_reward, t.reward "
    "FROM leases l JOIN trajectories t USING (trajectory_id) WHERE l.step = 4 AND l.acked_at IS NOT NULL",
]


def _normal(value):
    """Rows compared as sets of values; floats to 12 digits (a sum's order may differ)."""
    if isinstance(value, float):
        return float(f"{value:.12g}") if math.isfinite(value) else value
    if isinstance(value, list):
        return tuple(_normal(v) for v in value)
    return value


def _sql_answers(db: pathlib.Path, queries: list[str]) -> list[list[tuple]]:
    """Each query as ``rollbook query --db`` answers it: a private copy of the ledger (log folded),
    one sandbox process (store/sandbox.py), the statement fence on."""
    from rollbook.cli.query import private_copy
    from rollbook.store.sandbox import FixedSnapshot, SandboxPool
    from rollbook.store.sql import QueryLimits

    with tempfile.TemporaryDirectory(prefix="archive-answers-") as tmp:
        copy = pathlib.Path(tmp) / "snapshot.duckdb"
        private_copy(db, copy)
        pool = SandboxPool(QueryLimits(workers=1, queue=0), pathlib.Path(tmp) / "workers", FixedSnapshot(copy))
        try:
            answers = []
            for q in queries:
                batches = [b for ipc, _ in pool.run(q) for b in pa.ipc.open_stream(pa.py_buffer(ipc)).read_all().to_batches()]
                rows = pa.Table.from_batches(batches).to_pylist() if batches else []
                answers.append(sorted((tuple(_normal(v) for v in r.values()) for r in rows), key=repr))
            return answers
        finally:
            pool.close()


def _live_ids(db: pathlib.Path) -> set[str]:
    con = duckdb.connect(str(db), read_only=True)
    try:
        return {t for (t,) in con.execute("SELECT trajectory_id FROM trajectories").fetchall()}
    finally:
        con.close()


def _recorded(db: pathlib.Path) -> tuple[list[str], list[str]]:
    """(recorded archive files, every trajectory_id in them: a list, so a row twice shows)."""
    con = duckdb.connect(str(db), read_only=True)
    try:
        files = [p for (p,) in con.execute("SELECT path FROM archive_files").fetchall()]
    finally:
        con.close()
    return files, [t for f in files for t in pq.read_table(f, columns=["trajectory_id"]).column("trajectory_id").to_pylist()]


# ---- a real run --------------------------------------------------------------------------------------


def test_a_real_run_answers_the_same_after_ninety_percent_of_its_trained_rows_moved(tmp_path):
    from rollbook.cli.report import SUMMARY_SQL, summarize

    run_dir = tmp_path / "run"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollbook.cli",
            "run",
            "--config",
            "configs/smoke.toml",
            "--run_dir",
            str(run_dir),
            "--num_steps",
            "10",
            "--eval_every",
            "10",
            "--warm_start.student_steps",
            "2",
            "--rollout.num_eval_tasks",
            "4",
            "--rollout.num_prompts",
            "2",
            "--rollout.group_size",
            "4",
            "--trainer.num_samples",
            "8",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    db = run_dir / "rollbook.duckdb"
    queries = [*SUMMARY_SQL.values(), *README_QUERIES]
    before = _sql_answers(db, queries)
    report_before = json.loads((run_dir / "summary.json").read_text())  # rollbook run wrote it at its end
    every_id = _live_ids(db)
    trained = _sql_answers(db, ["SELECT count(*) FROM trajectories WHERE status = 'trained'"])[0][0][0]
    assert trained == 80  # 10 steps of 8
    readme = dict(zip(README_QUERIES, before[len(SUMMARY_SQL) :]))
    assert readme["SELECT count(*) FROM trajectories"] == [(len(every_id),)] and len(readme[README_QUERIES[-1]]) == 8
    assert ("trajectories",) in readme["SHOW TABLES"] and len(readme[README_QUERIES[0]]) == 10

    aged = rollbook_cli("store", "age", "--db", str(db), "--up-to-step", "8")  # steps 0-8 of 0-9: 90%
    assert aged.returncode == 0, aged.stderr
    assert "moved 72 trained row(s)" in aged.stdout and "pl.scan_parquet(" in aged.stdout
    live = _live_ids(db)
    files, archived = _recorded(db)
    assert len(archived) == 72 == 0.9 * trained and len(live) == len(every_id) - 72
    assert set(archived) | live == every_id and not set(archived) & live  # each row once, DuckDB or Parquet
    assert all(pathlib.Path(f).is_relative_to(run_dir / "archive" / "trajectories") for f in files)

    assert _sql_answers(db, queries) == before  # the report's and the README's answers, unchanged
    assert summarize(run_dir) == report_before  # rollbook report's summary.json, unchanged

    import polars as pl

    frame = pl.scan_parquet(str(run_dir / "archive" / "trajectories" / "**" / "*.parquet"), hive_partitioning=True)
    counted = frame.select(pl.len()).collect().item()
    endpoint = _sql_answers(db, ["SELECT sum(num_rows) FROM archive_files", "SELECT count(*) FROM trajectories"])
    assert counted == endpoint[0][0][0] == endpoint[1][0][0] - len(live) == 72
    assert set(frame.select("trajectory_id").collect()["trajectory_id"].to_list()) == set(archived)


# ---- kill -9 of the mover ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_ledger(tmp_path_factory) -> tuple[pathlib.Path, set[str], set[str]]:
    """A stopped ledger: 40 rows of two models, 32 of them trained at steps 0-3; returns (file, all
    ids, the ids trained at steps 0-2)."""
    from rollbook.store.ledger import Ledger
    from rollbook.trajectories import trajectory_from_dict
    from rollbook.v1 import rollbook_pb2 as pb

    db = tmp_path_factory.mktemp("kill") / "rollbook.duckdb"
    ledger = Ledger(db)
    models = (MODEL, "other/model")
    for m in models:
        ledger.register_model(m, 512)
        ledger.publish_version(m, 0, "c0")
    ledger.submit([trajectory_from_dict(traj(f"k-{m[0]}-{i:02d}", model_id=m)) for m in models for i in range(20)])
    ledger.flush()
    early: set[str] = set()
    for step in range(4):
        for m in models:
            batch = ledger.pull_batch(pb.PullBatchRequest(trainer_id="t", model_id=m, num_samples=4, step=step, max_staleness=5))
            ledger.ack_batch(batch.lease_id, "t")
            if step <= 2:
                early |= set(batch.table.column("trajectory_id").to_pylist())
    ledger.close()
    return db, _live_ids(db), early


@pytest.mark.parametrize("point", CRASH_POINTS)
def test_a_mover_killed_at_each_point_loses_and_doubles_nothing(trained_ledger, tmp_path, point):
    template, every_id, early = trained_ledger
    db = tmp_path / "rollbook.duckdb"
    shutil.copyfile(template, db)
    root = tmp_path / "shared-archive"
    args = ("store", "age", "--db", str(db), "--up-to-step", "2", "--to", str(root))

    killed = rollbook_cli(*args, env=clean_env(ROLLBOOK_ARCHIVE_CRASH_AT=point))
    assert killed.returncode == -9, (killed.returncode, killed.stderr[-2000:])
    on_disk = {p for p in root.rglob("*") if p.is_file()}
    if point in ("writing", "written"):
        assert on_disk and all(p.name.endswith(".tmp") for p in on_disk)  # temporary names only
    if point == "renamed":
        assert on_disk and all(p.suffix == ".parquet" for p in on_disk)  # in place, never recorded
    # before anyone cleans up: every row exactly once, in DuckDB or in a recorded file
    live = _live_ids(db)
    files, archived = _recorded(db)
    assert len(archived) == len(set(archived)) and set(archived) | live == every_id and not set(archived) & live
    assert set(archived) == (early if point == "committed" else set())
    assert _sql_answers(db, ["SELECT count(*), count(DISTINCT trajectory_id) FROM trajectories"])[0] == [
        (len(every_id), len(every_id))
    ]

    again = rollbook_cli(*args)  # opening the ledger rolls the cut move back, then this move completes
    assert again.returncode == 0, again.stderr
    live = _live_ids(db)
    files, archived = _recorded(db)
    assert sorted(archived) == sorted(early) and live == every_id - early
    assert {p for p in root.rglob("*") if p.is_file()} == {pathlib.Path(f) for f in files}  # no stray file
    con = duckdb.connect(str(db), read_only=True)
    try:
        assert con.execute("SELECT count(*) FROM _archive_moves").fetchone() == (0,)
    finally:
        con.close()


# ---- the running store ---------------------------------------------------------------------------------


def _archived(client) -> int:
    return json.loads(client.stats().stats_json)["archived"]


def test_the_running_store_ages_on_its_schedule_survives_a_kill_mid_move_and_holds_its_ledger(tmp_path, stores):
    db = tmp_path / "rollbook.duckdb"
    config = tmp_path / "store.toml"
    config.write_text("[ageing]\ninterval_s = 0.2\nkeep_steps = 0\n")
    store = start_store(db, args=("--config", str(config)), env=clean_env(ROLLBOOK_ARCHIVE_CRASH_AT="renamed"))
    stores.append(store)
    ids = [f"sched-{i:02d}" for i in range(20)]
    with store.client() as client:
        register(client)
        client.submit([traj(t) for t in ids])
        batch = client.pull_batch(model_id=MODEL, trainer_id="t", num_samples=12, step=0, max_staleness=5)
        client.ack_batch(batch.lease_id, "t")
    moved = set(batch.table.column("trajectory_id").to_pylist())
    assert store.proc.wait(timeout=60) == -9  # the schedule's first move killed its store after the rename
    live = _live_ids(db)
    files, archived = _recorded(db)
    assert live == set(ids) and archived == [] and any(root.suffix == ".parquet" for root in (tmp_path / "archive").rglob("*"))

    store = start_store(db, args=("--config", str(config)))  # rolls the move back, then moves again
    stores.append(store)
    with store.client() as client:
        deadline = time.monotonic() + 60
        while _archived(client) < len(moved) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _archived(client) == len(moved) and client.stats().accepted == len(ids)
        assert client.query("SELECT count(*) AS n FROM trajectories").to_pylist() == [{"n": len(ids)}]
        path = client.query("SELECT path FROM archive_files").column("path")[0].as_py()
        with pytest.raises(Exception, match=r"read_parquet\(\) is not allowed"):
            client.query(f"SELECT count(*) FROM read_parquet('{path}')")
        held = rollbook_cli("store", "age", "--db", str(db), "--older-than", "0")
        assert held.returncode == 1 and "held by another process" in held.stderr, held.stderr
    store.terminate()
    live = _live_ids(db)
    files, archived = _recorded(db)
    assert sorted(archived) == sorted(moved) and live == set(ids) - moved
    assert {p for p in (tmp_path / "archive").rglob("*") if p.is_file()} == {pathlib.Path(f) for f in files}
