"""The archive: trained rows moved out of the ledger's DuckDB file into hive-partitioned Parquet
(store/archive.py), each row exactly once in one or the other, still read through the same table
names by the SQL sandbox, and still known to the ledger (idempotency, SetReward, counters).

The kill -9 tests of the move, a real run's report and README answers, and the running store's
schedule are in tests/integration/test_archive.py.

Run: ``python -m pytest tests/unit/store/test_archive.py -q``.
"""

from __future__ import annotations

import pathlib
import time
import urllib.parse

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollbook.config import AgeingConfig
from rollbook.store import archive
from rollbook.store.archive import Criterion
from rollbook.store.ledger import ACCEPTED, DUPLICATE, Ledger, NotRewardable
from rollbook.store.sandbox import SandboxPool, Snapshots
from rollbook.store.sql import QueryError, QueryLimits
from rollbook.trajectories import trajectory_from_dict
from rollbook.v1 import rollbook_pb2 as pb

MODEL = "m"
ODD_MODEL = "org/m=1 x%"  # a slash, an equals sign, a space and a percent sign: one folder, decoded back
TRAINER = "t0"


def row(tid: str, *, model_id: str = MODEL, n: int = 4, **fields):
    t = dict(
        trajectory_id=tid,
        session_id=f"s-{tid}",
        request_id=f"r-{tid}",
        model_id=model_id,
        output_token_ids=list(range(n)),
        output_logprobs=[-1.0] * n,
        output_versions=[0] * n,
        temperature=1.0,
        top_p=1.0,
        reward=float(len(tid) % 3),
        created_at=1.0,
        domain="arithmetic" if len(tid) % 2 else "reverse",
    )
    t.update(fields)
    return trajectory_from_dict(t)


def open_ledger(db: pathlib.Path) -> Ledger:
    ledger = Ledger(db, fold_interval_s=3600)  # no background folds: tests fold explicitly
    for model in (MODEL, ODD_MODEL):
        ledger.register_model(model, 100)
        ledger.publish_version(model, 0, "c0")
    return ledger


def train_step(ledger: Ledger, step: int, model_id: str, n: int) -> list[str]:
    """Lease ``n`` ready rows of ``model_id`` for ``step`` and ack them; their ids."""
    batch = ledger.pull_batch(
        pb.PullBatchRequest(trainer_id=TRAINER, model_id=model_id, num_samples=n, step=step, max_staleness=10)
    )
    ledger.ack_batch(batch.lease_id, TRAINER)
    return batch.table.column("trajectory_id").to_pylist()


def sql(ledger: Ledger, query: str, params: list | None = None) -> list[tuple]:
    cur = ledger.cursor()
    try:
        return cur.execute(query, params or []).fetchall()
    finally:
        cur.close()


def live_ids(ledger: Ledger) -> set[str]:
    return {t for (t,) in sql(ledger, "SELECT trajectory_id FROM trajectories")}


def archive_ids(ledger: Ledger) -> list[str]:
    """Every id in the recorded Parquet files (a list: a row twice would show)."""
    paths = [p for (p,) in sql(ledger, "SELECT path FROM archive_files")]
    return [t for p in paths for t in pq.read_table(p, columns=["trajectory_id"]).column("trajectory_id").to_pylist()]


@pytest.fixture
def trained(tmp_path):
    """A ledger with rows of two models trained at steps 0-2 (4 per step and model) and 6 more
    waiting; yields ``(ledger, {step: ids})``."""
    ledger = open_ledger(tmp_path / "rollbook.duckdb")
    ledger.submit([row(f"a{i:02d}") for i in range(15)] + [row(f"b{i:02d}", model_id=ODD_MODEL) for i in range(15)])
    ledger.flush()
    steps = {s: train_step(ledger, s, MODEL, 4) + train_step(ledger, s, ODD_MODEL, 4) for s in range(3)}
    yield ledger, steps
    if not ledger._stop.is_set():  # a test that reopens the file closed it already
        ledger.close()


