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
staleness gate, the spooling submitter). Both configs, ``RolloutConfig`` and ``WorkerConfig``, are in
rollbook/config/rollout.py.

Your own data (``dataset`` set): the tasks are the dataset's rows (``rollbook/datasets.py``), prompts
are encoded with ``tokenizer`` (a local Hugging Face directory; chat rows through its chat template),
completions stop on its eos, ``stop_token_ids`` and ``stop_strings``, and each domain's reward (``rewards``,
``rollbook/rewards.py``) scores them in a process pool, so generation of the next chunk of prompts
(``chunk_prompts``) goes on while the previous one is scored. A row whose prompt is longer than
``max_prompt_tokens`` is a bad row (the engine is sized for that prompt plus ``max_new_tokens``:
rollout/engines.py). Without ``dataset`` the built-in toy domains run exactly as before, with the
character tokenizer (a toy prompt longer than ``max_prompt_tokens`` is a ``ConfigError``).

Stops: every request, for rollouts and for evaluation, stops on the tokenizer's eos and on
``stop_token_ids``, to which ``use_model_stops`` adds the model's own eos ids (its generation config's,
``rollbook.language_models.stop_token_ids``); a completion is scored up to the first of them.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from dataclasses import dataclass, field

from rollbook.config import ModelConfig, RolloutConfig
from rollbook.datasets import BadRow, DatasetError, Row, RowSampler, load_dataset
from rollbook.errors import ConfigError
from rollbook.language_models import stop_token_ids, student_vocab_size
from rollbook.rewards import RewardPool, Scored
from rollbook.rollout.engine import GenerationEngine, GenerationRequest
from rollbook.rollout.engines import rollout_prompt_tokens
from rollbook.tasks import TOKENIZER, RewardOutcome, RewardTally, Task, build_domains, make_tasks, score
from rollbook.tokenizers import StopStrings, Tokenizer, load_tokenizer
from rollbook.v1 import rollbook_pb2 as pb

log = logging.getLogger("rollbook.rollout")


# The row fields each built-in reward kind needs (a row without them is a bad row, found at load time).
_NEEDS = {"math": ("answer",), "exact": ("answer",), "code": ("tests",)}


def tokenizer_for(config: RolloutConfig) -> Tokenizer:
    """The tokenizer a worker of this config encodes with: the toy character tokenizer unless a
    dataset names a Hugging Face directory. Its ``stop_token_ids`` are its eos and
    ``config.stop_token_ids`` (the model's own eos ids among them once ``use_model_stops`` ran)."""
    if config.dataset is None:
        return load_tokenizer(None, default=TOKENIZER, extra_stop_token_ids=config.stop_token_ids)
    try:
        return load_tokenizer(
            config.tokenizer, default=TOKENIZER, stop_strings=config.stop_strings, extra_stop_token_ids=config.stop_token_ids
        )
    except (OSError, ValueError) as exc:  # a missing directory, files transformers cannot read, no eos
        raise ConfigError(f"rollout.tokenizer: {exc}") from None


def encode_row(tokenizer: Tokenizer, row: Row, max_prompt_tokens: int) -> tuple[list[int], str | None]:
    """A dataset row's prompt ids, and why the row is bad (None: it is not): a prompt the tokenizer
    refuses or encodes to nothing, or one longer than ``max_prompt_tokens`` (``rollout.max_prompt_tokens``:
    the engine holds no longer request)."""
    try:
        ids = tokenizer.encode_prompt(prompt=row.prompt, messages=row.messages)
        if not ids:
            raise ValueError("the prompt encodes to no tokens")
    except Exception as exc:  # noqa: BLE001 - whatever the tokenizer refuses is a bad row, never a crash mid-run
        return [], f"prompt does not encode: {type(exc).__name__}: {exc}"
    if len(ids) > max_prompt_tokens:
        return ids, f"prompt of {len(ids)} tokens is longer than rollout.max_prompt_tokens ({max_prompt_tokens})"
    return ids, None


@dataclass
class RolloutStats:
    tally: RewardTally = field(default_factory=RewardTally)
    num_trajectories: int = 0
    num_tokens: int = 0
    reasons: dict[str, int] = field(default_factory=dict)  # dataset rewards: "<domain>/<reason>" -> count
    fractions: dict[str, list[float]] = field(default_factory=dict)  # code rewards: tests passed, per domain

    def add_scored(self, domain: str, scored: Scored) -> None:
        key = f"{domain}/{scored.info.get('reason', 'ok' if scored.outcome.status == 'ok' else 'verifier_error')}"
        self.reasons[key] = self.reasons.get(key, 0) + 1
        if "fraction" in scored.info:
            self.fractions.setdefault(domain, []).append(float(scored.info["fraction"]))

    def metrics(self) -> dict[str, float]:
        out = {**self.tally.metrics(), "rollout/trajectories": self.num_trajectories, "rollout/tokens": self.num_tokens}
        out.update({f"reward/reason/{k}": v for k, v in sorted(self.reasons.items())})
        out.update({f"reward/tests_passed/{d}": sum(v) / len(v) for d, v in sorted(self.fractions.items()) if v})
        return out


