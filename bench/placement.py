"""Placement benchmark (issue 15): the same model, workload, step count and CPU budget under
``rollbook run --placement colocated | separated | ray``; per placement: trained tokens per second
(output tokens of acked leases over the span of the train steps), wall time, the largest process's
peak RSS, STALE and other rejected counts, and the final held-out reward.

    python bench/placement.py --json                          # one JSON line, then a markdown table on stderr
    python bench/placement.py --steps 20 --placements colocated,ray --ray-workers 2 --ranks 2

Not measured yet (null in the JSON): weight-sync time per step and restart-recovery time after a
trainer kill; peak RSS is the largest single process of the run (resource.getrusage of the waited
children), not a per-process table. Each placement runs in a fresh run directory under --work-dir.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

import duckdb

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_one(placement: str, work: pathlib.Path, args: argparse.Namespace) -> dict:
    run_dir = work / placement
    cmd = [
        sys.executable,
        "-m",
        "rollbook.cli",
        "run",
        "--config",
        str(ROOT / "configs" / "quickstart.toml"),
        "--run_dir",
        str(run_dir),
        "--placement",
        placement,
        "--num_steps",
        str(args.steps),
        "--eval_every",
        str(args.steps),
        "--trainer.num_samples",
        str(args.samples),
        "--warm_start.student_steps",
        str(args.warm_steps),
        *args.extra,
    ]
    if placement != "colocated":
        cmd += ["--max_staleness", str(args.max_staleness)]
    if placement == "ray":
        cmd += [
            "--ray.num_workers",
            str(args.ray_workers),
            "--trainer.num_ranks",
            str(args.ranks),
            "--ray.num_cpus",
            str(args.cpus),
            "--ray.worker_cpus",
            "0.5",
            "--ray.trainer_cpus",
            "0.5",
        ]
    started = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"{placement} failed ({done.returncode}): {done.stderr[-2000:]}")
    con = duckdb.connect(str(run_dir / "rollbook.duckdb"), read_only=True)
    (tokens,) = con.execute(
        "SELECT coalesce(sum(t.num_output_tokens), 0) FROM leases l JOIN trajectories t "
        "USING (trajectory_id) WHERE l.acked_at IS NOT NULL"
    ).fetchone()
    (span,) = con.execute("SELECT max(finished_at) - min(started_at) FROM train_steps").fetchone()
    rejected = dict(con.execute("SELECT reason, count(*) FROM rejections GROUP BY reason").fetchall())
    workers = dict(con.execute("SELECT worker_id, count(*) FROM trajectories GROUP BY worker_id").fetchall())
    con.close()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [m for m in metrics if "eval/reward" in m]
    return {
        "placement": placement,
        "steps": args.steps,
        "wall_s": round(wall, 1),
        "trained_tokens": int(tokens),
        "trained_tok_s": round(tokens / span, 1) if span else None,
        "peak_rss_mib_largest_process": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1),
        "stale": rejected.get("STALE", 0),
        "rejected": sum(rejected.values()),
        "rejected_by_reason": rejected,
        "workers": len(workers),
        "heldout_first": evals[0]["eval/reward"] if evals else None,
        "heldout_final": evals[-1]["eval/reward"] if evals else None,
        "heldout_sampled_final": evals[-1].get("eval/sampled_reward") if evals else None,
        "weight_sync_s_per_step": None,
        "restart_recovery_s": None,
    }


def markdown(rows: list[dict]) -> str:
    cols = [
        "placement",
        "steps",
        "wall_s",
        "trained_tok_s",
        "peak_rss_mib_largest_process",
        "stale",
        "rejected",
        "workers",
        "heldout_first",
        "heldout_final",
        "heldout_sampled_final",
    ]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--placements", default="colocated,separated,ray")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--warm-steps", type=int, default=100)
    p.add_argument("--max-staleness", type=int, default=2)
    p.add_argument("--ray-workers", type=int, default=2)
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray instance (the CPU budget)")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--work-dir", default=None)
    p.add_argument("--json", action="store_true")
    p.add_argument("extra", nargs="*", help="more `rollbook run` overrides for every placement (after --)")
    args = p.parse_args()
    work = pathlib.Path(args.work_dir or tempfile.mkdtemp(prefix="rollbook-placement-"))
    rows = [run_one(name, work, args) for name in args.placements.split(",")]
    if args.json:
        print(json.dumps({"placements": rows}))
        print(markdown(rows), file=sys.stderr)
    else:
        print(markdown(rows))


if __name__ == "__main__":
    main()
