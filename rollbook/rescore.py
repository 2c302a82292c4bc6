"""Scoring stored outputs again: a run's tokenizer and task rows, and a reward run over them the way
the rollout worker runs its own (``rollbook replay reward``, rollbook/cli/replay.py; docs/replay.md).

    config = load_run_config("runs/exp1/config.json")
    tokenizer, described = run_tokenizer(config)           # the run's: characters, or its HF directory
    rows = RowSource.for_run(config)                        # task_id -> the row a verifier receives
    scorer, settings = build_scorer("math", {}, config, rows, workers=2)
    with scorer:
        row, found = rows.row(task_id, domain, prompt_ids, tokenizer)
        pending = scorer.submit([scorer.item(domain, tokenizer.completion_text(output_ids), row, found)])
        scores = scorer.collect(pending)                    # one rollbook.rewards.Scored per item

What the worker did, done again: the completion is the text of the stored output ids up to the first
stop token or stop string (``Tokenizer.completion_text``: the run's tokenizer, its eos, the model's
generation-config eos ids and ``rollout.stop_token_ids``, ``rollout.stop_strings``); the row is the
one the worker scored (``rollbook.datasets.Row.as_dict``): the toy task of that ``task_id`` (rebuilt
from the run's domains and seeds: ``make_tasks`` is deterministic) or the dataset row of that
``task_id`` (the run's dataset files). A stored row whose task is not found (an online agent's own
problems, a dataset file since changed) gets a row made from the ledger alone (the prompt decoded,
no answer or tests), marked ``row_found`` false in its score's info: a reward that needs a reference
then says so as an ``error``.

Rewards (``REWARD_KINDS``): every kind of ``RewardConfig`` (``math``, ``code``, ``exact``, ``regex``,
``package.module:function``), run by the same ``RewardPool`` (processes, the code sandbox) as a
dataset run's rollouts, in chunks of rows per task; and ``run``: the run's own rewards, the toy
domains' verifiers (``rollbook.tasks.score``, in this process as the worker runs them) or the
dataset's ``[rollout.rewards.<domain>]``. A verifier that raises, times out or kills its process is
an ``error`` with its reason for that row alone (a chunk that fails is scored again row by row),
never a 0.0.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import pathlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollbook.config import RewardConfig, RunConfig
from rollbook.config.rollout import BUILTIN_REWARD_KINDS
from rollbook.errors import ConfigError
from rollbook.rewards import RewardPool, Scored
from rollbook.tasks import TOKENIZER, RewardOutcome, Task, TaskDomain, build_domains, make_tasks, score
from rollbook.tokenizers import Tokenizer, load_tokenizer

RUN_REWARD = "run"  # the run's own rewards
REWARD_KINDS = (*BUILTIN_REWARD_KINDS, "package.module:function", RUN_REWARD)

# Rows per pool task: a cheap verifier pays the hand-off between processes once per chunk. The code
# sandbox runs a program per row anyway, and its wall-clock limit is per row, so code goes one by one.
CHUNK_ROWS = 64
POOL_START_S = 300.0  # longest wait for restarted pool processes to take work
_REPLAY_KEY = "replay"  # the pool's one "domain" when a single reward scores every row


def load_run_config(path: str | pathlib.Path) -> RunConfig:
    """The resolved config a ``rollbook run`` wrote into its run directory (``config.json``)."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise ConfigError(
            f"no run config {path}: the ledger's run directory holds the config.json `rollbook run` wrote; "
            "name it with --run-config"
        )
    try:
        return RunConfig.model_validate(json.loads(path.read_text()))
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{path} is not a run config: {exc}") from None


