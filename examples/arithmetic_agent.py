"""An ordinary agent that learns through ``rollbook proxy``: plain Python and the ``openai`` client.

It plays a short guess-and-feedback game on the toy arithmetic tasks (rollbook/tasks.py): it asks
the model ``"12+34="``, checks the answer with its own code, tells the model ``"right."`` or
``"wrong."`` and asks again, for a fixed number of turns. Each turn's reward is that turn's answer
checked by the agent (1.0 right, 0.0 wrong), reported through the proxy's reward call for that
turn's completion; the session is then ended. Nothing in the agent knows about trajectories: the
proxy records them (docs/online.md).

    rollbook proxy --server 127.0.0.1:50551 --port 8000 &
    python examples/arithmetic_agent.py --proxy http://127.0.0.1:8000 --episodes 8 --group-size 4

As the load of an online run (``rollbook run --config configs/online.toml``, docs/online.md), it plays
the problems of a file (``--problems``, one ``a+b=`` or ``rev:abc=`` per line, the toy tasks' two
formats: it checks string reversal with its own code too) round after round (``--rounds 0``: until
stopped), ``--concurrency`` groups of ``--group-size`` sessions at once; the starting key comes from
``--start-key`` or the ``ROLLBOOK_WORKER_KEY`` environment variable (never the command line of a run).

The session calls (start, reward, end) are three small HTTP requests; the completions go through the
official client with the session key as its API key. Every session of the process shares one
connection pool (``http_client``): an ``openai.OpenAI`` built with its own would load the TLS
certificates and open a connection per session, the agent's largest cost at this size.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import openai


@functools.cache
def http_client() -> openai.DefaultHttpxClient:
    """The process's one connection pool (thread-safe), for the session calls and every session's
    ``openai`` client: openai's defaults (timeouts, connection limits)."""
    return openai.DefaultHttpxClient()


def control(base_url: str, path: str, body: dict, key: str | None) -> dict:
    """POST a JSON body to the proxy's session endpoints; raises on an HTTP error."""
    response = http_client().post(
        base_url.rstrip("/") + path,
        json=body,
        headers={"authorization": f"Bearer {key}"} if key else {},
        timeout=60,
    )
    if response.is_error:  # the proxy's OpenAI-format error says why
        raise RuntimeError(f"POST {path}: HTTP {response.status_code}: {response.text}")
    return response.json()


@dataclass
class Episode:
    session_id: str
    prompt: str
    answers: list[str] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    completion_ids: list[str] = field(default_factory=list)
    versions: list[list[int]] = field(default_factory=list)


def start_session(
    base_url: str, prompt: str, domain: str, group_id: str, group_size: int, start_key: str | None, client_kwargs: dict | None
) -> tuple[dict, openai.OpenAI]:
    """Start a session for ``prompt`` (``POST /rollbook/sessions``): its answer (session id and key)
    and an ``openai`` client with the session key as its API key, on the shared pool (``http_client``;
    ``client_kwargs`` may name another)."""
    started = control(
        base_url,
        "/rollbook/sessions",
        {"task_id": f"{domain}/{prompt}", "domain": domain, "group_id": group_id, "group_size": group_size},
        start_key,
    )
    kwargs = {"http_client": http_client(), **(client_kwargs or {})}
    client = openai.OpenAI(base_url=base_url.rstrip("/") + "/v1", api_key=started["api_key"], **kwargs)
    return started, client


def play(base_url: str, a: int, b: int, **kwargs) -> Episode:
    """One episode of ``a+b=`` (``play_problem``)."""
    return play_problem(base_url, f"{a}+{b}=", str(a + b), "arithmetic", **kwargs)


