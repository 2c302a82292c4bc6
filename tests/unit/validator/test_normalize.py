"""Grouped reward normalization: hand-computed examples plus property tests against a plain-loop reference."""

from __future__ import annotations

import math
import warnings
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from rollbook.config import NormConfig
from rollbook.validator.normalize import normalize_rewards

Batch = tuple[np.ndarray, list[str]]  # rewards [N], group ids [N]

MODES = ["none", "group_mean_std", "group_mean", "leave_one_out", "batch_mean_std"]
GROUP_MODES = ["group_mean_std", "group_mean", "leave_one_out"]
POLICIES = ["keep_raw", "batch_baseline", "drop"]
PROPERTY = settings(max_examples=200, deadline=None)
# Property tests draw every field combination, including ones NormConfig warns have no effect.
quiet = pytest.mark.filterwarnings("ignore:NormConfig.*has no effect")


# --- reference: the formulas written out plainly, one row at a time -----------------------------


def _std(values: list[float], unbiased: bool) -> float:
    n = len(values)
    mean = math.fsum(values) / n
    ddof = 1 if unbiased else 0
    return math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - ddof)) if n > ddof else 0.0


def reference(rewards: list[float], ids: list[str], cfg: NormConfig) -> tuple[list[float], list[bool], list[float]]:
    """Returns (normalized, dropped, tolerance per row); tolerance grows with the row's condition number."""
    n_rows = len(rewards)
    out, dropped, tol = list(rewards), [False] * n_rows, [0.0] * n_rows
    if cfg.mode == "none":
        return out, dropped, tol
    if cfg.mode == "batch_mean_std":
        mean, denom = math.fsum(rewards) / n_rows, _std(rewards, cfg.std_unbiased) + cfg.eps
        scale = max(abs(v) for v in rewards)
        for i in range(n_rows):
            out[i] = (rewards[i] - mean) / denom if denom > 0 else 0.0
            tol[i] = 1e-9 * scale / denom if denom > 0 else 0.0
        return out, dropped, tol
    groups: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(ids):
        groups[g].append(i)
    pool = [rewards[i] for rows in groups.values() if len(rows) > 1 for i in rows] or list(rewards)
    for rows in groups.values():
        values = [rewards[i] for i in rows]
        if len(rows) == 1:
            (i,) = rows
            if cfg.singleton_policy == "keep_raw":
                out[i] = rewards[i]
            elif cfg.singleton_policy == "batch_baseline":
                out[i] = rewards[i] - math.fsum(pool) / len(pool)
                tol[i] = 1e-9 * max(abs(v) for v in pool + [rewards[i]])
            else:
                out[i], dropped[i] = float("nan"), True
            continue
        mean, scale = math.fsum(values) / len(values), max(abs(v) for v in values)
        denom = _std(values, cfg.std_unbiased) + cfg.eps if cfg.mode == "group_mean_std" else 1.0
        for i in rows:
            if cfg.mode == "group_mean":
                out[i] = rewards[i] - mean
            elif cfg.mode == "leave_one_out":
                others = [rewards[j] for j in rows if j != i]
                out[i] = rewards[i] - math.fsum(others) / len(others)
            else:
                out[i] = (rewards[i] - mean) / denom if denom > 0 else 0.0
            tol[i] = 1e-9 * scale / denom if denom > 0 else 0.0
    return out, dropped, tol


# --- strategies ---------------------------------------------------------------------------------


@st.composite
def batches(draw: st.DrawFn) -> Batch:
    """Variable-size groups (size 1 included), some all-identical, at one of several magnitudes, shuffled."""
    sizes = draw(st.lists(st.integers(1, 6), min_size=1, max_size=8))
    scale = draw(st.sampled_from([1e-6, 1.0, 1e3, 1e9]))
    ties = st.sampled_from([0.0, 1.0, -1.0, 0.5])
    value = st.one_of(ties, st.integers(-(10**6), 10**6).map(lambda k: k * 1e-6))
    rewards, ids = [], []
    for g, size in enumerate(sizes):
        identical = draw(st.booleans())
        values = [draw(value)] * size if identical else draw(st.lists(value, min_size=size, max_size=size))
        rewards += [v * scale for v in values]
        ids += [f"prompt-{g}"] * size
    perm = draw(st.permutations(range(len(rewards))))
    return np.array(rewards, dtype=np.float64)[perm], [ids[i] for i in perm]


