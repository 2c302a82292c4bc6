"""``rollbook replay reward`` on a real run: a short ``rollbook run`` of configs/smoke.toml (a real
store process, rollouts, two trainer steps), re-scored by the command as a user runs it with a
``module:function`` reward from a test module (tests/rescore_rewards.py) in the reward pool; checked
through ``rollbook query --db`` that ``original_reward`` and every other row are untouched and each
selected row is scored once; a kill -9 mid-way (``ROLLBOOK_REPLAY_CRASH_AFTER``) followed by the same
command, which resumes; a ``--where`` with a subquery on ``leases``; the new tables through a running
store's SQL endpoint, and the command refused while that store holds the ledger.

Run: ``python -m pytest tests/integration/test_rescore.py -q``.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import pytest

from rollbook.run.store_process import StoreProcess
from rollbook.tasks import TOKENIZER

ROOT = pathlib.Path(__file__).resolve().parents[2]
REWARD = "tests.rescore_rewards:answer_length"


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``rollbook ARGS`` from the repository root (so the pool's processes import ``tests.*``), with no
    ROLLBOOK_* setting of the caller's."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ROLLBOOK_")}
    return subprocess.run(
        [sys.executable, "-m", "rollbook.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**clean, **(env or {})},
    )


def sql(db: pathlib.Path, query: str) -> list[dict]:
    done = cli("query", "--db", str(db), "--format", "json", query, timeout=120)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> pathlib.Path:
    run_dir = tmp_path_factory.mktemp("rescore") / "run"
    done = cli(
        "run",
        "--config",
        "configs/smoke.toml",
        "--run_dir",
        str(run_dir),
        "--num_steps",
        "2",
        "--eval_every",
        "100",
        "--warm_start.student_steps",
        "20",
        "--rollout.num_eval_tasks",
        "4",
        "--rollout.num_eval_samples",
        "0",
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return run_dir


@pytest.fixture
def db(finished_run, tmp_path) -> pathlib.Path:
    """A copy of the finished run's directory's ledger and config, one per test."""
    run = tmp_path / "run"
    run.mkdir()
    for name in ("rollbook.duckdb", "config.json"):
        shutil.copyfile(finished_run / name, run / name)
    return run / "rollbook.duckdb"


def expected_scores(db: pathlib.Path) -> dict[str, float]:
    """What ``answer_length`` gives each stored output, computed here from the ids and the run's verdict:
    the completion's length (the character tokenizer's text up to the first eos), 1000 more when the
    toy verifier rewarded it 1.0 (an exact match: its answer)."""
    rows = sql(db, "SELECT trajectory_id, output_token_ids, original_reward FROM trajectories")
    return {
        r["trajectory_id"]: len(TOKENIZER.completion_text(r["output_token_ids"]))
        + (1000.0 if r["original_reward"] == 1.0 else 0.0)
        for r in rows
    }


LEDGER = "SELECT trajectory_id, original_reward, reward, status, output_token_ids FROM trajectories ORDER BY trajectory_id"


def test_a_module_function_reward_scores_every_row_once_and_changes_no_row(db):
    before = sql(db, LEDGER)
    leases = sql(db, "SELECT count(*) AS n FROM leases WHERE acked_at IS NOT NULL")
    assert len(before) == 128
    done = cli("replay", "reward", "--db", str(db), "--reward", REWARD, "--name", "len")
    assert done.returncode == 0, done.stderr
    assert "reward version 'len': 128 of 128 selected rows scored (128 ok, 0 errors)" in done.stdout
    assert "rollbook replay: len: 128/128 rows (100.0%)" in done.stderr
    assert sql(db, LEDGER) == before  # original_reward, the served reward, status: as they were
    assert sql(db, "SELECT count(*) AS n FROM leases WHERE acked_at IS NOT NULL") == leases
    got = {
        r["trajectory_id"]: r["reward"] for r in sql(db, "SELECT trajectory_id, reward FROM reward_versions WHERE name = 'len'")
    }
    assert got == expected_scores(db)
    [run] = sql(db, "SELECT reward, predicate, selected, scored, errors, starts, finished_at FROM reward_version_runs")
    assert (run["reward"], run["predicate"], run["selected"], run["scored"], run["errors"], run["starts"]) == (
        REWARD,
        "TRUE",
        128,
        128,
        0,
        1,
    )
    assert run["finished_at"] is not None


def test_killed_mid_way_the_same_command_resumes_and_each_row_is_scored_once(db):
    args = ("replay", "reward", "--db", str(db), "--reward", REWARD, "--name", "crash", "--batch-rows", "16")
    killed = cli(*args, env={"ROLLBOOK_REPLAY_CRASH_AFTER": "40"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    [cut] = sql(db, "SELECT scored, finished_at FROM reward_version_runs WHERE name = 'crash'")
    assert cut == {"scored": 32, "finished_at": None}  # two batches committed; the third died with its process
    assert sql(db, "SELECT count(*) AS n FROM reward_versions WHERE name = 'crash'") == [{"n": 32}]
    resumed = cli(*args)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming, 32 of 128 selected rows already scored (start 2)" in resumed.stderr
    assert "this run scored 96" in resumed.stdout
    [once] = sql(
        db,
        "SELECT count(*) AS n, count(DISTINCT trajectory_id) AS ids, "
        "(SELECT count(*) FROM trajectories) - count(*) AS missing FROM reward_versions WHERE name = 'crash'",
    )
    assert once == {"n": 128, "ids": 128, "missing": 0}
    got = {
        r["trajectory_id"]: r["reward"] for r in sql(db, "SELECT trajectory_id, reward FROM reward_versions WHERE name = 'crash'")
    }
    assert got == expected_scores(db)
    [run] = sql(db, "SELECT scored, starts, finished_at IS NOT NULL AS finished FROM reward_version_runs WHERE name = 'crash'")
    assert run == {"scored": 128, "starts": 2, "finished": True}


def test_a_where_on_the_ledgers_tables_selects_and_the_store_serves_the_versions(db):
    where = "trajectory_id IN (SELECT trajectory_id FROM leases WHERE step = 0 AND acked_at IS NOT NULL)"
    done = cli("replay", "reward", "--db", str(db), "--reward", "run", "--name", "step0", "--where", where, "--workers", "0")
    assert done.returncode == 0, done.stderr
    [check] = sql(
        db,
        "SELECT count(*) AS n, count(*) FILTER (WHERE v.reward IS DISTINCT FROM t.original_reward) AS differ, "
        "(SELECT count(*) FROM leases WHERE step = 0 AND acked_at IS NOT NULL) AS step0 "
        "FROM reward_versions v JOIN trajectories t USING (trajectory_id) WHERE v.name = 'step0'",
    )
    assert check == {"n": check["step0"], "differ": 0, "step0": 64}  # the run's own verifiers agree with the ledger
    escaped = cli("replay", "reward", "--db", str(db), "--reward", "run", "--name", "x", "--where", "TRUE) UNION (SELECT 'y'")
    assert escaped.returncode == 2 and "--where must be one condition" in escaped.stderr
    refused = cli(
        "replay", "reward", "--db", str(db), "--reward", "run", "--name", "x", "--where", "length(read_text('/etc/hostname')) > 0"
    )
    assert refused.returncode == 2 and "read_text() is not allowed" in refused.stderr

    store = StoreProcess(db)
    try:
        with store.client() as client:  # the SQL endpoint reads both tables
            served = client.query("SELECT name, count(*) AS n FROM reward_versions GROUP BY name").to_pylist()
            assert served == [{"name": "step0", "n": 64}]
            assert client.query("SELECT name, scored FROM reward_version_runs").to_pylist() == [{"name": "step0", "scored": 64}]
        held = cli("replay", "reward", "--db", str(db), "--reward", "run", "--name", "while-served", "--workers", "0")
        assert held.returncode == 1 and "held by another process" in held.stderr, held.stderr
    finally:
        store.stop()


def test_a_store_serving_a_reward_version_trains_on_its_rewards(tmp_path):
    """``rollbook serve --validator.reward_version digits`` and a real ``rollbook train`` step: the trainer
    is served (and trains on) the version's rewards, normalized in the same groups; only the groups the
    version scores whole are served; original_reward stays. A version the ledger lacks is refused."""
    from bench.rescore import make_ledger
    from rollbook.config import NormConfig
    from rollbook.validator.normalize import normalize_rewards

    db = make_ledger(tmp_path / "run", 64)  # 8 ready groups of 8, arithmetic and reversal tasks
    done = cli(
        "replay",
        "reward",
        "--db",
        str(db),
        "--reward",
        "tests.rescore_rewards:digits",
        "--name",
        "digits",
        "--where",
        "domain = 'arithmetic'",
        "--workers",
        "0",
    )
    assert done.returncode == 0, done.stderr
    before = sql(db, "SELECT trajectory_id, group_id, domain, original_reward FROM trajectories ORDER BY trajectory_id")
    version = {r["trajectory_id"]: r["reward"] for r in sql(db, "SELECT trajectory_id, reward FROM reward_versions")}
    arithmetic = [r for r in before if r["domain"] == "arithmetic"]
    assert 0 < len(arithmetic) < len(before) and set(version) == {r["trajectory_id"] for r in arithmetic}

    wrong = cli("serve", "--db", str(db), "--port", "0", "--validator.reward_version", "nope", timeout=120)
    assert wrong.returncode == 1 and "holds no such reward version" in wrong.stderr, wrong.stderr

    store = StoreProcess(db, extra_args=("--validator.reward_version", "digits"))
    try:
        trained = cli(
            "train", "--server", store.address, "--run_dir", str(tmp_path / "trainer"), "--num_steps", "1",
            "--num_samples", "64", "--max_wait_s", "30", timeout=600,
        )  # fmt: skip
        assert trained.returncode == 0, trained.stderr[-3000:]
    finally:
        store.stop()
    served = sql(
        db,
        "SELECT t.trajectory_id, t.group_id, t.domain, t.original_reward, t.reward, t.status FROM trajectories t "
        "JOIN leases l USING (trajectory_id) WHERE l.acked_at IS NOT NULL ORDER BY t.trajectory_id",
    )
    assert {r["trajectory_id"] for r in served} == set(version)  # every arithmetic group, no reversal
    assert all(r["status"] == "trained" for r in served)
    groups = [r["group_id"] for r in served]
    want = normalize_rewards([version[r["trajectory_id"]] for r in served], groups, NormConfig()).normalized
    from_original = normalize_rewards([r["original_reward"] for r in served], groups, NormConfig()).normalized
    assert [r["reward"] for r in served] == pytest.approx(list(want), abs=1e-9)
    assert list(want) != pytest.approx(list(from_original), abs=1e-3)  # the version moved the advantages
    after = sql(db, "SELECT trajectory_id, group_id, domain, original_reward FROM trajectories ORDER BY trajectory_id")
    assert after == before
    [step] = sql(db, "SELECT step, (stats->>'$.\"reward/normalized_mean\"')::DOUBLE AS served FROM train_steps")
    assert step["step"] == 0 and step["served"] == pytest.approx(sum(want) / len(want), abs=1e-6)
