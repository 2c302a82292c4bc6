"""Experiment trackers behind the metrics file: every row ``MetricsLog`` (rollbook/run/driving.py)
appends to RUN_DIR/metrics.jsonl also goes to TensorBoard event files (RUN_DIR/tensorboard/) and to
Weights & Biases, each when the run's ``[tracker]`` section turns it on (both off by default).

    [tracker]
    tensorboard = true          # tensorboard --logdir RUN_DIR/tensorboard
    wandb = true
    wandb_mode = "offline"      # RUN_DIR/wandb/; `wandb sync` uploads it later

Each number of a row is one scalar under its flat ``/``-namespaced name (``reward/mean``,
``eval/sampled/addition``) at the row's ``step`` (the trainer step, as in metrics.jsonl); the
row's ``time`` and anything not a number are not sent. The libraries are imported only when a tracker
is opened; ``check_tracker`` tells at start time, in one line (a ``ConfigError``, exit 2), that a
tracker turned on is not installed (``pip install 'rollbook[tracking]'``).
"""

from __future__ import annotations

import atexit
import importlib.util
import pathlib
import secrets
from typing import Any, Protocol

from rollbook.config import TrackerConfig
from rollbook.errors import ConfigError

# the package each tracker needs, by its config field
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}
NOT_SCALARS = ("step", "time")


class Sink(Protocol):
    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def check_tracker(config: TrackerConfig) -> None:
    """Raise ``ConfigError`` when a tracker the config turns on is not installed (nothing is imported)."""
    for field, package in PACKAGES.items():
        if getattr(config, field) and importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"tracker.{field} = true needs the {package} package, which is not installed: "
                f"pip install 'rollbook[tracking]' (or pip install {package}), or set tracker.{field} = false"
            )


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics row by name, without ``step`` and ``time`` (booleans and text are not scalars)."""
    out: dict[str, float] = {}
    for name, value in row.items():
        if name in NOT_SCALARS or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        out[name] = float(value)
    return out


class Tracker:
    """The sinks a ``TrackerConfig`` turns on, for one run directory. ``log`` sends a metrics row to
    every sink; ``close`` flushes and closes them (also at interpreter exit). With no tracker on it
    holds no sink and imports nothing."""

    def __init__(self, config: TrackerConfig, run_dir: str | pathlib.Path, run_config: dict[str, Any] | None = None):
        check_tracker(config)
        run_dir = pathlib.Path(run_dir)
        self.sinks: list[Sink] = []
        if config.tensorboard:
            self.sinks.append(TensorBoardSink(run_dir / "tensorboard"))
        if config.wandb:
            self.sinks.append(WandbSink(config, run_dir, run_config))
        self._closed = False
        if self.sinks:
            atexit.register(self.close)

    def log(self, row: dict[str, Any]) -> None:
        if not self.sinks or "step" not in row:
            return
        values = scalars(row)
        if values:
            for sink in self.sinks:
                sink.log(values, int(row["step"]))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for sink in self.sinks:
            sink.close()


class TensorBoardSink:
    """Scalars into TensorBoard event files under ``log_dir`` (``torch.utils.tensorboard``), flushed
    after every row so a running ``tensorboard --logdir`` sees each step."""

    def __init__(self, log_dir: pathlib.Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, scalars: dict[str, float], step: int) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """One Weights & Biases run per run directory, its files under RUN_DIR/wandb/. The run's id is kept
    in RUN_DIR/wandb-id, so a resumed ``rollbook run`` continues the same wandb run."""

    def __init__(self, config: TrackerConfig, run_dir: pathlib.Path, run_config: dict[str, Any] | None):
        import wandb

        id_file = run_dir / "wandb-id"
        run_id = id_file.read_text().strip() if id_file.exists() else ""
        if not run_id:
            run_id = secrets.token_hex(4)
            run_dir.mkdir(parents=True, exist_ok=True)
            id_file.write_text(run_id + "\n")
        self.run = wandb.init(
            project=config.wandb_project,
            entity=config.wandb_entity,
            name=config.wandb_name or run_dir.resolve().name,
            mode=config.wandb_mode,
            dir=str(run_dir),
            id=run_id,
            resume="allow",
            config=run_config or {},
        )

    def log(self, scalars: dict[str, float], step: int) -> None:
        # rows of one step (a step's training row after the evaluation before it) add to it; wandb
        # drops, with a warning, a row below a step it has seen (steps a resumed run trains again)
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()