configs = st.builds(
    NormConfig,
    mode=st.sampled_from(MODES),
    eps=st.sampled_from([0.0, 1e-8, 1e-5, 1.0]),
    std_unbiased=st.booleans(),
    singleton_policy=st.sampled_from(POLICIES),
)


def _group_sizes(ids: list[str]) -> np.ndarray:
    counts: dict[str, int] = defaultdict(int)
    for g in ids:
        counts[g] += 1
    return np.array([counts[g] for g in ids])


# --- hand-computed examples ---------------------------------------------------------------------

# Group a = rows 0, 2, 4 with rewards [1, 0, 2]: mean 1, biased std sqrt(2/3).
# Group b = rows 1, 5 with rewards [2, 4]: mean 3, std 1. Group c = row 3, a singleton with reward 7.
REWARDS = np.array([1.0, 2.0, 0.0, 7.0, 2.0, 4.0])
IDS = ["a", "b", "a", "c", "a", "b"]
S = 1 / math.sqrt(2 / 3)  # 1 / std_a = 1.2247...


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (NormConfig(mode="none"), [1, 2, 0, 7, 2, 4]),
        (NormConfig(mode="group_mean"), [0, -1, -1, 7, 1, 1]),
        # RLOO: 1 - (0+2)/2 = 0; 0 - (1+2)/2 = -1.5; 2 - (1+0)/2 = 1.5; 2 - 4 = -2; 4 - 2 = 2
        (NormConfig(mode="leave_one_out"), [0, -2, -1.5, 7, 1.5, 2]),
        (NormConfig(mode="group_mean_std", eps=0.0), [0, -1, -S, 7, S, 1]),
        # batch of 6: mean 16/6 = 8/3, sum of squared deviations 282/9, variance 282/54 = 47/9
        (NormConfig(mode="batch_mean_std", eps=0.0), (REWARDS - 8 / 3) / math.sqrt(47 / 9)),
        # singleton c: 7 - mean of the five grouped rows (1+2+0+2+4)/5 = 7 - 1.8 = 5.2
        (NormConfig(mode="group_mean", singleton_policy="batch_baseline"), [0, -1, -1, 5.2, 1, 1]),
    ],
    ids=["none", "group_mean", "leave_one_out", "group_mean_std", "batch_mean_std", "batch_baseline"],
)
def test_hand_computed_example_per_mode(config: NormConfig, expected: list[float]) -> None:
    result = normalize_rewards(REWARDS, IDS, config)
    np.testing.assert_allclose(result.normalized, expected, rtol=1e-12, atol=1e-12)
    assert not result.dropped.any()


def test_drop_policy_flags_singleton_with_nan_and_stats_over_kept_rows() -> None:
    result = normalize_rewards(REWARDS, IDS, NormConfig(mode="group_mean", singleton_policy="drop"))
    assert result.dropped.tolist() == [False, False, False, True, False, False]
    assert math.isnan(result.normalized[3])
    np.testing.assert_allclose(result.normalized[~result.dropped], [0, -1, -1, 1, 1])
    assert result.reward_mean_before == pytest.approx(1.8)  # (1+2+0+2+4)/5, the singleton's 7 excluded
    assert result.reward_mean_after == pytest.approx(0.0)
    assert result.metrics()["reward/num_singletons_dropped"] == 1.0


