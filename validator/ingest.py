"""Per-trajectory evidence rules checked at ingest, before anything is stored.

``check(row, registry, config)`` returns ``None`` for a trajectory that may be stored, or a
``(Reason, detail)`` pair; the store writes the pair to ``rejections`` and answers ``REJECTED``.
Rules run in a fixed order and the first failure wins, so each trajectory gets exactly one code.
Group- and pull-time rules (retry orphans, incomplete groups, staleness) live elsewhere in this
package. The codes are documented in ``docs/evidence.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np
from pydantic import BaseModel, Field

from rollbook.validator.reasons import Reason

Verdict = tuple[Reason, str] | None


class IngestConfig(BaseModel):
    """Limits and tolerances of the ingest rules."""

    max_output_tokens: int = Field(262_144, ge=1, description="Longest accepted output (tokens); longer is OVERSIZED.")
    max_prompt_tokens: int = Field(262_144, ge=0, description="Longest accepted prompt (tokens); longer is OVERSIZED.")
    max_id_length: int = Field(256, ge=8, description="Longest accepted id string (trajectory, session, group, request).")
    positive_logprob_tolerance: float = Field(
        1e-4, ge=0, description="A log-prob above this is POSITIVE_LOGPROB (log-softmax rounding can give tiny positives)."
    )
    sentinel_logprobs: list[float] = Field(
        default_factory=lambda: [-9999.0],
        description="Values engines write instead of a real log-prob (vLLM: -9999.0); any one of them is SENTINEL_LOGPROB.",
    )
    require_sampling_params: bool = Field(
        True, description="Reject trajectories without `temperature` and `top_p` (MISSING_SAMPLING_PARAMS)."
    )


class Registry(Protocol):
    """What the rules need to know about registered models and published policy versions."""

    def vocab_size(self, model_id: str) -> int | None: ...

    def published_versions(self, model_id: str) -> "VersionSet": ...


@dataclass
class VersionSet:
    """The versions published for one model (sorted numpy array for vectorised membership)."""

    versions: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @property
    def latest(self) -> int | None:
        return int(self.versions[-1]) if len(self.versions) else None


class _RowLike(Protocol):
    msg: object
    prompt: np.ndarray
    tokens: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray


def check(row: _RowLike, registry: Registry, config: IngestConfig) -> Verdict:
    """The first broken rule for this trajectory, or ``None``."""
    return _structure(row, config) or _evidence(row, config) or _against_registry(row, registry)


def check_batch(rows: Sequence[_RowLike], registry: Registry, config: IngestConfig) -> list[Verdict]:
    """``check`` for a whole batch, vectorised: every rule runs once over the batch's concatenated
    arrays; only rows that some rule flags go through ``check`` for their exact code and detail.
    Same verdicts as ``[check(r, ...) for r in rows]``, at a fraction of the cost."""
    suspect = _suspects(rows, registry, config)
    return [check(row, registry, config) if bad else None for row, bad in zip(rows, suspect)]


def _suspects(rows: Sequence[_RowLike], registry: Registry, config: IngestConfig) -> np.ndarray:
    """True for rows that may break a rule (a superset of the rejected rows)."""
    n = len(rows)
    n_tok = np.fromiter((len(r.tokens) for r in rows), np.int64, n)
    n_lp = np.fromiter((len(r.logprobs) for r in rows), np.int64, n)
    n_v = np.fromiter((len(r.versions) for r in rows), np.int64, n)
    n_p = np.fromiter((len(r.prompt) for r in rows), np.int64, n)
    suspect = (n_tok == 0) | (n_lp != n_tok) | (n_v != n_tok) | (n_tok > config.max_output_tokens)
    suspect |= (n_p > config.max_prompt_tokens) | np.fromiter((_scalar_suspect(r, config) for r in rows), bool, n)
    ok = np.flatnonzero(~suspect)
    if len(ok) == 0:
        return suspect
    sel = [rows[i] for i in ok]
    starts = _starts(n_tok[ok])
    lp = np.concatenate([r.logprobs for r in sel])
    tok = np.concatenate([r.tokens for r in sel])
    ver = np.concatenate([r.versions for r in sel])
    bad_lp = ~np.isfinite(lp) | (lp > config.positive_logprob_tolerance)
    for sentinel in config.sentinel_logprobs:
        bad_lp |= lp == np.float32(sentinel)
    step_down = np.zeros(len(ver), bool)
    step_down[1:] = np.diff(ver) < 0
    step_down[starts] = False  # a new row may start lower than the previous one ended
    bad = np.logical_or.reduceat(bad_lp | step_down | (tok < 0) | (ver < 0), starts)
    top = np.maximum.reduceat(tok, starts)
    # prompts (may be empty): a -1 appended to each row's prompt keeps every reduceat segment non-empty
    prompts = np.concatenate([np.append(r.prompt, -1) for r in sel])
    p_starts = _starts(n_p[ok] + 1)
    top = np.maximum(top, np.maximum.reduceat(prompts, p_starts))
    negative = prompts < 0
    negative[p_starts + n_p[ok]] = False  # the appended -1s
    bad |= np.logical_or.reduceat(negative, p_starts)
    vocab = np.fromiter((registry.vocab_size(r.msg.model_id) or 0 for r in sel), np.int64, len(sel))
    lo, hi = _version_ranges(sel, registry)
    bad |= (top >= vocab) | (np.minimum.reduceat(ver, starts) < lo) | (np.maximum.reduceat(ver, starts) > hi)
    suspect[ok] = bad
    return suspect


def _starts(lengths: np.ndarray) -> np.ndarray:
    starts = np.zeros(len(lengths), np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return starts


def _scalar_suspect(r: _RowLike, config: IngestConfig) -> bool:
    m = r.msg
    return (not m.trajectory_id
            or max(len(m.trajectory_id), len(m.session_id), len(m.group_id), len(m.request_id), len(m.model_id)) > config.max_id_length
            or (config.require_sampling_params and not (m.HasField("temperature") and m.HasField("top_p")))
            or (m.HasField("reward") and not math.isfinite(m.reward)))


def _version_ranges(rows: Sequence[_RowLike], registry: Registry) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the published range [lo, hi] when the model's versions are contiguous (so any
    version inside is published); otherwise an empty range, which sends the row to ``check``."""
    ranges: dict[str, tuple[int, int]] = {}
    for model_id in {r.msg.model_id for r in rows}:
        v = registry.published_versions(model_id).versions
        contiguous = len(v) > 0 and int(v[-1]) - int(v[0]) + 1 == len(v)
        ranges[model_id] = (int(v[0]), int(v[-1])) if contiguous else (1, 0)
    lo = np.fromiter((ranges[r.msg.model_id][0] for r in rows), np.int64, len(rows))
    hi = np.fromiter((ranges[r.msg.model_id][1] for r in rows), np.int64, len(rows))
    return lo, hi


