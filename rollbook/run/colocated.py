"""The colocated placement of ``rollbook run``: rollout and training alternate in this process on one
model's two copies (the native engine and the trainer's student); weights pass in memory."""

from __future__ import annotations

import logging

from rollbook.config import RunConfig
from rollbook.run.driving import drive_run, engine_copy, install_weights
from rollbook.trainer.drive import Placement

log = logging.getLogger("rollbook.run")


def run_colocated(config: RunConfig, client) -> dict:
    from rollbook.rollout.engine import NativeEngine
    from rollbook.rollout.worker import RolloutWorker
    from rollbook.trainer.loop import Trainer
    from rollbook.trainer.model_builders import build_models

    student, teacher = build_models(config)
    engine = NativeEngine(engine_copy(student, config.rollout), version=0, seed=config.rollout.seed)
    worker = RolloutWorker(engine, config.rollout, model_id=config.trainer.model_id)
    trainer = Trainer(
        config.trainer, client, model=student, teacher=teacher, publishers=[lambda v, sd: install_weights(engine, v, sd)]
    )
    trainer.start()
    return drive_run(config, trainer, Colocated(worker, client))


class Colocated(Placement):
    """Rollout in the trainer's process: before each step a round is sampled on the engine that holds
    the trainer's latest version, rewarded and submitted; held-out reward on that engine."""

    poll_interval_s = 0.0  # the next try produces its own round: nothing to wait for

    def __init__(self, worker, client):
        self.worker, self.client, self.result = worker, client, None

    def before_step(self) -> bool:
        if self.worker.exhausted:
            return False
        self.result = self.client.submit(self.worker.produce())
        return True

    def stepped(self, stats: dict) -> None:
        stats.update(self.worker.stats.metrics())

    def evaluate(self) -> dict:
        return self.worker.evaluate()

    def waiting(self) -> str | None:
        if self.worker.exhausted:  # a dataset whose epochs are done
            return "dataset epochs done"
        if self.result is not None:
            log.warning("no ready batch after a rollout round (%s rejected)", self.result.rejected_by_reason())
        return None