def test_batch_baseline_with_only_singletons_uses_all_rows() -> None:
    config = NormConfig(mode="group_mean", singleton_policy="batch_baseline")
    result = normalize_rewards(np.array([1.0, 3.0]), ["x", "y"], config)
    np.testing.assert_allclose(result.normalized, [-1.0, 1.0])  # baseline (1+3)/2 = 2


def test_unbiased_std_divides_by_n_minus_one() -> None:
    # [1, 3]: mean 2, deviations [-1, 1]; biased std sqrt(2/2) = 1, unbiased std sqrt(2/1)
    biased = normalize_rewards(np.array([1.0, 3.0]), ["g", "g"], NormConfig(eps=0.0))
    unbiased = normalize_rewards(np.array([1.0, 3.0]), ["g", "g"], NormConfig(eps=0.0, std_unbiased=True))
    np.testing.assert_allclose(biased.normalized, [-1.0, 1.0])
    np.testing.assert_allclose(unbiased.normalized, [-1 / math.sqrt(2), 1 / math.sqrt(2)])


def test_eps_is_added_to_the_std() -> None:
    # [0, 1]: deviations [-0.5, 0.5], std 0.5, denominator 0.5 + 0.5 = 1
    result = normalize_rewards(np.array([0.0, 1.0]), ["g", "g"], NormConfig(eps=0.5))
    np.testing.assert_allclose(result.normalized, [-0.5, 0.5])


@pytest.mark.parametrize("mode", ["group_mean_std", "batch_mean_std"])
def test_zero_std_with_zero_eps_gives_zero_not_nan(mode: str) -> None:
    # 0.1 * 3 is not exactly representable: a naive mean would leave ~1e-17 deviations to blow up.
    result = normalize_rewards(np.array([0.1, 0.1, 0.1]), ["g"] * 3, NormConfig(mode=mode, eps=0.0))
    assert result.normalized.tolist() == [0.0, 0.0, 0.0]


def test_unbiased_one_row_batch_is_zero_not_nan() -> None:
    config = NormConfig(mode="batch_mean_std", std_unbiased=True, eps=0.0)
    result = normalize_rewards(np.array([5.0]), ["g"], config)
    assert result.normalized.tolist() == [0.0]


def test_empty_batch() -> None:
    result = normalize_rewards(np.array([]), [], NormConfig())
    assert result.normalized.shape == (0,) and result.dropped.shape == (0,)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_reward_is_a_value_error(bad: float) -> None:
    with pytest.raises(ValueError, match="rewards must be finite.*row 1"):
        normalize_rewards(np.array([1.0, bad]), ["g", "g"], NormConfig())


def test_length_mismatch_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="one group id per reward"):
        normalize_rewards(np.array([1.0, 2.0]), ["g"], NormConfig())


