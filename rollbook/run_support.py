"""What both placements of ``rollbook run`` (run.py: colocated, run_separated.py: separated) share:
the metrics file, installing a published version into an in-process engine, the console line of a
step, and reading how far a run directory's trainer got. Its own module so neither placement imports
the other's internals."""

from __future__ import annotations

import json
import pathlib
import time


class MetricsLog:
    """Appends one JSON object per line; remembers the latest evaluation."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        self._last_eval: dict = {}

    def write(self, row: dict) -> None:
        row = {"time": time.time(), **row}
        if "eval/reward" in row:
            self._last_eval = {k: v for k, v in row.items() if k.startswith("eval/") or k == "step"}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def last_eval(self) -> dict:
        return self._last_eval


def install_weights(engine, version: int, state_dict) -> None:
    """A weight publisher for an engine in this process: take ``version`` when it is newer."""
    if version > engine.version:
        engine.update_weights(state_dict, version)


def heldout_text(evals: dict) -> str:
    """``0.611 greedy, 0.540 sampled`` (the sampled figure when the evaluation made one)."""
    text = f"{evals['eval/reward']:.3f} greedy"
    if "eval/sampled_reward" in evals:
        text += f", {evals['eval/sampled_reward']:.3f} sampled"
    return text


def step_line(stats: dict, num_steps: int, *, extra: str = "") -> str:
    """The console line of a finished step. ``step`` is the ``train_steps.step`` of the row the
    trainer reported (0-based, as in SQL); ``done/num_steps`` counts the steps finished."""
    step = int(stats["step"])
    return (f"step {step:4d} ({step + 1}/{num_steps} done)  train reward {stats['reward/mean']:.3f}  "
            f"held-out {heldout_text(stats)}  loss {stats['loss/total']:+.4f}  {extra}"
            f"{stats['perf/tokens_per_s']:.0f} tok/s")


def steps_done(run_dir: pathlib.Path) -> int:
    """Trainer steps the run directory's latest checkpoint holds (0 without one); reads JSON only."""
    root = pathlib.Path(run_dir) / "checkpoints"
    try:
        name = (root / "LATEST").read_text().strip()
        return int(json.loads((root / name / "trainer.json").read_text())["step"])
    except (OSError, ValueError, KeyError):
        return 0
