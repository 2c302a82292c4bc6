"""Rewards for dataset rows: a registry of verifiers chosen per domain in the config (``RewardConfig``,
rollbook/config/rollout.py), and a process pool that runs them off the generation thread.

    rewards = {"math": RewardConfig(kind="math"), "code": RewardConfig(kind="code", timeout_s=5)}
    scored = score_row(build_reward(rewards["math"]), "so \\boxed{\\frac{1}{2}}", {"answer": "0.5"})
    scored.outcome          # RewardOutcome(status="ok", reward=1.0)
    with RewardPool(rewards, max_workers=2) as pool:
        futures = [pool.submit(row["domain"], completion, row) for ...]   # generation goes on meanwhile

Kinds (``RewardConfig.kind``):

- ``math``: ``math-verify`` compares the completion's final answer (``\\boxed{}`` or plain; the last one
  wins as math-verify extracts it) with the row's reference answer; equivalent forms (``1/2``, ``0.5``,
  ``\\frac{1}{2}``) agree. No answer found in the completion is a wrong answer (0.0, reason
  ``no_answer``); a reference that does not parse is the dataset's fault: an ``error`` outcome.
- ``code``: the completion's program (its last fenced block, else the whole text) runs against the
  row's ``tests`` in the sandbox (``rollbook/sandbox_exec.py``); reward 1.0 when every test passes
  (``code_reward = "fraction"``: the fraction passed); the fraction and the reason are in ``info``. A
  misbehaving program is reward 0.0 with its reason (``timeout``, ``memory``, ``network``, ...).
- ``exact``: the stripped completion equals the stripped reference (``case_sensitive``).
- ``regex``: ``pattern`` searched in the completion; with a reference answer, the match (group 1 when
  the pattern has a group) must equal it, else a match is enough.
- ``package.module:function``: a user's function ``f(completion: str, row: dict) -> float`` (or a
  ``RewardOutcome``), imported in the pool's processes.

A verifier that raises, returns something that is not a finite number, or cannot run is an
``error`` ``RewardOutcome`` with its reason, never a silent 0.0 (the convention of rollbook/tasks.py).
Rows are plain dicts (``rollbook.datasets.Row.as_dict``): ``task_id``, ``domain``, ``prompt``,
``messages``, ``answer``, ``tests``, ``extra``.
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib
import json
import math
import multiprocessing
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollbook.config.rollout import BUILTIN_REWARD_KINDS, RewardConfig
from rollbook.errors import ConfigError
from rollbook.lifetime import exit_with_parent
from rollbook.sandbox_exec import SandboxLimits, extract_program, run_program
from rollbook.tasks import RewardOutcome


@dataclass
class Scored:
    """A verifier's outcome, and what it recorded about it (``reason``; for code ``passed``, ``total``,
    ``fraction``)."""

    outcome: RewardOutcome
    info: dict[str, Any] = field(default_factory=dict)


class VerifierError(Exception):
    """The verifier could not judge (bad reference, no tests, sandbox failure): an ``error`` outcome."""


Verifier = Callable[[str, Mapping[str, Any]], "float | RewardOutcome | Scored"]


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def math_reward(completion: str, row: Mapping[str, Any]) -> Scored:
    from math_verify import parse, verify

    answer = row.get("answer")
    if answer is None or str(answer).strip() == "":
        raise VerifierError("the row has no reference answer")
    # math-verify's timeouts use SIGALRM, which only the main thread may set
    timeout = 5 if _in_main_thread() else None
    # the reference is read as math first ($...$: "2\\sqrt{2}" is 2*sqrt(2), not the number 2), then as it is
    gold = parse(f"${answer}$", fallback_mode="no_fallback", parsing_timeout=timeout)
    if not gold:
        gold = parse(str(answer), fallback_mode="no_fallback", parsing_timeout=timeout)
    if not gold:
        raise VerifierError(f"reference answer {str(answer)[:80]!r} does not parse")
    pred = parse(completion, parsing_timeout=timeout)
    if not pred and "\\" in completion and "$" not in completion:  # bare LaTeX such as \frac12: read it as math
        pred = parse(f"${completion.strip()}$", parsing_timeout=timeout)
    if not pred:
        return Scored(RewardOutcome("ok", 0.0), {"reason": "no_answer"})
    ok = verify(gold, pred, timeout_seconds=timeout)
    return Scored(RewardOutcome("ok", float(ok)), {"reason": "correct" if ok else "wrong", "parsed": str(pred[-1])[:80]})


def _normalize_tests(tests: Any) -> list[str]:
    if tests is None:
        return []
    if isinstance(tests, str):
        try:
            loaded = json.loads(tests)
        except ValueError:
            return [tests] if tests.strip() else []
        return _normalize_tests(loaded) if isinstance(loaded, list) else [tests]
    if isinstance(tests, (list, tuple)) and all(isinstance(t, str) for t in tests):
        return [t for t in tests if t.strip()]
    raise VerifierError(f"tests must be a list of Python statements or one string, got {type(tests).__name__}")


def sandbox_limits(config: RewardConfig) -> SandboxLimits:
    """The code sandbox's limits for one ``code`` reward (rollbook/sandbox_exec.py)."""
    return SandboxLimits(
        wall_s=config.timeout_s,
        cpu_s=config.cpu_s,
        memory_mb=config.memory_mb,
        max_file_mb=config.max_file_mb,
        max_files=config.max_files,
        network_namespace=config.network_namespace,
    )


