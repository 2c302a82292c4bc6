"""The rollout path end to end: engine evidence through a real store, and ``rollbook run`` in both
placements (real store process, real DuckDB file, real PyTorch training)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import duckdb
import pytest
import torch

from rollbook.client import StoreClient
from rollbook.config import RolloutConfig
from rollbook.language_models import TinyModelSpec, build_tiny_model
from rollbook.rollout.engine import NativeEngine
from rollbook.rollout.worker import RolloutWorker
from rollbook.run.store_process import StoreProcess
from rollbook.tasks import TOKENIZER

KEYS = {"admin_key": "admin-test-key", "trainer_key": "trainer-test-key"}


@pytest.fixture
def store(tmp_path):
    proc = StoreProcess(tmp_path / "rollbook.duckdb", **KEYS)
    yield proc
    proc.stop()


@pytest.mark.smoke
def test_weight_update_mid_generation_gives_mixed_version_trajectories_the_store_accepts(store):
    torch.manual_seed(0)
    model = build_tiny_model(TinyModelSpec(vocab_size=TOKENIZER.vocab_size))
    engine = NativeEngine(model, version=0, seed=0)
    new_weights = {
        k: v + 0.01 for k, v in build_tiny_model(TinyModelSpec(vocab_size=TOKENIZER.vocab_size), seed=1).state_dict().items()
    }
    engine.schedule_weight_update(new_weights, version=1, at_step=2)
    # no stop token: every completion runs past the update, so each one spans both versions
    config = RolloutConfig(group_size=4, num_prompts=2, max_new_tokens=5, num_train_tasks=20, num_eval_tasks=4)
    worker = RolloutWorker(engine, config, model_id="tiny")
    worker.produce = _without_stop(worker)
    trajectories = worker.produce()

    for t in trajectories:
        assert list(t.output_versions) == [0, 0] + [1] * (len(t.output_versions) - 2)  # split at token 2
    with StoreClient(store.address, **KEYS) as client:
        client.register_model("tiny", TOKENIZER.vocab_size)
        client.publish_version("tiny", 0)
        client.publish_version("tiny", 1)
        result = client.submit(trajectories)
        assert result.accepted == len(trajectories), result.rejected_by_reason()
        table = client.query("SELECT count(*) AS n FROM trajectories WHERE min_version = 0 AND max_version = 1")
    assert table.column("n")[0].as_py() == len(trajectories)


def _without_stop(worker: RolloutWorker):
    """``produce`` with the stop token removed, so outputs reach max_new_tokens."""
    original = worker.engine.generate

    def generate(requests):
        from dataclasses import replace

        return original([replace(r, stop_token_ids=()) for r in requests])

    worker.engine.generate = generate
    return worker.produce


def _run(tmp_path: pathlib.Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "rollbook.cli",
        "run",
        "--config",
        "configs/smoke.toml",
        "--run_dir",
        str(tmp_path / "run"),
        "--num_steps",
        "3",
        "--eval_every",
        "3",
        "--warm_start.student_steps",
        "5",
        "--rollout.num_eval_tasks",
        "8",
        "--rollout.num_prompts",
        "4",
        "--rollout.group_size",
        "4",
        "--trainer.num_samples",
        "16",
        *extra,
    ]
    return subprocess.run(cmd, cwd=pathlib.Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=900)


def _ledger(tmp_path: pathlib.Path) -> duckdb.DuckDBPyConnection:
    return duckdb.connect(str(tmp_path / "run" / "rollbook.duckdb"), read_only=True)


@pytest.mark.parametrize(
    "placement,eta,given",
    [
        pytest.param("colocated", 0, True, id="colocated", marks=pytest.mark.smoke),  # the fast lane's one short run
        pytest.param("separated", 2, False, id="separated-default-eta", marks=pytest.mark.slow),
    ],
)
def test_rollbook_run_trains_and_records_every_step(tmp_path, placement, eta, given):
    # separated without a bound: the run's default eta for the placement (2) reaches both sides
    bound = ("--trainer.max_staleness", str(eta), "--rollout.max_staleness", str(eta)) if given else ()
    done = _run(tmp_path, "--placement", placement, *bound)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "held-out reward before step 0" in done.stdout
    assert "step    2 (3/3 done)" in done.stdout  # the console names the train_steps row (0-based)
    resolved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert resolved["max_staleness"] == resolved["trainer"]["max_staleness"] == resolved["rollout"]["max_staleness"] == eta
    assert (tmp_path / "run" / "store.json").exists()
    con = _ledger(tmp_path)
    steps = con.execute("SELECT step, version, lease_id FROM train_steps ORDER BY step").fetchall()
    assert [s for s, _, _ in steps] == [0, 1, 2] and [v for _, v, _ in steps] == [1, 2, 3]
    # every trained row is within the staleness bound of the trainer version that leased it
    (worst,) = con.execute(
        "SELECT max(l.trainer_version - t.min_version) FROM leases l JOIN trajectories t USING (trajectory_id) "
        "WHERE l.acked_at IS NOT NULL"
    ).fetchone()
    assert worst <= eta
    (twice,) = con.execute(
        "SELECT count(*) FROM (SELECT trajectory_id FROM leases WHERE acked_at IS NOT NULL "
        "GROUP BY trajectory_id HAVING count(*) > 1)"
    ).fetchone()
    assert twice == 0
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert "eval/reward" in metrics[0] and "eval/reward" in metrics[-1]
