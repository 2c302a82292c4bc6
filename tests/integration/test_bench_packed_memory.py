"""bench/packed_memory.py runs end to end at a small size: both paths in their own processes, the
same log-probs and gradients, a JSON line with every size's peak memory (the figures themselves are the
benchmark's, docs/RESULTS.md)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_packed_memory_bench_measures_both_paths_and_they_agree():
    done = subprocess.run(
        [sys.executable, "bench/packed_memory.py", "--json", "--tokens", "256", "512", "--vocab", "2048", "--chunk-tokens", "64"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["bench"] == "packed_memory" and [s["tokens"] for s in report["sizes"]] == [256, 512]
    for size in report["sizes"]:
        assert size["chunked_peak_mib"] > 0 and size["dense_peak_mib"] > 0, size
    assert report["max_abs_logp_diff"] < 1e-5 and report["max_abs_grad_diff"] < 1e-5
    assert report["dense_over_chunked_at"] == 512
