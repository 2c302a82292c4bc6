"""Pure loss functions of the trainer: decoupled PPO, multi-teacher on-policy distillation, and the
KL penalty to a reference policy.

Tensors in, ``(loss, stats)`` out: no model, no optimizer, no config object. The step loop calls
them per micro-batch on packed tokens, shape ``[T]`` (any shape works if every argument has the
same one). Three policies appear in the arguments, named as in docs/design.md, "The trainer":

- behavior: sampled the tokens; its log-probs come from the rollout engine through the store;
- proximal: the trainer's weights before this update (recomputed, or the log-linear approximation of
  ``rollbook.trainer.proximal``);
- current: the weights being optimized. ``logprobs`` is the only argument gradients flow into; every
  other tensor is detached here, even when it requires grad.

Conventions shared by every loss here:

- Token mean over ``loss_mask`` (bool or 0/1). The denominator is the number of tokens in the
  ORIGINAL mask, even when ``behavior_weight_action="mask"`` drops tokens from the numerator
  (AReaL's convention: a dropped token counts as a zero contribution, so dropping tokens never
  inflates the others). With no valid token the loss is 0 and still has a grad_fn. To weight
  micro-batches by token count across a step, scale each loss by
  ``stats[".../num_valid_tokens"] / total_valid_tokens``.
- Values at masked positions are never read: padding may hold anything, nan included.
- Log-ratios (current/proximal, proximal/behavior, teacher/current) are clamped to
  ``[-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]``, so no ratio, advantage or stat is inf or nan (a -inf
  log-prob included, as long as the two sides of a ratio are not both -inf); beyond the clamp the
  gradient is zero.
- Arithmetic is float32 (or float64 when given); stats are a flat dict with ``/`` keys whose values
  are detached 0-d tensors (no device sync; call ``.item()`` when logging).

Tests: ``python -m pytest tests/unit/trainer -q``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

LOG_RATIO_CLAMP = 20.0
"""exp(20) ~ 4.9e8: far beyond any cap or clip, still finite in float32 and bfloat16."""

TEACHER_LOGP_FLOOR = 100.0
"""``full_kl_distill_loss`` floors the teacher's log-probs at -100: a token it never emits costs the
student 100 nats per unit of its own probability there, finite in float32."""

K3_CLAMP = 10.0
"""Bound on the per-token k3 estimate (verl clamps its ``low_var_kl`` to [-10, 10] the same way)."""

BehaviorWeightAction = Literal["mask", "clamp"]
KLEstimator = Literal["k1", "k3"]
LossOutput = tuple[torch.Tensor, dict[str, torch.Tensor]]


def decoupled_ppo_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float | None = None,
    behavior_weight_cap: float | None = None,
    behavior_weight_action: BehaviorWeightAction = "mask",
    dual_clip: float | None = None,
    token_weights: torch.Tensor | None = None,
) -> LossOutput:
    """Decoupled PPO loss, AReaL Eq. 5 (https://arxiv.org/abs/2505.24298).

    Per valid token: ``w * max(-A*u, -A*clip(u, 1-eps_clip, 1+eps_clip_high))`` with
    ``u = pi_current / pi_proximal`` and ``w = pi_proximal / pi_behavior`` (detached). With the dual
    clip ``c``, tokens with ``A < 0`` take ``min(that, -c*A)`` before ``w`` multiplies. Then the
    token mean (see the module docstring for the denominator).

    Args:
        logprobs: current policy, ``[T]``; log-probs of the sampled tokens; carries the gradient.
        proximal_logprobs: proximal policy, ``[T]``.
        behavior_logprobs: behavior policy, ``[T]``.
        advantages: ``[T]``, one per token (a sequence's advantage repeated over its tokens).
        loss_mask: ``[T]``, bool or 0/1; false for prompt tokens and padding.
        eps_clip: lower clip, ``u >= 1 - eps_clip``; in (0, 1).
        eps_clip_high: upper clip, ``u <= 1 + eps_clip_high``; defaults to ``eps_clip``.
        behavior_weight_cap: upper bound on ``w``; None means uncapped.
        behavior_weight_action: above the cap, "mask" drops the token from the numerator,
            "clamp" uses ``w = cap``.
        dual_clip: ``c > 1`` bounding negative-advantage tokens' loss by ``-c*A``; None is off.
        token_weights: ``[T]``, non-negative; None: the token mean. Given: the weighted mean
            ``sum(w * loss) / sum(w)`` over valid tokens (``1 / sequence length`` weighs every
            sequence alike: ``sequence_mean_weights``). Stats stay token means.

    Returns:
        The scalar loss and ``ppo/*`` stats.
    """
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    _check_ppo_options(eps_clip, eps_high, dual_clip)
    _check_cap_options(behavior_weight_cap, behavior_weight_action)
    mask, (logp, prox, behav, adv) = _prepare(loss_mask, logprobs, proximal_logprobs, behavior_logprobs, advantages)
    ratio = _exp_clamped(logp - prox)
    raw_weight = _exp_clamped(prox - behav)
    weight, keep, capped = _cap_behavior_weight(raw_weight, mask, behavior_weight_cap, behavior_weight_action)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - eps_clip, 1.0 + eps_high)
    is_clipped = clipped > unclipped
    per_token = torch.where(is_clipped, clipped, unclipped)
    is_dual = torch.zeros_like(mask)
    if dual_clip is not None:
        dual = -dual_clip * adv
        is_dual = (adv < 0) & (dual < per_token)
        per_token = torch.where(is_dual, dual, per_token)
    loss = _token_mean(weight * per_token, keep, mask, _weights(token_weights, mask))
    stats = _shared_stats("ppo", loss, logp, prox, raw_weight, mask, keep, capped)
    stats["ppo/clip_frac"] = _fraction(is_clipped, keep)
    stats["ppo/dual_clip_frac"] = _fraction(is_dual, keep)
    return loss, stats


def mopd_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behavior_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    adv_clip: float,
    behavior_weight_cap: float | None = None,
    behavior_weight_action: BehaviorWeightAction = "mask",
    token_weights: torch.Tensor | None = None,
) -> LossOutput:
    """Multi-teacher on-policy distillation loss (MOPD), with AReaL's decoupled importance ratio.

    Per valid token: ``A_T = clip(log pi_teacher - sg(log pi_current), -c, c)`` and
    ``-rho * A_T`` with ``rho = u * w``: ``u = pi_current / pi_proximal`` keeps its gradient,
    ``w = pi_proximal / pi_behavior`` is detached and capped as in ``decoupled_ppo_loss``. Then the
    token mean. The gradient per token is ``-rho * A_T / T_valid``: a policy gradient whose
    advantage is the teacher-student log-prob gap. The decoupled ratio is AReaL Eq. 5,
    https://arxiv.org/abs/2505.24298.
    The caller combines it with the RL loss (``combined_loss``).

    Args:
        logprobs: current policy, ``[T]``; carries the gradient.
        proximal_logprobs: proximal policy, ``[T]``.
        behavior_logprobs: behavior policy, ``[T]``.
        teacher_logprobs: teacher policy, ``[T]``: the teacher's log-probs of the student's sampled
            tokens (one teacher per token by domain routing, or ``mix_teacher_logprobs``).
        loss_mask: ``[T]``, bool or 0/1.
        adv_clip: ``c > 0`` bounding the teacher advantage (AReaL's mopd_adv_clip, 5.0).
        behavior_weight_cap: upper bound on ``w``; None means uncapped.
        behavior_weight_action: "mask" or "clamp", as in ``decoupled_ppo_loss``.
        token_weights: as in ``decoupled_ppo_loss``.

    Returns:
        The scalar loss and ``mopd/*`` stats.
    """
    _check_positive("adv_clip", adv_clip)
    _check_cap_options(behavior_weight_cap, behavior_weight_action)
    mask, (logp, prox, behav, teacher) = _prepare(loss_mask, logprobs, proximal_logprobs, behavior_logprobs, teacher_logprobs)
    gap = _clamp_log_ratio(teacher - logp.detach())
    adv = gap.clamp(-adv_clip, adv_clip)
    raw_weight = _exp_clamped(prox - behav)
    weight, keep, capped = _cap_behavior_weight(raw_weight, mask, behavior_weight_cap, behavior_weight_action)
    rho = _exp_clamped(logp - prox) * weight
    loss = _token_mean(-rho * adv, keep, mask, _weights(token_weights, mask))
    stats = _shared_stats("mopd", loss, logp, prox, raw_weight, mask, keep, capped)
    stats["mopd/teacher_gap_mean"] = _masked_mean(gap, mask)
    stats["mopd/adv_clip_frac"] = _fraction(gap.abs() > adv_clip, keep)
    return loss, stats


def full_kl_distill_loss(
    log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    token_weights: torch.Tensor | None = None,
) -> LossOutput:
    """On-policy distillation by the exact reverse KL over the vocabulary (``loss.distill_estimator =
    "full"``; GKD's on-policy, reverse-KL setting, https://arxiv.org/abs/2306.13649).

    Per valid position ``t``: ``KL_t = sum_v pi(v) * (log pi(v) - log pi_T(v))``, both
    distributions conditioned on the student's own sampled prefix, then the token mean. Where
    ``mopd_loss`` sees the teacher only through the sampled token (a one-sample estimate of the same
    KL's gradient, whose signal vanishes once the student rarely samples a wrong token), this
    differentiates the KL itself: every position pulls every vocabulary entry toward the teacher.
    No importance weight: the expectation over the next token is exact, so only the prefix comes
    from the behavior policy (as for the KL penalty), and no trust-region clip.

    Args:
        log_probs: current policy, ``[T, V]`` log-softmax at each output position; carries the gradient.
        teacher_log_probs: the teacher's, ``[T, V]`` on the same positions (same vocabulary).
        loss_mask: ``[T]``, bool or 0/1.
        token_weights: as in ``decoupled_ppo_loss``.

    Returns:
        The scalar loss and ``mopd/*`` stats: ``mopd/kl_mean`` (the per-position KL, a token mean)
        and ``mopd/num_valid_tokens``.
    """
    if log_probs.ndim != 2 or teacher_log_probs.shape != log_probs.shape:
        raise ValueError(
            f"need [T, V] log-probs for the student and the teacher alike, got {tuple(log_probs.shape)} "
            f"and {tuple(teacher_log_probs.shape)}"
        )
    if loss_mask.shape != log_probs.shape[:1]:
        raise ValueError(f"loss_mask must be [T] = {tuple(log_probs.shape[:1])}, got {tuple(loss_mask.shape)}")
    mask = loss_mask.bool()
    rows = mask[:, None]  # padding rows are never read: zeroed before any arithmetic
    kl = reverse_kl(torch.where(rows, log_probs, 0.0), torch.where(rows, teacher_log_probs, 0.0))
    return kl_distill_loss(kl, mask, token_weights=token_weights)


def reverse_kl(log_probs: torch.Tensor, teacher_log_probs: torch.Tensor) -> torch.Tensor:
    """``KL(pi || pi_T)`` per row, ``[T]`` float32, from ``[T, V]`` log-softmaxes: the student's
    (carries the gradient) and the teacher's (detached; floored at ``-TEACHER_LOGP_FLOOR``, so an entry
    it never emits makes the KL large, not inf). The trainer computes it a few rows at a time
    (trainer/packing.py ``packed_logprobs_and_kl``) and hands the rows to ``kl_distill_loss``."""
    dtype = torch.promote_types(log_probs.dtype, torch.float32)
    logp = log_probs.to(dtype)
    teacher = teacher_log_probs.detach().to(dtype).clamp(min=-TEACHER_LOGP_FLOOR)
    return (logp.exp() * (logp - teacher)).sum(-1)


def kl_distill_loss(kl: torch.Tensor, loss_mask: torch.Tensor, *, token_weights: torch.Tensor | None = None) -> LossOutput:
    """``full_kl_distill_loss`` from the per-position KL (``reverse_kl``, ``[T]``, with grad): its
    token mean (or ``token_weights``' weighting) over ``loss_mask``, and the same ``mopd/*`` stats."""
    if kl.ndim != 1 or loss_mask.shape != kl.shape:
        raise ValueError(
            f"need a per-position KL [T] and a loss_mask of the same shape, got {tuple(kl.shape)} and {tuple(loss_mask.shape)}"
        )
    mask = loss_mask.bool()
    dtype = torch.promote_types(kl.dtype, torch.float32)
    kl = torch.where(mask, kl.to(dtype), 0.0)
    loss = _token_mean(kl, mask, mask, _weights(token_weights, mask))
    return loss, {
        "mopd/loss": loss.detach(),
        "mopd/kl_mean": _masked_mean(kl, mask),
        "mopd/num_valid_tokens": mask.sum().to(dtype),
    }


def sequence_mean_weights(seq_index: torch.Tensor) -> torch.Tensor:
    """Per-token weights ``1 / (tokens of its sequence)`` for the ``token_weights`` argument: every
    sequence then weighs the same in the loss whatever its length (verl's ``seq-mean-token-mean``
    ``loss_agg_mode``), where the plain token mean lets long answers outweigh short ones (a 14-token
    program answer counts three and a half times a 4-token sum).

    Args:
        seq_index: ``[T]`` integer, the sequence each token belongs to (any ids).
    """
    _, inverse, counts = torch.unique(seq_index, return_inverse=True, return_counts=True)
    return 1.0 / counts[inverse].to(torch.float32)


def mix_teacher_logprobs(teacher_logprobs: torch.Tensor, weights: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """Mixture routing: log-probs of the arithmetic mixture ``sum_j w_j * pi_Tj``.

    Computes ``logsumexp_j(log pi_Tj + log w_j)`` with the weights normalized to sum to 1.

    Args:
        teacher_logprobs: ``[K, T]`` (or ``[K, ...]``), teacher j's log-probs of the sampled tokens.
        weights: ``K`` positive, finite mixture weights, in any scale.

    Returns:
        ``[T]`` (or ``[...]``): the mixture's log-probs, for ``mopd_loss(teacher_logprobs=...)``.
    """
    w = torch.as_tensor(weights, dtype=torch.float64).detach().cpu()
    if teacher_logprobs.ndim == 0 or w.shape != (teacher_logprobs.shape[0],):
        raise ValueError(
            f"need one weight per teacher: weights shape {tuple(w.shape)}, "
            f"teacher_logprobs shape {tuple(teacher_logprobs.shape)} (teachers on dim 0)"
        )
    if not bool((torch.isfinite(w) & (w > 0)).all()):
        raise ValueError(f"mixture weights must be positive and finite, got {w.tolist()}")
    dtype = torch.promote_types(teacher_logprobs.dtype, torch.float32)
    log_w = (w / w.sum()).log().to(device=teacher_logprobs.device, dtype=dtype)
    log_w = log_w.view(-1, *([1] * (teacher_logprobs.ndim - 1)))
    return torch.logsumexp(teacher_logprobs.to(dtype) + log_w, dim=0)


def kl_penalty(
    logprobs: torch.Tensor,
    reference_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    estimator: KLEstimator,
    token_weights: torch.Tensor | None = None,
) -> LossOutput:
    """Token-mean estimate of KL(current || reference) on the sampled tokens, as a loss term.

    With ``r = log pi_current - log pi_reference`` per token (clamped like every log-ratio here):

    - ``k1 = r``: unbiased for the KL when the tokens are sampled from the current policy, but may be
      negative per token;
    - ``k3 = exp(-r) - 1 + r`` (``= ratio - log ratio - 1`` with ``ratio = pi_reference / pi_current``):
      never negative, lower variance; clamped to ``[0, K3_CLAMP]``.

    The names and formulas are those of J. Schulman, "Approximating KL divergence" (2020,
    http://joschu.net/blog/kl-approx.html), as verl's ``kl_penalty`` spells them
    (verl/trainer/ppo/core_algos.py: ``"kl"``/``"k1"`` is ``logprob - ref_logprob``,
    ``"low_var_kl"``/``"k3"`` is ``exp(ref_logprob - logprob) - (ref_logprob - logprob) - 1`` clamped
    to [-10, 10]) and TRL's GRPO trainer computes its ``beta`` term (k3). Like verl's ``use_kl_loss``
    the term goes into the loss (not into the reward) and carries no importance weight.

    Args:
        logprobs: current policy, ``[T]``; carries the gradient.
        reference_logprobs: reference policy, ``[T]``, scored on the same tokens at the same
            temperature.
        loss_mask: ``[T]``, bool or 0/1.
        estimator: ``"k1"`` or ``"k3"``: which estimate is the loss.
        token_weights: as in ``decoupled_ppo_loss``.

    Returns:
        The scalar token mean of the chosen estimate and ``kl/*`` stats: ``kl/mean`` (that loss),
        ``kl/k1_mean`` and ``kl/k3_mean`` (both estimates, whichever is the loss).
    """
    if estimator not in ("k1", "k3"):
        raise ValueError(f"kl estimator must be 'k1' or 'k3', got {estimator!r}")
    mask, (logp, ref) = _prepare(loss_mask, logprobs, reference_logprobs)
    log_ratio = _clamp_log_ratio(logp - ref)
    k1 = log_ratio
    k3 = ((-log_ratio).exp() - 1.0 + log_ratio).clamp(0.0, K3_CLAMP)
    loss = _token_mean(k1 if estimator == "k1" else k3, mask, mask, _weights(token_weights, mask))
    return loss, {
        "kl/mean": loss.detach(),
        "kl/k1_mean": _masked_mean(k1, mask),
        "kl/k3_mean": _masked_mean(k3, mask),
        "kl/num_valid_tokens": mask.sum().to(k1.dtype),
    }


def add_kl_penalty(policy: LossOutput, kl: LossOutput, *, kl_coef: float) -> LossOutput:
    """``L = L_policy + kl_coef * L_KL``, stats merged, ``loss/total`` the sum.

    Args:
        policy: the step's loss so far (``decoupled_ppo_loss`` or ``combined_loss``, already weighted).
        kl: the output of ``kl_penalty`` on the same tokens.
        kl_coef: weight of the KL term (verl's ``kl_loss_coef``, TRL's ``beta``).
    """
    loss = policy[0] + kl_coef * kl[0]
    return loss, {**policy[1], **kl[1], "loss/total": loss.detach()}


def combined_loss(rl: LossOutput, distill: LossOutput, *, rl_coef: float, distill_coef: float) -> LossOutput:
    """``L = rl_coef * L_RL + distill_coef * L_MOPD``, stats merged (AReaL's MOPD example: 0 / 1).

    Args:
        rl: the output of ``decoupled_ppo_loss``.
        distill: the output of ``mopd_loss`` on the same tokens.
        rl_coef: weight of the RL loss.
        distill_coef: weight of the distillation loss.
    """
    loss = rl_coef * rl[0] + distill_coef * distill[0]
    return loss, {**rl[1], **distill[1], "loss/total": loss.detach()}


# --- private helpers ---------------------------------------------------------------------------


def _prepare(loss_mask: torch.Tensor, logprobs: torch.Tensor, *others: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Bool mask, and the tensors upcast, masked positions zeroed; only ``logprobs`` keeps grad."""
    for tensor in (logprobs, *others):
        if tensor.shape != loss_mask.shape:
            raise ValueError(f"every argument must have loss_mask's shape {tuple(loss_mask.shape)}, got {tuple(tensor.shape)}")
    mask = loss_mask.bool()
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    tensors = [logprobs] + [t.detach() for t in others]
    return mask, [torch.where(mask, t.to(dtype), 0.0) for t in tensors]


def _clamp_log_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _exp_clamped(log_ratio: torch.Tensor) -> torch.Tensor:
    return _clamp_log_ratio(log_ratio).exp()


def _cap_behavior_weight(
    weight: torch.Tensor, mask: torch.Tensor, cap: float | None, action: BehaviorWeightAction
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (weight to use, tokens kept in the numerator, valid tokens above the cap)."""
    if cap is None:
        return weight, mask, torch.zeros_like(mask)
    capped = mask & (weight > cap)
    if action == "mask":
        return weight, mask & ~capped, capped
    return weight.clamp(max=cap), mask, capped


def _token_mean(
    values: torch.Tensor, keep: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    # where, not multiply: a dropped token's value may be huge and 0 * inf is nan.
    if weights is None:
        return torch.where(keep, values, 0.0).sum() / mask.sum().clamp(min=1)
    total = torch.where(mask, weights, 0.0).sum()
    return torch.where(keep, weights * values, 0.0).sum() / torch.where(total > 0, total, 1.0)


def _weights(token_weights: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor | None:
    """``token_weights`` checked (shape, finite, non-negative where valid), detached, float32."""
    if token_weights is None:
        return None
    if token_weights.shape != mask.shape:
        raise ValueError(f"token_weights must have loss_mask's shape {tuple(mask.shape)}, got {tuple(token_weights.shape)}")
    weights = torch.where(mask, token_weights.detach().to(torch.float32), 0.0)
    if not bool((torch.isfinite(weights) & (weights >= 0)).all()):
        raise ValueError("token_weights must be finite and non-negative at valid tokens")
    return weights


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return _token_mean(values.detach(), mask, mask)


def _masked_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Max over valid tokens of non-negative values; 0 when there is none."""
    valid = torch.where(mask, values.detach(), 0.0).flatten()
    return torch.cat([valid.new_zeros(1), valid]).amax()


def _fraction(flags: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (flags & mask).sum() / mask.sum().clamp(min=1)


def _shared_stats(
    prefix: str,
    loss: torch.Tensor,
    logp: torch.Tensor,
    prox: torch.Tensor,
    raw_weight: torch.Tensor,
    mask: torch.Tensor,
    keep: torch.Tensor,
    capped: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Stats both losses report. Importance weight: pi_prox/pi_behav before the cap, valid tokens.

    approx_kl is the k3 estimator of KL(proximal || current), ``u - 1 - log u`` (never negative).
    """
    log_ratio = _clamp_log_ratio(logp.detach() - prox)
    return {
        f"{prefix}/loss": loss.detach(),
        f"{prefix}/num_valid_tokens": mask.sum().to(raw_weight.dtype),
        f"{prefix}/num_loss_tokens": keep.sum().to(raw_weight.dtype),
        f"{prefix}/behavior_weight_capped_frac": _fraction(capped, mask),
        f"{prefix}/importance_weight_mean": _masked_mean(raw_weight, mask),
        f"{prefix}/importance_weight_max": _masked_max(raw_weight, mask),
        f"{prefix}/approx_kl": _masked_mean(log_ratio.exp() - 1.0 - log_ratio, mask),
    }


def _check_ppo_options(eps_clip: float, eps_clip_high: float, dual_clip: float | None) -> None:
    if not 0.0 < eps_clip < 1.0:
        raise ValueError(f"eps_clip must be in (0, 1) so that 1 - eps_clip > 0, got {eps_clip}")
    _check_positive("eps_clip_high", eps_clip_high)
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None to turn it off), got {dual_clip}")


def _check_cap_options(cap: float | None, action: str) -> None:
    if cap is not None:
        _check_positive("behavior_weight_cap", cap)
    if action not in ("mask", "clamp"):
        raise ValueError(f"behavior_weight_action must be 'mask' or 'clamp', got {action!r}")


def _check_positive(name: str, value: float) -> None:
    if not value > 0.0:
        raise ValueError(f"{name} must be > 0, got {value}")
