"""Placement benchmark: the same model, workload, step count and CPU budget under
``rollbook run --placement colocated | separated | ray``, plus an online scenario.

    python bench/placement.py --json --png docs/placement.png   # one JSON line; the markdown tables on stderr
    python bench/placement.py --steps 20 --placements colocated,ray --ray-workers 2 --ranks 2 --no-recovery
    python bench/placement.py --placements colocated,colocated-offload --no-recovery --no-online   # offload's cost

Every run gets a fresh run directory under ``--work-dir`` holding one warm-started student, made once
by this script and copied in, so every placement starts from the same weights bit for bit. A
placement named with ``-offload`` (``colocated-offload``) is that placement with
``--trainer.offload_optimizer true``. Per placement:

- ``trained_tok_s``: output tokens of acked leases over the span of the train steps (first
  ``started_at`` to last ``finished_at`` in the ledger). The asynchronous placements generate up to
  ``max_staleness + 1`` batches before the first step starts, outside that span, so
  ``trained_tok_s_from_first_rollout`` divides by the time from the first trajectory's
  ``created_at`` instead; ``wall_s``: the whole command, start-up, evaluations and report included;
- memory (bench/proc_memory.py, every 0.5 s over the run's process tree): the peak resident set of
  the largest process of each role (``store``: ``rollbook serve`` and its SQL sandbox; ``trainer``:
  the ``rollbook run`` process itself for colocated, which also holds the rollout engine, and for
  separated, or the ``TrainerRank`` actors; ``rollout``: the ``rollbook rollout`` process or the
  ``RolloutActor`` actors; ``ray``: Ray's own processes; ``driver``: the ``rollbook run`` process of
  the ray placement), the largest process, and the peak of the tree's summed PSS;
- per step, the means over the ledger's ``train_steps.stats`` (trainer/loop.py): ``weight_sync_s_per_step``
  (``perf/weight_sync_s``, the trainer's weight publishers: colocated, the copy into the engine that
  samples, on the device; separated, the checksummed shared-memory write and the held-out engine's
  load; ray, putting the version in Ray's object store, or packing and diffing it for the network
  channel, and the held-out engine's load), ``offload_s_per_step`` and ``onload_s_per_step``
  (``perf/offload_s``, ``perf/onload_s``: the AdamW state to host memory and back, with
  ``trainer.offload_optimizer``; null without it) and ``kv_released_mib_per_step`` (the colocated
  engine's KV cache freed for the training phase, with offload); ``peak_device_mib``, the largest
  ``perf/peak_device_mib`` of a step (on CUDA: the trainer process's peak allocated device memory
  during the step, a colocated engine's resident weights and KV cache included; null on the CPU); and
  ``publish_s_per_step``, the mean of ``perf/publish_s`` in metrics.jsonl (the publishers plus the
  checksum and ``PublishVersion``).
  What the rollout side spends fetching and loading runs beside training and is not in them;
- ``stale``, ``rejected``: rejections in the ledger; ``heldout_first`` / ``heldout_final``: greedy
  held-out reward before the first step and after the last;
- ``--recovery`` (on with ``--json``; ``--recovery-placements`` names a subset): a second run of
  ``--kill-after`` + ``--steps-after-kill`` steps, checkpointing every step. ``--kill-delay`` seconds
  after ``--kill-after`` steps are checkpointed (so usually mid-step, a batch leased and not
  checkpointed) the trainer is SIGKILLed:
  colocated and separated, where the trainer is the ``rollbook run`` process, the whole run (its
  process group: store and rollout worker too), and the same command is started again on the same
  run directory; ray, the ``TrainerRank`` actor processes, and the driver starts the group again
  itself. ``restart_recovery_s``: from that restart (the command's start, or the kill for ray) to the
  first train step that finishes after it. Then one SQL query over the ledger checks that no batch
  was lost or repeated (``audit``, ``exactly_once``);
- ``--online`` (on with ``--json``, bench/online_retries.py): agents whose client times out and
  retries while the proxy's admission is held, rewards sent after each session ended; counts of
  completions received, attempts, accepted and served rows, ``RETRY_ORPHAN`` rejections, and
  whether the rows PullBatch serves are exactly the completions received (computed, not asserted).

Not measured: the rollout side's fetch-and-load time per version (bench/weights.py --ray measures
the channels into a Ray actor; the ray placement publishes through Ray's object store).
A loaded machine moves every timing; compare placements within one run, and read ``load_avg``.
A local Ray instance that timed out starting is started again by the launcher itself (up to three
starts; ``ray_start_failures`` counts them from the run's log). A run that fails is reported with its ``error`` in the JSON and the
table, the others are still measured, and the script exits non-zero. SIGTERM (a time limit around
the script) kills the run under way and reports what was measured before it (``terminated``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import duckdb

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "smoke.toml"

# one row over the ledger of a finished run: rows stored twice, rows acked in two leases, rows marked
# trained without an acked lease, steps with more or less than one acked lease, reported steps whose
# lease was never acked, the reported steps, and leases never acked (the killed step's) with how many
# of their rows trained later under another lease
AUDIT = """
SELECT (SELECT count(*) - count(DISTINCT trajectory_id) FROM trajectories) AS stored_twice,
       (SELECT count(*) FROM (SELECT trajectory_id FROM leases WHERE acked_at IS NOT NULL
                              GROUP BY trajectory_id HAVING count(*) > 1)) AS acked_twice,
       (SELECT count(*) FROM trajectories WHERE status = 'trained' AND trajectory_id NOT IN
            (SELECT trajectory_id FROM leases WHERE acked_at IS NOT NULL)) AS trained_unacked,
       (SELECT count(*) FROM (SELECT step FROM leases WHERE acked_at IS NOT NULL GROUP BY step
                              HAVING count(DISTINCT lease_id) <> 1)) AS steps_not_one_lease,
       (SELECT count(*) FROM train_steps s WHERE NOT EXISTS (SELECT 1 FROM leases l
            WHERE l.lease_id = s.lease_id AND l.acked_at IS NOT NULL)) AS steps_without_acked_lease,
       (SELECT list(step ORDER BY step) FROM train_steps) AS steps,
       (SELECT count(DISTINCT lease_id) FROM leases WHERE lease_id NOT IN
            (SELECT lease_id FROM leases WHERE acked_at IS NOT NULL)) AS unacked_leases,
       (SELECT count(DISTINCT d.trajectory_id) FROM leases d JOIN leases a ON a.trajectory_id = d.trajectory_id
            AND a.acked_at IS NOT NULL WHERE d.lease_id NOT IN
            (SELECT lease_id FROM leases WHERE acked_at IS NOT NULL)) AS unacked_rows_trained_later
