"""``rollbook run`` in online mode (docs/online.md "Online learning"): a real store process, the trainer
publishing over shared memory, a real ``rollbook proxy`` process following it, and the example agent
(examples/arithmetic_agent.py, the official ``openai`` client) as the load.

- ``test_online_run_trains_on_the_agents_sessions``: a short run trains only on what the agent's
  sessions produced through the proxy (every trained trajectory is a proxy turn of a rewarded
  session, under a version the trainer published) and writes the held-out agent evaluation.
- ``test_online_run_raises_the_agents_sampled_heldout_reward`` (slow): one short run of
  ``configs/smoke.toml`` in online mode (bench/learning.py's ``check-online``: string reversal, one
  try, from a student warm-started to greedy training accuracy 0.3; 16 steps, evaluated on every
  held-out reversal, 16 samples each) raises the agent's sampled
  held-out reward (its expected reward, the same random numbers at every evaluation) by more than
  the checks' margin, as tests/integration/test_learning.py holds for the rollout worker. The
  claim over seeds (60 steps, 200 held-out problems) is bench/learning.py's ``online`` case.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import duckdb
import pytest

from tests.integration.learning_check import check_heldout_rises

pytest.importorskip("fastapi")
pytest.importorskip("openai")

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(run_dir: pathlib.Path, seed: int, *overrides: str, timeout: float = 1500) -> list[dict]:
    cmd = [
        sys.executable,
        "-m",
        "rollbook.cli",
        "run",
        "--config",
        "configs/online.toml",
        "--run_dir",
        str(run_dir),
        "--warm_start.seed",
        str(seed),
        "--trainer.model.seed",
        str(seed),
        "--rollout.seed",
        str(seed),
        *overrides,
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_online_run_trains_on_the_agents_sessions(tmp_path):
    run_dir = tmp_path / "online"
    metrics = _run(
        run_dir,
        0,
        "--num_steps",
        "3",
        "--eval_every",
        "3",
        "--online.eval_samples",
        "1",
        "--online.num_eval_problems",
        "5",
        "--trainer.num_samples",  # a step's batch: four groups of four sessions (turn 0 and turn 1 rows)
        "16",
        "--warm_start.student_steps",  # what it trains on, not how well: a short warm start
        "20",
        timeout=900,
    )
    evals = [m for m in metrics if "eval/sampled_reward" in m]
    assert [m["step"] for m in evals] == [0, 2], metrics  # before the first step and after the last
    assert all(0.0 <= m["eval/reward"] <= 1.0 and "eval/turn1" in m for m in evals)
    con = duckdb.connect(str(run_dir / "rollbook.duckdb"), read_only=True)
    try:
        trained = con.execute(
            "SELECT t.worker_id, t.session_id, split_part(t.request_id, '.', 1) AS turn, t.group_id, t.consumed, "
            "t.original_reward, t.output_versions, (SELECT max(version) FROM policy_versions) AS published "
            "FROM leases l JOIN trajectories t USING (trajectory_id) WHERE l.acked_at IS NOT NULL"
        ).fetchall()
        steps = con.execute("SELECT count(*) FROM train_steps").fetchone()
    finally:
        con.close()
    assert steps == (3,)
    assert len(trained) >= 3 * 16, len(trained)  # at least a batch of 16 rows (groups of four sessions) per step
    for worker, session, turn, group, consumed, reward, versions, published in trained:
        assert worker == "proxy" and session.startswith("s-") and turn in ("turn-0", "turn-1"), (worker, session, turn)
        assert group.startswith("agent-0-") and group.endswith("/" + turn) and consumed
        assert reward in (0.0, 1.0)  # the agent's own check, through the proxy's reward call
        assert versions and 0 <= min(versions) and max(versions) <= published


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a warm start to 0.3, then 16 steps; a loaded machine takes it past 600 s
def test_online_run_raises_the_agents_sampled_heldout_reward(tmp_path):
    check_heldout_rises("check-online", tmp_path / "online")
