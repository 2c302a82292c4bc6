"""Admission of completions to the engine (``Gate``): concurrency, a bounded wait, pauses."""

import asyncio

from rollbook.rollout.proxy.schemas import ApiError


class Gate:
    """Admission of completions to the engine: at most ``max_concurrent`` at once, ``max_waiting``
    waiting (more: 429); while paused (admin pause, a weight load) new ones wait up to ``wait_s``
    (then 503). In-flight completions are never stopped."""

    def __init__(self, max_concurrent: int, max_waiting: int, wait_s: float):
        self.max_concurrent, self.max_waiting, self.wait_s = max_concurrent, max_waiting, wait_s
        self.running = self.waiting = 0
        self.paused: set[str] = set()
        self._cond = asyncio.Condition()

    async def admit(self) -> None:
        async with self._cond:
            if self.running + self.waiting >= self.max_concurrent + self.max_waiting:
                raise ApiError(
                    429,
                    f"overloaded: {self.running} completions running and {self.waiting} waiting "
                    "(max_concurrent, max_waiting); retry later",
                    code="overloaded",
                )
            self.waiting += 1
            try:
                await asyncio.wait_for(
                    self._cond.wait_for(lambda: not self.paused and self.running < self.max_concurrent), self.wait_s
                )
            except TimeoutError:
                why = ", ".join(sorted(self.paused)) or "busy"
                raise ApiError(
                    503,
                    f"not admitted within {self.wait_s:g} s (admission_wait_s): engine {why}; retry later",
                    code="engine_unavailable",
                ) from None
            finally:
                self.waiting -= 1
            self.running += 1

    async def release(self) -> None:
        async with self._cond:
            self.running -= 1
            self._cond.notify_all()

    async def pause(self, reason: str) -> None:
        async with self._cond:
            self.paused.add(reason)

    async def resume(self, reason: str) -> None:
        async with self._cond:
            self.paused.discard(reason)
            self._cond.notify_all()
