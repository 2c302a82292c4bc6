"""``rollbook rollout``: a rollout worker as its own process.

    rollbook rollout --config runs/x/worker.json            # or TOML; dotted overrides work too

It maps the trainer's weights from a weight channel (``shm:NAME`` on one host, ``grpc:HOST:PORT``
across hosts), generates task groups with the native engine under the staleness gate (admission
capacity ``(eta + version + 1) * batch_size - (accepted + running)``), and hands every trajectory to
the spooling ``Submitter``, so a store outage pauses nothing until the spool fills. New weights are
installed between decode steps (in-flight sequences continue under them, their later tokens carrying
the new version). SIGTERM/SIGINT: finish the round, flush the spool, exit.
"""

from __future__ import annotations

import logging
import pathlib
import signal
import threading
import time

from pydantic import BaseModel, ConfigDict, Field

from rollbook.models import ModelConfig
from rollbook.rollout.worker import RolloutConfig

log = logging.getLogger("rollbook.rollout")


class WorkerConfig(BaseModel):
    """Configuration of ``rollbook rollout``."""

    model_config = ConfigDict(extra="forbid")

    server: str = Field("127.0.0.1:50551", description="Store address HOST:PORT.")
    weights: str = Field(description="Weight channel: 'shm:NAME' (shared memory, one host) or 'grpc:HOST:PORT' (network).")
    model_id: str = Field("tiny", description="Model id the trajectories are recorded under.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Architecture to build before the first weights arrive.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    batch_size: int = Field(64, ge=1, description="The trainer's samples per version (the staleness gate's batch).")
    spool_dir: str = Field("runs/default/spool", description="Local spool for trajectories while the store is unreachable.")
    spool_max_bytes: int = Field(256 << 20, ge=1 << 16, description="Spool bound; admission stops when it is full.")
    first_weights_timeout_s: float = Field(300.0, gt=0, description="How long to wait for the first published weights.")
    max_rounds: int = Field(0, ge=0, description="Stop after this many rollout rounds (0 = until signalled).")
    max_idle_s: float = Field(600.0, ge=0, description="Stop when no round could run for this long (the staleness gate "
                              "closed and no newer weights, e.g. the trainer has exited); 0 = wait until signalled.")
    log_every: int = Field(10, ge=1, description="Log one progress line every N rounds.")


def open_channel(spec: str):
    kind, _, where = spec.partition(":")
    if kind == "shm":
        from rollbook.weights.shm import SharedMemoryReceiver

        return SharedMemoryReceiver(where)
    if kind == "grpc":
        from rollbook.tls import ClientTLS
        from rollbook.weights.network import NetworkReceiver

        return NetworkReceiver(where, tls=ClientTLS.from_env())
    from rollbook.errors import ConfigError

    raise ConfigError(f"weights must be 'shm:NAME' or 'grpc:HOST:PORT', got {spec!r}")


def run_worker(config: WorkerConfig, stop: threading.Event | None = None) -> dict:
    import torch

    from rollbook.models import build_student
    from rollbook.rollout.engine import NativeEngine
    from rollbook.rollout.worker import RolloutWorker, registered_vocab_size, use_model_tokenizer
    from rollbook.weights.base import load_into

    torch.set_num_threads(1)
    stop = stop or _stop_on_signals()
    channel = _wait_for_channel(config, stop)
    snapshot = _first_snapshot(channel, config, stop)
    model_cfg = config.model
    use_model_tokenizer(config.rollout, model_cfg)
    if config.rollout.dataset is not None and model_cfg.path is None and model_cfg.vocab_size is None:
        # a tiny model for your own tokenizer: its vocabulary, not the toy tasks'
        model_cfg = model_cfg.model_copy(update={"vocab_size": registered_vocab_size(config.rollout, model_cfg)})
    model = build_student(model_cfg)
    load_into(model, snapshot)
    engine = NativeEngine(model, version=snapshot.version, seed=config.rollout.seed)
    worker = RolloutWorker(engine, config.rollout, model_id=config.model_id)
    try:
        return _loop(config, stop, channel, engine, worker)
    finally:
        worker.close()


