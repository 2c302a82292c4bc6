"""``bench/proxy.py`` still runs end to end (a real store, a real ``rollbook proxy``, the openai client)
and prints one JSON line with the fields docs/RESULTS.md quotes. Tiny sizes: this checks the benchmark
works, not how fast anything is.

Run: ``python -m pytest tests/integration/test_proxy_bench.py -q``.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_proxy_bench_prints_one_json_line_with_both_sides(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "proxy.py"),
            "--json",
            "--clients",
            "2",
            "--calls",
            "3",
            "--rounds",
            "2",
            "--max-tokens",
            "4",
            "--stream-tokens",
            "8",
            "--ttft-calls",
            "2",
            "--work-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = done.stdout.strip().splitlines()
    report = json.loads(line)
    for key in ("direct_rps", "proxy_rps", "proxy_over_direct_rps", "direct_latency_ms_mean", "proxy_latency_ms_mean"):
        assert report[key] > 0, key
    assert len(report["proxy_over_direct_rps_all"]) == report["rounds"] == 2
    cores = report["proxy_phase_cpu_cores"]
    assert set(cores) == {"engine", "proxy", "store", "clients"}
    assert all(v is not None and v >= 0 for v in cores.values()) and cores["proxy"] > 0, cores
    assert "added_latency_ms_mean" in report and "added_latency_ms_p50" in report
    assert 0 < report["ttft_over_call"] <= 1 and report["stream_calls_timed"] == 2
    # one per call, warm-ups and streamed calls included (the bench checks the exact count itself)
    assert report["stored_trajectories"] >= 2 * (2 * 3 + 1) + 2
    assert "one per call (checked)" in done.stderr
