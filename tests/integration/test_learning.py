"""Learning is shown: ``rollbook run`` on the CPU tasks (real store process, DuckDB ledger, native
engine, PyTorch training) raises held-out reward with decoupled PPO, and MOPD toward a better teacher
shrinks the student's log-prob gap to it. Each claim is checked over several seeds, never one.

What is measured, and why (docs/RESULTS.md, "Why step 0 moved between machines"):
- the warm-started student lands on a steep part of the string-reversal learning curve, so its
  *greedy* held-out accuracy at step 0 depends on float rounding (AVX2 vs AVX-512 kernels gave 0.167
  and 0.500 with the same seeds) and on the seed (0.09 to 0.56). A threshold on greedy accuracy
  relative to that start passes or fails by luck;
- the *sampled* held-out reward (``eval/sampled_reward``: 8 answers per problem at the rollout
  temperature, drawn with one fixed seed at every evaluation) is the policy's expected reward, the
  quantity RL raises; it moves smoothly with the weights, so its rise is what the PPO test holds;
- MOPD's own objective is the teacher gap (log pi_teacher - log pi_student on the student's tokens),
  which every seed shrinks when the teacher is far ahead; its held-out reward is not asserted.
The thresholds hold for every seed measured while writing them (docs/RESULTS.md); the effects are
small on these toy tasks, and domains where RL and MOPD move held-out reward by a wide margin are
the next step (issue 13).
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SEEDS = (0, 1, 2)

pytestmark = pytest.mark.slow


def _run(run_dir: pathlib.Path, seed: int, *overrides: str) -> list[dict]:
    cmd = [
        sys.executable,
        "-m",
        "rollbook.cli",
        "run",
        "--config",
        "configs/quickstart.toml",
        "--run_dir",
        str(run_dir),
        "--num_steps",
        "30",
        "--eval_every",
        "30",
        "--warm_start.seed",
        str(seed),
        "--trainer.model.seed",
        str(seed),
        "--rollout.seed",
        str(seed),
        *overrides,
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _evals(metrics: list[dict], key: str) -> list[float]:
    return [m[key] for m in metrics if key in m]


@pytest.mark.timeout(2400)  # three runs; pytest's 600 s default is too short for a loaded CI machine
def test_decoupled_ppo_raises_sampled_heldout_and_training_reward(tmp_path):
    gains, train_gains, report = [], [], []
    for seed in SEEDS:
        metrics = _run(tmp_path / f"ppo-{seed}", seed)
        sampled = _evals(metrics, "eval/sampled_reward")
        reverse = _evals(metrics, "reward/reverse")
        gains.append(sampled[-1] - sampled[0])
        train_gains.append(np.mean(reverse[-10:]) - np.mean(reverse[:5]))
        report.append((seed, sampled, _evals(metrics, "eval/reward"), train_gains[-1]))
    # no seed collapses, and over the seeds the expected held-out reward and the training reward rise
    # (seeds 0-4 measured: held-out +0.101, -0.022, +0.207, +0.054, -0.004; every three of them
    # average above +0.009; a seed that never finds string reversal moves little either way)
    assert min(gains) > -0.05, report
    assert np.mean(gains) > 0.005, report
    assert np.mean(train_gains) > 0.0, report


@pytest.mark.timeout(2400)  # three runs with a 400-step teacher each: 8 min per run on a loaded machine
def test_mopd_toward_a_better_teacher_shrinks_the_gap(tmp_path):
    """MOPD alone, from a student far below the teacher (60 warm-start steps against 400): on every
    seed the student's tokens move toward the teacher. Held-out reward is not asserted: on these
    tasks distillation toward one 0.25 M-parameter teacher moved it by -0.08 to +0.02 over 30 steps
    (docs/RESULTS.md)."""
    report = []
    for seed in SEEDS:
        metrics = _run(
            tmp_path / f"mopd-{seed}",
            seed,
            "--trainer.loss.rl_coef",
            "0",
            "--trainer.loss.distill_coef",
            "1",
            "--warm_start.teacher_steps",
            "400",
            "--warm_start.student_steps",
            "60",
            "--trainer.lr",
            "1e-4",
        )
        gaps = [
            np.mean([v for k, v in m.items() if k.startswith("teacher_gap/")])
            for m in metrics
            if any(k.startswith("teacher_gap/") for k in m)
        ]
        early, late = float(np.mean(gaps[:5])), float(np.mean(gaps[-10:]))
        report.append((seed, round(early, 3), round(late, 3), _evals(metrics, "eval/sampled_reward")))
        # the gap is log pi_teacher - log pi_student on the student's own tokens: negative, heading to 0
        # (seeds 0-2 measured: it ends at 0.82, 0.79 and 0.89 of its start)
        assert abs(late) < 0.95 * abs(early), report