def play_problem(
    base_url: str,
    prompt: str,
    expected: str,
    domain: str,
    *,
    group_id: str = "",
    group_size: int = 1,
    turns: int = 2,
    stream: bool = False,
    start_key: str | None = None,
    model: str = "tiny",
    temperature: float = 1.0,
    max_tokens: int = 6,
    client_kwargs: dict | None = None,
    reward_after_end: bool = False,
) -> Episode:
    """One episode: start a session, ``turns`` calls, a reward per call, end (or end first, then the
    rewards: a reward may arrive after its session ended)."""
    started, client = start_session(base_url, prompt, domain, group_id, group_size, start_key, client_kwargs)
    episode = Episode(started["session_id"], prompt)
    messages: list[dict] = [{"role": "user", "content": prompt}]
    for _ in range(turns):
        answer, completion_id, versions = _ask(client, model, messages, stream, temperature, max_tokens)
        right = answer.strip() == expected  # the agent's own check is its reward
        episode.answers.append(answer)
        episode.rewards.append(1.0 if right else 0.0)
        episode.completion_ids.append(completion_id)
        episode.versions.append(versions)
        messages += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": ("right." if right else "wrong.") + prompt},
        ]
    if reward_after_end:
        control(base_url, f"/rollbook/sessions/{episode.session_id}/end", {}, started["api_key"])
    for completion_id, value in zip(episode.completion_ids, episode.rewards):
        control(
            base_url,
            f"/rollbook/sessions/{episode.session_id}/reward",
            {"reward": value, "call": completion_id},
            started["api_key"],
        )
    if not reward_after_end:
        control(base_url, f"/rollbook/sessions/{episode.session_id}/end", {}, started["api_key"])
    return episode  # the client's connections stay in the shared pool


def _ask(
    client: openai.OpenAI, model: str, messages: list[dict], stream: bool, temperature: float, max_tokens: int
) -> tuple[str, str, list[int]]:
    if not stream:
        completion = client.chat.completions.create(
            model=model, messages=messages, temperature=temperature, max_tokens=max_tokens
        )
        extra = completion.model_extra.get("rollbook") or {}
        return completion.choices[0].message.content or "", completion.id, (extra.get("output_versions") or [[]])[0]
    text, completion_id = [], ""
    for chunk in client.chat.completions.create(
        model=model, messages=messages, temperature=temperature, max_tokens=max_tokens, stream=True
    ):
        completion_id = chunk.id
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
    return "".join(text), completion_id, []


def solve(prompt: str) -> tuple[str, str]:
    """The agent's own answer key for a problem line: ``"12+34="`` -> ``("46", "arithmetic")``,
    ``"rev:abc="`` -> ``("cba", "reverse")`` (the toy tasks' two formats, rollbook/tasks.py)."""
    body = prompt.strip().removesuffix("=")
    if body.startswith("rev:"):
        return body[4:][::-1], "reverse"
    left, _, right = body.partition("+")
    return str(int(left) + int(right)), "arithmetic"


def play_rounds(
    base_url: str,
    problems: list[str],
    *,
    rounds: int,
    concurrency: int,
    group_size: int,
    turns: int,
    seed: int,
    start_key: str | None,
    model: str,
    temperature: float,
    max_tokens: int,
    play: Callable[..., Episode] | None = None,
    answer_key: Callable[[str], tuple[str, str]] | None = None,
) -> None:
    """Play ``problems`` in a shuffled order, ``rounds`` times (0: until stopped): each problem is a
    group of ``group_size`` sessions, ``concurrency`` groups at once. A failed episode is reported and
    skipped (its group then stays incomplete: the store's incomplete-group policy decides). ``play``
    (default ``play_problem``) plays one episode of a problem whose ``(expected, domain)`` come from
    ``answer_key`` (default ``solve``); examples/calculator_agent.py passes its own."""
    play, answer_key = play or play_problem, answer_key or solve
    rng = random.Random(seed)
    order = list(problems)
    done = 0
    with concurrent.futures.ThreadPoolExecutor(max(1, concurrency * group_size)) as pool:
        while rounds == 0 or done < rounds:
            rng.shuffle(order)
            for start in range(0, len(order), concurrency):
                futures = [
                    pool.submit(
                        play,
                        base_url,
                        prompt,
                        *answer_key(prompt),
                        group_id=f"agent-{seed}-r{done}-{start + i}",
                        group_size=group_size,
                        turns=turns,
                        start_key=start_key,
                        model=model,
                        temperature=temperature,
                        max_tokens=max_tokens,
                    )
                    for i, prompt in enumerate(order[start : start + concurrency])
                    for _ in range(group_size)
                ]
                for future in futures:
                    try:
                        ep = future.result()
                    except Exception as exc:  # the proxy refused or went away: this episode is lost, the rest go on
                        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
                        continue
                    print(
                        json.dumps(
                            {"session_id": ep.session_id, "prompt": ep.prompt, "answers": ep.answers, "rewards": ep.rewards}
                        ),
                        flush=True,
                    )
            done += 1


