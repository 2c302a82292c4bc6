"""OpenAI-format response bodies of a finished completion, and its server-sent events."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rollbook.rollout.engine import GenerationResult

if TYPE_CHECKING:  # the payloads read the proxy's renderer, engine version and model id
    from rollbook.rollout.proxy.core import Proxy


def _usage(results: Sequence[GenerationResult]) -> dict:
    prompt = len(results[0].prompt_token_ids)
    completion = sum(len(r.output_token_ids) for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _rollbook_extra(proxy: Proxy, results: Sequence[GenerationResult], turn: int) -> dict:
    return {"turn": turn, "version": proxy.engine.version, "output_versions": [r.output_versions for r in results]}


def chat_payload(proxy: Proxy, req: Any, completion_id: str, results: Sequence[GenerationResult], turn: int) -> dict:
    choices = []
    for i, r in enumerate(results):
        logprobs = None
        if req.logprobs:
            logprobs = {
                "content": [
                    {"token": (t := proxy.render.token_text(tok)), "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                    for tok, lp in zip(r.output_token_ids, r.output_logprobs)
                ],
                "refusal": None,
            }
        choices.append(
            {
                "index": i,
                "message": {"role": "assistant", "content": proxy.render.decode(r.output_token_ids)},
                "logprobs": logprobs,
                "finish_reason": r.finish_reason,
            }
        )
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
            offsets, at = [], 0
            for t in tokens:
                offsets.append(at)
                at += len(t)
            logprobs = {"tokens": tokens, "token_logprobs": list(r.output_logprobs), "top_logprobs": None, "text_offset": offsets}
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


def stream_chunks(proxy: Proxy, kind: str, payload: dict, include_usage: bool) -> list[bytes]:
    """The server-sent events of a finished completion: a role chunk (chat), one chunk per token of
    every choice, a finish chunk per choice, the usage chunk when asked, then ``[DONE]``."""
    events: list[dict] = []
    base = {
        "id": payload["id"],
        "created": payload["created"],
        "model": payload["model"],
        "system_fingerprint": payload["system_fingerprint"],
    }
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    for choice in payload["choices"]:
        i = choice["index"]
        if kind == "chat":
            events.append(
                {
                    **base,
                    "object": obj,
                    "choices": [
                        {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                    ],
                }
            )
            text = choice["message"]["content"]
            items = choice["logprobs"]["content"] if choice["logprobs"] else None
            pieces = _split(text, items)
            for piece, item in pieces:
                events.append(
                    {
                        **base,
                        "object": obj,
                        "choices": [
                            {
                                "index": i,
                                "delta": {"content": piece},
                                "logprobs": {"content": [item], "refusal": None} if item else None,
                                "finish_reason": None,
                            }
                        ],
                    }
                )
            events.append(
                {
                    **base,
                    "object": obj,
                    "choices": [{"index": i, "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}],
                }
            )
        else:
            lp = choice["logprobs"]
            pieces = _split(
                choice["text"], None if lp is None else list(zip(lp["tokens"], lp["token_logprobs"], lp["text_offset"]))
            )
            for piece, item in pieces:
                logprobs = None
                if item is not None:
                    logprobs = {"tokens": [item[0]], "token_logprobs": [item[1]], "top_logprobs": None, "text_offset": [item[2]]}
                events.append(
                    {**base, "object": obj, "choices": [{"index": i, "text": piece, "logprobs": logprobs, "finish_reason": None}]}
                )
            events.append(
                {
                    **base,
                    "object": obj,
                    "choices": [{"index": i, "text": "", "logprobs": None, "finish_reason": choice["finish_reason"]}],
                }
            )
    if include_usage:
        events.append({**base, "object": obj, "choices": [], "usage": payload["usage"]})
    return [f"data: {json.dumps(e)}\n\n".encode() for e in events] + [b"data: [DONE]\n\n"]


def _split(text: str, items: list | None) -> list[tuple[str, Any]]:
    """Per-token pieces of ``text`` (one character a token with the character tokenizer); with log-probs,
    one piece per output token (special tokens as empty text)."""
    if items is None:
        return [(ch, None) for ch in text]
    out, at = [], 0
    for item in items:
        token = item["token"] if isinstance(item, dict) else item[0]
        piece = text[at : at + len(token)] if text[at : at + len(token)] == token else ""
        at += len(piece)
        out.append((piece, item))
    return out
