"""Preparing a ``[replay]`` run's ledger (rollbook/run/from_ledger.py): seeded from a stopped store's
file selected through the SQL sandbox, the source left byte for byte as it was, the manifest beside
the new ledger; a restart keeps a ledger seeded from the same selection and refuses another one; the
refusals before anything is written (a predicate that is not a condition, a missing source, token ids
the student cannot read, nothing to train); the placement's stop once no seeded row is left; the
last held-out evaluation of a run whose rows ran out between evaluations; the run config's
[replay] rules (no staleness bound, the store's reward version following it, the settings refused).

Run: ``python -m pytest tests/unit/test_from_ledger.py -q``.
"""

from __future__ import annotations

import hashlib
import json
import pathlib

import pyarrow as pa
import pytest

from rollbook.config import RunConfig
from rollbook.config.run import ReplayConfig
from rollbook.errors import CommandError, ConfigError
from rollbook.run import from_ledger
from rollbook.store.ledger import Ledger
from rollbook.trajectories import trajectory_from_dict

MODEL = "tiny"


def traj(tid: str, group: str, reward: float, token: int = 5):
    return trajectory_from_dict(
        dict(
            trajectory_id=tid,
            group_id=group,
            group_size=2,
            model_id=MODEL,
            domain="a",
            prompt_token_ids=[1, 2],
            output_token_ids=[3, token],
            output_logprobs=[-0.5, -1.0],
            output_versions=[7, 7],
            temperature=1.0,
            top_p=1.0,
            reward=reward,
        )
    )


@pytest.fixture
def source(tmp_path) -> pathlib.Path:
    """A stopped store's file: groups g1 (tokens below 10), g2 (a token 60)."""
    path = tmp_path / "source" / "rollbook.duckdb"
    led = Ledger(path, fold_interval_s=3600)
    led.register_model(MODEL, 100)
    for v in range(8):
        led.publish_version(MODEL, v, "")
    led.submit([traj("a0", "g1", 0.0), traj("a1", "g1", 1.0), traj("b0", "g2", 1.0, token=60), traj("b1", "g2", 0.0)])
    led.close()
    return path


def fingerprint(folder: pathlib.Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def config(tmp_path, source: pathlib.Path, **replay) -> RunConfig:
    return RunConfig(run_dir=str(tmp_path / "new"), replay=ReplayConfig(ledger=str(source), **replay))


def test_the_ledger_is_seeded_from_the_selection_and_the_source_is_only_read(tmp_path, source, capsys):
    before = fingerprint(source.parent)
    cfg = config(tmp_path, source, where="domain = 'a' AND trajectory_id NOT IN (SELECT trajectory_id FROM rejections)", epochs=2)
    manifest = from_ledger.prepare_ledger(cfg, vocab_size=100)
    assert fingerprint(source.parent) == before
    run_dir = pathlib.Path(cfg.run_dir)
    assert sorted(p.name for p in run_dir.iterdir()) == ["replay.json", "rollbook.duckdb"]  # the private copy is gone
    assert json.loads((run_dir / "replay.json").read_text()) == manifest
    assert manifest["ledger"] == str(source) and manifest["epochs"] == 2 and manifest["model_id"] == MODEL
    assert (manifest["seeded"]["groups"], manifest["seeded"]["total_rows"], manifest["seeded"]["max_token_id"]) == (2, 8, 60)
    assert "replay: seeded 2 groups, 4 rows x 2 epoch(s) = 8 rows" in capsys.readouterr().out
    served = Ledger(run_dir / "rollbook.duckdb")
    try:
        cur = served.cursor()
        got = sorted(t for (t,) in cur.execute("SELECT trajectory_id FROM trajectories WHERE status = 'ready'").fetchall())
        cur.close()
    finally:
        served.close()
    assert got == ["a0", "a0@2", "a1", "a1@2", "b0", "b0@2", "b1", "b1@2"]


def test_a_restart_keeps_the_ledger_seeded_from_the_same_selection_and_refuses_another(tmp_path, source, capsys):
    cfg = config(tmp_path, source, where="group_id = 'g1'")
    first = from_ledger.prepare_ledger(cfg, vocab_size=100)
    db = pathlib.Path(cfg.run_dir) / "rollbook.duckdb"
    made = db.stat().st_mtime_ns
    assert from_ledger.prepare_ledger(cfg, vocab_size=100) == first
    assert db.stat().st_mtime_ns == made
    assert "replay: resuming on" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="seeded from another selection: where \"group_id = 'g1'\" \\(now 'TRUE'\\)"):
        from_ledger.prepare_ledger(config(tmp_path, source), vocab_size=100)
    (pathlib.Path(cfg.run_dir) / "replay.json").unlink()
    with pytest.raises(CommandError, match="was not seeded from a ledger"):
        from_ledger.prepare_ledger(cfg, vocab_size=100)


