"""Learning over seeds: ``rollbook run`` (real store process, DuckDB ledger, PyTorch training) on the
small CPU workloads, one JSON line per run and a summary line per case comparing each run's start
with its end, with a printed verdict against the thresholds the claims were measured with. Like the
other benches it never asserts: the verdict is information, the exit status is non-zero only when a
run itself fails.

    python bench/learning.py                                   # every case, seeds 0-2 (about an hour on 2 cores)
    python bench/learning.py --cases ppo mopd --seeds 0 1 2 3 4
    python bench/learning.py --cases check-colocated --seeds 0 1 2   # the CI check's workload over seeds

Cases (each seed sets ``warm_start.seed``, ``trainer.model.seed`` and ``rollout.seed``):

- ``ppo``: decoupled PPO, ``configs/smoke.toml``, 30 steps, colocated. Gain = the sampled held-out
  reward (``eval/sampled_reward``: the policy's expected reward, the same random numbers at every
  evaluation) after the last step minus before the first; the training reward on string reversal,
  last 10 steps minus first 5. Verdict: no seed below -0.05, mean held-out gain above +0.005, mean
  training gain above 0 (seeds 0-4 measured: +0.101, -0.022, +0.207, +0.054, -0.004; docs/RESULTS.md);
- ``mopd``: MOPD alone (``rl_coef 0``, ``distill_coef 1``, lr 1e-4) from a 60-step student toward a
  400-step teacher. Gain = the teacher gap's shrink (``log pi_teacher - log pi_student`` on the
  student's tokens, mean of the last 10 steps over the first 5). Verdict: every seed's gap ends below
  0.95 of its start (measured 0.79-0.89);
- ``online``: online mode (``configs/online.toml``, the example agent through ``rollbook proxy``),
  string reversal, one try, from a student warm-started to greedy training accuracy 0.3, 60 steps,
  200 held-out problems. Verdict: no seed below -0.02, mean gain above +0.05 (measured +0.147,
  +0.113, +0.294);
- ``calculator``: online mode with the tool-using agent (``configs/calculator.toml``,
  examples/calculator_agent.py: a ``mul`` tool call, then the answer), 60 steps, 100 held-out
  problems, from a model examples/make_calculator_model.py built once into the work dir (taught the
  tool format to a greedy accuracy of 0.8; the seeds vary the run: problems, sampling, the agent's
  order). Verdict: no seed below -0.02, mean gain above +0.03;
- ``ray``: ``--placement ray`` on a local Ray instance, two rollout actors and two trainer ranks,
  30 steps. Verdict: mean held-out and training gains above 0, no seed below -0.1;
- ``shard``: the ``ray`` workload with the two trainer ranks sharding the model (FSDP2,
  ``--trainer.data_parallel shard``); the same verdict as ``ray``;
- ``check-colocated``, ``check-separated``, ``check-online``, ``check-ray``, ``check-bf16`` (the
  smoke workload in bfloat16, 20 steps): the workloads of the
  single-seed learning checks in the test suite (tests/integration/test_learning.py), run over
  seeds to choose the checks' seed and margin. Verdict: every seed's held-out gain above the check's
  margin.

Every run writes under ``--work-dir`` (default runs/bench-learning; a run directory left from an
earlier invocation is removed first). Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

ROOT = pathlib.Path(__file__).resolve().parents[1]

# the online workload whose held-out reward RL raises (docs/RESULTS.md "Online", the reversal table):
# held-out reversals share the procedure with the training ones, held-out one-digit sums do not
ONLINE_REVERSAL = (
    *("--rollout.domains", '["reverse"]', "--rollout.reverse_max_len", "4", "--online.num_problems", "256"),
    *("--online.max_tokens", "6", "--online.turns", "1"),
    *("--warm_start.student_steps", "400", "--warm_start.student_target", "0.3", "--warm_start.student_check_every", "10"),
)
RAY_TWO_RANKS = (
    *("--placement", "ray", "--trainer.num_ranks", "2", "--ray.num_workers", "2", "--ray.num_cpus", "4"),
    *("--ray.worker_cpus", "0.5", "--ray.trainer_cpus", "0.5"),
)
# the Ray check's: one rollout actor and one trainer rank (two of each, and their kills, are
# tests/integration/test_ray_placement.py's; two ranks learning over seeds is the ``ray`` case's claim)
RAY_ONE_EACH = (
    *("--placement", "ray", "--trainer.num_ranks", "1", "--ray.num_workers", "1", "--ray.num_cpus", "2"),
    *("--ray.worker_cpus", "0.5", "--ray.trainer_cpus", "0.5"),
)
MOPD_ONLY = (
    *("--trainer.loss.rl_coef", "0", "--trainer.loss.distill_coef", "1", "--trainer.lr", "1e-4"),
    *("--warm_start.teacher_steps", "400", "--warm_start.student_steps", "60"),
)
# The single-seed checks' workload: configs/smoke.toml, evaluated before the first step and after the
# last only. CHECK_MARGIN is the gain every seed measured cleared (docs in bench/README.md).
CHECK_STEPS = 20
CHECK = ("--num_steps", str(CHECK_STEPS), "--eval_every", str(CHECK_STEPS))
# Online: fewer steps (each is 64 agent sessions through the proxy, the suite's costliest) on a finer
# evaluation (every held-out reversal, 16 samples each: in-process, seconds), which the gain needs:
# on 40 problems x 8 samples the noise was as large as a 20-step gain, one seed's measured gain
# moving from +0.038 to -0.006 between two runs; at 12 steps one run of seed 0 in four gained +0.0007
CHECK_ONLINE_STEPS = 16
CHECK_ONLINE = (
    *("--online.agent", "examples/arithmetic_agent.py"),
    *ONLINE_REVERSAL,
    *("--num_steps", str(CHECK_ONLINE_STEPS), "--eval_every", str(CHECK_ONLINE_STEPS), "--online.num_eval_problems", "200"),
    *("--online.eval_samples", "16"),
)
# bfloat16: the smoke workload in bfloat16, 20 steps (seeds 0-2 gained +0.044 to +0.156:
# bench/README.md); the quick start in bfloat16 is measured in docs/RESULTS.md
CHECK_BF16_STEPS = 20
CHECK_BF16 = ("--dtype", "bfloat16", "--num_steps", str(CHECK_BF16_STEPS), "--eval_every", str(CHECK_BF16_STEPS))
CHECK_MARGIN = 0.005
CHECK_SEED = 0


@dataclass
class Case:
    config: str
    overrides: tuple[str, ...]
    metric: str  # "heldout": sampled held-out gain; "teacher_gap": the gap's shrink
    thresholds: dict[str, float] = field(default_factory=dict)
    built_model: bool = False  # trains examples/make_calculator_model.py's model, built once into the work dir


CALCULATOR_MODEL = pathlib.Path("models") / "calculator-llm"


def build_calculator_model(work_dir: pathlib.Path) -> pathlib.Path:
    """examples/make_calculator_model.py's model under ``work_dir`` (built when missing, seed 0)."""
    path = work_dir / CALCULATOR_MODEL
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        print(f"building {path} (examples/make_calculator_model.py)", file=sys.stderr, flush=True)
        build = [sys.executable, "examples/make_calculator_model.py", "--out", str(work_dir)]
        subprocess.run(build, cwd=ROOT, check=True, stdout=sys.stderr)  # stdout holds only the JSON lines
    return path


