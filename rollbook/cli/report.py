"""``rollbook report RUN_DIR [RUN_DIR...]``: a finished run as report.md, PNG plots and summary.json.

    rollbook report runs/demo                                  # runs/demo/report.md, *.png, summary.json
    rollbook report runs/mopd runs/rl --out runs/compare       # several runs on one plot each

Sources, both in the run directory: ``metrics.jsonl`` (one line per trainer step; evaluations on the
steps ``eval_every`` picks) for the curves, and the ledger ``rollbook.duckdb`` for what happened to the
evidence (accepted, rejected by reason, trained, staleness). The ledger is read the way ``rollbook
query --db`` reads it: a private copy with the acknowledged log batches DuckDB had not yet folded,
opened read-only; the run's files are never written. Run it on a finished run (the store stopped):
``rollbook run`` calls it itself at the end.

Each RUN_DIR gets its own ``summary.json`` (``summarize``); ``report.md`` and the plots go to ``--out``
(default: the first RUN_DIR). Plots (matplotlib, Agg backend), one line or bar per run:
- ``heldout.png``: held-out reward per domain by step (sampled solid, greedy dotted); with the
  promotion gate (docs/gate.md) a marker per version it decided, at the steps done then and the gate's
  greedy figure for the domain: promoted ▲, refused ✕, rolled back ▼;
- ``train_reward.png``: training reward per domain (that step's batch) by step;
- ``teacher_gap.png``: mean ``log pi_teacher - log pi_student`` per token and domain (MOPD runs);
- ``staleness.png``: trained rows by staleness (trainer version - oldest token version);
- ``rejections.png``: rejected trajectories by reason;
- ``throughput.png``: trainer tokens per second by step.
"""

from __future__ import annotations

import json
import math
import pathlib
import tempfile
from typing import Any

# The ledger's answers summary.json holds; tests/integration/test_report.py asks the same SQL.
SUMMARY_SQL = {
    "accepted": "SELECT count(*) AS n FROM trajectories",
    "rejected_by_reason": "SELECT reason, count(*) AS n FROM rejections GROUP BY reason ORDER BY reason",
    "trained": "SELECT count(DISTINCT trajectory_id) AS n FROM leases WHERE acked_at IS NOT NULL",
    "steps": "SELECT count(DISTINCT step) AS n FROM train_steps",
    "staleness": "SELECT l.trainer_version - t.min_version AS staleness, count(*) AS n "
    "FROM leases l JOIN trajectories t USING (trajectory_id) WHERE l.acked_at IS NOT NULL "
    "GROUP BY staleness ORDER BY staleness",
}

# The promotion gate's verdicts (policy_versions.status, gate; docs/gate.md): in summary.json as "gate"
GATE_SQL = "SELECT version, status, gate FROM policy_versions WHERE status IS NOT NULL ORDER BY version"

PLOTS = ("heldout", "train_reward", "teacher_gap", "staleness", "rejections", "throughput")


