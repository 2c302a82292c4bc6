"""One staleness bound for separately started processes: ``rollbook train`` announces its
``max_staleness`` and ``num_samples`` with every version it publishes to the store, and a separately
started ``rollbook rollout`` configured otherwise gates by the trainer's values (docs/design.md,
"Staleness gate"). Real processes: a store, a trainer, a worker; weights over gRPC.

Run: ``python -m pytest tests/integration/test_staleness_contract.py -q``.
"""

from __future__ import annotations

import ast
import pathlib
import re
import signal
import socket
import subprocess
import sys

import grpc
import pytest

from rollbook.client import ModelInfo, StoreClient
from tests.integration.conftest import clean_env, rpc_error, start_store

TRAINER_ETA, TRAINER_BATCH = 0, 8  # the trainer's: authoritative
WORKER_ETA, WORKER_BATCH = 3, 64  # the worker's own config, which it must give up
GROUP, PROMPTS = 4, 2  # 8 trajectories per round


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_store_keeps_the_latest_announcement_per_model(tmp_path: pathlib.Path):
    store = start_store(tmp_path / "rollbook.duckdb")
    try:
        with store.client() as client:
            assert rpc_error(lambda: client.get_model("nobody")).code() == grpc.StatusCode.FAILED_PRECONDITION
            client.register_model("a", 64)
            client.register_model("b", 64)
            assert client.get_model("a") == ModelInfo("a", 64, -1, None, None)  # registered, nothing published
            client.publish_version("a", 0, checksum="c0")  # a trainer that announces nothing
            assert (client.get_model("a").latest_version, client.get_model("a").max_staleness) == (0, None)
            client.publish_version("a", 1, checksum="c1", max_staleness=0, samples_per_version=8)
            client.publish_version("b", 0, checksum="c0", max_staleness=2, samples_per_version=16)
            a, b = client.get_model("a"), client.get_model("b")
            assert (a.latest_version, a.max_staleness, a.samples_per_version) == (1, 0, 8)  # 0 is a value, not "unset"
            assert (b.latest_version, b.max_staleness, b.samples_per_version) == (0, 2, 16)
            client.publish_version("a", 2, checksum="c2", max_staleness=3, samples_per_version=8)  # a restarted trainer
            assert client.get_model("a").max_staleness == 3
            client.publish_version("a", 3, checksum="c3")  # no announcement: the last one stands
            assert (client.get_model("a").latest_version, client.get_model("a").max_staleness) == (3, 3)
            bad = rpc_error(lambda: client.publish_version("a", 4, samples_per_version=0))
            assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "samples_per_version" in bad.details()
            assert client.get_model("a").latest_version == 3  # refused: nothing changed
    finally:
        store.terminate()


@pytest.mark.timeout(900)
def test_a_separately_started_worker_gates_by_the_trainers_bound(tmp_path: pathlib.Path):
    store = start_store(tmp_path / "rollbook.duckdb")
    port = _free_port()
    cli = [sys.executable, "-m", "rollbook.cli"]
    env = clean_env()
    try:
        with store.client() as client:
            from rollbook.tasks import TOKENIZER

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
                str(TRAINER_BATCH),
                "--max_staleness",
                str(TRAINER_ETA),
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
                str(WORKER_BATCH),
                "--rollout.max_staleness",
                str(WORKER_ETA),
                "--rollout.group_size",
                str(GROUP),
                "--rollout.num_prompts",
                str(PROMPTS),
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
            worker.send_signal(signal.SIGTERM)  # finish the round, flush, log the final statistics
            _, worker_log = worker.communicate(timeout=120)
        assert trainer.returncode == 0, trainer_log[-3000:]
        assert worker.returncode == 0, worker_log[-3000:]
        with StoreClient(store.address) as client:
            info = client.get_model("tiny")
    finally:
        store.terminate()
    # the store holds what the trainer announced
    assert (info.max_staleness, info.samples_per_version, info.latest_version) == (TRAINER_ETA, TRAINER_BATCH, 3)
    # the worker said once that it uses the trainer's values instead of its own
    adopted = [line for line in worker_log.splitlines() if "the trainer announces" in line]
    assert len(adopted) == 1, worker_log[-3000:]
    assert (
        f"max_staleness={TRAINER_ETA}, samples_per_version={TRAINER_BATCH}" in adopted[0]
        and f"rollout.max_staleness={WORKER_ETA}, batch_size={WORKER_BATCH}" in adopted[0]
    ), adopted
    done = re.search(r"rollout worker done: (\{.*\})", worker_log)
    assert done, worker_log[-3000:]
    stats = ast.literal_eval(done.group(1))
    assert (stats["gate/max_staleness"], stats["gate/batch_size"], stats["gate/from_trainer"]) == (TRAINER_ETA, TRAINER_BATCH, 1)
    # the gate's promise under the trainer's bound: every sample admitted at a version v it held had
    # (eta + v + 1) * batch as the cap on all samples so far. Under its own bound (3, 64) the worker
    # would have had room for 256 samples at version 0 alone.
    assert 0 < stats["rollout/trajectories"] <= (TRAINER_ETA + stats["version"] + 1) * TRAINER_BATCH, stats
