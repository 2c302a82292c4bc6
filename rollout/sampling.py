"""Per-request random streams for the native engine's sampler (rollout/engine.py).

    key = request_key(seed=1234, index=0)                # 32 bits per request
    noise = gumbel_noise(keys, output_index, mix)        # [N, V], a pure function of its inputs
    tokens = (logp + noise).argmax(dim=-1)               # Gumbel-max: a draw from softmax(logp)

A request's output token ``i`` is the argmax of its sampling log-probabilities plus Gumbel noise
made from a hash of (the request's key, ``i``, the vocabulary index). The noise is a function of
those three alone, not of a generator's state, so a request draws the same tokens whatever else
shares the batch, on CPU and CUDA alike. Truncated entries are ``-inf`` in the log-probabilities and
so never win. The hash is ``lowbias32`` (Chris Wellons' hash prospector) on int64 tensors holding
32-bit values: every product stays below 2**63 and every shift is of a non-negative value, so it
runs with plain tensor ops anywhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import torch

_MASK = 0xFFFFFFFF


def request_key(seed: int, index: int = 0) -> int:
    """The 32-bit sampling key of request ``index`` of a call seeded with ``seed`` (any int)."""
    seed &= (1 << 64) - 1
    return _mix(_mix(_mix(seed >> 32) ^ (seed & _MASK)) ^ _mix(index & _MASK))


def vocab_mix(num_vocab: int, device: torch.device) -> torch.Tensor:
    """The hashed vocabulary indices ``[V]`` the noise combines with each row's key (build once)."""
    import torch

    return _mix(torch.arange(num_vocab, dtype=torch.long, device=device) ^ 0x5BD1E995)


def gumbel_noise(keys: torch.Tensor, output_index: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise ``[N, V]`` float32 for rows with sampling ``keys`` ``[N]`` at output index
    ``output_index`` ``[N]`` (both int64); ``mix`` is ``vocab_mix(V)``."""
    row = _mix((keys + output_index * 0x9E3779B1) & _MASK)  # [N]; products stay below 2**63
    bits = _mix(row[:, None] ^ mix[None, :])  # [N, V]
    uniform = (bits >> 8).float().add_(0.5).mul_(2.0**-24)  # in (0, 1): 24 bits fill a float32 mantissa
    return uniform.log_().neg_().log_().neg_()


def _mix(x):
    """lowbias32 on a Python int or an int64 tensor of 32-bit values."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _MASK
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _MASK
    return x ^ (x >> 15)
