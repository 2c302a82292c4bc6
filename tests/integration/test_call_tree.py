"""A session's call tree (``Trajectory.parent_request_id`` and ``branched``) through a real store:
submitted, walked in SQL with the recursive query of docs/schema.md, served by ``PullBatch``, kept
with a rejected call; a branch without a parent is ``BRANCH_WITHOUT_PARENT``; a ledger file and a
write-ahead log made before the two columns open with no parent and not branched.

Run: ``python -m pytest tests/integration/test_call_tree.py -q``.
"""

from __future__ import annotations

import pathlib
import re

import duckdb
import pytest

from rollbook.store import wal
from rollbook.store.schema import ADDED_COLUMNS, DDL
from rollbook.store.tables import rejections_table, trajectories_table
from rollbook.trajectories import decode_messages, trajectory_from_dict
from rollbook.v1 import rollbook_pb2 as pb
from tests.integration.conftest import MODEL, query_file, register, rows, start_store, traj

ROOT = pathlib.Path(__file__).resolve().parents[2]
SESSION = "agent-7"


def tree_query(session: str) -> str:
    """The session-tree query of docs/schema.md, as written there, for ``session`` of ``MODEL``."""
    text = (ROOT / "docs" / "schema.md").read_text()
    [sql] = [block for block in re.findall(r"```sql\n(.*?)```", text, re.S) if "WITH RECURSIVE" in block]
    assert "model_id = 'm'" in sql and "'sess-7'" in sql
    return sql.replace("model_id = 'm'", f"model_id = '{MODEL}'").replace("'sess-7'", f"'{session}'")


def call(tid: str, request_id: str, parent: str = "", branched: bool = False, session: str = SESSION, **fields) -> dict:
    return traj(tid, session_id=session, request_id=request_id, parent_request_id=parent, branched=branched, **fields)


# turn-0 -> turn-1 (two choices; choice 0 retried once, the retry consumed) -> turn-2 extends
# turn-1.0; turn-3 re-renders an edited turn-1.0 history (branched) -> turn-4 extends turn-3
SESSION_CALLS = [
    call("t0", "turn-0.0", created_at=1.0),
    call("t1c0-a0", "turn-1.0", "turn-0.0", attempt=0, consumed=False, created_at=2.0),
    call("t1c0-a1", "turn-1.0", "turn-0.0", attempt=1, created_at=2.5),
    call("t1c1", "turn-1.1", "turn-0.0", created_at=2.5),
    call("t2", "turn-2.0", "turn-1.0", created_at=3.0),
    call("t3", "turn-3.0", "turn-1.0", branched=True, created_at=4.0),
    call("t4", "turn-4.0", "turn-3.0", created_at=5.0),
    # another session with the same request ids: never part of SESSION's tree
    call("o0", "turn-0.0", session="other", created_at=1.0),
    call("o1", "turn-1.0", "turn-0.0", session="other", created_at=2.0),
]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    s = start_store(tmp_path_factory.mktemp("tree") / "rollbook.duckdb")
    with s.client() as client:
        register(client)
        result = client.submit(SESSION_CALLS)
        assert result.accepted == len(SESSION_CALLS), {t: v.reason for t, v in result.verdicts.items()}
    yield s
    s.kill()


def test_the_docs_query_walks_a_session_tree_from_its_first_call_over_consumed_attempts(store):
    with store.client() as client:
        got = rows(client, tree_query(SESSION))
    assert [(r["depth"], r["request_id"], r["parent_request_id"], r["branched"], r["trajectory_id"]) for r in got] == [
        (0, "turn-0.0", "", False, "t0"),
        (1, "turn-1.0", "turn-0.0", False, "t1c0-a1"),
        (2, "turn-2.0", "turn-1.0", False, "t2"),
        (2, "turn-3.0", "turn-1.0", True, "t3"),
        (3, "turn-4.0", "turn-3.0", False, "t4"),
        (1, "turn-1.1", "turn-0.0", False, "t1c1"),
    ]
    assert all(r["num_output_tokens"] == 16 and r["num_prompt_tokens"] == 3 for r in got)


def test_a_retry_that_was_not_kept_keeps_its_place_in_the_tree_in_rejections(store):
    with store.client() as client:
        got = rows(
            client,
            f"SELECT trajectory_id, reason, request_id, parent_request_id, branched FROM rejections "
            f"WHERE session_id = '{SESSION}'",
        )
    assert got == [
        {
            "trajectory_id": "t1c0-a0",
            "reason": "RETRY_ORPHAN",
            "request_id": "turn-1.0",
            "parent_request_id": "turn-0.0",
            "branched": False,
        }
    ]


def test_pull_batch_serves_the_call_tree(store):
    with store.client() as client:
        batch = client.pull_batch(trainer_id="tree", trainer_version=0, max_staleness=10, num_samples=100, model_id=MODEL)
    served = {
        r["trajectory_id"]: (r["session_id"], r["request_id"], r["parent_request_id"], r["branched"])
        for r in batch.table.to_pylist()
    }
    assert {t: v for t, v in served.items() if v[0] == SESSION} == {
        "t0": (SESSION, "turn-0.0", "", False),
        "t1c0-a1": (SESSION, "turn-1.0", "turn-0.0", False),
        "t1c1": (SESSION, "turn-1.1", "turn-0.0", False),
        "t2": (SESSION, "turn-2.0", "turn-1.0", False),
        "t3": (SESSION, "turn-3.0", "turn-1.0", True),
        "t4": (SESSION, "turn-4.0", "turn-3.0", False),
    }
    assert served["o1"] == ("other", "turn-1.0", "turn-0.0", False)