def run_tokenizer(config: RunConfig) -> tuple[Tokenizer, str]:
    """The tokenizer the run's rollout worker decoded completions with, and a description of it: the
    toy character tokenizer, or a dataset run's ``rollout.tokenizer`` (the model's directory when
    unset), stopping where the worker's completions stopped (rollout/worker.py ``tokenizer_for``,
    ``use_model_tokenizer``, ``use_model_stops``)."""
    from rollbook.language_models import stop_token_ids

    rollout, model = config.rollout, config.trainer.model
    stops = stop_token_ids(None, model, rollout.stop_token_ids)
    if rollout.dataset is None:
        return load_tokenizer(None, default=TOKENIZER, extra_stop_token_ids=stops), "toy character tokenizer"
    path = rollout.tokenizer or model.path
    try:
        tokenizer = load_tokenizer(path, default=TOKENIZER, stop_strings=rollout.stop_strings, extra_stop_token_ids=stops)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"the run's tokenizer: {exc}") from None
    return tokenizer, f"Hugging Face tokenizer {path}" if path else "toy character tokenizer"


@dataclass
class RowSource:
    """The row a verifier receives for a stored ``task_id`` (``rollbook.datasets.Row.as_dict``'s
    keys): the run's toy tasks or dataset rows, by id. ``toy`` holds the toy tasks themselves (the
    ``run`` reward verifies them with their domain's own verifier) and ``domains`` those verifiers."""

    rows: dict[str, dict[str, Any]]
    described: str
    toy: dict[str, Task] = field(default_factory=dict)
    domains: dict[str, TaskDomain] = field(default_factory=dict)
    ambiguous: set[str] = field(default_factory=set)  # dataset task ids of two different rows

    @classmethod
    def for_run(cls, config: RunConfig) -> RowSource:
        rollout = config.rollout
        if rollout.dataset is not None:
            return cls._dataset(config)
        domains = build_domains(rollout)
        seeds = {rollout.seed}
        if config.placement == "ray":  # each rollout actor samples its own tasks: seed + I (rollbook/run/ray_cluster.py)
            seeds |= {rollout.seed + i for i in range(config.ray.num_workers)}
        if config.online is not None and config.online.agent_seed is not None:
            seeds.add(config.online.agent_seed)
        tasks: dict[str, Task] = {}
        for seed in sorted(seeds):
            for domain in domains.values():
                for split, n in (("train", rollout.num_train_tasks), ("heldout", rollout.num_eval_tasks)):
                    for task in make_tasks(domain, split, n, seed, allow_fewer=True):  # type: ignore[arg-type]
                        tasks[task.task_id] = task
        rows = {tid: _task_row(t) for tid, t in tasks.items()}
        described = f"toy tasks of {sorted(domains)} (seeds {sorted(seeds)}, {len(tasks)} tasks)"
        return cls(rows, described, toy=tasks, domains=dict(domains))

    @classmethod
    def _dataset(cls, config: RunConfig) -> RowSource:
        from rollbook.datasets import load_dataset

        data_cfg = config.rollout.dataset
        assert data_cfg is not None
        missing = [f for f in [*data_cfg.train_files, *data_cfg.heldout_files] if not pathlib.Path(f).exists()]
        if missing:
            raise ConfigError(
                f"the run's dataset file {missing[0]} is not found from {pathlib.Path.cwd()} (config.json keeps the "
                "paths as the run was given them: run this from the directory the run started in)"
            )
        data = load_dataset(data_cfg.model_copy(update={"on_bad_row": "skip"}))
        rows: dict[str, dict[str, Any]] = {}
        ambiguous: set[str] = set()
        for row in [*data.train, *data.heldout]:
            as_dict = row.as_dict()
            known = rows.get(row.task_id)
            if known is not None and _reference(known) != _reference(as_dict):
                ambiguous.add(row.task_id)
            rows.setdefault(row.task_id, as_dict)
        files = [*data_cfg.train_files, *data_cfg.heldout_files]
        return cls(rows, f"dataset rows of {files} ({len(rows)} task ids)", ambiguous=ambiguous)

    def row(
        self, task_id: str, domain: str, prompt_token_ids: Sequence[int], tokenizer: Tokenizer
    ) -> tuple[dict[str, Any], bool]:
        """The row of ``task_id`` and whether the run's tasks had it; else one made from the ledger
        (the stored prompt decoded, no reference)."""
        found = self.rows.get(task_id)
        if found is not None and task_id not in self.ambiguous:
            return found, True
        prompt = tokenizer.decode([i for i in prompt_token_ids if i != tokenizer.bos_token_id])
        return (
            {
                "task_id": task_id,
                "domain": domain,
                "prompt": prompt,
                "messages": None,
                "answer": None,
                "tests": None,
                "source": "ledger",
                "extra": {},
            },
            False,
        )


