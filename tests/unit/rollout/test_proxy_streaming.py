"""Streamed completions on the batched engine: tokens leave as they are sampled, the answer is held
before its finish events, a caller that leaves mid-stream gets its attempt recorded unconsumed, and
the text pieces of the tokens index the reply text (rollout/proxy/streaming.py, payloads.py).

The engine is the real ``NativeEngine`` over the proxy's default tiny model; a thin wrapper stops
its scheduler after the first sampled token until the test lets it go, so "the first token left
before the generation finished" is shown by order, not by timing.

Run: python -m pytest tests/unit/rollout/test_proxy_streaming.py -q
"""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from rollbook.config import ModelConfig, ProxyConfig
from rollbook.language_models import build_student
from rollbook.rollout.engine import NativeEngine
from rollbook.rollout.proxy.core import Proxy
from rollbook.rollout.proxy.payloads import TextPieces, token_pieces
from rollbook.rollout.proxy.render import CharRenderer
from rollbook.rollout.proxy.streaming import TokenStream
from rollbook.tasks import TOKENIZER
from tests.unit.rollout.test_proxy import _FakeEngine, _FakeStore

PROMPT = {"model": "tiny", "messages": [{"role": "user", "content": "12+34="}]}


class _FirstTokenGate:
    """A ``NativeEngine`` whose scheduler waits after each request's first token until ``go`` is set."""

    def __init__(self) -> None:
        self.engine = NativeEngine(build_student(ModelConfig()), version=0, seed=0)
        self.first = threading.Event()
        self.go = threading.Event()
        self.version = 0

    def submit(self, request, *, seed=None, index=0, on_token=None):
        sampled = []

        def hook(token, logprob, version, *top):
            sampled.append(token)
            if len(sampled) == 1:
                self.first.set()
            on_token(token, logprob, version, *top)
            if len(sampled) == 1:
                assert self.go.wait(30), "the test never let the engine go on"

        return self.engine.submit(request, seed=seed, index=index, on_token=hook)

    def generate(self, requests, *, seed=None):
        return self.engine.generate(requests, seed=seed)


def _events(raw: list[bytes]) -> list[dict | str]:
    out: list[dict | str] = []
    for event in raw:
        text = event.decode().removeprefix("data: ").strip()
        out.append(text if text == "[DONE]" else json.loads(text))
    return out


async def _start(engine, store, body: dict):
    proxy = Proxy(ProxyConfig(), engine, store, admin_key=None, worker_key=None)
    session, key = proxy.sessions.start(task_id="t", domain="d", group_id="", group_size=1)
    answer = await proxy.complete("chat", {"authorization": f"Bearer {key}"}, body)
    return proxy, session, answer


def test_the_first_token_leaves_before_the_generation_finishes_and_the_answer_is_held_before_its_finish():
    gate = _FirstTokenGate()
    store = _FakeStore()

    async def scenario():
        proxy, session, stream = await _start(gate, store, {**PROMPT, "stream": True, "max_tokens": 64, "logprobs": True})
        assert isinstance(stream, TokenStream)

        async def connected() -> bool:
            return False

        events = stream.events(connected)
        got = [await anext(events)]  # the role chunk
        while not (isinstance(e := _events([await anext(events)])[0], dict) and e["choices"][0]["logprobs"]):
            got.append(e)
        # a sampled token reached the caller while the engine is stopped after it: nothing finished
        assert gate.first.is_set() and not stream.outcome.done()
        assert proxy.counters["completions"] == 0 and proxy.status()["running"] == 1
        gate.go.set()
        rest = []
        async for raw in events:
            event = _events([raw])[0]
            if isinstance(event, dict) and event["choices"] and event["choices"][0]["finish_reason"]:
                assert proxy.counters["completions"] == 1  # held (durable with spool_dir) before the finish event
            rest.append(event)
        await proxy.end(session)
        proxy.submitter.close()
        proxy.close()
        return [e, *rest]

    tokens_and_tail = asyncio.run(scenario())
    gate.engine.close()
    assert tokens_and_tail[-1] == "[DONE]"
    token_events = [e for e in tokens_and_tail if isinstance(e, dict) and e["choices"][0]["logprobs"]]
    [row] = store.submitted
    assert row["consumed"] is True
    # one event per sampled token, in order, with the stored log-probs; the deltas are the stored text
    assert [e["choices"][0]["logprobs"]["content"][0]["logprob"] for e in token_events] == pytest.approx(
        list(row["output_logprobs"]), abs=0
    )
    assert "".join(e["choices"][0]["delta"]["content"] for e in token_events) == TOKENIZER.decode(row["output_token_ids"])