def _loop(config: WorkerConfig, stop: threading.Event, channel, engine, worker) -> dict:
    from rollbook.client import StoreClient
    from rollbook.rollout.gate import StalenessGate
    from rollbook.rollout.spool import Spool
    from rollbook.rollout.submitter import Submitter
    from rollbook.weights.base import load_into

    gate = StalenessGate(config.rollout.max_staleness, config.batch_size)
    group = config.rollout.group_size
    want = group * config.rollout.num_prompts
    rounds = 0
    idle_since = time.monotonic()
    # keys and TLS from the environment (ROLLBOOK_WORKER_KEY, ROLLBOOK_TLS_CA, ...), never from the config file
    with StoreClient.from_env(config.server) as client, Submitter(client, Spool(config.spool_dir, max_bytes=config.spool_max_bytes)) as sub:
        while not stop.is_set() and (config.max_rounds == 0 or rounds < config.max_rounds):
            if worker.exhausted:
                log.info("dataset epochs done after %d rounds: stopping", rounds)
                break
            latest = _fetch_or_none(channel)
            if latest is not None:
                try:
                    engine.update_weights(lambda m, s=latest: load_into(m, s), latest.version)  # type: ignore[misc]  # default binds this version
                except RuntimeError as exc:  # torn shared-memory copy: the next fetch brings a whole version
                    log.warning("weight update to version %d failed (%s); fetching again", latest.version, exc)
                    channel = _reopen(channel, config)
                    continue
            admitted = gate.try_admit(want, engine.version)
            whole = admitted - admitted % group
            if admitted > whole:
                gate.on_finished(admitted - whole, accepted=False)  # give back a partial group's slots
            if whole == 0:
                if config.max_idle_s and time.monotonic() - idle_since > config.max_idle_s:
                    log.warning("no round for %.0f s (staleness gate closed at version %d, no newer weights): stopping "
                                "(max_idle_s)", config.max_idle_s, engine.version)
                    break
                stop.wait(0.05)
                continue
            trajectories = worker.produce(whole // group)
            if trajectories:  # none once a dataset's epochs are done
                sub.submit(trajectories)
            gate.on_finished(whole, accepted=True)
            rounds += 1
            idle_since = time.monotonic()
            if rounds % config.log_every == 0 or rounds == config.max_rounds:
                log.info("round %d: %d trajectories so far, version %d, %s", rounds, worker.stats.num_trajectories,
                         engine.version, sub.stats().metrics())
        sub.flush(timeout=120)
        stats = {**worker.stats.metrics(), **sub.stats().metrics(), "rounds": rounds, "version": engine.version}
    channel.close()
    log.info("rollout worker done: %s", stats)
    return stats


def _wait_for_channel(config: WorkerConfig, stop: threading.Event):
    deadline = time.monotonic() + config.first_weights_timeout_s
    while True:
        try:
            return open_channel(config.weights)
        except FileNotFoundError:
            if stop.is_set() or time.monotonic() > deadline:
                from rollbook.errors import CommandError

                raise CommandError(f"no weight channel {config.weights} within {config.first_weights_timeout_s:g} s "
                                   "(first_weights_timeout_s): is the trainer running on this host?") from None
            stop.wait(0.2)


UNREACHABLE_LOG_EVERY_S = 30.0
_last_unreachable_log = [float("-inf")]


def _fetch_or_none(channel):
    """The newest version, or None when there is none newer or the weight server is unreachable
    (generation goes on with the resident weights; the staleness gate bounds how far). The
    unreachable warning is logged at most once every ``UNREACHABLE_LOG_EVERY_S`` seconds."""
    import grpc

    try:
        return channel.fetch()
    except grpc.RpcError as exc:
        now = time.monotonic()
        if now - _last_unreachable_log[0] >= UNREACHABLE_LOG_EVERY_S:
            _last_unreachable_log[0] = now
            log.warning("weight channel unreachable (%s); keeping version %s (said at most every %.0f s)",
                        exc.code().name, channel.version, UNREACHABLE_LOG_EVERY_S)
        return None


def _reopen(channel, config: WorkerConfig):
    """A fresh receiver (its version -1), so the next fetch returns the newest version whole."""
    channel.close()
    return open_channel(config.weights)


def _first_snapshot(channel, config: WorkerConfig, stop: threading.Event):
    deadline = time.monotonic() + config.first_weights_timeout_s
    while not stop.is_set():
        snapshot = _fetch_or_none(channel)  # None too while the trainer's weight server is not up
        if snapshot is not None:
            return snapshot
        if time.monotonic() > deadline:
            break
        stop.wait(0.1)
    from rollbook.errors import CommandError

    raise CommandError(f"no weights on {config.weights} within {config.first_weights_timeout_s:g} s "
                       "(first_weights_timeout_s): is the trainer running and publishing there?")


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def write_worker_config(config: WorkerConfig, path: pathlib.Path) -> pathlib.Path:
    path.write_text(config.model_dump_json(indent=2))
    return path
