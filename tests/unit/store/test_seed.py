"""Seeding a new ledger with stored groups of another (store/seed.py): whole groups only, each left-out
group counted by why (cut by the selection, a member without a reward, still waiting for members, in
the archive), rows copied as stored except their model, served reward, status and arrival time, the
source order kept, epochs as suffixed copies, a reward version copied with its rows, the refusals
(an unknown version, several models), and a store opening the seeded file and serving it through the
ordinary pull: leases, normalization over the stored groups, from the version when asked.

The source is a real ledger (``Ledger.submit``: the ingest path), with a group trained and acked.

Run: ``python -m pytest tests/unit/store/test_seed.py -q``.
"""

from __future__ import annotations

import pyarrow as pa
import pytest

from rollbook.config import NormConfig, ValidatorConfig
from rollbook.config.run import REPLAY_MAX_STALENESS
from rollbook.store import reward_versions as rv
from rollbook.store import seed
from rollbook.store.ledger import Ledger
from rollbook.trajectories import trajectory_from_dict
from rollbook.v1 import rollbook_pb2 as pb

SOURCE_MODEL, NEW_MODEL = "src", "new"
NOW = 2_000_000_000.0


def traj(
    tid: str,
    group: str,
    *,
    size: int = 2,
    reward: float | None = 1.0,
    versions: int = 3,
    session: str = "",
    model: str = SOURCE_MODEL,
):
    return trajectory_from_dict(
        dict(
            trajectory_id=tid,
            session_id=session,
            group_id=group,
            group_size=size if group else 0,
            model_id=model,
            domain="a" if tid < "m" else "b",
            task_id=f"task-{group}",
            prompt_token_ids=[1, 2],
            output_token_ids=[3, 4, 40],
            output_logprobs=[-0.5, -1.0, -1.5],
            output_versions=[versions] * 3,
            temperature=1.0,
            top_p=1.0,
            reward=reward,
        )
    )


@pytest.fixture
def source(tmp_path):
    """Groups: g1 (a0, a1: rewards 0, 1; trained and acked), g2 (b0, b1: rewards 1, 3; session s),
    g3 (c0 rewarded, c1 not), g4 (d0 alone of 2: waiting), a singleton e0 (no group id), and f0/f1
    of another model."""
    led = Ledger(tmp_path / "source.duckdb", fold_interval_s=3600)
    for model in (SOURCE_MODEL, "other"):
        led.register_model(model, 100)
        for v in range(4):
            led.publish_version(model, v, f"c{v}")
    led.submit([traj("a0", "g1", reward=0.0, versions=0), traj("a1", "g1", reward=1.0, versions=0)])
    led.flush()
    batch = led.pull_batch(pb.PullBatchRequest(trainer_id="t", model_id=SOURCE_MODEL, num_samples=2, max_staleness=9))
    led.ack_batch(batch.lease_id, "t")
    led.submit(
        [
            traj("n0", "g2", reward=1.0, session="s"),
            traj("n1", "g2", reward=3.0, session="s"),
            traj("o0", "g3", reward=1.0),
            traj("o1", "g3", reward=None),
            traj("p0", "g4", reward=1.0),
            traj("q0", "", reward=2.0),
            traj("r0", "g5", model="other"),
            traj("r1", "g5", model="other"),
        ]
    )
    led.flush()
    yield led
    led.close()


def ids(*names: str) -> pa.Table:
    return pa.table({"trajectory_id": pa.array(names, pa.string())})


def rows(con, sql: str, params=None) -> list[tuple]:
    return con.execute(sql, params or []).fetchall()


def seeded(source: Ledger, tmp_path, selected: pa.Table, **kwargs):
    dest = seed.create_ledger(tmp_path / "new.duckdb")
    cur = source.cursor()
    try:
        result = seed.seed(cur, dest, selected, model_id=NEW_MODEL, now=NOW, **kwargs)
    finally:
        cur.close()
    return result, dest


