"""The rollout worker: sample task groups with a generation engine, verify them, and turn them into
``Trajectory`` evidence for the store.

    worker = RolloutWorker(engine, RolloutConfig(), model_id="tiny")
    trajectories = worker.produce(num_prompts=8)      # group_size samples per prompt, rewarded
    heldout = worker.evaluate()                       # greedy held-out reward per domain

Every trajectory carries its group (one per prompt), the per-token log-probs and policy versions
the engine recorded, the sampling parameters, the domain, and the verifier's reward. A verifier
that raises yields no reward (never 0.0): the sample is submitted without one and counted as an
error, and the store keeps its group waiting under the incomplete-group policy.
``rollout/main.py`` ``run_worker`` is the loop behind ``rollbook rollout`` (weights from a channel, the
staleness gate, the spooling submitter).
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from rollbook.rollout.engine import GenerationEngine, GenerationRequest
from rollbook.tasks import TOKENIZER, RewardTally, Task, build_domains, make_tasks, score
from rollbook.v1 import rollbook_pb2 as pb

log = logging.getLogger("rollbook.rollout")


class RolloutConfig(BaseModel):
    """What a rollout worker samples and how."""

    model_config = ConfigDict(extra="forbid")

    domains: list[str] = Field(default_factory=lambda: ["arithmetic", "reverse"], description="Task domains to sample (see rollbook/tasks.py).")
    num_digits: int = Field(2, ge=1, le=6, description="arithmetic: operand digits.")
    reverse_max_len: int = Field(4, ge=1, le=12, description="reverse: longest string.")
    reverse_per_char: bool = Field(False, description="reverse: graded reward, the fraction of characters in the right place (else 1/0 exact match).")
    num_train_tasks: int = Field(400, ge=1, description="Training problems per domain.")
    num_eval_tasks: int = Field(40, ge=1, description="Held-out problems per domain for evaluation.")
    num_eval_samples: int = Field(8, ge=0, description="Sampled answers per held-out problem for eval/sampled_reward (0 = greedy only).")
    eval_seed: int = Field(1234, description="Seed of the sampled evaluation: the same for every evaluation (common random numbers).")
    group_size: int = Field(8, ge=1, description="Samples per prompt (one normalization group).")
    num_prompts: int = Field(8, ge=1, description="Prompts per rollout round.")
    max_new_tokens: int = Field(6, ge=1, description="Longest completion.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature (the trainer recomputes log-probs at the same one).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass (1 = off).")
    top_k: int = Field(0, ge=-1, description="Top-k (0 or -1 = off).")
    max_staleness: int = Field(1, ge=0, description="Staleness gate eta: admit while (eta + version + 1) * batch > accepted + running. `rollbook rollout` replaces it with the max_staleness its trainer announces through the store.")
    seed: int = Field(0, description="Task sampling seed.")
    worker_id: str = Field("worker-0", description="Recorded on every trajectory.")


@dataclass
class RolloutStats:
    tally: RewardTally = field(default_factory=RewardTally)
    num_trajectories: int = 0
    num_tokens: int = 0

    def metrics(self) -> dict[str, float]:
        return {**self.tally.metrics(), "rollout/trajectories": self.num_trajectories, "rollout/tokens": self.num_tokens}


class RolloutWorker:
    def __init__(self, engine: GenerationEngine, config: RolloutConfig, *, model_id: str):
        self.engine = engine
        self.config = config
        self.model_id = model_id
        self.domains = build_domains(config)
        self.train_tasks = [t for d in self.domains.values() for t in make_tasks(d, "train", config.num_train_tasks, config.seed, allow_fewer=True)]
        self.eval_tasks = [t for d in self.domains.values() for t in make_tasks(d, "heldout", config.num_eval_tasks, config.seed, allow_fewer=True)]
        self.rng = random.Random(config.seed)
        self.stats = RolloutStats()

    def produce(self, num_prompts: int | None = None) -> list[pb.Trajectory]:
        """Sample ``num_prompts`` training problems, ``group_size`` completions each."""
        cfg = self.config
        tasks = [self.rng.choice(self.train_tasks) for _ in range(num_prompts or cfg.num_prompts)]
        requests, owners = [], []
        for task in tasks:
            group_id = uuid.uuid4().hex
            prompt = TOKENIZER.encode(task.prompt, add_bos=True)
            for _ in range(cfg.group_size):
                requests.append(GenerationRequest(prompt_token_ids=prompt, max_new_tokens=cfg.max_new_tokens,
                                                  temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                                  stop_token_ids=[TOKENIZER.eos_token_id]))
                owners.append((task, group_id))
        results = self.engine.generate(requests)
        return [self._trajectory(task, group_id, result) for (task, group_id), result in zip(owners, results)]

    def _trajectory(self, task: Task, group_id: str, result) -> pb.Trajectory:
        outcome = score(task, TOKENIZER.decode(result.output_token_ids), self.domains)
        self.stats.tally.add(outcome)
        self.stats.num_trajectories += 1
        self.stats.num_tokens += len(result.output_token_ids)
        traj = pb.Trajectory(
            trajectory_id=uuid.uuid4().hex, session_id=result.request_id, group_id=group_id,
            group_size=self.config.group_size, request_id=result.request_id, consumed=True, task_id=task.task_id,
            domain=task.domain, model_id=self.model_id, prompt_token_ids=result.prompt_token_ids,
            output_token_ids=result.output_token_ids, output_logprobs=result.output_logprobs,
            output_versions=result.output_versions, temperature=result.temperature, top_p=result.top_p,
            top_k=result.top_k, finish_reason=result.finish_reason, worker_id=self.config.worker_id,
            created_at=time.time())
        if outcome.status == "ok":
            traj.reward = outcome.reward
        else:
            log.warning("verifier error on %s: %s (submitted without a reward)", task.task_id, outcome.error)
        return traj

    def evaluate(self, tasks: list[Task] | None = None) -> dict[str, float]:
        """Held-out reward, per domain and overall, two ways:

        - greedy (``eval/reward``, ``eval/<domain>``): one answer per problem at temperature 0;
        - sampled (``eval/sampled_reward``, ``eval/sampled/<domain>``): ``num_eval_samples`` answers
          per problem at the rollout's temperature and top-p, the policy's expected reward, the
          quantity RL raises. Drawn with the fixed ``eval_seed`` (common random numbers), so two
          evaluations differ only by the weights.

        Greedy accuracy is a threshold of the policy: a tiny change in the weights can flip many
        answers at once, so the sampled figure is the smooth one to compare across steps."""
        tasks = tasks or self.eval_tasks
        cfg = self.config
        greedy = [GenerationRequest(prompt_token_ids=TOKENIZER.encode(t.prompt, add_bos=True),
                                    max_new_tokens=cfg.max_new_tokens, temperature=0.0,
                                    stop_token_ids=[TOKENIZER.eos_token_id]) for t in tasks]
        out, errors = self._score(tasks, self.engine.generate(greedy), "eval/", "eval/reward")
        if cfg.num_eval_samples:
            sampled_tasks = [t for t in tasks for _ in range(cfg.num_eval_samples)]
            sampled = [GenerationRequest(prompt_token_ids=TOKENIZER.encode(t.prompt, add_bos=True),
                                         max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                                         top_p=cfg.top_p, top_k=cfg.top_k, stop_token_ids=[TOKENIZER.eos_token_id])
                       for t in sampled_tasks]
            more, more_errors = self._score(sampled_tasks, self.engine.generate(sampled, seed=cfg.eval_seed),
                                            "eval/sampled/", "eval/sampled_reward")
            out.update(more)
            errors += more_errors
        out["eval/errors"] = errors
        return out

    def _score(self, tasks: list[Task], results, prefix: str, overall: str) -> tuple[dict[str, float], int]:
        per_domain: dict[str, list[float]] = {}
        errors = 0
        for task, result in zip(tasks, results):
            outcome = score(task, TOKENIZER.decode(result.output_token_ids), self.domains)
            if outcome.status == "ok":
                per_domain.setdefault(task.domain, []).append(outcome.reward)
            else:  # a crashed verifier is not a wrong answer: counted apart, not averaged as 0
                errors += 1
        out = {f"{prefix}{d}": sum(v) / len(v) for d, v in per_domain.items()}
        scored = sum(len(v) for v in per_domain.values())
        out[overall] = sum(sum(v) for v in per_domain.values()) / scored if scored else float("nan")
        return out, errors
