"""Per-trajectory evidence rules checked at ingest, before anything is stored.

``check(row, registry, config)`` returns ``None`` for a trajectory that may be stored, or a
``(Reason, detail)`` pair; the store writes the pair to ``rejections`` and answers ``REJECTED``.
Rules run in a fixed order and the first failure wins, so each trajectory gets exactly one code.
Group- and pull-time rules (retry orphans, incomplete groups, staleness) live elsewhere in this
package. The codes are documented in ``docs/evidence.md``; the limits are ``IngestConfig``'s
(rollbook/config/store.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from rollbook.config import IngestConfig
from rollbook.trajectories import Ragged, TrajectoryColumns
from rollbook.validator.reasons import Reason

Verdict = tuple[Reason, str] | None


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
    msg: Any  # a rollbook.v1 Trajectory message (generated; the validator does not import the stubs)
    prompt: np.ndarray
    tokens: np.ndarray
    logprobs: np.ndarray
    versions: np.ndarray


# every string field of a Trajectory, each limited to ``max_id_length`` characters (OVERSIZED)
STRING_FIELDS = (
    "trajectory_id",
    "session_id",
    "group_id",
    "request_id",
    "task_id",
    "domain",
    "model_id",
    "worker_id",
    "finish_reason",
    "parent_request_id",
)


# Trajectory.metadata: at most this many entries, keys at most this long (values: max_id_length)
MAX_METADATA_ENTRIES = 32
MAX_METADATA_KEY = 64


def check(row: _RowLike, registry: Registry, config: IngestConfig) -> Verdict:
    """The first broken rule for this trajectory, or ``None``."""
    return _structure(row, config) or _evidence(row, config) or _against_registry(row, registry)


def check_batch(batch: TrajectoryColumns, registry: Registry, config: IngestConfig) -> list[Verdict]:
    """``check`` for a whole decoded batch (``rollbook.trajectories.TrajectoryColumns``), vectorised: every rule
    runs once over the batch's flat arrays; only rows that some rule flags go through ``check`` for
    their exact code and detail. Same verdicts as ``[check(batch.row(i), ...) for i in ...]``, at a
    fraction of the cost."""
    suspect = _suspects(batch, registry, config)
    return [check(batch.row(i), registry, config) if bad else None for i, bad in enumerate(suspect)]


def _suspects(batch: TrajectoryColumns, registry: Registry, config: IngestConfig) -> np.ndarray:
    """True for rows that may break a rule (a superset of the rejected rows)."""
    n_tok, n_p = batch.tokens.lengths, batch.prompt.lengths
    suspect = (n_tok == 0) | (batch.logprobs.lengths != n_tok) | (batch.versions.lengths != n_tok)
    suspect |= (n_tok > config.max_output_tokens) | (n_p > config.max_prompt_tokens) | _scalar_suspects(batch, config)
    # each rule below reads one array with its own offsets, so rows of mismatched lengths cannot shift
    # the others; their results only matter for rows not already suspect
    found = batch.logprobs.stats  # each row's range, found while decoding: no pass over the values
    if found is not None:  # float32 values as float64: compared with the float32 limits, as below
        bad = found.flag | (found.greatest > float(np.float32(config.positive_logprob_tolerance)))
        for sentinel in config.sentinel_logprobs:
            bad |= (found.least <= float(np.float32(sentinel))) & (float(np.float32(sentinel)) <= found.greatest)
        suspect |= bad
    else:
        lp = batch.logprobs.values
        bad_lp = ~np.isfinite(lp) | (lp > config.positive_logprob_tolerance)
        for sentinel in config.sentinel_logprobs:
            bad_lp |= lp == np.float32(sentinel)
        suspect |= _rows(batch.logprobs, bad_lp).reduce(np.logical_or, False)
    found = batch.versions.stats
    if found is not None:  # a step down inside a row, or a negative version
        suspect |= found.flag | (found.least < 0)
    else:
        ver = batch.versions.values
        step_down = np.zeros(len(ver), bool)
        step_down[1:] = ver[1:] < ver[:-1]
        starts = batch.versions.offsets[:-1]
        step_down[starts[starts < len(ver)]] = False  # a row may start lower than the previous one ended
        suspect |= _rows(batch.versions, step_down | (ver < 0)).reduce(np.logical_or, False)
    top = np.maximum(batch.tokens.reduce(np.maximum, -1), batch.prompt.reduce(np.maximum, -1))
    low = np.minimum(batch.tokens.reduce(np.minimum, 0), batch.prompt.reduce(np.minimum, 0))
    models = batch.array("model_id").dictionary_encode()  # each model looked up once
    model_ids, row_model = models.dictionary.to_pylist(), models.indices.to_numpy()
    vocab = np.fromiter((registry.vocab_size(m) or 0 for m in model_ids), np.int64, len(model_ids))[row_model]
    lo, hi = (bound[row_model] for bound in _version_ranges(model_ids, registry))
    suspect |= (low < 0) | (top >= vocab)
    suspect |= (batch.versions.reduce(np.minimum, 0) < lo) | (batch.versions.reduce(np.maximum, 0) > hi)
    return suspect


def _rows(like: Ragged, values: np.ndarray) -> Ragged:
    """``values`` (one per element of ``like``) split into ``like``'s rows."""
    return Ragged(values, like.offsets)


