"""A kill -9 of the trainer neither loses nor double-trains a batch.

A real ``rollbook serve`` store holds 40 rewarded groups of four (version 0). ``rollbook train``
runs as its own process (10 steps of 16 samples, 3 s leases) and is SIGKILLed after three steps,
preferably between a pull and its report (a batch leased, not checkpointed); once that lease has
expired the same command is started again. It
must resume from its checkpoint (its log says so) and finish. Then the ledger must show:

- ``train_steps`` has steps 0..9 exactly once, each with an acked lease of 16 rows; the steps before
  the resume point are the first process's, untouched;
- every trajectory has exactly one acked lease (160 rows, 10 x 16: none lost, none trained twice);
- rows the killed trainer leased and did not checkpoint came back and were trained under a later lease.

Run: python -m pytest tests/integration/test_trainer_crash.py -q   (about 40 s; two trainer starts)
"""

from __future__ import annotations

import pathlib
import random
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.integration.procs import AUDIT, ServeProcess, child_env, rows, trajectory

MODEL = "crash-model"
VOCAB = 64
NUM_GROUPS, GROUP_SIZE = 40, 4
NUM_STEPS, NUM_SAMPLES = 10, 16


def workload(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for g in range(NUM_GROUPS):
        for i in range(GROUP_SIZE):
            n = rng.randint(8, 24)
            out.append(
                trajectory(
                    f"c{g:02d}-{i}",
                    model_id=MODEL,
                    n=n,
                    group_id=f"grp-{g:02d}",
                    group_size=GROUP_SIZE,
                    task_id=f"task-{g}",
                    reward=float(rng.random() < 0.5),
                    prompt_token_ids=[rng.randrange(VOCAB) for _ in range(rng.randint(3, 10))],
                    output_token_ids=[rng.randrange(VOCAB) for _ in range(n)],
                    output_logprobs=[-rng.uniform(0.05, 6.0) for _ in range(n)],
                )
            )
    return out


def start_trainer(address: str, run_dir: pathlib.Path, log: pathlib.Path) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "rollbook.cli",
        "train",
        "--server",
        address,
        "--run_dir",
        str(run_dir),
        "--model_id",
        MODEL,
        "--model.vocab_size",
        str(VOCAB),
        "--num_steps",
        str(NUM_STEPS),
        "--num_samples",
        str(NUM_SAMPLES),
        "--lease_seconds",
        "3",
        "--max_staleness",
        "100",
        "--log-level",
        "INFO",
    ]
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=child_env())


def count(client, sql: str) -> int:
    return rows(client, sql)[0]["n"]


@pytest.fixture
def store(tmp_path):
    proc = ServeProcess(tmp_path / "rollbook.duckdb")
    client = proc.client()
    client.register_model(MODEL, vocab_size=VOCAB)
    client.publish_version(MODEL, 0)
    yield client
    client.close()
    proc.stop()


# a lease the trainer pulled but has not reported yet: it cannot be checkpointed (report comes first)
UNREPORTED = """SELECT l.lease_id FROM leases l WHERE l.acked_at IS NULL
                AND l.lease_id NOT IN (SELECT lease_id FROM train_steps) LIMIT 1"""


def reported_steps(log: pathlib.Path) -> int:
    """Steps the trainer's log says are done (``step N  reward ...``, written after the step's report)."""
    return len(re.findall(r"rollbook\.trainer: step \d+ ", log.read_text(errors="replace")))


def frozen(pid: int) -> bool:
    """The process is stopped (``T`` in /proc/PID/stat) by a SIGSTOP."""
    stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2] in "tT"


def kill_mid_run(client, trainer: subprocess.Popen, log: pathlib.Path, timeout_s: float = 240.0) -> str | None:
    """SIGKILL once three steps are reported, preferably while the trainer holds a lease it has not
    reported (so not checkpointed) yet. Returns that lease.

    The trainer is frozen (SIGSTOP) while the ledger is looked at, so what the query sees is still
    true when the kill lands, and the trainer cannot finish its remaining steps during a slow query
    (it trains ten steps in under two seconds on a fast machine: a CI run once saw it exit before
    the kill). Between looks it runs for a few milliseconds; after 50 looks without an unreported
    lease it is killed anyway."""
    deadline = time.monotonic() + timeout_s
    rng = random.Random(0)
    polls = 0
    while time.monotonic() < deadline:
        assert trainer.poll() is None, f"trainer exited ({trainer.returncode}) before the kill:\n{log.read_text()}"
        if reported_steps(log) < 3:
            time.sleep(0.01)
            continue
        trainer.send_signal(signal.SIGSTOP)
        try:
            while not frozen(trainer.pid):
                time.sleep(0.001)
            assert count(client, "SELECT count(*) AS n FROM train_steps") >= 3
            found = rows(client, UNREPORTED)
        except BaseException:
            trainer.kill()  # never leave a stopped trainer behind a failed test
            raise
        polls += 1
        if found or polls > 50:
            trainer.send_signal(signal.SIGKILL)  # a stopped process dies of SIGKILL as it is
            trainer.wait(timeout=30)
            return found[0]["lease_id"] if found else None
        trainer.send_signal(signal.SIGCONT)
        time.sleep(rng.uniform(0.002, 0.03))
    trainer.kill()
    raise AssertionError(f"trainer reported no 3 steps in {timeout_s} s:\n{log.read_text()}")


