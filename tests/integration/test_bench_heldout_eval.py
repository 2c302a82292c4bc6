"""``bench/heldout_eval.py`` (the demo's final models evaluated with more samples, docs/RESULTS.md "The
MOPD demo") runs on a saved model and prints one JSON line per model with a reward per domain.
Tiny sizes: an untrained model, 4 problems, 2 samples; this checks the script, not the figures.

Run: ``python -m pytest tests/integration/test_bench_heldout_eval.py -q``.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

from rollbook.config import ModelConfig
from rollbook.language_models import build_student

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_heldout_eval_bench_scores_each_model_on_each_domain(tmp_path):
    model_dir = tmp_path / "student"
    build_student(ModelConfig(seed=1)).save_pretrained(model_dir)
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "heldout_eval.py"), str(model_dir), str(model_dir)]
        + ["--seed", "3", "--num_problems", "4", "--samples", "2", "--max_new_tokens", "6"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert row["model"] == str(model_dir) and row["seed"] == 3 and row["samples"] == 2
        for domain in ("addition", "program"):
            assert row[f"{domain}_problems"] == 4 and row[f"{domain}_errors"] == 0
            assert 0.0 <= row[domain] <= 1.0
    assert rows[0]["addition"] == rows[1]["addition"]  # the same model, the same seeded samples


def test_an_unknown_domain_is_refused_in_one_line(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "heldout_eval.py"), str(tmp_path), "--domains", "addition,poetry"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "unknown domain(s) ['poetry']" in done.stderr
