"""``bench/placement.py`` still runs all three placements end to end (real store, real trainer, a
local Ray instance for ``ray``) and prints one JSON line plus the markdown table. Tiny sizes: this
checks the benchmark works, not how fast anything is."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_the_placement_bench_runs_every_placement_and_prints_json_and_a_table(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "placement.py"),
            "--json",
            "--steps",
            "2",
            "--samples",
            "16",
            "--warm-steps",
            "5",
            "--ray-workers",
            "2",
            "--ranks",
            "2",
            "--work-dir",
            str(tmp_path),
            "--",
            "--rollout.group_size",
            "4",
            "--rollout.num_prompts",
            "2",
            "--rollout.num_eval_tasks",
            "4",
            "--rollout.num_eval_samples",
            "1",
            "--trainer.model.hidden_size",
            "64",
            "--trainer.model.intermediate_size",
            "128",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = done.stdout.strip().splitlines()
    rows = {r["placement"]: r for r in json.loads(line)["placements"]}
    assert set(rows) == {"colocated", "separated", "ray"}
    for name, row in rows.items():
        assert row["trained_tokens"] > 0 and row["trained_tok_s"] > 0, name
        assert row["heldout_final"] is not None and row["peak_rss_mib_largest_process"] > 0, name
    assert (
        rows["ray"]["workers"] >= 1 and rows["colocated"]["workers"] == 1
    )  # two steps: the second actor may not have submitted yet
    assert "| placement |" in done.stderr
