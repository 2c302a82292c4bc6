"""``bench/generate.py`` runs end to end at tiny sizes and prints one JSON line with both sides, the
ratio and the decode step's bandwidth figures. This checks the benchmark works, not how fast anything is.

Run: python -m pytest tests/integration/test_bench_generate.py -q
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_generation_bench_prints_both_sides_and_the_bandwidth_fraction():
    args = [
        "--json",
        "--batch-size",
        "4",
        "--max-new-tokens",
        "8",
        "--num-requests",
        "6",
        "--repeats",
        "1",
        "--bandwidth-gbs",
        "40",
    ]
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "generate.py"), *args], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = done.stdout.strip().splitlines()
    report = json.loads(line)
    static = report["static"]
    assert static["engine_tokens_per_s"] > 0 and static["hf_tokens_per_s"] > 0 and static["ratio"] > 0
    bandwidth = static["bandwidth"]
    assert bandwidth["bytes_per_step"] == bandwidth["weight_bytes"] + bandwidth["kv_bytes"]
    assert bandwidth["weight_bytes"] == 4 * report["parameters"]  # float32
    expected = bandwidth["bytes_per_step"] / bandwidth["step_s"] / 40e9
    assert abs(bandwidth["fraction_of_bandwidth"] - expected) <= 1e-4 + 0.01 * expected
    assert report["arrivals"]["engine_tokens_per_s"] > 0