def _structure(row: _RowLike, config: IngestConfig) -> Verdict:
    m = row.msg
    if not m.trajectory_id:
        return Reason.MISSING_ID, "trajectory_id is empty; it is the idempotency key and must be set by the client"
    for name in ("trajectory_id", "session_id", "group_id", "request_id", "model_id"):
        if len(getattr(m, name)) > config.max_id_length:
            return Reason.OVERSIZED, f"{name} is {len(getattr(m, name))} chars, over the limit of {config.max_id_length}"
    n = len(row.tokens)
    if n > config.max_output_tokens:
        return Reason.OVERSIZED, f"output has {n} tokens, over the limit of {config.max_output_tokens}"
    if len(row.prompt) > config.max_prompt_tokens:
        return Reason.OVERSIZED, f"prompt has {len(row.prompt)} tokens, over the limit of {config.max_prompt_tokens}"
    if n == 0:
        return Reason.EMPTY_OUTPUT, "output_token_ids is empty: nothing to train on"
    if len(row.logprobs) == 0:
        return Reason.MISSING_LOGPROBS, f"output_logprobs is empty for {n} output tokens"
    if len(row.logprobs) != n or len(row.versions) != n:
        return (
            Reason.LENGTH_MISMATCH,
            f"output_token_ids={n}, output_logprobs={len(row.logprobs)}, output_versions={len(row.versions)} must be equal",
        )
    if (row.tokens < 0).any() or (row.prompt < 0).any():
        return Reason.INVALID_TOKEN_ID, "token ids must be >= 0"
    return None


def _evidence(row: _RowLike, config: IngestConfig) -> Verdict:
    m, lp = row.msg, row.logprobs
    finite = np.isfinite(lp)
    if not finite.all():
        i = int(np.argmin(finite))
        return Reason.NONFINITE_LOGPROB, f"output_logprobs[{i}] = {lp[i]}"
    for sentinel in config.sentinel_logprobs:
        hits = np.flatnonzero(lp == np.float32(sentinel))
        if len(hits):
            return Reason.SENTINEL_LOGPROB, f"output_logprobs[{hits[0]}] = {sentinel} is an engine sentinel, not a log-prob ({len(hits)} tokens)"
    if (lp > config.positive_logprob_tolerance).any():
        i = int(np.argmax(lp))
        return Reason.POSITIVE_LOGPROB, f"output_logprobs[{i}] = {lp[i]:.6g} > {config.positive_logprob_tolerance} (a probability above 1)"
    v = row.versions
    if (v < 0).any():
        return Reason.UNPUBLISHED_VERSION, f"output_versions has negative version {int(v.min())} (prompt tokens carry no version)"
    if len(v) > 1 and (np.diff(v) < 0).any():
        i = int(np.flatnonzero(np.diff(v) < 0)[0])
        return Reason.DECREASING_VERSIONS, f"output_versions[{i}]={v[i]} > output_versions[{i + 1}]={v[i + 1]}"
    if config.require_sampling_params:
        missing = [f for f in ("temperature", "top_p") if not m.HasField(f)]
        if missing:
            return Reason.MISSING_SAMPLING_PARAMS, f"missing {', '.join(missing)}: the behavior distribution is unknown"
    if m.HasField("reward") and not math.isfinite(m.reward):
        return Reason.NONFINITE_REWARD, f"reward = {m.reward}"
    return None


def _against_registry(row: _RowLike, registry: Registry) -> Verdict:
    m = row.msg
    vocab = registry.vocab_size(m.model_id)
    if vocab is None:
        return Reason.UNREGISTERED_MODEL, f"model_id {m.model_id!r} is not registered (RegisterModel, admin key)"
    top = max(int(row.tokens.max()), int(row.prompt.max()) if len(row.prompt) else -1)
    if top >= vocab:
        return Reason.TOKEN_OUT_OF_VOCAB, f"token id {top} >= vocab_size {vocab} of model {m.model_id!r}"
    published = registry.published_versions(m.model_id)
    latest = published.latest
    vmax = int(row.versions[-1])
    if latest is None or vmax > latest:
        return Reason.FUTURE_VERSION, f"version {vmax} is newer than the latest published version {latest} of {m.model_id!r}"
    unique = np.unique(row.versions)
    known = np.isin(unique, published.versions)
    if not known.all():
        return Reason.UNPUBLISHED_VERSION, f"version {int(unique[~known][0])} of {m.model_id!r} was never published"
    return None
