"""The proxy with a Hugging Face tokenizer and its chat template: tool calls parsed from the output and
rendered back, token-exact multi-turn histories (a call extends the ids the model saw and sampled),
edited histories stored as branches with their parent, and fields the proxy does not honour refused.

The tokenizer is a real byte-level BPE built locally (tests/hf_fixtures.py) with a chat template that
renders tools and Hermes-style ``<tool_call>`` blocks. The engine is scripted: it "samples" the ids of
given replies, so what the model says (a tool call, a special token inside a reply) is fixed and the
proxy's handling of it is what is tested. A real model behind a real ``rollbook proxy`` is in
tests/integration/test_proxy_hf.py.

Run: python -m pytest tests/unit/rollout/test_proxy_hf.py -q
"""

from __future__ import annotations

import asyncio
import json

import pytest

from rollbook.config import ProxyConfig
from rollbook.rollout.engine import GenerationResult
from rollbook.rollout.proxy.core import Proxy
from rollbook.rollout.proxy.render import HermesToolParser, HFRenderer
from rollbook.rollout.proxy.schemas import ApiError
from rollbook.rollout.proxy.streaming import TokenStream
from tests.hf_fixtures import USER, save_bpe_tokenizer
from tests.unit.rollout.test_proxy import _FakeStore

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "mul",
            "description": "Multiply two numbers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
        },
    }
]


@pytest.fixture(scope="module")
def render(tmp_path_factory):
    return HFRenderer(str(save_bpe_tokenizer(tmp_path_factory.mktemp("tok"))))


class ScriptedEngine:
    """Answers each request with the next scripted reply: its ids (text encoded, or ids as given) and
    the eos, log-prob -0.25 each, version 0. No per-token callback: streams go out once generated."""

    version = 0

    def __init__(self, render: HFRenderer, replies: list[str | list[int]]):
        self.render, self.replies = render, list(replies)
        self.prompts: list[list[int]] = []

    def generate(self, requests, *, seed=None):
        out = []
        for r in requests:
            reply = self.replies.pop(0)
            ids = self.render.hf.encode(reply, add_special_tokens=False) if isinstance(reply, str) else list(reply)
            ids = ids[: r.max_new_tokens - 1] + [self.render.eos_token_id]
            self.prompts.append(list(r.prompt_token_ids))
            out.append(
                GenerationResult(
                    request_id="r",
                    prompt_token_ids=list(r.prompt_token_ids),
                    output_token_ids=ids,
                    output_logprobs=[-0.25] * len(ids),
                    output_versions=[0] * len(ids),
                    finish_reason="stop",
                    temperature=r.temperature,
                    top_p=r.top_p,
                    top_k=r.top_k,
                )
            )
        return out


async def _call(proxy: Proxy, key: str, body: dict) -> dict:
    body = {"model": "tiny", "max_tokens": 200, **body}
    payload, deliver, _ = await proxy.complete("chat", {"authorization": f"Bearer {key}"}, body)
    deliver(True)
    return payload


def _rows(store: _FakeStore) -> dict[str, dict]:
    return {t["request_id"]: t for t in store.submitted}


