"""Online mode of ``rollbook run`` (an ``[online]`` section, docs/online.md): the trainer learns from an
ordinary agent's calls through ``rollbook proxy``.

    rollbook run --config configs/online.toml

Beside the store the run already started, this module starts

1. the trainer here, publishing every version over shared memory (``SharedMemoryPublisher``) and to
   the store (``PublishVersion``);
2. a ``rollbook proxy`` process following that channel (``--weights shm:NAME``): it serves nothing
   until the trainer's first version is in, and installs each newer one as it appears;
3. the agent process (``online.agent``, examples/arithmetic_agent.py): ``online.concurrency`` groups
   of ``online.group_size`` sessions at a time over the training problems, each session a short
   multi-turn episode (an answer, then a second try after the agent's own ``right.``/``wrong.``
   feedback), its reward computed by the agent and reported through the proxy's reward call.

The trainer pulls the agent's rewarded sessions from the store like any rollout (turn ``k`` of a
group normalized together, the staleness bound ``max_staleness``). Every ``eval_every`` steps the
agent's game is played here, directly on an engine holding the trainer's weights, on held-out
problems: greedy (``eval/reward``) and ``online.eval_samples`` sampled episodes per problem with a
fixed seed (``eval/sampled_reward``), both the mean per-turn reward the agent would report, with
the first and second tries apart. Everything goes into RUN_DIR/metrics.jsonl. The trainer steps once
per ``trainer.num_samples`` newly rewarded turns (a pull returns whatever is ready, and the agent is
slower than the trainer: without this pacing the batches would be a few rows each).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import uuid
from typing import TYPE_CHECKING, Literal

from rollbook import environment as rollbook_env
from rollbook.config import ModelConfig, OnlineConfig, RunConfig
from rollbook.errors import CommandError
from rollbook.lifetime import child_env
from rollbook.run.driving import drive_run, engine_copy, install_weights
from rollbook.trainer.drive import Placement

if TYPE_CHECKING:  # pragma: no cover
    from collections.abc import Sequence

    from rollbook.rollout.engine import GenerationEngine
    from rollbook.rollout.proxy.render import Renderer
    from rollbook.tasks import Task

# max_context_tokens of the online mode's proxy (and of its held-out games' engine): an agent's whole
# session (the problem, its answers, the feedback) fits; less when the model has fewer positions
ONLINE_CONTEXT_TOKENS = 512
# the problems of each game of ``online.game``
GAME_DOMAINS = {"feedback": {"arithmetic", "reverse"}, "calculator": {"multiply"}}


def online_problems(config: RunConfig, split: Literal["train", "heldout"], num: int) -> list[Task]:
    """The problems of ``split`` the agent plays (train) or is evaluated on (heldout): ``num`` per
    domain of ``rollout.domains`` (fewer when a domain has fewer), in the two formats the agent knows."""
    from rollbook.tasks import build_domains, make_tasks

    domains = build_domains(config.rollout)
    game = config.online.game if config.online is not None else "feedback"
    plays = GAME_DOMAINS[game]
    unknown = sorted(set(domains) - plays)
    if unknown:
        raise CommandError(f"the online {game} game plays {sorted(plays)} problems, not {unknown}: set rollout.domains")
    return [t for d in domains.values() for t in make_tasks(d, split, num, config.rollout.seed, allow_fewer=True)]


class AgentEvaluation:
    """The agent's game (examples/arithmetic_agent.py ``play``) played directly on ``engine``: the same
    rendering as the proxy (rollout/proxy/render.py), the same feedback and the same reward (the
    answer, stripped, equals the sum). Its calls stop where the proxy's do: on the renderer's eos and
    ``model``'s own eos ids (``rollbook.language_models.stop_token_ids``)."""

    def __init__(
        self,
        engine: GenerationEngine,
        tasks: list[Task],
        online: OnlineConfig,
        *,
        top_p: float = 1.0,
        model: ModelConfig | None = None,
        render: Renderer | None = None,
    ):
        from rollbook.language_models import stop_token_ids
        from rollbook.rollout.proxy.render import renderer

        self.engine, self.tasks, self.online, self.top_p = engine, tasks, online, top_p
        self.render = render or renderer()
        self.stop_token_ids = stop_token_ids(self.render.eos_token_id, model)

    def _episodes(self, tasks: list[Task], temperature: float, seed: int | None) -> list[list[float]]:
        from rollbook.rollout.engine import GenerationRequest

        history: list[list[tuple[str, str]]] = [[("user", t.prompt)] for t in tasks]
        rewards: list[list[float]] = [[] for _ in tasks]
        for turn in range(self.online.turns):
            requests = [
                GenerationRequest(
                    prompt_token_ids=self.render.render([{"role": r, "content": c} for r, c in h], None, True),
                    max_new_tokens=self.online.max_tokens,
                    temperature=temperature,
                    top_p=self.top_p if temperature > 0 else 1.0,
                    stop_token_ids=self.stop_token_ids,
                )
                for h in history
            ]
            # one seed per turn, the same at every evaluation: two evaluations differ only by the weights
            results = self.engine.generate(requests, seed=None if seed is None else seed + turn)
            for task, h, r, result in zip(tasks, history, rewards, results):
                ids = result.output_token_ids
                answer = self.render.decode(ids[:-1] if ids and ids[-1] in self.stop_token_ids else ids)
                right = answer.strip() == task.answer
                r.append(1.0 if right else 0.0)
                h += [("assistant", answer), ("user", ("right." if right else "wrong.") + task.prompt)]
        return rewards

    @staticmethod
    def _summary(rewards: list[list[float]], prefix: str, overall: str) -> dict[str, float]:
        turns = len(rewards[0]) if rewards else 0
        out = {overall: sum(map(sum, rewards)) / max(1, len(rewards) * turns)}
        for k in range(turns):
            out[f"{prefix}turn{k}"] = sum(r[k] for r in rewards) / max(1, len(rewards))
        out[f"{prefix}solved"] = sum(max(r) for r in rewards) / max(1, len(rewards))
        return out

    def evaluate(self) -> dict[str, float]:
        out = self._summary(self._episodes(self.tasks, 0.0, None), "eval/", "eval/reward")
        if self.online.eval_samples:
            tasks = [t for t in self.tasks for _ in range(self.online.eval_samples)]
            out.update(
                self._summary(
                    self._episodes(tasks, self.online.temperature, self.online.eval_seed), "eval/sampled/", "eval/sampled_reward"
                )
            )
        return out


