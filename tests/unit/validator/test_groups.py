"""Group-time rules on an in-memory DuckDB with the ledger's DDL (validator/groups.py): retry orphans,
group readiness under each incomplete-group policy, lease expiry, staleness. Pulls and acks:
test_pull.py.

Time is explicit (``now``), so nothing here sleeps. The gRPC path is covered by
``tests/integration/test_validator_rules.py``; this file pins the edge cases.

Run: python -m pytest tests/unit/validator/test_groups.py -q
"""

from __future__ import annotations

import pytest

from rollbook.config import ValidatorConfig
from rollbook.validator.groups import expire_leases, reject_stale, settle
from rollbook.validator.pull import ack_lease
from tests.unit.validator.ledger_rows import T0, connect, insert, pull, rejected, served, status, traj


@pytest.fixture
def con():
    c = connect()
    yield c
    c.close()


# ---- retry orphans ---------------------------------------------------------------------------


def test_consumed_attempt_beats_a_later_unconsumed_one(con):
    insert(
        con,
        traj("a0", request_id="r", attempt=0, consumed=True, created_at=1.0),
        traj("a1", request_id="r", attempt=1, consumed=False, created_at=2.0),
    )
    assert settle(con, ValidatorConfig(), T0)["retry_orphans"] == 1
    assert rejected(con) == {"a1": "RETRY_ORPHAN"} and status(con) == {"a0": "ready"}


def test_without_a_consumed_attempt_the_latest_created_at_is_kept(con):
    insert(con, *[traj(f"a{k}", request_id="r", attempt=k, consumed=False, created_at=float(c)) for k, c in enumerate([3, 9, 5])])
    settle(con, ValidatorConfig(), T0)
    assert rejected(con) == {"a0": "RETRY_ORPHAN", "a2": "RETRY_ORPHAN"} and status(con) == {"a1": "ready"}


def test_empty_request_id_never_makes_orphans(con):
    insert(con, traj("x", request_id=""), traj("y", request_id=""))
    settle(con, ValidatorConfig(), T0)
    assert rejected(con) == {} and status(con) == {"x": "ready", "y": "ready"}


def test_an_attempt_already_served_beats_a_consumed_one_arriving_later(con):
    insert(con, traj("a0", request_id="r", consumed=False))
    assert served(pull(con, now=T0)) == ["a0"]
    insert(con, traj("a1", request_id="r", attempt=1, consumed=True), at=T0 + 1)
    settle(con, ValidatorConfig(), T0 + 1)
    assert rejected(con) == {"a1": "RETRY_ORPHAN"} and status(con) == {"a0": "leased"}


def test_a_ready_unconsumed_attempt_is_replaced_and_its_group_waits_for_the_replacement(con):
    # a group of two became ready with member b's unconsumed attempt; b's consumed attempt arrives
    # later without a reward: the old attempt is an orphan and a must not be served alone
    insert(con, traj("a", group_id="g", group_size=2), traj("b0", group_id="g", group_size=2, request_id="rb", consumed=False))
    settle(con, ValidatorConfig(), T0)
    assert status(con) == {"a": "ready", "b0": "ready"}
    insert(con, traj("b1", group_id="g", group_size=2, request_id="rb", attempt=1, reward=None), at=T0 + 1)
    assert served(pull(con, now=T0 + 1)) == []
    assert rejected(con) == {"b0": "RETRY_ORPHAN"} and status(con) == {"a": "pending", "b1": "pending"}
    con.execute("UPDATE trajectories SET original_reward = 0.0, reward = 0.0 WHERE trajectory_id = 'b1'")
    assert served(pull(con, now=T0 + 2)) == ["a", "b1"]


def reject_at_ingest(
    con,
    tid: str,
    *,
    request_id: str,
    consumed: bool,
    session_id: str = "s",
    model_id: str = "m",
    reason: str = "NONFINITE_LOGPROB",
    at: float = T0,
) -> None:
    con.execute(
        "INSERT INTO rejections BY NAME SELECT ? AS trajectory_id, ? AS reason, 'x' AS detail, 'ingest' AS stage, "
        "? AS session_id, ? AS request_id, ? AS model_id, ? AS consumed, ? AS rejected_at",
        [tid, reason, session_id, request_id, model_id, consumed, at],
    )


