"""The promotion gate end to end (rollbook/run/gate.py, docs/gate.md): a short colocated run against a
real store process, one version damaged on purpose (``rollbook.run.gate.TEST_DAMAGE``): that version
never reaches the rollout engine nor any stored token, the ledger records its refusal with the gate's
figures, the trainer goes on from the last promoted version's weights and optimizer state, and
``rollbook admin rollback`` rolls the stopped run back by hand so that the next run resumes there.

A tiny student's greedy held-out reward after a short warm start is often 0 (ten held-out problems),
so the gate's deciding figure here is its regression set: the training problems the warm-started
student answers right at greedy. The RL steps are too small to change a greedy answer, so every
version solves them but the damaged one."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import duckdb
import pytest
import torch

from rollbook.config import RunConfig, load_config
from rollbook.run import gate as gate_module
from rollbook.run.main import _run_with_store
from rollbook.run.store_process import StoreProcess

ROOT = pathlib.Path(__file__).resolve().parents[2]
DAMAGED = 2  # the version the test damages: step 1 produces it
NUM_STEPS = 4  # versions 1, 2 (refused), 3 (version 1 restored), 4, 5
KEYS = {"admin_key": "a", "trainer_key": "t", "worker_key": "w", "reader_key": "r"}
OVERRIDES = [
    *("--num_steps", str(NUM_STEPS), "--eval_every", "2"),
    *("--rollout.domains", '["arithmetic"]', "--rollout.num_eval_tasks", "10", "--rollout.num_eval_samples", "0"),
    *("--trainer.num_samples", "16", "--rollout.group_size", "4", "--rollout.num_prompts", "4"),
    *("--trainer.model.hidden_size", "64", "--trainer.model.intermediate_size", "128"),
    # a student that answers some problems, and RL steps too small to change a greedy answer: only the
    # damaged version moves the gate's figures
    *("--warm_start.student_steps", "300", "--warm_start.batch_size", "32", "--warm_start.lr", "1e-2"),
    *("--trainer.lr", "1e-7", "--trainer.keep_last", "10"),
    *("--gate.enabled", "true", "--gate.max_drop", "0.2"),
]


def _config(run_dir: pathlib.Path, *extra: str) -> RunConfig:
    return load_config(RunConfig, "configs/smoke.toml", [*OVERRIDES, "--run_dir", str(run_dir), *extra])


@pytest.fixture(scope="module")
def student(tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path]:
    """The warm-started student every run here starts from (built once, as ``rollbook run`` caches it),
    and the regression set: the training problems it answers right at greedy, on the engine the gate uses."""
    from rollbook.rollout.engines import native_engine
    from rollbook.rollout.worker import RolloutWorker
    from rollbook.run.driving import engine_copy
    from rollbook.trainer.model_builders import build_models

    run_dir = tmp_path_factory.mktemp("warm")
    config = _config(run_dir)
    model, _ = build_models(config)
    worker = RolloutWorker(
        native_engine(engine_copy(model, config.rollout), config.rollout, version=0), config.rollout, model_id="tiny"
    )
    solved = [t for t in worker.train_tasks[:40] if worker.evaluate([t])["eval/reward"] == 1.0]
    assert len(solved) >= 2, "the warm start left the student solving too few problems for a regression set"
    regression = run_dir / "regression.jsonl"
    regression.write_text(
        "".join(json.dumps({"domain": t.domain, "prompt": t.prompt, "answer": t.answer}) + "\n" for t in solved)
    )
    return run_dir / "base-student", regression


def _run(run_dir: pathlib.Path, regression: pathlib.Path, *extra: str) -> None:
    """One colocated run of the config against its own store process (resumes when run_dir has a checkpoint)."""
    config = _config(run_dir, "--gate.regression", str(regression), *extra)
    store = StoreProcess(run_dir / "rollbook.duckdb", **KEYS)
    try:
        _run_with_store(config, store, KEYS)
    finally:
        store.stop()


def _sql(run_dir: pathlib.Path, sql: str) -> list[tuple]:
    con = duckdb.connect(str(run_dir / "rollbook.duckdb"), read_only=True)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


@pytest.fixture(scope="module")
def gated_run(tmp_path_factory, student):
    """The run with version 2 damaged (every weight zeroed as it is published): what rollout was
    given, and the trainer's weights at each version it published."""
    base, regression = student
    run_dir = tmp_path_factory.mktemp("gate") / "run"
    run_dir.mkdir()
    shutil.copytree(base, run_dir / "base-student")
    served: list[int] = []  # the rollout engine's version after each promotion
    weights: dict[int, dict[str, torch.Tensor]] = {}
    original = gate_module.EngineRollout.publish_model

    def publish_model(self, version, model):
        original(self, version, model)
        served.append(self.engine.version)

    def damage(version, model):
        if version == DAMAGED:
            with torch.no_grad():
                for p in model.parameters():
                    p.zero_()
        weights[version] = {k: v.detach().clone() for k, v in model.state_dict().items()}

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gate_module.EngineRollout, "publish_model", publish_model)
        mp.setattr(gate_module, "TEST_DAMAGE", damage)
        _run(run_dir, regression)
    return run_dir, served, weights