def test_trainer_killed_mid_run_resumes_without_losing_or_repeating_a_batch(store, tmp_path):
    client = store
    result = client.submit(workload())
    assert result.accepted == NUM_GROUPS * GROUP_SIZE
    run_dir = tmp_path / "run"
    first_log, second_log = tmp_path / "train-1.log", tmp_path / "train-2.log"

    address = client.address
    in_flight = kill_mid_run(client, start_trainer(address, run_dir, first_log), first_log)
    before = {r["step"]: r for r in rows(client, "SELECT step, lease_id, started_at FROM train_steps")}
    open_at_kill = rows(client, "SELECT lease_id, trajectory_id, expires_at FROM leases WHERE acked_at IS NULL")
    # the second trainer pulls only after the dead one's lease expired
    time.sleep(max([r["expires_at"] - time.time() for r in open_at_kill] + [0.0]) + 0.2)

    second = start_trainer(address, run_dir, second_log)
    try:
        assert second.wait(timeout=240) == 0, second_log.read_text()
    finally:
        if second.poll() is None:
            second.kill()
    text = second_log.read_text()
    assert "resumed at step" in text, text
    resumed_at = int(text.split("resumed at step")[1].split(",")[0])
    # the checkpoint holds every reported step, or all but the last (killed between report and checkpoint)
    assert resumed_at in (len(before) - 1, len(before)), (resumed_at, sorted(before))

    # one query over train_steps and leases: each step once, with an acked lease of a full batch
    steps = rows(
        client,
        """
        SELECT s.step, s.lease_id, s.started_at, count(l.trajectory_id) AS leased_rows, count(l.acked_at) AS acked_rows
        FROM train_steps s LEFT JOIN leases l USING (lease_id) GROUP BY ALL ORDER BY s.step""",
    )
    assert [s["step"] for s in steps] == list(range(NUM_STEPS))
    assert all(s["leased_rows"] == NUM_SAMPLES and s["acked_rows"] == NUM_SAMPLES for s in steps), steps
    for s in steps[:resumed_at]:  # checkpointed before the kill: not trained again
        assert (s["lease_id"], s["started_at"]) == (before[s["step"]]["lease_id"], before[s["step"]]["started_at"])
    if resumed_at in before:  # reported, not checkpointed: trained again on another lease, row replaced
        assert steps[resumed_at]["lease_id"] != before[resumed_at]["lease_id"]

    # the ledger's verdict in one query over leases and train_steps: nothing lost, nothing twice
    assert rows(client, AUDIT) == [
        {
            "trajectories": NUM_GROUPS * GROUP_SIZE,
            "acked_once": NUM_GROUPS * GROUP_SIZE,
            "acked_twice": 0,
            "acked_outside_steps": 0,
            "steps": list(range(NUM_STEPS)),
            "steps_without_acked_lease": 0,
        }
    ]
    assert count(client, "SELECT count(*) AS n FROM rejections") == 0

    # leases the killed trainer held but never checkpointed: never acked, rows trained later
    lost = rows(
        client,
        """
        SELECT d.lease_id, d.trajectory_id, count(a.lease_id) AS later_acked
        FROM leases d LEFT JOIN leases a ON a.trajectory_id = d.trajectory_id AND a.acked_at IS NOT NULL
                                        AND a.issued_at > d.issued_at
        WHERE d.acked_at IS NULL GROUP BY ALL""",
    )
    assert all(r["later_acked"] == 1 for r in lost), lost
    unacked_at_kill = {r["lease_id"] for r in open_at_kill}
    assert {r["lease_id"] for r in lost} <= unacked_at_kill
    if in_flight and in_flight not in {b["lease_id"] for b in before.values()}:
        # killed between pull and report: that batch was never checkpointed, so it must have come back
        assert {r["trajectory_id"] for r in lost if r["lease_id"] == in_flight} == {
            r["trajectory_id"] for r in open_at_kill if r["lease_id"] == in_flight
        }
        assert sum(r["lease_id"] == in_flight for r in lost) == NUM_SAMPLES
    print(
        f"killed with {len(unacked_at_kill)} open lease(s); {len(lost)} row(s) returned and retrained; "
        f"resumed at step {resumed_at}"
    )
    assert count(client, f"SELECT max(version) AS n FROM policy_versions WHERE model_id = '{MODEL}'") == NUM_STEPS
