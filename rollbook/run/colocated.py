"""The colocated placement of ``rollbook run``: rollout and training alternate in this process on one
model's two copies (the native engine and the trainer's student). Each new version is copied from the
student into the engine's model tensor by tensor on the device (``EngineHandoff``: no state dict, no
host copy). With ``trainer.offload_optimizer`` the two phases take turns with the device's memory: the
trainer's AdamW state leaves it after each step and the engine frees its KV cache after each round
(vLLM sleeps: its KV cache discarded, its weights in host memory until the next round).

With the promotion gate (``[gate] enabled``, rollbook/run/gate.py) the trainer hands each version to a
third copy instead, a native held-out evaluator, and the engine gets only the versions the gate
promotes; held-out reward (``eval/...``) is then the evaluator's, the trainer's newest version, as in
the separated placement."""

from __future__ import annotations

import logging

from rollbook.config import RunConfig
from rollbook.run.driving import EngineHandoff, drive_run
from rollbook.trainer.drive import Placement

log = logging.getLogger("rollbook.run")


def run_colocated(config: RunConfig, client) -> dict:
    import contextlib

    from rollbook.rollout.engines import build_engine, close_engine
    from rollbook.rollout.worker import RolloutWorker
    from rollbook.trainer.loop import Trainer
    from rollbook.trainer.model_builders import build_models

    student, teacher = build_models(config)
    release_kv = config.trainer.offload_optimizer
    with contextlib.ExitStack() as closing:  # engines and reward processes end with the run, not at interpreter exit
        engine = build_engine(config.trainer.model, config.rollout, version=0, weights=student, releases_memory=release_kv)
        closing.callback(close_engine, engine)
        worker = closing.enter_context(RolloutWorker(engine, config.rollout, model_id=config.trainer.model_id))
        if not config.gate.enabled:
            trainer = Trainer(config.trainer, client, model=student, teacher=teacher, publishers=[EngineHandoff(engine)])
            trainer.start()
            return drive_run(config, trainer, Colocated(worker, client, trainer=trainer, release_kv=release_kv))
        from rollbook.rollout.engines import native_engine
        from rollbook.run.driving import engine_copy, say
        from rollbook.run.gate import EngineRollout, build_gate, trainer_publishers

        evaluator = native_engine(engine_copy(student, config.rollout), config.rollout, version=0)
        closing.callback(close_engine, evaluator)
        publishers = trainer_publishers(EngineHandoff(evaluator))
        trainer = Trainer(config.trainer, client, model=student, teacher=teacher, publishers=publishers)
        trainer.start()
        gate = build_gate(config, trainer, client, EngineRollout(engine), evaluator, say=say)
        gate.start()
        judge = closing.enter_context(RolloutWorker(evaluator, config.rollout, model_id=config.trainer.model_id))
        placement = Colocated(worker, client, trainer=trainer, release_kv=release_kv, gate=gate, judge=judge)
        return drive_run(config, trainer, placement)


class Colocated(Placement):
    """Rollout in the trainer's process: before each step a round is sampled on the engine that holds
    the trainer's latest version, rewarded and submitted; held-out reward on that engine. With
    ``release_kv`` the engine frees its KV cache once the round is done (``release_memory``: the native
    engine drops its slab, allocated again by the next round; vLLM, built with its sleep mode, sleeps
    until the next generate or weight update), what it freed reported with the step
    (``rollout/kv_released_bytes``; vLLM's is the GPU's free memory gained, weights included). With a
    ``gate`` (rollbook/run/gate.py) each step's version is decided after the step, and held-out reward
    is measured by ``judge``, a worker on the evaluator that holds the trainer's newest version."""

    poll_interval_s = 0.0  # the next try produces its own round: nothing to wait for

    def __init__(self, worker, client, *, trainer=None, release_kv: bool = False, gate=None, judge=None):
        self.worker, self.client, self.result = worker, client, None
        self.trainer, self.release_kv = trainer, release_kv
        self.gate, self.judge = gate, judge

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
        if self.gate is not None:
            self.gate.after_step(stats)

    def evaluate(self) -> dict:
        if self.judge is None:
            return self.worker.evaluate()
        evaluation = self.judge.evaluate()
        if self.release_kv:  # the evaluator's KV cache too: the next phase has the memory
            self.judge.engine.release_memory()
        return evaluation

    def waiting(self) -> str | None:
        if self.worker.exhausted:  # a dataset whose epochs are done
            return "dataset epochs done"
        if self.result is not None:
            log.warning("no ready batch after a rollout round (%s rejected)", self.result.rejected_by_reason())
        return None