def test_a_refused_version_never_reaches_the_rollout_engine_nor_a_stored_token(gated_run):
    run_dir, served, _ = gated_run
    assert DAMAGED not in served and served == [0, 1, 3, 4, 5]
    assert _sql(run_dir, "SELECT count(*) FROM trajectories")[0][0] > 0
    assert _sql(run_dir, f"SELECT count(*) FROM trajectories WHERE list_contains(output_versions, {DAMAGED})") == [(0,)]
    assert _sql(run_dir, f"SELECT count(*) FROM trajectories WHERE min_version = {DAMAGED}") == [(0,)]
    assert {v for (v,) in _sql(run_dir, "SELECT DISTINCT min_version FROM trajectories")} == {0, 1, 3, 4}


def test_the_ledger_records_each_verdict_with_the_gates_figures(gated_run):
    run_dir, _, _ = gated_run
    rows = _sql(run_dir, "SELECT version, status, gate FROM policy_versions ORDER BY version")
    assert [(v, s) for v, s, _ in rows] == [
        (0, "promoted"),
        (1, "promoted"),
        (2, "refused"),
        (3, "promoted"),
        (4, "promoted"),
        (5, "promoted"),
    ]
    gates = {v: json.loads(g) for v, _, g in rows}
    refused = gates[DAMAGED]
    assert refused["regression_reward"] == 0.0 and refused["reward"] == 0.0 and refused["heldout"] == {"arithmetic": 0.0}
    assert refused["baseline_version"] == 1 and refused["baseline_reward"] == gates[1]["reward"] and refused["max_drop"] == 0.2
    assert refused["step"] == 2 and refused["reasons"][-1] == "regression reward 0.0000 is below regression_min_reward 1"
    assert all(gates[v]["regression_reward"] == 1.0 for v in (0, 1, 3, 4, 5))
    assert gates[3]["restores"] == 1 and gates[3]["after_refusal"] == DAMAGED and gates[3]["reward"] == gates[1]["reward"]
    assert gates[0]["baseline"] is True
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    decided = [(m["gate/version"], m["gate/promoted"], m["gate/rollout_version"]) for m in metrics if "gate/version" in m]
    assert decided == [(1, 1.0, 1), (2, 0.0, 3), (4, 1.0, 4), (5, 1.0, 5)]


