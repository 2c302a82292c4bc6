"""Unit tests of rollbook.trainer.losses: hand arithmetic on 3-5 tokens, independent references.

Run: python -m pytest tests/unit/trainer/test_losses.py -q
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollbook.trainer.losses import (
    combined_loss,
    decoupled_ppo_loss,
    full_kl_distill_loss,
    kl_penalty,
    mix_teacher_logprobs,
    mopd_loss,
    sequence_mean_weights,
)

TOL = {"atol": 1e-6, "rtol": 1e-5}


def _t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def _log(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).log()


def _ones_mask(n: int) -> torch.Tensor:
    return torch.ones(n, dtype=torch.bool)


def _ppo_inputs(ratio: torch.Tensor, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Log-probs whose current/proximal ratio is `ratio` and proximal/behavior ratio is `weight`."""
    behav = _t(-1.0, -2.0, -0.5, -3.0, -1.5)[: len(ratio)]
    prox = behav + weight.log()
    logp = (prox + ratio.log()).requires_grad_()
    return {"logprobs": logp, "proximal_logprobs": prox, "behavior_logprobs": behav}


# --- decoupled PPO: hand arithmetic ---------------------------------------------------------------


def test_ppo_proximal_equals_behavior_gives_clipped_token_mean_of_hand_arithmetic():
    # u = [1.5, 0.5, 1.1], A = [1, -1, 2], eps 0.2 -> clip(u) = [1.2, 0.8, 1.1], w = 1
    # token 0: max(-1*1.5, -1*1.2) = -1.2 (clipped)
    # token 1: max(+1*0.5, +1*0.8) = +0.8 (clipped)
    # token 2: max(-2*1.1, -2*1.1) = -2.2
    # loss = (-1.2 + 0.8 - 2.2) / 3 = -0.8667; clip_frac = 2/3
    inputs = _ppo_inputs(_t(1.5, 0.5, 1.1), _t(1.0, 1.0, 1.0))
    loss, stats = decoupled_ppo_loss(**inputs, advantages=_t(1.0, -1.0, 2.0), loss_mask=_ones_mask(3), eps_clip=0.2)
    torch.testing.assert_close(loss, torch.tensor(-2.6 / 3), **TOL)
    torch.testing.assert_close(stats["ppo/clip_frac"], torch.tensor(2 / 3), **TOL)
    torch.testing.assert_close(stats["ppo/num_valid_tokens"], torch.tensor(3.0), **TOL)


def test_ppo_behavior_weight_multiplies_each_token_loss():
    # same u and A as above, w = pi_prox/pi_behav = [2, 0.5, 1]
    # loss = (2*-1.2 + 0.5*0.8 + 1*-2.2) / 3 = (-2.4 + 0.4 - 2.2) / 3 = -1.4
    # importance weight mean = 3.5/3, max = 2
    inputs = _ppo_inputs(_t(1.5, 0.5, 1.1), _t(2.0, 0.5, 1.0))
    loss, stats = decoupled_ppo_loss(**inputs, advantages=_t(1.0, -1.0, 2.0), loss_mask=_ones_mask(3), eps_clip=0.2)
    torch.testing.assert_close(loss, torch.tensor(-1.4), **TOL)
    torch.testing.assert_close(stats["ppo/importance_weight_mean"], torch.tensor(3.5 / 3), **TOL)
    torch.testing.assert_close(stats["ppo/importance_weight_max"], torch.tensor(2.0), **TOL)


def test_ppo_eps_clip_high_defaults_to_eps_clip_and_widens_upper_clip_when_set():
    # u = 1.3, A = 1:
    # eps_high 0.2 -> max(-1.3, -1.2) = -1.2;  eps_high 0.28 -> max(-1.3, -1.28) = -1.28
    inputs = _ppo_inputs(_t(1.3), _t(1.0))
    common = {"advantages": _t(1.0), "loss_mask": _ones_mask(1), "eps_clip": 0.2}
    default, _ = decoupled_ppo_loss(**inputs, **common)
    symmetric, _ = decoupled_ppo_loss(**inputs, **common, eps_clip_high=0.2)
    wider, _ = decoupled_ppo_loss(**inputs, **common, eps_clip_high=0.28)
    torch.testing.assert_close(default, torch.tensor(-1.2), **TOL)
    torch.testing.assert_close(symmetric, default, **TOL)
    torch.testing.assert_close(wider, torch.tensor(-1.28), **TOL)


