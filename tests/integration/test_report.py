"""``rollbook report`` on a finished run: report.md, the PNG plots and
summary.json exist, the PNGs decode, and summary.json's numbers are the ledger's SQL answers, asked
through ``rollbook query --db`` (the path a user takes). The run is a real ``rollbook run`` of
configs/demo.toml, shrunk (specialist teachers, MOPD + RL), with broken evidence submitted to its
store afterwards so that the rejections have reasons to count."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _cli(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rollbook.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def _sql(db: pathlib.Path, sql: str) -> list[dict]:
    done = _cli("query", "--db", str(db), "--format", "json", sql, timeout=120)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> pathlib.Path:
    run_dir = tmp_path_factory.mktemp("report") / "run"
    done = _cli(
        "run",
        "--config",
        "configs/demo.toml",
        "--run_dir",
        str(run_dir),
        "--num_steps",
        "3",
        "--eval_every",
        "2",
        "--warm_start.student_steps",
        "4",
        "--warm_start.teacher_steps",
        "4",
        "--rollout.num_eval_tasks",
        "6",
        "--rollout.num_eval_samples",
        "2",
        "--rollout.num_prompts",
        "4",
        "--rollout.group_size",
        "4",
        "--trainer.num_samples",
        "16",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "warm start teacher-addition" in done.stdout and "warm start teacher-program" in done.stdout
    for domain in ("addition", "program"):  # each teacher's held-out accuracy, before RL starts
        assert f"teacher {domain}: held-out accuracy " in done.stdout.split("held-out reward before step")[0]
    assert f"report: {run_dir / 'report.md'}" in done.stdout  # rollbook run writes the report itself
    from rollbook.cli.demo import generate_workload
    from rollbook.run.store_process import StoreProcess

    store = StoreProcess(run_dir / "rollbook.duckdb")  # broken evidence, after the run: rejections to count
    try:
        with store.client() as client:
            result = client.submit(generate_workload(40, model_id="tiny", bad_every=3))
        assert result.rejected > 0
    finally:
        store.stop()
    return run_dir


def test_report_writes_markdown_decodable_pngs_and_a_summary_equal_to_the_ledger(finished_run, tmp_path):
    import matplotlib.image

    (finished_run / "summary.json").unlink()
    done = _cli("report", str(finished_run), timeout=300)
    assert done.returncode == 0, done.stderr
    report = (finished_run / "report.md").read_text()
    for name in ("heldout", "train_reward", "teacher_gap", "staleness", "rejections", "throughput"):
        image = matplotlib.image.imread(finished_run / f"{name}.png")
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100, name
        assert f"]({name}.png)" in report
    summary = json.loads((finished_run / "summary.json").read_text())
    db = finished_run / "rollbook.duckdb"
    assert summary["accepted"] == _sql(db, "SELECT count(*) AS n FROM trajectories")[0]["n"]
    by_reason = {r["reason"]: r["n"] for r in _sql(db, "SELECT reason, count(*) AS n FROM rejections GROUP BY reason")}
    assert summary["rejected_by_reason"] == by_reason and summary["rejected"] == sum(by_reason.values()) > 0
    trained = _sql(db, "SELECT count(DISTINCT trajectory_id) AS n FROM leases WHERE acked_at IS NOT NULL")[0]["n"]
    assert summary["trained"] == trained > 0
    assert summary["steps"] == _sql(db, "SELECT count(*) AS n FROM train_steps")[0]["n"] == 3
    staleness = _sql(
        db,
        "SELECT l.trainer_version - t.min_version AS s, count(*) AS n FROM leases l "
        "JOIN trajectories t USING (trajectory_id) WHERE l.acked_at IS NOT NULL GROUP BY s",
    )
    assert summary["staleness"] == {str(r["s"]): r["n"] for r in staleness} == {"0": trained}  # colocated: on-policy
    metrics = [json.loads(line) for line in (finished_run / "metrics.jsonl").read_text().splitlines()]
    evals = [m for m in metrics if "eval/reward" in m]
    for domain in ("addition", "program"):
        assert summary["heldout"]["greedy"][domain]["start"] == evals[0][f"eval/{domain}"]
        assert summary["heldout"]["sampled"][domain]["end"] == evals[-1][f"eval/sampled/{domain}"]
        assert summary["heldout"]["sampled"][domain]["end_step"] == 3
    assert summary["wall_time_s"] > 0


def test_report_puts_several_runs_on_one_plot(finished_run, tmp_path):
    other = tmp_path / "copy"
    import shutil

    shutil.copytree(
        finished_run, other, ignore=shutil.ignore_patterns("*.png", "report.md", "checkpoints", "teacher-*", "base-student")
    )
    out = tmp_path / "compare"
    done = _cli("report", str(finished_run), str(other), "--out", str(out), timeout=300)
    assert done.returncode == 0, done.stderr
    report = (out / "report.md").read_text()
    assert f"| {finished_run.name} |" in report and "| copy |" in report
    assert json.loads((other / "summary.json").read_text())["steps"] == 3


def test_report_of_a_folder_that_is_no_run_is_one_line(tmp_path):
    done = _cli("report", str(tmp_path), timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip().count("\n") == 0 and "not a finished run directory" in done.stderr
