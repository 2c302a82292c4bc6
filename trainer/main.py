"""``rollbook train``: the trainer as its own process against a running store (weights are
published to the store's version registry; rollout workers get them through a weight channel)."""

from __future__ import annotations

import logging

from rollbook.client import StoreClient
from rollbook.trainer.config import TrainerConfig

log = logging.getLogger("rollbook.trainer")


def train(config: TrainerConfig) -> list[dict]:
    import torch

    from rollbook.trainer.loop import Trainer
    from rollbook.trainer.setup import build_student, build_teachers

    if config.loss.distill_coef > 0 and not config.teachers:
        raise ValueError("loss.distill_coef > 0 needs at least one [[teachers]] entry (or set loss.distill_coef = 0)")
    torch.set_num_threads(2)
    with StoreClient(config.server, trainer_key=config.trainer_key) as client:
        trainer = Trainer(config, client, model=build_student(config.model), teacher=build_teachers(config))
        history = trainer.run()
    log.info("done: %d steps, version %d", trainer.state.step, trainer.state.version)
    return history