# --- decoupled PPO: behavior-weight cap -----------------------------------------------------------


def _capped_ppo(action: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    inputs = _ppo_inputs(_t(1.5, 0.5, 1.1), _t(2.0, 8.0, 1.0))
    return decoupled_ppo_loss(
        **inputs,
        advantages=_t(1.0, -1.0, 2.0),
        loss_mask=_ones_mask(3),
        eps_clip=0.2,
        behavior_weight_cap=5.0,
        behavior_weight_action=action,
    )


def test_cap_mask_drops_token_above_cap_but_keeps_original_denominator():
    # w = [2, 8, 1], cap 5: token 1 is dropped; denominator stays 3 (the original loss_mask)
    # loss = (2*-1.2 + 0 + 1*-2.2) / 3 = -4.6 / 3
    loss, stats = _capped_ppo("mask")
    torch.testing.assert_close(loss, torch.tensor(-4.6 / 3), **TOL)
    torch.testing.assert_close(stats["ppo/behavior_weight_capped_frac"], torch.tensor(1 / 3), **TOL)
    torch.testing.assert_close(stats["ppo/num_loss_tokens"], torch.tensor(2.0), **TOL)
    torch.testing.assert_close(stats["ppo/importance_weight_max"], torch.tensor(8.0), **TOL)


def test_cap_clamp_limits_weight_to_cap_and_keeps_every_token():
    # w = [2, min(8, 5), 1]: loss = (2*-1.2 + 5*0.8 + 1*-2.2) / 3 = -0.6 / 3 = -0.2
    loss, stats = _capped_ppo("clamp")
    torch.testing.assert_close(loss, torch.tensor(-0.2), **TOL)
    torch.testing.assert_close(stats["ppo/behavior_weight_capped_frac"], torch.tensor(1 / 3), **TOL)
    torch.testing.assert_close(stats["ppo/num_loss_tokens"], torch.tensor(3.0), **TOL)


@pytest.mark.parametrize(
    ("action", "expected"),
    [("mask", (-2.2 / 3, 0.0, -1 / 3)), ("clamp", (-2.2 / 3, -5 / 3, -1 / 3))],
)
def test_cap_mask_zeroes_dropped_token_gradient_and_clamp_scales_it_by_cap(action, expected):
    # u = [1.1, 1, 1] (inside the clip), A = 1, w = [2, 8, 1], cap 5: grad = -w * u * A / 3
    # mask: token 1 dropped -> 0;  clamp: token 1 uses w = 5 -> -5/3
    inputs = _ppo_inputs(_t(1.1, 1.0, 1.0), _t(2.0, 8.0, 1.0))
    loss, _ = decoupled_ppo_loss(
        **inputs,
        advantages=_t(1.0, 1.0, 1.0),
        loss_mask=_ones_mask(3),
        eps_clip=0.2,
        behavior_weight_cap=5.0,
        behavior_weight_action=action,
    )
    loss.backward()
    torch.testing.assert_close(inputs["logprobs"].grad, _t(*expected), **TOL)


# --- decoupled PPO: dual clip ---------------------------------------------------------------------


def test_dual_clip_bounds_negative_advantage_loss_at_minus_c_times_a():
    # u = [5, 0.1, 2], A = [-1, 1, -0.5], eps 0.2, c = 3
    # token 0: max(5, 1.2) = 5 -> A < 0: min(5, 3*1) = 3 (dual-clipped)
    # token 1: max(-0.1, -0.8) = -0.1 (A > 0: dual clip never applies)
    # token 2: max(1.0, 0.6) = 1.0 -> min(1.0, 3*0.5) = 1.0
    # loss = (3 - 0.1 + 1.0) / 3 = 1.3; without dual clip (5 - 0.1 + 1.0) / 3
    inputs = _ppo_inputs(_t(5.0, 0.1, 2.0), _t(1.0, 1.0, 1.0))
    common = {"advantages": _t(-1.0, 1.0, -0.5), "loss_mask": _ones_mask(3), "eps_clip": 0.2}
    dual, stats = decoupled_ppo_loss(**inputs, **common, dual_clip=3.0)
    plain, _ = decoupled_ppo_loss(**inputs, **common)
    torch.testing.assert_close(dual, torch.tensor(1.3), **TOL)
    torch.testing.assert_close(plain, torch.tensor(5.9 / 3), **TOL)
    torch.testing.assert_close(stats["ppo/dual_clip_frac"], torch.tensor(1 / 3), **TOL)


def test_dual_clipped_token_gets_zero_gradient():
    # token 0 above is bounded by the constant -c*A: no gradient; token 2 keeps -A*u/3 = 0.5*2/3
    inputs = _ppo_inputs(_t(5.0, 0.1, 2.0), _t(1.0, 1.0, 1.0))
    loss, _ = decoupled_ppo_loss(
        **inputs,
        advantages=_t(-1.0, 1.0, -0.5),
        loss_mask=_ones_mask(3),
        eps_clip=0.2,
        dual_clip=3.0,
    )
    loss.backward()
    torch.testing.assert_close(inputs["logprobs"].grad, _t(0.0, -0.1 / 3, 1.0 / 3), **TOL)


# --- decoupled PPO: independent references --------------------------------------------------------


def _reference_clipped_ppo(
    logp: list[float],
    old_logp: list[float],
    adv: list[float],
    mask: list[bool],
    eps_low: float,
    eps_high: float,
) -> tuple[float, list[float]]:
    """Textbook PPO-clip (Schulman 2017) in plain floats: -mean(min(r*A, clip(r)*A)) and grad."""
    n = max(sum(mask), 1)
    total, grad = 0.0, []
    for lp, old, a, valid in zip(logp, old_logp, adv, mask):
        r = math.exp(lp - old)
        surr_plain, surr_clip = r * a, min(max(r, 1 - eps_low), 1 + eps_high) * a
        total += -min(surr_plain, surr_clip) if valid else 0.0
        plain_binds = surr_plain < surr_clip or 1 - eps_low <= r <= 1 + eps_high
        grad.append(-r * a / n if valid and plain_binds else 0.0)
    return total / n, grad


def test_ppo_with_proximal_equal_behavior_matches_reference_clipped_ppo():
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(5, generator=gen, dtype=torch.float64) * 3
    logp = (old + (torch.rand(5, generator=gen, dtype=torch.float64) - 0.5)).requires_grad_()
    adv = torch.randn(5, generator=gen, dtype=torch.float64)
    mask = torch.tensor([True, True, False, True, True])
    loss, _ = decoupled_ppo_loss(logp, old, old, adv, mask, eps_clip=0.2, eps_clip_high=0.28)
    loss.backward()
    ref_loss, ref_grad = _reference_clipped_ppo(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.28)
    torch.testing.assert_close(loss.item(), ref_loss, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(logp.grad.tolist(), ref_grad, atol=1e-12, rtol=1e-10)


_token = st.tuples(
    st.floats(-5.0, 0.0),  # behavior = proximal log-prob
    st.floats(-1.5, 1.5),  # log u
    st.floats(-3.0, 3.0),  # advantage
    st.booleans(),  # in the loss mask
)


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(_token, min_size=1, max_size=5),
    eps_low=st.floats(0.05, 0.5),
    eps_high=st.floats(0.05, 0.5),
)
def test_ppo_with_proximal_equal_behavior_matches_reference_for_any_tokens(tokens, eps_low, eps_high):
    old, log_u, adv, mask = (list(column) for column in zip(*tokens))
    logp = [o + d for o, d in zip(old, log_u)]
    logp_t = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    old_t = torch.tensor(old, dtype=torch.float64)
    loss, _ = decoupled_ppo_loss(
        logp_t,
        old_t,
        old_t,
        torch.tensor(adv, dtype=torch.float64),
        torch.tensor(mask),
        eps_clip=eps_low,
        eps_clip_high=eps_high,
    )
    loss.backward()
    ref_loss, ref_grad = _reference_clipped_ppo(logp, old, adv, mask, eps_low, eps_high)
    torch.testing.assert_close(loss.item(), ref_loss, atol=1e-10, rtol=1e-9)
    torch.testing.assert_close(logp_t.grad.tolist(), ref_grad, atol=1e-10, rtol=1e-9)


def test_ppo_gradient_at_current_equal_proximal_is_importance_weighted_policy_gradient():
    # u = 1 everywhere (inside the clip), so d loss / d logp_t = -w_t * A_t / T_valid
    gen = torch.Generator().manual_seed(1)
    behav = -torch.rand(5, generator=gen) * 3
    prox = behav + (torch.rand(5, generator=gen) - 0.5)
    adv = torch.randn(5, generator=gen)
    mask = torch.tensor([True, False, True, True, False])
    logp = prox.clone().requires_grad_()
    loss, _ = decoupled_ppo_loss(logp, prox, behav, adv, mask, eps_clip=0.2)
    loss.backward()
    expected = torch.where(mask, -(prox - behav).exp() * adv / 3, 0.0)
    torch.testing.assert_close(logp.grad, expected, **TOL)


# --- masking, shapes, extremes --------------------------------------------------------------------


def test_token_mean_ignores_masked_tokens_even_when_they_hold_nan_or_inf():
    logp = _t(-1.0, float("nan"), -0.5, -2.0).requires_grad_()
    prox, behav = _t(-1.2, float("inf"), -0.4, -2.5), _t(-1.1, float("-inf"), -0.6, -2.0)
    adv, mask = _t(1.0, float("inf"), -2.0, 0.5), torch.tensor([True, False, True, True])
    loss, _ = decoupled_ppo_loss(logp, prox, behav, adv, mask, eps_clip=0.2)
    loss.backward()
    keep = [0, 2, 3]
    sub_logp = logp.detach()[keep].requires_grad_()
    sub_loss, _ = decoupled_ppo_loss(sub_logp, prox[keep], behav[keep], adv[keep], _ones_mask(3), eps_clip=0.2)
    sub_loss.backward()
    torch.testing.assert_close(loss, sub_loss, **TOL)
    torch.testing.assert_close(logp.grad[keep], sub_logp.grad, **TOL)
    assert logp.grad[1].item() == 0.0


def test_no_valid_tokens_gives_zero_loss_that_still_backpropagates():
    logp = _t(-1.0, -2.0, -3.0).requires_grad_()
    loss, stats = decoupled_ppo_loss(
        logp,
        _t(-1.5, -2.0, -1.0),
        _t(-1.0, -1.0, -1.0),
        _t(1.0, 2.0, 3.0),
        torch.zeros(3, dtype=torch.bool),
        eps_clip=0.2,
    )
    loss.backward()
    torch.testing.assert_close(loss, torch.tensor(0.0), atol=0.0, rtol=0.0)
    torch.testing.assert_close(logp.grad, torch.zeros(3), atol=0.0, rtol=0.0)
    assert stats["ppo/num_valid_tokens"].item() == 0.0
    assert all(torch.isfinite(value) for value in stats.values())


def test_float_zero_one_mask_equals_bool_mask():
    args = (_t(-1.0, -2.0, -0.3), _t(-1.2, -1.5, -0.5), _t(-1.0, -1.0, -1.0), _t(1.0, -1.0, 0.5))
    as_bool, _ = decoupled_ppo_loss(*args, torch.tensor([True, False, True]), eps_clip=0.2)
    as_float, _ = decoupled_ppo_loss(*args, _t(1.0, 0.0, 1.0), eps_clip=0.2)
    torch.testing.assert_close(as_float, as_bool, atol=0.0, rtol=0.0)


def test_batched_shape_gives_same_loss_as_packed_tokens():
    gen = torch.Generator().manual_seed(2)
    logp, prox, behav, adv = (torch.randn(2, 3, generator=gen) for _ in range(4))
    mask = torch.tensor([[True, True, False], [True, False, True]])
    batched, _ = decoupled_ppo_loss(logp, prox, behav, adv, mask, eps_clip=0.2)
    flat = (t.flatten() for t in (logp, prox, behav, adv, mask))
    packed, _ = decoupled_ppo_loss(*flat, eps_clip=0.2)
    torch.testing.assert_close(batched, packed, **TOL)


def _extreme_inputs() -> dict[str, torch.Tensor]:
    return {
        "logprobs": _t(-1e4, -1e-3, -30.0, float("-inf"), -1e30).requires_grad_(),
        "proximal_logprobs": _t(-1e-3, -1e4, float("-inf"), -2.0, -1e-3),
        "behavior_logprobs": _t(-1e4, float("-inf"), -1e-3, -3.0, -1e30),
        "loss_mask": _ones_mask(5),
    }


def test_extreme_log_ratios_never_give_inf_or_nan_in_ppo_loss_grad_or_stats():
    inputs = _extreme_inputs()
    loss, stats = decoupled_ppo_loss(
        **inputs,
        advantages=_t(1e3, -1e3, 1.0, -1.0, 2.0),
        eps_clip=0.2,
        dual_clip=3.0,
        behavior_weight_cap=5.0,
        behavior_weight_action="clamp",
    )
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(inputs["logprobs"].grad).all()
    assert all(torch.isfinite(value) for value in stats.values())


def test_extreme_log_ratios_never_give_inf_or_nan_in_mopd_loss_grad_or_stats():
    inputs = _extreme_inputs()
    loss, stats = mopd_loss(**inputs, teacher_logprobs=_t(0.0, float("-inf"), -1e4, -1.0, -1e30), adv_clip=5.0)
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(inputs["logprobs"].grad).all()
    assert all(torch.isfinite(value) for value in stats.values())


# --- gradients flow only through logprobs ---------------------------------------------------------


def _leaves(*values: float) -> torch.Tensor:
    return _t(*values).requires_grad_()


def test_ppo_gives_no_gradient_to_proximal_behavior_or_advantages():
    logp, prox = _leaves(-1.0, -2.0, -0.5), _leaves(-1.2, -1.8, -0.6)
    behav, adv = _leaves(-1.1, -2.2, -0.4), _leaves(1.0, -1.0, 0.5)
    loss, stats = decoupled_ppo_loss(logp, prox, behav, adv, _ones_mask(3), eps_clip=0.2)
    loss.backward()
    assert logp.grad is not None and logp.grad.abs().sum() > 0
    assert prox.grad is None and behav.grad is None and adv.grad is None
    assert not any(value.requires_grad for value in stats.values())


def test_mopd_gives_no_gradient_to_proximal_behavior_or_teacher():
    logp, prox = _leaves(-1.0, -2.0, -0.5), _leaves(-1.2, -1.8, -0.6)
    behav, teacher = _leaves(-1.1, -2.2, -0.4), _leaves(-0.5, -3.0, -0.1)
    loss, stats = mopd_loss(logp, prox, behav, teacher, _ones_mask(3), adv_clip=5.0)
    loss.backward()
    assert logp.grad is not None and logp.grad.abs().sum() > 0
    assert prox.grad is None and behav.grad is None and teacher.grad is None
    assert not any(value.requires_grad for value in stats.values())


# --- MOPD -----------------------------------------------------------------------------------------


def test_mopd_on_policy_loss_is_minus_mean_clipped_teacher_gap():
    # logp = prox = behav, so rho = 1; teacher - logp = [0.5, -7, 3], c = 5 -> A_T = [0.5, -5, 3]
    # loss = -(0.5 - 5 + 3) / 3 = 0.5; gap mean = (0.5 - 7 + 3) / 3 = -3.5/3; adv_clip_frac = 1/3
    logp = _t(-1.0, -2.0, -0.5)
    loss, stats = mopd_loss(logp, logp, logp, logp + _t(0.5, -7.0, 3.0), _ones_mask(3), adv_clip=5.0)
    torch.testing.assert_close(loss, torch.tensor(0.5), **TOL)
    torch.testing.assert_close(stats["mopd/teacher_gap_mean"], torch.tensor(-3.5 / 3), **TOL)
    torch.testing.assert_close(stats["mopd/adv_clip_frac"], torch.tensor(1 / 3), **TOL)


def test_mopd_gradient_is_minus_rho_times_stop_grad_advantage_over_valid_count():
    # u = [1.5, 0.5, 2], w = [1, 2, 0.5] -> rho = [1.5, 1, 1]; A_T = teacher - logp = [1, -1, 0.5]
    # loss = -(1.5*1 + 1*-1 + 1*0.5) / 3 = -1/3
    # grad = -rho * A_T / 3 = [-0.5, 1/3, -1/6]   (without the stop-grad on logp inside A_T,
    # each token would get an extra +rho/3)
    inputs = _ppo_inputs(_t(1.5, 0.5, 2.0), _t(1.0, 2.0, 0.5))
    teacher = inputs["logprobs"].detach() + _t(1.0, -1.0, 0.5)
    loss, _ = mopd_loss(**inputs, teacher_logprobs=teacher, loss_mask=_ones_mask(3), adv_clip=5.0)
    loss.backward()
    torch.testing.assert_close(loss, torch.tensor(-1 / 3), **TOL)
    torch.testing.assert_close(inputs["logprobs"].grad, _t(-0.5, 1 / 3, -1 / 6), **TOL)


@pytest.mark.parametrize(("action", "expected"), [("mask", -1.0), ("clamp", -8 / 3)])
def test_mopd_behavior_weight_cap_masks_or_clamps(action, expected):
    # u = 1, A_T = 1, w = [2, 8, 1], cap 5
    # mask: -(2 + 0 + 1) / 3 = -1;  clamp: -(2 + 5 + 1) / 3 = -8/3
    inputs = _ppo_inputs(_t(1.0, 1.0, 1.0), _t(2.0, 8.0, 1.0))
    teacher = inputs["logprobs"].detach() + 1.0
    loss, stats = mopd_loss(
        **inputs,
        teacher_logprobs=teacher,
        loss_mask=_ones_mask(3),
        adv_clip=5.0,
        behavior_weight_cap=5.0,
        behavior_weight_action=action,
    )
    torch.testing.assert_close(loss, torch.tensor(expected), **TOL)
    capped_frac = stats["mopd/behavior_weight_capped_frac"]
    torch.testing.assert_close(capped_frac, torch.tensor(1 / 3), **TOL)


# --- full-vocabulary distillation -----------------------------------------------------------------


def test_full_kl_is_the_reverse_kl_of_each_position_then_the_token_mean():
    student = torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4]]).log().requires_grad_()
    teacher = torch.tensor([[0.25, 0.5, 0.25], [0.1, 0.8, 0.1], [0.9, 0.05, 0.05]]).log()
    mask = torch.tensor([True, True, False])  # the third position is padding
    loss, stats = full_kl_distill_loss(student, teacher, mask)
    kl0 = 0.5 * math.log(0.5 / 0.25) + 0.25 * math.log(0.25 / 0.5)  # + 0.25 * log(1) = 0
    torch.testing.assert_close(loss, torch.tensor(kl0 / 2), **TOL)  # position 1 matches its teacher: 0
    torch.testing.assert_close(stats["mopd/kl_mean"], torch.tensor(kl0 / 2), **TOL)
    assert float(stats["mopd/num_valid_tokens"]) == 2.0
    loss.backward()
    assert student.grad is not None and float(student.grad[2].abs().sum()) == 0.0  # padding gets no gradient


