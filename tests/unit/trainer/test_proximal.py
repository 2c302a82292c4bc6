"""Unit tests of rollbook.trainer.proximal: the log-linear proximal approximation and its alpha.

Run: python -m pytest tests/unit/trainer/test_proximal.py -q
"""

from __future__ import annotations

import pytest
import torch

from rollbook.trainer.losses import decoupled_ppo_loss
from rollbook.trainer.proximal import loglinear_alpha, loglinear_proximal_logprobs

TOL = {"atol": 1e-6, "rtol": 1e-5}


def test_loglinear_interpolates_between_behavior_and_current_by_alpha():
    # behav = [-2, -1], current = [-1, -3]; alpha 0.25:
    # [-2 + 0.25*(-1 - -2), -1 + 0.25*(-3 - -1)] = [-1.75, -1.5]
    behav, current = torch.tensor([-2.0, -1.0]), torch.tensor([-1.0, -3.0])
    got = loglinear_proximal_logprobs(behav, current, 0.25)
    torch.testing.assert_close(got, torch.tensor([-1.75, -1.5]), **TOL)
    torch.testing.assert_close(loglinear_proximal_logprobs(behav, current, 0.0), behav, **TOL)
    torch.testing.assert_close(loglinear_proximal_logprobs(behav, current, 1.0), current, **TOL)


def test_loglinear_takes_per_token_alpha_and_returns_detached_tensor():
    # alpha = [0, 0.5, 1]: [-2, -1 + 0.5*(-2), -0.5] = [-2, -2, -0.5]
    behav = torch.tensor([-2.0, -1.0, -3.0])
    current = torch.tensor([-1.0, -3.0, -0.5], requires_grad=True)
    got = loglinear_proximal_logprobs(behav, current, torch.tensor([0.0, 0.5, 1.0]))
    torch.testing.assert_close(got, torch.tensor([-2.0, -2.0, -0.5]), **TOL)
    assert not got.requires_grad


@pytest.mark.parametrize("alpha", [-0.1, 1.5])
def test_loglinear_rejects_float_alpha_outside_unit_interval(alpha):
    x = torch.tensor([-1.0])
    with pytest.raises(ValueError, match="alpha"):
        loglinear_proximal_logprobs(x, x, alpha)


def test_alpha_is_version_distance_ratio_per_token():
    # prox 5, current 6, versions [3, 4, 5]:
    # [(5-3)/(6-3), (5-4)/(6-4), (5-5)/(6-5)] = [2/3, 1/2, 0]
    alpha = loglinear_alpha(torch.tensor([3, 4, 5]), proximal_version=5, current_version=6)
    torch.testing.assert_close(alpha, torch.tensor([2 / 3, 1 / 2, 0.0]), **TOL)
    assert alpha.dtype == torch.float32


def test_alpha_is_one_when_current_version_equals_proximal_version():
    # (5-3)/(5-3) = 1, and all-equal versions (0/0) are defined as 1: the trainer's own log-probs
    alpha = loglinear_alpha(torch.tensor([3, 5]), proximal_version=5, current_version=5)
    torch.testing.assert_close(alpha, torch.tensor([1.0, 1.0]), **TOL)


def test_alpha_accepts_prompt_tokens_at_version_minus_one():
    # prox 2, current 3, version -1: (2+1)/(3+1) = 0.75
    alpha = loglinear_alpha(torch.tensor([-1, 2]), proximal_version=2, current_version=3)
    torch.testing.assert_close(alpha, torch.tensor([0.75, 0.0]), **TOL)


def test_alpha_rejects_proximal_version_newer_than_current():
    with pytest.raises(ValueError, match="proximal_version"):
        loglinear_alpha(torch.tensor([1]), proximal_version=4, current_version=3)


def test_alpha_rejects_behavior_version_newer_than_proximal():
    with pytest.raises(ValueError, match="newer than proximal_version"):
        loglinear_alpha(torch.tensor([2, 5]), proximal_version=4, current_version=5)


def test_fresh_tokens_get_unit_behavior_weight_in_decoupled_ppo():
    # versions [4, 4] at prox 4: alpha 0 -> proximal = behavior -> w = 1, so the loss is plain PPO
    # u = exp(logp - behav) = [1.1, 0.9], A = [1, -1]: (-1.1 + 0.9) / 2 = -0.1
    behav = torch.tensor([-1.0, -2.0])
    logp = behav + torch.tensor([1.1, 0.9]).log()
    alpha = loglinear_alpha(torch.tensor([4, 4]), proximal_version=4, current_version=5)
    prox = loglinear_proximal_logprobs(behav, logp, alpha)
    loss, stats = decoupled_ppo_loss(logp, prox, behav, torch.tensor([1.0, -1.0]), torch.ones(2, dtype=torch.bool), eps_clip=0.2)
    torch.testing.assert_close(loss, torch.tensor(-0.1), **TOL)
    torch.testing.assert_close(stats["ppo/importance_weight_max"], torch.tensor(1.0), **TOL)
