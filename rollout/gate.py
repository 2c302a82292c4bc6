"""``StalenessGate``: how much new rollout work may start, so that no sample is too stale to train.

AReaL's admission rule (arXiv 2505.24298, staleness-aware training; its ``max_head_offpolicyness``
is ``eta``), without AReaL's separate cap on concurrent rollouts. With a trainer that consumes
``batch_size`` samples per policy version and a staleness bound ``eta`` (``max_staleness``),
rollout may start new samples only while

    capacity(version) = (eta + version + 1) * batch_size - (accepted + running) > 0

``accepted`` counts finished samples that went to the store, ``running`` the samples in generation.
By version ``v`` the trainer has consumed ``v * batch_size`` samples, so at most ``eta + 1`` batches
beyond that exist or are being made: every sample is at most ``eta`` versions behind the policy that
trains on it. ``eta = 0`` is synchronous RL: one batch per version, then admission stops until the
version advances. Dropped samples (failed, filtered) give their slot back.

``eta`` and ``batch_size`` are the trainer's (its ``max_staleness`` and ``num_samples``): a
separately started worker learns them from the store, where the trainer announces them with every
version it publishes, and calls ``set_bound`` (rollout/main.py ``TrainerContract``).

    gate = StalenessGate(max_staleness=2, batch_size=4)
    n = gate.try_admit(8, version=engine.version)   # how many of 8 prompts may start now
    ...
    gate.on_finished(1, accepted=True)              # one sample submitted, no longer running
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class StalenessGate:
    def __init__(self, max_staleness: int, batch_size: int):
        _check_bound(max_staleness, batch_size)
        self.max_staleness = max_staleness
        self.batch_size = batch_size
        self._accepted = 0
        self._running = 0
        self._dropped = 0
        self._cond = threading.Condition()

    def set_bound(self, max_staleness: int, batch_size: int) -> None:
        """Gate by a new ``eta`` and ``batch_size`` from now on (the trainer's, once announced).
        Samples already admitted stay admitted; capacity follows the new values at once."""
        _check_bound(max_staleness, batch_size)
        with self._cond:
            self.max_staleness, self.batch_size = max_staleness, batch_size
            self._cond.notify_all()

    def capacity(self, version: int) -> int:
        """``(eta + version + 1) * batch_size - (accepted + running)``; <= 0 means admit nothing."""
        with self._cond:
            return self._capacity(version)

    def try_admit(self, n: int, version: int) -> int:
        """Admit up to ``n`` new samples at policy ``version``; returns how many are now running."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        with self._cond:
            admitted = max(0, min(n, self._capacity(version)))
            self._running += admitted
            return admitted

    def on_finished(self, n: int, accepted: bool) -> None:
        """``n`` running samples finished: accepted (went to the store) or dropped (slot given back)."""
        with self._cond:
            if not 0 <= n <= self._running:
                raise ValueError(f"on_finished({n}) with only {self._running} running")
            self._running -= n
            if accepted:
                self._accepted += n
            else:
                self._dropped += n
            self._cond.notify_all()

    def wait_for_capacity(self, version_fn: Callable[[], int], timeout: float | None = None, *, poll_s: float = 0.05) -> int:
        """Wait until ``capacity(version_fn()) > 0`` and return it; 0 if ``timeout`` seconds pass first.
        Wakes on ``on_finished`` and every ``poll_s`` (the version moves outside the gate). Another
        thread may take the capacity first: admit with ``try_admit`` and use what it returns."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while (capacity := self._capacity(version_fn())) <= 0:
                remaining = poll_s if deadline is None else min(poll_s, deadline - time.monotonic())
                if remaining <= 0:
                    return 0
                self._cond.wait(remaining)
            return capacity

    @property
    def running(self) -> int:
        return self._running

    @property
    def accepted(self) -> int:
        return self._accepted

    @property
    def dropped(self) -> int:
        return self._dropped

    def _capacity(self, version: int) -> int:
        return (self.max_staleness + version + 1) * self.batch_size - (self._accepted + self._running)


def _check_bound(max_staleness: int, batch_size: int) -> None:
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0 (0 = synchronous), got {max_staleness}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1 (the trainer's samples per version), got {batch_size}")
