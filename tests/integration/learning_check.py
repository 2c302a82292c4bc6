"""The single-seed learning check the placements share (tests/integration/test_learning.py): one
seed of a bench/learning.py ``check-*`` case, asserting that its sampled held-out reward rose by
more than the margin every measured seed cleared."""

from __future__ import annotations

import pathlib
import subprocess

from bench.learning import CASES, CHECK_MARGIN, CHECK_SEED, evals, read_metrics, run_command

ROOT = pathlib.Path(__file__).resolve().parents[2]


def check_heldout_rises(case: str, run_dir: pathlib.Path, *, seed: int = CHECK_SEED, timeout: float = 1200) -> None:
    """Run one seed of bench/learning.py's ``case`` and assert its sampled held-out reward rose."""
    done = subprocess.run(run_command(CASES[case], run_dir, seed), cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    metrics = read_metrics(run_dir)
    sampled = evals(metrics, "eval/sampled_reward")
    assert len(sampled) == 2, metrics  # before the first step and after the last
    report = {"sampled": sampled, "greedy": evals(metrics, "eval/reward"), "margin": CHECK_MARGIN}
    assert sampled[-1] - sampled[0] > CHECK_MARGIN, report
