"""Forgetting on a real ``rollbook serve`` after real training: trajectories carrying a marker (a
token sequence and a metadata string) are trained on by ``rollbook train``, then forgotten. No file
of the ledger, its write-ahead log or its SQL snapshots holds the marker afterwards (before: they
do), the lineage names exactly the step and the checkpoints that trained the rows, and after a
restart (log replay) the rows stay gone and their ids stay taken."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np

from rollbook.tasks import TOKENIZER
from tests.integration.procs import ServeProcess, child_env, rows, trajectory

MARKER_TEXT = "forget-me-marker-4c1d9e"
MARKER_TOKENS = [7, 19, 4, 23, 11, 31, 5, 17]  # an output no untrained model writes by chance
MARKER_BYTES = np.asarray(MARKER_TOKENS, dtype="<i4").tobytes()


def _groups(prefix: str, task: str, n_groups: int, **fields) -> list[dict]:
    return [
        trajectory(
            f"{prefix}-{g}-{i}", model_id="tiny", group_id=f"{prefix}-{g}", group_size=2, task_id=task, reward=float(i), **fields
        )
        for g in range(n_groups)
        for i in range(2)
    ]


def _ledger_files(db: pathlib.Path) -> list[pathlib.Path]:
    """The ledger, DuckDB's own log, the write-ahead log segments and the SQL snapshots."""
    found = [db, db.with_name(db.name + ".wal")]
    for folder in (db.with_name(db.name + ".log"), db.with_name(db.name + ".sandbox")):
        found += [p for p in folder.rglob("*") if p.is_file()] if folder.exists() else []
    return [p for p in found if p.exists()]


def _hits(db: pathlib.Path) -> dict[str, int]:
    hits = {}
    for path in _ledger_files(db):
        data = path.read_bytes()
        n = data.count(MARKER_TEXT.encode()) + data.count(MARKER_BYTES)
        if n:
            hits[str(path.relative_to(db.parent))] = n
    return hits


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rollbook.cli", *args], capture_output=True, text=True, timeout=timeout, env=child_env()
    )


def test_forgotten_rows_leave_no_byte_behind_and_lineage_names_what_trained_them(tmp_path):
    db = tmp_path / "store" / "rollbook.duckdb"
    run_dir = tmp_path / "trainer"
    store = ServeProcess(db)
    try:
        with store.client() as client:
            client.register_model("tiny", vocab_size=TOKENIZER.vocab_size)
            client.publish_version("tiny", 0)
            assert client.submit(_groups("clean", "clean", 4)).accepted == 8  # oldest: trained by step 0
            marked = _groups("mark", "marker", 4, output_token_ids=MARKER_TOKENS, output_logprobs=[-1.0] * 8,
                             output_versions=[0] * 8, metadata={"note": MARKER_TEXT})  # fmt: skip
            assert client.submit(marked).accepted == 8  # then step 1
        trained = _cli(
            "train", "--server", store.address, "--run_dir", str(run_dir), "--num_steps", "2", "--num_samples", "8",
            "--checkpoint_every", "1", "--keep_last", "5", "--max_wait_s", "60",
        )  # fmt: skip
        assert trained.returncode == 0, trained.stderr[-3000:]
        with store.client() as client:
            steps = rows(
                client,
                "SELECT s.step, list(DISTINCT t.task_id) AS tasks FROM train_steps s JOIN leases l USING (lease_id) "
                "JOIN trajectories t USING (trajectory_id) GROUP BY ALL ORDER BY 1",
            )
            assert steps == [{"step": 0, "tasks": ["clean"]}, {"step": 1, "tasks": ["marker"]}]
            client.query("SELECT count(*) FROM trajectories")  # a snapshot holding the rows
        assert sorted((run_dir / "checkpoints").glob("step-*")) == [run_dir / "checkpoints" / f"step-00000{n}" for n in (1, 2)]
        before = _hits(db)
        assert before, "the marker must be findable before it is forgotten (else the search proves nothing)"

        done = _cli("forget", "--server", store.address, "--where", "task_id = 'marker'", "--reason", "data subject request",
                    "--run-dir", str(run_dir))  # fmt: skip
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert report["rows"] == 8 and report["audit_id"]
        lineage = report["lineage"]
        assert lineage["steps"] == [1] and lineage["versions"] == [2] and lineage["trained"] == 8
        assert lineage["checkpoints"] == [str(run_dir / "checkpoints" / "step-000002")]  # step-000001 predates step 1
        assert lineage["hf_exports"] == [str(run_dir / "hf" / "step-000002")]  # the final export

        with store.client() as client:
            assert rows(client, "SELECT count(*) AS n FROM trajectories WHERE task_id = 'marker'") == [{"n": 0}]
            tombstones = rows(client, "SELECT trajectory_id, tenant, reason, length(content_sha256) AS h FROM tombstones")
            assert len(tombstones) == 8 and {(t["tenant"], t["reason"], t["h"]) for t in tombstones} == {
                ("default", "data subject request", 64)
            }
            audit = rows(client, "SELECT action, predicate, num_rows FROM audit")
            assert audit == [{"action": "forget", "predicate": "task_id = 'marker'", "num_rows": 8}]
        assert _hits(db) == {}, "the marker survived somewhere"
    finally:
        store.stop()

    store = ServeProcess(db)  # a clean restart: the log replays, the rows stay gone
    try:
        with store.client() as client:
            assert rows(client, "SELECT count(*) AS n FROM trajectories") == [{"n": 8}]
            again = client.submit([marked[0]])  # a retry of a forgotten id cannot bring the content back
            assert again.accepted == 0 and again.duplicates == 1
        assert _hits(db) == {}
        lineage = _cli("lineage", "mark-0-0", "mark-0-1", "--server", store.address, "--run-dir", str(run_dir))
        assert lineage.returncode == 0, lineage.stderr
        assert json.loads(lineage.stdout)["steps"] == [1]
    finally:
        store.stop()
    assert _hits(db) == {}
    # the stopped store's file answers the same way (a private copy, the SQL sandbox)
    lineage = _cli("lineage", "--where", "task_id = 'clean'", "--db", str(db), "--run-dir", str(run_dir))
    assert lineage.returncode == 0, lineage.stderr
    report = json.loads(lineage.stdout)
    assert report["steps"] == [0] and report["trained"] == 8
    assert report["checkpoints"] == [str(run_dir / "checkpoints" / f"step-00000{n}") for n in (1, 2)]
