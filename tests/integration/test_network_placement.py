"""Separated placement across processes over the network: ``rollbook train --weight_server`` serves
each version over gRPC, ``rollbook rollout --weights grpc:...`` generates with it and submits to the
store; three real processes plus the store."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import duckdb
import pytest

from rollbook.client import StoreClient
from rollbook.run.store_process import StoreProcess
from rollbook.tasks import TOKENIZER

KEYS = {"admin_key": "admin-net-key", "trainer_key": "trainer-net-key"}

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_trainer_and_rollout_worker_exchange_weights_over_grpc(tmp_path: pathlib.Path):
    store = StoreProcess(tmp_path / "rollbook.duckdb", **KEYS)
    env = {**os.environ, "ROLLBOOK_TRAINER_KEY": KEYS["trainer_key"]}
    port = _free_port()
    cli = [sys.executable, "-m", "rollbook.cli"]
    try:
        with StoreClient(store.address, **KEYS) as client:
            client.register_model("tiny", TOKENIZER.vocab_size)
        trainer = subprocess.Popen(
            cli
            + [
                "train",
                "--server",
                store.address,
                "--run_dir",
                str(tmp_path / "trainer"),
                "--weight_server",
                f"127.0.0.1:{port}",
                "--num_steps",
                "3",
                "--num_samples",
                "16",
                "--max_staleness",
                "1",
                "--max_wait_s",
                "240",
            ],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        worker = subprocess.Popen(
            cli
            + [
                "rollout",
                "--server",
                store.address,
                "--weights",
                f"grpc:127.0.0.1:{port}",
                "--batch_size",
                "16",
                "--rollout.group_size",
                "4",
                "--rollout.num_prompts",
                "4",
                "--rollout.max_staleness",
                "1",
                "--spool_dir",
                str(tmp_path / "spool"),
            ],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            _, trainer_log = trainer.communicate(timeout=600)
        finally:
            worker.terminate()
            worker.communicate(timeout=120)
        assert trainer.returncode == 0, trainer_log[-3000:]
        assert f"serving weights on 127.0.0.1:{port}" in trainer_log
    finally:
        store.stop()
    con = duckdb.connect(str(tmp_path / "rollbook.duckdb"), read_only=True)
    assert [s for (s,) in con.execute("SELECT step FROM train_steps ORDER BY step").fetchall()] == [0, 1, 2]
    # the worker generated under versions it could only have received over the network
    (newest,) = con.execute("SELECT max(max_version) FROM trajectories").fetchone()
    assert newest >= 1
    (worst,) = con.execute(
        "SELECT max(l.trainer_version - t.min_version) FROM leases l JOIN trajectories t "
        "USING (trajectory_id) WHERE l.acked_at IS NOT NULL"
    ).fetchone()
    assert worst <= 1