"""


OFFLOAD = "-offload"  # a placement name ending in it: that placement with trainer.offload_optimizer on

# the per-step figures of train_steps.stats, averaged over the run's steps (the peak: the largest), NULL
# when no step has one
PER_STEP_SQL = """
SELECT avg((stats->>'$."perf/weight_sync_s"')::DOUBLE), avg((stats->>'$."perf/offload_s"')::DOUBLE),
       avg((stats->>'$."perf/onload_s"')::DOUBLE), avg((stats->>'$."rollout/kv_released_bytes"')::DOUBLE),
       max((stats->>'$."perf/peak_device_mib"')::DOUBLE)
FROM train_steps
"""


def base_placement(name: str) -> str:
    """The ``--placement`` a bench placement name runs (``colocated-offload``: colocated)."""
    return name.removesuffix(OFFLOAD)


def run_command(placement: str, run_dir: pathlib.Path, args: argparse.Namespace, num_steps: int) -> list[str]:
    offload = placement.endswith(OFFLOAD)
    placement = base_placement(placement)
    cmd = [
        sys.executable,
        "-m",
        "rollbook.cli",
        "run",
        "--config",
        str(CONFIG),
        "--run_dir",
        str(run_dir),
        "--placement",
        placement,
        "--num_steps",
        str(num_steps),
        "--eval_every",
        str(num_steps),
        *common_overrides(args),
    ]
    if offload:
        cmd += ["--trainer.offload_optimizer", "true"]
    if placement != "colocated":
        cmd += ["--max_staleness", str(args.max_staleness)]
    if placement == "ray":
        cmd += ["--ray.num_workers", str(args.ray_workers), "--trainer.num_ranks", str(args.ranks)]
        cmd += ["--ray.num_cpus", str(args.cpus), "--ray.worker_cpus", "0.5", "--ray.trainer_cpus", "0.5"]
    return cmd


def common_overrides(args: argparse.Namespace) -> list[str]:
    return ["--trainer.num_samples", str(args.samples), "--warm_start.student_steps", str(args.warm_steps), *args.extra]


def warm_start(work: pathlib.Path, args: argparse.Namespace) -> pathlib.Path:
    """The student every run starts from, warm-started once as ``rollbook run`` would (its cache)."""
    from rollbook.config import RunConfig, load_config
    from rollbook.trainer.model_builders import build_models

    config = load_config(RunConfig, str(CONFIG), [*common_overrides(args), "--run_dir", str(work / "warm")])
    with contextlib.redirect_stdout(sys.stderr):  # its progress lines; stdout holds only the JSON
        build_models(config)
    return work / "warm" / "base-student"


def ray_start_failures(log: pathlib.Path) -> int:
    """Starts of the local Ray instance that timed out and were made again by the launcher
    (rollbook/run/ray_cluster.py ``ray_session``, which logs each one)."""
    return log.read_text(errors="replace").count("Ray did not start (")


def fresh_run_dir(work: pathlib.Path, name: str, student: pathlib.Path) -> pathlib.Path:
    run_dir = work / name
    run_dir.mkdir(parents=True)
    shutil.copytree(student, run_dir / "base-student")
    return run_dir


_STARTED: list[subprocess.Popen] = []  # every run this process started, for _on_terminate
_TERMINATED: list[int] = []  # the signal that asked this process to end, once it came


def start(cmd: list[str], log: pathlib.Path) -> subprocess.Popen:
    """In a process group of its own, so the whole run can be killed at once."""
    if _TERMINATED:
        raise SystemExit(f"terminated (signal {_TERMINATED[0]}) before starting; log {log}")
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    _STARTED.append(proc)
    return proc


def _on_terminate(signum: int, frame) -> None:
    """SIGTERM (a time limit, such as scripts/gpu_check.sh's ``timeout``): kill the run under way, so its
    measurement fails at once, and let ``main`` report the placements measured before it."""
    _TERMINATED.append(signum)
    for proc in _STARTED:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)


def finish(proc: subprocess.Popen, log: pathlib.Path, what: str, timeout: float) -> None:
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        raise SystemExit(f"{what}: no end within {timeout:g} s; log {log}") from None
    if code != 0:
        text = log.read_text(errors="replace")
        raise SystemExit(f"{what} failed ({code}):\n{text[-3000:]}")


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group ``proc`` leads, and wait until none of it is left."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    deadline = time.monotonic() + 60
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def _group_alive(pgid: int) -> bool:
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def measure(placement: str, work: pathlib.Path, student: pathlib.Path, args: argparse.Namespace) -> dict:
    from bench.proc_memory import TreeMemory

    run_dir = fresh_run_dir(work, placement, student)
    log = work / f"{placement}.log"
    started = time.monotonic()
    proc = start(run_command(placement, run_dir, args, args.steps), log)
    with TreeMemory(proc.pid, root_role="driver" if base_placement(placement) == "ray" else "trainer") as memory:
        finish(proc, log, placement, args.timeout)
    wall = time.monotonic() - started
    con = duckdb.connect(str(run_dir / "rollbook.duckdb"), read_only=True)
    (tokens,) = con.execute(
        "SELECT coalesce(sum(t.num_output_tokens), 0) FROM leases l JOIN trajectories t "
        "USING (trajectory_id) WHERE l.acked_at IS NOT NULL"
    ).fetchone()
    (span,) = con.execute("SELECT max(finished_at) - min(started_at) FROM train_steps").fetchone()
    (since_first,) = con.execute(
        "SELECT (SELECT max(finished_at) FROM train_steps) - (SELECT min(created_at) FROM trajectories)"
    ).fetchone()
    rejected = dict(con.execute("SELECT reason, count(*) FROM rejections GROUP BY reason").fetchall())
    workers = dict(con.execute("SELECT worker_id, count(*) FROM trajectories GROUP BY worker_id").fetchall())
    weight_sync, offload, onload, kv_released, peak_device = con.execute(PER_STEP_SQL).fetchone()
    con.close()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [m for m in metrics if "eval/reward" in m]
    publish = [m["perf/publish_s"] for m in metrics if "perf/publish_s" in m]
    return {
        "placement": placement,
        "steps": args.steps,
        "wall_s": round(wall, 1),
        "trained_tokens": int(tokens),
        "trained_tok_s": round(tokens / span, 1) if span else None,
        "trained_tok_s_from_first_rollout": round(tokens / since_first, 1) if since_first else None,
        **memory.report(),
        "weight_sync_s_per_step": _round(weight_sync, 6),
        "offload_s_per_step": _round(offload, 6),
        "onload_s_per_step": _round(onload, 6),
        "kv_released_mib_per_step": _round(kv_released, 2, 1 / 2**20),
        "peak_device_mib": _round(peak_device, 1),
        "publish_s_per_step": round(sum(publish) / len(publish), 4) if publish else None,
        "stale": rejected.get("STALE", 0),
        "rejected": sum(rejected.values()),
        "rejected_by_reason": rejected,
        "workers": len(workers),
        "heldout_first": evals[0]["eval/reward"] if evals else None,
        "heldout_final": evals[-1]["eval/reward"] if evals else None,
        "heldout_sampled_final": evals[-1].get("eval/sampled_reward") if evals else None,
        "ray_start_failures": ray_start_failures(log),
    }


def recover(placement: str, work: pathlib.Path, student: pathlib.Path, args: argparse.Namespace) -> dict:
    """Kill the trainer once ``--kill-after`` steps are checkpointed, let the run resume, time it."""
    from bench.proc_memory import TreeMemory
    from rollbook.run.driving import steps_done

    run_dir = fresh_run_dir(work, f"{placement}-recovery", student)
    num_steps = args.kill_after + args.steps_after_kill
    cmd = run_command(placement, run_dir, args, num_steps)
    log = work / f"{placement}-recovery.log"
    first = start(cmd, log)
    deadline = time.monotonic() + args.timeout
    while steps_done(run_dir) < args.kill_after:
        if first.poll() is not None:
            finish(first, log, f"{placement} recovery", 0)
        if first.poll() is not None or time.monotonic() > deadline:
            kill_group(first)
            raise SystemExit(f"{placement} recovery: {args.kill_after} steps never checkpointed; log {log}")
        time.sleep(0.05)
    time.sleep(args.kill_delay)  # into the next step, so the kill usually finds a batch leased and not checkpointed
    if base_placement(placement) == "ray":
        victims = TreeMemory(first.pid, root_role="driver").pids("trainer")
        if not victims:
            kill_group(first)
            raise SystemExit(f"{placement} recovery: no TrainerRank process under the driver; log {log}")
        done, killed_at = steps_done(run_dir), time.time()
        restarted_at = killed_at
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        finish(first, log, f"{placement} recovery", args.timeout)
        killed = f"the trainer actor processes ({len(victims)}); the driver restarts the group"
    else:
        done, killed_at = steps_done(run_dir), time.time()
        kill_group(first)
        _remove_shm(run_dir)
        restarted_at = time.time()
        finish(start(cmd, log), log, f"{placement} recovery (restarted)", args.timeout)
        killed = "the whole run (its process group); the same command started again"
    con = duckdb.connect(str(run_dir / "rollbook.duckdb"), read_only=True)
    (first_after,) = con.execute("SELECT min(finished_at) FROM train_steps WHERE finished_at > ?", [restarted_at]).fetchone()
    cursor = con.execute(AUDIT)
    audit = dict(zip([c[0] for c in cursor.description], cursor.fetchone(), strict=True))
    con.close()
    faults = ("stored_twice", "acked_twice", "trained_unacked", "steps_not_one_lease", "steps_without_acked_lease")
    return {
        "killed": killed,
        "checkpointed_steps_at_kill": done,
        "kill_delay_s": args.kill_delay,
        "steps": num_steps,
        "kill_to_restart_s": round(restarted_at - killed_at, 2),
        "restart_recovery_s": round(first_after - restarted_at, 2) if first_after is not None else None,
        "audit": audit,
        "exactly_once": all(audit[k] == 0 for k in faults) and audit["steps"] == list(range(num_steps)),
        "ray_start_failures": ray_start_failures(log),
        **({} if first_after else {"note": "no step finished after the restart: the kill came after the last one"}),
    }


def _remove_shm(run_dir: pathlib.Path) -> None:
    """The shared-memory weight file a killed separated run leaves in /dev/shm (its name in worker.json)."""
    path = run_dir / "worker.json"
    if path.exists():
        kind, _, name = json.loads(path.read_text())["weights"].partition(":")
        if kind == "shm":
            pathlib.Path("/dev/shm", name).unlink(missing_ok=True)


COLUMNS = [  # (header, how to read it from a row)
    ("placement", lambda r: r["placement"]),
    ("steps", lambda r: r["steps"]),
    ("wall s", lambda r: r["wall_s"]),
    ("trained tok/s", lambda r: r["trained_tok_s"]),
    ("from first rollout", lambda r: r["trained_tok_s_from_first_rollout"]),
    ("RSS MiB trainer", lambda r: r["peak_rss_mib_by_role"].get("trainer")),
    ("rollout", lambda r: r["peak_rss_mib_by_role"].get("rollout", "(in trainer)")),
    ("store", lambda r: r["peak_rss_mib_by_role"].get("store")),
    ("ray + driver", lambda r: _ray_and_driver(r)),
    ("largest", lambda r: r["largest_process_mib"]),
    ("PSS MiB total", lambda r: r["peak_pss_mib_total"]),
    ("weight sync ms/step", lambda r: _round(r["weight_sync_s_per_step"], 2, 1000)),
    ("offload ms/step", lambda r: _round(r["offload_s_per_step"], 2, 1000)),
    ("onload ms/step", lambda r: _round(r["onload_s_per_step"], 2, 1000)),
    ("KV freed MiB/step", lambda r: r["kv_released_mib_per_step"]),
    ("peak device MiB", lambda r: r["peak_device_mib"]),
    ("publish ms/step", lambda r: _round(r["publish_s_per_step"], 1, 1000)),
    ("stale", lambda r: r["stale"]),
    ("rejected", lambda r: r["rejected"]),
    ("held-out first", lambda r: _round(r["heldout_first"], 3)),
    ("held-out final", lambda r: _round(r["heldout_final"], 3)),
    ("restart recovery s", lambda r: (r["recovery"] or {}).get("restart_recovery_s")),
    ("exactly once", lambda r: (r["recovery"] or {}).get("exactly_once")),
]


def _round(value: float | None, digits: int, scale: float = 1) -> float | None:
    return None if value is None else round(value * scale, digits)


def _ray_and_driver(row: dict) -> str:
    roles = row["peak_rss_mib_by_role"]
    return " / ".join(str(roles[k]) for k in ("ray", "driver") if k in roles) or "-"


def markdown(rows: list[dict], online: dict | None) -> str:
    lines = ["| " + " | ".join(h for h, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['placement']} | failed: {_last_line(r['error'])} |")
        else:
            lines.append("| " + " | ".join(str(get(r)) for _, get in COLUMNS) + " |")
    if online:
        keys = ["completions_received", "attempts", "accepted_rows", "served_rows", "retry_orphans", "served_equals_experienced"]
        lines += ["", "| online: " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        lines += ["| " + " | ".join(str(online[k]) for k in keys) + " |"]
    return "\n".join(lines)


def write_png(rows: list[dict], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["placement"] for r in rows]
    panels = [
        ("trained tokens/s", [[r["trained_tok_s"] or 0 for r in rows]], [None]),
        (
            "peak memory (MiB)",
            [[r["largest_process_mib"] for r in rows], [r["peak_pss_mib_total"] for r in rows]],
            ["largest process RSS", "all processes, PSS"],
        ),
        ("greedy held-out reward", [[r["heldout_first"] for r in rows], [r["heldout_final"] for r in rows]], ["before", "final"]),
    ]
    if any(r.get("peak_device_mib") for r in rows):
        panels.append(("peak device memory in a train step (MiB)", [[r.get("peak_device_mib") or 0 for r in rows]], [None]))
    if any(r.get("restart_recovery_s") for r in rows):
        panels.append(("restart recovery (s)", [[r.get("restart_recovery_s") or 0 for r in rows]], [None]))
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.4))
    for ax, (title, series, labels) in zip(axes, panels):
        width = 0.8 / len(series)
        for i, (values, label) in enumerate(zip(series, labels)):
            ax.bar([x + i * width - 0.4 + width / 2 for x in range(len(names))], values, width, label=label)
        ax.set_xticks(range(len(names)), names)
        ax.set_title(title, fontsize=10)
        if labels[0]:
            ax.legend(fontsize=7)
    fig.suptitle(f"bench/placement.py: {rows[0]['steps']} steps, same model and workload", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


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
    p.add_argument("--recovery", action=argparse.BooleanOptionalAction, default=None, help="default: on with --json")
    p.add_argument(
        "--recovery-placements",
        default=None,
        help="comma-separated: which of --placements get the kill and restart (default: every one)",
    )
    p.add_argument("--kill-after", type=int, default=2, help="checkpointed steps before the trainer is killed")
    p.add_argument("--kill-delay", type=float, default=0.5, help="seconds after that checkpoint before the kill")
    p.add_argument(
        "--steps-after-kill",
        type=int,
        default=6,
        help="steps asked for after --kill-after (a fast placement finishes several within --kill-delay)",
    )
    p.add_argument("--online", action=argparse.BooleanOptionalAction, default=None, help="default: on with --json")
    p.add_argument("--png", default=None, help="write the bar chart here")
    p.add_argument("--timeout", type=float, default=1800, help="seconds for each run")
    p.add_argument("--work-dir", default=None)
    p.add_argument("--json", action="store_true")
    p.add_argument("extra", nargs="*", help="more `rollbook run` overrides for every placement (after --)")
    args = p.parse_args()
    recovery = args.json if args.recovery is None else args.recovery
    placements = args.placements.split(",")
    recovering = set(placements if args.recovery_placements is None else args.recovery_placements.split(","))
    if not recovering <= set(placements):
        p.error(f"--recovery-placements {sorted(recovering - set(placements))} are not among --placements {placements}")
    online = args.json if args.online is None else args.online
    work = pathlib.Path(args.work_dir or tempfile.mkdtemp(prefix="rollbook-placement-"))
    work.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _on_terminate)
    load = [round(os.getloadavg()[0], 2)]
    student = warm_start(work, args)
    rows, failed = [], []
    for name in placements:
        if _TERMINATED:
            break
        print(f"[placement bench] {name}: {args.steps} steps", file=sys.stderr, flush=True)
        row = _or_error(measure, (name, work, student, args), {"placement": name, "steps": args.steps}, failed)
        row["recovery"] = row["restart_recovery_s"] = None
        if recovery and name in recovering and not _TERMINATED:
            print(f"[placement bench] {name}: kill and restart", file=sys.stderr, flush=True)
            row["recovery"] = _or_error(recover, (name, work, student, args), {}, failed)
            row["restart_recovery_s"] = row["recovery"].get("restart_recovery_s")
        rows.append(row)
    report: dict = {"placements": rows}
    if _TERMINATED:
        report["terminated"] = f"signal {_TERMINATED[0]}: placements not listed were not measured"
        failed.append(f"terminated by signal {_TERMINATED[0]}")
    elif online:
        from bench.online_retries import run_scenario

        print("[placement bench] online: retries and late rewards", file=sys.stderr, flush=True)
        report["online"] = run_scenario(work / "online")
    load.append(round(os.getloadavg()[0], 2))
    report["machine"] = {"cpus": os.cpu_count(), "load_avg_1m_start_end": load}
    if args.png and any("error" not in r for r in rows):
        try:
            write_png([r for r in rows if "error" not in r], pathlib.Path(args.png))
        except ImportError as exc:  # matplotlib: not every machine that runs the bench has it
            report["png"] = f"not written: {exc}"
            print(f"[placement bench] no PNG: {exc}", file=sys.stderr, flush=True)
    table = markdown(rows, report.get("online"))
    if args.json:
        print(json.dumps(report))
        print(table, file=sys.stderr)
    else:
        print(table)
    if failed:
        raise SystemExit(f"{len(failed)} run(s) failed (their error is in the JSON): " + "; ".join(failed))


def _last_line(text: str) -> str:
    return [line for line in text.splitlines() if line.strip()][-1].strip()


def _or_error(run, run_args: tuple, partial: dict, failed: list[str]) -> dict:
    """What ``run(*run_args)`` returns, or ``partial`` with the error of a run that failed, so that
    the other placements are still measured and reported; the bench exits non-zero at the end."""
    try:
        return run(*run_args)
    except SystemExit as exc:
        failed.append(f"{str(exc).splitlines()[0]} {_last_line(str(exc))}")
        print(f"[placement bench] {exc}", file=sys.stderr, flush=True)
        return {**partial, "error": str(exc)[-1500:]}


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # bench.* and examples/ (the online agent)
    main()
