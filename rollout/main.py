"""``rollbook rollout``: a rollout worker as its own process.

    rollbook rollout --config runs/x/worker.json            # or TOML; dotted overrides work too

It maps the trainer's weights from a weight channel (``shm:NAME`` on one host, ``cuda-ipc:NAME`` on one
GPU host, ``grpc:HOST:PORT`` across hosts), generates task groups with the engine ``rollout.engine`` names (native, or vLLM on
``model.path``: rollout/engines.py) under the staleness gate (admission
capacity ``(eta + version + 1) * batch_size - (accepted + running)``), and hands every trajectory to
the spooling ``Submitter``, so a store outage pauses nothing until the spool fills. New weights are
installed between decode steps (in-flight sequences continue under them, their later tokens carrying
the new version). SIGTERM/SIGINT: finish the round, flush the spool, exit.

The staleness bound is the trainer's: it announces its ``max_staleness`` and ``num_samples`` with
every version it publishes to the store, and the worker runs its gate with them (``TrainerContract``),
logging once when they differ from its own ``rollout.max_staleness`` / ``batch_size``. Those two
settings only apply while the store has no announcement (a trainer from before the announcement, or
none published yet).
"""

from __future__ import annotations

import logging
import math
import pathlib
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from rollbook.config import WorkerConfig

if TYPE_CHECKING:  # pragma: no cover
    from rollbook.client import StoreClient
    from rollbook.rollout.gate import StalenessGate

log = logging.getLogger("rollbook.rollout")


def open_channel(spec: str):
    kind, _, where = spec.partition(":")
    if kind == "shm":
        from rollbook.weights.shm import SharedMemoryReceiver

        return SharedMemoryReceiver(where)
    if kind == "grpc":
        from rollbook.tls import ClientTLS
        from rollbook.weights.network import NetworkReceiver

        return NetworkReceiver(where, tls=ClientTLS.from_env())
    if kind == "ray":
        from rollbook.weights.ray_objects import RayObjectReceiver

        return RayObjectReceiver(where)
    if kind == "cuda-ipc":
        from rollbook.weights.cuda_ipc import CudaIpcReceiver

        return CudaIpcReceiver(where)
    from rollbook.errors import ConfigError

    raise ConfigError(f"weights must be 'shm:NAME', 'grpc:HOST:PORT', 'ray:BOARD' or 'cuda-ipc:NAME', got {spec!r}")


def run_worker(
    config: WorkerConfig, stop: threading.Event | None = None, on_weights: Callable[[int], None] | None = None
) -> dict:
    """The worker's loop until ``stop`` (SIGINT/SIGTERM when None). ``on_weights`` is told the version
    of the first weights once the engine holds them (a launcher's barrier: rollbook/run/ray_cluster.py)."""
    import torch

    from rollbook.rollout.engines import build_engine, close_engine, install_snapshot
    from rollbook.rollout.worker import RolloutWorker, registered_vocab_size, use_model_stops, use_model_tokenizer

    torch.set_num_threads(1)
    stop = stop or _stop_on_signals()
    channel = _wait_for_channel(config, stop)
    snapshot = _first_snapshot(channel, config, stop)
    model_cfg = config.model
    use_model_tokenizer(config.rollout, model_cfg)
    use_model_stops(config.rollout, model_cfg)
    if config.rollout.dataset is not None and model_cfg.path is None and model_cfg.vocab_size is None:
        # a tiny model for your own tokenizer: its vocabulary, not the toy tasks'
        model_cfg = model_cfg.model_copy(update={"vocab_size": registered_vocab_size(config.rollout, model_cfg)})
    engine = build_engine(model_cfg, config.rollout, version=-1)  # the built weights are never served
    while True:
        try:
            install_snapshot(engine, snapshot)
            break
        except RuntimeError as exc:  # torn shared-memory copy (the trainer published twice meanwhile): fetch again
            log.warning("first weight install (version %d) failed (%s); fetching again", snapshot.version, exc)
            channel = _reopen(channel, config)
            snapshot = _first_snapshot(channel, config, stop)
    worker = RolloutWorker(engine, config.rollout, model_id=config.model_id)
    if on_weights is not None:
        on_weights(engine.version)
    try:
        return _loop(config, stop, channel, engine, worker)
    finally:
        worker.close()
        close_engine(engine)


