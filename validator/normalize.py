"""Grouped reward normalization: raw rewards in, per-row advantages out (pure numpy, no I/O).

Rows are grouped by ``group_id`` (any group sizes, any row order, never a fixed stride). Modes:
``none``, ``group_mean_std`` (GRPO, arXiv 2402.03300), ``group_mean`` (Dr.GRPO, arXiv 2503.20783),
``leave_one_out`` (RLOO, arXiv 2402.14740), ``batch_mean_std``. A group of one is never silently
erased by centering: ``NormConfig.singleton_policy`` says what happens to it (``NormConfig``:
rollbook/config/store.py).

    result = normalize_rewards(rewards, group_ids, NormConfig(mode="group_mean"))

Tests: ``pytest tests/unit/validator/test_normalize.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rollbook.config import NormConfig


@dataclass(frozen=True)
class NormResult:
    normalized: np.ndarray  # [N] float64; NaN exactly where `dropped`, finite everywhere else
    dropped: np.ndarray  # [N] bool; singleton rows under singleton_policy="drop"
    original: np.ndarray  # [N] float64; read-only copy of the input rewards
    reward_mean_before: float  # mean of `original` over kept rows (NaN when no row is kept)
    reward_mean_after: float  # mean of `normalized` over kept rows (NaN when no row is kept)

    def metrics(self) -> dict[str, float]:
        return {
            "reward/mean_before_norm": self.reward_mean_before,
            "reward/mean_after_norm": self.reward_mean_after,
            "reward/num_singletons_dropped": float(self.dropped.sum()),
        }


def normalize_rewards(rewards: np.ndarray, group_ids: Sequence[str] | np.ndarray, config: NormConfig) -> NormResult:
    """Normalize `rewards` [N] within the groups named by `group_ids` [N]; the input is never modified.

    Rewards must be finite (the validator rejects others as NONFINITE_REWARD first) and small enough
    that their squares stay finite (|r| < ~1e150). The result does not depend on row order: permuting
    the rows permutes the output bit for bit.
    """
    original = np.array(rewards, dtype=np.float64, copy=True)
    ids = np.asarray(group_ids)
    if original.ndim != 1 or ids.shape != original.shape:
        raise ValueError(
            f"rewards and group_ids must be 1-D with one group id per reward; got shapes {original.shape} and {ids.shape}"
        )
    bad = np.flatnonzero(~np.isfinite(original))
    if bad.size:
        raise ValueError(
            f"rewards must be finite: {bad.size} are not (row {bad[0]} is {original[bad[0]]}); reject them "
            "as NONFINITE_REWARD before normalizing"
        )
    original.setflags(write=False)
    dropped = np.zeros(original.shape, dtype=bool)
    if config.mode == "none" or original.size == 0:
        normalized = original.copy()
    elif config.mode == "batch_mean_std":
        dev, std, _ = _center(original, np.zeros(original.size, dtype=np.int64), int(config.std_unbiased))
        normalized = _safe_divide(dev, std + config.eps)
    else:
        normalized, dropped = _grouped(original, ids, config)
    kept = ~dropped
    return NormResult(
        normalized=normalized,
        dropped=dropped,
        original=original,
        reward_mean_before=float(original[kept].mean()) if kept.any() else float("nan"),
        reward_mean_after=float(normalized[kept].mean()) if kept.any() else float("nan"),
    )


def _grouped(r: np.ndarray, ids: np.ndarray, config: NormConfig) -> tuple[np.ndarray, np.ndarray]:
    _, inverse = np.unique(ids, return_inverse=True)
    dev, std, n = _center(r, inverse.reshape(-1), int(config.std_unbiased))
    if config.mode == "group_mean_std":
        out = _safe_divide(dev, std + config.eps)
    elif config.mode == "group_mean":
        out = dev
    else:  # leave_one_out: r_i - (sum_g - r_i) / (n - 1) == n / (n - 1) * (r_i - mean_g)
        out = dev * _safe_divide(n.astype(np.float64), n - 1.0)
    singleton = n == 1
    dropped = np.zeros(r.shape, dtype=bool)
    if config.singleton_policy == "keep_raw":
        out[singleton] = r[singleton]
    elif config.singleton_policy == "batch_baseline":
        pool = r[~singleton] if not singleton.all() else r
        out[singleton] = r[singleton] - np.sort(pool).mean()  # sorted: same sum for any row order
    else:
        out[singleton] = np.nan
        dropped = singleton
    return out, dropped


def _center(r: np.ndarray, inverse: np.ndarray, ddof: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row: (r - mean_g, std_g, n_g) for the groups numbered 0..G-1 by `inverse` [N].

    Rows are summed in (group, reward) order, so the result is the same bit for bit in any row order,
    and each group is first shifted by its minimum, so identical rewards center to exactly 0.
    """
    order = np.lexsort((r, inverse))
    g, x = inverse[order], r[order]
    counts = np.bincount(g)
    x = x - x[np.cumsum(counts) - counts][g]
    dev_sorted = x - (np.bincount(g, weights=x) / counts)[g]
    sum_sq = np.bincount(g, weights=dev_sorted**2)
    var = np.divide(sum_sq, counts - ddof, out=np.zeros(counts.size), where=counts > ddof)
    dev = np.empty_like(r)
    dev[order] = dev_sorted
    return dev, np.sqrt(var)[inverse], counts[inverse]


def _safe_divide(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    # A zero denominator (std 0 with eps 0, or n - 1 = 0) only meets a zero numerator: give 0, not NaN.
    return np.divide(num, den, out=np.zeros(num.shape), where=den > 0)
