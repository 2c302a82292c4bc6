"""Separated placement for ``rollbook run``: the trainer here, a ``rollbook rollout`` worker process
beside it, weights over shared memory, bounded staleness (asynchronous RL: eta is the run's
``max_staleness``, 2 unless configured, so the worker generates ahead while the trainer trains).

With the promotion gate (``[gate] enabled``, rollbook/run/gate.py) the trainer publishes only to the
held-out evaluator here, and the shared-memory channel carries only the versions the gate promotes."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import uuid

from rollbook import environment as rollbook_env
from rollbook.config import RunConfig
from rollbook.lifetime import child_env
from rollbook.run.driving import drive_run, engine_copy, install_weights, say
from rollbook.run.gate import ChannelRollout, build_gate, trainer_publishers
from rollbook.trainer.drive import Placement


def run_separated(config: RunConfig, client, address: str, keys: dict) -> dict:
    from rollbook.config import WorkerConfig
    from rollbook.devices import cast_floating
    from rollbook.rollout.engines import native_engine
    from rollbook.rollout.main import write_worker_config
    from rollbook.rollout.worker import RolloutWorker
    from rollbook.trainer.loop import Trainer
    from rollbook.trainer.model_builders import build_models
    from rollbook.weights.shm import SharedMemoryPublisher

    run_dir = pathlib.Path(config.run_dir)
    student, teacher = build_models(config)
    channel = f"rollbook-{uuid.uuid4().hex[:12]}"
    publisher = SharedMemoryPublisher(channel, cast_floating(student.state_dict(), config.trainer.dtype), checksum=True)
    evaluator = native_engine(engine_copy(student, config.rollout), config.rollout, version=0)
    judge = RolloutWorker(evaluator, config.rollout, model_id=config.trainer.model_id)
    to_evaluator = lambda v, sd: install_weights(evaluator, v, sd)  # noqa: E731 - a publisher
    gated = config.gate.enabled
    publishers = trainer_publishers(to_evaluator) if gated else [publisher.publish, to_evaluator]
    trainer = Trainer(config.trainer, client, model=student, teacher=teacher, publishers=publishers)
    trainer.start()
    gate = None
    if gated:  # the channel gets the promoted versions only
        gate = build_gate(config, trainer, client, ChannelRollout(publisher, config.trainer.dtype), evaluator, say=say)
        gate.start()
    worker_cfg = WorkerConfig(
        server=address,
        weights=f"shm:{channel}",
        model_id=config.trainer.model_id,
        model=config.trainer.model,
        rollout=config.rollout,
        batch_size=config.trainer.num_samples,
        spool_dir=str(run_dir / "spool"),
    )
    path = write_worker_config(worker_cfg, run_dir / "worker.json")
    worker = subprocess.Popen(
        [sys.executable, "-m", "rollbook.cli", "rollout", "--config", str(path)],
        env=child_env(rollbook_env.with_keys(dict(os.environ), {"worker_key": keys["worker_key"]})),
    )  # the worker role only
    try:
        epochs = config.rollout.dataset is not None and bool(config.rollout.dataset.epochs)
        return drive_run(config, trainer, Separated(judge, worker, epochs, gate=gate))
    finally:
        worker.terminate()
        _wait_or_kill(worker, WORKER_STOP_S)
        publisher.close()


class Separated(Placement):
    """Rollout in a ``rollbook rollout`` process beside the trainer: the trainer waits for its batches
    (stopping when the worker ended a dataset's epochs, failing when it died); held-out reward on an
    engine here that takes every published version. With a ``gate`` each step's version is decided
    after the step (rollbook/run/gate.py)."""

    def __init__(self, judge, worker: subprocess.Popen, epochs: bool, gate=None):
        self.judge, self.worker, self.epochs, self.gate = judge, worker, epochs, gate

    def stepped(self, stats: dict) -> None:
        if self.gate is not None:
            self.gate.after_step(stats)

    def evaluate(self) -> dict:
        return self.judge.evaluate()

    def waiting(self) -> str | None:
        code = self.worker.poll()
        if code == 0 and self.epochs:
            return "dataset epochs done"
        if code is not None:
            raise RuntimeError(f"rollout worker exited with {code}")
        return None

    def console_extra(self, stats: dict) -> str:
        return f"staleness<={stats['batch/staleness_max']}  "


# From SIGTERM to a stopped worker: it finishes its round, then flushes its spool for up to 120 s
# while the store answers (rollout/main.py); past this it is killed. Nothing acknowledged is lost:
# what the store has not acknowledged stays in the worker's spool directory for the next start.
WORKER_STOP_S = 180.0


def _wait_or_kill(worker: subprocess.Popen, seconds: float) -> None:
    try:
        worker.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        print(
            f"rollout worker (pid {worker.pid}) still running {seconds:.0f} s after SIGTERM: killing it; "
            "rows the store has not acknowledged stay in its spool for the next start",
            file=sys.stderr,
            flush=True,
        )
        worker.kill()
        worker.wait()
