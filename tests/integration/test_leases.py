"""Leases through a real ``rollbook serve`` process.

Trainer A pulls a batch with a two-second lease and dies without acking. Trainer B pulls at once
and gets other rows only; then, after A's lease expired and version 2 was published, B pulls at
version 2: A's rows come back, the ones that aged past the staleness bound meanwhile are ``STALE``
in ``rejections`` and not served. One SQL query over ``leases`` then shows every trained row has
exactly one acked lease. Acks are idempotent; an unknown lease is ``NOT_FOUND``; the dead trainer's
late ack is refused; another trainer's ack is ``PERMISSION_DENIED``.

Run: python -m pytest tests/integration/test_leases.py -q   (about 10 s)
"""

from __future__ import annotations

import time

import grpc
import pytest

from tests.integration.procs import ServeProcess, ids_in, rows, rpc_code, trajectory

MODEL = "lease-model"
ETA = 1  # max_staleness
LEASE_S = 2.0


@pytest.fixture
def client(tmp_path):
    proc = ServeProcess(tmp_path / "rollbook.duckdb")
    c = proc.client()
    c.register_model(MODEL, vocab_size=64)
    for v in (0, 1):
        c.publish_version(MODEL, v)
    yield c
    c.close()
    proc.stop()


def groups(num: int) -> list[dict]:
    """``num`` rewarded groups of two; even groups sampled at version 0, odd ones at version 1.
    Served oldest first, then by group id, so every pull gets both kinds."""
    return [
        trajectory(f"g{g:02d}-{i}", model_id=MODEL, version=g % 2, group_id=f"g{g:02d}", group_size=2, reward=float(i))
        for g in range(num)
        for i in range(2)
    ]


def pull(client, trainer: str, version: int, n: int):
    return client.pull_batch(
        trainer_id=trainer, trainer_version=version, max_staleness=ETA, num_samples=n, model_id=MODEL, lease_seconds=LEASE_S
    )


def served(batch) -> set[str]:
    return set(batch.table.column("trajectory_id").to_pylist())


def test_dead_trainers_rows_return_once_and_stale_ones_go_to_rejections(client):
    workload = groups(12)
    assert client.submit(workload).accepted == 24
    every_id = {t["trajectory_id"] for t in workload}

    dead = pull(client, "trainer-A", version=1, n=8)  # ...and trainer A dies here, never acking
    assert served(dead) == {f"g{g:02d}-{i}" for g in range(4) for i in range(2)}

    alive = pull(client, "trainer-B", version=1, n=8)  # A's lease is live: B gets other rows
    assert served(alive) == {f"g{g:02d}-{i}" for g in range(4, 8) for i in range(2)}
    assert client.ack_batch(alive.lease_id, "trainer-B") == 8

    client.publish_version(MODEL, 2)  # B's weights moved on; version-0 samples are now 2 behind
    (expires,) = [r["e"] for r in rows(client, f"SELECT max(expires_at) AS e FROM leases WHERE lease_id = '{dead.lease_id}'")]
    time.sleep(max(0.0, expires - time.time()) + 0.2)

    later = pull(client, "trainer-B", version=2, n=100)
    odd = {f"g{g:02d}-{i}" for g in range(12) if g % 2 for i in range(2)}
    returned = served(dead) & odd
    assert served(later) == returned | {t for t in odd if int(t[1:3]) >= 8}
    assert later.stats["events"]["expired_rows"] == 8 and later.stats["events"]["stale"] == 8
    assert client.ack_batch(later.lease_id, "trainer-B") == later.num_rows

    # one query over `leases`: every trajectory that trained has exactly one acked lease
    trained = rows(
        client,
        """
        SELECT t.trajectory_id, t.status, count(l.acked_at) AS acked, count(l.lease_id) AS leased
        FROM trajectories t LEFT JOIN leases l USING (trajectory_id) GROUP BY ALL ORDER BY 1""",
    )
    assert {r["trajectory_id"] for r in trained} == served(alive) | served(later)
    assert all(r["acked"] == 1 and r["status"] == "trained" for r in trained), trained
    assert {r["trajectory_id"] for r in trained if r["leased"] == 2} == returned  # A's lease, then B's

    # the version-0 rows of the eight unserved groups went stale, A's among them; none ever acked
    stale = rows(
        client,
        """
        SELECT r.trajectory_id, r.reason, r.stage, count(l.acked_at) AS acked
        FROM rejections r LEFT JOIN leases l USING (trajectory_id) GROUP BY ALL""",
    )
    assert {r["trajectory_id"] for r in stale} == every_id - served(alive) - odd
    assert {(r["reason"], r["stage"], r["acked"]) for r in stale} == {("STALE", "pull", 0)}
    assert ids_in(client, "trajectories") | ids_in(client, "rejections") == every_id  # nothing lost

    # trainer A's lease: expired, never acked, and its late ack is refused
    assert rows(
        client,
        f"""SELECT count(*) AS n, count(acked_at) AS acked, count(expired_at) AS expired
                            FROM leases WHERE lease_id = '{dead.lease_id}'""",
    ) == [{"n": 8, "acked": 0, "expired": 8}]
    assert rpc_code(lambda: client.ack_batch(dead.lease_id, "trainer-A")) == grpc.StatusCode.FAILED_PRECONDITION


def test_ack_is_idempotent_and_an_unknown_lease_is_not_found(client):
    client.submit(groups(2))
    batch = pull(client, "trainer-B", version=1, n=4)
    assert batch.num_rows == 4
    assert client.ack_batch(batch.lease_id, "trainer-B") == 4
    first = rows(client, f"SELECT acked_at FROM leases WHERE lease_id = '{batch.lease_id}'")
    assert client.ack_batch(batch.lease_id, "trainer-B") == 4
    assert rows(client, f"SELECT acked_at FROM leases WHERE lease_id = '{batch.lease_id}'") == first
    assert rows(client, "SELECT count(*) AS n FROM trajectories WHERE status = 'trained'") == [{"n": 4}]
    assert rpc_code(lambda: client.ack_batch("no-such-lease", "trainer-B")) == grpc.StatusCode.NOT_FOUND
    assert rpc_code(lambda: client.ack_batch("", "trainer-B")) == grpc.StatusCode.NOT_FOUND


def test_only_the_trainer_a_lease_was_issued_to_may_ack_it(client):
    client.submit(groups(1))
    batch = pull(client, "trainer-B", version=1, n=2)
    assert rpc_code(lambda: client.ack_batch(batch.lease_id, "trainer-A")) == grpc.StatusCode.PERMISSION_DENIED
    assert rows(client, f"SELECT count(acked_at) AS n FROM leases WHERE lease_id = '{batch.lease_id}'") == [{"n": 0}]
    assert client.ack_batch(batch.lease_id, "trainer-B") == 2