def code_reward(config: RewardConfig) -> Verifier:
    limits = sandbox_limits(config)

    def verify_code(completion: str, row: Mapping[str, Any]) -> Scored:
        tests = _normalize_tests(row.get("tests"))
        if not tests:
            raise VerifierError("the row has no tests")
        result = run_program(extract_program(completion), tests, limits)
        if result.reason == "sandbox_error":
            raise VerifierError(f"sandbox failed: {result.detail}")
        info = {
            "reason": result.reason,
            "passed": result.passed,
            "total": result.total,
            "fraction": result.fraction,
            "detail": result.detail,
            "wall_s": round(result.wall_s, 3),
        }
        if result.violations or result.reason not in ("ok", "tests_failed"):
            return Scored(RewardOutcome("ok", 0.0), info)  # misbehaviour: 0 whatever passed before it
        reward = result.fraction if config.code_reward == "fraction" else float(result.all_passed)
        return Scored(RewardOutcome("ok", reward), info)

    return verify_code


def exact_reward(config: RewardConfig) -> Verifier:
    def verify_exact(completion: str, row: Mapping[str, Any]) -> Scored:
        answer = row.get("answer")
        if answer is None:
            raise VerifierError("the row has no reference answer")
        got, want = completion.strip(), str(answer).strip()
        if not config.case_sensitive:
            got, want = got.casefold(), want.casefold()
        return Scored(RewardOutcome("ok", float(got == want)), {"reason": "correct" if got == want else "wrong"})

    return verify_exact


def regex_reward(config: RewardConfig) -> Verifier:
    if not config.pattern:
        raise ValueError("a regex reward needs `pattern`")
    pattern = re.compile(config.pattern, 0 if config.case_sensitive else re.IGNORECASE)

    def verify_regex(completion: str, row: Mapping[str, Any]) -> Scored:
        match = pattern.search(completion)
        if match is None:
            return Scored(RewardOutcome("ok", 0.0), {"reason": "no_match"})
        answer = row.get("answer")
        if answer is None:
            return Scored(RewardOutcome("ok", 1.0), {"reason": "match"})
        got = (match.group(1) if pattern.groups else match.group(0)).strip()
        want = str(answer).strip()
        if not config.case_sensitive:
            got, want = got.casefold(), want.casefold()
        return Scored(RewardOutcome("ok", float(got == want)), {"reason": "correct" if got == want else "wrong"})

    return verify_regex


def import_function(spec: str) -> Callable[..., Any]:
    """``package.module:function`` -> the function (ImportError/AttributeError name what is missing)."""
    module_name, _, name = spec.partition(":")
    module = importlib.import_module(module_name)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise AttributeError(f"{module_name} has no function {name!r}")
    return fn


