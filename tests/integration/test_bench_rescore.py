"""``bench/rescore.py`` runs end to end at a tiny size and prints one JSON line per its cases, each
replay checked against the by-hand baseline row for row. This checks the benchmark works, not how
fast anything is.

Run: python -m pytest tests/integration/test_bench_rescore.py -q
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_rescore_bench_prints_replay_and_baseline_for_each_reward():
    args = ["--json", "--num-trajectories", "64", "--workers", "0", "--rewards", "math", "bench.rescore:digit_match"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "rescore.py"), *args], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = done.stdout.strip().splitlines()
    report = json.loads(line)
    assert report["num_trajectories"] == 64
    assert [(c["reward"], c["workers"]) for c in report["cases"]] == [("math", 0), ("bench.rescore:digit_match", 0)]
    for case in report["cases"]:
        assert case["rows"] == 64 and case["errors"] == 0 and case["same_scores"] is True
        assert case["replay_rows_per_s"] > 0 and case["baseline_rows_per_s"] > 0 and case["replay_over_baseline"] > 0
