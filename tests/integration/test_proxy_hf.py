"""``rollbook proxy`` serving a locally built Hugging Face model (a byte-level BPE tokenizer whose chat
template renders tools and Hermes ``<tool_call>`` blocks, and a tiny Llama) beside a real store,
through the official ``openai`` client: a three-turn tool-using session, streamed and not, stored token
for token, and an edited history stored as a branch of its parent.

The tiny model is first taught (a few hundred AdamW steps, here) to answer the session's three
prompts with a tool call, the answer after the tool result, and a short confirmation, so that greedy
decoding produces a real tool call from a real model; the proxy then parses it from the sampled ids.

Run: python -m pytest tests/integration/test_proxy_hf.py -q
"""

from __future__ import annotations

import json
import pathlib

import pytest

from tests.hf_fixtures import save_tiny_model_dir
from tests.integration.conftest import StoreProcess
from tests.integration.test_proxy import ADMIN, MODEL, READER, TRAINER, WORKER, ProxyProcess, sql, wait_for_rows

openai = pytest.importorskip("openai")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "mul",
            "description": "Multiply.",
            "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
        },
    }
]
QUESTION = {"role": "user", "content": "What is 3 times 7?"}
CALL = '<tool_call>{"name": "mul", "arguments": {"a": 3, "b": 7}}</tool_call>'


