"""An online, agent-style workload through a real ``rollbook serve`` process.

Fifty agent sessions, each one logical LLM call whose SDK timed out and retried: two or three
attempts share a ``request_id`` and exactly one is ``consumed`` (not always the latest). Attempts
arrive shuffled, from three concurrent clients; a few timed-out attempts are reported only after
the rewards. Rewards arrive afterwards through ``SetReward`` by ``session_id`` (the session's last
interaction). Most sessions are grouped four to a prompt; ten are singletons (``group_size`` 1, or an
empty ``group_id``).

What the trainer is served (``PullBatch``) must be exactly the consumed completions, each once, with
the rewards that were set as ``original_reward``; every other attempt must be in ``rejections`` as
``RETRY_ORPHAN``, and nothing else may be there.

Run: python -m pytest tests/integration/test_online_sessions.py -q   (about 10 s)
"""

from __future__ import annotations

import random
import threading
import time

import pytest

from rollbook.v1 import rollbook_pb2 as pb
from tests.integration.procs import ServeProcess, rows, trajectory

MODEL = "online-model"
NUM_SESSIONS = 50


@pytest.fixture
def store(tmp_path):
    proc = ServeProcess(tmp_path / "rollbook.duckdb")
    client = proc.client()
    client.register_model(MODEL, vocab_size=64)
    client.publish_version(MODEL, 0)
    yield proc
    client.close()
    proc.stop()


def make_sessions(seed: int = 0) -> tuple[list[dict], dict[str, str], dict[str, float]]:
    """(every attempt, consumed trajectory id by session, the reward each session will get)."""
    rng = random.Random(seed)
    attempts, consumed, rewards = [], {}, {}
    t0 = time.time()
    for i in range(NUM_SESSIONS):
        session = f"sess-{i}"
        if i < 40:
            group = {"group_id": f"prompt-{i // 4}", "group_size": 4, "task_id": f"task-{i // 4}"}
        elif i < 45:
            group = {"group_id": f"solo-{i}", "group_size": 1, "task_id": f"task-{i}"}
        else:
            group = {"group_id": "", "group_size": 0, "task_id": f"task-{i}"}
        num_attempts = rng.choice([2, 3])
        kept = rng.randrange(num_attempts)  # the caller used this one; a later retry may also have landed
        for k in range(num_attempts):
            tid = f"{session}-a{k}"
            n = rng.randint(3, 12)
            attempts.append(
                trajectory(
                    tid,
                    model_id=MODEL,
                    n=n,
                    reward=None,
                    session_id=session,
                    request_id=f"{session}-call",
                    attempt=k,
                    consumed=(k == kept),
                    created_at=t0 + i + 0.5 * k,
                    output_token_ids=[rng.randrange(64) for _ in range(n)],
                    output_logprobs=[-rng.uniform(0.01, 5.0) for _ in range(n)],
                    **group,
                )
            )
            if k == kept:
                consumed[session] = tid
        rewards[session] = round(rng.uniform(-1.0, 1.0), 4)
    return attempts, consumed, rewards


def submit_concurrently(proc: ServeProcess, items: list[dict], num_clients: int = 3) -> dict[str, pb.Verdict]:
    verdicts: dict[str, pb.Verdict] = {}
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker(part: list[dict]) -> None:
        try:
            with proc.client() as client:
                for start in range(0, len(part), 7):  # small batches, like an SDK flushing often
                    result = client.submit(part[start : start + 7])
                    with lock:
                        verdicts.update(result.verdicts)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(items[c::num_clients],)) for c in range(num_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return verdicts


def test_served_rows_are_exactly_the_consumed_completions_with_their_session_rewards(store):
    attempts, consumed, rewards = make_sessions()
    rng = random.Random(1)
    rng.shuffle(attempts)
    # a few timed-out attempts are reported late, after the rewards
    late = [t for t in attempts if not t["consumed"]][:8]
    early = [t for t in attempts if t not in late]

    verdicts = submit_concurrently(store, early)
    assert len(verdicts) == len(early)
    assert {v.status for v in verdicts.values()} == {pb.Verdict.ACCEPTED}

    client = store.client()
    for session in rng.sample(sorted(rewards), len(rewards)):
        rewarded = client.set_reward(rewards[session], session_id=session)
        assert rewarded == consumed[session], f"{session}: reward went to {rewarded}"
    late_verdicts = client.submit(late).verdicts
    assert {v.status for v in late_verdicts.values()} == {pb.Verdict.ACCEPTED}

    served: dict[str, dict] = {}
    for step in range(20):
        batch = client.pull_batch(
            trainer_id="online", trainer_version=0, max_staleness=4, num_samples=16, step=step, model_id=MODEL, lease_seconds=60
        )
        if batch.num_rows == 0:
            break
        for row in batch.table.to_pylist():
            assert row["trajectory_id"] not in served, "served twice"
            served[row["trajectory_id"]] = row
        assert client.ack_batch(batch.lease_id, "online") == batch.num_rows
    assert batch.num_rows == 0

    by_tid = {tid: session for session, tid in consumed.items()}
    assert set(served) == set(consumed.values())
    assert {tid: row["original_reward"] for tid, row in served.items()} == {
        tid: rewards[session] for tid, session in by_tid.items()
    }
    for tid, row in served.items():  # singletons keep their raw reward (singleton_policy keep_raw)
        if int(by_tid[tid].split("-")[1]) >= 40:
            assert row["reward"] == row["original_reward"]
    for g in range(10):  # each full group of four is centered on its own mean
        members = [row["reward"] for row in served.values() if row["group_id"] == f"prompt-{g}"]
        assert len(members) == 4 and abs(sum(members)) < 1e-6

    orphans = {t["trajectory_id"] for t in attempts if not t["consumed"]}
    rejected = rows(client, "SELECT trajectory_id, reason, stage FROM rejections")
    assert {r["trajectory_id"] for r in rejected} == orphans
    assert len(rejected) == len(orphans)
    assert {(r["reason"], r["stage"]) for r in rejected} == {("RETRY_ORPHAN", "group")}
    # the ledger agrees: every consumed completion trained exactly once, under an acked lease
    trained = rows(
        client,
        """
        SELECT t.trajectory_id, t.session_id, t.original_reward, count(l.acked_at) AS acked
        FROM trajectories t LEFT JOIN leases l USING (trajectory_id) GROUP BY ALL""",
    )
    assert {r["trajectory_id"] for r in trained} == set(consumed.values())
    assert all(r["acked"] == 1 and r["original_reward"] == rewards[r["session_id"]] for r in trained)
    assert rows(client, "SELECT count(*) AS n, count(DISTINCT trajectory_id) AS d FROM rewards WHERE source = 'session'") == [
        {"n": NUM_SESSIONS, "d": NUM_SESSIONS}
    ]
    client.close()