def _task_row(task: Task) -> dict[str, Any]:
    return {
        "task_id": task.task_id,
        "domain": task.domain,
        "prompt": task.prompt,
        "messages": None,
        "answer": task.answer,
        "tests": None,
        "source": "toy",
        "extra": {},
    }


def _reference(row: Mapping[str, Any]) -> tuple[Any, ...]:
    return (row.get("domain"), row.get("answer"), json.dumps(row.get("tests"), sort_keys=True, default=str))


def reward_settings(reward: str, options: Mapping[str, str], config: RunConfig) -> tuple[dict[str, RewardConfig], str]:
    """The reward ``reward`` (a kind, ``module:function`` or ``run``) with ``options`` (``RewardConfig``
    fields as text, e.g. ``pattern``, ``timeout_s``), as the pool's configs by key, and its settings as
    canonical JSON (what a reward version records and compares on a resume). ``run`` takes no
    options: the run's config says everything."""
    if reward == RUN_REWARD:
        if options:
            raise ConfigError(f"--reward run takes no --reward-option (the run's config sets its rewards): {sorted(options)}")
        if config.rollout.dataset is None:
            domains = build_domains(config.rollout)
            settings = {"toy": {name: repr(domain) for name, domain in sorted(domains.items())}}
            return {}, json.dumps(settings, sort_keys=True)
        rewards = dict(config.rollout.rewards)
        return rewards, json.dumps({d: r.model_dump(mode="json") for d, r in sorted(rewards.items())}, sort_keys=True)
    try:
        reward_config = RewardConfig.model_validate({**options, "kind": reward})
    except ValueError as exc:
        raise ConfigError(f"--reward {reward!r}: {exc}".replace("\n", "; ")) from None
    return {_REPLAY_KEY: reward_config}, json.dumps(reward_config.model_dump(mode="json"), sort_keys=True)


@dataclass(frozen=True)
class Item:
    """One output to score: its pool key (its domain, or the one reward's key), completion and row."""

    key: str
    completion: str
    row: dict[str, Any]
    row_found: bool


@dataclass
class Pending:
    """What ``Scorer.submit`` started: the items, and the pool's chunk futures (or the scores already
    made in this process)."""

    items: list[Item]
    chunks: list[tuple[cf.Future[list[Scored]], list[int]]] = field(default_factory=list)
    done: dict[int, Scored] = field(default_factory=dict)