# the tool examples/calculator_agent.py offers (a test holds the two equal): rendered into every prompt
CALCULATOR_TOOLS = [
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


def calculator_tool(name: str, arguments: dict) -> str:
    """What examples/calculator_agent.py's ``run_tool`` answers a call: the product, or an error text."""
    if name != "mul":
        return f"error: no tool named {name!r}"
    try:
        return str(int(arguments["a"]) * int(arguments["b"]))
    except (ValueError, TypeError, KeyError):
        return "error: mul takes two integers, a and b"


class CalculatorGame:
    """The calculator game's two calls as ``rollbook proxy`` builds their prompts for
    examples/calculator_agent.py: the question with ``CALCULATOR_TOOLS``; after a reply with tool
    calls, the first prompt + the sampled ids + the tool results (rollout/proxy/history.py's
    token-exact continuation)."""

    def __init__(self, render: Renderer):
        self.render = render
        if render.tool_parser is None:
            raise CommandError("the calculator game needs a tool-call parser: a model whose chat template renders tools")

    def first_prompt(self, question: str) -> tuple[list[int], list[dict]]:
        messages = [{"role": "user", "content": question}]
        return self.render.render(messages, CALCULATOR_TOOLS, True), messages

    def calls(self, output_ids: Sequence[int]) -> tuple[str, list[dict]]:
        """(content, tool calls) of a reply, as the proxy parses it."""
        assert self.render.tool_parser is not None
        return self.render.tool_parser.parse(self.render.decode(output_ids))

    def answer_prompt(self, prompt: list[int], messages: list[dict], output_ids: list[int]) -> list[int] | None:
        """The second call's prompt after the reply ``output_ids`` (None when it holds no tool call)."""
        from rollbook.rollout.proxy.history import Reply, Turn, continue_prompt

        content, calls = self.calls(output_ids)
        if not calls:
            return None
        ids = [f"call_{i}" for i in range(len(calls))]
        reply = {
            "role": "assistant",
            "content": content,
            "tool_calls": [
                {"id": i, "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for i, c in zip(ids, calls)
            ],
        }
        results = [
            {"role": "tool", "tool_call_id": i, "content": calculator_tool(c["name"], c["arguments"])} for i, c in zip(ids, calls)
        ]
        after = [*messages, reply, *results]
        turn = Turn(prompt, messages=messages, tools=CALCULATOR_TOOLS)
        continued = continue_prompt(self.render, turn, Reply(list(output_ids), "stop", reply), after, CALCULATOR_TOOLS)
        return continued if continued is not None else self.render.render(after, CALCULATOR_TOOLS, True)


class CalculatorEvaluation(AgentEvaluation):
    """The calculator game (examples/calculator_agent.py) played directly on ``engine`` on held-out
    problems: the first call; for a reply with tool calls, the tools run and the second call; the
    episode's reward is its final answer, stripped, equal to the product. Reported as
    ``eval/reward`` (greedy), ``eval/sampled_reward`` (``online.eval_samples`` per problem, fixed
    seed), and ``eval/tool_call`` / ``eval/sampled/tool_call``: the share of first calls that call
    ``mul`` with the problem's two numbers."""

    def __init__(self, engine: GenerationEngine, tasks: list[Task], online: OnlineConfig, **kwargs):
        super().__init__(engine, tasks, online, **kwargs)
        self.game = CalculatorGame(self.render)

    def _play(self, tasks: list[Task], temperature: float, seed: int | None) -> tuple[list[float], list[float]]:
        from rollbook.rollout.engine import GenerationRequest

        def generate(prompts: list[list[int]], turn: int) -> list[list[int]]:
            requests = [
                GenerationRequest(
                    prompt_token_ids=p,
                    max_new_tokens=self.online.max_tokens,
                    temperature=temperature,
                    top_p=self.top_p if temperature > 0 else 1.0,
                    stop_token_ids=self.stop_token_ids,
                )
                for p in prompts
            ]
            results = self.engine.generate(requests, seed=None if seed is None else seed + turn)
            return [list(r.output_token_ids) for r in results]

        firsts = [self.game.first_prompt(t.prompt) for t in tasks]
        replies = generate([p for p, _ in firsts], 0)
        called, finals = [], list(replies)
        second: dict[int, list[int]] = {}
        for i, (task, (prompt, messages), reply) in enumerate(zip(tasks, firsts, replies)):
            _, calls = self.game.calls(reply)
            a, b = (int(x) for x in task.prompt.removeprefix("what is ").removesuffix("?").split(" times "))
            called.append(
                float(any(c["name"] == "mul" and c["arguments"] in ({"a": a, "b": b}, {"a": b, "b": a}) for c in calls))
            )
            if self.online.turns > 1:
                nxt = self.game.answer_prompt(prompt, messages, reply)
                if nxt is not None:
                    second[i] = nxt
        for i, out in zip(second, generate(list(second.values()), 1) if second else []):
            finals[i] = out
        solved = [float(self.render.decode(out).strip() == task.answer) for task, out in zip(tasks, finals)]
        return called, solved

    def evaluate(self) -> dict[str, float]:
        out: dict[str, float] = {}
        runs: list[tuple[str, str, list[Task], float, int | None]] = [("eval/", "eval/reward", self.tasks, 0.0, None)]
        if self.online.eval_samples:
            tasks = [t for t in self.tasks for _ in range(self.online.eval_samples)]
            runs.append(("eval/sampled/", "eval/sampled_reward", tasks, self.online.temperature, self.online.eval_seed))
        for prefix, overall, tasks, temperature, seed in runs:
            called, solved = self._play(tasks, temperature, seed)
            out[overall] = sum(solved) / max(1, len(solved))
            out[f"{prefix}tool_call"] = sum(called) / max(1, len(called))
        return out


def _rewarded(client) -> int:
    """Turns of the agent's sessions that got their reward (the trainer can pull only those)."""
    table = client.query("SELECT count(*) AS n FROM trajectories WHERE original_reward IS NOT NULL")
    return int(table.column("n")[0].as_py())


class ProxyProcess:
    """``rollbook proxy`` as a child process; ``url`` once it printed 'listening on'."""

    def __init__(self, config_path: pathlib.Path, env: dict[str, str]):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rollbook.cli", "proxy", "--config", str(config_path), "--log-level", "WARNING"],
            stdout=subprocess.PIPE,
            text=True,
            env=child_env(env),
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line.startswith("listening on "):
            self.proc.kill()
            raise RuntimeError(f"rollbook proxy did not start (exit {self.proc.wait()}): {line!r}")
        self.url = line.removeprefix("listening on ")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def run_online(config: RunConfig, client, address: str, keys: dict) -> dict:
    from rollbook.config import ProxyConfig, write_resolved
    from rollbook.devices import cast_floating
    from rollbook.rollout.engine import NativeEngine
    from rollbook.rollout.engines import model_positions, proxy_batch_size
    from rollbook.rollout.proxy.render import renderer
    from rollbook.trainer.loop import Trainer
    from rollbook.trainer.model_builders import build_models
    from rollbook.weights.shm import SharedMemoryPublisher

    online = config.online
    assert online is not None
    agent = pathlib.Path(online.agent)
    if not agent.is_file():
        raise CommandError(f"online.agent {online.agent!r} is not a file (run from the repository root, or give its path)")
    run_dir = pathlib.Path(config.run_dir)
    train, heldout = (
        online_problems(config, "train", online.num_problems),
        online_problems(config, "heldout", online.num_eval_problems),
    )
    problems = run_dir / "online-problems.txt"
    problems.write_text("".join(t.prompt + "\n" for t in train))

    student, teacher = build_models(config)
    channel = f"rollbook-{uuid.uuid4().hex[:12]}"
    publisher = SharedMemoryPublisher(channel, cast_floating(student.state_dict(), config.trainer.dtype), checksum=True)
    positions = model_positions(config.trainer.model, field="trainer.model.path") or ONLINE_CONTEXT_TOKENS
    proxy_cfg = ProxyConfig(
        server=address,
        port=0,
        model_id=config.trainer.model_id,
        model=config.trainer.model,
        weights=f"shm:{channel}",
        seed=config.rollout.seed,
        device=config.rollout.device,
        dtype=config.rollout.dtype,
        max_context_tokens=min(ONLINE_CONTEXT_TOKENS, positions),
        max_tokens_limit=max(16, online.max_tokens),
        worker_id="proxy",
        max_concurrent=max(4, online.concurrency * online.group_size),
        spool_dir=str(run_dir / "proxy" / "spool"),
    )
    # the held-out games are the agent's sessions played here: sized as the proxy's engine is
    evaluator = NativeEngine(
        engine_copy(student, config.rollout),
        version=0,
        seed=config.rollout.seed,
        max_batch_size=proxy_batch_size(proxy_cfg),
        max_seq_len=proxy_cfg.max_context_tokens,
    )
    # the held-out games render as the proxy does: its tokenizer (model.path's, or the toy one)
    evaluation = CalculatorEvaluation if online.game == "calculator" else AgentEvaluation
    judge = evaluation(
        evaluator, heldout, online, top_p=config.rollout.top_p, model=config.trainer.model, render=renderer(proxy_cfg)
    )
    trainer = Trainer(
        config.trainer,
        client,
        model=student,
        teacher=teacher,
        publishers=[publisher.publish, lambda v, sd: install_weights(evaluator, v, sd)],
    )
    trainer.start()
    proxy_dir = run_dir / "proxy"
    write_resolved(proxy_cfg, proxy_dir)
    env = rollbook_env.with_keys(dict(os.environ), {"worker_key": keys["worker_key"], "admin_key": keys["admin_key"]})
    proxy = ProxyProcess(proxy_dir / "config.json", env)
    print(f"proxy: {proxy.url} following shm:{channel}", flush=True)
    agent_log = open(run_dir / "agent.log", "a")
    agent_env = rollbook_env.with_keys(dict(os.environ), {"worker_key": keys["worker_key"]})  # starts sessions only
    agent_proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rollbook.lifetime",  # the agent stops with this process, even when it is SIGKILLed
            str(agent),
            "--proxy",
            proxy.url,
            "--problems",
            str(problems),
            "--rounds",
            "0",
            "--concurrency",
            str(online.concurrency),
            "--group-size",
            str(online.group_size),
            "--turns",
            str(online.turns),
            "--seed",
            str(config.rollout.seed if online.agent_seed is None else online.agent_seed),
            "--model",
            config.trainer.model_id,
            "--temperature",
            str(online.temperature),
            "--max-tokens",
            str(online.max_tokens),
        ],
        stdout=agent_log,
        stderr=subprocess.STDOUT,
        env=child_env(agent_env),
    )
    print(
        f"agent: {agent} (pid {agent_proc.pid}), {online.concurrency} x {online.group_size} sessions at once, "
        f"log {run_dir / 'agent.log'}",
        flush=True,
    )
    try:
        placement = Online(judge, client, config.trainer.num_samples, {"agent": agent_proc, "proxy": proxy.proc}, run_dir)
        return drive_run(config, trainer, placement)
    finally:
        agent_proc.terminate()
        try:
            agent_proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            agent_proc.kill()
            agent_proc.wait()
        agent_log.close()
        proxy.stop()
        publisher.close()
        evaluator.close()


