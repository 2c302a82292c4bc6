"""The drive loop (trainer/drive.py) with a scripted trainer and placement: when it evaluates, what
it writes, how it waits, when it gives up and when a placement stops it early."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rollbook.trainer.drive import NoBatchError, Placement, drive, step_line


class ScriptedTrainer:
    """``step()`` answers from a script: True = a step with statistics, False = no batch ready."""

    def __init__(self, script: list[bool], start: int = 0):
        self.script = list(script)
        self.state = SimpleNamespace(step=start, version=start)

    def step(self):
        if not self.script.pop(0):
            return None
        row = {"step": self.state.step, "reward/mean": 0.5, "loss/total": 0.1, "perf/tokens_per_s": 100.0}
        self.state.step += 1
        self.state.version += 1
        return row


class Recorder(Placement):
    def __init__(self, evals=None, stop_after_waits: int | None = None, skip: int = 0):
        self.calls: list[str] = []
        self.evals = list(evals or [])
        self.stop_after_waits, self.waits, self.skip = stop_after_waits, 0, skip

    def before_step(self) -> bool:
        self.calls.append("before")
        if self.skip:
            self.skip -= 1
            return False
        return True

    def stepped(self, stats):
        self.calls.append("stepped")
        stats["rollout/rounds"] = 1

    def evaluate(self):
        self.calls.append("evaluate")
        return {"eval/reward": self.evals.pop(0) if self.evals else 0.0}

    def waiting(self):
        self.waits += 1
        if self.stop_after_waits is not None and self.waits >= self.stop_after_waits:
            return "dataset epochs done"
        return None

    def console_extra(self, stats):
        return "extra  "


class Rows(list):
    def write(self, row):
        self.append(dict(row))


def test_evaluates_before_the_first_step_every_n_steps_and_at_the_last():
    trainer, placement, rows, said = ScriptedTrainer([True] * 5), Recorder(evals=[0.1, 0.2, 0.3, 0.4]), Rows(), []
    out = drive(trainer, num_steps=5, placement=placement, eval_every=2, metrics=rows, say=said.append)
    assert trainer.state.step == 5
    assert [r["step"] for r in rows] == [0, 0, 1, 2, 3, 4]  # the evaluation before step 0, then each step's row
    assert [r.get("eval/reward") for r in rows] == [0.1, None, 0.2, None, 0.3, 0.4]  # after 2, 4 and the last (5) done
    assert out.first == {"step": 0, "eval/reward": 0.1}
    assert out.last == {"step": 4, "eval/reward": 0.4}
    assert all(r.get("rollout/rounds") == 1 for r in rows[1:])  # the placement's own counters join the row
    assert said[0] == "held-out reward before step 0: 0.100 greedy"
    assert said[1].startswith("step    1 (2/5 done)") and "extra  100 tok/s" in said[1]
    assert len(out.history) == 5 and out.stopped is None


def test_eval_every_zero_never_evaluates():
    placement = Recorder()
    out = drive(ScriptedTrainer([True] * 3), num_steps=3, placement=placement, eval_every=0)
    assert "evaluate" not in placement.calls and out.first == {} and out.last == {}


def test_a_resumed_trainer_starts_at_its_step():
    rows = Rows()
    drive(ScriptedTrainer([True] * 2, start=3), num_steps=5, placement=Recorder(), eval_every=10, metrics=rows)
    assert [r["step"] for r in rows] == [3, 3, 4]


def test_waits_without_a_batch_then_trains_on():
    slept: list[float] = []
    trainer = ScriptedTrainer([False, False, True, True])
    out = drive(trainer, num_steps=2, placement=Recorder(), poll_interval_s=0.25, sleep=slept.append)
    assert trainer.state.step == 2 and slept == [0.25, 0.25] and len(out.history) == 2


def test_a_placement_that_skips_a_try_costs_no_step():
    trainer, placement = ScriptedTrainer([True, True]), Recorder(skip=3)
    drive(trainer, num_steps=2, placement=placement, sleep=lambda s: None)
    assert placement.calls.count("before") == 5 and placement.calls.count("stepped") == 2


def test_gives_up_after_max_wait_s_without_a_batch():
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    trainer = ScriptedTrainer([False] * 100)
    with pytest.raises(NoBatchError, match=r"no batch from the store for 2 s at step 0 .*max_wait_s"):
        drive(trainer, num_steps=1, placement=Recorder(), max_wait_s=2.0, poll_interval_s=0.5, clock=lambda: now[0], sleep=sleep)


def test_a_placement_can_stop_the_run_early_with_its_reason():
    said: list[str] = []
    trainer = ScriptedTrainer([True, False, False, False])
    out = drive(trainer, num_steps=5, placement=Recorder(stop_after_waits=2), say=said.append, sleep=lambda s: None)
    assert out.stopped == "dataset epochs done" and trainer.state.step == 1
    assert said[-1] == "dataset epochs done at step 1: stopping"


def test_a_dead_producer_raises_out_of_the_loop():
    class Dead(Recorder):
        def waiting(self):
            raise RuntimeError("rollout worker exited with 1")

    with pytest.raises(RuntimeError, match="exited with 1"):
        drive(ScriptedTrainer([False]), num_steps=1, placement=Dead(), sleep=lambda s: None)


def test_step_line_counts_finished_steps():
    row = {"step": 9, "reward/mean": 0.25, "loss/total": -0.01, "perf/tokens_per_s": 1234.0, "eval/reward": 0.5}
    assert step_line(row, 40) == ("step    9 (10/40 done)  train reward 0.250  held-out 0.500 greedy  loss -0.0100  1234 tok/s")
