"""OpenAI-format response bodies and server-sent events of completions.

The text of a reply is ``render.decode(output ids)``; ``TextPieces`` splits it into the piece each
output token adds (empty for a token the text leaves out, such as ``<eos>`` or ``<pad>``), so the
streamed deltas concatenate to the non-streamed text and ``text_offset`` indexes it. ``Chunks``
writes the events of one streamed completion; the proxy sends them as tokens are sampled
(``rollout/proxy/streaming.py``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rollbook.rollout.engine import GenerationResult
from rollbook.rollout.proxy.render import openai_tool_calls

if TYPE_CHECKING:  # the payloads read the proxy's renderer, engine version and model id
    from rollbook.rollout.proxy.core import Proxy
    from rollbook.rollout.proxy.render import Renderer

# tokens decoded again before the newest one: enough context for a tokenizer whose decoding of a
# token depends on its neighbours (a leading space, a multi-byte character split over tokens)
_CONTEXT_TOKENS = 6


class TextPieces:
    """The text each output token adds to the decoded reply, one token at a time. A token that ends
    inside a multi-byte character adds nothing until the character is whole; ``flush`` returns what
    is left at the end, so the pieces always concatenate to ``render.decode(ids)``."""

    def __init__(self, render: Renderer) -> None:
        self.render = render
        self.ids: list[int] = []
        self.text = ""  # what the pieces so far concatenate to
        self._prefix = 0  # ids[_prefix:_read] decode to the tail of text
        self._read = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self.render.decode(self.ids[self._prefix : self._read])
        after = self.render.decode(self.ids[self._prefix :])
        if len(after) <= len(before) or not after.startswith(before) or after.endswith("\ufffd"):
            return ""
        piece = after[len(before) :]
        self.text += piece
        self._prefix, self._read = max(0, len(self.ids) - _CONTEXT_TOKENS), len(self.ids)
        return piece

    def flush(self) -> str:
        whole = self.render.decode(self.ids)
        piece = whole[len(self.text) :] if whole.startswith(self.text) else ""
        self.text += piece
        return piece


class ToolCallHold:
    """Streamed text of a reply whose tool calls are parsed at the end: text goes out until a
    ``<tool_call>`` block may be starting, the rest waits for the end (``rest``), so the deltas are
    the answer's ``content`` and the calls go out whole, parsed."""

    MARK = "<tool_call>"

    def __init__(self) -> None:
        self.text = ""  # everything the reply has so far
        self.sent = ""  # what went out as content
        self.holding = False

    def push(self, piece: str) -> str:
        self.text += piece
        if self.holding:
            return ""
        at = self.text.find(self.MARK, len(self.sent))
        if at >= 0:
            self.holding = True
            out = self.text[len(self.sent) : at]
        else:  # keep back a tail that may be the start of the mark
            keep = next((k for k in range(len(self.MARK) - 1, 0, -1) if self.text.endswith(self.MARK[:k])), 0)
            out = self.text[len(self.sent) : len(self.text) - keep]
        if not (self.sent + out).strip():  # only whitespace so far: it is content only if text follows
            return ""
        self.sent += out
        return out

    def rest(self, content: str | None) -> str:
        """What of the final ``content`` has not gone out yet."""
        content = content or ""
        return content[len(self.sent) :] if content.startswith(self.sent) else ""


def token_pieces(render: Renderer, ids: Sequence[int]) -> list[str]:
    """Per output token, the text it adds; the last one also carries what ``flush`` returns."""
    pieces = TextPieces(render)
    out = [pieces.push(t) for t in ids]
    if out:
        out[-1] += pieces.flush()
    return out


def _tops(r: GenerationResult) -> list:
    return r.output_top_logprobs or [None] * len(r.output_token_ids)


def _usage(results: Sequence[GenerationResult]) -> dict:
    prompt = len(results[0].prompt_token_ids)
    completion = sum(len(r.output_token_ids) for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _rollbook_extra(proxy: Proxy, results: Sequence[GenerationResult], turn: int) -> dict:
    return {"turn": turn, "version": proxy.engine.version, "output_versions": [r.output_versions for r in results]}


def chat_logprob(render: Renderer, token: int, logprob: float, top: list | None = None) -> dict:
    """One position of a chat answer's ``logprobs.content``, with its ``top_logprobs`` when asked."""
    text = render.token_text(token)
    alternatives = []
    for other, value in top or []:
        other_text = render.token_text(other)
        alternatives.append({"token": other_text, "logprob": value, "bytes": list(other_text.encode())})
    return {"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": alternatives}


def text_top_logprobs(render: Renderer, top: list | None) -> dict | None:
    """One position of a completion's ``logprobs.top_logprobs``: token text to log-prob."""
    return None if top is None else {render.token_text(t): v for t, v in top}


def uses_tools(req: Any) -> bool:
    """Whether a (validated) chat request's output is parsed for tool calls."""
    return bool(getattr(req, "tools", None)) and getattr(req, "tool_choice", None) != "none"


def chat_reply(proxy: Proxy, req: Any, completion_id: str, index: int, r: GenerationResult) -> tuple[dict, str, dict]:
    """One choice of a chat answer: (its OpenAI message, its finish reason, the message as a history
    entry for ``history.py``: tool-call arguments as dicts). With tools, the calls the parser finds
    leave the content (it keeps the text around them) and the finish reason of a stopped reply with
    calls is ``tool_calls``."""
    text = proxy.render.decode(r.output_token_ids)
    parser = proxy.render.tool_parser
    if not uses_tools(req) or parser is None:
        return {"role": "assistant", "content": text}, r.finish_reason, {"role": "assistant", "content": text}
    content, calls = parser.parse(text)
    if not calls:
        return {"role": "assistant", "content": text}, r.finish_reason, {"role": "assistant", "content": text}
    tool_calls = openai_tool_calls(calls, completion_id, index)
    history = {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {**c, "function": {"name": c["function"]["name"], "arguments": a["arguments"]}} for c, a in zip(tool_calls, calls)
        ],
    }
    finish = "tool_calls" if r.finish_reason == "stop" else r.finish_reason
    return {"role": "assistant", "content": content or None, "tool_calls": tool_calls}, finish, history