def test_full_kl_gradient_is_the_expectation_of_the_sampled_mopd_gradient_over_every_token():
    """The sampled estimator (``mopd_loss``, on policy, no clip) scores one drawn token; weighting every
    vocabulary entry by its probability gives its expectation, which is the exact KL's gradient."""
    torch.manual_seed(0)
    logits = torch.randn(6, requires_grad=True)
    teacher = torch.randn(6).log_softmax(-1)
    full, _ = full_kl_distill_loss(logits.log_softmax(-1)[None], teacher[None], _ones_mask(1))
    (grad_full,) = torch.autograd.grad(full, logits)
    logp = logits.log_softmax(-1)  # token v "sampled" at each of 6 positions, weighted by pi(v)
    sampled, _ = mopd_loss(
        logp, logp.detach(), logp.detach(), teacher, _ones_mask(6), adv_clip=1e6, token_weights=logp.detach().exp()
    )
    (grad_sampled,) = torch.autograd.grad(sampled, logits)
    torch.testing.assert_close(grad_sampled, grad_full, **TOL)


def test_full_kl_gradient_steps_move_the_student_onto_its_teacher():
    torch.manual_seed(1)
    logits = torch.randn(4, 10, requires_grad=True)
    teacher = torch.randn(4, 10).mul(3).log_softmax(-1)
    opt = torch.optim.Adam([logits], lr=0.1)
    first = None
    for _ in range(500):
        opt.zero_grad()
        loss, _ = full_kl_distill_loss(logits.log_softmax(-1), teacher, _ones_mask(4))
        first = float(loss.detach()) if first is None else first
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 1e-3 * first
    # in probability: where the teacher puts almost no mass the reverse KL hardly cares how little
    torch.testing.assert_close(logits.softmax(-1).detach(), teacher.exp(), atol=1e-2, rtol=0)


