"""The ledger: idempotency within and across batches, and recovery of log batches that were
acknowledged but not folded when the process died (replayed exactly once).

Run: ``python -m pytest tests/unit/store/test_ledger.py -q``.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap
import threading

import pyarrow as pa
import pytest

from rollbook.store import wal
from rollbook.store.ledger import ACCEPTED, DUPLICATE, REJECTED, Ledger, ModelConflict, NotRewardable
from rollbook.trajectories import trajectory_from_dict

MODEL = "m"


def row(tid: str, n: int = 4, **fields):
    t = dict(
        trajectory_id=tid,
        model_id=MODEL,
        output_token_ids=list(range(n)),
        output_logprobs=[-1.0] * n,
        output_versions=[0] * n,
        temperature=1.0,
        top_p=1.0,
    )
    t.update(fields)
    return trajectory_from_dict(t)


def open_ledger(db: pathlib.Path) -> Ledger:
    ledger = Ledger(db, fold_interval_s=3600)  # no background folds: tests fold explicitly
    ledger.register_model(MODEL, 100)
    ledger.publish_version(MODEL, 0, "c0")
    return ledger


def ids(ledger: Ledger) -> list[str]:
    ledger.flush()
    cur = ledger.cursor()
    try:
        return [t for (t,) in cur.execute("SELECT trajectory_id FROM trajectories ORDER BY trajectory_id").fetchall()]
    finally:
        cur.close()


@pytest.fixture
def ledger(tmp_path):
    led = open_ledger(tmp_path / "l.duckdb")
    yield led
    led.close()


def test_the_ledger_folds_on_one_duckdb_thread(ledger):
    """Two threads write an order-keeping insert (a fold) in parallel and merge it: twice the CPU
    per folded row and a file twice the size (store/ledger.py ``_connect``)."""
    assert ledger.con.execute("SELECT current_setting('threads')").fetchone() == (1,)


def test_duplicates_within_one_batch_are_stored_once(ledger):
    out = ledger.submit([row("a"), row("b"), row("a"), row("a")])
    assert [o.status for o in out] == [ACCEPTED, ACCEPTED, DUPLICATE, DUPLICATE]
    assert ids(ledger) == ["a", "b"]
    assert ledger.counters["duplicates"] == 2


def test_duplicates_across_batches_are_stored_once_folded_or_not(ledger):
    assert [o.status for o in ledger.submit([row("a"), row("b")])] == [ACCEPTED, ACCEPTED]
    assert [o.status for o in ledger.submit([row("b"), row("c")])] == [DUPLICATE, ACCEPTED]  # b not folded yet
    ledger.flush()
    assert [o.status for o in ledger.submit([row("a"), row("c"), row("d")])] == [DUPLICATE, DUPLICATE, ACCEPTED]
    assert ids(ledger) == ["a", "b", "c", "d"]


def test_a_rejected_id_is_not_accepted_later_and_says_so(ledger):
    [first] = ledger.submit([row("x", output_logprobs=[float("nan")] * 4)])
    [again] = ledger.submit([row("x")])
    assert (first.status, first.reason) == (REJECTED, "NONFINITE_LOGPROB")
    assert again.status == DUPLICATE and "REJECTED" in again.detail and "new trajectory_id" in again.detail
    assert ids(ledger) == []


def test_a_session_reward_goes_to_the_latest_consumed_or_only_attempt(ledger):
    ledger.submit(
        [
            row("r1-a0", session_id="s", request_id="r1", consumed=False, created_at=1.0),
            row("r1-a1", session_id="s", request_id="r1", consumed=True, created_at=2.0),
            row("r2-a0", session_id="s", request_id="r2", created_at=3.0),
            row("other", session_id="s2", request_id="r9", consumed=True, created_at=9.0),
        ]
    )
    assert ledger.set_reward(0.5, session_id="s") == "r2-a0"


def test_a_reward_beyond_max_abs_reward_is_refused_with_its_code(ledger):
    ledger.submit([row("later", reward=None)])
    for reward in (1e6 + 1, -1e200):
        with pytest.raises(ValueError, match="REWARD_OUT_OF_RANGE"):
            ledger.set_reward(reward, trajectory_id="later")
    assert ledger.set_reward(-1e6, trajectory_id="later") == "later"


def test_recovery_reads_a_log_segment_written_before_rejections_had_consumed(tmp_path):
    """A segment from before the column existed replays with consumed NULL instead of being
    mistaken for a torn tail (which would drop acknowledged rejections)."""
    from rollbook.store.schema import ADDED_COLUMNS, REJECTION_SCHEMA

    old_schema = pa.schema([f for f in REJECTION_SCHEMA if f.name != "consumed" and f.name not in ADDED_COLUMNS])
    old = pa.table(
        {
            f.name: pa.array(["x"] if f.type == pa.string() else [1] if f.type == pa.int64() else [1.0], f.type)
            for f in old_schema
        },
        schema=old_schema,
    )
    conformed = wal._conform(old.to_batches(), REJECTION_SCHEMA)
    assert conformed.schema == REJECTION_SCHEMA and conformed.column("consumed").to_pylist() == [None]
    assert conformed.column("trajectory_id").to_pylist() == ["x"]
    assert (conformed.column("parent_request_id").to_pylist(), conformed.column("branched").to_pylist()) == ([""], [False])


def test_a_file_made_before_groups_were_per_model_opens_with_its_groups_keyed_by_model(tmp_path):
    """An older file's ``groups`` (keyed by group_id alone) and ``rejections`` (no created_at) are
    brought to the current shape when the ledger opens it; its rows keep their values."""
    import duckdb

    from rollbook.store.schema import _DUCK_TYPES, REJECTION_SCHEMA

    db = tmp_path / "old.duckdb"
    con = duckdb.connect(str(db))
    con.execute(
        """CREATE TABLE groups (group_id VARCHAR PRIMARY KEY, expected_size UINTEGER, num_members UINTEGER,
           num_rewarded UINTEGER, status VARCHAR, ready_at DOUBLE, closed_at DOUBLE)"""
    )
    con.execute("INSERT INTO groups VALUES ('g-old', 2, 2, 2, 'ready', 5.0, NULL)")
    old_columns = [f"{f.name} {_DUCK_TYPES[f.type]}" for f in REJECTION_SCHEMA if f.name != "created_at"]
    con.execute(f"CREATE TABLE rejections ({', '.join(old_columns)})")
    con.execute("INSERT INTO rejections (trajectory_id, reason) VALUES ('rej-old', 'STALE')")
    con.close()
    ledger = open_ledger(db)
    try:
        ledger.submit([row(f"new-{i}", group_id="g-old", group_size=2, reward=float(i)) for i in range(2)])
        ledger.flush()
        got = ledger.con.execute("SELECT model_id, group_id, num_members FROM groups ORDER BY ALL").fetchall()
        assert got == [("", "g-old", 2), (MODEL, "g-old", 2)]
        assert ledger.con.execute("SELECT trajectory_id, created_at FROM rejections").fetchall() == [("rej-old", None)]
    finally:
        ledger.close()


def test_the_call_tree_is_stored_and_goes_with_a_row_into_rejections(ledger):
    call = dict(session_id="s", request_id="turn-1.0", parent_request_id="turn-0.0", branched=True)
    out = ledger.submit(
        [
            row("turn-0", session_id="s", request_id="turn-0.0", consumed=True, created_at=1.0),
            row("turn-1-a0", **call, attempt=0, consumed=False, created_at=2.0),  # an orphaned retry
            row("turn-1-a1", **call, attempt=1, consumed=True, created_at=3.0),
            row("orphan-branch", session_id="s", request_id="turn-2.0", branched=True, consumed=True, created_at=4.0),
        ]
    )
    assert [(o.status, o.reason) for o in out][3] == (REJECTED, "BRANCH_WITHOUT_PARENT")
    ledger.flush()
    cur = ledger.cursor()
    try:
        kept = cur.execute("SELECT trajectory_id, parent_request_id, branched FROM trajectories ORDER BY 1").fetchall()
        rejected = cur.execute("SELECT trajectory_id, reason, parent_request_id, branched FROM rejections ORDER BY 1").fetchall()
    finally:
        cur.close()
    assert kept == [("turn-0", "", False), ("turn-1-a1", "turn-0.0", True)]
    assert rejected == [("orphan-branch", "BRANCH_WITHOUT_PARENT", "", True), ("turn-1-a0", "RETRY_ORPHAN", "turn-0.0", True)]


def test_a_file_and_a_log_made_before_the_call_tree_columns_open_with_no_parent_and_not_branched(tmp_path):
    """An older file's ``trajectories`` and ``rejections`` get ``parent_request_id`` and ``branched``
    (its rows read '' and false, as a trajectory that does not set them), in the same column order
    as a new file; acknowledged rows of an older log segment replay with the same values."""
    import duckdb

    from rollbook.store.schema import ADDED_COLUMNS, DDL
    from rollbook.store.tables import rejections_table, trajectories_table
    from rollbook.trajectories import decode_messages

    db = tmp_path / "old.duckdb"
    con = duckdb.connect(str(db))
    for ddl in DDL:  # the DDL without the statements that add the call tree's columns
        if not any(f"ADD COLUMN IF NOT EXISTS {name}" in ddl for name in ADDED_COLUMNS):
            con.execute(ddl)
    assert "parent_request_id" not in [c for (c,) in con.execute("SELECT column_name FROM duckdb_columns()").fetchall()]
    con.execute("INSERT INTO trajectories (trajectory_id, model_id, status) VALUES ('folded-old', 'm', 'trained')")
    con.execute("INSERT INTO rejections (trajectory_id, reason) VALUES ('rej-old', 'STALE')")
    con.close()
    halves = {
        "traj": trajectories_table(decode_messages([row("logged-old")]), 5.0),
        "rej": rejections_table(decode_messages([row("logged-bad")]), [(0, "NONFINITE_LOGPROB", "x")], "ingest", 5.0),
    }
    wal.log_root(db).mkdir()
    for kind, table in halves.items():
        old = table.drop_columns([c for c in ADDED_COLUMNS if c in table.column_names])
        segment = wal._SegmentFile(wal.log_root(db) / f"00000001.{kind}.arrow", old.schema)
        segment.append([old])
        segment.close()

    def columns(ledger: Ledger) -> list[tuple]:
        return ledger.con.execute(
            "SELECT table_name, column_name, data_type FROM duckdb_columns() "
            "WHERE table_name IN ('trajectories', 'rejections') ORDER BY table_name, column_index"
        ).fetchall()

    ledger = open_ledger(db)
    fresh = open_ledger(tmp_path / "new.duckdb")
    try:
        assert columns(ledger) == columns(fresh)
        ledger.submit([row("new", request_id="turn-1.0", parent_request_id="turn-0.0", branched=True)])
        ledger.flush()
        got = ledger.con.execute("SELECT trajectory_id, parent_request_id, branched FROM trajectories ORDER BY 1").fetchall()
        assert got == [("folded-old", "", False), ("logged-old", "", False), ("new", "turn-0.0", True)]
        got = ledger.con.execute("SELECT trajectory_id, parent_request_id, branched FROM rejections ORDER BY 1").fetchall()
        assert got == [("logged-bad", "", False), ("rej-old", "", False)]
    finally:
        fresh.close()
        ledger.close()


def test_a_session_reward_is_refused_when_its_last_interaction_was_rejected(ledger):
    ledger.submit(
        [
            row("turn-1", session_id="s", request_id="r1", consumed=True, created_at=1.0),
            row(
                "turn-2",
                session_id="s",
                request_id="r2",
                consumed=True,
                created_at=2.0,
                output_logprobs=[-1.0, float("nan"), -1.0, -1.0],
            ),
        ]
    )
    with pytest.raises(
        NotRewardable, match=r"the last interaction of session 's' \(trajectory 'turn-2'\) was rejected \(NONFINITE_LOGPROB\)"
    ):
        ledger.set_reward(0.5, session_id="s")


@pytest.mark.parametrize("by", ["session_id", "trajectory_id"])
def test_a_reward_for_a_row_that_settling_rejects_first_is_refused_and_recorded_nowhere(tmp_path, by):
    """The reward's own transaction settles what it folds before it looks the row up: a row whose group
    waited past group_timeout_s is INCOMPLETE_GROUP by then, so its reward is refused, not recorded."""
    import time

    from rollbook.config import ValidatorConfig

    led = Ledger(tmp_path / "l.duckdb", fold_interval_s=3600, validator_config=ValidatorConfig(group_timeout_s=0.05))
    led.register_model(MODEL, 100)
    led.publish_version(MODEL, 0, "c0")
    try:
        led.submit([row("alone", session_id="s", request_id="r1", group_id="g", group_size=2, reward=None)])
        time.sleep(0.2)  # past the group's timeout, still in the log (no background fold)
        with pytest.raises(NotRewardable, match=r"'alone'.* was rejected \(INCOMPLETE_GROUP\)"):
            led.set_reward(1.0, **{by: "s" if by == "session_id" else "alone"})
        cur = led.cursor()
        try:
            assert cur.execute("SELECT count(*) FROM rewards").fetchone() == (0,)
            assert cur.execute("SELECT reason FROM rejections WHERE trajectory_id = 'alone'").fetchall() == [
                ("INCOMPLETE_GROUP",)
            ]
        finally:
            cur.close()
    finally:
        led.close()


def test_registering_a_model_with_another_vocab_size_is_refused(ledger):
    ledger.register_model(MODEL, 100)  # the same again: nothing changes
    with pytest.raises(ModelConflict, match="'m' is registered with vocab_size 100, not 200"):
        ledger.register_model(MODEL, 200)
    assert ledger.model_entry(MODEL).vocab_size == 100


def test_empty_ids_are_each_rejected_and_never_deduplicated(ledger):
    out = ledger.submit([row(""), row("")])
    assert [(o.status, o.reason) for o in out] == [(REJECTED, "MISSING_ID")] * 2
    ledger.flush()
    assert ledger.stats()["rejected_by_reason"] == {"MISSING_ID": 2}


def test_concurrent_submits_of_the_same_ids_store_each_once(ledger):
    results: list[list[str]] = []
    barrier = threading.Barrier(4)

    def worker():
        barrier.wait()
        results.append([o.status for o in ledger.submit([row(f"t{i}") for i in range(50)])])

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    per_id = list(zip(*results))
    assert all(sorted(s) == [ACCEPTED, DUPLICATE, DUPLICATE, DUPLICATE] for s in per_id)
    assert ids(ledger) == sorted(f"t{i}" for i in range(50))


# ---- recovery --------------------------------------------------------------------------------

CRASHING_WRITER = textwrap.dedent("""
    import os, sys
    from rollbook.trajectories import trajectory_from_dict
    from rollbook.store.ledger import Ledger

    def row(tid, n=4):
        return trajectory_from_dict(dict(trajectory_id=tid, model_id="m", output_token_ids=list(range(n)),
            output_logprobs=[-1.0] * n, output_versions=[0] * n, temperature=1.0, top_p=1.0))

    ledger = Ledger(sys.argv[1], fold_interval_s=3600)
    ledger.register_model("m", 100)
    ledger.publish_version("m", 0, "c0")
    folded, unfolded = int(sys.argv[2]), int(sys.argv[3])
    for b in range(folded):
        ledger.submit([row(f"r{b:02d}-{i}") for i in range(10)])
    ledger.flush()
    for b in range(folded, folded + unfolded):
        ledger.submit([row(f"r{b:02d}-{i}") for i in range(10)] + [row(f"bad{b:02d}", n=0)])
    os._exit(0)  # acknowledged, never folded, never closed
