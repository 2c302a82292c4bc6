"""bench/pull_history.py runs end to end at a small size: it fabricates ledgers of trained history that
a real ``rollbook serve`` opens, every timed pull serves exactly the rows just submitted (the bench
fails otherwise), and the JSON line carries each history's figures (the figures themselves are the
benchmark's, docs/RESULTS.md)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import duckdb

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_fabricated_history_is_trained_groups_of_eight_each_leased_once_and_acked(tmp_path):
    from bench.pull_history import fabricate

    db = tmp_path / "rollbook.duckdb"
    fabricate(db, 1000, 16, model_id="m", vocab_size=100, versions=(0, 1))
    con = duckdb.connect(str(db), read_only=True)
    rows = con.execute(
        "SELECT count(*), count(DISTINCT group_id), min(num_output_tokens), max(len(output_token_ids)), "
        "bool_and(status = 'trained'), max(list_max(output_token_ids)) < 100 FROM trajectories"
    ).fetchone()
    (acked,) = con.execute("SELECT count(*) FROM leases WHERE acked_at IS NOT NULL").fetchone()
    con.close()
    assert rows == (1000, 125, 16, 16, True, True) and acked == 1000


def test_pull_history_bench_reports_every_history():
    done = subprocess.run(
        [sys.executable, "bench/pull_history.py", "--json", "--histories", "0", "200", "2000"]
        + ["--repeats", "1", "--batch", "16", "--ingest", "128", "--output-tokens", "8"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert [h["history"] for h in report["histories"]] == [0, 200, 2000]
    for h in report["histories"]:
        assert h["pull_ms"] > 0 and h["ack_ms"] > 0 and h["ingest_tok_s"] > 0 and h["ingest_folded_tok_s"] > 0, h
    assert report["pull_ms_per_10x"] > 0 and report["ingest_over_empty"] > 0