def test_a_branch_without_a_parent_and_an_overlong_parent_are_rejected(store):
    with store.client() as client:
        result = client.submit(
            [
                call("no-parent", "turn-9.0", branched=True),
                call("long-parent", "turn-9.1", "p" * 257),
                call("parent-at-limit", "turn-9.2", "p" * 256, branched=True),
            ]
        )
        verdicts = result.verdicts
        assert (verdicts["no-parent"].status, verdicts["no-parent"].reason) == (pb.Verdict.REJECTED, "BRANCH_WITHOUT_PARENT")
        assert "parent_request_id" in verdicts["no-parent"].detail
        assert (verdicts["long-parent"].reason, "parent_request_id" in verdicts["long-parent"].detail) == ("OVERSIZED", True)
        assert verdicts["parent-at-limit"].status == pb.Verdict.ACCEPTED
        got = rows(
            client,
            "SELECT trajectory_id, stage, parent_request_id, branched FROM rejections "
            "WHERE trajectory_id IN ('no-parent', 'long-parent') ORDER BY 1",
        )
        assert got == [
            {"trajectory_id": "long-parent", "stage": "ingest", "parent_request_id": "p" * 257, "branched": False},
            {"trajectory_id": "no-parent", "stage": "ingest", "parent_request_id": "", "branched": True},
        ]
        assert client.stats().rejected_by_reason["BRANCH_WITHOUT_PARENT"] == 1


def _old_file(db: pathlib.Path) -> None:
    """A ledger file and an unfolded log segment as a store wrote them before the call tree's
    columns: the DDL without the statements that add them, and log batches without them."""
    con = duckdb.connect(str(db))
    for ddl in DDL:
        if not any(f"ADD COLUMN IF NOT EXISTS {name}" in ddl for name in ADDED_COLUMNS):
            con.execute(ddl)
    con.execute("INSERT INTO models VALUES (?, 512, 0.0)", [MODEL])
    con.execute("INSERT INTO policy_versions (model_id, version, checksum, published_at) VALUES (?, 0, 'sha-0', 0.0)", [MODEL])
    folded = trajectories_table(decode_messages([trajectory_from_dict(traj("old-folded"))]), 1.0)
    con.register("_old", folded.drop_columns(list(ADDED_COLUMNS)))
    con.execute("INSERT INTO trajectories BY NAME SELECT * FROM _old")
    con.execute("INSERT INTO rejections (trajectory_id, reason, stage) VALUES ('old-rejected', 'STALE', 'pull')")
    con.close()
    logged = decode_messages([trajectory_from_dict(traj("old-logged")), trajectory_from_dict(traj("old-logged-bad"))])
    halves = {
        "traj": trajectories_table(logged, 2.0).slice(0, 1),
        "rej": rejections_table(logged, [(1, "NONFINITE_LOGPROB", "output_logprobs[0] = nan")], "ingest", 2.0),
    }
    root = wal.log_root(db)
    root.mkdir()
    for kind, table in halves.items():
        old = table.drop_columns([c for c in ADDED_COLUMNS if c in table.column_names])
        segment = wal._SegmentFile(root / f"00000001.{kind}.arrow", old.schema)
        segment.append([old])
        segment.close()


def test_a_ledger_file_and_log_made_before_the_call_tree_open_with_no_parent_and_not_branched(tmp_path, stores):
    db = tmp_path / "old.duckdb"
    _old_file(db)
    stores.append(store := start_store(db))
    with store.client() as client:
        verdict = client.submit([call("new-child", "turn-1.0", "turn-0.0", branched=True)]).verdicts["new-child"]
        assert verdict.status == pb.Verdict.ACCEPTED, verdict.detail
        got = rows(client, "SELECT trajectory_id, parent_request_id, branched FROM trajectories ORDER BY 1")
        assert got == [
            {"trajectory_id": "new-child", "parent_request_id": "turn-0.0", "branched": True},
            {"trajectory_id": "old-folded", "parent_request_id": "", "branched": False},
            {"trajectory_id": "old-logged", "parent_request_id": "", "branched": False},
        ]
        got = rows(client, "SELECT trajectory_id, parent_request_id, branched FROM rejections ORDER BY 1")
        assert got == [
            {"trajectory_id": "old-logged-bad", "parent_request_id": "", "branched": False},
            {"trajectory_id": "old-rejected", "parent_request_id": "", "branched": False},
        ]
        columns = [r["column_name"] for r in rows(client, "SELECT column_name FROM (DESCRIBE trajectories)")]
        at = columns.index("status")  # where a new file has them: after status
        assert columns[at : at + 3] == ["status", "parent_request_id", "branched"]
    assert store.terminate() == 0
    got = query_file(db, "SELECT trajectory_id, parent_request_id, branched FROM trajectories WHERE trajectory_id = 'new-child'")
    assert got == [{"trajectory_id": "new-child", "parent_request_id": "turn-0.0", "branched": True}]


def test_rollbook_query_reads_a_ledger_made_before_the_call_tree_that_no_new_store_opened(tmp_path):
    """``rollbook query --db`` folds the unfolded log into a private copy: the copy first gets today's
    columns, so the old segment's rows read with no parent and not branched."""
    db = tmp_path / "old.duckdb"
    _old_file(db)
    got = query_file(db, "SELECT trajectory_id, parent_request_id, branched FROM trajectories ORDER BY 1")
    assert got == [
        {"trajectory_id": "old-folded", "parent_request_id": "", "branched": False},
        {"trajectory_id": "old-logged", "parent_request_id": "", "branched": False},
    ]