def test_only_whole_rewarded_complete_groups_are_seeded_and_the_rest_is_counted(source, tmp_path):
    selected = ids("a0", "a1", "n0", "o0", "o1", "p0", "q0", "gone")  # n1 not selected: g2 is cut
    result, dest = seeded(source, tmp_path, selected)
    got = {t for (t,) in rows(dest, "SELECT trajectory_id FROM trajectories")}
    assert got == {"a0", "a1", "q0"}
    assert (result.groups, result.rows, result.selected, result.archived) == (2, 3, 8, 1)
    assert (result.partial_groups, result.partial_rows) == (1, 1)
    assert (result.unrewarded_groups, result.unrewarded_rows) == (1, 2)
    assert (result.waiting_groups, result.waiting_rows) == (1, 1)
    assert result.source_model_id == SOURCE_MODEL
    assert result.max_token_id == 40
    assert "1 groups (1 selected rows) only partly selected" in result.left_out()
    assert "1 selected rows in the archive" in result.left_out()


def test_a_seeded_row_keeps_what_was_stored_and_enters_ready_for_the_new_model(source, tmp_path):
    _, dest = seeded(source, tmp_path, ids("a0", "a1"))
    columns = "trajectory_id, group_id, task_id, prompt_token_ids, output_token_ids, output_logprobs, output_versions, original_reward, created_at, worker_id"
    cur = source.cursor()
    try:
        stored = rows(cur, f"SELECT {columns} FROM trajectories WHERE group_id = 'g1' ORDER BY trajectory_id")
        (trained,) = rows(cur, "SELECT count(*) FROM trajectories WHERE group_id = 'g1' AND status = 'trained'")[0]
    finally:
        cur.close()
    assert trained == 2  # the source had trained them
    assert rows(dest, f"SELECT {columns} FROM trajectories ORDER BY trajectory_id") == stored
    assert rows(dest, "SELECT DISTINCT model_id, status, reward FROM trajectories") == [(NEW_MODEL, "ready", None)]
    assert rows(dest, "SELECT model_id, group_id, expected_size, num_members, num_rewarded, status FROM groups") == [
        (NEW_MODEL, "g1", 2, 2, 2, "ready")
    ]
    for table in ("leases", "train_steps", "policy_versions", "models", "rejections", "reward_versions"):
        assert rows(dest, f"SELECT count(*) FROM {table}") == [(0,)], table


def test_epochs_are_suffixed_copies_in_the_source_order(source, tmp_path):
    result, dest = seeded(source, tmp_path, ids("a0", "a1", "n0", "n1", "q0"), epochs=3)
    assert (result.rows, result.total_rows) == (5, 15)
    order = rows(dest, "SELECT trajectory_id, group_id, session_id FROM trajectories ORDER BY received_at")
    epoch1 = [("a0", "g1", ""), ("a1", "g1", ""), ("n0", "g2", "s"), ("n1", "g2", "s"), ("q0", "", "")]
    assert order[:5] == epoch1  # g1 arrived first in the source, then g2, then the singleton
    assert order[5:10] == [(t + "@2", g + "@2" if g else "", s + "@2" if s else "") for t, g, s in epoch1]
    assert order[10:] == [(t + "@3", g + "@3" if g else "", s + "@3" if s else "") for t, g, s in epoch1]
    (spacing,) = rows(dest, "SELECT max(received_at) - min(received_at) FROM trajectories")[0]
    assert spacing == pytest.approx(14 * seed.ROW_SPACING_S, abs=1e-6)
    groups = rows(dest, "SELECT group_id, num_members FROM groups ORDER BY group_id")
    assert groups == sorted(
        [(g, 2) for g in ("g1", "g1@2", "g1@3", "g2", "g2@2", "g2@3")] + [(f"traj:q0{s}", 1) for s in ("", "@2", "@3")]
    )


