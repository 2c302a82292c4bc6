"""``rollbook replay step`` on a real run: a short colocated ``rollbook run`` (real store process, DuckDB
ledger, native engine, PyTorch training on the CPU, two minibatches of packed micro-batches per step,
a checkpoint after every step), then the command, as a user runs it, on three of its steps: each
must give back the recorded loss, gradient norm, every parameter and the AdamW state, bit for bit.
A copy of the ledger with one stored behaviour log-prob of one trained row changed must be reported
as differing (exit 1, the quantities named); a step with no checkpoint before it, or none recorded,
is refused with the replayable steps (exit 2).

The workload is string reversal with a per-character reward on strings of one or two letters, from
a student with no warm start: cheap, and its groups score apart often enough that every step has
non-zero advantages (a step whose advantages are all 0 would train on weight decay alone).

Run: python -m pytest tests/integration/test_replay_step.py -q
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import duckdb
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
NUM_STEPS = 4
REPLAYED = (0, 1, 3)  # from the initial model, from a checkpoint, and the last step
TAMPERED = 1  # one of them: its own ledger replays it bit for bit
MISSING = 2  # the checkpoint removed in a copy of the run


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ROLLBOOK_")}
    return subprocess.run(
        [sys.executable, "-m", "rollbook.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=clean
    )


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> pathlib.Path:
    run = tmp_path_factory.mktemp("replay-step") / "run"
    done = cli(
        *("run", "--config", "configs/smoke.toml", "--run_dir", str(run), "--num_steps", str(NUM_STEPS)),
        *("--eval_every", "100", "--warm_start.student_steps", "0"),
        *("--rollout.num_eval_tasks", "2", "--rollout.num_eval_samples", "0"),
        *("--rollout.domains", '["reverse"]', "--rollout.reverse_per_char", "true", "--rollout.reverse_max_len", "2"),
        *("--rollout.max_new_tokens", "2", "--rollout.group_size", "4", "--rollout.num_prompts", "8"),
        *("--trainer.num_samples", "32", "--trainer.model.hidden_size", "64", "--trainer.model.intermediate_size", "128"),
        *("--trainer.num_minibatches", "2", "--trainer.micro_batch_tokens", "64"),
        *("--trainer.checkpoint_every", "1", "--trainer.keep_last", "100"),
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return run


def ledger(db: pathlib.Path, sql: str, params: list | None = None) -> list[tuple]:
    con = duckdb.connect(str(db), read_only=True)
    try:
        return con.execute(sql, params or []).fetchall()
    finally:
        con.close()


def replay(step: int, run: pathlib.Path, *extra: str) -> subprocess.CompletedProcess:
    return cli("replay", "step", str(step), "--run", str(run), *extra)


def test_three_steps_replay_bit_for_bit(run_dir):
    db = run_dir / "rollbook.duckdb"
    for step in REPLAYED:
        done = replay(step, run_dir, "--json")
        assert done.returncode == 0, done.stdout + done.stderr[-3000:]
        result = json.loads(done.stdout)
        compared = {c["name"].split(" (")[0]: c for c in result["compared"]}
        assert set(compared) == {
            "loss/total",
            "grad/norm",
            "optim/lr",
            f"parameters vs checkpoint step-{step + 1:06d}",
            f"AdamW state vs checkpoint step-{step + 1:06d}",
        }
        assert result["equal"] and all(c["equal"] for c in result["compared"]) and result["first_difference"] is None
        # the recorded values, exactly: a step with a gradient, from its lease's rows in served order
        (stats,) = ledger(db, "SELECT stats FROM train_steps WHERE step = ?", [step])[0]
        stats = json.loads(stats)
        assert compared["loss/total"]["replayed"] == stats["loss/total"]
        assert compared["grad/norm"]["replayed"] == stats["grad/norm"] > 0
        assert result["rows"] == 32 and result["torch_threads"] == stats["perf/torch_threads"]
        positions = ledger(db, "SELECT list(position ORDER BY position) FROM leases WHERE lease_id = ?", [result["lease_id"]])
        assert positions == [(list(range(32)),)]
        initial = "the initial model (built as the run built it, a fresh AdamW)"
        assert result["checkpoint_before"] == (initial if step == 0 else f"checkpoint step-{step:06d}")


def test_a_changed_behaviour_logprob_is_reported_as_a_difference(run_dir, tmp_path):
    copy = tmp_path / "tampered.duckdb"
    shutil.copyfile(run_dir / "rollbook.duckdb", copy)
    con = duckdb.connect(str(copy))
    try:
        # a row the step trained with a non-zero advantage, its first behaviour log-prob lowered by 0.25
        (tid, advantage, before), *_ = con.execute(
            """SELECT l.trajectory_id, l.advantage, t.output_logprobs[1] FROM leases l JOIN train_steps s USING (lease_id)
               JOIN trajectories t USING (trajectory_id) WHERE s.step = ? ORDER BY abs(l.advantage) DESC, l.position""",
            [TAMPERED],
        ).fetchall()
        assert advantage != 0, "the step has no row with an advantage: a changed log-prob would not change it"
        con.execute(
            "UPDATE trajectories SET output_logprobs = list_concat([(output_logprobs[1] - 0.25)::FLOAT], output_logprobs[2:]) "
            "WHERE trajectory_id = ?",
            [tid],
        )
        assert con.execute("SELECT output_logprobs[1] FROM trajectories WHERE trajectory_id = ?", [tid]).fetchone() != (before,)
    finally:
        con.close()
    done = replay(TAMPERED, run_dir, "--db", str(copy))
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    differs = next(line for line in lines if line.startswith("DIFFERS: "))
    for name in ("loss/total", "grad/norm", f"parameters vs checkpoint step-{TAMPERED + 1:06d}"):
        assert name in differs
    assert "optim/lr" not in differs  # the schedule is not the rows'
    assert any(line.startswith("first differing parameter: model.") and "max |difference|" in line for line in lines)


def test_a_step_without_the_checkpoint_before_it_is_refused_with_the_replayable_steps(run_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run, ignore=shutil.ignore_patterns(f"step-{MISSING:06d}", "hf", "spool*"))
    done = replay(MISSING, run)
    assert done.returncode == 2
    assert f"no checkpoint holds the state before step {MISSING}" in done.stderr
    assert "replayable steps are 0-1, 3" in done.stderr and "trainer.checkpoint_every = 1" in done.stderr
    done = replay(99, run)
    assert done.returncode == 2 and "no step 99 in train_steps" in done.stderr and "0-3 recorded" in done.stderr
    # the step before the missing checkpoint replays; its parameters have nothing to be compared with
    done = replay(MISSING - 1, run)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "the parameters were not compared" in done.stdout
