"""The drive loop: the one loop every placement trains through.

    drive(trainer, num_steps=40, eval_every=5, placement=Colocated(...), metrics=log)

Step until ``num_steps`` (``trainer.step()``: pull, update, checkpoint, ack, publish); before the first
step and every ``eval_every`` steps evaluate held-out reward; print a console line per evaluated step;
write every step's statistics (with the evaluation when there is one) to the metrics sink. While no
batch is ready, wait ``poll_interval_s`` between tries, say so every ``progress_every_s`` seconds, ask
the placement whether its producers are still alive, and give up after ``max_wait_s`` without one.

What differs between placements is a ``Placement``: how a step gets its batch (colocated: a rollout
round first, in this process), how held-out reward is measured, what can die while the trainer waits
(a rollout process, an agent, a proxy), and what the console line adds. ``rollbook run`` (colocated,
separated, online), the ray placement's rank 0 and ``rollbook train`` each give one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from rollbook.errors import CommandError

log = logging.getLogger("rollbook.trainer")


class StepTrainer(Protocol):
    """What the loop needs of a trainer (trainer/loop.py ``Trainer``)."""

    @property
    def state(self) -> Any: ...  # ``.step``: steps finished; ``.version``: the policy version

    def step(self) -> dict[str, Any] | None: ...  # one step's statistics, or None when no batch was ready


class MetricsSink(Protocol):
    """Where each step's row goes (rollbook/run/driving.py ``MetricsLog``: metrics.jsonl and trackers)."""

    def write(self, row: dict[str, Any]) -> None: ...


class Placement:
    """The part of a run that differs by placement. This base is a placement with no producer of its
    own (``rollbook train`` against a store others feed); each placement of ``rollbook run``
    overrides what it has."""

    poll_interval_s: float | None = None  # None: the drive's; 0 for a placement whose before_step produces

    def before_step(self) -> bool:
        """Called before every try of ``trainer.step()`` (colocated: a rollout round, submitted);
        False skips this try as if no batch were ready (online: too few rewarded turns yet)."""
        return True

    def stepped(self, stats: dict[str, Any]) -> None:
        """Called after a step with its statistics, which it may extend (the rollout's own counters)."""

    def evaluate(self) -> dict[str, Any]:
        """Held-out evaluation as ``eval/...`` metrics; ``{}`` when the placement has none."""
        return {}

    def waiting(self) -> str | None:
        """Called while no batch is ready: raise when a producer died; return a reason to stop the run
        early (a dataset whose epochs are done), else None."""
        return None

    def console_extra(self, stats: dict[str, Any]) -> str:
        """Text the console line of an evaluated step adds (``staleness<=2  ``)."""
        return ""


class NoBatchError(CommandError):
    """No batch came within ``max_wait_s`` (a one-line error for the user: exit 1)."""


@dataclass
class Outcome:
    """What a drive returns: the evaluations before the first and after the last step of this start,
    every step's row, and why it stopped early (None: it reached ``num_steps``)."""

    first: dict[str, Any]
    last: dict[str, Any]
    history: list[dict[str, Any]]
    stopped: str | None = None

    def summary(self) -> dict[str, Any]:
        return {"first": self.first, "last": self.last}


def drive(
    trainer: StepTrainer,
    *,
    num_steps: int,
    placement: Placement | None = None,
    eval_every: int = 0,
    metrics: MetricsSink | None = None,
    max_wait_s: float = 600.0,
    poll_interval_s: float = 0.5,
    progress_every_s: float = 10.0,
    say: Callable[[str], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Outcome:
    """Train ``trainer`` to ``num_steps`` (see the module docstring). ``eval_every`` 0 evaluates never
    (nor before the first step); ``say`` prints console lines (None: silent)."""
    placement = placement or Placement()
    poll = poll_interval_s if placement.poll_interval_s is None else placement.poll_interval_s
    emit = say or (lambda text: None)
    first: dict[str, Any] = {}
    last: dict[str, Any] = {}
    if eval_every > 0:
        first = {"step": trainer.state.step, **placement.evaluate()}
        if len(first) > 1:
            last = first
            _write(metrics, first)
            emit(f"held-out reward before step {trainer.state.step}: {heldout_text(first)}")
    history: list[dict[str, Any]] = []
    waited_since = last_said = clock()
    while trainer.state.step < num_steps:
        stats = trainer.step() if placement.before_step() else None
        now = clock()
        if stats is None:
            reason = placement.waiting()
            if reason is not None:
                emit(f"{reason} at step {trainer.state.step}: stopping")
                return Outcome(first, last, history, stopped=reason)
            if now - waited_since > max_wait_s:
                raise NoBatchError(
                    f"no batch from the store for {max_wait_s:g} s at step {trainer.state.step} (version "
                    f"{trainer.state.version}); is a rollout worker submitting? (max_wait_s)"
                )
            if now - last_said >= progress_every_s:
                log.info(
                    "waiting for a batch: step %d, version %d, %.0f s of max_wait_s %g",
                    trainer.state.step,
                    trainer.state.version,
                    now - waited_since,
                    max_wait_s,
                )
                last_said = now
            sleep(poll)
            continue
        waited_since = last_said = now
        placement.stepped(stats)
        done = trainer.state.step
        if eval_every > 0 and (done % eval_every == 0 or done == num_steps):
            evaluation = placement.evaluate()
            stats.update(evaluation)
            if evaluation:
                last = {k: v for k, v in stats.items() if k.startswith("eval/") or k == "step"}
            emit(step_line(stats, num_steps, extra=placement.console_extra(stats)))
        _write(metrics, stats)
        history.append(stats)
    return Outcome(first, last, history)


def _write(metrics: MetricsSink | None, row: dict[str, Any]) -> None:
    if metrics is not None:
        metrics.write(row)


def heldout_text(evals: dict[str, Any]) -> str:
    """``0.611 greedy, 0.540 sampled`` (the sampled figure when the evaluation made one)."""
    if "eval/reward" not in evals:
        return "not evaluated"
    text = f"{evals['eval/reward']:.3f} greedy"
    if "eval/sampled_reward" in evals:
        text += f", {evals['eval/sampled_reward']:.3f} sampled"
    return text


def step_line(stats: dict[str, Any], num_steps: int, *, extra: str = "") -> str:
    """The console line of a finished step. ``step`` is the ``train_steps.step`` of the row the
    trainer reported (0-based, as in SQL); ``done/num_steps`` counts the steps finished."""
    step = int(stats["step"])
    return (
        f"step {step:4d} ({step + 1}/{num_steps} done)  train reward {stats['reward/mean']:.3f}  "
        f"held-out {heldout_text(stats)}  loss {stats['loss/total']:+.4f}  {extra}"
        f"{stats['perf/tokens_per_s']:.0f} tok/s"
    )
