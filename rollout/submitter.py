"""``Submitter``: deliver a rollout worker's trajectories to the store, surviving store outages.

    spool = Spool("runs/w0/spool", max_bytes=256 << 20)
    with Submitter(StoreClient.from_env(address), spool) as submitter:   # worker key: ROLLBOOK_WORKER_KEY
        submitter.submit(trajectories)     # durable in the spool when it returns; blocks while full
        ...
        submitter.flush(timeout=60)        # every spooled batch has its verdicts
    print(submitter.stats().metrics())

``submit`` only writes to the local spool, so generation never waits on the network. A background
thread sends the oldest spooled batch with ``StoreClient.submit`` and removes it from the spool only
once every verdict of it arrived. While the store is unreachable the batch stays, the thread retries
with exponential backoff, and new batches pile up behind it in order; when the spool is full,
``submit`` blocks (admission stops) instead of dropping anything. Batches still in the spool when
the process dies are replayed by the next ``Submitter`` on the same directory.

Replays never duplicate: ``trajectory_id`` is the store's idempotency key. A batch the store had
committed before its verdicts were lost (the store died after the commit, before answering) comes
back ``DUPLICATE`` when replayed. DUPLICATE means "the store already has it", so it counts as
delivered (``stats().delivered = accepted + duplicates``), never as a loss or an error.

The thread sends only once the client's channel is ready (``StoreClient.submit`` opens its stream
with ``wait_for_ready`` and no deadline, so a call started while the store is down would wait
without a way to stop it). If the store dies mid-call, the client reconnects and resends by itself;
the call returns once the store is back, and the whole call counts as outage time.

A non-retryable error (a wrong key, a protocol error) stops the thread; the batches stay in the
spool, and the next ``submit`` or ``flush`` raises ``SubmitterFailed`` with the cause.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

from rollbook.client import RETRYABLE as CLIENT_RETRYABLE
from rollbook.client import StoreClient, SubmitResult, as_trajectory
from rollbook.rollout.spool import Spool, SpoolFull
from rollbook.v1 import rollbook_pb2 as pb

log = logging.getLogger("rollbook.rollout")

# What the client resends (rollbook.client.RETRYABLE: store down, restarting, stream broke), plus the
# store refusing a stream over its limits (RESOURCE_EXHAUSTED, "retry later"): the client gives that
# up at once; the submitter keeps the batch in its spool and retries it with backoff.
RETRYABLE = CLIENT_RETRYABLE | {grpc.StatusCode.RESOURCE_EXHAUSTED}

# ``flush(while_reachable=True)``: how long the store may stay unreachable before the flush gives up
UNREACHABLE_GRACE_S = 2.0


class SubmitterFailed(RuntimeError):
    """The delivery thread stopped on a non-retryable error; pending batches are still in the spool."""


@dataclass
class SubmitterStats:
    """Counters since the ``Submitter`` started. Verdict counts come from the store."""

    accepted: int = 0
    duplicates: int = 0  # the store already had these ids: after a replay, delivered earlier
    rejected_by_reason: collections.Counter = field(default_factory=collections.Counter)
    batches_spooled: int = 0
    batches_delivered: int = 0
    replays: int = 0  # sends of a batch beyond its first (our retries plus the client's resends)
    outage_s: float = 0.0  # time between a failed delivery attempt and the next delivered batch
    admission_wait_s: float = 0.0  # time ``submit`` spent blocked on a full spool
    spool_batches: int = 0
    spool_bytes: int = 0

    @property
    def rejected(self) -> int:
        return sum(self.rejected_by_reason.values())

    @property
    def delivered(self) -> int:
        return self.accepted + self.duplicates

    def metrics(self) -> dict[str, float]:
        out = {
            f"submit/{name}": float(getattr(self, name))
            for name in (
                "accepted",
                "duplicates",
                "delivered",
                "rejected",
                "batches_spooled",
                "batches_delivered",
                "replays",
                "outage_s",
                "admission_wait_s",
                "spool_batches",
                "spool_bytes",
            )
        }
        out.update({f"submit/rejected/{reason}": float(n) for reason, n in self.rejected_by_reason.items()})
        return out


class Submitter:
    def __init__(
        self,
        client: StoreClient,
        spool: Spool,
        *,
        batch_size: int = 64,
        retry_backoff_s: tuple[float, float] = (0.05, 2.0),
        retry_deadline_s: float = 10.0,
    ):
        """``retry_backoff_s``: (first, largest) wait between delivery attempts, doubling in between.
        ``retry_deadline_s``: passed to ``StoreClient.submit``, how long it may retry a batch that a
        reachable store keeps failing (UNAVAILABLE: commit failed) before giving it back to this loop."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 < retry_backoff_s[0] <= retry_backoff_s[1]:
            raise ValueError(f"retry_backoff_s must be (first, largest) with 0 < first <= largest, got {retry_backoff_s}")
        self.client = client
        self.spool = spool
        self.batch_size = batch_size
        self.retry_backoff_s = retry_backoff_s
        self.retry_deadline_s = retry_deadline_s
        self._stats = SubmitterStats()
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._last_probe = 0.0
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._drain, name="rollbook-submitter", daemon=True)
        self._thread.start()

    def submit(self, trajectories: Iterable[pb.Trajectory | Mapping[str, Any]], *, timeout: float | None = None) -> list[int]:
        """Spool ``trajectories`` in batches of ``batch_size``; returns their spool sequence numbers.
        Blocks while the spool is full; ``SpoolFull`` if that lasts ``timeout`` seconds."""
        if self._stop.is_set():
            raise RuntimeError("submit() on a closed Submitter")
        items = [as_trajectory(t) for t in trajectories]
        if missing := [i for i, t in enumerate(items) if not t.trajectory_id]:
            raise ValueError(
                f"trajectories at positions {missing[:5]} have no trajectory_id; it is the idempotency "
                "key that makes replays safe, so set it before submitting"
            )
        deadline = None if timeout is None else time.monotonic() + timeout
        return [self._put(items[i : i + self.batch_size], deadline) for i in range(0, len(items), self.batch_size)]

    def flush(self, timeout: float | None = None, *, while_reachable: bool = False) -> bool:
        """Wait until every spooled batch is delivered; False if ``timeout`` seconds pass first.

        ``while_reachable``: also give up (False) once the store has been unreachable for
        ``UNREACHABLE_GRACE_S``: a worker stopping because its run ended, store included, should not
        wait out ``timeout`` on a store that is gone. The batches stay in the spool, and the next
        ``Submitter`` on the same directory sends them (the store's idempotency makes any resend a
        DUPLICATE)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        unreachable_since: float | None = None
        while True:
            self._raise_if_failed()
            if self._stop.is_set() and len(self.spool):
                raise RuntimeError("flush() on a closed Submitter with batches still spooled")
            remaining = 0.2 if deadline is None else min(0.2, deadline - time.monotonic())
            if self.spool.wait_until_empty(max(0.0, remaining)):
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            if while_reachable:
                now = time.monotonic()
                if self._store_ready(timeout=0.2):
                    unreachable_since = None
                elif unreachable_since is None:
                    unreachable_since = now
                elif now - unreachable_since >= UNREACHABLE_GRACE_S:
                    log.warning(
                        "submitter: store %s unreachable for %.1f s while flushing; %d batch(es) stay in spool %s",
                        self.client.address,
                        now - unreachable_since,
                        len(self.spool),
                        self.spool.directory,
                    )
                    return False

    def stats(self) -> SubmitterStats:
        """A snapshot of the counters (an ongoing outage counts up to now)."""
        with self._lock:
            snap = dataclasses.replace(self._stats, rejected_by_reason=collections.Counter(self._stats.rejected_by_reason))
            if self._down_since is not None:
                snap.outage_s += time.monotonic() - self._down_since
        snap.spool_batches, snap.spool_bytes = len(self.spool), self.spool.nbytes
        return snap

    def close(self, timeout: float = 10.0) -> None:
        """Stop delivering. Undelivered batches stay in the spool; call ``flush`` first to send them.
        A second call returns at once."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout)
        # grpc's connectivity poller outlives a readiness probe by up to 0.2 s and raises in its
        # thread if the caller closes the channel meanwhile; let it retire first.
        time.sleep(max(0.0, self._last_probe + 0.25 - time.monotonic()))
        if self._thread.is_alive():
            log.warning(
                "submitter: delivery thread still waiting on the store after %.0f s; %d batch(es) stay in "
                "spool %s for the next run",
                timeout,
                len(self.spool),
                self.spool.directory,
            )

    def __enter__(self) -> "Submitter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- admission --------------------------------------------------------------------------------

    def _put(self, batch: list[pb.Trajectory], deadline: float | None) -> int:
        """``spool.put`` in short waits, so that a failed delivery thread surfaces instead of a hang."""
        started, full = time.monotonic(), self.spool.nbytes >= self.spool.max_bytes
        try:
            while True:
                self._raise_if_failed()
                wait = 0.5 if deadline is None else min(0.5, max(0.0, deadline - time.monotonic()))
                try:
                    seq = self.spool.put(batch, timeout=wait)
                    break
                except SpoolFull:
                    full = True
                    if deadline is not None and time.monotonic() >= deadline:
                        raise
        finally:
            with self._lock:
                if full:
                    self._stats.admission_wait_s += time.monotonic() - started
        with self._lock:
            self._stats.batches_spooled += 1
        return seq

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise SubmitterFailed(
                f"delivery stopped: {self._error!r}; {len(self.spool)} batch(es) kept in spool {self.spool.directory}"
            ) from self._error

    # ---- delivery (background thread) -------------------------------------------------------------

    def _drain(self) -> None:
        try:
            while not self._stop.is_set():
                item = self.spool.peek(timeout=0.1)
                if item is not None:
                    self._deliver(*item)
        except BaseException as exc:  # recorded and re-raised to the producer by submit/flush
            log.exception("submitter: delivery stopped; batches stay in spool %s", self.spool.directory)
            self._error = exc

    def _deliver(self, seq: int, request: pb.SubmitRequest) -> None:
        """Send batch ``seq`` until every verdict is in, then remove it; returns early on close."""
        backoff, sends = self.retry_backoff_s[0], 0
        while not self._stop.is_set():
            probed = time.monotonic()
            if not self._store_ready(timeout=backoff):
                self._mark_down(probed)
                backoff = min(2 * backoff, self.retry_backoff_s[1])
                continue
            sends += 1
            started = time.monotonic()
            try:
                result = self.client.submit(
                    request.trajectories,
                    batch_size=len(request.trajectories),
                    max_in_flight=1,
                    retry_deadline_s=self.retry_deadline_s,
                )
            except grpc.RpcError as exc:
                if exc.code() not in RETRYABLE:
                    raise
                log.warning("submitter: batch %d not delivered (%s); keeping it, retry in %.2f s", seq, exc.code().name, backoff)
                self._mark_down(started)
                self._stop.wait(backoff)
                backoff = min(2 * backoff, self.retry_backoff_s[1])
                continue
            if result.reconnects:
                self._mark_down(started)
            assert all(t.trajectory_id in result.verdicts for t in request.trajectories), "a verdict is missing"
            self._record(result, replays=sends - 1 + result.resent_batches)
            self.spool.remove(seq)
            return

    def _store_ready(self, timeout: float) -> bool:
        ready = grpc.channel_ready_future(self.client.channel)
        try:
            ready.result(timeout=timeout)
            return True
        except grpc.FutureTimeoutError:
            ready.cancel()
            return False
        finally:
            self._last_probe = time.monotonic()

    def _mark_down(self, since: float) -> None:
        with self._lock:
            if self._down_since is None:
                self._down_since = since
                log.warning("submitter: store %s unreachable; spooling to %s", self.client.address, self.spool.directory)

    def _record(self, result: SubmitResult, *, replays: int) -> None:
        with self._lock:
            self._stats.accepted += result.accepted
            self._stats.duplicates += result.duplicates
            self._stats.rejected_by_reason.update(result.rejected_by_reason())
            self._stats.batches_delivered += 1
            self._stats.replays += replays
            if self._down_since is not None:
                outage = time.monotonic() - self._down_since
                self._stats.outage_s += outage
                self._down_since = None
                log.info("submitter: store back after %.1f s; replaying %d spooled batch(es)", outage, len(self.spool) - 1)
