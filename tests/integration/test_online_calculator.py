"""``rollbook run`` in online mode with the tool-using agent (``configs/calculator.toml``,
docs/online.md "A tool-using agent"): a real store process, the trainer publishing over shared memory,
a real ``rollbook proxy`` serving a Hugging Face model directory (BPE tokenizer, a chat template that
renders tools), and examples/calculator_agent.py (the official ``openai`` client) offering its ``mul``
tool as the load.

The model is built by examples/make_calculator_model.py's ``build``, taught the tool-call format for
80 steps on the run's own sixteen training problems (its replies hold real tool calls the proxy
parses and the agent runs; whether their numbers are right does not matter here). A short run then trains on both calls of the agent's sessions: every
trained row is a proxy turn of a rewarded session, and every second call's prompt extends its first
call's prompt and sampled ids, the first named as its parent.

Run: python -m pytest tests/integration/test_online_calculator.py -q
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import duckdb
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROBLEMS = 16


def _replies_with_calls(model_dir: pathlib.Path, problems: list[tuple[int, int]]) -> int:
    """How many of the model's greedy first replies hold a tool call the proxy parses."""
    from transformers import AutoModelForCausalLM

    from examples.make_calculator_model import greedy
    from rollbook.rollout.proxy.render import HFRenderer
    from rollbook.run.online import CalculatorGame

    game = CalculatorGame(HFRenderer(str(model_dir)))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True)
    prompts = [game.first_prompt(f"what is {a} times {b}?")[0] for a, b in problems]
    return sum(bool(game.calls(greedy(model, p, game.render.eos_token_id, 32))[1]) for p in prompts)


@pytest.mark.timeout(900)
def test_online_calculator_run_trains_on_tool_calls_and_the_answers_that_extend_them(tmp_path):
    from examples.calculator_agent import solve_operands
    from examples.make_calculator_model import build
    from rollbook.tasks import MultiplyDomain, make_tasks

    problems = [
        solve_operands(t.prompt) for t in make_tasks(MultiplyDomain(), "train", PROBLEMS, 0)
    ]  # the run's (rollout.seed 0)
    model_dir = tmp_path / "calculator-llm"
    build(model_dir, problems, problems, hidden_size=64, steps=80, check_every=10**6, batch_size=16)  # the format, not the sums
    assert _replies_with_calls(model_dir, problems) >= len(problems) // 2
    run_dir = tmp_path / "run"
    cmd = [
        *(sys.executable, "-m", "rollbook.cli", "run", "--config", "configs/calculator.toml", "--run_dir", str(run_dir)),
        *("--trainer.model.path", str(model_dir), "--online.num_problems", str(PROBLEMS), "--rollout.seed", "0"),
        *("--num_steps", "2", "--eval_every", "2", "--trainer.num_samples", "16"),
        *("--online.num_eval_problems", "4", "--online.eval_samples", "1"),
        # a group's second calls are short of members when some of its sessions answered without a
        # call: served with their true size after a second, not rejected after ten minutes
        *("--store.validator.incomplete_group_policy", "keep", "--store.validator.group_timeout_s", "1"),
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=800)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [m for m in metrics if "eval/sampled_reward" in m]
    assert [m["step"] for m in evals] == [0, 1], metrics
    assert all(0.0 <= m[k] <= 1.0 for m in evals for k in ("eval/reward", "eval/tool_call", "eval/sampled/tool_call"))
    con = duckdb.connect(str(run_dir / "rollbook.duckdb"), read_only=True)
    try:
        trained = con.execute(
            "SELECT t.worker_id, t.domain, split_part(t.request_id, '.', 1) AS turn, t.original_reward, t.consumed "
            "FROM leases l JOIN trajectories t USING (trajectory_id) WHERE l.acked_at IS NOT NULL"
        ).fetchall()
        # every second call of a session: its parent (the first call) and whether it extends it token for token
        seconds = con.execute(
            "SELECT s.parent_request_id, s.branched, "
            "s.prompt_token_ids[1:len(f.prompt_token_ids) + len(f.output_token_ids)] = list_concat(f.prompt_token_ids, f.output_token_ids) "
            "FROM trajectories s JOIN trajectories f ON f.session_id = s.session_id AND f.request_id = 'turn-0.0' "
            "WHERE s.request_id = 'turn-1.0'"
        ).fetchall()
    finally:
        con.close()
    assert len(trained) >= 16, len(trained)  # two steps (a group served short of members makes a batch smaller)
    assert {turn for *_, turn, _, _ in trained} == {"turn-0", "turn-1"}  # it trained on tool calls and on answers
    for worker, domain, turn, reward, consumed in trained:
        assert worker == "proxy" and domain == "multiply" and consumed and reward in (0.0, 1.0), (worker, domain, turn, reward)
    assert seconds and all(parent == "turn-0.0" and not branched and extends for parent, branched, extends in seconds), seconds