def test_full_kl_stays_finite_where_the_teacher_gives_a_token_no_mass_and_padding_holds_nan():
    student = torch.tensor([[0.5, 0.5], [0.5, 0.5]]).log().requires_grad_()
    teacher = torch.tensor([[0.0, float("-inf")], [float("nan"), float("nan")]])
    loss, stats = full_kl_distill_loss(student, teacher, torch.tensor([True, False]))
    loss.backward()
    value = float(loss.detach())
    assert math.isfinite(value) and value > 10  # -inf floored: large, not inf
    assert student.grad is not None and bool(torch.isfinite(student.grad).all())
    assert all(math.isfinite(float(v)) for v in stats.values())


def test_full_kl_refuses_shapes_that_are_not_one_distribution_per_position():
    with pytest.raises(ValueError, match=r"\[T, V\]"):
        full_kl_distill_loss(torch.zeros(3), torch.zeros(3), _ones_mask(3))
    with pytest.raises(ValueError, match="loss_mask"):
        full_kl_distill_loss(torch.zeros(3, 4), torch.zeros(3, 4), _ones_mask(2))


# --- mixture routing ------------------------------------------------------------------------------


def test_mix_teacher_logprobs_equals_log_of_weighted_probability_sum():
    probs = [[0.5, 0.1, 0.2], [0.25, 0.3, 0.6], [0.125, 0.6, 0.2]]  # [K=3 teachers, T=3 tokens]
    weights = [1.0, 2.0, 1.0]  # normalized: [0.25, 0.5, 0.25]
    # token 0: 0.25*0.5 + 0.5*0.25 + 0.25*0.125 = 0.28125
    expected = [math.log(sum(w / 4.0 * probs[k][t] for k, w in enumerate(weights))) for t in range(3)]
    mixed = mix_teacher_logprobs(torch.tensor(probs).log(), weights)
    torch.testing.assert_close(mixed, torch.tensor(expected), **TOL)
    torch.testing.assert_close(mixed[0], torch.tensor(math.log(0.28125)), **TOL)


