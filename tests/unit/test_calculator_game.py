"""The online mode's calculator game (rollbook/run/online.py, examples/calculator_agent.py): the agent's
tool and the evaluation's are the same, the evaluation's second prompt is exactly the one the proxy
builds for the agent's second call, the evaluation scores tool calls and answers, and a run config
that cannot play the game is refused.

Run: python -m pytest tests/unit/test_calculator_game.py -q
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import random

import pytest

from examples import calculator_agent
from rollbook.config import OnlineConfig, ProxyConfig, RunConfig
from rollbook.rollout.proxy.core import Proxy
from rollbook.rollout.proxy.render import HFRenderer
from rollbook.run.online import CALCULATOR_TOOLS, CalculatorEvaluation, CalculatorGame, calculator_tool
from rollbook.tasks import MultiplyDomain, make_tasks
from tests.hf_fixtures import save_bpe_tokenizer
from tests.unit.rollout.test_proxy import _FakeStore
from tests.unit.rollout.test_proxy_hf import ScriptedEngine


@pytest.fixture(scope="module")
def render(tmp_path_factory):
    return HFRenderer(str(save_bpe_tokenizer(tmp_path_factory.mktemp("tok"))))


def _call(a: int, b: int) -> str:
    from examples.make_calculator_model import tool_call_text

    return tool_call_text(a, b)  # the demonstrated call: what the built model learns to write


def test_the_agent_offers_and_runs_the_tool_the_evaluation_plays():
    assert calculator_agent.TOOLS == CALCULATOR_TOOLS
    cases = [("mul", {"a": 37, "b": 8}), ("mul", {"a": "4", "b": 5}), ("mul", {"a": 3}), ("add", {"a": 1, "b": 2})]
    cases += [("mul", {"a": "x", "b": 2}), ("mul", {"a": None, "b": 2})]
    for name, args in cases:
        assert calculator_agent.run_tool(name, json.dumps(args)) == calculator_tool(name, args), (name, args)
    assert calculator_tool("mul", {"a": 37, "b": 8}) == "296"


def test_the_agent_rewards_a_call_of_mul_with_the_problems_numbers():
    operands = sorted(calculator_agent.solve_operands("what is 37 times 8?"))
    assert calculator_agent.right_call("mul", '{"a": 37, "b": 8}', operands)
    assert calculator_agent.right_call("mul", '{"a": 8, "b": 37}', operands)  # either order
    for name, arguments in [("mul", '{"a": 37, "b": 9}'), ("add", '{"a": 37, "b": 8}'), ("mul", '{"a": 37}'), ("mul", "{")]:
        assert not calculator_agent.right_call(name, arguments, operands), (name, arguments)


def test_the_agent_solves_every_problem_of_the_multiply_domain():
    for task in make_tasks(MultiplyDomain(), "heldout", 50, seed=0):
        assert calculator_agent.solve(task.prompt) == (task.answer, "multiply")
    with pytest.raises(ValueError, match="not a calculator problem"):
        calculator_agent.solve("12+34=")
    rng = random.Random(0)
    assert all(2 <= int(x) <= 99 for _ in range(100) for x in MultiplyDomain().sample(rng)[0][8:-1].split(" times "))


def test_the_evaluations_second_prompt_is_the_one_the_proxy_builds_for_the_agents_second_call(render):
    """The agent's two calls through a proxy (its messages as the openai client hands them back) and
    the evaluation's game on the same sampled ids: the same prompts, token for token."""
    engine = ScriptedEngine(render, [_call(37, 8), "296"])
    store = _FakeStore()

    async def scenario():
        proxy = Proxy(ProxyConfig(), engine, store, admin_key=None, worker_key=None, render=render)
        session, key = proxy.sessions.start(task_id="t", domain="multiply", group_id="", group_size=1)
        headers = {"authorization": f"Bearer {key}"}
        messages = [{"role": "user", "content": "what is 37 times 8?"}]
        body = {"model": "tiny", "max_tokens": 200, "tools": calculator_agent.TOOLS}
        payload, deliver, _ = await proxy.complete("chat", headers, {**body, "messages": messages})
        deliver(True)
        message = {k: v for k, v in payload["choices"][0]["message"].items() if v is not None}  # model_dump(exclude_none)
        [call] = message["tool_calls"]
        result = calculator_agent.run_tool(call["function"]["name"], call["function"]["arguments"])
        messages += [message, {"role": "tool", "tool_call_id": call["id"], "content": result}]
        payload, deliver, _ = await proxy.complete("chat", headers, {**body, "messages": messages})
        deliver(True)
        await proxy.end(session)
        proxy.submitter.close()
        proxy.close()

    asyncio.run(scenario())
    first_seen, second_seen = engine.prompts
    game = CalculatorGame(render)
    first, messages = game.first_prompt("what is 37 times 8?")
    assert first == first_seen
    sampled = render.hf.encode(_call(37, 8), add_special_tokens=False) + [render.eos_token_id]
    second = game.answer_prompt(first, messages, sampled)
    assert second == second_seen
    assert second[: len(first) + len(sampled)] == first + sampled  # it extends the ids the model sampled
    assert "296" in render.decode(second[len(first) + len(sampled) :])
    assert game.answer_prompt(first, messages, render.hf.encode("296", add_special_tokens=False)) is None