def test_trained_rows_up_to_a_step_move_into_hive_partitions_and_leave_duckdb(trained, tmp_path):
    ledger, steps = trained
    moved_expected = set(steps[0] + steps[1])
    before = live_ids(ledger)
    result = ledger.age(Criterion(up_to_step=1))
    assert result.rows == len(moved_expected) == 16 and result.moves == 1
    assert live_ids(ledger) == before - moved_expected  # the rest, untrained rows included, stays
    assert sorted(archive_ids(ledger)) == sorted(moved_expected)  # each moved row once
    root = tmp_path / "archive"
    assert result.root == str(root)
    day = time.strftime("%Y-%m-%d", time.gmtime())
    folders = {pathlib.Path(f).parent.relative_to(root) for f in result.files}
    assert folders == {
        pathlib.Path("trajectories", f"model_id={MODEL}", f"date={day}"),
        pathlib.Path("trajectories", f"model_id={urllib.parse.quote(ODD_MODEL, safe='')}", f"date={day}"),
    }
    assert not list(root.rglob(".*.tmp"))  # no temporary name left
    for path in result.files:  # a file alone is whole: every column of `trajectories`, model and status
        table = pq.read_table(path)
        assert table.column_names == [c for (c,) in sql(ledger, "SELECT name FROM pragma_table_info('trajectories')")]
        assert set(table.column("status").to_pylist()) == {"trained"}
    files = sql(ledger, "SELECT model_id, date::VARCHAR, num_rows FROM archive_files ORDER BY model_id")
    assert files == [(MODEL, day, 8), (ODD_MODEL, day, 8)]
    assert ledger.age(Criterion(up_to_step=1)).rows == 0  # nothing left to move twice


def test_trained_rows_older_than_an_age_move_and_younger_ones_stay(trained):
    ledger, steps = trained
    with ledger._transaction() as con:  # step 0 trained eight days ago
        lease = sql(ledger, "SELECT DISTINCT lease_id FROM leases WHERE step = 0")
        con.executemany("UPDATE leases SET acked_at = acked_at - 8 * 86400 WHERE lease_id = ?", lease)
    assert ledger.age(Criterion(older_than_s=7 * 86400)).rows == len(steps[0])
    assert sorted(archive_ids(ledger)) == sorted(steps[0])
    assert ledger.age(Criterion(older_than_s=7 * 86400)).rows == 0
    assert ledger.age(Criterion(older_than_s=0)).rows == len(steps[1]) + len(steps[2])
    assert {s for (s,) in sql(ledger, "SELECT DISTINCT status FROM trajectories")} == {"ready"}


def test_a_large_move_is_cut_into_several_complete_moves_and_max_rows_caps_it(trained):
    ledger, steps = trained
    cut = ledger.age(Criterion(up_to_step=0, max_rows=5))
    assert cut.rows == 5 and set(archive_ids(ledger)) < set(steps[0])
    small = archive.move(
        ledger.cursor, ledger._transaction, Criterion(up_to_step=2), ledger.db_path.parent / "archive", move_bytes=1
    )
    assert small.moves == small.rows == 24 - 5  # one row per move when a row alone passes the budget
    assert sorted(archive_ids(ledger)) == sorted(steps[0] + steps[1] + steps[2])
    assert not sql(ledger, "SELECT * FROM _archive_moves")


def test_a_moved_row_stays_an_id_seen_counted_and_unrewardable_after_a_restart(trained, tmp_path):
    ledger, steps = trained
    before = ledger.stats()
    pulled_before = ledger.pull_batch(pb.PullBatchRequest(trainer_id=TRAINER, model_id=MODEL, num_samples=1, step=9))
    ledger.age(Criterion(up_to_step=2))
    after = ledger.stats()
    assert (after["accepted"], after["accepted_tokens"]) == (before["accepted"], before["accepted_tokens"])
    assert after["archived"] == 24 and after["archive_files"] == 2
    pulled_after = ledger.pull_batch(pb.PullBatchRequest(trainer_id=TRAINER, model_id=MODEL, num_samples=1, step=10))
    assert pulled_after.stats["ledger"] == pulled_before.stats["ledger"]  # masked_token_ratio counts moved rows
    ledger.close()
    ledger = open_ledger(tmp_path / "rollbook.duckdb")  # the idempotency index comes back from _archive_index
    try:
        moved = steps[0][0]
        assert [o.status for o in ledger.submit([row(moved), row("new-one")])] == [DUPLICATE, ACCEPTED]
        with pytest.raises(NotRewardable, match="moved to the archive"):
            ledger.set_reward(1.0, trajectory_id=moved)
        with pytest.raises(NotRewardable, match="moved to the archive"):  # the session's last call moved
            ledger.set_reward(1.0, session_id=f"s-{moved}")
        assert ledger.stats()["accepted"] == before["accepted"] + 1
    finally:
        ledger.close()