CASES: dict[str, Case] = {
    "ppo": Case(
        "configs/smoke.toml",
        ("--num_steps", "30", "--eval_every", "30"),
        "heldout",
        {"min_gain": -0.05, "mean_gain": 0.005, "mean_train_gain": 0.0},
    ),
    "mopd": Case(
        "configs/smoke.toml", ("--num_steps", "30", "--eval_every", "30", *MOPD_ONLY), "teacher_gap", {"max_gap_ratio": 0.95}
    ),
    "online": Case(
        "configs/online.toml",
        (*ONLINE_REVERSAL, "--num_steps", "60", "--eval_every", "20", "--online.num_eval_problems", "200"),
        "heldout",
        {"min_gain": -0.02, "mean_gain": 0.05},
    ),
    "calculator": Case(
        "configs/calculator.toml",
        ("--num_steps", "60", "--eval_every", "20"),
        "heldout",
        {"min_gain": -0.02, "mean_gain": 0.03},
        built_model=True,
    ),
    "ray": Case(
        "configs/smoke.toml",
        ("--num_steps", "30", "--eval_every", "30", *RAY_TWO_RANKS),
        "heldout",
        {"min_gain": -0.1, "mean_gain": 0.0, "mean_train_gain": 0.0},
    ),
    "shard": Case(
        "configs/smoke.toml",
        ("--num_steps", "30", "--eval_every", "30", *RAY_TWO_RANKS, "--trainer.data_parallel", "shard"),
        "heldout",
        {"min_gain": -0.1, "mean_gain": 0.0, "mean_train_gain": 0.0},
    ),
    "check-colocated": Case("configs/smoke.toml", CHECK, "heldout", {"min_gain": CHECK_MARGIN}),
    "check-separated": Case("configs/smoke.toml", (*CHECK, "--placement", "separated"), "heldout", {"min_gain": CHECK_MARGIN}),
    "check-online": Case("configs/smoke.toml", CHECK_ONLINE, "heldout", {"min_gain": CHECK_MARGIN}),
    "check-ray": Case("configs/smoke.toml", (*CHECK, *RAY_ONE_EACH), "heldout", {"min_gain": CHECK_MARGIN}),
    "check-bf16": Case("configs/smoke.toml", CHECK_BF16, "heldout", {"min_gain": CHECK_MARGIN}),
}
DEFAULT_CASES = ("ppo", "mopd", "online", "ray")


