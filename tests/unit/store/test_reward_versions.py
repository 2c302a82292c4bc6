"""Named reward versions' tables (store/reward_versions.py): what a start records, the refusal of a
name reused for another reward, batch writes whose counters always equal the rows, the skip of scored
rows that makes a resume score each row once, and the primary key that refuses a second score.

Run: ``python -m pytest tests/unit/store/test_reward_versions.py -q``.
"""

from __future__ import annotations

import duckdb
import pyarrow as pa
import pytest

from rollbook.store import reward_versions as rv
from rollbook.store.ledger import Ledger
from rollbook.trajectories import trajectory_from_dict

MODEL = "m"
SPEC = rv.VersionSpec("v1", "math", '{"kind": "math"}', "domain = 'a'", "toy character tokenizer", "toy tasks")


def traj(tid: str, reward: float = 1.0):
    return trajectory_from_dict(
        dict(
            trajectory_id=tid,
            model_id=MODEL,
            domain="a",
            output_token_ids=[3, 4],
            output_logprobs=[-1.0, -1.0],
            output_versions=[0, 0],
            temperature=1.0,
            top_p=1.0,
            reward=reward,
        )
    )


@pytest.fixture
def ledger(tmp_path):
    led = Ledger(tmp_path / "l.duckdb", fold_interval_s=3600)
    led.register_model(MODEL, 100)
    led.publish_version(MODEL, 0, "c0")
    led.submit([traj(f"t{i}", reward=float(i)) for i in range(10)])
    led.flush()
    yield led
    led.close()


def scores(ids: list[str], status: str = "ok") -> pa.Table:
    return pa.table(
        {
            "trajectory_id": pa.array(ids, pa.string()),
            "reward": pa.array([0.5 if status == "ok" else None] * len(ids), pa.float64()),
            "status": pa.array([status] * len(ids), pa.string()),
            "error": pa.array([None if status == "ok" else "ValueError: no"] * len(ids), pa.string()),
            "info": pa.array(['{"reason": "wrong"}'] * len(ids), pa.string()),
        }
    )


def read(ledger: Ledger, sql: str, params: list | None = None) -> list[tuple]:
    cur = ledger.cursor()
    try:
        return cur.execute(sql, params or []).fetchall()
    finally:
        cur.close()


def unscored(ledger: Ledger, name: str, selected: list[str]) -> set[str]:
    cur = ledger.cursor()
    try:
        cur.register("_sel", pa.table({"trajectory_id": pa.array(selected, pa.string())}))
        return {t for (t,) in cur.execute(rv.unscored_sql("_sel"), {"name": name}).fetchall()}
    finally:
        cur.close()


def test_every_ledger_has_both_tables_empty(ledger):
    assert read(ledger, "SELECT count(*) FROM reward_versions") == [(0,)]
    assert read(ledger, "SELECT count(*) FROM reward_version_runs") == [(0,)]
    columns = [c for (c,) in read(ledger, "SELECT column_name FROM duckdb_columns() WHERE table_name = 'reward_versions'")]
    assert columns == ["name", "trajectory_id", "reward", "status", "error", "info", "scored_at"]


def test_a_start_records_the_version_and_a_batch_adds_rows_and_counts_in_one_transaction(ledger):
    with ledger.transaction() as con:
        state = rv.begin(con, SPEC, selected=10, now=1.0)
    assert (state.scored, state.errors, state.starts, state.finished) == (0, 0, 1, False)
    with ledger.transaction() as con:
        assert rv.write(con, "v1", scores(["t0", "t1", "t2"]), now=2.0) == (3, 0)
    with ledger.transaction() as con:
        assert rv.write(con, "v1", scores(["t3"], status="error"), now=3.0) == (1, 1)
    rows = read(ledger, "SELECT trajectory_id, reward, status, error, info->>'reason' FROM reward_versions ORDER BY 1")
    assert rows == [
        ("t0", 0.5, "ok", None, "wrong"),
        ("t1", 0.5, "ok", None, "wrong"),
        ("t2", 0.5, "ok", None, "wrong"),
        ("t3", None, "error", "ValueError: no", "wrong"),
    ]
    after = rv.state(ledger.cursor(), "v1")
    assert after is not None and (after.selected, after.scored, after.errors, after.finished) == (10, 4, 1, False)
    assert after.spec == SPEC
    with ledger.transaction() as con:
        rv.finish(con, "v1", now=4.0)
    assert read(ledger, "SELECT finished_at, updated_at FROM reward_version_runs") == [(4.0, 4.0)]


def test_a_batch_rolled_back_leaves_neither_rows_nor_counts(ledger):
    with ledger.transaction() as con:
        rv.begin(con, SPEC, selected=10, now=1.0)
    with pytest.raises(RuntimeError), ledger.transaction() as con:
        rv.write(con, "v1", scores(["t0", "t1"]), now=2.0)
        raise RuntimeError("killed between the insert and the commit")
    assert read(ledger, "SELECT count(*) FROM reward_versions") == [(0,)]
    assert read(ledger, "SELECT scored, errors FROM reward_version_runs") == [(0, 0)]