def test_a_reward_version_is_copied_with_the_rows_and_a_member_it_failed_leaves_its_group_out(source, tmp_path):
    with source.transaction() as con:
        rv.begin(con, rv.VersionSpec("v", "mod:f", "{}", "TRUE"), 4, NOW)
        rv.write(
            con,
            "v",
            pa.table(
                {
                    "trajectory_id": pa.array(["a0", "a1", "n0", "n1"], pa.string()),
                    "reward": pa.array([5.0, 1.0, 2.0, None], pa.float64()),
                    "status": pa.array(["ok", "ok", "ok", "error"], pa.string()),
                    "error": pa.array([None, None, None, "ValueError: no"], pa.string()),
                    "info": pa.array(['{"reason": "x"}', None, None, None], pa.string()),
                }
            ),
            NOW,
        )
    result, dest = seeded(source, tmp_path, ids("a0", "a1", "n0", "n1"), reward_version="v", epochs=2)
    assert (result.groups, result.unrewarded_groups) == (1, 1)  # g2: n1 has no ok score
    assert rows(dest, "SELECT trajectory_id, reward, status, info::VARCHAR FROM reward_versions ORDER BY 1") == [
        ("a0", 5.0, "ok", '{"reason": "x"}'),
        ("a0@2", 5.0, "ok", '{"reason": "x"}'),
        ("a1", 1.0, "ok", None),
        ("a1@2", 1.0, "ok", None),
    ]
    state = rv.state(dest, "v")
    assert state is not None and state.spec.reward == "mod:f" and state.spec.predicate == "TRUE"
    assert (state.selected, state.scored, state.errors, state.finished) == (4, 4, 0, True)
    with pytest.raises(seed.SeedError, match="no reward version 'w' \\(it has: v;"):
        (tmp_path / "again").mkdir()
        seeded(source, tmp_path / "again", ids("a0"), reward_version="w")


def test_a_selection_of_two_models_is_refused(source, tmp_path):
    with pytest.raises(seed.SeedError, match="rows of 2 models \\(other, src\\).*model_id = 'other'"):
        seeded(source, tmp_path, ids("a0", "a1", "r0", "r1"))


def test_nothing_eligible_seeds_nothing(source, tmp_path):
    result, dest = seeded(source, tmp_path, ids("o0", "o1"))
    assert (result.rows, result.unrewarded_groups) == (0, 1)
    assert rows(dest, "SELECT count(*) FROM trajectories") == [(0,)]


def pull(ledger: Ledger, version: int = 0) -> pa.Table:
    batch = ledger.pull_batch(
        pb.PullBatchRequest(
            trainer_id="t", model_id=NEW_MODEL, trainer_version=version, num_samples=64, max_staleness=REPLAY_MAX_STALENESS
        )
    )
    return batch.table


@pytest.mark.parametrize("version", [None, "v"])
def test_a_store_serves_the_seeded_groups_normalized_over_their_members(source, tmp_path, version):
    if version:
        with source.transaction() as con:
            rv.begin(con, rv.VersionSpec("v", "mod:f", "{}", "TRUE"), 4, NOW)
            rv.write(
                con,
                "v",
                pa.table(
                    {
                        "trajectory_id": pa.array(["a0", "a1", "n0", "n1"], pa.string()),
                        "reward": pa.array([3.0, 1.0, 0.0, 0.0], pa.float64()),
                        "status": pa.array(["ok"] * 4, pa.string()),
                        "error": pa.array([None] * 4, pa.string()),
                        "info": pa.array([None] * 4, pa.string()),
                    }
                ),
                NOW,
            )
    _, dest = seeded(source, tmp_path, ids("a0", "a1", "n0", "n1"), reward_version=version)
    dest.close()
    config = ValidatorConfig(reward_version=version, norm=NormConfig(mode="group_mean"))
    served = Ledger(tmp_path / "new.duckdb", validator_config=config, fold_interval_s=3600)
    try:
        table = pull(served)  # trainer version 0, rows of source versions 0 and 3: none is refused
        got = dict(zip(table.column("trajectory_id").to_pylist(), table.column("advantage").to_pylist()))
        # group_mean: g1 (a0, a1) and g2 (n0, n1) each centred on its own members
        expected = {"a0": 1.0, "a1": -1.0, "n0": 0.0, "n1": 0.0} if version else {"a0": -0.5, "a1": 0.5, "n0": -1.0, "n1": 1.0}
        assert got == pytest.approx(expected)
        assert pull(served, version=50).num_rows == 0  # every row leased once
        cur = served.cursor()
        try:
            assert rows(cur, "SELECT count(*), count(DISTINCT lease_id) FROM leases") == [(4, 1)]
            assert rows(cur, "SELECT count(*) FROM rejections") == [(0,)]
        finally:
            cur.close()
    finally:
        served.close()