def test_a_caller_that_leaves_mid_stream_gets_its_attempt_recorded_unconsumed_once_generated():
    gate = _FirstTokenGate()
    store = _FakeStore()

    async def scenario():
        proxy, session, stream = await _start(gate, store, {**PROMPT, "stream": True, "max_tokens": 32})
        left = False

        async def disconnected() -> bool:
            return left

        events = stream.events(disconnected)
        await anext(events)  # the role chunk
        while not gate.first.is_set():
            await asyncio.sleep(0.01)
        left = True  # the client hangs up after the first token
        gate.go.set()
        assert [e async for e in events] == []  # nothing more is sent
        await stream.outcome
        await proxy.end(session)
        proxy.submitter.close()
        proxy.close()
        return proxy

    proxy = asyncio.run(scenario())
    gate.engine.close()
    [row] = store.submitted
    assert row["consumed"] is False and len(row["output_token_ids"]) >= 1
    assert proxy.counters["undelivered"] == 1


def test_a_caller_that_hangs_up_right_after_done_got_a_delivered_answer():
    """The openai client closes its response on ``[DONE]``, before the chunked body's end: the
    proxy may see the hang-up before the stream's generator returns. The answer was delivered."""
    store = _FakeStore()

    async def scenario():
        proxy, session, stream = await _start(_FakeEngine(), store, {**PROMPT, "stream": True})
        done_sent = False

        async def disconnected() -> bool:
            return done_sent

        events = []
        async for raw in stream.events(disconnected):
            events.append(raw)
            done_sent = raw.strip().endswith(b"[DONE]")
        await proxy.end(session)
        proxy.submitter.close()
        proxy.close()
        return proxy, events

    proxy, events = asyncio.run(scenario())
    assert _events(events)[-1] == "[DONE]"
    [row] = store.submitted
    assert row["consumed"] is True
    assert proxy.counters["delivered"] == 1 and proxy.counters["undelivered"] == 0


def test_a_stream_whose_events_never_start_is_recorded_unconsumed():
    store = _FakeStore()

    async def scenario():
        proxy, session, stream = await _start(_FakeEngine(), store, {**PROMPT, "stream": True})

        async def connected() -> bool:
            return False

        stream.events(connected)  # the response never began: the iterator is dropped unstarted
        await stream.outcome
        await asyncio.sleep(0)
        await proxy.end(session)
        proxy.submitter.close()
        proxy.close()

    asyncio.run(scenario())
    [row] = store.submitted
    assert row["consumed"] is False