def test_a_three_turn_tool_session_extends_the_sampled_ids_and_an_edited_history_is_a_branch(render):
    answer = render.hf.encode(" is ", add_special_tokens=False)
    special = render.hf.convert_tokens_to_ids(USER)
    engine = ScriptedEngine(
        render,
        [
            '<tool_call>{"name": "mul", "arguments": {"a": 3, "b": 7}}</tool_call>',
            # a special token inside the reply: the text leaves it out, re-rendering would lose it
            render.hf.encode("It", add_special_tokens=False)
            + [special]
            + answer
            + render.hf.encode("21", add_special_tokens=False),
            "Yes.",
            "It is 20",
        ],
    )
    store = _FakeStore()

    async def scenario():
        proxy = Proxy(ProxyConfig(), engine, store, admin_key=None, worker_key=None, render=render)
        session, key = proxy.sessions.start(task_id="t", domain="d", group_id="", group_size=1)
        history = [{"role": "user", "content": "What is 3 times 7?"}]
        first = await _call(proxy, key, {"messages": history, "tools": TOOLS})
        message = first["choices"][0]["message"]
        history += [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "21"}]
        second = await _call(proxy, key, {"messages": history, "tools": TOOLS})
        history += [second["choices"][0]["message"], {"role": "user", "content": "Sure?"}]
        third = await _call(proxy, key, {"messages": history, "tools": TOOLS})
        # the agent rewrites its history: the tool call is gone, the first answer edited
        edited = [
            {"role": "user", "content": "What is 3 times 7?"},
            {"role": "assistant", "content": "21"},
            {"role": "user", "content": "Sure?"},
        ]
        await _call(proxy, key, {"messages": edited, "tools": TOOLS})
        await proxy.end(session)
        proxy.submitter.close()
        proxy.close()
        return first, second, third, session.summary(), history

    first, second, third, summary, third_messages = asyncio.run(scenario())
    choice = first["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "mul"
    assert json.loads(call["function"]["arguments"]) == {"a": 3, "b": 7}
    assert second["choices"][0]["message"] == {"role": "assistant", "content": "It is 21"}

    rows = _rows(store)
    assert len(rows) == 4
    for k in (0, 1):  # turn k+1's prompt starts with turn k's prompt + sampled ids
        before, after = rows[f"turn-{k}.0"], rows[f"turn-{k + 1}.0"]
        history = list(before["prompt_token_ids"]) + list(before["output_token_ids"])
        assert list(after["prompt_token_ids"][: len(history)]) == history, k
    # the special token sampled inside turn 1's reply is in turn 2's prompt; rendering the messages
    # afresh would have lost it (the text leaves it out)
    rerendered = render.render(third_messages, TOOLS, True)
    assert rows["turn-2.0"]["prompt_token_ids"].count(special) == rerendered.count(special) + 1
    assert list(rows["turn-2.0"]["prompt_token_ids"]) != rerendered
    links = [(c["turn"], c["parent_request_id"], c["branched"]) for c in summary["calls"]]
    assert links == [(0, "", False), (1, "turn-0.0", False), (2, "turn-1.0", False), (3, "turn-0.0", True)]
    # the branch is rendered afresh from its messages
    assert engine.prompts[3] == render.render(
        [
            {"role": "user", "content": "What is 3 times 7?"},
            {"role": "assistant", "content": "21"},
            {"role": "user", "content": "Sure?"},
        ],
        TOOLS,
        True,
    )


def test_a_streamed_tool_call_sends_the_content_then_the_parsed_calls(render):
    text = 'Let me compute. <tool_call>{"name": "mul", "arguments": {"a": 2, "b": 5}}</tool_call>'
    store = _FakeStore()

    async def scenario():
        proxy = Proxy(ProxyConfig(), ScriptedEngine(render, [text, text]), store, admin_key=None, worker_key=None, render=render)
        session, key = proxy.sessions.start(task_id="t", domain="d", group_id="", group_size=1)
        headers = {"authorization": f"Bearer {key}"}
        body = {"model": "tiny", "max_tokens": 200, "messages": [{"role": "user", "content": "2 times 5?"}], "tools": TOOLS}
        whole = await _call(proxy, key, body)
        stream = await proxy.complete("chat", headers, {**body, "stream": True})
        assert isinstance(stream, TokenStream)

        async def connected() -> bool:
            return False

        events = [e async for e in stream.events(connected)]
        proxy.submitter.close()
        proxy.close()
        return whole, events

    whole, raw = asyncio.run(scenario())
    events = [json.loads(e.decode().removeprefix("data: ")) for e in raw[:-1]]
    assert raw[-1] == b"data: [DONE]\n\n"
    deltas = [e["choices"][0]["delta"] for e in events]
    content = "".join(d.get("content") or "" for d in deltas)
    [calls] = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert content == whole["choices"][0]["message"]["content"] == "Let me compute. "
    assert "<tool_call>" not in content
    assert [(c["index"], c["function"]) for c in calls] == [(0, {"name": "mul", "arguments": json.dumps({"a": 2, "b": 5})})]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_fields_the_proxy_does_not_honour_are_refused_and_neutral_values_pass(render):
    async def scenario():
        proxy = Proxy(
            ProxyConfig(), ScriptedEngine(render, ["ok", "ok"]), _FakeStore(), admin_key=None, worker_key=None, render=render
        )
        _, key = proxy.sessions.start(task_id="t", domain="d", group_id="", group_size=1)
        base = {"messages": [{"role": "user", "content": "hi"}]}
        errors = {}
        for name, extra in {
            "min_p": {"min_p": 0.1},
            "presence_penalty": {"presence_penalty": 0.5},
            "logit_bias": {"logit_bias": {"5": 10}},
            "functions": {"functions": [{"name": "f"}]},
            "tool_choice": {"tools": TOOLS, "tool_choice": "required"},
        }.items():
            with pytest.raises(ApiError) as refused:
                await _call(proxy, key, {**base, **extra})
            errors[name] = refused.value
        fine = await _call(proxy, key, {**base, "presence_penalty": 0, "user": "u-1", "parallel_tool_calls": False})
        proxy.submitter.close()
        proxy.close()
        return errors, fine

    errors, fine = asyncio.run(scenario())
    for name, error in errors.items():
        assert error.status == 400 and error.param == name, (name, error.body())
        assert error.code in ("unsupported_parameter", "unsupported_value"), (name, error.body())
    assert fine["choices"][0]["message"]["content"] == "ok"


def test_the_hermes_parser_keeps_a_malformed_block_as_content():
    parser = HermesToolParser()
    assert parser.parse('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>') == (
        "",
        [{"name": "f", "arguments": {"x": 1}}],
    )
    text = "<tool_call>not json</tool_call> and <tool_call>[1, 2]</tool_call>"
    assert parser.parse(text) == (text, [])
    assert parser.parse('a <tool_call>{"name": "g", "arguments": {}}</tool_call> b') == ("a  b", [{"name": "g", "arguments": {}}])


def test_a_long_session_plans_each_call_against_the_conversations_it_shares_a_first_message_with(render, monkeypatch):
    """An agent that runs many separate conversations in one session: a new call is matched only
    against the earlier calls whose history starts with its first message, not against every call the
    session ever made (which made each call's cost grow with the session)."""
    from rollbook.rollout.proxy import history as history_module

    conversations = 40
    engine = ScriptedEngine(render, ["ok"] * conversations + ["done"])
    store = _FakeStore()
    compared = []
    real = history_module.same_message
    monkeypatch.setattr(history_module, "same_message", lambda a, b: compared.append(1) or real(a, b))

    async def scenario():
        proxy = Proxy(ProxyConfig(), engine, store, admin_key=None, worker_key=None, render=render)
        session, key = proxy.sessions.start(task_id="t", domain="d", group_id="", group_size=1)
        for i in range(conversations):
            await _call(proxy, key, {"messages": [{"role": "user", "content": f"What is {i} times 2?"}]})
        compared.clear()
        follow = [
            {"role": "user", "content": "What is 5 times 2?"},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "Sure?"},
        ]
        await _call(proxy, key, {"messages": follow})
        await proxy.end(session)
        proxy.submitter.close()
        proxy.close()

    asyncio.run(scenario())
    rows = _rows(store)
    last, parent = rows[f"turn-{conversations}.0"], rows["turn-5.0"]
    assert last["parent_request_id"] == "turn-5.0" and not last["branched"]
    history = list(parent["prompt_token_ids"]) + list(parent["output_token_ids"])
    assert list(last["prompt_token_ids"][: len(history)]) == history
    assert len(compared) <= 3  # the one conversation that shares the first message, not all 40