def test_mix_is_invariant_to_weight_scale_and_identity_for_one_teacher():
    logps = _log(0.5, 0.1, 0.2, 0.25, 0.3, 0.6).view(2, 3)
    scaled = mix_teacher_logprobs(logps, torch.tensor([2.0, 6.0]))
    torch.testing.assert_close(mix_teacher_logprobs(logps, [1.0, 3.0]), scaled, **TOL)
    torch.testing.assert_close(mix_teacher_logprobs(logps[:1], [0.7]), logps[0], **TOL)


@pytest.mark.parametrize("weights", [[1.0, 0.0, 1.0], [1.0, -1.0, 1.0], [1.0, float("nan"), 1.0], [1.0, 1.0]])
def test_mix_rejects_non_positive_non_finite_or_miscounted_weights(weights):
    with pytest.raises(ValueError):
        mix_teacher_logprobs(torch.zeros(3, 4), weights)


# --- combination, stats, option checks ---------------------------------------------------------


def test_combined_loss_is_weighted_sum_with_merged_stats():
    inputs = _ppo_inputs(_t(1.5, 0.5, 1.1), _t(2.0, 0.5, 1.0))
    mask, teacher = _ones_mask(3), inputs["logprobs"].detach() + _t(1.0, -1.0, 0.5)
    rl = decoupled_ppo_loss(**inputs, advantages=_t(1.0, -1.0, 2.0), loss_mask=mask, eps_clip=0.2)
    distill = mopd_loss(**inputs, teacher_logprobs=teacher, loss_mask=mask, adv_clip=5.0)
    loss, stats = combined_loss(rl, distill, rl_coef=0.5, distill_coef=2.0)
    torch.testing.assert_close(loss, 0.5 * rl[0] + 2.0 * distill[0], **TOL)
    assert {"ppo/clip_frac", "mopd/teacher_gap_mean", "loss/total"} <= stats.keys()


