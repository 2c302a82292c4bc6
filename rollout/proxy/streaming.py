"""A streamed completion whose tokens leave as the engine samples them.

The engine's scheduler thread calls the proxy back for every sampled token; the callback puts
``(choice, token, logprob)`` on the stream's queue through the event loop, and ``events`` turns each
into a server-sent event at once. When every choice has finished, ``outcome`` holds the attempt
(durable with ``spool_dir``) and builds its answer; only then go the finish chunks, the usage
chunk and ``[DONE]``. So a caller that saw ``[DONE]`` got an answer that a restarted proxy still
submits, and a caller that did not (it left, or the proxy died) got no finished answer.

Delivery: the connection is checked before every event, and an attempt whose ``[DONE]`` was
written to an open connection is delivered, even when the caller hangs up at once (the openai
client closes its response on ``[DONE]``, before the chunked body's end arrives). A caller that
leaves mid-stream stops the events, not the generation: the attempt is recorded unconsumed once it
finishes.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from rollbook.rollout.proxy.payloads import Chunks, TextPieces, ToolCallHold, uses_tools
from rollbook.rollout.proxy.schemas import ApiError

if TYPE_CHECKING:
    from rollbook.rollout.proxy.core import Proxy

log = logging.getLogger("rollbook.proxy")


class TokenStream:
    """One streamed completion in flight: its token queue and the task that finishes it."""

    def __init__(self, proxy: Proxy, kind: str, req: Any, completion_id: str, turn: int, num_choices: int) -> None:
        self.proxy, self.kind, self.req, self.turn = proxy, kind, req, turn
        self.num_choices = num_choices
        self.chunks = Chunks(proxy, kind, req, completion_id)
        self.queue: asyncio.Queue[tuple[int, int, float, list | None] | None] = asyncio.Queue()
        self.outcome: asyncio.Task[tuple[dict, Callable[[bool], None]]]  # set by Proxy._stream
        self._settled = False

    def events(self, is_disconnected: Callable[[], Awaitable[bool]]) -> AsyncIterator[bytes]:
        """The server-sent events; the attempt's delivery is recorded when they end, however they end
        (also when the response never started: then when the iterator is dropped)."""
        events = self._events(is_disconnected)
        weakref.finalize(events, self._settle, None)
        return events

    async def _events(self, is_disconnected: Callable[[], Awaitable[bool]]) -> AsyncIterator[bytes]:
        chunks, delivered = self.chunks, None
        pieces = [TextPieces(self.proxy.render) for _ in range(self.num_choices)]
        holds = [ToolCallHold() for _ in range(self.num_choices)] if self.kind == "chat" and uses_tools(self.req) else None
        try:
            for i in range(self.num_choices):
                for event in chunks.role(i):
                    yield event
            while (item := await self.queue.get()) is not None:
                i, token, logprob, top = item
                piece = pieces[i].push(token)
                if holds is not None:
                    piece = holds[i].push(piece)
                for event in chunks.token(i, token, logprob, piece, top):
                    if await is_disconnected():
                        return
                    yield event
            try:
                payload, deliver = await self.outcome
            except ApiError as exc:
                yield chunks.error(exc.body())
                return
            tail = []
            for i, choice in enumerate(payload["choices"]):
                last = pieces[i].flush()
                if holds is None:
                    tail += chunks.token(i, None, None, last)
                else:
                    holds[i].push(last)
                    tail += chunks.token(i, None, None, holds[i].rest(choice["message"]["content"]))
                    tail += chunks.tool_calls(i, choice["message"].get("tool_calls") or [])
                tail += chunks.finish(i, choice["finish_reason"])
            usage = payload["usage"] if (self.req.stream_options or {}).get("include_usage") else None
            for event in tail + chunks.end(usage):
                if await is_disconnected():
                    return
                yield event
            delivered = True  # [DONE] went out on an open connection: the caller has the whole answer
        finally:
            self._settle(delivered)

    def _settle(self, delivered: bool | None) -> None:
        """Record the attempt: ``delivered`` as the stream ended; None (it ended early) as not
        delivered, once generation finishes. Only the first call counts."""
        if self._settled:
            return
        self._settled = True

        def record(task: asyncio.Task) -> None:
            if task.cancelled() or task.exception() is not None:
                return
            task.result()[1](bool(delivered))

        if self.outcome.done():
            record(self.outcome)
        else:
            self.outcome.add_done_callback(record)
