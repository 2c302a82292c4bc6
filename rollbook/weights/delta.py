"""Delta updates: the changed words of a flat weight buffer against a base version, bit-exact.

A flat buffer (see ``base.Layout``) is a whole number of 4-byte words. A delta lists the indices of
the words that differ from the base version and their new values. Words are compared as unsigned
integers, so the comparison is on raw bits: ``-0.0`` differs from ``0.0``, a NaN equals itself only
with the same payload, and bf16/fp16 tensors work unchanged (two elements per word).

After one AdamW step every trained element moves (weight decay alone does that), so a delta is only
smaller than a full copy when few parameters train (frozen layers, LoRA-like updates) or when the
weights are low precision and most small updates round away. ``smaller_than_full`` decides.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

WORD = np.dtype("<u4")


@dataclass(frozen=True)
class Delta:
    """``values[i]`` is word ``indices[i]`` of version ``version``; every other word equals ``base_version``'s."""

    base_version: int
    version: int
    indices: np.ndarray  # [K] sorted, "<u4" (or "<u8" for buffers of 16 GiB and more)
    values: np.ndarray  # [K] "<u4"

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: indices then values."""
        return self.indices.nbytes + self.values.nbytes

    def smaller_than_full(self, flat_nbytes: int) -> bool:
        return self.nbytes < flat_nbytes

    def to_bytes(self) -> bytes:
        return self.indices.tobytes() + self.values.tobytes()


def index_dtype(flat_nbytes: int) -> np.dtype:
    """Word indices fit 4 bytes below 16 GiB of weights."""
    return np.dtype("<u4") if flat_nbytes // WORD.itemsize <= 2**32 else np.dtype("<u8")


def compute_delta(base: np.ndarray, new: np.ndarray, *, base_version: int, version: int) -> Delta:
    """The words of ``new`` that differ from ``base`` (both uint8 [N], N a multiple of 4)."""
    assert base.shape == new.shape and base.nbytes % WORD.itemsize == 0
    base_words, new_words = base.view(WORD), new.view(WORD)
    indices = np.flatnonzero(base_words != new_words).astype(index_dtype(base.nbytes))
    return Delta(base_version, version, indices, new_words[indices])


def apply_delta(base: np.ndarray, delta: Delta, *, out: np.ndarray | None = None) -> np.ndarray:
    """``base`` with the delta's words written, in ``out`` (a new buffer by default); ``base`` is untouched."""
    num_words = base.nbytes // WORD.itemsize
    if len(delta.indices) and int(delta.indices.max()) >= num_words:
        raise ValueError(f"delta index {int(delta.indices.max())} is past the {num_words}-word buffer")
    if out is None:
        out = base.copy()
    else:
        np.copyto(out, base)
    out.view(WORD)[delta.indices] = delta.values
    return out


def delta_from_bytes(
    payload: bytes | memoryview, *, num_changed: int, index_bytes: int, base_version: int, version: int
) -> Delta:
    """Inverse of ``Delta.to_bytes``; ValueError when the payload size disagrees with the counts."""
    if index_bytes not in (4, 8):
        raise ValueError(f"index_bytes must be 4 or 8, got {index_bytes}")
    expected = num_changed * (index_bytes + WORD.itemsize)
    if len(payload) != expected:
        raise ValueError(f"delta payload has {len(payload)} bytes, expected {expected}")
    split = num_changed * index_bytes
    indices = np.frombuffer(payload, dtype=f"<u{index_bytes}", count=num_changed)
    values = np.frombuffer(payload, dtype=WORD, count=num_changed, offset=split)
    return Delta(base_version, version, indices, values)
