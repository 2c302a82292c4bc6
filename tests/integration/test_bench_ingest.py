"""``bench/ingest.py`` still runs end to end (a real store, real client processes, the Arrow
baseline) and prints one JSON line with the fields docs/RESULTS.md quotes. Tiny sizes: this checks
the benchmark works, not how fast anything is.

Run: ``python -m pytest tests/integration/test_bench_ingest.py -q``.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_ingest_bench_prints_one_json_line_with_its_ratios(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "ingest.py"),
            "--json",
            "--systems",
            "rollbook,rollbook_novalidate,arrow_ipc_fsync",
            "--num-trajectories",
            "96",
            "--num-tokens",
            "40",
            "--batch-size",
            "16",
            "--repeats",
            "1",
            "--work-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = done.stdout.strip().splitlines()
    report = json.loads(line)
    for key in ("rollbook_tok_s", "rollbook_novalidate_tok_s", "arrow_ipc_fsync_tok_s", "pull_tok_s", "duckdb_scan_tok_s"):
        assert report[key] > 0, key
    assert report["ray_queue_tok_s"] is None and report["rollbook_over_ray"] is None  # not asked for
    assert report["rollbook_over_ceiling"] > 0 and report["validation_cost"] < 1
    assert (report["num_trajectories"], report["num_output_tokens"], report["repeats"]) == (96, 40, 1)
    assert len(report["pull_over_scan_all"]) == 1 and report["pull_over_scan"] == report["pull_over_scan_all"][0]
    assert "rollbook: counters checked" in done.stderr  # the store's counters matched what was sent


def test_the_ray_queue_records_pickle_with_every_field_metadata_included():
    """What the Ray producers put on the queue must pickle (a protobuf map does not)."""
    import pickle

    from bench.ingest import _as_record, make_trajectories

    [msg] = make_trajectories(1, 8, worker=0, run="pickle", consent=True)
    assert dict(msg.metadata), "the record under test carries metadata"
    record = pickle.loads(pickle.dumps(_as_record(msg)))
    assert record["metadata"] == dict(msg.metadata)
    assert record["output_token_ids"].tolist() == list(msg.output_token_ids)