""")


def crash_after(db: pathlib.Path, *, folded: int, unfolded: int) -> None:
    done = subprocess.run(
        [sys.executable, "-c", CRASHING_WRITER, str(db), str(folded), str(unfolded)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr


def table_counts(ledger: Ledger) -> tuple[int, int, int]:
    cur = ledger.cursor()
    try:
        return cur.execute(
            "SELECT (SELECT count(*) FROM trajectories), (SELECT count(DISTINCT trajectory_id) "
            "FROM trajectories), (SELECT count(*) FROM rejections)"
        ).fetchall()[0]
    finally:
        cur.close()


def test_recovery_replays_unfolded_log_batches_exactly_once(tmp_path):
    db = tmp_path / "l.duckdb"
    crash_after(db, folded=3, unfolded=4)
    root = db.with_name(db.name + ".log")
    # the log still holds all 7 groups: 3 already in DuckDB (past the watermark) and 4 only here
    assert sum(len(wal.read_segment(root, s)) for s in wal.list_segments(root)) == 7
    ledger = Ledger(db, fold_interval_s=3600)
    try:
        assert table_counts(ledger) == (70, 70, 4)
        assert ledger.registry.vocab_size(MODEL) == 100
        out = ledger.submit([row("r00-0"), row("r06-9"), row("bad06"), row("new")])
        assert [o.status for o in out] == [DUPLICATE, DUPLICATE, DUPLICATE, ACCEPTED]
    finally:
        ledger.close()
    ledger = Ledger(db, fold_interval_s=3600)  # a second open replays nothing again
    try:
        assert table_counts(ledger) == (71, 71, 4)
    finally:
        ledger.close()


def test_recovery_after_a_torn_tail_keeps_the_complete_batches_and_writes_a_new_segment(tmp_path):
    db = tmp_path / "l.duckdb"
    crash_after(db, folded=0, unfolded=3)
    root = db.with_name(db.name + ".log")
    [segment] = wal.list_segments(root)
    path = root / f"{segment:08d}.traj.arrow"
    os.truncate(path, path.stat().st_size - 10)  # the last group's batch is torn
    ledger = Ledger(db, fold_interval_s=3600)
    try:
        assert table_counts(ledger) == (20, 20, 2)
        # the torn group was never complete on disk, so its ids are free; they land in a new segment
        assert [o.status for o in ledger.submit([row("r02-0"), row("r00-0")])] == [ACCEPTED, DUPLICATE]
        assert ledger.wal.segment > segment
    finally:
        ledger.close()
    ledger = Ledger(db, fold_interval_s=3600)
    try:
        assert table_counts(ledger) == (21, 21, 2)
    finally:
        ledger.close()


def test_a_later_reward_replaces_the_earlier_one_until_a_trainer_leases_the_row(ledger):
    """Overwrite until leased: a second reward for a rewarded row whose group is ready (not yet
    served) replaces the first; once a trainer leased it, the reward can no longer change."""
    from rollbook.v1 import rollbook_pb2 as pb

    ledger.submit([row("t", reward=None, group_id="g", group_size=1)])
    ledger.set_reward(0.25, trajectory_id="t")
    ledger.flush()
    cur = ledger.cursor()
    assert cur.execute("SELECT status, reward FROM trajectories").fetchall() == [("ready", 0.25)]
    assert ledger.set_reward(1.0, trajectory_id="t") == "t"  # ready, not leased: replaced
    assert cur.execute("SELECT status, reward, original_reward FROM trajectories").fetchall() == [("ready", 1.0, 1.0)]
    assert [r for (r,) in cur.execute("SELECT reward FROM rewards ORDER BY set_at").fetchall()] == [0.25, 1.0]
    leased = ledger.pull_batch(
        pb.PullBatchRequest(model_id=MODEL, trainer_id="tr", num_samples=1, trainer_version=0, max_staleness=4)
    )
    assert leased.lease_id
    with pytest.raises(NotRewardable, match="already leased to a trainer"):
        ledger.set_reward(0.0, trajectory_id="t")
    cur.close()


def test_a_reward_that_completes_a_group_makes_it_ready_at_the_next_settle_not_in_its_own_call(tmp_path):
    """SetReward records the reward and leaves promotion to the next settle (one settle for many
    rewards): the folder settles within ``fold_interval_s``, and a flush (queries, stats) settles
    before it reads, with no pull."""
    import time

    def status(led: Ledger) -> list[tuple[str, str]]:
        cur = led.cursor()
        try:
            return cur.execute("SELECT trajectory_id, status FROM trajectories ORDER BY trajectory_id").fetchall()
        finally:
            cur.close()

    group = [row(t, reward=None, group_id="g", group_size=2) for t in ("a", "b")]
    slow = open_ledger(tmp_path / "slow.duckdb")  # no background folds or settles
    try:
        slow.submit(group)
        slow.flush()
        slow.set_reward(1.0, trajectory_id="a")
        slow.set_reward(0.0, trajectory_id="b")
        assert status(slow) == [("a", "pending"), ("b", "pending")]  # the calls did not settle
        slow.flush()
        assert status(slow) == [("a", "ready"), ("b", "ready")]
    finally:
        slow.close()

    fast = Ledger(tmp_path / "fast.duckdb", fold_interval_s=0.2)
    try:
        fast.register_model(MODEL, 100)
        fast.publish_version(MODEL, 0, "c0")
        fast.submit(group)
        fast.flush()
        fast.set_reward(1.0, trajectory_id="a")
        fast.set_reward(0.0, trajectory_id="b")
        deadline = time.monotonic() + 30
        while status(fast) != [("a", "ready"), ("b", "ready")] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert status(fast) == [("a", "ready"), ("b", "ready")]  # the folder settled, nothing else did
    finally:
        fast.close()


def test_an_empty_pull_asked_again_is_answered_again_until_anything_it_read_changes(ledger, monkeypatch):
    """A trainer waiting for rollout asks the same empty pull several times a second: while nothing
    changed the ledger gives the last empty answer without running the pull's statements again; a
    submit (folded or not), a reward, a governance write, another request, and a lease's expiry
    each end that, and the next pull serves what became ready."""
    import time

    from rollbook.store import ledger as ledger_module
    from rollbook.v1 import rollbook_pb2 as pb
    from rollbook.validator import pull

    runs: list[int] = []
    real = pull.lease_batch
    monkeypatch.setattr(pull, "lease_batch", lambda *a, **k: runs.append(1) or real(*a, **k))

    def ask(version: int = 0, **kw) -> pull.LeasedBatch:
        return ledger.pull_batch(
            pb.PullBatchRequest(model_id=MODEL, trainer_id="tr", num_samples=2, trainer_version=version, max_staleness=4, **kw)
        )

    first = ask()
    assert first.table.num_rows == 0 and len(runs) == 1
    again = ask()
    assert again.table.num_rows == 0 and not again.lease_id and len(runs) == 1  # answered again
    assert again.table.schema == first.table.schema and set(again.stats["events"].values()) == {0}
    ask(version=1)
    assert len(runs) == 2  # another request: pulled
    ask(version=1)
    assert len(runs) == 2

    ledger.submit([row("a", reward=1.0, group_id="g", group_size=2), row("b", reward=0.0, group_id="g", group_size=2)])
    served = ask(version=1)  # a submit not yet folded ends it
    assert len(runs) == 3 and served.table.num_rows == 2
    ask(version=1)
    assert len(runs) == 4  # a pull that served rows is never given again

    # a reward that completes a group (it settles later): the next pull settles and serves it
    ledger.submit([row("c", reward=None, group_id="h", group_size=1)])
    ledger.flush()
    assert ask(version=1).table.num_rows == 0
    ledger.set_reward(1.0, trajectory_id="c")
    assert ask(version=1).table.num_rows == 1

    # an open lease's expiry: the empty answer is given again only until then
    monkeypatch.setattr(ledger_module, "EMPTY_PULL_REUSE_S", 60.0)
    ledger.submit([row("d", reward=1.0, group_id="i", group_size=1)])
    short = ask(version=1, lease_seconds=1)
    assert short.table.num_rows == 1
    before = len(runs)
    assert ask(version=1).table.num_rows == 0
    deadline = time.monotonic() + 30
    while (back := ask(version=1)).table.num_rows == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert back.table.column("trajectory_id").to_pylist() == ["d"]  # its lease expired: served again
    assert len(runs) > before + 1

    # a write through the ledger's transaction (a governance hold, a reward version) ends it
    assert ask(version=1).table.num_rows == 0
    n = len(runs)
    ask(version=1)
    assert len(runs) == n
    with ledger.transaction() as con:
        con.execute("SELECT 1")
    ask(version=1)
    assert len(runs) == n + 1