def build_reward(config: RewardConfig) -> Verifier:
    if config.kind == "math":
        return math_reward
    if config.kind == "code":
        return code_reward(config)
    if config.kind == "exact":
        return exact_reward(config)
    if config.kind == "regex":
        return regex_reward(config)
    return import_function(config.kind)


def score_row(verifier: Verifier, completion: str, row: Mapping[str, Any]) -> Scored:
    """Run ``verifier``; anything but a finite number (or an ``ok`` outcome) is an ``error``."""
    try:
        got = verifier(completion, row)
    except Exception as exc:  # a crashed verifier is not a wrong answer
        return Scored(RewardOutcome("error", None, f"{type(exc).__name__}: {exc}"[:500]), {"reason": "verifier_error"})
    if isinstance(got, Scored):
        scored = got
    elif isinstance(got, RewardOutcome):
        scored = Scored(got)
    elif isinstance(got, (bool, int, float)):
        scored = Scored(RewardOutcome("ok", float(got)))
    else:
        return Scored(
            RewardOutcome("error", None, f"verifier returned {type(got).__name__}, not a number"), {"reason": "verifier_error"}
        )
    outcome = scored.outcome
    if outcome.status == "ok" and (outcome.reward is None or not math.isfinite(outcome.reward)):
        return Scored(
            RewardOutcome("error", None, f"verifier returned a non-finite reward {outcome.reward!r}"),
            {"reason": "verifier_error"},
        )
    return scored


_BUILT: dict[str, Verifier] = {}


def _score_remote(config_json: str, completion: str, row: Mapping[str, Any]) -> Scored:
    """In a pool process: build (once) and run the verifier of ``config_json``."""
    try:
        verifier = _BUILT.get(config_json)
        if verifier is None:
            verifier = _BUILT[config_json] = build_reward(RewardConfig.model_validate_json(config_json))
    except Exception as exc:
        return Scored(
            RewardOutcome("error", None, f"cannot build the verifier: {type(exc).__name__}: {exc}"[:500]),
            {"reason": "verifier_error"},
        )
    return score_row(verifier, completion, row)


def _score_chunk_remote(config_json: str, items: list[tuple[str, dict[str, Any]]]) -> list[Scored]:
    """In a pool process: ``_score_remote`` for each ``(completion, row)`` of a chunk."""
    return [_score_remote(config_json, completion, row) for completion, row in items]


def _warm_up(needs_math: bool) -> None:
    """In each pool process at start: exit when the process that started the pool dies (a pool
    process waits on a queue whose writing end it holds itself, so it would otherwise live on after a
    SIGKILL of ``rollbook run``: rollbook/lifetime.py), and, when a ``math`` reward is configured
    (``needs_math``), import math_verify, so the first score is not slow (a pool without one skips its
    0.6 s import)."""
    parent = multiprocessing.parent_process()
    exit_with_parent(parent.pid if parent is not None else None)
    if needs_math:
        try:
            import math_verify  # noqa: F401
        except ImportError:
            pass


