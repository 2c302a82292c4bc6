"""Process helpers for integration tests: a real ``rollbook serve`` child, an in-process gRPC store
with a custom ``StoreConfig``, trajectory builders, and small SQL helpers.

Every store here is a real gRPC server on port 0 over a real DuckDB file; tests talk to it through
``StoreClient``. ``ServeProcess`` is the ``rollbook serve`` command itself; ``InProcessStore`` is
``store.server.create_server`` for settings the CLI cannot set (``ValidatorConfig``).
"""

from __future__ import annotations

import os
import pathlib
import time
from typing import Any

import grpc

from rollbook.client import StoreClient
from rollbook.config import StoreConfig
from rollbook.run.store_process import StoreProcess
from rollbook.store.server import create_server

ADMIN_KEY = "test-admin-key"
TRAINER_KEY = "test-trainer-key"
KEY_ENV = {"ROLLBOOK_ADMIN_KEY": ADMIN_KEY, "ROLLBOOK_TRAINER_KEY": TRAINER_KEY}


def child_env(**extra: str) -> dict[str, str]:
    """Environment for child processes: both keys, and no other ROLLBOOK_* setting from the caller."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLBOOK_")}
    return {**env, **KEY_ENV, **extra}


class ServeProcess(StoreProcess):
    """``python -m rollbook.cli serve --db DB --port 0`` with both keys set and no other ROLLBOOK_*
    setting from the caller; ``address`` is HOST:PORT."""

    def __init__(self, db: pathlib.Path, *, port: int = 0):
        super().__init__(db, admin_key=ADMIN_KEY, trainer_key=TRAINER_KEY, port=port, env=child_env())


class InProcessStore:
    """``create_server(StoreConfig(...))`` on port 0 in this process (a real gRPC server and ledger)."""

    def __init__(self, db: pathlib.Path, **config: Any):
        self.server, port, self.ledger = create_server(
            StoreConfig(db=db, port=0, admin_key=ADMIN_KEY, trainer_key=TRAINER_KEY, **config)
        )
        self.server.start()
        self.address = f"127.0.0.1:{port}"

    def client(self, **kwargs) -> StoreClient:
        return StoreClient(self.address, admin_key=ADMIN_KEY, trainer_key=TRAINER_KEY, **kwargs)

    def stop(self) -> None:
        self.server.stop(grace=2).wait()
        self.ledger.close()


def trajectory(tid: str, *, model_id: str, n: int = 4, version: int = 0, reward: float | None = 1.0, **fields: Any) -> dict:
    """A minimal valid trajectory as a dict (``StoreClient.submit`` takes dicts); ``fields`` override."""
    t = {
        "trajectory_id": tid,
        "session_id": f"s-{tid}",
        "group_id": "",
        "group_size": 1,
        "request_id": f"r-{tid}",
        "consumed": True,
        "task_id": "task",
        "domain": "arithmetic",
        "model_id": model_id,
        "prompt_token_ids": [1, 2, 3],
        "output_token_ids": [5 + i for i in range(n)],
        "output_logprobs": [-0.5] * n,
        "output_versions": [version] * n,
        "temperature": 1.0,
        "top_p": 1.0,
        "finish_reason": "stop",
        "reward": reward,
        "worker_id": "w0",
        "created_at": time.time(),
    }
    t.update(fields)
    return t


# One row over a ledger (test_trainer_crash.py, test_bench_placement.py): how many trajectories trained
# once / twice, acked leases no reported step owns, and the reported steps with whether each one's
# lease was acked.
AUDIT = """
    WITH per_row AS (SELECT t.trajectory_id, count(l.acked_at) AS acked
                     FROM trajectories t LEFT JOIN leases l USING (trajectory_id) GROUP BY ALL)
    SELECT (SELECT count(*) FROM per_row) AS trajectories,
           (SELECT count(*) FROM per_row WHERE acked = 1) AS acked_once,
           (SELECT count(*) FROM per_row WHERE acked > 1) AS acked_twice,
           (SELECT count(*) FROM leases WHERE acked_at IS NOT NULL
              AND lease_id NOT IN (SELECT lease_id FROM train_steps)) AS acked_outside_steps,
           (SELECT list(step ORDER BY step) FROM train_steps) AS steps,
           (SELECT count(*) FROM train_steps s WHERE NOT EXISTS (
              SELECT 1 FROM leases l WHERE l.lease_id = s.lease_id AND l.acked_at IS NOT NULL)) AS steps_without_acked_lease
"""


def rows(client: StoreClient, sql: str) -> list[dict]:
    """A query's result as a list of dicts."""
    return client.query(sql).to_pylist()


def ids_in(client: StoreClient, table: str, where: str = "TRUE") -> set[str]:
    return {r["trajectory_id"] for r in rows(client, f"SELECT trajectory_id FROM {table} WHERE {where}")}


def rpc_code(call) -> grpc.StatusCode:
    """The status code a failing RPC raises (a test helper: ``rpc_code(lambda: client.ack_batch("x"))``)."""
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code()
    raise AssertionError("the call succeeded; expected an RPC error")
