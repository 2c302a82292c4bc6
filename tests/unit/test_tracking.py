"""rollbook/tracking.py and the metrics sink behind it: the ``[tracker]`` section, TensorBoard event
files written and read back, the wandb sink against a stand-in module, and a tracker turned on but not
installed refused at start in one line.

Run: ``python -m pytest tests/unit/test_tracking.py -q``.
"""

from __future__ import annotations

import importlib.machinery
import json
import pathlib
import subprocess
import sys
import types

import pytest

from rollbook import tracking
from rollbook.config import RunConfig, TrackerConfig, load_config
from rollbook.errors import ConfigError
from rollbook.run.driving import MetricsLog

REPO = pathlib.Path(__file__).resolve().parents[2]
SMOKE = str(REPO / "configs" / "smoke.toml")

ROWS = [
    {"step": 0, "eval/reward": 0.25, "eval/sampled/addition": 0.125},
    {"step": 0, "reward/mean": 0.5, "loss/total": -0.25, "batch/rows": 64, "note": "text", "ok": True, "by": {"a": 1}},
    {"step": 1, "reward/mean": 0.75, "loss/total": -0.5, "batch/rows": 64},
]


def _metrics_rows(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---- config -------------------------------------------------------------------------------------


def test_trackers_are_off_by_default_and_metrics_log_for_run_holds_none(tmp_path):
    config = RunConfig(run_dir=str(tmp_path))
    assert not config.tracker.tensorboard and not config.tracker.wandb and config.tracker.wandb_mode == "offline"
    metrics = MetricsLog.for_run(config)
    assert metrics.tracker is None
    metrics.write({"step": 0, "reward/mean": 0.5})
    assert [r["reward/mean"] for r in _metrics_rows(tmp_path / "metrics.jsonl")] == [0.5]
    assert not (tmp_path / "tensorboard").exists() and not (tmp_path / "wandb").exists()


def test_tracker_section_takes_dotted_overrides_and_refuses_an_unknown_mode():
    config = load_config(RunConfig, SMOKE, ["--tracker.tensorboard", "true", "--tracker.wandb_project", "demo"])
    assert config.tracker.tensorboard and config.tracker.wandb_project == "demo"
    with pytest.raises(ConfigError, match="tracker.wandb_mode"):
        load_config(RunConfig, SMOKE, ["--tracker.wandb_mode", "cloud"])
    with pytest.raises(ConfigError, match="tracker.comet"):
        load_config(RunConfig, SMOKE, ["--tracker.comet", "true"])


def test_scalars_keep_numbers_under_their_flat_names_and_drop_step_time_and_the_rest():
    row = {"time": 1.5, **ROWS[1]}
    assert tracking.scalars(row) == {"reward/mean": 0.5, "loss/total": -0.25, "batch/rows": 64.0}


def test_a_run_config_without_any_tracker_imports_no_tracker_library():
    code = (
        "import sys, tempfile\n"
        "from rollbook.config import RunConfig\n"
        "from rollbook.run.driving import MetricsLog\n"
        "m = MetricsLog.for_run(RunConfig(run_dir=tempfile.mkdtemp()))\n"
        "m.write({'step': 0, 'reward/mean': 1.0})\n"
        "print(sorted(n for n in ('torch', 'tensorboard', 'wandb') if n in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# ---- a tracker turned on but not installed ------------------------------------------------------


@pytest.mark.parametrize("field", ["tensorboard", "wandb"])
def test_a_tracker_that_is_not_installed_is_a_config_error_naming_the_extra(monkeypatch, field):
    monkeypatch.setitem(tracking.PACKAGES, field, "rollbook_no_such_package")
    with pytest.raises(ConfigError) as caught:
        tracking.check_tracker(TrackerConfig(**{field: True}))
    line = str(caught.value)
    assert "\n" not in line
    assert f"tracker.{field} = true" in line and "rollbook[tracking]" in line
    tracking.check_tracker(TrackerConfig())  # nothing on: nothing to check


def test_rollbook_run_with_a_missing_tracker_exits_2_in_one_line_before_any_ledger(monkeypatch, tmp_path, capsys):
    from rollbook.cli.main import main

    monkeypatch.setitem(tracking.PACKAGES, "wandb", "rollbook_no_such_package")
    code = main(["run", "--config", SMOKE, "--run_dir", str(tmp_path / "run"), "--tracker.wandb", "true"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "tracker.wandb = true" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "rollbook.duckdb").exists()


# ---- TensorBoard, for real ----------------------------------------------------------------------


def test_tensorboard_event_files_hold_every_metric_at_its_trainer_step(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = RunConfig(run_dir=str(tmp_path), tracker=TrackerConfig(tensorboard=True))
    metrics = MetricsLog.for_run(config)
    for row in ROWS:
        metrics.write(row)
    metrics.close()
    assert len(_metrics_rows(tmp_path / "metrics.jsonl")) == 3  # the file is written as before

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert tags == {"eval/reward", "eval/sampled/addition", "reward/mean", "loss/total", "batch/rows"}
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(0, 0.5), (1, 0.75)]
    assert [(e.step, e.value) for e in events.Scalars("eval/sampled/addition")] == [(0, 0.125)]
    assert [(e.step, e.value) for e in events.Scalars("loss/total")] == [(0, -0.25), (1, -0.5)]


# ---- wandb, against a stand-in module -----------------------------------------------------------


class _FakeRun:
    def __init__(self, **kwargs):
        self.init = kwargs
        self.logged: list[tuple[dict, int]] = []
        self.finished = False

    def log(self, data: dict, step: int) -> None:
        self.logged.append((dict(data), step))

    def finish(self) -> None:
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch):
    module = types.ModuleType("wandb")
    module.__spec__ = importlib.machinery.ModuleSpec("wandb", None)  # find_spec answers from sys.modules
    module.runs = []

    def init(**kwargs):
        run = _FakeRun(**kwargs)
        module.runs.append(run)
        return run

    module.init = init
    monkeypatch.setitem(sys.modules, "wandb", module)
    return module


def test_wandb_gets_every_metric_at_its_step_offline_in_the_run_directory(tmp_path, fake_wandb):
    config = RunConfig(run_dir=str(tmp_path / "my-run"), tracker=TrackerConfig(wandb=True, wandb_project="demo"))
    metrics = MetricsLog.for_run(config)
    for row in ROWS:
        metrics.write(row)
    metrics.close()

    (run,) = fake_wandb.runs
    assert run.init["project"] == "demo" and run.init["mode"] == "offline" and run.init["name"] == "my-run"
    assert run.init["dir"] == str(tmp_path / "my-run") and run.init["resume"] == "allow"
    assert run.init["config"]["tracker"]["wandb"] is True  # the resolved run config
    assert run.logged == [
        ({"eval/reward": 0.25, "eval/sampled/addition": 0.125}, 0),
        ({"reward/mean": 0.5, "loss/total": -0.25, "batch/rows": 64.0}, 0),
        ({"reward/mean": 0.75, "loss/total": -0.5, "batch/rows": 64.0}, 1),
    ]
    assert run.finished


def test_a_resumed_run_continues_the_same_wandb_run(tmp_path, fake_wandb):
    config = RunConfig(run_dir=str(tmp_path), tracker=TrackerConfig(wandb=True, wandb_name="named"))
    first, second = MetricsLog.for_run(config), MetricsLog.for_run(config)
    first.close()
    second.close()
    ids = [run.init["id"] for run in fake_wandb.runs]
    assert ids[0] and ids[0] == ids[1] == (tmp_path / "wandb-id").read_text().strip()
    assert [run.init["name"] for run in fake_wandb.runs] == ["named", "named"]
