"""The colocated placement of ``rollbook run``: rollout and training alternate in this process on one
model's two copies (the native engine and the trainer's student). Each new version is copied from the
student into the engine's model tensor by tensor on the device (``EngineHandoff``: no state dict, no
host copy). With ``trainer.offload_optimizer`` the two phases take turns with the device's memory: the
trainer's AdamW state leaves it after each step and the engine frees its KV cache after each round
(vLLM sleeps: its KV cache discarded, its weights in host memory until the next round)."""

from __future__ import annotations

import logging

from rollbook.config import RunConfig
from rollbook.run.driving import EngineHandoff, drive_run
from rollbook.trainer.drive import Placement

log = logging.getLogger("rollbook.run")


def run_colocated(config: RunConfig, client) -> dict:
    from rollbook.rollout.engines import build_engine
    from rollbook.rollout.worker import RolloutWorker
    from rollbook.trainer.loop import Trainer
    from rollbook.trainer.model_builders import build_models

    student, teacher = build_models(config)
    release_kv = config.trainer.offload_optimizer
    engine = build_engine(config.trainer.model, config.rollout, version=0, weights=student, releases_memory=release_kv)
    worker = RolloutWorker(engine, config.rollout, model_id=config.trainer.model_id)
    trainer = Trainer(config.trainer, client, model=student, teacher=teacher, publishers=[EngineHandoff(engine)])
    trainer.start()
    return drive_run(config, trainer, Colocated(worker, client, trainer=trainer, release_kv=release_kv))


class Colocated(Placement):
    """Rollout in the trainer's process: before each step a round is sampled on the engine that holds
    the trainer's latest version, rewarded and submitted; held-out reward on that engine. With
    ``release_kv`` the engine frees its KV cache once the round is done (``release_memory``: the native
    engine drops its slab, allocated again by the next round; vLLM, built with its sleep mode, sleeps
    until the next generate or weight update), what it freed reported with the step
    (``rollout/kv_released_bytes``; vLLM's is the GPU's free memory gained, weights included)."""

    poll_interval_s = 0.0  # the next try produces its own round: nothing to wait for

    def __init__(self, worker, client, *, trainer=None, release_kv: bool = False):
        self.worker, self.client, self.result = worker, client, None
        self.trainer, self.release_kv = trainer, release_kv

    def before_step(self) -> bool:
        if self.worker.exhausted:
            return False
        self.result = self.client.submit(self.worker.produce())
        if self.release_kv:  # the round is done: nothing in flight
            freed = self.worker.engine.release_memory()
            self.trainer.report_with_next_step({"rollout/kv_released_bytes": freed})
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