def test_after_a_refusal_the_trainer_goes_on_from_the_last_promoted_weights_and_optimizer_state(gated_run):
    run_dir, _, weights = gated_run
    assert all(torch.equal(weights[3][k], weights[1][k]) for k in weights[1])  # published again as version 3
    assert not all(torch.equal(weights[3][k], weights[DAMAGED][k]) for k in weights[1])
    one = torch.load(run_dir / "checkpoints/step-000001/state.pt", weights_only=False)
    restored = torch.load(run_dir / "checkpoints/step-000002/state.pt", weights_only=False)
    assert json.loads((run_dir / "checkpoints/step-000002/trainer.json").read_text())["version"] == 3
    for key in ("model", "optimizer"):
        assert torch.equal(
            torch.cat([t.flatten() for t in _tensors(restored[key])]), torch.cat([t.flatten() for t in _tensors(one[key])])
        )
    # step 2 trained from the restored version on rows it generated: on-policy, version 4 next
    assert _sql(run_dir, "SELECT step, version, (stats->>'$.\"batch/staleness_max\"')::INT FROM train_steps ORDER BY step") == [
        (0, 1, 0),
        (1, 2, 0),
        (2, 4, 0),
        (3, 5, 0),
    ]


def _tensors(state) -> list[torch.Tensor]:
    """Every tensor of a (nested) state dict, in key order."""
    if isinstance(state, torch.Tensor):
        return [state.float()]
    if isinstance(state, dict):
        return [t for k in sorted(state, key=str) for t in _tensors(state[k])]
    if isinstance(state, (list, tuple)):
        return [t for item in state for t in _tensors(item)]
    return []


def _admin(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rollbook.cli", "admin", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_admin_rollback_rolls_a_stopped_run_back_and_the_next_run_resumes_there(gated_run, student, tmp_path):
    source, _, _ = gated_run
    run_dir = tmp_path / "run"
    shutil.copytree(source, run_dir)
    refused = _admin("rollback", "tiny", str(DAMAGED), "--run-dir", str(run_dir))
    assert refused.returncode == 1 and "was refused by the gate" in refused.stderr
    store = StoreProcess(run_dir / "rollbook.duckdb", **KEYS)
    try:
        held = _admin("rollback", "tiny", "4", "--run-dir", str(run_dir))
    finally:
        store.stop()
    assert held.returncode == 1 and "held by another process" in held.stderr

    done = _admin("rollback", "tiny", "4", "--run-dir", str(run_dir))
    assert done.returncode == 0, done.stderr
    assert "versions after it marked rolled_back (5)" in done.stdout
    statuses = dict(_sql(run_dir, "SELECT version, status FROM policy_versions"))
    assert statuses[5] == "rolled_back" and statuses[6] == "promoted" and statuses[DAMAGED] == "refused"
    latest = run_dir / "checkpoints" / (run_dir / "checkpoints/LATEST").read_text().strip()
    assert json.loads((latest / "trainer.json").read_text())["version"] == 6
    assert (latest / "state.pt").samefile(run_dir / "checkpoints/step-000003/state.pt")  # version 4's files, linked

    _run(run_dir, student[1], "--num_steps", str(NUM_STEPS + 1))
    assert _sql(run_dir, "SELECT step, version FROM train_steps WHERE step = 4") == [(4, 7)]
    rows = _sql(run_dir, f"SELECT DISTINCT min_version FROM trajectories WHERE created_at > {latest.stat().st_mtime}")
    assert rows == [(6,)]  # the resumed run generated with version 4's weights, as version 6
    assert dict(_sql(run_dir, "SELECT version, status FROM policy_versions"))[7] == "promoted"


def test_the_report_shows_the_gates_verdicts(gated_run, tmp_path):
    from rollbook.cli.report import write_report

    run_dir, _, _ = gated_run
    report = write_report([run_dir], tmp_path, quiet=True)
    verdicts = json.loads((run_dir / "summary.json").read_text())["gate"]
    assert [(v["version"], v["status"], v["step"]) for v in verdicts] == [
        (0, "promoted", 0),
        (1, "promoted", 1),
        (2, "refused", 2),
        (3, "promoted", 2),
        (4, "promoted", 3),
        (5, "promoted", 4),
    ]
    assert "refused: v2 (0.000)" in report.read_text() and (tmp_path / "heldout.png").stat().st_size > 0