def _loop(config: WorkerConfig, stop: threading.Event, channel, engine, worker) -> dict:
    from rollbook.client import StoreClient
    from rollbook.rollout.engines import install_snapshot
    from rollbook.rollout.gate import StalenessGate
    from rollbook.rollout.spool import Spool
    from rollbook.rollout.submitter import Submitter

    gate = StalenessGate(config.rollout.max_staleness, config.batch_size)
    group = config.rollout.group_size
    want = group * config.rollout.num_prompts
    rounds = 0
    idle_since = time.monotonic()
    # keys and TLS from the environment (ROLLBOOK_WORKER_KEY, ROLLBOOK_TLS_CA, ...), never from the config file
    with (
        StoreClient.from_env(config.server) as client,
        Submitter(client, Spool(config.spool_dir, max_bytes=config.spool_max_bytes)) as sub,
    ):
        contract = TrainerContract(client, config, gate)
        contract.wait_for_announcement(stop, config.announcement_wait_s)
        while not stop.is_set() and (config.max_rounds == 0 or rounds < config.max_rounds):
            if worker.exhausted:
                log.info("dataset epochs done after %d rounds: stopping", rounds)
                break
            latest = _fetch_or_none(channel)
            if latest is not None:
                try:
                    install_snapshot(engine, latest)
                except RuntimeError as exc:  # torn shared-memory copy: the next fetch brings a whole version
                    log.warning("weight update to version %d failed (%s); fetching again", latest.version, exc)
                    channel = _reopen(channel, config)
                    continue
            contract.refresh(engine.version)
            admitted = gate.try_admit(want, engine.version)
            whole = admitted - admitted % group
            if admitted > whole:
                gate.on_finished(admitted - whole, accepted=False)  # give back a partial group's slots
            if whole == 0:
                if config.max_idle_s and time.monotonic() - idle_since > config.max_idle_s:
                    log.warning(
                        "no round for %.0f s (staleness gate closed at version %d, no newer weights): stopping (max_idle_s)",
                        config.max_idle_s,
                        engine.version,
                    )
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
                log.info(
                    "round %d: %d trajectories so far, version %d, %s",
                    rounds,
                    worker.stats.num_trajectories,
                    engine.version,
                    sub.stats().metrics(),
                )
        # a stopping worker's store may have ended with its run: spooled rows wait for the next start
        if not sub.flush(timeout=120, while_reachable=True):
            sub.close(timeout=1.0)
        stats = {
            **worker.stats.metrics(),
            **sub.stats().metrics(),
            "rounds": rounds,
            "version": engine.version,
            "gate/max_staleness": gate.max_staleness,
            "gate/batch_size": gate.batch_size,
            "gate/from_trainer": int(contract.announced is not None),
        }
    channel.close()
    log.info("rollout worker done: %s", stats)
    return stats


CONTRACT_RECHECK_S = 1.0  # while the store has no announcement, ask again at most this often