class RolloutWorker:
    def __init__(self, engine: GenerationEngine, config: RolloutConfig, *, model_id: str, tokenizer: Tokenizer | None = None):
        self.engine = engine
        self.config = config
        self.model_id = model_id
        self.rng = random.Random(config.seed)
        self.stats = RolloutStats()
        self.rewards: RewardPool | None = None
        self.bad_rows: list[BadRow] = []
        if config.dataset is not None:
            self._init_dataset(config, tokenizer)
            return
        self.tokenizer = tokenizer_for(config)  # the characters, stopping on eos and config.stop_token_ids
        self.domains = build_domains(config)
        self.train_tasks = [
            t
            for d in self.domains.values()
            for t in make_tasks(d, "train", config.num_train_tasks, config.seed, allow_fewer=True)
        ]
        self.eval_tasks = [
            t
            for d in self.domains.values()
            for t in make_tasks(d, "heldout", config.num_eval_tasks, config.seed, allow_fewer=True)
        ]
        tasks = [*self.train_tasks, *self.eval_tasks]
        longest = max((len(TOKENIZER.encode(t.prompt, add_bos=True)) for t in tasks), default=0)
        if longest > rollout_prompt_tokens(config):
            raise ConfigError(
                f"rollout.max_prompt_tokens ({rollout_prompt_tokens(config)}) is shorter than the longest toy task "
                f"prompt ({longest} tokens): raise it"
            )

    # -- your own data ---------------------------------------------------------------------------

    def _init_dataset(self, config: RolloutConfig, tokenizer: Tokenizer | None) -> None:
        data_cfg = config.dataset
        assert data_cfg is not None
        self.tokenizer = tokenizer or tokenizer_for(config)
        needs = {domain: _NEEDS.get(r.kind, ()) for domain, r in config.rewards.items()}
        data = load_dataset(data_cfg, requirements=needs, known_domains=set(config.rewards))
        self.bad_rows = list(data.bad_rows)
        self._prompt_ids: dict[tuple[str, str], list[int]] = {}
        train, heldout = self._encodable(data.train), self._encodable(data.heldout)
        if self.bad_rows and data_cfg.on_bad_row == "fail":
            raise DatasetError(
                f"{len(self.bad_rows)} bad rows (on_bad_row = 'fail'): " + "; ".join(str(b) for b in self.bad_rows[:20])
            )
        if not train:
            raise DatasetError(f"no usable training rows in {data_cfg.train_files} ({len(self.bad_rows)} bad rows)")
        self.train_rows, self.eval_rows = train, heldout
        self.sampler = RowSampler(train, shuffle=data_cfg.shuffle, seed=data_cfg.seed, epochs=data_cfg.epochs)
        self.rewards = RewardPool(config.rewards, max_workers=config.reward_workers)
        self._stop = StopStrings(self.tokenizer, self.tokenizer.stop_strings) if self.tokenizer.stop_strings else None
        log.info(
            "dataset: %d training rows, %d held out, %d bad rows skipped; tokenizer vocabulary %d",
            len(train),
            len(heldout),
            len(self.bad_rows),
            self.tokenizer.vocab_size,
        )

    def _encodable(self, rows: list[Row]) -> list[Row]:
        """The rows whose prompt the tokenizer encodes within ``max_prompt_tokens`` (ids cached); the others
        are bad rows, reported now."""
        kept = []
        for row in rows:
            ids, problem = encode_row(self.tokenizer, row, rollout_prompt_tokens(self.config))
            if problem is not None:  # reported, never a crash mid-run
                path, _, line = row.source.rpartition(":")
                bad = BadRow(path, int(line) if line.isdigit() else 0, problem)
                self.bad_rows.append(bad)
                log.warning("bad row %s (skipped)", bad)
                continue
            self._prompt_ids[(row.source, row.task_id)] = ids
            kept.append(row)
        return kept

    @property
    def exhausted(self) -> bool:
        """A dataset whose epochs are all produced: there is nothing more to generate."""
        return self.config.dataset is not None and self.sampler.exhausted

    def _request(self, row: Row, *, temperature: float) -> GenerationRequest:
        cfg = self.config
        return GenerationRequest(
            prompt_token_ids=self._prompt_ids[(row.source, row.task_id)],
            max_new_tokens=cfg.max_new_tokens,
            temperature=temperature,
            top_p=cfg.top_p if temperature > 0 else 1.0,
            top_k=cfg.top_k if temperature > 0 else 0,
            stop_token_ids=self.tokenizer.stop_token_ids,
            stop=self._stop,
        )

    def _generate_and_score(self, rows: list[Row], temperature: float, *, seed: int | None = None, per_prompt: int = 1):
        """Generate ``rows`` (one request each; ``per_prompt`` consecutive requests per prompt) chunk by
        chunk of ``chunk_prompts`` prompts, each chunk's completions sent to the reward pool at once,
        so the next chunk generates while it is scored. Returns ``[(result, Scored)]`` in order."""
        assert self.rewards is not None
        chunk = self.config.chunk_prompts * per_prompt or len(rows)
        pending = []
        for start in range(0, len(rows), max(1, chunk)):
            part = rows[start : start + chunk]
            results = self.engine.generate([self._request(r, temperature=temperature) for r in part], seed=seed)
            pending += [
                (result, self.rewards.submit(row.domain, self.tokenizer.completion_text(result.output_token_ids), row.as_dict()))
                for row, result in zip(part, results)
            ]
        return [(result, self.rewards.result(future, timeout=self.config.reward_timeout_s)) for result, future in pending]

    def _produce_rows(self, num_prompts: int) -> list[pb.Trajectory]:
        cfg = self.config
        rows = self.sampler.take(num_prompts)
        owners = [(row, uuid.uuid4().hex) for row in rows]
        expanded = [(row, group_id) for row, group_id in owners for _ in range(cfg.group_size)]
        scored = self._generate_and_score([row for row, _ in expanded], cfg.temperature, per_prompt=cfg.group_size)
        out = []
        for (row, group_id), (result, score_) in zip(expanded, scored):
            self.stats.add_scored(row.domain, score_)
            out.append(self._build(row.task_id, row.domain, group_id, result, score_.outcome))
        return out

    def close(self) -> None:
        """Stop the reward processes (a dataset worker); idempotent."""
        if self.rewards is not None:
            self.rewards.close()

    def __enter__(self) -> "RolloutWorker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- both ------------------------------------------------------------------------------------

    def produce(self, num_prompts: int | None = None) -> list[pb.Trajectory]:
        """Sample ``num_prompts`` training problems, ``group_size`` completions each (a dataset whose
        epochs are done gives fewer, then none)."""
        cfg = self.config
        if cfg.dataset is not None:
            return self._produce_rows(num_prompts or cfg.num_prompts)
        tasks = [self.rng.choice(self.train_tasks) for _ in range(num_prompts or cfg.num_prompts)]
        requests, owners = [], []
        for task in tasks:
            group_id = uuid.uuid4().hex
            prompt = TOKENIZER.encode(task.prompt, add_bos=True)
            for _ in range(cfg.group_size):
                requests.append(
                    GenerationRequest(
                        prompt_token_ids=prompt,
                        max_new_tokens=cfg.max_new_tokens,
                        temperature=cfg.temperature,
                        top_p=cfg.top_p,
                        top_k=cfg.top_k,
                        stop_token_ids=self.tokenizer.stop_token_ids,
                    )
                )
                owners.append((task, group_id))
        results = self.engine.generate(requests)
        return [self._trajectory(task, group_id, result) for (task, group_id), result in zip(owners, results)]

    def _trajectory(self, task: Task, group_id: str, result) -> pb.Trajectory:
        outcome = score(task, self.tokenizer.completion_text(result.output_token_ids), self.domains)
        return self._build(task.task_id, task.domain, group_id, result, outcome)

    def _build(self, task_id: str, domain: str, group_id: str, result, outcome: RewardOutcome) -> pb.Trajectory:
        self.stats.tally.add(outcome)
        self.stats.num_trajectories += 1
        self.stats.num_tokens += len(result.output_token_ids)
        traj = pb.Trajectory(
            trajectory_id=uuid.uuid4().hex,
            session_id=result.request_id,
            group_id=group_id,
            group_size=self.config.group_size,
            request_id=result.request_id,
            consumed=True,
            task_id=task_id,
            domain=domain,
            model_id=self.model_id,
            prompt_token_ids=result.prompt_token_ids,
            output_token_ids=result.output_token_ids,
            output_logprobs=result.output_logprobs,
            output_versions=result.output_versions,
            temperature=result.temperature,
            top_p=result.top_p,
            top_k=result.top_k,
            finish_reason=result.finish_reason,
            worker_id=self.config.worker_id,
            created_at=time.time(),
        )
        if outcome.status == "ok":
            traj.reward = outcome.reward
        else:
            log.warning("verifier error on %s: %s (submitted without a reward)", task_id, outcome.error)
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
        cfg = self.config
        if cfg.dataset is not None:
            return self._evaluate_rows()
        tasks = tasks or self.eval_tasks
        greedy = [
            GenerationRequest(
                prompt_token_ids=TOKENIZER.encode(t.prompt, add_bos=True),
                max_new_tokens=cfg.max_new_tokens,
                temperature=0.0,
                stop_token_ids=self.tokenizer.stop_token_ids,
            )
            for t in tasks
        ]
        out, errors = self._score(tasks, self.engine.generate(greedy), "eval/", "eval/reward")
        if cfg.num_eval_samples:
            sampled_tasks = [t for t in tasks for _ in range(cfg.num_eval_samples)]
            sampled = [
                GenerationRequest(
                    prompt_token_ids=TOKENIZER.encode(t.prompt, add_bos=True),
                    max_new_tokens=cfg.max_new_tokens,
                    temperature=cfg.temperature,
                    top_p=cfg.top_p,
                    top_k=cfg.top_k,
                    stop_token_ids=self.tokenizer.stop_token_ids,
                )
                for t in sampled_tasks
            ]
            more, more_errors = self._score(
                sampled_tasks, self.engine.generate(sampled, seed=cfg.eval_seed), "eval/sampled/", "eval/sampled_reward"
            )
            out.update(more)
            errors += more_errors
        out["eval/errors"] = errors
        return out

    def _score(self, tasks: list[Task], results, prefix: str, overall: str) -> tuple[dict[str, float], int]:
        per_domain: dict[str, list[float]] = {}
        errors = 0
        for task, result in zip(tasks, results):
            outcome = score(task, self.tokenizer.completion_text(result.output_token_ids), self.domains)
            if outcome.status == "ok":
                per_domain.setdefault(task.domain, []).append(outcome.reward)
            else:  # a crashed verifier is not a wrong answer: counted apart, not averaged as 0
                errors += 1
        out = {f"{prefix}{d}": sum(v) / len(v) for d, v in per_domain.items()}
        scored = sum(len(v) for v in per_domain.values())
        out[overall] = sum(sum(v) for v in per_domain.values()) / scored if scored else float("nan")
        return out, errors

    def _evaluate_rows(self) -> dict[str, float]:
        """``evaluate`` on the dataset's held-out rows (none: an empty dict), scored by the rewards."""
        cfg = self.config
        rows = self.eval_rows[: cfg.num_eval_tasks]
        if not rows:
            return {}
        out, errors = self._tally(rows, self._generate_and_score(rows, 0.0), "eval/", "eval/reward")
        if cfg.num_eval_samples:
            sampled = [r for r in rows for _ in range(cfg.num_eval_samples)]
            more, more_errors = self._tally(
                sampled,
                self._generate_and_score(sampled, cfg.temperature, seed=cfg.eval_seed, per_prompt=cfg.num_eval_samples),
                "eval/sampled/",
                "eval/sampled_reward",
            )
            out.update(more)
            errors += more_errors
        out["eval/errors"] = errors
        return out

    @staticmethod
    def _tally(rows: list[Row], scored, prefix: str, overall: str) -> tuple[dict[str, float], int]:
        per_domain: dict[str, list[float]] = {}
        errors = 0
        for row, (_, s) in zip(rows, scored):
            if s.outcome.status == "ok":
                per_domain.setdefault(row.domain, []).append(s.outcome.reward)
            else:
                errors += 1
        out = {f"{prefix}{d}": sum(v) / len(v) for d, v in per_domain.items()}
        n = sum(len(v) for v in per_domain.values())
        out[overall] = sum(sum(v) for v in per_domain.values()) / n if n else float("nan")
        return out, errors