def seed_args(seed: int) -> list[str]:
    return ["--warm_start.seed", str(seed), "--trainer.model.seed", str(seed), "--rollout.seed", str(seed)]


def run_command(case: Case, run_dir: pathlib.Path, seed: int, *extra: str) -> list[str]:
    """The ``rollbook run`` command line of one seed of ``case`` (run from the repository root)."""
    return [
        sys.executable,
        *("-m", "rollbook.cli", "run", "--config", case.config, "--run_dir", str(run_dir)),
        *seed_args(seed),
        *case.overrides,
        *extra,
    ]


def read_metrics(run_dir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def evals(metrics: list[dict], key: str) -> list[float]:
    return [m[key] for m in metrics if key in m]


def outcome(case: Case, metrics: list[dict]) -> dict:
    """What one run shows: start and end of the held-out reward (or the teacher gap) and its gain."""
    sampled = evals(metrics, "eval/sampled_reward")
    greedy = evals(metrics, "eval/reward")
    row: dict = {"sampled": [round(s, 4) for s in sampled], "greedy": [round(g, 4) for g in greedy]}
    if sampled:
        row["heldout_gain"] = round(sampled[-1] - sampled[0], 4)
    reverse = evals(metrics, "reward/reverse")
    if len(reverse) >= 10:
        row["train_gain"] = round(statistics.fmean(reverse[-10:]) - statistics.fmean(reverse[:5]), 4)
    if case.metric == "teacher_gap":
        gaps = [
            statistics.fmean(v for k, v in m.items() if k.startswith("teacher_gap/"))
            for m in metrics
            if any(k.startswith("teacher_gap/") for k in m)
        ]
        early, late = statistics.fmean(gaps[:5]), statistics.fmean(gaps[-10:])
        row.update(gap_early=round(early, 4), gap_late=round(late, 4), gap_ratio=round(abs(late) / abs(early), 4))
    return row


def verdict(case: Case, rows: list[dict]) -> dict:
    """The summary of one case over its seeds and whether it meets the case's thresholds."""
    out: dict = {}
    checks: list[bool] = []
    if case.metric == "teacher_gap":
        ratios = [r["gap_ratio"] for r in rows]
        out["max_gap_ratio"] = max(ratios)
        checks.append(max(ratios) < case.thresholds["max_gap_ratio"])
    else:
        gains = [r["heldout_gain"] for r in rows]
        out.update(min_gain=min(gains), mean_gain=round(statistics.fmean(gains), 4))
        if "min_gain" in case.thresholds:
            checks.append(min(gains) > case.thresholds["min_gain"])
        if "mean_gain" in case.thresholds:
            checks.append(statistics.fmean(gains) > case.thresholds["mean_gain"])
        if "mean_train_gain" in case.thresholds:
            train = [r.get("train_gain", float("nan")) for r in rows]
            out["mean_train_gain"] = round(statistics.fmean(train), 4)
            checks.append(statistics.fmean(train) > case.thresholds["mean_train_gain"])
    out["verdict"] = "meets thresholds" if all(checks) else "below thresholds"
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(DEFAULT_CASES))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--work-dir", type=pathlib.Path, default=ROOT / "runs" / "bench-learning")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds one run may take")
    parser.add_argument("extra", nargs="*", help="after --: more `rollbook run` overrides for every run")
    args = parser.parse_args()
    failed = False
    for name in args.cases:
        case, rows = CASES[name], []
        for seed in args.seeds:
            run_dir = args.work_dir / f"{name}-s{seed}"
            shutil.rmtree(run_dir, ignore_errors=True)
            model = ("--trainer.model.path", str(build_calculator_model(args.work_dir))) if case.built_model else ()
            cmd = run_command(case, run_dir, seed, *model, *args.extra)
            print(f"{name} seed {seed}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
            start = time.monotonic()
            done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
            row: dict = {"case": name, "seed": seed, "wall_s": round(time.monotonic() - start, 1)}
            if done.returncode != 0:
                failed = True
                row["error"] = done.stderr[-2000:]
            else:
                row.update(outcome(case, read_metrics(run_dir)))
                rows.append(row)
            print(json.dumps(row), flush=True)
        if rows:
            summary = {"case": name, "summary": True, "seeds": [r["seed"] for r in rows], "thresholds": case.thresholds}
            print(json.dumps({**summary, **verdict(case, rows)}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