def test_a_consumed_attempt_rejected_at_ingest_orphans_every_unconsumed_attempt(con):
    insert(
        con,
        traj("u0", request_id="r", attempt=0, consumed=False, created_at=1.0),
        traj("u2", request_id="r", attempt=2, consumed=False, created_at=3.0),
    )
    reject_at_ingest(con, "c1", request_id="r", consumed=True)
    assert settle(con, ValidatorConfig(), T0)["retry_orphans"] == 2
    assert rejected(con) == {"c1": "NONFINITE_LOGPROB", "u0": "RETRY_ORPHAN", "u2": "RETRY_ORPHAN"}
    (detail,) = con.execute("SELECT detail FROM rejections WHERE trajectory_id = 'u2'").fetchone()
    assert "c1" in detail and "NONFINITE_LOGPROB" in detail


def test_a_consumed_rejection_arriving_after_the_retry_became_ready_still_orphans_it(con):
    insert(con, traj("u0", request_id="r", consumed=False))
    settle(con, ValidatorConfig(), T0)
    assert status(con) == {"u0": "ready"}
    reject_at_ingest(con, "c1", request_id="r", consumed=True, at=T0 + 1)
    assert settle(con, ValidatorConfig(), T0 + 1)["retry_orphans"] == 1
    assert status(con) == {}


def test_an_unconsumed_rejection_or_another_calls_rejection_orphans_nothing(con):
    insert(con, traj("u0", request_id="r", consumed=False), traj("v0", request_id="r", consumed=False, session_id="s2"))
    reject_at_ingest(con, "x1", request_id="r", consumed=False)
    reject_at_ingest(con, "y1", request_id="r", consumed=True, session_id="other-session")
    reject_at_ingest(con, "z1", request_id="r", consumed=True, model_id="other-model")
    settle(con, ValidatorConfig(), T0)
    assert status(con) == {"u0": "ready", "v0": "ready"}


def test_request_ids_are_scoped_per_session_and_model(con):
    insert(
        con,
        traj("a", request_id="turn-0", session_id="s1", consumed=False),
        traj("b", request_id="turn-0", session_id="s2", consumed=False),
        traj("c", request_id="turn-0", session_id="s1", model_id="m2", consumed=False),
    )
    assert settle(con, ValidatorConfig(), T0)["retry_orphans"] == 0
    assert status(con) == {"a": "ready", "b": "ready", "c": "ready"}


# ---- group readiness and the incomplete-group policies -------------------------------------------


def test_group_is_ready_only_when_every_member_is_in_and_rewarded(con):
    insert(con, traj("g0", group_id="g", group_size=3), traj("g1", group_id="g", group_size=3, reward=None))
    settle(con, ValidatorConfig(), T0)
    assert set(status(con).values()) == {"pending"}
    insert(con, traj("g2", group_id="g", group_size=3))
    con.execute("UPDATE trajectories SET original_reward = 0.0 WHERE trajectory_id = 'g1'")
    assert settle(con, ValidatorConfig(), T0)["ready"] == 3
    assert con.execute("SELECT group_id, expected_size, num_members, status FROM groups").fetchall() == [("g", 3, 3, "ready")]


def test_group_size_zero_is_a_group_of_one(con):
    insert(con, traj("z", group_id="g", group_size=0))
    settle(con, ValidatorConfig(), T0)
    assert status(con) == {"z": "ready"}


def test_wait_policy_rejects_a_short_group_only_after_the_timeout(con):
    cfg = ValidatorConfig(incomplete_group_policy="wait", group_timeout_s=10)
    insert(con, traj("w0", group_id="g", group_size=2))
    assert settle(con, cfg, T0 + 9)["incomplete_groups"] == 0
    assert settle(con, cfg, T0 + 11)["incomplete_groups"] == 1
    assert rejected(con) == {"w0": "INCOMPLETE_GROUP"}


