"""Rows in an in-memory DuckDB with the ledger's DDL, for the validator's group- and pull-time rules
(tests/unit/validator/test_groups.py, test_pull.py)."""

from __future__ import annotations

import duckdb

from rollbook.config import ValidatorConfig
from rollbook.store.schema import DDL
from rollbook.store.tables import trajectories_table
from rollbook.trajectories import decode_messages, trajectory_from_dict
from rollbook.v1 import rollbook_pb2 as pb
from rollbook.validator.pull import lease_batch

T0 = 1000.0  # received_at of the first insert; `now` values below are relative to it


def connect() -> duckdb.DuckDBPyConnection:
    c = duckdb.connect()
    for ddl in DDL:
        c.execute(ddl)
    return c


def traj(tid: str, **fields) -> dict:
    t = {
        "trajectory_id": tid,
        "session_id": "s",
        "group_id": "",
        "group_size": 1,
        "request_id": f"r-{tid}",
        "consumed": True,
        "model_id": "m",
        "prompt_token_ids": [1],
        "output_token_ids": [2, 3],
        "output_logprobs": [-0.1, -0.2],
        "output_versions": [0, 0],
        "temperature": 1.0,
        "top_p": 1.0,
        "reward": 1.0,
        "created_at": T0,
    }
    t.update(fields)
    return t


def insert(con, *trajs: dict, at: float = T0) -> None:
    table = trajectories_table(decode_messages([trajectory_from_dict(t) for t in trajs]), at)
    con.register("_in", table)
    con.execute("INSERT INTO trajectories BY NAME SELECT * FROM _in")
    con.unregister("_in")


def status(con) -> dict[str, str]:
    return dict(con.execute("SELECT trajectory_id, status FROM trajectories").fetchall())


def rejected(con) -> dict[str, str]:
    return dict(con.execute("SELECT trajectory_id, reason FROM rejections").fetchall())


def pull(
    con, *, now: float, version: int = 0, eta: int = 10, n: int = 100, lease_s: float = 5.0, config: ValidatorConfig | None = None
):
    req = pb.PullBatchRequest(
        trainer_id="t",
        trainer_version=version,
        max_staleness=eta,
        num_samples=n,
        num_groups=0,
        step=0,
        model_id="m",
        lease_seconds=lease_s,
    )
    return lease_batch(con, req, config or ValidatorConfig(), now)


def served(batch) -> list[str]:
    return sorted(batch.table.column("trajectory_id").to_pylist()) if batch.table.num_rows else []