class TrainerContract:
    """Keeps the staleness gate on the trainer's bound: ``max_staleness`` and ``samples_per_version``
    as the trainer last announced them to the store (``GetModel``). Asks again on every new policy
    version (a restarted trainer may announce other values) and, while nothing is announced, at
    most every ``CONTRACT_RECHECK_S``. A store that cannot answer (down, too old for ``GetModel``, the
    model not registered yet) leaves the gate as it is; each kind of failure is logged once."""

    def __init__(self, client: StoreClient, config: WorkerConfig, gate: StalenessGate) -> None:
        self.client, self.config, self.gate = client, config, gate
        self.announced: tuple[int, int] | None = None  # (max_staleness, batch_size) adopted from the trainer
        self._asked_at_version: int | None = None
        self._asked_at = float("-inf")
        self._said: set[str] = set()

    def refresh(self, version: int) -> bool:
        """Ask the store when due; True once the trainer's values are in force."""
        now = time.monotonic()
        if version == self._asked_at_version and (self.announced is not None or now - self._asked_at < CONTRACT_RECHECK_S):
            return self.announced is not None
        self._asked_at_version, self._asked_at = version, now
        import grpc

        try:
            info = self.client.get_model(self.config.model_id)
        except grpc.RpcError as exc:
            self._once(
                exc.code().name,
                "staleness gate: cannot read the trainer's bound from the store (%s: %s); "
                "gating with this worker's max_staleness=%d, batch_size=%d until it can",
                exc.code().name,
                exc.details(),
                self.gate.max_staleness,
                self.gate.batch_size,
            )
            return self.announced is not None
        if info.max_staleness is None and info.samples_per_version is None:
            self._once(
                "none",
                "staleness gate: the trainer has announced no bound yet; gating with this worker's "
                "max_staleness=%d, batch_size=%d",
                self.gate.max_staleness,
                self.gate.batch_size,
            )
            return self.announced is not None
        eta = self.config.rollout.max_staleness if info.max_staleness is None else info.max_staleness
        if info.samples_per_version:
            share = math.ceil(info.samples_per_version * self.config.version_share)
            batch = max(share, self.config.rollout.group_size)
        else:
            batch = self.config.batch_size
        if (eta, batch) != self.announced:
            own = (self.config.rollout.max_staleness, self.config.batch_size)
            if (eta, batch) != own or self.announced is not None:
                log.info(
                    "staleness gate: the trainer announces max_staleness=%d, samples_per_version=%d; using them "
                    "(this worker's config: rollout.max_staleness=%d, batch_size=%d)",
                    eta,
                    batch,
                    *own,
                )
            self.gate.set_bound(eta, batch)
            self.announced = (eta, batch)
        return True

    def wait_for_announcement(self, stop: threading.Event, timeout_s: float) -> None:
        """Before the first round: the trainer publishes weights a moment before it announces the
        version to the store, so give the announcement ``timeout_s`` to arrive (only while the store
        answers that there is none yet)."""
        deadline = time.monotonic() + timeout_s
        version = -1
        while not self.refresh(version) and "none" in self._said and not stop.is_set() and time.monotonic() < deadline:
            stop.wait(0.1)
            self._asked_at = float("-inf")

    def _once(self, kind: str, message: str, *args: object) -> None:
        if kind not in self._said:
            self._said.add(kind)
            log.log(logging.INFO if kind == "none" else logging.WARNING, message, *args)


def _wait_for_channel(config: WorkerConfig, stop: threading.Event):
    deadline = time.monotonic() + config.first_weights_timeout_s
    while True:
        try:
            return open_channel(config.weights)
        except FileNotFoundError:
            if stop.is_set() or time.monotonic() > deadline:
                from rollbook.errors import CommandError

                raise CommandError(
                    f"no weight channel {config.weights} within {config.first_weights_timeout_s:g} s "
                    "(first_weights_timeout_s): is the trainer running on this host?"
                ) from None
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
            log.warning(
                "weight channel unreachable (%s); keeping version %s (said at most every %.0f s)",
                exc.code().name,
                channel.version,
                UNREACHABLE_LOG_EVERY_S,
            )
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

    raise CommandError(
        f"no weights on {config.weights} within {config.first_weights_timeout_s:g} s "
        "(first_weights_timeout_s): is the trainer running and publishing there?"
    )


def _stop_on_signals() -> threading.Event:
    from rollbook.lifetime import stop_event  # a handler that takes no lock (StopEvent)

    return stop_event()


def write_worker_config(config: WorkerConfig, path: pathlib.Path) -> pathlib.Path:
    path.write_text(config.model_dump_json(indent=2))
    return path