def test_a_session_that_repeats_one_question_branches_each_call_from_the_first_without_rereading_all(render, monkeypatch):
    """The same one-message chat sent again and again (a group sampled in one session): each call is a
    branch of the first (the earliest call sharing the most), found without comparing every earlier call."""
    from rollbook.rollout.proxy import history as history_module

    repeats = 30
    store = _FakeStore()
    compared = []
    real = history_module.same_message
    monkeypatch.setattr(history_module, "same_message", lambda a, b: compared.append(1) or real(a, b))

    async def scenario():
        proxy = Proxy(
            ProxyConfig(), ScriptedEngine(render, ["ok"] * repeats), store, admin_key=None, worker_key=None, render=render
        )
        session, key = proxy.sessions.start(task_id="t", domain="d", group_id="", group_size=1)
        for i in range(repeats):
            if i == repeats - 1:
                compared.clear()
            await _call(proxy, key, {"messages": [{"role": "user", "content": "What is 3 times 7?"}]})
        await proxy.end(session)
        proxy.submitter.close()
        proxy.close()
        return session.summary()

    summary = asyncio.run(scenario())
    links = [(c["parent_request_id"], c["branched"]) for c in summary["calls"]]
    assert links == [("", False)] + [("turn-0.0", True)] * (repeats - 1)
    assert len(compared) <= 2
