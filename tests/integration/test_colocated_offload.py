"""The colocated placement with ``trainer.offload_optimizer`` on trains exactly as with it off: the
same trajectories (tokens, log-probs, versions) and the same losses, bit for bit, and the offload,
onload, weight-sync and freed-KV figures land in ``train_steps``.

A whole ``rollbook run`` does not repeat itself bit for bit: the worker names trajectories with
random ids and the store orders a batch by them, so the trainer sums the same tokens in another order
(log-probs then differ by about 1e-7 from the second step on). So this drives the colocated placement
itself (``run_colocated``: the engine, the weight handoff, the worker and the trainer in this process)
against a real store process, the worker's ids made deterministic, from one warm-started student.

Run: python -m pytest tests/integration/test_colocated_offload.py -q
"""

from __future__ import annotations

import itertools
import json
import pathlib
import shutil
import types

import duckdb
import pytest

from rollbook.config import RunConfig, load_config
from rollbook.run.main import _run_with_store
from rollbook.run.store_process import StoreProcess

NUM_STEPS = 4
OVERRIDES = [
    *("--num_steps", str(NUM_STEPS), "--eval_every", str(NUM_STEPS)),
    *("--trainer.num_samples", "16", "--rollout.group_size", "4", "--rollout.num_prompts", "4"),
    *("--rollout.num_eval_tasks", "4", "--rollout.num_eval_samples", "1"),
    *("--trainer.model.hidden_size", "64", "--trainer.model.intermediate_size", "128"),
    *("--trainer.checkpoint_every", "2"),
]
KEYS = {"admin_key": "a", "trainer_key": "t", "worker_key": "w", "reader_key": "r"}


def _config(run_dir: pathlib.Path, *extra: str) -> RunConfig:
    return load_config(RunConfig, "configs/smoke.toml", [*OVERRIDES, "--run_dir", str(run_dir), *extra])


@pytest.fixture(scope="module")
def student(tmp_path_factory) -> pathlib.Path:
    """The warm-started student both runs start from (built once, as ``rollbook run`` caches it)."""
    from rollbook.trainer.model_builders import build_models

    run_dir = tmp_path_factory.mktemp("warm")
    build_models(_config(run_dir))
    return run_dir / "base-student"


def _run_colocated(run_dir: pathlib.Path, student: pathlib.Path, monkeypatch, *extra: str) -> tuple[list, list[dict]]:
    """One colocated run against its own store; its trajectories in submission order and its steps' stats."""
    import rollbook.rollout.worker as worker

    ids = itertools.count()
    monkeypatch.setattr(worker, "uuid", types.SimpleNamespace(uuid4=lambda: types.SimpleNamespace(hex=f"{next(ids):032x}")))
    run_dir.mkdir()
    shutil.copytree(student, run_dir / "base-student")
    config = _config(run_dir, *extra)
    store = StoreProcess(run_dir / "rollbook.duckdb", **KEYS)
    try:
        _run_with_store(config, store, KEYS)
    finally:
        store.stop()
    con = duckdb.connect(str(run_dir / "rollbook.duckdb"), read_only=True)
    trajectories = con.execute(
        "SELECT trajectory_id, output_token_ids, output_logprobs, output_versions, original_reward FROM trajectories "
        "ORDER BY trajectory_id"
    ).fetchall()
    steps = [json.loads(s) for (s,) in con.execute("SELECT stats FROM train_steps ORDER BY step").fetchall()]
    con.close()
    return trajectories, steps


def test_colocated_offload_trains_exactly_as_without_it_and_reports_its_figures(tmp_path, student, monkeypatch):
    plain_rows, plain_steps = _run_colocated(tmp_path / "plain", student, monkeypatch)
    rows, steps = _run_colocated(tmp_path / "offload", student, monkeypatch, "--trainer.offload_optimizer", "true")

    assert len(plain_steps) == len(steps) == NUM_STEPS
    assert len(rows) == NUM_STEPS * 16 and rows == plain_rows  # tokens, log-probs, versions, rewards
    assert {max(v) for _, _, _, v, _ in rows} == set(range(NUM_STEPS))  # each round sampled on the newest version
    assert any(s["loss/total"] != 0 and s["grad/norm"] > 0 for s in plain_steps)  # the runs really trained
    for key in ("loss/total", "ppo/loss", "grad/norm", "proximal/behavior_gap"):
        assert [s[key] for s in steps] == [s[key] for s in plain_steps], key

    # the new figures are in train_steps: offload after every step, onload from the second step on
    # (nothing was off the device before the first), the weight handoff of each step's version, the KV cache freed
    assert all(s["perf/offload_s"] > 0 for s in steps)
    assert steps[0]["perf/onload_s"] == 0 and all(s["perf/onload_s"] > 0 for s in steps[1:])
    assert all(s["perf/weight_sync_s"] >= 0 for s in steps) and all(s["perf/weight_sync_s"] > 0 for s in steps[1:])
    assert all(s["rollout/kv_released_bytes"] > 0 for s in steps)
    assert all("perf/weight_sync_s" in s and "perf/offload_s" not in s for s in plain_steps)
    assert all("rollout/kv_released_bytes" not in s for s in plain_steps)
