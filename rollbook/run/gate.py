"""The promotion gate of ``rollbook run`` (``[gate]``, docs/gate.md): a version the trainer publishes
reaches rollout only once it passes.

Without the gate every version goes to rollout as the trainer publishes it. With it, the trainer's
publishers reach only a held-out evaluator (an engine of its own, never a rollout engine); the rollout
side (the colocated engine, the separated worker's shared-memory channel: ``EngineRollout``,
``ChannelRollout``) is the gate's, and gets only promoted versions. After each step (``Gate.after_step``,
called by the placement's ``stepped``) the gate looks at the trainer's new version ``v``, ``p`` being
the last promoted one:

- ``v - p`` not a multiple of ``every``: held. Rollout keeps ``p``; no verdict (``policy_versions.status``
  stays NULL).
- otherwise measured: greedy held-out reward on the placement's held-out problems (``eval_size`` of
  them), and the ``regression`` set's greedy reward. It passes when its reward is at most ``max_drop``
  below ``p``'s and the regression set's reaches ``regression_min_reward``:
  - promoted: its checkpoint is kept (RUN_DIR/gate/promoted-NNNNNN, the trainer's files linked, not
    copied; the trainer's checkpoint is written first when the step wrote none), rollout gets it, and
    the store records 'promoted' with the figures (``SetVersionStatus``);
  - refused: the store records 'refused' with the figures and the reasons, rollout keeps ``p``, and
    ``on_refuse`` says what the trainer does. 'rollback': ``p``'s kept checkpoint becomes the trainer's
    latest under the next version number, ``v + 1`` (the step count goes on), the trainer restarts from
    it (``Trainer.start``: weights, optimizer state, re-acks, publishes ``v + 1``), and ``v + 1`` is
    promoted at once. A new number because a version number names one set of weights everywhere (the
    tokens' ``output_versions``, the engines, which take only newer versions), and so that rollout
    and trainer are level again: a colocated run stays on-policy. 'continue': the trainer keeps the
    refused weights and trains on rows of ``p``; a refusal after which the next decision would need
    rows staler than ``max_staleness`` stops the run in one line (the config check makes the first
    one safe).

Staleness is measured as always, against the version that generated a row: a held or refused version
generates nothing, so it never moves what rollout samples with.

A restarted run (``Gate.start``) finds the last promoted version in RUN_DIR/gate: when the trainer
resumes at it, rollout gets it; when the trainer resumes past it, rollout gets the kept checkpoint's
weights under their number and the resumed version is decided when it is due; a fresh run (nothing
kept) measures its starting version, keeps it (a step-0 checkpoint) and promotes it: the first
baseline.

``rollbook admin rollback`` (``roll_back_run``) does the rollback by hand on a stopped run: the same
checkpoint under a new version number, the ledger's versions after it marked 'rolled_back'.

``TEST_DAMAGE`` is a test hook: tests set it to damage one version on purpose.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import pathlib
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from rollbook.errors import CommandError, ConfigError
from rollbook.fsync import fsync_dir

log = logging.getLogger("rollbook.run")

GATE_DIR = "gate"  # RUN_DIR/gate: PROMOTED names the kept checkpoint of the last promoted version
REWARD_TOLERANCE = 1e-9  # rewards are means of a few hundred answers: float error, not a drop

# Test hook: ``(version, model) -> None``, called on the trainer's model as each version is published,
# before the evaluator copies it (a gated run only). Tests set it to damage a version on purpose; the
# trainer holds the damaged weights from then on (its checkpoint of that step, written before, does
# not). Never set in the product.
TEST_DAMAGE: Callable[[int, Any], None] | None = None


class RolloutSide(Protocol):
    """Where promoted versions go: the rollout engine or the rollout worker's weight channel."""

    def publish_model(self, version: int, model: Any) -> None: ...

    def publish_state(self, version: int, state: Mapping[str, Any]) -> None: ...