def test_drop_policy_waits_for_the_present_members_rewards_then_rejects(con):
    cfg = ValidatorConfig(incomplete_group_policy="drop")
    insert(con, traj("d0", group_id="g", group_size=3), traj("d1", group_id="g", group_size=3, reward=None))
    assert settle(con, cfg, T0)["incomplete_groups"] == 0
    con.execute("UPDATE trajectories SET original_reward = 1.0 WHERE trajectory_id = 'd1'")
    assert settle(con, cfg, T0)["incomplete_groups"] == 2
    assert rejected(con) == {"d0": "INCOMPLETE_GROUP", "d1": "INCOMPLETE_GROUP"}


def test_keep_policy_serves_the_rewarded_members_after_the_timeout(con):
    cfg = ValidatorConfig(incomplete_group_policy="keep", group_timeout_s=10)
    insert(
        con,
        traj("k0", group_id="g", group_size=4, reward=1.0),
        traj("k1", group_id="g", group_size=4, reward=0.0),
        traj("k2", group_id="g", group_size=4, reward=None),
    )
    assert settle(con, cfg, T0 + 5) == {"retry_orphans": 0, "incomplete_groups": 0, "ready": 0}
    assert settle(con, cfg, T0 + 11) == {"retry_orphans": 0, "incomplete_groups": 1, "ready": 2}
    assert rejected(con) == {"k2": "INCOMPLETE_GROUP"} and status(con) == {"k0": "ready", "k1": "ready"}


# ---- lease expiry and staleness --------------------------------------------------------------


def test_expired_lease_returns_its_rows_and_an_acked_one_does_not(con):
    insert(con, traj("e"), traj("f"))
    first = pull(con, now=T0, n=1, lease_s=5)
    second = pull(con, now=T0, n=1, lease_s=5)
    ack_lease(con, second.lease_id, T0 + 1)
    assert expire_leases(con, T0 + 6) == 1
    assert status(con) == {served(first)[0]: "ready", served(second)[0]: "trained"}
    (expired,) = con.execute(
        "SELECT count(*) FROM leases WHERE lease_id = ? AND expired_at IS NOT NULL", [first.lease_id]
    ).fetchone()
    assert expired == 1


def test_staleness_bound_is_inclusive_and_filtered_by_model(con):
    insert(
        con,
        traj("v0", output_versions=[0, 1]),
        traj("v1", output_versions=[1, 1]),
        traj("other", model_id="other", output_versions=[0, 0]),
    )
    assert reject_stale(con, "m", trainer_version=2, max_staleness=1, now=T0) == 1
    assert rejected(con) == {"v0": "STALE"}
    assert "other" in status(con)


@pytest.mark.parametrize("policy", ["wait", "drop"])
def test_a_group_losing_members_to_stale_is_rejected_whole_under_wait_and_drop(con, policy):
    insert(con, *[traj(f"g{i}", group_id="g", group_size=4, output_versions=[0 if i < 2 else 2] * 2) for i in range(4)])
    insert(con, traj("solo", output_versions=[0, 0]), traj("fresh", output_versions=[2, 2]))
    settle(con, ValidatorConfig(), T0)
    assert reject_stale(con, "m", trainer_version=2, max_staleness=1, now=T0, policy=policy) == 3
    assert rejected(con) == {"g0": "STALE", "g1": "STALE", "solo": "STALE", "g2": "INCOMPLETE_GROUP", "g3": "INCOMPLETE_GROUP"}
    assert status(con) == {"fresh": "ready"}


def test_a_group_losing_members_to_stale_keeps_the_rest_under_keep(con):
    insert(con, *[traj(f"g{i}", group_id="g", group_size=4, output_versions=[0 if i < 2 else 2] * 2) for i in range(4)])
    assert reject_stale(con, "m", trainer_version=2, max_staleness=1, now=T0, policy="keep") == 2
    assert rejected(con) == {"g0": "STALE", "g1": "STALE"}