def use_model_tokenizer(rollout: RolloutConfig, model: ModelConfig) -> None:
    """With a dataset and no ``rollout.tokenizer``: take the tokenizer from the model's directory
    (``model.path``) when the model loads from one. Called where both configs meet (``rollbook run``,
    ``rollbook rollout``)."""
    if rollout.dataset is not None and rollout.tokenizer is None and model.path:
        rollout.tokenizer = model.path


def use_model_stops(rollout: RolloutConfig, model: ModelConfig) -> None:
    """Add the model's own eos ids (its generation config's: ``rollbook.language_models.stop_token_ids``)
    to ``rollout.stop_token_ids``, so that the worker's requests, for rollouts and for evaluation, stop
    on any of them as well as on the tokenizer's eos. Called where both configs meet (``rollbook run``,
    ``rollbook rollout``); running it again changes nothing."""
    rollout.stop_token_ids = stop_token_ids(None, model, rollout.stop_token_ids)


def registered_vocab_size(rollout: RolloutConfig, model: ModelConfig) -> int:
    """The vocabulary size to register for the store's token check: the student's
    (``rollbook.language_models.student_vocab_size``: a model directory's config.json, or the tiny model's
    ``vocab_size``), except a tiny model of unset size trained on a dataset, which gets its tokenizer's."""
    if model.path or model.vocab_size or rollout.dataset is None:
        return student_vocab_size(model)
    return tokenizer_for(rollout).vocab_size
