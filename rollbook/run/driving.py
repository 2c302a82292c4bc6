"""How the placements of ``rollbook run`` drive their trainer: the metrics file (``MetricsLog``:
RUN_DIR/metrics.jsonl and the experiment trackers), the drive loop with the run's settings
(``drive_run``), installing a published version into an in-process engine (``install_weights`` from
a state dict, ``EngineHandoff`` from the trained model itself), and how far a run directory's trainer
got (``steps_done``)."""

from __future__ import annotations

import json
import pathlib
import time


class MetricsLog:
    """Appends one JSON object per line. With a ``tracker`` (rollbook/tracking.py ``Tracker``) every
    row also goes to the experiment trackers it holds."""

    def __init__(self, path: pathlib.Path, tracker=None):
        self.path = path
        self.tracker = tracker

    @classmethod
    def for_run(cls, config) -> "MetricsLog":
        """RUN_DIR/metrics.jsonl of a ``RunConfig``, with the trackers its ``[tracker]`` section turns on."""
        from rollbook.tracking import Tracker

        run_dir = pathlib.Path(config.run_dir)
        tracker = Tracker(config.tracker, run_dir, config.model_dump(mode="json"))
        return cls(run_dir / "metrics.jsonl", tracker=tracker if tracker.sinks else None)

    def write(self, row: dict) -> None:
        row = {"time": time.time(), **row}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tracker is not None:
            self.tracker.log(row)

    def close(self) -> None:
        """Flush and close the trackers (they close at interpreter exit too); the file needs nothing."""
        if self.tracker is not None:
            self.tracker.close()


def engine_copy(student, rollout):
    """An inference copy of the trained ``student`` for an engine in this process, on ``rollout.device``
    in ``rollout.dtype`` (the student itself stays where the trainer keeps it, float32)."""
    import copy

    from rollbook.devices import place

    return place(copy.deepcopy(student), rollout.device, rollout.dtype)


def install_weights(engine, version: int, state_dict) -> None:
    """A weight publisher for an engine in this process: take ``version`` when it is newer."""
    if version > engine.version:
        engine.update_weights(state_dict, version)


class EngineHandoff:
    """The weight publisher of an engine that shares the trainer's process (trainer/loop.py
    ``ModelPublisher``): a newer version is copied from the trained model into the engine's, tensor by
    tensor where each lies (a GPU: on it), cast to the engine's dtype in the copy, between the engine's
    decode steps (a callable ``Weights``, rollout/engine.py). No state dict of the trainer's model is
    made and nothing passes through host memory unless the engine sits there; the engine holds
    exactly what a state dict cast to its dtype would give it."""

    def __init__(self, engine):
        self.engine = engine

    def publish_model(self, version: int, model) -> None:
        if version <= self.engine.version:
            return
        from rollbook.rollout.engine import NativeEngine

        if isinstance(self.engine, NativeEngine):
            self.engine.update_weights(lambda target: copy_weights(model, target), version)
        else:  # vLLM loads named tensors itself (its modules fuse some): a state dict, which it casts
            self.engine.update_weights({k: v.detach() for k, v in model.state_dict().items()}, version)


def copy_weights(source, target) -> None:
    """Copy ``source``'s tensors into ``target``'s, in place: every parameter and persistent buffer of
    ``target`` (its state-dict names; a tied tensor once) from ``source``'s tensor of that name, cast to
    the target's dtype on the target's device. Raises ``ValueError`` when a name is missing or a shape
    differs, before anything is copied."""
    import torch

    from rollbook.devices import synchronize

    sources = dict(source.named_parameters(remove_duplicate=False))
    sources.update(source.named_buffers(remove_duplicate=False))
    targets = target.state_dict(keep_vars=True)  # the target's own tensors, no copies
    missing = sorted(targets.keys() - sources.keys())
    reshaped = sorted(n for n in targets.keys() & sources.keys() if targets[n].shape != sources[n].shape)
    if missing or reshaped:
        raise ValueError(f"the models do not match: {missing} missing from the source, {reshaped} of another shape")
    copied: set[int] = set()
    with torch.no_grad():
        for name, tensor in targets.items():
            if id(tensor) not in copied:  # tied weights appear under several names
                copied.add(id(tensor))
                tensor.copy_(sources[name])
    for device in {t.device for t in targets.values()}:
        synchronize(device)  # the engine's weights are whole when the update returns


def drive_run(config, trainer, placement, finish=None) -> dict:
    """Train a started ``trainer`` to the run's ``num_steps`` through the drive loop
    (trainer/drive.py) with ``placement``, rows into RUN_DIR/metrics.jsonl (and the trackers), the
    console lines on stdout; returns the held-out evaluations before the first and after the last step.
    ``finish(outcome, metrics)``, when given, runs after the loop while the metrics log is open."""
    from rollbook.trainer.drive import drive

    metrics = MetricsLog.for_run(config)
    try:
        outcome = drive(
            trainer,
            num_steps=config.num_steps,
            placement=placement,
            eval_every=config.eval_every,
            metrics=metrics,
            max_wait_s=config.trainer.max_wait_s,
            poll_interval_s=config.trainer.poll_interval_s,
            say=say,
        )
        if finish is not None:
            finish(outcome, metrics)
    finally:
        metrics.close()
    return outcome.summary()


def say(text: str) -> None:
    print(text, flush=True)


def steps_done(run_dir: pathlib.Path) -> int:
    """Trainer steps the run directory's latest checkpoint holds (0 without one); reads JSON only."""
    root = pathlib.Path(run_dir) / "checkpoints"
    try:
        name = (root / "LATEST").read_text().strip()
        return int(json.loads((root / name / "trainer.json").read_text())["step"])
    except (OSError, ValueError, KeyError):
        return 0