@pytest.mark.parametrize(
    ("replay", "vocab", "error"),
    [
        ({"where": "TRUE) UNION (SELECT 'x'"}, 100, "--where must be one condition"),
        ({"where": "read_text('/etc/passwd') <> ''"}, 100, "--where:"),
        ({"where": "group_id = 'g9'"}, 100, "selects 0 rows of .* and no whole rewarded group"),
        (
            {"where": "trajectory_id = 'a0'"},
            100,
            "no whole rewarded group \\(1 groups \\(1 selected rows\\) only partly selected\\)",
        ),
        ({"reward_version": "nope"}, 100, "the source ledger has no reward version 'nope'"),
        ({}, 60, "token id 60 and the student reads 60 ids"),
    ],
)
def test_refusals_leave_no_ledger_behind(tmp_path, source, replay, vocab, error):
    before = fingerprint(source.parent)
    with pytest.raises(ConfigError, match=error):
        from_ledger.prepare_ledger(config(tmp_path, source, **replay), vocab_size=vocab)
    assert fingerprint(source.parent) == before
    run_dir = tmp_path / "new"
    assert not run_dir.exists() or list(run_dir.iterdir()) == []


def test_a_missing_source_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="replay.ledger: no such ledger file .*nowhere.duckdb"):
        from_ledger.prepare_ledger(config(tmp_path, tmp_path / "nowhere.duckdb"), vocab_size=100)


class FakeClient:
    def __init__(self, left: int):
        self.left = left

    def query(self, sql: str) -> pa.Table:
        assert "status IN ('pending', 'ready')" in sql
        return pa.table({"n": [self.left]})


def test_the_placement_stops_the_run_once_no_seeded_row_is_left():
    assert from_ledger.FromLedger(None, FakeClient(3), 10).waiting() is None
    assert from_ledger.FromLedger(None, FakeClient(0), 10).waiting() == "the ledger's 10 seeded rows are trained"


class State:
    def __init__(self) -> None:
        self.step = self.version = 0


class FakeTrainer:
    """Trains ``rows`` steps, then finds no batch."""

    def __init__(self, rows: int):
        self.state, self.rows = State(), rows

    def step(self):
        if self.state.step == self.rows:
            return None
        self.state.step += 1
        self.state.version += 1
        return {"step": self.state.step - 1, "reward/mean": 0.5, "loss/total": 0.0, "perf/tokens_per_s": 1.0}


class Judge:
    def __init__(self) -> None:
        self.calls = 0

    def evaluate(self) -> dict:
        self.calls += 1
        return {"eval/reward": self.calls / 10}


@pytest.mark.parametrize(("rows", "evaluations"), [(3, 3), (4, 3)])
def test_a_run_whose_rows_ran_out_between_evaluations_is_evaluated_once_more(tmp_path, rows, evaluations, capsys):
    cfg = RunConfig(run_dir=str(tmp_path), num_steps=10, eval_every=2)
    judge = Judge()
    placement = from_ledger.FromLedger(judge, FakeClient(0), 4)
    summary = from_ledger.drive_replay(cfg, FakeTrainer(rows), placement)
    written = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval/reward"]) for r in written if "eval/reward" in r]
    # before step 0, after step 1 (2 done), then after step 2 (rows 3: stopped) or step 3 (rows 4: an evaluation step)
    assert evals == [(0, 0.1), (1, 0.2), (rows - 1, 0.3)]
    assert judge.calls == evaluations
    assert summary["last"] == {"step": rows - 1, "eval/reward": 0.3}
    assert f"the ledger's 4 seeded rows are trained at step {rows}: stopping" in capsys.readouterr().out


def test_a_replay_config_has_no_staleness_bound_and_its_store_serves_its_reward_version():
    from rollbook.config.run import REPLAY_MAX_STALENESS

    cfg = RunConfig(replay=ReplayConfig(ledger="src.duckdb", reward_version="strict"))
    assert cfg.max_staleness == cfg.trainer.max_staleness == REPLAY_MAX_STALENESS
    assert cfg.store.validator.reward_version == "strict"
    again = RunConfig.model_validate(cfg.model_dump(mode="json"))  # config.json read back
    assert (again.max_staleness, again.store.validator.reward_version) == (REPLAY_MAX_STALENESS, "strict")
    assert RunConfig().store.validator.reward_version is None and RunConfig().max_staleness == 0


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"max_staleness": 2}, "max_staleness = 2: a \\[replay\\] run has no staleness bound"),
        ({"placement": "separated"}, "placement = 'separated'"),
        ({"trainer": {"loss": {"proximal": "loglinear"}}}, "proximal = 'loglinear' interpolates by policy versions"),
        (
            {"store": {"validator": {"reward_version": "x"}}},
            "store.validator.reward_version = 'x' and replay.reward_version = None",
        ),
        ({"online": {}}, "\\[replay\\] trains on stored rows and \\[online\\]"),
    ],
)
def test_settings_a_replay_run_cannot_take_are_refused(fields, error):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=error):
        RunConfig.model_validate({"replay": {"ledger": "src.duckdb"}, **fields})
