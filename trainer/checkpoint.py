"""Checkpoints that neither lose nor repeat a batch.

A checkpoint holds the model, the optimizer, the policy version, the step, every RNG state, whether
the model was in training mode (dropout), and the lease ids the checkpointed weights consumed
(``state.pt``, ``trainer.json``), and the model's Hugging Face ``config.json`` and
``generation_config.json`` (its architecture and its generation defaults: ``rollbook export`` turns
any kept checkpoint into the Hugging Face directory the run itself writes for that step,
``trainer/export.py``). It is written to a temporary directory and renamed into
place (atomic on POSIX), so a kill -9 leaves either the old checkpoint or the new one. A lease is
acked only after the checkpoint holding it exists; on restart the trainer re-acks the checkpoint's
leases (acks are idempotent) and republishes its version, so a crash between checkpoint and ack
loses nothing, and a crash before the checkpoint lets the lease expire and its rows return.

The newest ``keep_last`` checkpoints are kept (``checkpoints/step-NNNNNN/``, ``LATEST`` names the
newest; TrainerConfig.keep_last, default 2), so a checkpoint found bad can be rolled back by hand.
``step-N`` holds the state before step ``N`` (``N`` steps done): ``rollbook replay step N`` reruns
that step from it (``read_checkpoint(run_dir, N)``) and compares with ``step-N+1``, so
``checkpoint_every = 1`` with a large ``keep_last`` keeps every step replayable.

Sharded data-parallel ranks (trainer/distributed.py) write and read this same format: rank 0 writes
the whole state, gathered from the shards, and reads it back to scatter it, so a checkpoint moves
between one rank, replicated ranks and sharded ranks as it is.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import shutil
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from rollbook.fsync import fsync_dir
from rollbook.trainer.export import save_hf_configs

if TYPE_CHECKING:  # pragma: no cover
    from rollbook.config import TrainerConfig


@dataclass
class TrainerState:
    step: int = 0  # the next step to run
    version: int = 0  # policy version of the current weights
    consumed_leases: list[str] = field(default_factory=list)  # leases trained since the previous checkpoint (re-acked on restart)


def checkpoint_due(config: TrainerConfig, step: int) -> bool:
    """Whether the step that brought the trainer to ``step`` steps done ends with a checkpoint
    (``TrainerConfig.checkpoint_every``, and always the last of ``num_steps``)."""
    return step % config.checkpoint_every == 0 or step == config.num_steps


def save_checkpoint(
    run_dir: pathlib.Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: TrainerState, keep_last: int = 2
) -> pathlib.Path:
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{state.step:06d}"
    tmp = root / f".tmp-{state.step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    torch.save(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": _rng_state(), "training": model.training},
        tmp / "state.pt",
    )
    (tmp / "trainer.json").write_text(json.dumps(asdict(state), indent=2))
    save_hf_configs(model, tmp)  # for `rollbook export` (trainer/export.py)
    _fsync_tree(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    fsync_dir(root)
    (root / "LATEST.tmp").write_text(final.name)
    os.replace(root / "LATEST.tmp", root / "LATEST")
    fsync_dir(root)
    _prune(root, newest=final.name, keep_last=keep_last)
    return final


def load_checkpoint(
    run_dir: pathlib.Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int | None = None
) -> TrainerState | None:
    """Restore the latest checkpoint (with ``step``, ``step-<step>``) into ``model``/``optimizer``, and
    this process's RNG states; None when there is none."""
    found = read_checkpoint(run_dir, step)
    if found is None:
        return None
    blob, state = found
    model.load_state_dict(blob["model"])
    model.train(blob.get("training", model.training))  # a resumed run trains in the mode the run before did
    optimizer.load_state_dict(blob["optimizer"])
    restore_rng(blob)
    return state


def read_checkpoint(run_dir: pathlib.Path, step: int | None = None) -> tuple[dict, TrainerState] | None:
    """The latest checkpoint (or, with ``step``, the one holding the state after ``step`` steps) as
    written (``{"model", "optimizer", "rng", "training"}``, the state dicts whole) and its
    ``TrainerState``; None when there is none."""
    root = run_dir / "checkpoints"
    if step is None:
        latest = root / "LATEST"
        if not latest.exists():
            return None
        path = root / latest.read_text().strip()
    else:
        path = root / f"step-{step:06d}"
        if not (path / "state.pt").is_file():
            return None
    blob = torch.load(path / "state.pt", weights_only=False)
    return blob, TrainerState(**json.loads((path / "trainer.json").read_text()))


def restore_rng(blob: dict) -> None:
    """This process's RNG states (Python, NumPy, torch) as a checkpoint ``read_checkpoint`` returned holds them."""
    _set_rng_state(blob["rng"])


def _rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def _prune(root: pathlib.Path, newest: str, keep_last: int) -> None:
    """Keep ``newest`` and the ``keep_last - 1`` checkpoints before it; a checkpoint of a later step
    (left by a run that was rolled back by hand) is removed, as LATEST no longer leads to it."""
    older = sorted(p for p in root.glob("step-*") if p.name < newest)
    keep = {newest, *(p.name for p in older[len(older) - (keep_last - 1) :] if keep_last > 1)}
    for p in root.glob("step-*"):
        if p.name not in keep:
            shutil.rmtree(p, ignore_errors=True)


def _fsync_tree(path: pathlib.Path) -> None:
    for p in path.iterdir():
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    fsync_dir(path)