def test_stats_are_flat_slash_keys_with_detached_scalar_tensors():
    inputs = _ppo_inputs(_t(1.5, 0.5, 1.1), _t(2.0, 0.5, 1.0))
    _, stats = decoupled_ppo_loss(**inputs, advantages=_t(1.0, -1.0, 2.0), loss_mask=_ones_mask(3), eps_clip=0.2)
    expected = {
        "ppo/loss",
        "ppo/num_valid_tokens",
        "ppo/num_loss_tokens",
        "ppo/clip_frac",
        "ppo/dual_clip_frac",
        "ppo/behavior_weight_capped_frac",
        "ppo/importance_weight_mean",
        "ppo/importance_weight_max",
        "ppo/approx_kl",
    }
    assert stats.keys() == expected
    assert all(v.ndim == 0 and not v.requires_grad for v in stats.values())


def test_approx_kl_is_zero_at_current_equal_proximal_and_positive_otherwise():
    # k3 at u = 1.5: 1.5 - 1 - log 1.5 = 0.0945
    same = _ppo_inputs(_t(1.0, 1.0), _t(1.0, 1.0))
    moved = _ppo_inputs(_t(1.5, 1.5), _t(1.0, 1.0))
    common = {"advantages": _t(1.0, 1.0), "loss_mask": _ones_mask(2), "eps_clip": 0.2}
    _, at_prox = decoupled_ppo_loss(**same, **common)
    _, away = decoupled_ppo_loss(**moved, **common)
    torch.testing.assert_close(at_prox["ppo/approx_kl"], torch.tensor(0.0), **TOL)
    torch.testing.assert_close(away["ppo/approx_kl"], torch.tensor(0.5 - math.log(1.5)), **TOL)