def test_an_engine_without_token_callbacks_streams_its_finished_answer():
    store = _FakeStore()

    async def scenario():
        proxy, session, stream = await _start(
            _FakeEngine(), store, {**PROMPT, "stream": True, "n": 2, "stream_options": {"include_usage": True}}
        )

        async def connected() -> bool:
            return False

        events = _events([e async for e in stream.events(connected)])
        await proxy.end(session)
        proxy.submitter.close()
        proxy.close()
        return events

    events = asyncio.run(scenario())
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 4
    for index in (0, 1):
        mine = [e["choices"][0] for e in events[:-2] if e["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""} and mine[-1]["finish_reason"] == "length"
        assert "".join(c["delta"].get("content", "") for c in mine) == TOKENIZER.decode([5, 5])
    assert len(store.submitted) == 2 and all(t["consumed"] for t in store.submitted)


def test_text_pieces_leave_out_special_tokens_so_offsets_index_the_text():
    render = CharRenderer()
    pad, bos = TOKENIZER.pad_token_id, TOKENIZER.bos_token_id
    ids = [TOKENIZER.encode("1")[0], pad, TOKENIZER.encode("2")[0], bos, TOKENIZER.encode("3")[0], TOKENIZER.eos_token_id]
    pieces = token_pieces(render, ids)
    assert pieces == ["1", "", "2", "", "3", ""]
    assert "".join(pieces) == render.decode(ids) == "123"


class _Utf8Bytes:
    """A byte-level renderer: token i is byte i; decoding replaces an incomplete character with U+FFFD."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def test_a_character_split_over_tokens_is_sent_once_it_is_whole():
    pieces = TextPieces(_Utf8Bytes())  # type: ignore[arg-type]
    ids = list("a€b😀".encode())
    out = [pieces.push(t) for t in ids] + [pieces.flush()]
    assert [p for p in out if p] == ["a", "€", "b", "😀"]
    assert "".join(out) == "a€b😀"


def test_completion_text_offsets_index_the_text_when_a_token_adds_none():
    """``/v1/completions`` ``logprobs.text_offset``: a special token (``<pad>``, five characters as a
    token string) adds nothing to the text, so it moves no offset."""
    from rollbook.rollout.engine import GenerationResult
    from rollbook.rollout.proxy.payloads import text_payload
    from rollbook.rollout.proxy.schemas import CompletionRequest

    one, two = TOKENIZER.encode("1")[0], TOKENIZER.encode("2")[0]
    ids = [one, TOKENIZER.pad_token_id, two, two]
    done = GenerationResult(
        request_id="r",
        prompt_token_ids=[1, 4],
        output_token_ids=ids,
        output_logprobs=[-0.1] * 4,
        output_versions=[0] * 4,
        finish_reason="length",
        temperature=1.0,
        top_p=1.0,
        top_k=0,
    )
    proxy = Proxy(ProxyConfig(), _FakeEngine(), _FakeStore(), admin_key=None, worker_key=None)
    req = CompletionRequest.model_validate({"model": "tiny", "prompt": "1+1=", "logprobs": 0})
    [choice] = text_payload(proxy, req, "cmpl-x", [done], 0)["choices"]
    proxy.close()
    text, lp = choice["text"], choice["logprobs"]
    assert text == "122" and lp["tokens"] == ["1", "<pad>", "2", "2"]
    assert lp["text_offset"] == [0, 1, 1, 2]
    assert [text[o : o + 1] for o in lp["text_offset"]] == ["1", "2", "2", "2"]


def test_top_logprobs_and_seed_are_served_streamed_or_not():
    """``top_logprobs`` lists the most likely tokens of the distribution the token was sampled from
    (the sampled one among them at temperature 0, first); a ``seed`` gives the same choices, streamed
    or not."""
    engine = NativeEngine(build_student(ModelConfig()), version=0, seed=0)
    store = _FakeStore()
    body = {**PROMPT, "max_tokens": 12, "logprobs": True, "top_logprobs": 3, "n": 2, "seed": 11}

    async def scenario():
        proxy = Proxy(ProxyConfig(), engine, store, admin_key=None, worker_key=None)
        _, key = proxy.sessions.start(task_id="t", domain="d", group_id="", group_size=1)
        headers = {"authorization": f"Bearer {key}"}
        whole, deliver, _ = await proxy.complete("chat", headers, body)
        deliver(True)
        greedy, deliver, _ = await proxy.complete("chat", headers, {**body, "temperature": 0, "n": 1})
        deliver(True)
        stream = await proxy.complete("chat", headers, {**body, "stream": True})

        async def connected() -> bool:
            return False

        events = _events([e async for e in stream.events(connected)])
        proxy.submitter.close()
        proxy.close()
        return whole, greedy, events

    whole, greedy, events = asyncio.run(scenario())
    engine.close()
    for position in greedy["choices"][0]["logprobs"]["content"]:
        tops = position["top_logprobs"]
        assert len(tops) == 3 and [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)
        assert (tops[0]["token"], tops[0]["logprob"]) == (position["token"], position["logprob"])
    streamed = {0: [], 1: []}
    for e in events[:-1]:
        for c in e["choices"]:
            if c.get("logprobs"):
                streamed[c["index"]] += c["logprobs"]["content"]
    for i, choice in enumerate(whole["choices"]):
        assert [p["token"] for p in streamed[i]] == [p["token"] for p in choice["logprobs"]["content"]]
        for got, want in zip(streamed[i], choice["logprobs"]["content"]):  # values up to the batch's float order
            assert [t["token"] for t in got["top_logprobs"]] == [t["token"] for t in want["top_logprobs"]]
            assert [t["logprob"] for t in got["top_logprobs"]] == pytest.approx(
                [t["logprob"] for t in want["top_logprobs"]], abs=1e-5
            )
    assert whole["choices"][0]["logprobs"] != whole["choices"][1]["logprobs"]  # two choices, two draws
