"""``rollbook train --num_ranks 2`` (and the same under torchrun, and with the ranks sharded by FSDP2)
against a real store and a real rollout worker (weights over the network channel): two gloo ranks
train on one lease per step, rank 0 alone reports, checkpoints, acks and publishes; the ledger shows
one acked lease per step and no row trained twice."""

from __future__ import annotations

import json
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

KEYS = {"admin_key": "admin-dist-key", "trainer_key": "trainer-dist-key"}
STEPS = 4

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# each launcher and each data-parallel mode once: the launcher decides how the ranks meet (a spawned
# child on a loopback rendezvous, or torchrun's env://), the mode what they hold once met, and neither
# reads the other (the step of each mode is tests/unit/trainer/test_distributed.py's and test_sharded.py's)
@pytest.mark.parametrize(("launcher", "data_parallel"), [("torchrun", "replicate"), ("num_ranks", "shard")])
def test_two_rank_train_takes_one_lease_and_one_ack_per_step(tmp_path: pathlib.Path, launcher: str, data_parallel: str):
    store = StoreProcess(tmp_path / "rollbook.duckdb", **KEYS)
    env = {**os.environ, "ROLLBOOK_TRAINER_KEY": KEYS["trainer_key"]}
    port = _free_port()
    cli = [sys.executable, "-m", "rollbook.cli"]
    try:
        with StoreClient(store.address, **KEYS) as client:
            client.register_model("tiny", TOKENIZER.vocab_size)
        train = [
            "train",
            "--server",
            store.address,
            "--run_dir",
            str(tmp_path / "trainer"),
            "--weight_server",
            f"127.0.0.1:{port}",
            "--num_steps",
            str(STEPS),
            "--num_samples",
            "16",
            "--max_staleness",
            "1",
            "--max_wait_s",
            "240",
            "--data_parallel",
            data_parallel,
            "--log-level",
            "INFO",
        ]
        if launcher == "torchrun":  # env:// rendezvous; every rank runs the same command
            launch = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node",
                "2",
                "--master_port",
                str(_free_port()),
                "-m",
                "rollbook.cli",
            ]
            trainer = subprocess.Popen(launch + train, env=env, stderr=subprocess.PIPE, text=True)
        else:
            trainer = subprocess.Popen(cli + train + ["--num_ranks", "2"], env=env, stderr=subprocess.PIPE, text=True)
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
        assert ("model sharded over 2 ranks" in trainer_log) == (data_parallel == "shard"), trainer_log[-3000:]
    finally:
        store.stop()
    con = duckdb.connect(str(tmp_path / "rollbook.duckdb"), read_only=True)
    steps = con.execute("SELECT step, stats FROM train_steps ORDER BY step").fetchall()
    assert [s for s, _ in steps] == list(range(STEPS))
    assert all(json.loads(stats)["dist/world_size"] == 2 for _, stats in steps)
    # one lease per step, acked once; every trained row in exactly one acked lease
    per_step = con.execute(
        "SELECT step, count(DISTINCT lease_id), count(*) FILTER (WHERE acked_at IS NOT NULL) "
        "FROM leases GROUP BY step ORDER BY step"
    ).fetchall()
    assert [(s, n) for s, n, _ in per_step] == [(s, 1) for s in range(STEPS)]
    (twice,) = con.execute(
        "SELECT count(*) FROM (SELECT trajectory_id FROM leases WHERE acked_at IS NOT NULL "
        "GROUP BY trajectory_id HAVING count(*) > 1)"
    ).fetchone()
    assert twice == 0
    (newest,) = con.execute("SELECT max(max_version) FROM trajectories").fetchone()
    assert newest >= 1  # rank 0 published over the network and the worker used it