def chat_payload(proxy: Proxy, req: Any, completion_id: str, results: Sequence[GenerationResult], turn: int) -> dict:
    choices = []
    for i, r in enumerate(results):
        logprobs = None
        if req.logprobs:
            logprobs = {
                "content": [
                    chat_logprob(proxy.render, tok, lp, top)
                    for tok, lp, top in zip(r.output_token_ids, r.output_logprobs, _tops(r))
                ],
                "refusal": None,
            }
        message, finish, _ = chat_reply(proxy, req, completion_id, i, r)
        choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish})
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": proxy.config.model_id,
        "choices": choices,
        "usage": _usage(results),
        "system_fingerprint": f"v{proxy.engine.version}",
        "rollbook": _rollbook_extra(proxy, results, turn),
    }


def text_payload(proxy: Proxy, req: Any, completion_id: str, results: Sequence[GenerationResult], turn: int) -> dict:
    choices = []
    for i, r in enumerate(results):
        logprobs = None
        if req.logprobs is not None:
            tokens = [proxy.render.token_text(t) for t in r.output_token_ids]
            offsets, at = [], 0  # where each token's text starts in the reply text
            for piece in token_pieces(proxy.render, r.output_token_ids):
                offsets.append(at)
                at += len(piece)
            tops = [text_top_logprobs(proxy.render, t) for t in _tops(r)] if req.logprobs else None
            logprobs = {"tokens": tokens, "token_logprobs": list(r.output_logprobs), "top_logprobs": tops, "text_offset": offsets}
        choices.append(
            {"index": i, "text": proxy.render.decode(r.output_token_ids), "logprobs": logprobs, "finish_reason": r.finish_reason}
        )
    return {
        "id": completion_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": proxy.config.model_id,
        "choices": choices,
        "usage": _usage(results),
        "system_fingerprint": f"v{proxy.engine.version}",
        "rollbook": _rollbook_extra(proxy, results, turn),
    }


class Chunks:
    """The server-sent events of one streamed completion, as the OpenAI API sends them: per choice a
    role chunk (chat), a chunk per output token (with its log-prob when asked; a token that adds no
    text and carries no log-prob sends nothing), a finish chunk; then the usage chunk when asked, and
    ``[DONE]``. ``text_offset`` (completions) indexes the choice's text."""

    def __init__(self, proxy: Proxy, kind: str, req: Any, completion_id: str, created: int | None = None) -> None:
        self.render, self.kind = proxy.render, kind
        self.logprobs = bool(req.logprobs) if kind == "chat" else req.logprobs is not None
        self.base = {
            "id": completion_id,
            "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
            "created": int(time.time()) if created is None else created,
            "model": proxy.config.model_id,
            "system_fingerprint": f"v{proxy.engine.version}",
        }
        self._offsets: dict[int, int] = {}

    def _event(self, choice: dict | None, **extra: Any) -> bytes:
        body = {**self.base, "choices": [] if choice is None else [choice], **extra}
        return f"data: {json.dumps(body)}\n\n".encode()

    def role(self, index: int) -> list[bytes]:
        if self.kind != "chat":
            return []
        return [
            self._event({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None})
        ]

    def token(self, index: int, token: int | None, logprob: float | None, piece: str, top: list | None = None) -> list[bytes]:
        """The event of one output token (``token`` None: text with no token of its own, a flush)."""
        with_logprob = self.logprobs and token is not None
        if not piece and not with_logprob:
            return []
        at = self._offsets.get(index, 0)
        self._offsets[index] = at + len(piece)
        logprobs: dict[str, Any] | None = None
        if self.kind == "chat":
            if with_logprob:
                logprobs = {"content": [chat_logprob(self.render, token, logprob, top)], "refusal": None}
            return [self._event({"index": index, "delta": {"content": piece}, "logprobs": logprobs, "finish_reason": None})]
        if with_logprob:
            text = self.render.token_text(token)
            tops = [text_top_logprobs(self.render, top)] if top is not None else None
            logprobs = {"tokens": [text], "token_logprobs": [logprob], "top_logprobs": tops, "text_offset": [at]}
        return [self._event({"index": index, "text": piece, "logprobs": logprobs, "finish_reason": None})]

    def tool_calls(self, index: int, calls: list[dict]) -> list[bytes]:
        """The parsed calls of a chat choice, whole, in one delta."""
        if not calls:
            return []
        deltas = [{"index": j, **call} for j, call in enumerate(calls)]
        return [self._event({"index": index, "delta": {"tool_calls": deltas}, "logprobs": None, "finish_reason": None})]

    def finish(self, index: int, finish_reason: str) -> list[bytes]:
        if self.kind == "chat":
            return [self._event({"index": index, "delta": {}, "logprobs": None, "finish_reason": finish_reason})]
        return [self._event({"index": index, "text": "", "logprobs": None, "finish_reason": finish_reason})]

    def end(self, usage: dict | None) -> list[bytes]:
        return ([self._event(None, usage=usage)] if usage is not None else []) + [b"data: [DONE]\n\n"]

    def error(self, body: dict) -> bytes:
        return f"data: {json.dumps(body)}\n\n".encode()