class Scorer:
    """Runs one reward over items: the pool's verifiers in ``workers`` processes (0: in this process)
    in chunks, or the toy verifiers here. ``timeout_s`` bounds one row's verifier: a chunk gets
    ``timeout_s`` per row; a chunk that runs past it or loses its process is scored again row by row,
    the pool's processes restarted first, so only the row at fault gets the ``error``."""

    def __init__(
        self,
        pools: dict[str, RewardConfig],
        rows: RowSource,
        *,
        workers: int = 2,
        timeout_s: float = 300.0,
    ) -> None:
        self.rows = rows
        self.single = _REPLAY_KEY in pools
        self.timeout_s = timeout_s
        self.pool = RewardPool(pools, max_workers=workers) if pools else None
        self.chunk_rows = {key: 1 if config.kind == "code" else CHUNK_ROWS for key, config in pools.items()}
        self.retried_rows = 0  # rows scored again alone after their chunk failed
        # the pool's processes start now, beside the selection; no row's time counts until one takes work
        self._starting = self.pool.submit_many(self.pool.domains()[0], []) if self.pool is not None and workers > 0 else None

    def item(self, domain: str, completion: str, row: dict[str, Any], row_found: bool) -> Item:
        return Item(_REPLAY_KEY if self.single else domain, completion, row, row_found)

    def submit(self, items: list[Item]) -> Pending:
        pending = Pending(items)
        by_key: dict[str, list[int]] = {}
        for i, it in enumerate(items):
            if self.pool is None:  # the toy domains' own verifiers: microseconds, in this process as the worker runs them
                pending.done[i] = self._toy(it)
            else:
                by_key.setdefault(it.key, []).append(i)
        assert self.pool is not None or not by_key
        for key, indices in by_key.items():
            step = self.chunk_rows.get(key, CHUNK_ROWS)
            for start in range(0, len(indices), step):
                chunk = indices[start : start + step]
                future = self.pool.submit_many(key, [(items[i].completion, items[i].row) for i in chunk])  # type: ignore[union-attr]
                pending.chunks.append((future, chunk))
        return pending

    def collect(self, pending: Pending) -> list[Scored]:
        """One ``Scored`` per submitted item, in order; ``info`` notes a row made from the ledger alone."""
        done = dict(pending.done)
        if self._starting is not None and pending.chunks:
            self._starting.result(timeout=POOL_START_S)
            self._starting = None
        for future, chunk in pending.chunks:
            try:
                scores = future.result(timeout=self.timeout_s * len(chunk))
            except Exception:  # noqa: BLE001 - past its time, its process died, or cancelled by a restart: row by row
                self._restart()
                scores = [self._alone(pending.items[i]) for i in chunk]
                self.retried_rows += len(chunk)
            done.update(zip(chunk, scores))
        out = []
        for i, it in enumerate(pending.items):
            scored = done[i]
            if not it.row_found:
                scored = Scored(scored.outcome, {**scored.info, "row_found": False})
            out.append(scored)
        return out

    def _alone(self, it: Item) -> Scored:
        assert self.pool is not None
        future = self.pool.submit(it.key, it.completion, it.row)
        try:
            return future.result(timeout=self.timeout_s)
        except cf.TimeoutError:
            self._restart()  # the verifier still runs: its process must go
            return _error(f"verifier did not answer within {self.timeout_s:g} s")
        except cf.process.BrokenProcessPool:
            self._restart()  # fresh processes now, so the next row's time does not pay for their start
            return _error("the verifier's process died scoring this row")
        except Exception as exc:  # noqa: BLE001 - anything else the pool raised: this row's error
            return _error(f"{type(exc).__name__}: {exc}")

    def _restart(self) -> None:
        """Fresh pool processes, waited for (spawned, their imports done) before any row's time counts:
        a row scored alone must not be charged for the pool's start."""
        assert self.pool is not None
        self.pool.restart()
        self.pool.submit_many(self.pool.domains()[0], []).result(timeout=POOL_START_S)

    def _toy(self, it: Item) -> Scored:
        task = self.rows.toy.get(it.row["task_id"]) if it.row_found else None
        if task is None:
            return _error(f"task {it.row['task_id']!r} ({it.row['domain']}) is not among the run's toy tasks: no verifier")
        outcome = score(task, it.completion, self.rows.domains)
        return Scored(outcome, {} if outcome.status == "ok" else {"reason": "verifier_error"})

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    def __enter__(self) -> Scorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _error(reason: str) -> Scored:
    return Scored(RewardOutcome("error", None, reason[:500]), {"reason": "verifier_error"})


def build_scorer(
    reward: str, options: Mapping[str, str], config: RunConfig, rows: RowSource, *, workers: int = 2, timeout_s: float = 300.0
) -> tuple[Scorer, str]:
    """The scorer of ``reward`` (``reward_settings``) over ``rows``, and its settings' canonical JSON.
    A ``module:function`` that does not import is a ``ConfigError`` now, not an error on every row."""
    pools, settings = reward_settings(reward, options, config)
    try:
        scorer = Scorer(pools, rows, workers=workers, timeout_s=timeout_s)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("rollout.rewards.replay", "--reward")) from None
    return scorer, settings