class Online(Placement):
    """An agent's sessions through ``rollbook proxy`` feed the trainer. A step per
    ``num_samples`` newly rewarded turns: the trainer would otherwise take every few rows the agent
    finished (its pulls return what is ready), a batch too small to learn from. Held-out reward is the
    agent's game played here (``AgentEvaluation``); a dead agent or proxy fails the run."""

    def __init__(self, judge: AgentEvaluation, client, num_samples: int, processes: dict, run_dir: pathlib.Path):
        self.judge, self.client, self.num_samples = judge, client, num_samples
        self.processes, self.run_dir = processes, run_dir
        self.seen: int | None = None  # counted from the first try, after the evaluation before step 0
        self.now = 0

    def before_step(self) -> bool:
        self.now = _rewarded(self.client)
        if self.seen is None:
            self.seen = self.now
        return self.now - self.seen >= self.num_samples

    def stepped(self, stats: dict) -> None:
        self.seen = self.now

    def evaluate(self) -> dict:
        return self.judge.evaluate()

    def waiting(self) -> str | None:
        for name, proc in self.processes.items():
            if proc.poll() is not None:
                raise RuntimeError(f"the {name} process exited with {proc.returncode} (see {self.run_dir})")
        return None

    def console_extra(self, stats: dict) -> str:
        return f"staleness<={stats['batch/staleness_max']}  "