class EngineRollout:
    """The colocated engine as the gate's rollout side: a version from the trainer's model is copied
    into it on the device (``EngineHandoff``), one from a kept checkpoint loaded as a state dict."""

    def __init__(self, engine: Any) -> None:
        from rollbook.run.driving import EngineHandoff

        self.engine, self.handoff = engine, EngineHandoff(engine)

    def publish_model(self, version: int, model: Any) -> None:
        self.handoff.publish_model(version, model)

    def publish_state(self, version: int, state: Mapping[str, Any]) -> None:
        from rollbook.run.driving import install_weights

        install_weights(self.engine, version, dict(state))


class ChannelRollout:
    """The separated worker's shared-memory channel as the gate's rollout side, in the run's dtype."""

    def __init__(self, publisher: Any, dtype: str) -> None:
        self.publisher, self.dtype = publisher, dtype

    def publish_model(self, version: int, model: Any) -> None:
        self.publish_state(version, {k: v.detach() for k, v in model.state_dict().items()})

    def publish_state(self, version: int, state: Mapping[str, Any]) -> None:
        from rollbook.devices import cast_floating

        self.publisher.publish(version, cast_floating(dict(state), self.dtype))


class GateClient(Protocol):
    """The store calls the gate makes (``rollbook.client.StoreClient``)."""

    def set_version_status(self, model_id: str, version: int, status: str, gate: Mapping[str, Any] | None = None) -> None: ...


class Measure(Protocol):
    """A greedy evaluation: ``eval/reward`` and ``eval/<domain>`` (``RolloutWorker.evaluate``)."""

    def __call__(self) -> dict[str, float]: ...


class _Damage:
    """The trainer's first publisher in a gated run while ``TEST_DAMAGE`` is set (a test hook)."""

    def publish_model(self, version: int, model: Any) -> None:
        if TEST_DAMAGE is not None:
            TEST_DAMAGE(version, model)


def trainer_publishers(to_evaluator: Any) -> list[Any]:
    """The publishers of a gated run's trainer: the held-out evaluator's only (``TEST_DAMAGE`` first when set)."""
    return [_Damage(), to_evaluator] if TEST_DAMAGE is not None else [to_evaluator]


# ---- kept checkpoints ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Kept:
    """The last promoted version's kept checkpoint (RUN_DIR/gate/promoted-NNNNNN) and its figures;
    ``reward`` None when it was promoted by hand without a measurement."""

    version: int
    reward: float | None
    figures: dict[str, Any]
    path: pathlib.Path


def kept_promoted(run_dir: pathlib.Path) -> Kept | None:
    """The kept checkpoint of the run's last promoted version, or None (a run that never gated)."""
    root = pathlib.Path(run_dir) / GATE_DIR
    try:
        path = root / (root / "PROMOTED").read_text().strip()
        meta = json.loads((path / "gate.json").read_text())
        return Kept(int(meta["version"]), meta.get("reward"), dict(meta.get("figures") or {}), path)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def keep_promoted(run_dir: pathlib.Path, checkpoint: pathlib.Path, version: int, figures: dict[str, Any]) -> Kept:
    """Keep ``checkpoint`` (a checkpoint directory of ``version``) as the last promoted version's:
    its files linked into RUN_DIR/gate/promoted-NNNNNN with gate.json, then PROMOTED renamed onto it
    (a kill -9 leaves the old one or the new one), then the older kept ones removed."""
    root = pathlib.Path(run_dir) / GATE_DIR
    root.mkdir(parents=True, exist_ok=True)
    name = f"promoted-{version:06d}"
    tmp = root / f".tmp-{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    _link_files(checkpoint, tmp, skip={"gate.json"})
    reward = figures.get("reward")
    (tmp / "gate.json").write_text(json.dumps({"version": version, "reward": reward, "figures": figures}, indent=2))
    _fsync_files(tmp)
    shutil.rmtree(root / name, ignore_errors=True)
    os.replace(tmp, root / name)
    _point(root, "PROMOTED", name)
    for old in root.glob("promoted-*"):
        if old.name != name:
            shutil.rmtree(old, ignore_errors=True)
    return Kept(version, reward, figures, root / name)


