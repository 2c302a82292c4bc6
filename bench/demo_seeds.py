"""The MOPD demo's comparisons (docs/RESULTS.md, "The MOPD demo"), one JSON line per run
and a summary line per variant: held-out reward per domain at the start and the end, from each run's
summary.json (``rollbook report``).

    python bench/demo_seeds.py --json                           # MOPD + RL against RL alone, seeds 0-2
    python bench/demo_seeds.py --json --variants mopd_rl,rl,mopd --seeds 0 1 2 --num_steps 60
    python bench/demo_seeds.py --json --staleness 0 2 4         # the staleness table (separated placement),
                                                                # decoupled objective against standard PPO

Each seed sets ``warm_start.seed``, ``trainer.model.seed`` and ``rollout.seed``. Runs of one seed
start from the same warm-started student and share the specialist teachers: the first run of a seed
trains them in its run directory and they are kept in ``OUT/models-sSEED``; every later run of that
seed, in this invocation or a later one with the same ``--out`` (the staleness table after the
comparison), copies them in (``cached_warm_start`` loads a cached model).
Every run is ``rollbook run --config configs/demo.toml`` plus overrides, in ``--out`` (default
runs/demo-seeds); ``rollbook report --out OUT/compare`` draws them on one plot at the end.
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

ROOT = pathlib.Path(__file__).resolve().parents[1]

VARIANTS = {
    "mopd_rl": [],
    "rl": ["--trainer.loss.distill_coef", "0"],
    "mopd": ["--trainer.loss.rl_coef", "0"],
    "mopd_rl_full": ["--trainer.loss.distill_estimator", "full"],  # the whole-vocabulary reverse KL
}


def run_one(out: pathlib.Path, name: str, seed: int, overrides: list[str], args) -> dict:
    run_dir = out / name
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    models = out / f"models-s{seed}"  # the seed's student and teachers, made by its first run (any invocation)
    for cached in sorted(models.iterdir()) if models.is_dir() else []:
        shutil.copytree(cached, run_dir / cached.name)
    cmd = [
        sys.executable,
        "-m",
        "rollbook.cli",
        "run",
        "--config",
        args.config,
        "--run_dir",
        str(run_dir),
        *(["--num_steps", str(args.num_steps)] if args.num_steps is not None else []),
        *(["--eval_every", str(args.eval_every)] if args.eval_every is not None else []),
        "--warm_start.seed",
        str(seed),
        "--trainer.model.seed",
        str(seed),
        "--rollout.seed",
        str(seed),
        *overrides,
    ]
    started = time.time()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
    for made in run_dir.iterdir():
        if (
            made.is_dir()
            and (made.name == "base-student" or made.name.startswith("teacher-"))
            and not (models / made.name).exists()
        ):
            shutil.copytree(made, models / made.name)
    summary = json.loads((run_dir / "summary.json").read_text())
    row = {"run": name, "seed": seed, "overrides": overrides, "seconds": round(time.time() - started, 1)}
    for kind in ("sampled", "greedy"):
        for domain, v in summary["heldout"].get(kind, {}).items():
            row[f"{kind}/{domain}"] = [round(v["start"], 3), round(v["end"], 3)]
    return row


def aggregate(rows: list[dict], label: str) -> dict:
    out: dict = {"variant": label, "seeds": [r["seed"] for r in rows]}
    for key in sorted({k for r in rows for k in r if "/" in k}):
        ends = [r[key][1] for r in rows]
        gains = [r[key][1] - r[key][0] for r in rows]
        out[key] = {
            "end_mean": round(statistics.mean(ends), 3),
            "end_min": min(ends),
            "end_max": max(ends),
            "gain_mean": round(statistics.mean(gains), 3),
            "gain_min": round(min(gains), 3),
        }
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/demo.toml")
    p.add_argument("--out", default="runs/demo-seeds")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--variants", default="mopd_rl,rl", help=f"comma-separated, of {sorted(VARIANTS)}")
    p.add_argument("--num_steps", type=int, default=None, help="default: the config's")
    p.add_argument("--eval_every", type=int, default=None, help="default: the config's")
    p.add_argument(
        "--staleness",
        type=int,
        nargs="*",
        default=None,
        help="run the staleness table instead: separated placement at these eta, MOPD + RL, decoupled "
        "(loss.proximal recompute) and not (loss.proximal behavior)",
    )
    p.add_argument(
        "--set",
        nargs=2,
        action="append",
        default=[],
        metavar=("KEY", "VALUE"),
        help="one more override for every run, e.g. --set trainer.teacher_temperature 0.5 (repeatable)",
    )
    p.add_argument("--tag", default="", help="appended to each run's name: variants of one --out side by side")
    p.add_argument("--json", action="store_true", help="JSON lines only")
    args = p.parse_args()
    extra = [part for key, value in args.set for part in (f"--{key}", value)]
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan: list[tuple[str, str, int, list[str]]] = []
    if args.staleness is not None:
        for eta in args.staleness:
            for objective, proximal in (("decoupled", "recompute"), ("standard", "behavior")):
                for seed in args.seeds:
                    plan.append(
                        (
                            f"eta{eta}-{objective}{args.tag}",
                            f"eta{eta}-{objective}{args.tag}-s{seed}",
                            seed,
                            ["--placement", "separated", "--max_staleness", str(eta), "--trainer.loss.proximal", proximal]
                            + extra,
                        )
                    )
    else:
        for seed in args.seeds:  # seed by seed: a comparison cut short still pairs its variants
            for variant in args.variants.split(","):
                plan.append((f"{variant}{args.tag}", f"{variant}{args.tag}-s{seed}", seed, VARIANTS[variant] + extra))
    results: dict[str, list[dict]] = {}
    for label, name, seed, overrides in plan:
        row = run_one(out, name, seed, overrides, args)
        results.setdefault(label, []).append(row)
        print(json.dumps(row), flush=True)
    for label, rows in results.items():
        print(json.dumps(aggregate(rows, label)), flush=True)
    runs = [str(out / name) for _, name, _, _ in plan]
    subprocess.run(
        [sys.executable, "-m", "rollbook.cli", "report", *runs, "--out", str(out / "compare")],
        cwd=ROOT,
        check=True,
        capture_output=args.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