@pytest.mark.parametrize(
    "options",
    [
        {"eps_clip": 0.0},
        {"eps_clip": 1.0},
        {"eps_clip": 0.2, "eps_clip_high": 0.0},
        {"eps_clip": 0.2, "dual_clip": 1.0},
        {"eps_clip": 0.2, "behavior_weight_cap": 0.0},
        {"eps_clip": 0.2, "behavior_weight_action": "drop"},
    ],
)
def test_ppo_rejects_invalid_options_with_value_error(options):
    x = _t(-1.0, -2.0)
    with pytest.raises(ValueError):
        decoupled_ppo_loss(x, x, x, x, _ones_mask(2), **options)


def test_mopd_rejects_non_positive_adv_clip():
    x = _t(-1.0, -2.0)
    with pytest.raises(ValueError, match="adv_clip"):
        mopd_loss(x, x, x, x, _ones_mask(2), adv_clip=0.0)


def test_mismatched_shapes_raise_value_error():
    x = _t(-1.0, -2.0, -3.0)
    with pytest.raises(ValueError, match="shape"):
        decoupled_ppo_loss(x, x[:2], x, x, _ones_mask(3), eps_clip=0.2)


# --- token weights: the sequence mean ----------------------------------------------------------------


def test_sequence_mean_weights_are_one_over_each_tokens_sequence_length():
    weights = sequence_mean_weights(torch.tensor([0, 0, 0, 7, 2, 2]))
    torch.testing.assert_close(weights, _t(1 / 3, 1 / 3, 1 / 3, 1.0, 0.5, 0.5))