class RewardPool:
    """Verifiers per domain, run in ``max_workers`` processes (spawned: a fresh interpreter, never a
    fork of a process holding torch threads; each exits when this process dies, however it dies).
    ``max_workers = 0`` scores in the calling thread. A pool process that dies is replaced and the
    samples it held get ``error`` outcomes; the pool keeps going."""

    def __init__(self, rewards: Mapping[str, RewardConfig], *, max_workers: int = 2) -> None:
        for domain, config in rewards.items():  # fail at start on a bad config, not in the middle of a run
            try:
                if config.kind not in BUILTIN_REWARD_KINDS:
                    import_function(config.kind)
                elif config.kind == "regex":
                    regex_reward(config)
            except (ImportError, AttributeError, ValueError, re.error) as exc:
                raise ConfigError(f"rollout.rewards.{domain}: {type(exc).__name__}: {exc}") from None
        self._configs = {domain: config.model_dump_json() for domain, config in rewards.items()}
        self._math = any(config.kind == "math" for config in rewards.values())  # its processes import math_verify
        self.max_workers = max_workers
        self._lock = threading.Lock()
        self._executor: cf.ProcessPoolExecutor | None = None

    def domains(self) -> list[str]:
        return sorted(self._configs)

    def _pool(self) -> cf.ProcessPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = cf.ProcessPoolExecutor(
                    self.max_workers,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_warm_up,
                    initargs=(self._math,),
                )
            return self._executor

    def submit(self, domain: str, completion: str, row: Mapping[str, Any]) -> cf.Future[Scored]:
        config = self._configs.get(domain)
        if config is None:
            done: cf.Future[Scored] = cf.Future()
            done.set_result(
                Scored(
                    RewardOutcome("error", None, f"no reward configured for domain {domain!r} (configured: {self.domains()})"),
                    {"reason": "verifier_error"},
                )
            )
            return done
        if self.max_workers == 0:
            inline: cf.Future[Scored] = cf.Future()
            inline.set_result(_score_remote(config, completion, dict(row)))
            return inline
        try:
            return self._pool().submit(_score_remote, config, completion, dict(row))
        except cf.process.BrokenProcessPool:
            self._reset()
            return self._pool().submit(_score_remote, config, completion, dict(row))

    def submit_many(self, domain: str, items: Sequence[tuple[str, Mapping[str, Any]]]) -> cf.Future[list[Scored]]:
        """Score ``items`` (``(completion, row)``, one domain) as one task of one pool process: a cheap
        verifier's rows then pay the hand-off between processes (about 0.2 ms) once per chunk instead of
        once per row (``rollbook replay reward`` re-scores a ledger this way). The future's result is
        one ``Scored`` per item, in order; a pool process that dies fails the whole chunk
        (``BrokenProcessPool``), which the caller may score again row by row."""
        config = self._configs.get(domain)
        chunk = [(completion, dict(row)) for completion, row in items]
        if config is None or self.max_workers == 0:
            done: cf.Future[list[Scored]] = cf.Future()
            if config is None:  # each row's outcome says that no reward is configured for the domain
                done.set_result([self.submit(domain, completion, row).result() for completion, row in chunk])
            else:
                done.set_result(_score_chunk_remote(config, chunk))
            return done
        try:
            return self._pool().submit(_score_chunk_remote, config, chunk)
        except cf.process.BrokenProcessPool:
            self._reset()
            return self._pool().submit(_score_chunk_remote, config, chunk)

    def restart(self) -> None:
        """Stop every pool process now, busy or not, so the next ``submit`` starts fresh ones: a
        verifier that never returns would otherwise hold its process (and its share of the pool) for
        good, since shutting an executor down waits for the task a process is running. Futures still
        pending fail (``BrokenProcessPool``, or cancelled)."""
        with self._lock:
            old, self._executor = self._executor, None
        if old is None:
            return
        # CPython's own table of the executor's processes: before Python 3.14 no public call stops a busy one
        processes = list((getattr(old, "_processes", None) or {}).values())
        old.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            process.kill()

    def result(self, future: cf.Future[Scored], timeout: float | None = None) -> Scored:
        """The future's result; a broken pool or a timeout is an ``error`` outcome (and a broken pool
        is replaced for the next samples)."""
        try:
            return future.result(timeout=timeout)
        except cf.process.BrokenProcessPool as exc:
            self._reset()
            return Scored(RewardOutcome("error", None, f"reward process died: {exc}"[:500]), {"reason": "verifier_error"})
        except cf.TimeoutError:
            future.cancel()
            return Scored(
                RewardOutcome("error", None, f"verifier did not answer within {timeout} s"), {"reason": "verifier_error"}
            )
        except Exception as exc:
            return Scored(RewardOutcome("error", None, f"{type(exc).__name__}: {exc}"[:500]), {"reason": "verifier_error"})

    def score_many(self, items: list[tuple[str, str, Mapping[str, Any]]]) -> list[Scored]:
        futures = [self.submit(domain, completion, row) for domain, completion, row in items]
        return [self.result(f) for f in futures]

    def _reset(self) -> None:
        with self._lock:
            old, self._executor = self._executor, None
        if old is not None:
            old.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        with self._lock:
            old, self._executor = self._executor, None
        if old is not None:
            old.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