def test_a_session_reward_goes_to_a_later_call_still_in_the_ledger(tmp_path):
    ledger = open_ledger(tmp_path / "rollbook.duckdb")
    try:
        ledger.submit([row("first", session_id="s", request_id="r1", created_at=1.0)])
        ledger.flush()
        train_step(ledger, 0, MODEL, 1)
        ledger.submit([row("second", session_id="s", request_id="r2", created_at=2.0, reward=None)])
        ledger.age(Criterion(up_to_step=0))
        assert ledger.set_reward(0.5, session_id="s") == "second"
    finally:
        ledger.close()


def test_a_move_that_fails_before_its_commit_leaves_every_row_in_duckdb_and_no_file(trained, monkeypatch):
    ledger, steps = trained
    written: list[pathlib.Path] = []
    real = archive._write_file

    def fail_on_second(table, path):
        if written:
            raise OSError(28, "No space left on device")
        written.append(path)
        return real(table, path)

    monkeypatch.setattr(archive, "_write_file", fail_on_second)
    before = live_ids(ledger)
    with pytest.raises(OSError, match="No space"):
        ledger.age(Criterion(up_to_step=2))
    assert live_ids(ledger) == before and archive_ids(ledger) == []
    assert not [p for p in (ledger.db_path.parent / "archive").rglob("*") if p.is_file()]
    assert not sql(ledger, "SELECT * FROM _archive_moves")


def test_opening_the_ledger_rolls_back_a_move_that_never_committed(trained, tmp_path):
    """What a kill -9 between the plan and the commit leaves (the integration test kills a real
    mover at each point): a plan, a renamed file and a temporary one; on open both files go, the
    plan goes, and the rows never left DuckDB."""
    ledger, _ = trained
    before = live_ids(ledger)
    folder = archive.partition_dir(tmp_path / "archive", "trajectories", MODEL, archive._EPOCH)
    renamed, torn = folder / "part-x-0000.parquet", folder / "part-x-0001.parquet"
    with ledger._transaction() as con:
        con.execute("INSERT INTO _archive_moves VALUES ('x', ?, 0)", [[str(renamed), str(torn)]])
    folder.mkdir(parents=True)
    pq.write_table(pa.table({"trajectory_id": sorted(before)}), renamed)
    archive.temporary_name(torn).write_bytes(b"PAR1 torn")
    ledger.close()
    reopened = open_ledger(tmp_path / "rollbook.duckdb")
    try:
        assert not renamed.exists() and not archive.temporary_name(torn).exists()
        assert not sql(reopened, "SELECT * FROM _archive_moves")
        assert live_ids(reopened) == before and archive_ids(reopened) == []
    finally:
        reopened.close()


def _answers(pool: SandboxPool, queries: list[str]) -> list[list[tuple]]:
    out = []
    for q in queries:
        table = pa.Table.from_batches(
            [b for ipc, _ in pool.run(q) for b in pa.ipc.open_stream(pa.py_buffer(ipc)).read_all().to_batches()]
        )
        out.append(sorted(tuple(r.values()) for r in table.to_pylist()))
    return out


QUERIES = [
    "SHOW TABLES",
    "SELECT count(*), sum(num_output_tokens), sum(reward), count(DISTINCT trajectory_id) FROM trajectories",
    "SELECT model_id, domain, status, count(*), min(trajectory_id), max(output_token_ids) FROM trajectories GROUP BY ALL",
    "SELECT l.step, count(*), sum(t.num_output_tokens) FROM leases l JOIN trajectories t USING (trajectory_id) GROUP BY ALL",
    "SELECT * FROM trajectories WHERE trajectory_id = 'a03'",
    "SELECT column_name, column_type FROM (DESCRIBE trajectories)",
]