def test_config_bounds_and_ignored_option_warning() -> None:
    with pytest.raises(ValidationError):
        NormConfig(eps=-1e-3)
    with pytest.raises(ValidationError):
        NormConfig(mode="group_median")
    with pytest.warns(UserWarning, match="singleton_policy has no effect with mode='batch_mean_std'"):
        NormConfig(mode="batch_mean_std", singleton_policy="drop")
    with pytest.warns(UserWarning, match="eps, std_unbiased has no effect"):
        NormConfig(mode="leave_one_out", eps=0.0, std_unbiased=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        NormConfig(mode="group_mean_std", eps=1e-6, std_unbiased=True, singleton_policy="drop")


# --- properties ---------------------------------------------------------------------------------


@quiet
@PROPERTY
@given(batch=batches(), cfg=configs, as_array=st.booleans())
def test_matches_plain_reference_for_every_mode(batch: Batch, cfg: NormConfig, as_array: bool) -> None:
    rewards, ids = batch
    result = normalize_rewards(rewards, np.array(ids) if as_array else ids, cfg)
    expected, expected_dropped, tol = reference(rewards.tolist(), ids, cfg)
    assert result.dropped.tolist() == expected_dropped
    assert np.array_equal(np.isnan(result.normalized), result.dropped)
    kept = ~result.dropped
    error = np.abs(result.normalized - np.array(expected))[kept]
    assert (error <= np.array(tol)[kept]).all(), (error, tol)


@quiet
@PROPERTY
@given(batch=batches(), mode=st.sampled_from(GROUP_MODES), eps=st.sampled_from([0.0, 1e-5]))
def test_singleton_keeps_raw_reward_exactly(batch: Batch, mode: str, eps: float) -> None:
    rewards, ids = batch
    result = normalize_rewards(rewards, ids, NormConfig(mode=mode, eps=eps))
    singleton = _group_sizes(ids) == 1
    assert np.array_equal(result.normalized[singleton], rewards[singleton])


@quiet
@PROPERTY
@given(batch=batches(), mode=st.sampled_from(GROUP_MODES))
def test_drop_flags_exactly_the_singletons(batch: Batch, mode: str) -> None:
    rewards, ids = batch
    result = normalize_rewards(rewards, ids, NormConfig(mode=mode, singleton_policy="drop"))
    assert np.array_equal(result.dropped, _group_sizes(ids) == 1)
    assert np.isfinite(result.normalized[~result.dropped]).all()


@quiet
@PROPERTY
@given(batch=batches(), mode=st.sampled_from(GROUP_MODES), eps=st.sampled_from([0.0, 1e-5]))
def test_identical_rewards_in_a_group_center_to_exactly_zero(batch: Batch, mode: str, eps: float) -> None:
    rewards, ids = batch
    result = normalize_rewards(rewards, ids, NormConfig(mode=mode, eps=eps))
    sizes = _group_sizes(ids)
    for g in set(ids):
        rows = [i for i, h in enumerate(ids) if h == g]
        if sizes[rows[0]] > 1 and len(set(rewards[rows].tolist())) == 1:
            assert (result.normalized[rows] == 0.0).all()


@quiet
@PROPERTY
@given(batch=batches(), cfg=configs)
def test_input_and_original_are_never_changed(batch: Batch, cfg: NormConfig) -> None:
    rewards, ids = batch
    before = rewards.copy()
    result = normalize_rewards(rewards, ids, cfg)
    assert np.array_equal(rewards, before) and np.array_equal(result.original, before)
    assert not np.shares_memory(result.original, rewards)
    assert not np.shares_memory(result.normalized, result.original)
    with pytest.raises(ValueError, match="read-only"):
        result.original[0] = 123.0


@quiet
@PROPERTY
@given(batch=batches(), cfg=configs, data=st.data())
def test_permuting_rows_permutes_the_output_bit_for_bit(batch: Batch, cfg: NormConfig, data: st.DataObject) -> None:
    rewards, ids = batch
    perm = np.array(data.draw(st.permutations(range(len(ids)))))
    result = normalize_rewards(rewards, ids, cfg)
    permuted = normalize_rewards(rewards[perm], [ids[i] for i in perm], cfg)
    assert np.array_equal(permuted.normalized, result.normalized[perm], equal_nan=True)
    assert np.array_equal(permuted.dropped, result.dropped[perm])


@PROPERTY
@given(batch=batches())
def test_unbiased_scales_group_std_result_by_sqrt_n_minus_one_over_n(batch: Batch) -> None:
    # With eps = 0: (r - m) / std_unbiased = (r - m) / std_biased * sqrt((n - 1) / n).
    rewards, ids = batch
    biased = normalize_rewards(rewards, ids, NormConfig(eps=0.0))
    unbiased = normalize_rewards(rewards, ids, NormConfig(eps=0.0, std_unbiased=True))
    n = _group_sizes(ids)
    grouped = n > 1
    expected = biased.normalized[grouped] * np.sqrt((n[grouped] - 1) / n[grouped])
    np.testing.assert_allclose(unbiased.normalized[grouped], expected, rtol=1e-12, atol=1e-12)
    assert np.array_equal(unbiased.normalized[~grouped], rewards[~grouped])