def test_the_evaluation_scores_the_tool_call_and_the_final_answer(render):
    tasks = make_tasks(MultiplyDomain(), "heldout", 3, seed=0)
    (a0, b0), (a1, b1), _ = ((int(x) for x in t.prompt[8:-1].split(" times ")) for t in tasks)
    engine = ScriptedEngine(
        render,
        [
            _call(a0, b0),  # right call ...
            _call(a1 + 1, b1),  # wrong numbers ...
            "12",  # no call: this is its answer
            tasks[0].answer,  # ... and the result copied: solved
            str((a1 + 1) * b1),  # ... and the wrong result copied: not solved
        ],
    )
    online = OnlineConfig(game="calculator", turns=2, eval_samples=0, max_tokens=200)
    out = CalculatorEvaluation(engine, tasks, online, render=render).evaluate()
    assert out == {"eval/reward": pytest.approx(1 / 3), "eval/tool_call": pytest.approx(1 / 3)}
    assert not engine.replies  # two first calls with a tool call got a second call; the third did not


def test_a_config_that_cannot_play_the_calculator_game_is_refused(tmp_path):
    online = {"game": "calculator", "agent": "examples/calculator_agent.py"}
    with pytest.raises(ValueError, match="trainer.model.path"):
        RunConfig.model_validate({"online": online, "rollout": {"domains": ["multiply"]}})
    with pytest.raises(ValueError, match="rollout.domains = \\['multiply'\\]"):
        RunConfig.model_validate({"online": online, "trainer": {"model": {"path": str(tmp_path)}}})
    config = RunConfig.model_validate(
        {"online": online, "rollout": {"domains": ["multiply"]}, "trainer": {"model": {"path": str(tmp_path)}}}
    )
    assert config.online is not None and config.online.game == "calculator"


def test_the_shipped_calculator_config_plays_the_calculator_agent():
    from rollbook.config import load_config

    root = pathlib.Path(__file__).resolve().parents[2]
    config = load_config(RunConfig, str(root / "configs" / "calculator.toml"), [])
    assert config.online is not None and config.online.game == "calculator"
    assert (root / config.online.agent).is_file() and config.online.agent.endswith("calculator_agent.py")
    assert config.rollout.domains == ["multiply"] and config.trainer.model.path == "models/calculator-llm"
    assert config.online.max_tokens >= 32  # a whole tool call of the built model (28 tokens) fits


def test_a_calculator_model_build_stopped_while_teaching_leaves_no_weights_that_look_built(tmp_path, monkeypatch):
    """bench/learning.py reuses a directory with a config and weights as a built model: a build killed
    during its supervised steps must leave no weights there (only the tokenizer and configs)."""
    from examples import make_calculator_model

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    model_dir = tmp_path / "calculator-llm"
    model_dir.mkdir()
    (model_dir / "model.safetensors").write_bytes(b"an earlier build's weights")
    monkeypatch.setattr(make_calculator_model, "teach", killed)
    problems = [(2, 3), (4, 5), (6, 7), (8, 9)]
    with pytest.raises(KeyboardInterrupt):
        make_calculator_model.build(model_dir, problems, problems, hidden_size=32, steps=1)
    assert (model_dir / "tokenizer.json").is_file() and (model_dir / "config.json").is_file()
    assert not list(model_dir.glob("*.safetensors"))