def agent_parser(description: str, *, turns_help: str, problems_help: str, max_tokens: int) -> argparse.ArgumentParser:
    """The flags every example agent takes (``rollbook run``'s online mode passes them)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--proxy", default="http://127.0.0.1:8000")
    parser.add_argument("--episodes", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4, help="episodes per prompt (a normalization group)")
    parser.add_argument("--turns", type=int, default=2, help=turns_help)
    parser.add_argument("--model", default="tiny")
    parser.add_argument(
        "--start-key",
        default=os.environ.get("ROLLBOOK_WORKER_KEY"),
        help="worker key of the proxy (if it has one); default: $ROLLBOOK_WORKER_KEY",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--problems", default=None, help=problems_help)
    parser.add_argument("--rounds", type=int, default=1, help="with --problems: rounds over the file (0 = until stopped)")
    parser.add_argument("--concurrency", type=int, default=1, help="with --problems: groups played at once")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=max_tokens)
    return parser


def play_file(args: argparse.Namespace, play: Callable[..., Episode], answer_key: Callable[[str], tuple[str, str]]) -> None:
    """``--problems FILE``: ``play_rounds`` over its lines with the parsed flags."""
    with open(args.problems) as f:
        problems = [line.strip() for line in f if line.strip()]
    play_rounds(
        args.proxy,
        problems,
        rounds=args.rounds,
        concurrency=args.concurrency,
        group_size=args.group_size,
        turns=args.turns,
        seed=args.seed,
        start_key=args.start_key,
        model=args.model,
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        play=play,
        answer_key=answer_key,
    )


def main(argv: list[str] | None = None) -> None:
    parser = agent_parser(
        __doc__.splitlines()[0],
        turns_help="calls per episode: the answer, then retries after the feedback",
        problems_help="a file of problems, one 'a+b=' or 'rev:abc=' per line: play them --rounds times",
        max_tokens=6,
    )
    parser.add_argument("--stream", action="store_true")
    args = parser.parse_args(argv)
    if args.problems:
        play_file(args, play_problem, solve)
        return
    rng = random.Random(args.seed)
    total = []
    for g in range(0, args.episodes, args.group_size):
        a, b = rng.randrange(100), rng.randrange(100)
        for _ in range(min(args.group_size, args.episodes - g)):
            ep = play(
                args.proxy,
                a,
                b,
                group_id=f"agent-{args.seed}-{g}",
                group_size=args.group_size,
                turns=args.turns,
                stream=args.stream,
                start_key=args.start_key,
                model=args.model,
                temperature=args.temperature,
                max_tokens=args.max_tokens,
            )
            total += ep.rewards
            print(json.dumps({"session_id": ep.session_id, "prompt": ep.prompt, "answers": ep.answers, "rewards": ep.rewards}))
    print(json.dumps({"episodes": args.episodes, "mean_reward": sum(total) / max(1, len(total))}))


if __name__ == "__main__":
    main()