def test_the_sandbox_reads_moved_rows_through_the_same_names_and_users_still_cannot_read_files(trained, tmp_path):
    ledger, _ = trained
    snapshots = Snapshots(ledger, tmp_path / "snapshots")
    pools = {
        fence: SandboxPool(QueryLimits(workers=1, queue=0, fence=fence), tmp_path / f"w-{fence}", snapshots)
        for fence in (True, False)
    }
    try:
        before = _answers(pools[True], QUERIES)
        ledger.age(Criterion(up_to_step=2))
        assert len(archive_ids(ledger)) == 24 and len(live_ids(ledger)) == 6
        assert _answers(pools[True], QUERIES) == before
        assert _answers(pools[False], QUERIES) == before
        path = sql(ledger, "SELECT path FROM archive_files LIMIT 1")[0][0]
        content = pathlib.Path(path).read_bytes()
        with pytest.raises(QueryError, match=r"read_parquet\(\) is not allowed"):  # the fence
            list(pools[True].run(f"SELECT count(*) FROM read_parquet('{path}')"))
        for statement in (  # without the fence, DuckDB itself: no file is reachable
            f"SELECT count(*) FROM read_parquet('{path}')",
            f"SELECT count(*) FROM read_blob('{path}')",
            f"COPY (SELECT 1 AS x) TO '{path}' (FORMAT parquet, USE_TMP_FILE false)",
        ):
            with pytest.raises(QueryError, match="disabled by config"):
                list(pools[False].run(statement))
        assert pathlib.Path(path).read_bytes() == content
        list(pools[False].run("DETACH ledger"))  # a query that drops the snapshot: the next one reopens it
        assert _answers(pools[False], QUERIES[1:2]) == before[1:2]
    finally:
        for pool in pools.values():
            pool.close()


def test_polars_reads_the_archive_in_place_with_hive_partitions(trained, tmp_path):
    import polars as pl

    ledger, _ = trained
    ledger.age(Criterion(up_to_step=1), tmp_path / "shared")
    frame = pl.scan_parquet(str(tmp_path / "shared" / "trajectories" / "**" / "*.parquet"), hive_partitioning=True).collect()
    assert frame.height == 16 == sum(n for (n,) in sql(ledger, "SELECT num_rows FROM archive_files"))
    assert sorted(frame["model_id"].unique().to_list()) == sorted([MODEL, ODD_MODEL])
    assert frame["date"].dtype == pl.Date
    assert sorted(frame["trajectory_id"].to_list()) == sorted(archive_ids(ledger))


def test_the_schedule_moves_rows_of_every_step_but_the_newest_and_stops_with_the_ledger(trained):
    ledger, steps = trained
    schedule = archive.Schedule(ledger, AgeingConfig(interval_s=0.05, keep_steps=1)).start()
    deadline = time.monotonic() + 30
    while schedule.passes < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(archive_ids(ledger)) == sorted(steps[0] + steps[1])
    assert schedule.stop in ledger._close_hooks  # Ledger.close stops it first
    schedule.stop()
    assert not schedule._thread.is_alive()


def test_the_ageing_config_needs_one_criterion_to_run():
    assert AgeingConfig().interval_s == 0  # off by default
    with pytest.raises(ValueError, match="older_than_s or keep_steps"):
        AgeingConfig(interval_s=60)
    with pytest.raises(ValueError, match="not both"):
        AgeingConfig(interval_s=60, older_than_s=3600, keep_steps=2)
    with pytest.raises(ValueError, match="exactly one"):
        Criterion()


def test_durations_for_the_command():
    from rollbook.cli.age import parse_duration

    assert parse_duration("7d") == 7 * 86400 and parse_duration("36h") == 36 * 3600 and parse_duration("90") == 90
    assert parse_duration("1.5w") == 1.5 * 604800 and parse_duration("15m") == 900
    with pytest.raises(Exception, match="not a duration"):
        parse_duration("a week")