@pytest.mark.parametrize("which", ["ppo", "mopd", "kl"])
def test_sequence_mean_is_the_mean_over_sequences_of_each_sequences_token_mean(which):
    """A 1-token and a 4-token sequence: with the weights each counts half, whatever its length;
    with none, the 4-token one counts four fifths."""
    torch.manual_seed(0)
    seq = torch.tensor([0, 1, 1, 1, 1])
    logp = (-torch.rand(5) - 0.1).requires_grad_()
    prox, behav, teacher = -torch.rand(5) - 0.1, -torch.rand(5) - 0.1, -torch.rand(5) * 3
    adv = _t(1.0, -0.5, -0.5, -0.5, -0.5)

    def loss(lp, mask, weights=None):
        if which == "ppo":
            return decoupled_ppo_loss(lp, prox, behav, adv, mask, eps_clip=0.2, token_weights=weights)[0]
        if which == "mopd":
            return mopd_loss(lp, prox, behav, teacher, mask, adv_clip=5.0, token_weights=weights)[0]
        return kl_penalty(lp, teacher, mask, estimator="k3", token_weights=weights)[0]

    per_sequence = [loss(logp, seq == i) for i in (0, 1)]
    weighted = loss(logp, _ones_mask(5), sequence_mean_weights(seq))
    torch.testing.assert_close(weighted, (per_sequence[0] + per_sequence[1]) / 2, **TOL)
    torch.testing.assert_close(loss(logp, _ones_mask(5), torch.ones(5)), loss(logp, _ones_mask(5)), **TOL)
    torch.testing.assert_close(loss(logp, _ones_mask(5)), (per_sequence[0] + 4 * per_sequence[1]) / 5, **TOL)


def test_token_weights_must_match_the_mask_and_be_non_negative():
    kw = {"proximal_logprobs": _t(-1.0, -1.0), "behavior_logprobs": _t(-1.0, -1.0), "advantages": _t(1.0, 1.0)}
    with pytest.raises(ValueError, match="shape"):
        decoupled_ppo_loss(_t(-1.0, -1.0), loss_mask=_ones_mask(2), eps_clip=0.2, token_weights=torch.ones(3), **kw)
    with pytest.raises(ValueError, match="non-negative"):
        decoupled_ppo_loss(_t(-1.0, -1.0), loss_mask=_ones_mask(2), eps_clip=0.2, token_weights=_t(1.0, -1.0), **kw)