def read_metrics(run_dir: pathlib.Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl (is it a rollbook run directory?)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def ledger_answers(db: pathlib.Path) -> dict[str, Any]:
    """``SUMMARY_SQL`` answered on a private, read-only copy of the ledger (``rollbook query --db``'s
    path: the copy includes acknowledged log batches not yet folded into DuckDB, and rows moved into
    the archive are read through the same table names)."""
    from rollbook.cli.query import private_copy
    from rollbook.store.archive import connect_snapshot

    if not db.exists():
        raise FileNotFoundError(f"no ledger {db}")
    with tempfile.TemporaryDirectory(prefix="rollbook-report-") as tmp:
        snapshot = pathlib.Path(tmp) / "snapshot.duckdb"
        private_copy(db, snapshot)
        con = connect_snapshot(snapshot)
        try:
            rows = {name: con.sql(sql).fetchall() for name, sql in SUMMARY_SQL.items()}
            verdicts = gate_verdicts(con)
        finally:
            con.close()
    return {
        "accepted": int(rows["accepted"][0][0]),
        "rejected_by_reason": {str(reason): int(n) for reason, n in rows["rejected_by_reason"]},
        "trained": int(rows["trained"][0][0]),
        "steps": int(rows["steps"][0][0]),
        "staleness": {str(int(s)): int(n) for s, n in rows["staleness"] if s is not None},
        "gate": verdicts,
    }


def gate_verdicts(con) -> list[dict[str, Any]]:
    """Each version the promotion gate decided (``GATE_SQL``): version, status, the steps done when it
    was decided, its greedy held-out reward overall and per domain (None where not measured). A ledger
    made before the gate's columns has none."""
    has_status = con.sql(
        "SELECT count(*) FROM duckdb_columns() WHERE table_name = 'policy_versions' AND column_name = 'status'"
    ).fetchall()[0][0]
    if not has_status:
        return []
    out = []
    for version, status, gate in con.sql(GATE_SQL).fetchall():
        figures = json.loads(gate) if gate else {}
        out.append(
            {
                "version": int(version),
                "status": str(status),
                "step": figures.get("step"),
                "reward": figures.get("reward"),
                "heldout": figures.get("heldout") or {},
            }
        )
    return out


def _evals(metrics: list[dict]) -> list[dict]:
    return [m for m in metrics if "eval/reward" in m]


def _domains(metrics: list[dict], prefix: str) -> list[str]:
    skip = {"reward", "sampled_reward", "errors", "num_ok", "num_error", "mean", "normalized_mean", "sampled"}
    found = {k[len(prefix) :] for m in metrics for k in m if k.startswith(prefix)}
    return sorted(d for d in found if d not in skip and "/" not in d)


def summarize(run_dir: pathlib.Path) -> dict[str, Any]:
    """One run's figures: held-out reward per domain at its first and last evaluation (greedy and
    sampled), steps, wall time (from the run's start, config.json, to its last metrics line: warm
    start and teachers included; a resumed run counts from its last start), training time (first to
    last metrics line), and the ledger's counts."""
    run_dir = pathlib.Path(run_dir)
    metrics = read_metrics(run_dir)
    evals = _evals(metrics)
    heldout: dict[str, dict[str, dict[str, float]]] = {}
    for kind, prefix in (("greedy", "eval/"), ("sampled", "eval/sampled/")):
        per = {}
        for d in _domains(evals, prefix):
            values = [(_steps_done(m), m[prefix + d]) for m in evals if prefix + d in m]
            if values:
                per[d] = {"start": values[0][1], "end": values[-1][1], "start_step": values[0][0], "end_step": values[-1][0]}
        if per:
            heldout[kind] = per
    ledger = ledger_answers(run_dir / "rollbook.duckdb")
    times = [m["time"] for m in metrics if "time" in m]
    config = run_dir / "config.json"  # written as the (last) run started, before the warm start
    started = min(config.stat().st_mtime, times[0]) if config.exists() and times else (times[0] if times else 0.0)
    return {
        "run_dir": str(run_dir),
        "heldout": heldout,
        "steps": ledger["steps"],
        "wall_time_s": round(times[-1] - started, 3) if times else 0.0,
        "train_time_s": round(times[-1] - times[0], 3) if len(times) > 1 else 0.0,
        "accepted": ledger["accepted"],
        "rejected": sum(ledger["rejected_by_reason"].values()),
        "rejected_by_reason": ledger["rejected_by_reason"],
        "trained": ledger["trained"],
        "staleness": ledger["staleness"],
        "gate": ledger["gate"],
    }


def write_report(run_dirs: list[pathlib.Path], out: pathlib.Path | None = None, *, quiet: bool = False) -> pathlib.Path:
    """summary.json in each run dir; report.md and the PNGs in ``out`` (default: the first run dir).
    Returns the path of report.md."""
    run_dirs = [pathlib.Path(d) for d in run_dirs]
    if not run_dirs:
        raise ValueError("rollbook report needs at least one run directory")
    out = pathlib.Path(out) if out is not None else run_dirs[0]
    out.mkdir(parents=True, exist_ok=True)
    labels = _labels(run_dirs)
    runs = []
    for run_dir, label in zip(run_dirs, labels):
        summary = summarize(run_dir)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        runs.append((label, read_metrics(run_dir), summary))
    pngs = _plots(runs, out)
    report = out / "report.md"
    report.write_text(_markdown(runs, pngs))
    if not quiet:
        print(f"report: {report} ({len(pngs)} plots; summary.json in {', '.join(str(d) for d in run_dirs)})", flush=True)
    return report


def _labels(run_dirs: list[pathlib.Path]) -> list[str]:
    names = [d.resolve().name for d in run_dirs]
    return names if len(set(names)) == len(names) else [str(d) for d in run_dirs]


def _plots(runs: list[tuple[str, list[dict], dict]], out: pathlib.Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def per_domain(name: str, title: str, ylabel: str, series) -> None:
        """One panel per domain; ``series(metrics, domain)`` -> [(label suffix, style, xs, ys)]."""
        domains = sorted({d for _, metrics, _ in runs for d in series.domains(metrics)})
        if not domains:
            return
        fig, axes = plt.subplots(1, len(domains), figsize=(4.5 * len(domains), 3.4), squeeze=False)
        for ax, domain in zip(axes[0], domains):
            for i, (label, metrics, summary) in enumerate(runs):
                for suffix, style, xs, ys in series.lines(metrics, domain):
                    if xs:
                        ax.plot(xs, ys, style, color=f"C{i}", label=f"{label}{suffix}", marker=".")
                if getattr(series, "markers", False):
                    _gate_markers(ax, summary.get("gate", []), domain, color=f"C{i}", label=label)
            if name != "teacher_gap":  # rewards: the whole 0..1 range, comparable across panels
                ax.set_ylim(-0.03, 1.03)
            ax.set_title(f"{title}: {domain}")
            ax.set_xlabel("step")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=90)
        plt.close(fig)
        written.append(name)

    class Heldout:
        markers = True  # the gate's verdicts, where there are any

        @staticmethod
        def domains(metrics):
            return _domains(_evals(metrics), "eval/")

        @staticmethod
        def lines(metrics, domain):
            evals = _evals(metrics)
            out = []
            for suffix, style, key in ((" sampled", "-", f"eval/sampled/{domain}"), (" greedy", ":", f"eval/{domain}")):
                pts = [(_steps_done(m), m[key]) for m in evals if key in m]
                out.append((suffix, style, [p[0] for p in pts], [p[1] for p in pts]))
            return out

    class Keyed:
        def __init__(self, prefix: str):
            self.prefix = prefix

        def domains(self, metrics):
            return _domains([m for m in metrics if "loss/total" in m], self.prefix)

        def lines(self, metrics, domain):
            key = self.prefix + domain
            pts = [(_steps_done(m), m[key]) for m in metrics if "loss/total" in m and key in m and _finite(m[key])]
            return [("", "-", [p[0] for p in pts], [p[1] for p in pts])]

    per_domain("heldout", "held-out reward", "reward (sampled -, greedy :)", Heldout)
    per_domain("train_reward", "training reward", "mean reward of the batch", Keyed("reward/"))
    per_domain("teacher_gap", "teacher gap", "log pi_T - log pi_student", Keyed("teacher_gap/"))

    # staleness and rejections: grouped bars, one color per run
    for name, key, title, xlabel in (
        ("staleness", "staleness", "trained rows by staleness", "staleness (versions)"),
        ("rejections", "rejected_by_reason", "rejected trajectories by reason", ""),
    ):
        cats = sorted({c for _, _, s in runs for c in s[key]}, key=lambda c: (len(c), c))
        fig, ax = plt.subplots(figsize=(max(4.5, 1.2 * len(cats) + 2), 3.4))
        width = 0.8 / len(runs)
        for i, (label, _, summary) in enumerate(runs):
            ax.bar(
                [j + i * width for j in range(len(cats))],
                [summary[key].get(c, 0) for c in cats],
                width,
                color=f"C{i}",
                label=label,
            )
        ax.set_xticks(
            [j + 0.4 - width / 2 for j in range(len(cats))],
            cats,
            rotation=20 if key != "staleness" else 0,
            fontsize=7 if key != "staleness" else 9,
        )
        ax.set_title(title if cats else f"{title}: none")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("rows")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=90)
        plt.close(fig)
        written.append(name)

    fig, ax = plt.subplots(figsize=(5, 3.4))
    for i, (label, metrics, _) in enumerate(runs):
        pts = [(_steps_done(m), m["perf/tokens_per_s"]) for m in metrics if "perf/tokens_per_s" in m]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color=f"C{i}", label=label, marker=".")
    ax.set_title("trainer throughput")
    ax.set_xlabel("step")
    ax.set_ylabel("tokens / s (pull + update)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=90)
    plt.close(fig)
    written.append("throughput")
    return written


# how each verdict of the promotion gate is drawn on the held-out plot
_GATE_MARKERS = {"promoted": ("^", "promoted"), "refused": ("X", "refused"), "rolled_back": ("v", "rolled back")}


def _gate_markers(ax, verdicts: list[dict], domain: str, *, color: str, label: str) -> None:
    """The gate's verdicts on one domain's held-out panel: x the steps done when decided, y the gate's
    greedy figure for the domain (its overall reward when it has none)."""
    for status, (marker, name) in _GATE_MARKERS.items():
        pts = []
        for v in verdicts:
            y = v.get("heldout", {}).get(domain, v.get("reward"))
            if v["status"] == status and v.get("step") is not None and _finite(y):
                pts.append((v["step"], y))
        if pts:
            ax.scatter(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker=marker,
                s=60 if status == "refused" else 36,
                color="red" if status == "refused" else color,
                edgecolors="black",
                linewidths=0.5,
                zorder=3,
                label=f"{label} gate: {name}",
            )


def _steps_done(row: dict) -> int:
    """Steps finished when a metrics row was written: a trainer step's row carries its 0-based
    ``step`` (as in ``train_steps``), the evaluation before training carries the steps done."""
    return int(row["step"]) + (1 if "loss/total" in row else 0)


def _verdict_text(verdict: dict) -> str:
    """``v3 (0.412)``: a decided version and its greedy held-out reward when measured."""
    reward = verdict.get("reward")
    return f"v{verdict['version']}" + (f" ({reward:.3f})" if _finite(reward) else "")


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def _markdown(runs: list[tuple[str, list[dict], dict]], pngs: list[str]) -> str:
    lines = ["# Run report", ""]
    lines += ["| run | steps | wall time (s) | accepted | rejected | trained |", "|---|---|---|---|---|---|"]
    for label, _, s in runs:
        lines.append(f"| {label} | {s['steps']} | {s['wall_time_s']:.0f} | {s['accepted']} | {s['rejected']} | {s['trained']} |")
    lines += ["", "## Held-out reward per domain (first → last evaluation)", ""]
    lines += ["| run | domain | sampled | greedy |", "|---|---|---|---|"]
    for label, _, s in runs:
        domains = sorted({d for kind in s["heldout"].values() for d in kind})
        for d in domains:
            cells = []
            for kind in ("sampled", "greedy"):
                v = s["heldout"].get(kind, {}).get(d)
                cells.append(f"{v['start']:.3f} → {v['end']:.3f} ({v['end'] - v['start']:+.3f})" if v else "")
            lines.append(f"| {label} | {d} | {cells[0]} | {cells[1]} |")
    gated = [(label, s["gate"]) for label, _, s in runs if s.get("gate")]
    if gated:
        lines += ["", "## Promotion gate (docs/gate.md)", ""]
        for label, verdicts in gated:
            parts = []
            for status in ("promoted", "refused", "rolled_back"):
                shown = [_verdict_text(v) for v in verdicts if v["status"] == status]
                parts.append(f"{status.replace('_', ' ')}: {', '.join(shown) or 'none'}")
            lines.append(f"- {label}: " + "; ".join(parts))
    lines += ["", "## Rejections by reason", ""]
    for label, _, s in runs:
        text = ", ".join(f"{r}: {n}" for r, n in s["rejected_by_reason"].items()) or "none"
        lines.append(f"- {label}: {text}")
    lines.append("")
    titles = {
        "heldout": "Held-out reward per domain",
        "train_reward": "Training reward per domain",
        "teacher_gap": "Teacher gap per domain (MOPD)",
        "staleness": "Staleness of trained rows",
        "rejections": "Rejections by reason",
        "throughput": "Throughput",
    }
    for name in PLOTS:
        if name in pngs:
            lines += [f"## {titles[name]}", "", f"![{name}]({name}.png)", ""]
    lines += [
        'Numbers: each run\'s summary.json; ask the ledger more with `rollbook query --db RUN_DIR/rollbook.duckdb "SQL"`.',
        "",
    ]
    return "\n".join(lines)