def test_unscored_leaves_out_scored_rows_other_versions_rows_and_ids_not_in_the_ledger(ledger):
    selected = ["t0", "t1", "t2", "t3", "gone"]  # "gone": moved to the archive, or never stored
    with ledger.transaction() as con:
        rv.begin(con, SPEC, selected=4, now=1.0)
        rv.begin(con, rv.VersionSpec("other", "exact", "{}", "TRUE"), selected=10, now=1.0)
        rv.write(con, "v1", scores(["t0", "t2"]), now=2.0)
        rv.write(con, "other", scores(["t1"]), now=2.0)
    assert unscored(ledger, "v1", selected) == {"t1", "t3"}
    assert unscored(ledger, "other", selected) == {"t0", "t2", "t3"}


def test_a_second_score_for_the_same_row_is_refused_by_the_primary_key(ledger):
    with ledger.transaction() as con:
        rv.begin(con, SPEC, selected=10, now=1.0)
        rv.write(con, "v1", scores(["t0"]), now=2.0)
    with pytest.raises(duckdb.ConstraintException), ledger.transaction() as con:
        rv.write(con, "v1", scores(["t0"]), now=3.0)
    assert read(ledger, "SELECT count(*), max(scored) FROM reward_versions, reward_version_runs") == [(1, 1)]


def test_a_resume_needs_the_same_reward_settings_and_predicate(ledger):
    with ledger.transaction() as con:
        rv.begin(con, SPEC, selected=10, now=1.0)
        rv.write(con, "v1", scores(["t0", "t1"]), now=2.0)
        rv.finish(con, "v1", now=2.5)
    with ledger.transaction() as con:  # the same version again: one more start, the counts kept, not finished
        again = rv.begin(con, rv.VersionSpec("v1", "math", '{"kind": "math"}', "domain = 'a'", "moved tokenizer"), 12, now=3.0)
    assert (again.scored, again.starts, again.selected, again.finished) == (2, 2, 12, True)
    assert read(ledger, "SELECT finished_at, tokenizer FROM reward_version_runs") == [(None, "moved tokenizer")]
    for other in (
        rv.VersionSpec("v1", "exact", '{"kind": "math"}', "domain = 'a'"),
        rv.VersionSpec("v1", "math", '{"kind": "math", "timeout_s": 1}', "domain = 'a'"),
        rv.VersionSpec("v1", "math", '{"kind": "math"}', "TRUE"),
    ):
        with pytest.raises(rv.VersionMismatch, match="another --name"), ledger.transaction() as con:
            rv.begin(con, other, selected=10, now=4.0)
    assert read(ledger, "SELECT starts FROM reward_version_runs") == [(2,)]


@pytest.mark.parametrize("name", ["", "has space", "quote'", "-lead", "x" * 129, "semi;colon"])
def test_names_are_plain(name):
    with pytest.raises(ValueError, match="reward version name"):
        rv.check_name(name)


def test_original_rewards_stay_as_they_were(ledger):
    before = read(ledger, "SELECT trajectory_id, original_reward, reward, status FROM trajectories ORDER BY 1")
    with ledger.transaction() as con:
        rv.begin(con, SPEC, selected=10, now=1.0)
        rv.write(con, "v1", scores([f"t{i}" for i in range(10)]), now=2.0)
    assert read(ledger, "SELECT trajectory_id, original_reward, reward, status FROM trajectories ORDER BY 1") == before


def test_a_ledger_serving_a_version_normalizes_its_rewards_and_serves_only_groups_it_scores_whole(tmp_path):
    from rollbook.config import ValidatorConfig
    from rollbook.v1 import rollbook_pb2 as pb

    led = Ledger(tmp_path / "v.duckdb", fold_interval_s=3600, validator_config=ValidatorConfig(reward_version="v1"))
    try:
        led.register_model(MODEL, 100)
        led.publish_version(MODEL, 0, "c0")
        led.submit([trajectory_from_dict(_fields(t, g)) for t, g in (("a1", "ga"), ("a2", "ga"), ("b1", "gb"), ("b2", "gb"))])
        led.flush()
        with led.transaction() as con:
            rv.begin(con, SPEC, selected=4, now=1.0)
            ok = scores(["a1", "a2", "b1"])
            ok = ok.set_column(1, "reward", pa.array([3.0, 1.0, 5.0], pa.float64()))
            rv.write(con, "v1", ok, now=2.0)
            rv.write(con, "v1", scores(["b2"], status="error"), now=2.0)  # gb has a member without a score: it waits
        batch = led.pull_batch(pb.PullBatchRequest(model_id=MODEL, trainer_id="t", num_samples=10, max_staleness=5))
        served = dict(zip(batch.table.column("trajectory_id").to_pylist(), batch.table.column("reward").to_pylist()))
        assert served == pytest.approx({"a1": 1.0, "a2": -1.0}, abs=1e-5)  # (3, 1): mean 2, std 1
        assert batch.table.column("original_reward").to_pylist() == [1.0, 1.0]
        assert batch.stats["reward_version"] == "v1" and batch.stats["reward/mean_before"] == 2.0
        assert read(led, "SELECT trajectory_id, status FROM trajectories WHERE group_id = 'gb' ORDER BY 1") == [
            ("b1", "ready"),
            ("b2", "ready"),
        ]
    finally:
        led.close()


def _fields(tid: str, group_id: str) -> dict:
    return dict(
        trajectory_id=tid,
        model_id=MODEL,
        domain="a",
        group_id=group_id,
        group_size=2,
        output_token_ids=[3, 4],
        output_logprobs=[-1.0, -1.0],
        output_versions=[0, 0],
        temperature=1.0,
        top_p=1.0,
        reward=1.0,
    )
