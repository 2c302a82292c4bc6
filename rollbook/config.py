"""Run configuration: one TOML per runnable scenario in ``configs/``, dotted overrides on the
command line (``--trainer.lr 1e-4 --rollout.group_size 4``), the resolved config written into the run
directory. Parsing and validation import no torch.
"""

from __future__ import annotations

import json
import pathlib
import tomllib
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollbook.rollout.worker import RolloutConfig
from rollbook.trainer.config import TrainerConfig

M = TypeVar("M", bound=BaseModel)


class WarmStartConfig(BaseModel):
    """Supervised warm start of the tiny student (and teacher) before RL, as RL on LLMs always
    starts from a pretrained model. Cached in the run directory."""

    model_config = ConfigDict(extra="forbid")

    student_steps: int = Field(60, ge=0, description="Supervised steps for the student's starting point (0 = random init).")
    teacher_steps: int = Field(0, ge=0, description="Supervised steps for the MOPD teacher (0 = no teacher is built).")
    batch_size: int = Field(64, ge=1, description="Problems per supervised step.")
    lr: float = Field(3e-3, gt=0, description="Supervised learning rate.")
    seed: int = Field(1, description="Seed of the supervised data order (distinct from the RL task seed).")


class RunConfig(BaseModel):
    """Configuration of ``rollbook run``: the store, a rollout worker and the trainer on one machine."""

    model_config = ConfigDict(extra="forbid")

    run_dir: str = Field("runs/quickstart", description="Run directory: rollbook.duckdb, checkpoints/, metrics.jsonl, config.json.")
    placement: Literal["colocated", "separated"] = Field(
        "colocated", description="colocated: rollout and training alternate in one process (eta = 0 is strictly on-policy). "
        "separated: a rollout worker process runs asynchronously, weights over shared memory, bounded staleness.")
    num_steps: int = Field(40, ge=1, description="Trainer steps.")
    eval_every: int = Field(5, ge=1, description="Evaluate held-out reward every N steps (and before the first and after the last).")
    warm_start: WarmStartConfig = Field(default_factory=WarmStartConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)

    @model_validator(mode="after")
    def _consistent(self) -> "RunConfig":
        self.trainer.run_dir = self.run_dir
        self.trainer.num_steps = self.num_steps
        if self.trainer.loss.distill_coef > 0 and self.warm_start.teacher_steps == 0 and not self.trainer.teachers:
            raise ValueError("MOPD (trainer.loss.distill_coef > 0) needs a teacher: set warm_start.teacher_steps > 0 "
                             "or list [[trainer.teachers]]")
        return self


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["--trainer.lr", "1e-4", "--placement=separated"]`` -> nested dict; values parse as TOML
    scalars when they can (numbers, booleans, arrays), else as strings."""
    out: dict[str, Any] = {}
    it = iter(items)
    for item in it:
        if not item.startswith("--"):
            raise ValueError(f"expected --dotted.key VALUE, got {item!r}")
        key, _, value = item[2:].partition("=")
        if not _:
            value = next(it, None)
            if value is None:
                raise ValueError(f"override {item} has no value")
        node = out
        *parents, leaf = key.replace("-", "_").split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = _scalar(value)
    return out


def _scalar(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _merge(base: dict, extra: dict) -> dict:
    for k, v in extra.items():
        base[k] = _merge(base.get(k, {}), v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return base


def load_config(model: type[M], path: str | None, overrides: list[str]) -> M:
    data: dict[str, Any] = {}
    if path:
        text = pathlib.Path(path).read_text()
        data = json.loads(text) if str(path).endswith(".json") else tomllib.loads(text)
    return model.model_validate(_merge(data, parse_overrides(overrides)))


def write_resolved(config: BaseModel, run_dir: str | pathlib.Path) -> pathlib.Path:
    path = pathlib.Path(run_dir) / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config.model_dump(mode="json"), indent=2) + "\n")
    return path
