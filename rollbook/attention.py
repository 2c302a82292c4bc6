"""Causal attention within each sequence of a packed row, shared by packed training
(trainer/packing.py) and the rollout engine's prefill (rollout/kv_slab.py). Both register their own
attention function with transformers and call these, so the two read the model's attention alike.

Imports torch at module level: only the trainer and the engine import it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

SCORE_MODIFIERS = ("softcap", "s_aux", "position_bias")


def refuse_score_modifiers(module: Any, kwargs: dict, where: str) -> None:
    """Raise ``ValueError`` when ``module``'s attention modifies its scores (soft-capping, sinks, a
    position bias): ``where`` (packed training, the native engine) applies plain causal SDPA only."""
    unsupported = [name for name in SCORE_MODIFIERS if kwargs.get(name) is not None]
    if unsupported:
        raise ValueError(
            f"{type(module).__name__} modifies its attention scores ({', '.join(unsupported)}), which {where} does "
            "not apply; it supports attention that is plain causal SDPA (Llama, Qwen2, Mistral, ...)"
        )


def causal_per_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    groups: Sequence[slice | torch.Tensor],
    scale: float | None,
    window: int | None,
    *,
    dropout: float = 0.0,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Causal SDPA within each sequence of ``q``/``k``/``v`` (``[heads, T, dim]``), sequences given as
    ``groups``: a slice (one sequence) or a ``[n, L]`` index tensor (n sequences of length L, run as
    one batch). A ``window`` (a sliding-window layer) hides keys that many positions back or more, as
    transformers' own mask does, through a band mask for a sequence longer than it. Returns
    ``[sum of lengths, heads, dim]`` in the groups' order."""
    pieces = []
    for group in groups:
        if isinstance(group, slice):
            qs, ks, vs = (t[None, :, group] for t in (q, k, v))  # [1, H, L, D]
        else:
            qs, ks, vs = (t[:, group].transpose(0, 1) for t in (q, k, v))  # [n, H, L, D]
        length = qs.shape[2]
        if window is not None and length > window:
            pos = torch.arange(length, device=qs.device)
            band = (pos[:, None] >= pos[None, :]) & (pos[:, None] - pos[None, :] < window)  # query i sees key j
            out = F.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=band, dropout_p=dropout, scale=scale, enable_gqa=enable_gqa
            )
        else:
            out = F.scaled_dot_product_attention(
                qs, ks, vs, dropout_p=dropout, is_causal=True, scale=scale, enable_gqa=enable_gqa
            )
        pieces.append(out.transpose(1, 2).reshape(-1, q.shape[0], q.shape[2]))  # [n * L, H, D]
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]
