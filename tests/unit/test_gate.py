"""The promotion gate's decisions (rollbook/run/gate.py) on a real ``Trainer`` with a fake store, a
scripted held-out figure and a rollout side that records what it is given; its config checks; the
regression file; ``roll_back_run`` on a run directory and a real ledger file (no store process)."""

from __future__ import annotations

import json

import pytest
import torch

from rollbook.config import RunConfig, TrainerConfig
from rollbook.config.run import GateConfig
from rollbook.errors import CommandError, ConfigError
from rollbook.language_models import TinyModelSpec, build_tiny_model
from rollbook.run.gate import Gate, kept_promoted, read_regression_tasks, roll_back_run
from rollbook.store.ledger import Ledger
from rollbook.trainer.loop import Trainer
from tests.unit.trainer.test_loop import FakeStore


class StatusStore(FakeStore):
    """The fake store, also recording the gate's verdicts."""

    def __init__(self):
        super().__init__()
        self.verdicts: list[tuple[int, str, dict]] = []

    def set_version_status(self, model_id, version, status, gate=None):
        self.verdicts.append((version, status, dict(gate or {})))


class Rollout:
    """The rollout side: the versions it was given, and the weights of each."""

    def __init__(self):
        self.versions: list[int] = []
        self.weights: dict[int, dict[str, torch.Tensor]] = {}

    def publish_model(self, version, model):
        self.publish_state(version, model.state_dict())

    def publish_state(self, version, state):
        self.versions.append(version)
        self.weights[version] = {k: v.detach().clone() for k, v in state.items()}


def _trainer(tmp_path, store, **overrides) -> Trainer:
    config = TrainerConfig(
        **{"run_dir": str(tmp_path), "num_steps": 6, "num_samples": 4, "model": {"vocab_size": 32}, **overrides}
    )
    torch.manual_seed(0)
    return Trainer(config, store, model=build_tiny_model(TinyModelSpec(vocab_size=32)))


def _gate(trainer, store, rollout, rewards: dict[int, float], *, max_staleness: int = 0, **config) -> Gate:
    """A started gate whose held-out figure for the trainer's version ``v`` is ``rewards[v]`` (0.5 unset)."""
    heldout = lambda: {"eval/reward": rewards.get(trainer.state.version, 0.5), "eval/d": 0.0}  # noqa: E731
    gate = Gate(
        GateConfig(enabled=True, **config),
        trainer=trainer,
        client=store,
        rollout=rollout,
        heldout=heldout,
        max_staleness=max_staleness,
    )
    gate.start()
    return gate


def _step(trainer, gate) -> dict:
    stats = trainer.step()
    assert stats is not None
    gate.after_step(stats)
    return stats


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_only_every_nth_version_is_decided_and_the_versions_between_never_reach_rollout(tmp_path):
    store, rollout = StatusStore(), Rollout()
    trainer = _trainer(tmp_path, store)
    trainer.start()
    gate = _gate(trainer, store, rollout, {}, every=2, max_staleness=1)
    held = _step(trainer, gate)
    decided = _step(trainer, gate)
    assert rollout.versions == [0, 2]
    assert [(v, s) for v, s, _ in store.verdicts] == [(0, "promoted"), (2, "promoted")]
    assert held == {**held, "gate/rollout_version": 0} and "gate/version" not in held
    assert decided["gate/version"] == 2 and decided["gate/promoted"] == 1.0 and decided["gate/rollout_version"] == 2
    assert kept_promoted(tmp_path).version == 2  # type: ignore[union-attr]


