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
from typing import Protocol

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
