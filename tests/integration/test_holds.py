"""Training eligibility on a real gRPC store under concurrent ingest and pulls: held rows are never
served, released rows are served exactly once, a group with a held member waits (the ``wait``
policy) and is served whole once the member is released, and every action is one audit row."""

from __future__ import annotations

import threading
import time

import grpc

from rollbook.client import StoreClient
from tests.integration.procs import ADMIN_KEY, InProcessStore, rows, rpc_code, trajectory

MODEL = "tiny"


def _group(gid: str, task: str, *, reward: float | None = 1.0) -> list[dict]:
    return [
        trajectory(
            f"{gid}-{i}",
            model_id=MODEL,
            group_id=gid,
            group_size=2,
            task_id=task,
            reward=reward + i if reward is not None else None,
        )
        for i in range(2)
    ]


def test_held_rows_are_never_served_and_released_ones_once_under_concurrent_ingest_and_pulls(tmp_path):
    store = InProcessStore(tmp_path / "rollbook.duckdb")
    try:
        with store.client() as admin:
            admin.register_model(MODEL, vocab_size=128)
            admin.publish_version(MODEL, 0)
            # ten groups to hold, unrewarded so nothing can serve them before the hold
            for g in range(10):
                admin.submit(_group(f"h{g}", "to-hold", reward=None))
            # a group with one member to hold and one not: it waits for the held one (policy wait)
            admin.submit([trajectory("split-0", model_id=MODEL, group_id="split", group_size=2, task_id="to-hold", reward=None)])
            admin.submit([trajectory("split-1", model_id=MODEL, group_id="split", group_size=2, task_id="other", reward=0.0)])
            held = admin.govern("hold", where="task_id = 'to-hold'", reason="review pending")
            assert held.rows == 21 and held.audit_id
            assert (
                rpc_code(lambda: admin.govern("hold", where="task_id = 'to-hold'", reason="")) == grpc.StatusCode.INVALID_ARGUMENT
            )
            assert (
                rpc_code(lambda: admin.govern("hold", where="no_such_column = 1", reason="x")) == grpc.StatusCode.INVALID_ARGUMENT
            )

        leased: list[str] = []
        stop = threading.Event()
        errors: list[BaseException] = []

        def ingest() -> None:  # other groups keep arriving
            try:
                with StoreClient(store.address, admin_key=ADMIN_KEY) as c:
                    n = 0
                    while not stop.is_set():
                        c.submit(_group(f"bg{n}", "background"))
                        n += 1
            except BaseException as exc:
                errors.append(exc)

        def pull() -> None:  # a trainer drains whatever is ready
            try:
                with store.client() as c:
                    while not stop.is_set():
                        batch = c.pull_batch(trainer_id="t", trainer_version=0, max_staleness=8, model_id=MODEL, num_samples=8)
                        if batch.num_rows:
                            leased.extend(batch.table.column("trajectory_id").to_pylist())
                            c.ack_batch(batch.lease_id, "t")
                        else:
                            time.sleep(0.02)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=ingest), threading.Thread(target=pull)]
        for t in threads:
            t.start()
        with store.client() as admin:
            for g in range(10):  # rewards arrive while the rows are held: still not served
                for i in range(2):
                    admin.set_reward(0.5 + i, trajectory_id=f"h{g}-{i}")
            admin.set_reward(1.0, trajectory_id="split-0")
            time.sleep(1.0)
            assert not [t for t in leased if t.startswith(("h", "split"))], "a held row (or its group) was served"
            released = admin.govern("release", where="task_id = 'to-hold' AND group_id <> 'h9'", reason="review passed")
            assert released.rows == 19
            deadline = time.monotonic() + 30
            while sum(t.startswith(("h", "split")) for t in leased) < 20 and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)  # any second serving would show up now
        stop.set()
        for t in threads:
            t.join(60)
        assert not errors, errors
        served = [t for t in leased if t.startswith(("h", "split"))]
        expected = {f"h{g}-{i}" for g in range(9) for i in range(2)} | {"split-0", "split-1"}
        assert sorted(served) == sorted(expected), "released rows are served exactly once, the split group whole"
        assert len(leased) == len(set(leased)), "a row was served twice"
        assert sum(t.startswith("bg") for t in leased) > 0  # the background went on meanwhile
        with store.client() as admin:
            still = rows(admin, "SELECT trajectory_id, eligibility, status FROM trajectories WHERE group_id = 'h9' ORDER BY 1")
            assert still == [{"trajectory_id": f"h9-{i}", "eligibility": "held", "status": "pending"} for i in range(2)]
            audit = rows(admin, "SELECT action, predicate, reason, num_rows, actor_role FROM audit ORDER BY acted_at")
            assert audit == [
                {
                    "action": "hold",
                    "predicate": "task_id = 'to-hold'",
                    "reason": "review pending",
                    "num_rows": 21,
                    "actor_role": "admin",
                },
                {
                    "action": "release",
                    "predicate": "task_id = 'to-hold' AND group_id <> 'h9'",
                    "reason": "review passed",
                    "num_rows": 19,
                    "actor_role": "admin",
                },
            ]
            assert admin.stats().rejected == 0  # a hold is not a rejection
    finally:
        store.stop()
