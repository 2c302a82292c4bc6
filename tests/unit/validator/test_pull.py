"""Pull-time rules on an in-memory DuckDB with the ledger's DDL (validator/pull.py): whole groups
oldest first, the pull's required fields, normalized rewards, lease ownership and acks.

Run: python -m pytest tests/unit/validator/test_pull.py -q
"""

from __future__ import annotations

import pyarrow as pa
import pytest

from rollbook.config import ValidatorConfig
from rollbook.v1 import rollbook_pb2 as pb
from rollbook.validator.groups import expire_leases
from rollbook.validator.pull import InvalidPull, LeaseError, NotLeaseOwner, UnknownLease, ack_lease, lease_batch
from tests.unit.validator.ledger_rows import T0, connect, insert, pull, rejected, served, status, traj


@pytest.fixture
def con():
    c = connect()
    yield c
    c.close()


def test_pull_serves_whole_groups_oldest_first_within_num_samples(con):
    insert(con, *[traj(f"old{i}", group_id="old", group_size=3) for i in range(3)], at=T0)
    insert(con, *[traj(f"new{i}", group_id="new", group_size=3) for i in range(3)], at=T0 + 1)
    assert served(pull(con, now=T0 + 2, n=4)) == ["old0", "old1", "old2"]  # the next group would exceed 4
    assert served(pull(con, now=T0 + 2, n=1)) == ["new0", "new1", "new2"]  # a first group larger than n still goes


def test_a_pull_must_name_its_model_and_trainer(con):
    for missing in ("model_id", "trainer_id"):
        req = pb.PullBatchRequest(
            trainer_id="t",
            trainer_version=0,
            max_staleness=0,
            num_samples=1,
            num_groups=0,
            step=0,
            model_id="m",
            lease_seconds=1.0,
        )
        setattr(req, missing, "")
        with pytest.raises(InvalidPull, match=missing):
            lease_batch(con, req, ValidatorConfig(), T0)


def test_only_the_trainer_a_lease_was_issued_to_may_ack_it(con):
    insert(con, traj("a"))
    batch = pull(con, now=T0)
    with pytest.raises(NotLeaseOwner):
        ack_lease(con, batch.lease_id, T0 + 1, "someone-else")
    with pytest.raises(UnknownLease):
        ack_lease(con, "no-such-lease", T0 + 1, "t")
    assert ack_lease(con, batch.lease_id, T0 + 1, "t") == 1


def test_ack_is_idempotent_and_an_unknown_lease_is_refused(con):
    insert(con, traj("a"))
    batch = pull(con, now=T0)
    assert ack_lease(con, batch.lease_id, T0 + 1) == 1
    assert ack_lease(con, batch.lease_id, T0 + 2) == 1
    assert con.execute("SELECT acked_at FROM leases").fetchall() == [(T0 + 1,)]
    with pytest.raises(UnknownLease):
        ack_lease(con, "no-such-lease", T0)


def test_late_ack_of_an_expired_lease_is_accepted_while_its_rows_are_still_free(con):
    insert(con, traj("a"))
    batch = pull(con, now=T0, lease_s=1)
    assert expire_leases(con, T0 + 5) == 1  # expired, its row back to ready, but not leased again
    assert ack_lease(con, batch.lease_id, T0 + 6) == 1
    assert status(con) == {"a": "trained"}


def test_late_ack_is_refused_once_the_rows_went_to_another_lease(con):
    insert(con, traj("a"))
    dead = pull(con, now=T0, lease_s=1)
    alive = pull(con, now=T0 + 5)
    assert served(alive) == ["a"]
    with pytest.raises(LeaseError):
        ack_lease(con, dead.lease_id, T0 + 6)
    ack_lease(con, alive.lease_id, T0 + 6)
    assert con.execute("SELECT lease_id FROM leases WHERE acked_at IS NOT NULL").fetchall() == [(alive.lease_id,)]


def test_late_ack_is_refused_once_the_rows_were_rejected_as_stale(con):
    insert(con, traj("a"))
    dead = pull(con, now=T0, lease_s=1)
    assert served(pull(con, now=T0 + 5, version=20, eta=1)) == []  # expires the lease, then a is STALE
    assert rejected(con) == {"a": "STALE"}
    with pytest.raises(LeaseError):
        ack_lease(con, dead.lease_id, T0 + 6)  # a row in `rejections` never also trains
    assert con.execute("SELECT count(acked_at) FROM leases").fetchone() == (0,)


def test_served_rows_carry_normalized_reward_and_keep_original_reward(con):
    insert(con, traj("p", group_id="g", group_size=2, reward=1.0), traj("q", group_id="g", group_size=2, reward=0.0))
    batch = pull(con, now=T0)
    got = {r["trajectory_id"]: (r["original_reward"], r["reward"]) for r in batch.table.to_pylist()}
    assert got["p"][0] == 1.0 and got["q"][0] == 0.0
    assert got["p"][1] == pytest.approx(1.0, abs=1e-3) and got["q"][1] == pytest.approx(-1.0, abs=1e-3)
    stored = dict(con.execute("SELECT trajectory_id, reward FROM trajectories").fetchall())
    assert stored == {k: v[1] for k, v in got.items()}
    assert isinstance(batch.table, pa.Table)


def test_served_rows_carry_the_session_call_tree(con):
    insert(
        con,
        traj("first", request_id="turn-0.0"),
        traj("next", request_id="turn-1.0", parent_request_id="turn-0.0"),
        traj("edited", request_id="turn-2.0", parent_request_id="turn-1.0", branched=True),
    )
    got = {
        r["trajectory_id"]: (r["session_id"], r["request_id"], r["parent_request_id"], r["branched"])
        for r in pull(con, now=T0).table.to_pylist()
    }
    assert got == {
        "first": ("s", "turn-0.0", "", False),
        "next": ("s", "turn-1.0", "turn-0.0", False),
        "edited": ("s", "turn-2.0", "turn-1.0", True),
    }