def write_restored_checkpoint(run_dir: pathlib.Path, source: pathlib.Path, state: Any) -> pathlib.Path:
    """The trainer's latest checkpoint made of ``source``'s weights and optimizer state (its files
    linked) with ``state`` (a ``TrainerState``: the step count, the new version, the leases to re-ack)
    in trainer.json: RUN_DIR/checkpoints/step-NNNNNN (replacing one of that step), then LATEST. The
    same atomic steps as ``trainer.checkpoint.save_checkpoint``."""
    root = pathlib.Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = root / f"step-{state.step:06d}", root / f".tmp-{state.step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    _link_files(source, tmp, skip={"trainer.json", "gate.json"})  # linked before ``final`` may go: it can be the source
    (tmp / "trainer.json").write_text(json.dumps(dataclasses.asdict(state), indent=2))
    _fsync_files(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _point(root, "LATEST", final.name)
    return final


def latest_checkpoint(run_dir: pathlib.Path) -> tuple[pathlib.Path, dict[str, Any]] | None:
    """RUN_DIR/checkpoints/LATEST's directory and its trainer.json, or None."""
    root = pathlib.Path(run_dir) / "checkpoints"
    try:
        path = root / (root / "LATEST").read_text().strip()
        return path, json.loads((path / "trainer.json").read_text())
    except (OSError, ValueError):
        return None


def _link_files(source: pathlib.Path, target: pathlib.Path, *, skip: set[str]) -> None:
    """Hard links of ``source``'s files in ``target`` (checkpoint files are never written in place),
    copies where the file system has none."""
    for path in source.iterdir():
        if path.is_file() and path.name not in skip:
            try:
                os.link(path, target / path.name)
            except OSError:
                shutil.copy2(path, target / path.name)


def _fsync_files(folder: pathlib.Path) -> None:
    for path in folder.iterdir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    fsync_dir(folder)


def _point(root: pathlib.Path, pointer: str, name: str) -> None:
    """``root/pointer`` names ``name``, replaced atomically, the directory fsync'd before and after."""
    fsync_dir(root)
    (root / f"{pointer}.tmp").write_text(name)
    os.replace(root / f"{pointer}.tmp", root / pointer)
    fsync_dir(root)


# ---- the regression set -------------------------------------------------------------------------


def regression_measure(path: str, rollout: Any, engine: Any, model_id: str, judge: Any) -> Measure:
    """The greedy evaluation of ``gate.regression`` on ``engine``: the toy tasks of its lines through
    ``judge`` (a greedy ``RolloutWorker``), or with [rollout.dataset] its rows read as the dataset's
    (its field map, scored by its rewards) through a worker of their own."""
    file = pathlib.Path(path)
    if not file.is_file():
        raise ConfigError(f"gate.regression: no such file {path}")
    if rollout.dataset is None:
        tasks = read_regression_tasks(file, set(rollout.domains))
        return lambda: judge.evaluate(tasks)
    from rollbook.rollout.worker import RolloutWorker

    rows = sum(1 for line in file.read_text().splitlines() if line.strip())
    dataset = rollout.dataset.model_copy(update={"train_files": [str(file)], "heldout_files": [str(file)], "max_rows": None})
    config = rollout.model_copy(update={"dataset": dataset, "num_eval_tasks": max(1, rows), "num_eval_samples": 0})
    return RolloutWorker(engine, config, model_id=model_id).evaluate


def read_regression_tasks(path: pathlib.Path, domains: set[str]) -> list[Any]:
    """The toy tasks of a regression file: one JSON object a line with ``domain`` (one of the run's),
    ``prompt`` and ``answer`` (strings) and an optional ``task_id``. A bad line is a ``ConfigError``
    naming it."""
    from rollbook.tasks import Task

    tasks = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise ConfigError(f"gate.regression {path}:{number}: not JSON ({exc})") from None
        if not isinstance(row, dict) or not all(isinstance(row.get(k), str) for k in ("domain", "prompt", "answer")):
            raise ConfigError(f'gate.regression {path}:{number}: needs string fields "domain", "prompt" and "answer"')
        if row["domain"] not in domains:
            raise ConfigError(
                f"gate.regression {path}:{number}: domain {row['domain']!r} is not in rollout.domains {sorted(domains)}"
            )
        tasks.append(Task(str(row.get("task_id") or f"regression/{number}"), row["domain"], row["prompt"], row["answer"]))
    if not tasks:
        raise ConfigError(f"gate.regression {path}: no problems in it")
    return tasks


# ---- the gate -----------------------------------------------------------------------------------


class Gate:
    """Decides each version of a started trainer (see the module docstring). ``heldout`` and
    ``regression`` are greedy evaluations of the evaluator engine, which holds the trainer's newest
    version; ``release`` frees that engine's KV cache after a measurement (``trainer.offload_optimizer``)."""

    def __init__(
        self,
        config: Any,
        *,
        trainer: Any,
        client: GateClient,
        rollout: RolloutSide,
        heldout: Measure,
        regression: Measure | None = None,
        max_staleness: int = 0,
        release: Callable[[], Any] | None = None,
        say: Callable[[str], None] | None = None,
    ) -> None:
        self.config, self.trainer, self.client, self.rollout = config, trainer, client, rollout
        self.heldout, self.regression, self.release = heldout, regression, release
        self.max_staleness = max_staleness
        self.say = say or (lambda text: None)
        self.run_dir = pathlib.Path(trainer.config.run_dir)
        self.model_id = trainer.config.model_id
        self.kept: Kept | None = None
        self.serving = -1  # the version rollout holds

    # -- start ------------------------------------------------------------------------------------

    def start(self) -> None:
        """After ``trainer.start()``: give rollout the last promoted version (see the module docstring)."""
        version = self.trainer.state.version
        kept = kept_promoted(self.run_dir)
        if kept is None or kept.version > version:  # a fresh run (or one pointed back by hand past it)
            self._promote(version, {**self._measure(), "baseline": True})
            return
        if kept.reward is None:  # promoted by `rollbook admin rollback`: measured once it serves
            kept = self._measured_kept(kept, version)
        self.kept = kept
        if kept.version == version:
            self._serve_model(version)
            self.client.set_version_status(self.model_id, version, "promoted", kept.figures)  # again: idempotent
            return
        import torch

        blob = torch.load(kept.path / "state.pt", map_location="cpu", weights_only=False)
        self.rollout.publish_state(kept.version, blob["model"])
        self.serving = kept.version
        self.say(f"gate: rollout resumes at promoted version {kept.version} (the trainer resumes at {version})")
        self._decide()

    def _measured_kept(self, kept: Kept, version: int) -> Kept:
        """A kept version without figures measured now (the trainer holds its weights: ``version``)."""
        if kept.version != version:
            return kept  # measured when a later version is decided against it: no baseline, it passes
        figures = {**kept.figures, **self._measure()}
        return keep_promoted(self.run_dir, kept.path, kept.version, figures)

    # -- each step --------------------------------------------------------------------------------

    def after_step(self, stats: dict[str, Any]) -> None:
        """Decide the trainer's new version; ``gate/...`` figures into the step's ``stats`` (metrics.jsonl)."""
        stats.update(self._decide())

    def _decide(self) -> dict[str, Any]:
        kept, version = self.kept, self.trainer.state.version
        assert kept is not None  # start() ran
        if version == kept.version or (version - kept.version) % self.config.every:
            return {"gate/rollout_version": self.serving}  # held: rollout keeps the promoted version
        figures = self._measure()
        reasons = self._failures(figures, kept)
        out = {"gate/version": version, "gate/reward": figures["reward"], "gate/promoted": 0.0 if reasons else 1.0}
        if "regression_reward" in figures:
            out["gate/regression_reward"] = figures["regression_reward"]
        if reasons:
            self._refuse(version, {**figures, "reasons": reasons}, kept)
        else:
            self._promote(version, figures)
        out["gate/rollout_version"] = self.serving
        return out

    def _measure(self) -> dict[str, Any]:
        """The figures of the trainer's version: greedy held-out reward overall and per domain, the
        regression set's; ``step``: the steps done."""
        heldout = self.heldout()
        domains = {k[len("eval/") :]: v for k, v in heldout.items() if k.startswith("eval/") and k.count("/") == 1}
        figures: dict[str, Any] = {
            "step": self.trainer.state.step,
            "reward": _finite_or_none(heldout.get("eval/reward")),
            "heldout": {d: v for d, v in domains.items() if d not in ("reward", "errors")},
        }
        if self.regression is not None:
            figures["regression_reward"] = _finite_or_none(self.regression().get("eval/reward"))
        if self.release is not None:
            self.release()
        return figures

    def _failures(self, figures: dict[str, Any], kept: Kept) -> list[str]:
        """Why the measured version fails against ``kept`` (empty: it passes)."""
        cfg, reasons = self.config, []
        reward = figures["reward"]
        if reward is None:
            reasons.append("held-out reward not measured (no problem scored)")
        elif kept.reward is not None and reward < kept.reward - cfg.max_drop - REWARD_TOLERANCE:
            reasons.append(
                f"held-out reward {reward:.4f} is more than max_drop {cfg.max_drop:g} below promoted "
                f"version {kept.version}'s {kept.reward:.4f}"
            )
        if self.regression is not None:
            got = figures.get("regression_reward")
            if got is None or got < cfg.regression_min_reward - REWARD_TOLERANCE:
                shown = "not measured" if got is None else f"{got:.4f}"
                reasons.append(f"regression reward {shown} is below regression_min_reward {cfg.regression_min_reward:g}")
        figures.update({"baseline_version": kept.version, "baseline_reward": kept.reward, "max_drop": cfg.max_drop})
        return reasons

    # -- verdicts ---------------------------------------------------------------------------------

    def _promote(self, version: int, figures: dict[str, Any]) -> None:
        """Keep the version's checkpoint, hand it to rollout, record 'promoted' (in that order: a crash
        between leaves a kept version that a restart serves and records again)."""
        self.kept = keep_promoted(self.run_dir, self._checkpoint_of(version), version, figures)
        self._serve_model(version)
        self.client.set_version_status(self.model_id, version, "promoted", figures)
        reward = figures.get("reward")
        shown = "not measured" if reward is None else f"{reward:.3f}"
        self.say(f"gate: version {version} promoted (held-out {shown}): rollout generates with it")

    def _refuse(self, version: int, figures: dict[str, Any], kept: Kept) -> None:
        self.client.set_version_status(self.model_id, version, "refused", figures)
        self.say(f"gate: version {version} refused ({'; '.join(figures['reasons'])}); rollout keeps version {self.serving}")
        if self.config.on_refuse == "rollback":
            self._roll_back(version, kept)
        else:
            self._check_reachable(version)

    def _roll_back(self, refused: int, kept: Kept) -> None:
        """The trainer restarts from ``kept``'s checkpoint as version ``refused + 1``, promoted at once."""
        from rollbook.trainer.checkpoint import TrainerState
        from rollbook.trainer.offload import offload_optimizer

        trainer, state = self.trainer, self.trainer.state
        restored = TrainerState(step=state.step, version=state.version + 1, consumed_leases=list(state.consumed_leases))
        path = write_restored_checkpoint(self.run_dir, kept.path, restored)
        # the AdamW state the trainer moved off its device after the refused step: the checkpoint's replaces it
        trainer._offloaded = None
        trainer.start()  # loads the checkpoint just written: weights, optimizer state; re-acks; publishes the version
        if trainer.offload:
            trainer._offloaded = offload_optimizer(trainer.optimizer)  # off the device between steps, as after a step
        figures = {
            **{k: v for k, v in kept.figures.items() if k in ("reward", "heldout", "regression_reward")},
            "step": state.step,
            "restores": kept.version,
            "after_refusal": refused,
        }
        self.kept = keep_promoted(self.run_dir, path, restored.version, figures)
        self._serve_model(restored.version)
        self.client.set_version_status(self.model_id, restored.version, "promoted", figures)
        self.say(f"gate: rolled back to version {kept.version}'s weights and optimizer state as version {restored.version}")

    def _check_reachable(self, refused: int) -> None:
        """'continue': the trainer trains on rows of the version rollout keeps up to the next decision."""
        stale = refused + self.config.every - 1 - self.serving
        if stale > self.max_staleness:
            raise CommandError(
                f"gate: version {refused} refused and gate.on_refuse = 'continue': the trainer would train version "
                f"{refused + self.config.every - 1} on rows of version {self.serving}, {stale} versions stale, past "
                f"max_staleness {self.max_staleness}, so rollout cannot give it a batch; set gate.on_refuse = 'rollback' "
                "or a larger max_staleness"
            )

    def _serve_model(self, version: int) -> None:
        self.rollout.publish_model(version, self.trainer.model)
        self.serving = version

    def _checkpoint_of(self, version: int) -> pathlib.Path:
        """The trainer's checkpoint of its current state (``version``): the step's own, or written now
        (a step ``checkpoint_every`` skipped, or the start of a fresh run)."""
        from rollbook.trainer.checkpoint import save_checkpoint

        trainer = self.trainer
        latest = latest_checkpoint(self.run_dir)
        if latest is not None and latest[1].get("version") == version and latest[1].get("step") == trainer.state.step:
            return latest[0]
        return save_checkpoint(self.run_dir, trainer.model, trainer.optimizer, trainer.state, keep_last=trainer.config.keep_last)


def _finite_or_none(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def build_gate(config: Any, trainer: Any, client: GateClient, rollout: RolloutSide, evaluator: Any, *, say=None) -> Gate:
    """The gate of a ``RunConfig`` (``[gate]``) over a started ``trainer``: its held-out evaluation and
    regression set on ``evaluator`` (an engine that takes every version the trainer publishes)."""
    from rollbook.rollout.worker import RolloutWorker

    gate, rollout_cfg = config.gate, config.rollout
    size = gate.eval_size or rollout_cfg.num_eval_tasks
    greedy = rollout_cfg.model_copy(update={"num_eval_tasks": size, "num_eval_samples": 0})
    judge = RolloutWorker(evaluator, greedy, model_id=config.trainer.model_id)
    regression = None
    if gate.regression:
        regression = regression_measure(gate.regression, greedy, evaluator, config.trainer.model_id, judge)
    release = evaluator.release_memory if config.trainer.offload_optimizer else None
    return Gate(
        gate,
        trainer=trainer,
        client=client,
        rollout=rollout,
        heldout=judge.evaluate,
        regression=regression,
        max_staleness=config.max_staleness,
        release=release,
        say=say,
    )


# ---- rollbook admin rollback ------------------------------------------------------------------------


@dataclass(frozen=True)
class RolledBack:
    """What ``roll_back_run`` did: the versions marked, the new version and the step it resumes at."""

    version: int
    new_version: int
    step: int
    marked: list[int]
    checkpoint: pathlib.Path


def kept_checkpoints(run_dir: pathlib.Path) -> dict[int, pathlib.Path]:
    """Version -> a kept checkpoint holding it: the trainer's (RUN_DIR/checkpoints/step-*, the newest
    step of a version) and the gate's last promoted one."""
    found: dict[int, tuple[int, pathlib.Path]] = {}
    for path in sorted((pathlib.Path(run_dir) / "checkpoints").glob("step-*")):
        try:
            meta = json.loads((path / "trainer.json").read_text())
        except (OSError, ValueError):
            continue
        if (path / "state.pt").is_file():
            found[int(meta["version"])] = (int(meta["step"]), path)
    out = {version: path for version, (_, path) in found.items()}
    kept = kept_promoted(run_dir)
    if kept is not None and (kept.path / "state.pt").is_file():
        out.setdefault(kept.version, kept.path)
    return out


def roll_back_run(run_dir: pathlib.Path, db: pathlib.Path, model_id: str, version: int) -> RolledBack:
    """``rollbook admin rollback MODEL VERSION`` on a stopped run (docs/gate.md): the ledger ``db``
    marks the versions after ``version`` 'rolled_back' and records the next free version number
    'promoted'; RUN_DIR's latest checkpoint becomes ``version``'s weights and optimizer state under
    that number (the step count kept), so the next ``rollbook run`` resumes from it and rollout gets
    it. The ledger is opened first, so a running store (which holds it) stops the command before
    anything changes. Raises ``CommandError`` in one line."""
    import duckdb

    from rollbook.store.ledger import InvalidStatus, Ledger, UnknownVersion
    from rollbook.trainer.checkpoint import TrainerState

    run_dir, db = pathlib.Path(run_dir), pathlib.Path(db)
    latest = latest_checkpoint(run_dir)
    if latest is None:
        raise CommandError(f"{run_dir} has no checkpoint (checkpoints/LATEST): nothing to roll back")
    if not db.exists():
        raise CommandError(f"no such ledger file {db}")
    try:
        ledger = Ledger(db)
    except duckdb.IOException as exc:
        if "lock" not in str(exc).lower():
            raise
        raise CommandError(f"ledger {db} is held by another process (the run's store?): stop the run first") from None
    try:
        published = ledger.registry.published_versions(model_id).latest
        new_version = max(int(latest[1]["version"]), -1 if published is None else int(published)) + 1
        record = {"rolled_back_to": version, "restored_as": new_version, "by": "rollbook admin rollback", "at": time.time()}
        step = int(latest[1]["step"])
        try:  # checked before the run directory changes: the ledger's rollback below then cannot be refused
            status, gate = ledger.version_record(model_id, version)
            if status == "refused":
                raise InvalidStatus(
                    f"version {version} of model {model_id!r} was refused by the gate: roll back to a promoted one"
                )
        except (UnknownVersion, InvalidStatus) as exc:
            raise CommandError(str(exc)) from None
        kept = kept_checkpoints(run_dir)
        if version not in kept:
            raise CommandError(
                f"no kept checkpoint of version {version} in {run_dir}: the kept ones hold versions {sorted(kept)} "
                "(trainer.keep_last keeps the newest checkpoints; the gate keeps the last promoted version's)"
            )
        restored = TrainerState(step=step, version=new_version, consumed_leases=list(latest[1].get("consumed_leases", [])))
        path = write_restored_checkpoint(run_dir, kept[version], restored)
        marked = ledger.roll_back(model_id, version, new_version, json.dumps(record))
    finally:
        ledger.close()
    measured = json.loads(gate) if gate else {}  # the gate's figures of those weights: a gated run's baseline
    figures = {k: v for k, v in measured.items() if k in ("reward", "heldout", "regression_reward")}
    keep_promoted(run_dir, path, new_version, {**figures, "step": step, "restores": version, **record})
    return RolledBack(version, new_version, step, marked, path)