def _taught_model(directory: pathlib.Path) -> pathlib.Path:
    """A tiny model directory whose greedy answers to the session's three prompts are fixed."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollbook.rollout.proxy.history import Reply, Turn, continue_prompt
    from rollbook.rollout.proxy.render import HermesToolParser, HFRenderer, openai_tool_calls

    model_dir = save_tiny_model_dir(directory, seed=0)
    render = HFRenderer(str(model_dir))
    hf = render.hf
    eos = render.eos_token_id

    def ids(text: str) -> list[int]:
        return hf.encode(text, add_special_tokens=False) + [eos]

    # the prompts the proxy will build: each extends the last (token-exact continuation)
    _, calls = HermesToolParser().parse(CALL)
    [tool_call] = openai_tool_calls(calls, "x", 0)
    reply0 = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{**tool_call, "function": {"name": "mul", "arguments": calls[0]["arguments"]}}],
    }
    m0 = [QUESTION]
    m1 = [*m0, reply0, {"role": "tool", "tool_call_id": tool_call["id"], "content": "21"}]
    m2 = [*m1, {"role": "assistant", "content": "It is 21"}, {"role": "user", "content": "Sure?"}]
    p0 = render.render(m0, TOOLS, True)
    out0, out1, out2 = ids(CALL), ids("It is 21"), ids("Yes.")
    p1 = continue_prompt(render, Turn(p0, messages=m0, tools=TOOLS), Reply(out0, "stop", reply0), m1, TOOLS)
    p2 = continue_prompt(render, Turn(p1, messages=m1, tools=TOOLS), Reply(out1, "stop", m2[len(m1)]), m2, TOOLS)
    assert p1 is not None and p2 is not None
    examples = [(p0, out0), (p1, out1), (p2, out2)]

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True)
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def learned() -> bool:
        model.eval()
        with torch.no_grad():
            for prompt, out in examples:
                got = model.generate(
                    torch.tensor([prompt]), max_new_tokens=len(out), do_sample=False, eos_token_id=eos, pad_token_id=eos
                )
                if got[0, len(prompt) :].tolist() != out:
                    return False
        return True

    for step in range(1, 401):
        model.train()
        loss = 0.0
        for prompt, out in examples:
            x = torch.tensor([prompt + out])
            labels = torch.tensor([[-100] * len(prompt) + out])
            loss = loss + model(input_ids=x, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 25 == 0 and learned():
            break
    assert learned(), "the tiny model did not learn its script"
    model.save_pretrained(str(model_dir))
    return model_dir


@pytest.fixture(scope="module")
def hf_proxy(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf-proxy")
    model_dir = _taught_model(tmp / "model")
    store = StoreProcess(tmp / "rollbook.duckdb", admin_key=ADMIN, worker_key=WORKER, trainer_key=TRAINER, reader_key=READER)
    from transformers import AutoTokenizer

    with store.client() as client:
        client.register_model(MODEL, vocab_size=len(AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)))
        client.publish_version(MODEL, 0)
    proxy = ProxyProcess(
        store.address, tmp, "--model.path", str(model_dir), "--max_context_tokens", "512", "--max_tokens_limit", "128"
    )
    yield store, proxy
    proxy.stop()
    store.kill()
    assert "Traceback" not in proxy.log(), proxy.log()[-3000:]


def _session(proxy: ProxyProcess) -> tuple[str, openai.OpenAI]:
    from bench.online_retries import http

    status, started = http(proxy.url + "/rollbook/sessions", "POST", {"task_id": "tools"}, key=WORKER)
    assert status == 200, started
    return started["session_id"], openai.OpenAI(base_url=proxy.url + "/v1", api_key=started["api_key"], max_retries=0)


def _streamed(client: openai.OpenAI, messages: list) -> tuple[str, list, str]:
    content, calls, finish = "", [], ""
    for chunk in client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=96, stream=True
    ):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish


def test_a_three_turn_tool_session_is_stored_token_for_token_and_an_edit_is_a_branch(hf_proxy):
    store, proxy = hf_proxy
    session_id, client = _session(proxy)
    messages: list = [QUESTION]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=96)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "mul" and json.loads(call.function.arguments) == {"a": 3, "b": 7}

    messages += [choice.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "21"}]
    content, calls, finish = _streamed(client, messages)  # the second turn streamed
    assert (content, calls, finish) == ("It is 21", [], "stop")

    messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "Sure?"}]
    third = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=96)
    assert third.choices[0].message.content == "Yes."

    edited = [QUESTION, {"role": "assistant", "content": "It is 20"}, {"role": "user", "content": "Sure?"}]
    client.chat.completions.create(model=MODEL, messages=edited, tools=TOOLS, temperature=0, max_tokens=8)
    from bench.online_retries import http

    http(proxy.url + f"/rollbook/sessions/{session_id}/end", "POST", {}, key=ADMIN)
    wait_for_rows(store, f"session_id = '{session_id}'", 4)
    rows = {
        r["request_id"]: r
        for r in sql(
            store,
            "SELECT request_id, prompt_token_ids, output_token_ids, parent_request_id, branched "
            f"FROM trajectories WHERE session_id = '{session_id}' ORDER BY request_id",
        )
    }
    assert sorted(rows) == ["turn-0.0", "turn-1.0", "turn-2.0", "turn-3.0"]
    for k in (0, 1):  # every stored turn k+1 starts with turn k's prompt + output ids
        before, after = rows[f"turn-{k}.0"], rows[f"turn-{k + 1}.0"]
        history = list(before["prompt_token_ids"]) + list(before["output_token_ids"])
        assert list(after["prompt_token_ids"])[: len(history)] == history, k
        assert (after["parent_request_id"], after["branched"]) == (f"turn-{k}.0", False)
    assert (rows["turn-0.0"]["parent_request_id"], rows["turn-0.0"]["branched"]) == ("", False)
    assert (rows["turn-3.0"]["parent_request_id"], rows["turn-3.0"]["branched"]) == ("turn-0.0", True)
    # SQL walks the tree from the first call
    tree = sql(
        store,
        f"""WITH RECURSIVE walk(request_id, depth) AS (
              SELECT request_id, 0 FROM trajectories WHERE session_id = '{session_id}' AND parent_request_id = ''
              UNION ALL
              SELECT t.request_id, w.depth + 1 FROM trajectories t JOIN walk w
                ON t.session_id = '{session_id}' AND t.parent_request_id = w.request_id AND NOT t.branched)
            SELECT request_id, depth FROM walk ORDER BY depth""",
    )
    assert [(r["request_id"], r["depth"]) for r in tree] == [("turn-0.0", 0), ("turn-1.0", 1), ("turn-2.0", 2)]
