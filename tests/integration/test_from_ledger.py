"""Training a new policy from a finished run's ledger, as a user runs it: a short real ``rollbook run``
of configs/smoke.toml (the source: store process, rollouts, three trainer steps), a named reward
version made on it by ``rollbook replay reward`` with a test module's reward, then ``rollbook run
--replay.ledger SOURCE`` twice into new run directories:

- on a ``--replay.where`` with a subquery on ``leases``, two epochs: every seeded row is leased once
  and acked in the new ledger, epoch 1 under the source's ids and epoch 2 under ``<id>@2``, each row's
  tokens, behavior log-probs, source versions and original reward as stored; the run stops with its
  line when the rows are used up, with its own train steps, versions and held-out evaluations; the
  source's files are byte for byte as they were;
- on the reward version ``length`` (tests/rescore_rewards.py ``answer_length``, made for the
  ``arithmetic`` rows only) under ``group_mean`` normalization: only the groups it scores whole are
  seeded, and every served reward is the version's minus its group's mean, not the original's;
- on a source its store still holds: refused in one line, no ledger made.

Run: ``python -m pytest tests/integration/test_from_ledger.py -q``.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SMALL = (
    "--config",
    "configs/smoke.toml",
    "--warm_start.student_steps",
    "20",
    "--rollout.num_eval_tasks",
    "4",
    "--rollout.num_eval_samples",
    "0",
)


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``rollbook ARGS`` from the repository root (the reward pool imports ``tests.*``), with no
    ROLLBOOK_* setting of the caller's."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ROLLBOOK_")}
    return subprocess.run(
        [sys.executable, "-m", "rollbook.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=clean
    )


def sql(db: pathlib.Path, query: str) -> list[dict]:
    done = cli("query", "--db", str(db), "--format", "json", query, timeout=120)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def fingerprint(folder: pathlib.Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()
    }


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> pathlib.Path:
    """A finished 3-step run with reward version ``length`` of its arithmetic rows."""
    run_dir = tmp_path_factory.mktemp("from-ledger") / "source"
    done = cli("run", *SMALL, "--run_dir", str(run_dir), "--num_steps", "3", "--eval_every", "100", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    db = run_dir / "rollbook.duckdb"
    done = cli(
        "replay",
        "reward",
        "--db",
        str(db),
        "--reward",
        "tests.rescore_rewards:answer_length",
        "--name",
        "length",
        "--where",
        "domain = 'arithmetic'",
        "--workers",
        "0",
    )
    assert done.returncode == 0, done.stderr
    return run_dir


def replay_run(source: pathlib.Path, run_dir: pathlib.Path, *flags: str) -> subprocess.CompletedProcess:
    before = fingerprint(source)
    done = cli(
        "run", *SMALL, "--run_dir", str(run_dir), "--replay.ledger", str(source / "rollbook.duckdb"), "--eval_every", "2", *flags
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert fingerprint(source) == before  # the source's ledger, log, checkpoints: only read
    return done


STORED = "trajectory_id, group_id, prompt_token_ids, output_token_ids, output_logprobs, output_versions, original_reward"


def test_a_new_run_trains_every_selected_row_once_per_epoch_with_its_own_lineage(source, tmp_path):
    run_dir = tmp_path / "replay"
    where = "trajectory_id IN (SELECT trajectory_id FROM leases WHERE step < 2)"
    done = replay_run(source, run_dir, "--replay.where", where, "--replay.epochs", "2", "--num_steps", "10")
    assert "replay: seeded 16 groups, 128 rows x 2 epoch(s) = 256 rows" in done.stdout
    assert "the ledger's 256 seeded rows are trained at step 4: stopping" in done.stdout
    new = run_dir / "rollbook.duckdb"

    picked = {r["trajectory_id"]: r for r in sql(source / "rollbook.duckdb", f"SELECT {STORED} FROM trajectories WHERE {where}")}
    assert len(picked) == 128
    rows = sql(new, f"SELECT {STORED}, model_id, status FROM trajectories")
    assert len(rows) == 256 and {(r["model_id"], r["status"]) for r in rows} == {("tiny", "trained")}
    by_id = {r.pop("trajectory_id"): r for r in rows}
    for tid, stored in picked.items():
        for epoch, suffix in ((1, ""), (2, "@2")):
            row = dict(by_id[tid + suffix])
            assert row.pop("group_id") == stored["group_id"] + suffix, (tid, epoch)
            row.pop("model_id"), row.pop("status")
            assert row == {k: v for k, v in stored.items() if k not in ("trajectory_id", "group_id")}, (tid, epoch)

    leases = sql(new, "SELECT trajectory_id, step, acked_at FROM leases")
    assert sorted(r["trajectory_id"] for r in leases) == sorted(by_id)  # each row leased once
    assert all(r["acked_at"] is not None for r in leases)
    steps = {r["step"] for r in leases}
    assert steps == {0, 1, 2, 3}
    epoch_of_step = {r["step"]: r["trajectory_id"].endswith("@2") for r in leases}
    assert [epoch_of_step[s] for s in sorted(steps)] == [False, False, True, True]  # epoch 1 first, then epoch 2
    assert sql(new, "SELECT count(*) AS n FROM train_steps") == [{"n": 4}]
    assert sql(new, "SELECT max(version) AS v FROM policy_versions") == [{"v": 4}]
    assert sql(new, "SELECT count(*) AS n FROM rejections") == [{"n": 0}]

    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "eval/reward" in m] == [0, 1, 3]  # before, after step 1, after the last (3)
    assert len([m for m in metrics if "loss/total" in m]) == 4


def test_a_run_on_a_reward_version_is_served_the_versions_rewards(source, tmp_path):
    run_dir = tmp_path / "on-version"
    done = replay_run(
        source, run_dir, "--replay.reward_version", "length", "--store.validator.norm.mode", "group_mean", "--num_steps", "20"
    )
    seeded = json.loads((run_dir / "replay.json").read_text())["seeded"]
    # the version scored only arithmetic: the reverse groups have no score in it and stay out
    [reverse] = sql(source / "rollbook.duckdb", "SELECT count(DISTINCT group_id) AS n FROM trajectories WHERE domain = 'reverse'")
    assert seeded["domains"] == {"arithmetic": seeded["rows"]} and seeded["unrewarded_groups"] == reverse["n"] > 0
    assert f"the ledger's {seeded['rows']} seeded rows are trained" in done.stdout

    new = run_dir / "rollbook.duckdb"
    rows = sql(
        new,
        "SELECT t.group_id, t.status, t.original_reward, t.reward AS served, v.reward AS version "
        "FROM trajectories t JOIN reward_versions v USING (trajectory_id) WHERE v.name = 'length'",
    )
    assert len(rows) == seeded["rows"] and {r["status"] for r in rows} == {"trained"}
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["group_id"], []).append(r)
    moved = False
    for members in groups.values():  # group_mean: each reward minus its group's mean, from the version
        version_mean = sum(m["version"] for m in members) / len(members)
        original_mean = sum(m["original_reward"] for m in members) / len(members)
        for m in members:
            assert m["served"] == pytest.approx(m["version"] - version_mean, abs=1e-9)
            moved |= abs(m["served"] - (m["original_reward"] - original_mean)) > 1e-3
    assert moved  # original_reward would have been served otherwise
    [copied] = sql(new, "SELECT reward, predicate, selected, scored, errors FROM reward_version_runs WHERE name = 'length'")
    assert copied == {
        "reward": "tests.rescore_rewards:answer_length",
        "predicate": "domain = 'arithmetic'",
        "selected": seeded["rows"],
        "scored": seeded["rows"],
        "errors": 0,
    }


def test_a_source_its_store_still_holds_is_refused_in_one_line(source, tmp_path):
    from rollbook.run.store_process import StoreProcess

    held = tmp_path / "held"
    held.mkdir()
    shutil.copyfile(source / "rollbook.duckdb", held / "rollbook.duckdb")
    store = StoreProcess(held / "rollbook.duckdb")
    try:
        done = cli("run", *SMALL, "--run_dir", str(tmp_path / "new"), "--replay.ledger", str(held / "rollbook.duckdb"))
    finally:
        store.stop()
    assert done.returncode == 1
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"rollbook run: error: replay.ledger {held / 'rollbook.duckdb'} cannot be read (")
    assert line.endswith("if a store holds it, stop it first")
    assert not (tmp_path / "new" / "rollbook.duckdb").exists()