@pytest.mark.parametrize("offload", [False, True], ids=["resident", "offloaded"])
def test_a_refused_version_rolls_the_trainer_back_to_the_promoted_weights_and_optimizer_under_a_new_version(tmp_path, offload):
    store, rollout = StatusStore(), Rollout()
    trainer = _trainer(tmp_path, store, offload_optimizer=offload)
    trainer.start()
    gate = _gate(trainer, store, rollout, {2: 0.1}, max_drop=0.2)
    _step(trainer, gate)
    promoted_model = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    promoted_optimizer = [t.clone() for s in trainer.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    stats = _step(trainer, gate)
    assert stats["gate/version"] == 2 and stats["gate/promoted"] == 0.0 and stats["gate/rollout_version"] == 3
    assert (trainer.state.step, trainer.state.version) == (2, 3)  # the step count goes on, the version is a new one
    assert _same({k: v.detach() for k, v in trainer.model.state_dict().items()}, promoted_model)
    restored = [t for s in trainer.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    assert all(torch.equal(a, b) for a, b in zip(restored, promoted_optimizer, strict=True))
    assert rollout.versions == [0, 1, 3] and _same(rollout.weights[3], rollout.weights[1])
    verdicts = {v: (s, g) for v, s, g in store.verdicts}
    assert verdicts[2][0] == "refused" and verdicts[2][1]["reward"] == 0.1 and verdicts[2][1]["baseline_reward"] == 0.5
    assert "more than max_drop 0.2 below promoted version 1's 0.5000" in verdicts[2][1]["reasons"][0]
    assert verdicts[3] == ("promoted", {"reward": 0.5, "heldout": {"d": 0.0}, "step": 2, "restores": 1, "after_refusal": 2})
    latest = json.loads((tmp_path / "checkpoints" / (tmp_path / "checkpoints/LATEST").read_text() / "trainer.json").read_text())
    assert (latest["step"], latest["version"]) == (2, 3)
    assert ("publish", 3) in store.calls
    assert (trainer._offloaded is not None) == offload  # off the device between steps, as after any step
    _step(trainer, gate)  # the next version is decided against the restored one
    assert rollout.versions[-1] == 4 and store.verdicts[-1][:2] == (4, "promoted")


def test_continue_trains_on_from_the_refused_weights_and_stops_when_rows_would_be_too_stale(tmp_path):
    store, rollout = StatusStore(), Rollout()
    trainer = _trainer(tmp_path, store)
    trainer.start()
    gate = _gate(trainer, store, rollout, {1: 0.0, 2: 0.0}, on_refuse="continue", max_staleness=1)
    _step(trainer, gate)  # version 1 refused: the trainer at 1, rollout at 0, one version stale: allowed
    assert trainer.state.version == 1 and rollout.versions == [0]
    with pytest.raises(CommandError, match="train version 2 on rows of version 0, 2 versions stale, past max_staleness 1"):
        _step(trainer, gate)
    assert [(v, s) for v, s, _ in store.verdicts] == [(0, "promoted"), (1, "refused"), (2, "refused")]


def test_a_restarted_run_gives_rollout_the_kept_version_and_decides_the_version_it_resumes_at(tmp_path):
    store, rollout = StatusStore(), Rollout()
    trainer = _trainer(tmp_path, store)
    trainer.start()
    gate = _gate(trainer, store, rollout, {1: 0.0}, on_refuse="continue", max_staleness=1)
    _step(trainer, gate)
    resumed, again = StatusStore(), Rollout()
    second = _trainer(tmp_path, resumed)
    assert second.start().version == 1
    _gate(second, resumed, again, {1: 0.0}, on_refuse="continue", max_staleness=1)
    assert again.versions == [0] and _same(again.weights[0], rollout.weights[0])  # from the kept checkpoint
    assert [(v, s) for v, s, _ in resumed.verdicts] == [(1, "refused")]


def test_a_regression_set_below_its_minimum_refuses_the_version(tmp_path):
    store, rollout = StatusStore(), Rollout()
    trainer = _trainer(tmp_path, store)
    trainer.start()
    scores = iter([1.0, 0.5])
    gate = Gate(
        GateConfig(enabled=True),
        trainer=trainer,
        client=store,
        rollout=rollout,
        heldout=lambda: {"eval/reward": 0.5},
        regression=lambda: {"eval/reward": next(scores)},
    )
    gate.start()
    _step(trainer, gate)
    refused = store.verdicts[1]  # then version 2 restores version 0
    assert refused[:2] == (1, "refused") and refused[2]["regression_reward"] == 0.5
    assert refused[2]["reasons"] == ["regression reward 0.5000 is below regression_min_reward 1"]


def test_the_config_refuses_a_gate_the_run_cannot_keep():
    with pytest.raises(ValueError, match="set max_staleness >= 1 or a smaller gate.every"):
        RunConfig.model_validate({"gate": {"enabled": True, "every": 2}})
    with pytest.raises(ValueError, match="set max_staleness >= 1, or gate.on_refuse = 'rollback'"):
        RunConfig.model_validate({"gate": {"enabled": True, "on_refuse": "continue"}})
    with pytest.raises(ValueError, match="not with placement 'ray'"):
        RunConfig.model_validate({"placement": "ray", "gate": {"enabled": True}})
    config = RunConfig.model_validate({"placement": "separated", "gate": {"enabled": True, "on_refuse": "continue"}})
    assert config.max_staleness == 2
    assert not RunConfig().gate.enabled


def test_regression_lines_are_read_as_toy_tasks_and_a_bad_line_is_named(tmp_path):
    path = tmp_path / "regression.jsonl"
    path.write_text(
        '{"domain": "arithmetic", "prompt": "1+2=", "answer": "3"}\n\n{"domain": "reverse", "prompt": "ab", "answer": "ba", "task_id": "r1"}\n'
    )
    tasks = read_regression_tasks(path, {"arithmetic", "reverse"})
    assert [(t.task_id, t.domain, t.answer) for t in tasks] == [("regression/1", "arithmetic", "3"), ("r1", "reverse", "ba")]
    with pytest.raises(ConfigError, match=r"regression.jsonl:3: domain 'reverse' is not in rollout.domains \['arithmetic'\]"):
        read_regression_tasks(path, {"arithmetic"})
    path.write_text('{"domain": "arithmetic", "prompt": 1}\n')
    with pytest.raises(ConfigError, match=r':1: needs string fields "domain", "prompt" and "answer"'):
        read_regression_tasks(path, {"arithmetic"})


def test_roll_back_run_marks_the_later_versions_and_makes_the_kept_checkpoint_the_latest_under_a_new_version(tmp_path):
    run_dir, db = tmp_path / "run", tmp_path / "run" / "rollbook.duckdb"
    trainer = _trainer(run_dir, FakeStore(), keep_last=10)
    trainer.start()
    for _ in range(3):
        trainer.step()
    ledger = Ledger(db)
    try:
        ledger.register_model("tiny", 32)
        for version in range(4):
            ledger.publish_version("tiny", version, f"sum-{version}")
        ledger.set_version_status("tiny", 2, "refused", json.dumps({"reward": 0.0}))
        ledger.set_version_status("tiny", 1, "promoted", json.dumps({"reward": 0.4, "heldout": {"d": 0.4}}))
    finally:
        ledger.close()
    with pytest.raises(CommandError, match="version 2 of model 'tiny' was refused by the gate"):
        roll_back_run(run_dir, db, "tiny", 2)
    with pytest.raises(CommandError, match="version 9 of model 'tiny' was never published"):
        roll_back_run(run_dir, db, "tiny", 9)

    done = roll_back_run(run_dir, db, "tiny", 1)
    assert (done.version, done.new_version, done.step, done.marked) == (1, 4, 3, [3])
    latest = json.loads((done.checkpoint / "trainer.json").read_text())
    assert (latest["step"], latest["version"]) == (3, 4) and done.checkpoint.name == "step-000003"
    assert (done.checkpoint / "state.pt").samefile(run_dir / "checkpoints/step-000001/state.pt")
    kept = kept_promoted(run_dir)
    assert kept is not None and (kept.version, kept.reward) == (4, 0.4)
    ledger = Ledger(db)
    try:
        rows = ledger.con.execute("SELECT version, status FROM policy_versions ORDER BY version").fetchall()
        assert rows == [(0, None), (1, "promoted"), (2, "refused"), (3, "rolled_back"), (4, "promoted")]
    finally:
        ledger.close()
    resumed = _trainer(run_dir, FakeStore())
    assert (resumed.start().step, resumed.state.version) == (3, 4)
    one = torch.load(run_dir / "checkpoints/step-000001/state.pt", weights_only=False)["model"]
    assert _same({k: v.detach() for k, v in resumed.model.state_dict().items()}, one)
    with pytest.raises(CommandError, match=r"no kept checkpoint of version 3 .* hold versions \[1, 2, 4\]"):
        roll_back_run(run_dir, db, "tiny", 3)


def test_a_run_rolled_back_by_hand_without_figures_is_measured_when_it_resumes(tmp_path):
    run_dir, db = tmp_path / "run", tmp_path / "run" / "rollbook.duckdb"
    trainer = _trainer(run_dir, FakeStore(), keep_last=10)
    trainer.start()
    for _ in range(2):
        trainer.step()
    ledger = Ledger(db)
    try:
        ledger.register_model("tiny", 32)
        for version in range(3):
            ledger.publish_version("tiny", version, "")
    finally:
        ledger.close()
    assert roll_back_run(run_dir, db, "tiny", 1).new_version == 3
    assert kept_promoted(run_dir).reward is None  # type: ignore[union-attr]  # no gate measured version 1
    store, rollout = StatusStore(), Rollout()
    resumed = _trainer(run_dir, store)
    assert resumed.start().version == 3
    _gate(resumed, store, rollout, {3: 0.25})
    assert rollout.versions == [3] and store.verdicts[-1][:2] == (3, "promoted")
    assert store.verdicts[-1][2]["reward"] == 0.25 and store.verdicts[-1][2]["restores"] == 1
    assert kept_promoted(run_dir).reward == 0.25  # type: ignore[union-attr]  # the baseline of the next decision
