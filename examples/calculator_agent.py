"""An ordinary tool-using agent that learns through ``rollbook proxy``: plain Python, the ``openai``
client, and one tool.

It asks the model ``"what is 37 times 8?"`` and offers a calculator, the ``mul`` tool (OpenAI
``tools``). When the model calls it (a ``tool_calls`` reply), the agent runs the call with its own
code and sends the result back as a ``role: tool`` message, and the model answers. The agent checks
each call with its own code and reports a reward per call: a tool call is right when it calls
``mul`` with the problem's two numbers, an answer when it is the product, exactly (a model that
answers without calling the tool gets that answer checked the same way). So a right call followed by
a miscopied answer is not blamed for the answer. Nothing in the agent knows about
trajectories: the proxy records each call token for token, the second call's prompt extending the
first's (docs/online.md).

    python examples/make_calculator_model.py --out .        # models/calculator-llm/ (taught the tool format)
    rollbook proxy --server 127.0.0.1:50551 --port 8000 --model.path models/calculator-llm &
    python examples/calculator_agent.py --proxy http://127.0.0.1:8000 --episodes 8 --group-size 4

As the load of an online run (``rollbook run --config configs/calculator.toml``), it plays the
problems of a file (``--problems``, one ``what is A times B?`` per line) round after round, with the
flags of examples/arithmetic_agent.py (whose session helpers it uses).
"""

from __future__ import annotations

import json
import random
import re

try:
    from examples.arithmetic_agent import Episode, agent_parser, control, play_file, start_session
except ImportError:  # run as a script: its own directory is on the path
    from arithmetic_agent import Episode, agent_parser, control, play_file, start_session  # type: ignore[no-redef]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "mul",
            "description": "Multiply two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
PROBLEM = re.compile(r"what is (\d+) times (\d+)\?")


def solve(prompt: str) -> tuple[str, str]:
    """The agent's answer key: ``"what is 37 times 8?"`` -> ``("296", "multiply")``."""
    a, b = solve_operands(prompt)
    return str(a * b), "multiply"


def run_tool(name: str, arguments: str) -> str:
    """The agent's own tool: ``mul`` of integer ``a`` and ``b``; anything else gets an error text back
    (as a real agent would tell its model)."""
    if name != "mul":
        return f"error: no tool named {name!r}"
    try:
        args = json.loads(arguments)
        return str(int(args["a"]) * int(args["b"]))
    except (ValueError, TypeError, KeyError):
        return "error: mul takes two integers, a and b"


def solve_operands(prompt: str) -> tuple[int, int]:
    """``"what is 37 times 8?"`` -> ``(37, 8)``."""
    match = PROBLEM.fullmatch(prompt.strip())
    if match is None:
        raise ValueError(f"not a calculator problem: {prompt!r} (want 'what is A times B?')")
    return int(match.group(1)), int(match.group(2))


def right_call(name: str, arguments: str, operands: list[int]) -> bool:
    """A call of ``mul`` with the problem's two numbers (either order)."""
    try:
        args = json.loads(arguments)
        return name == "mul" and sorted([int(args["a"]), int(args["b"])]) == operands
    except (ValueError, TypeError, KeyError):
        return False


def play_problem(
    base_url: str,
    prompt: str,
    expected: str,
    domain: str,
    *,
    group_id: str = "",
    group_size: int = 1,
    turns: int = 2,
    start_key: str | None = None,
    model: str = "tiny",
    temperature: float = 1.0,
    max_tokens: int = 32,
    client_kwargs: dict | None = None,
) -> Episode:
    """One episode: at most ``turns`` calls (tool calls, then the answer), a reward for each, then
    the session ends."""
    started, client = start_session(base_url, prompt, domain, group_id, group_size, start_key, client_kwargs)
    episode = Episode(started["session_id"], prompt)
    operands = sorted(int(x) for x in solve_operands(prompt))
    messages: list[dict] = [{"role": "user", "content": prompt}]
    for turn in range(turns):
        completion = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, temperature=temperature, max_tokens=max_tokens
        )
        message = completion.choices[0].message
        episode.completion_ids.append(completion.id)
        if not message.tool_calls or turn + 1 == turns:
            answer = message.content or ""
            episode.answers.append(answer)
            episode.rewards.append(1.0 if answer.strip() == expected else 0.0)
            break
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            result = run_tool(call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        episode.answers.append(json.dumps([c.function.model_dump() for c in message.tool_calls]))
        right = any(right_call(c.function.name, c.function.arguments, operands) for c in message.tool_calls)
        episode.rewards.append(1.0 if right else 0.0)
    for completion_id, reward in zip(episode.completion_ids, episode.rewards):
        body = {"reward": reward, "call": completion_id}
        control(base_url, f"/rollbook/sessions/{episode.session_id}/reward", body, started["api_key"])
    control(base_url, f"/rollbook/sessions/{episode.session_id}/end", {}, started["api_key"])
    return episode  # the client's connections stay in the shared pool (examples/arithmetic_agent.py http_client)


def main(argv: list[str] | None = None) -> None:
    parser = agent_parser(
        __doc__.splitlines()[0],
        turns_help="most calls per episode: tool calls, then the answer",
        problems_help="a file of problems, one 'what is A times B?' per line: play them --rounds times",
        max_tokens=32,
    )
    args = parser.parse_args(argv)
    if args.problems:
        play_file(args, play_problem, solve)
        return
    settings = {"turns": args.turns, "start_key": args.start_key, "model": args.model}
    settings.update(temperature=args.temperature, max_tokens=args.max_tokens)
    rng = random.Random(args.seed)
    total = []
    for g in range(0, args.episodes, args.group_size):
        prompt = f"what is {rng.randint(2, 99)} times {rng.randint(2, 99)}?"
        for _ in range(min(args.group_size, args.episodes - g)):
            ep = play_problem(
                args.proxy, prompt, *solve(prompt), group_id=f"calc-{args.seed}-{g}", group_size=args.group_size, **settings
            )
            total.append(ep.rewards[-1])  # the answer's
            print(json.dumps({"session_id": ep.session_id, "prompt": ep.prompt, "answers": ep.answers, "rewards": ep.rewards}))
    print(json.dumps({"episodes": args.episodes, "mean_reward": sum(total) / max(1, len(total))}))


if __name__ == "__main__":
    main()