def _scalar_suspects(batch: TrajectoryColumns, config: IngestConfig) -> np.ndarray:
    """Rows whose scalar fields may break a rule: empty or overlong strings, missing or invalid
    sampling parameters, a non-finite or out-of-range reward, a non-finite created_at, a group_size
    over the limit, a branch without a parent."""
    n = len(batch)
    suspect = np.zeros(n, bool)
    for name in STRING_FIELDS:  # bytes, at least the characters the rule counts: a superset
        lengths = batch.byte_lengths(name)
        suspect |= lengths > config.max_id_length
        if name == "trajectory_id":
            suspect |= lengths == 0
    # an unset temperature / top_p reads as NaN: a suspect either way (MISSING_ or INVALID_SAMPLING_PARAMS)
    temperature, top_p = batch.numbers("temperature"), batch.numbers("top_p")
    with np.errstate(invalid="ignore"):  # NaN compares False: the isfinite terms catch it
        suspect |= ~np.isfinite(temperature) | (temperature < 0) | ~(top_p > 0) | ~(top_p <= 1)
        suspect |= batch.numbers("top_k") < -1  # unset: NaN, never below
    suspect |= ~(np.abs(batch.numbers("reward", unset=0.0)) <= config.max_abs_reward)  # NaN and inf too
    suspect |= ~np.isfinite(batch.numbers("created_at"))
    suspect |= batch.numbers("group_size") > config.max_group_size
    suspect |= (batch.numbers("branched") != 0) & (batch.byte_lengths("parent_request_id") == 0)  # a branch without a parent
    limit = config.max_id_length
    with_metadata = batch.metadata_rows()
    if len(with_metadata):
        metadata = batch.column("metadata")
        suspect[with_metadata] |= [
            len(md) > MAX_METADATA_ENTRIES or any(not k or len(k) > MAX_METADATA_KEY or len(v) > limit for k, v in md.items())
            for md in (metadata[i] for i in with_metadata)
        ]
    return suspect


def _version_ranges(model_ids: Sequence[str], registry: Registry) -> tuple[np.ndarray, np.ndarray]:
    """Per model, the published range [lo, hi] when its versions are contiguous (so any version
    inside is published); otherwise an empty range, which sends its rows to ``check``."""
    ranges = []
    for model_id in model_ids:
        v = registry.published_versions(model_id).versions
        contiguous = len(v) > 0 and int(v[-1]) - int(v[0]) + 1 == len(v)
        ranges.append((int(v[0]), int(v[-1])) if contiguous else (1, 0))
    bounds = np.array(ranges, dtype=np.int64).reshape(len(ranges), 2)
    return bounds[:, 0], bounds[:, 1]


def _structure(row: _RowLike, config: IngestConfig) -> Verdict:
    m = row.msg
    if not m.trajectory_id:
        return Reason.MISSING_ID, "trajectory_id is empty; it is the idempotency key and must be set by the client"
    for name in STRING_FIELDS:
        if len(getattr(m, name)) > config.max_id_length:
            return Reason.OVERSIZED, f"{name} is {len(getattr(m, name))} chars, over the limit of {config.max_id_length}"
    metadata = m.metadata
    if len(metadata) > MAX_METADATA_ENTRIES:
        return Reason.OVERSIZED, f"metadata has {len(metadata)} entries, over the limit of {MAX_METADATA_ENTRIES}"
    for key, value in metadata.items():
        if not key or len(key) > MAX_METADATA_KEY:
            return Reason.OVERSIZED, f"metadata key {key[:MAX_METADATA_KEY]!r} must be 1 to {MAX_METADATA_KEY} chars"
        if len(value) > config.max_id_length:
            return Reason.OVERSIZED, f"metadata[{key!r}] is {len(value)} chars, over the limit of {config.max_id_length}"
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
            return (
                Reason.SENTINEL_LOGPROB,
                f"output_logprobs[{hits[0]}] = {sentinel} is an engine sentinel, not a log-prob ({len(hits)} tokens)",
            )
    if (lp > config.positive_logprob_tolerance).any():
        i = int(np.argmax(lp))
        return (
            Reason.POSITIVE_LOGPROB,
            f"output_logprobs[{i}] = {lp[i]:.6g} > {config.positive_logprob_tolerance} (a probability above 1)",
        )
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
    bad = _bad_sampling_param(m)
    if bad:
        return Reason.INVALID_SAMPLING_PARAMS, bad
    if m.HasField("reward") and not math.isfinite(m.reward):
        return Reason.NONFINITE_REWARD, f"reward = {m.reward}"
    if m.HasField("reward") and abs(m.reward) > config.max_abs_reward:
        return Reason.REWARD_OUT_OF_RANGE, reward_out_of_range(m.reward, config)
    if not math.isfinite(m.created_at):
        return Reason.NONFINITE_CREATED_AT, f"created_at = {m.created_at} (it orders the attempts of a request)"
    if m.group_size > config.max_group_size:
        return Reason.INVALID_GROUP_SIZE, f"group_size = {m.group_size} > max_group_size {config.max_group_size}"
    if m.branched and not m.parent_request_id:
        return (
            Reason.BRANCH_WITHOUT_PARENT,
            "branched is true but parent_request_id is empty: a call can only branch from a parent call",
        )
    return None


def reward_out_of_range(reward: float, config: IngestConfig) -> str:
    """The detail of a reward above ``max_abs_reward`` (after the code, at ingest and in SetReward),
    with both numbers exact (``repr``: 1000000.5 stays 1000000.5)."""
    return f"reward = {float(reward)!r}; |reward| must be <= max_abs_reward {float(config.max_abs_reward)!r}"


def _bad_sampling_param(m: Any) -> str | None:
    """Why a sampling parameter that is set cannot describe a distribution, or None."""
    if m.HasField("temperature") and not (math.isfinite(m.temperature) and m.temperature >= 0):
        return f"temperature = {m.temperature}; must be finite and >= 0"
    if m.HasField("top_p") and not (0 < m.top_p <= 1):
        return f"top_p = {m.top_p}; must be in (0, 1]"
    if m.HasField("top_k") and m.top_k < -1:
        return f"top_k = {m.top_k}; must be >= 1, or 0 / -1 for disabled"
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
