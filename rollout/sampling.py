"""Per-request random streams for the native engine's sampler (rollout/engine.py).

    key = request_key(seed=1234, index=0)                # 32 bits per request
    noise = gumbel_noise(keys, output_index, mix)        # [N, V], a pure function of its inputs
    tokens = (logp + noise).argmax(dim=-1)               # Gumbel-max: a draw from softmax(logp)

    # the same draw in two halves: the per-(key, index) hash can be computed steps ahead
    tokens = gumbel_max(logp, row_hashes(keys, output_index), mix)

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
    return gumbel_noise_of_rows(row_hashes(keys, output_index), mix)


def row_hashes(keys: torch.Tensor, output_index: torch.Tensor) -> torch.Tensor:
    """The hash of each (key, output index) pair: ``keys`` ``[N]`` with ``output_index`` ``[N]``, or
    ``[N, W]`` for W indices per row at once (both int64)."""
    if output_index.dim() == 2:
        keys = keys[:, None]
    return _mix_((output_index * 0x9E3779B1).add_(keys).bitwise_and_(_MASK))  # products stay below 2**63


def gumbel_noise_of_rows(rows: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """``gumbel_noise`` from the ``row_hashes`` ``[N]`` of its rows."""
    return _exponential(rows, mix).log_().neg_()


def gumbel_max(logp: torch.Tensor, rows: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """``(logp + gumbel_noise_of_rows(rows, mix)).argmax(dim=-1)``: the tokens ``[N]`` drawn from the
    log-probabilities ``logp`` ``[N, V]`` (float32), with one pass fewer and the same sums bit for
    bit (``a + -b`` is ``a - b``)."""
    import torch

    exponential = _exponential(rows, mix)
    return torch.sub(logp, exponential.log_(), out=exponential).argmax(dim=-1)


def _exponential(rows: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """``-log(u)`` ``[N, V]`` float32 for the hashed uniform ``u`` of each row and vocabulary index."""
    bits = _mix_(rows[:, None] ^ mix)  # [N, V]
    uniform = bits.bitwise_right_shift_(8).float().add_(0.5).mul_(2.0**-24)  # in (0, 1): 24 bits fill a float32 mantissa
    return uniform.log_().neg_()


def _mix(x):
    """lowbias32 on a Python int or an int64 tensor of 32-bit values."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _MASK
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _MASK
    return x ^ (x >> 15)


def _mix_(x: torch.Tensor) -> torch.Tensor:
    """``_mix`` in place on an int64 tensor of 32-bit values that nothing else holds (fewer
    temporaries: the noise is ``[N, V]``, large for a real vocabulary)."""
    x ^= x >> 16
    x.mul_(0x21F0AAAD).bitwise_and_(_MASK)
    x ^= x >> 15
    x.mul_(0x735A2D97).bitwise_and_(_MASK)
    x ^= x >> 15
    return x
