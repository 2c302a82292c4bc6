"""The weight-channel boundary: protocols, the flat layout both transports share, and the checksum.

A weight channel moves policy weights from the trainer to rollout workers. It has two ends:

- ``WeightPublisher`` (trainer end): ``publish(version, state_dict)`` makes ``version`` the newest.
- ``WeightChannel`` (rollout end, what a generation worker holds): ``fetch()`` returns the newest
  published version as a ``WeightSnapshot`` when it is newer than ``channel.version``, else ``None``;
  ``load_into(model, snapshot)`` copies it into a model.

Both transports (``shm.py`` for one host, ``network.py`` across hosts) move one *flat buffer*: every
tensor of the state dict packed back to back, each at a 64-byte aligned offset, described by a
``Layout``. Tensors sharing storage (tied embeddings) share one offset, so they travel once. The
checksum is blake2b-256 over the layout and the flat bytes, so it identifies a version's weights
bit for bit.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import torch

    Buffer = memoryview | np.ndarray  # anything with the buffer protocol, e.g. an mmap slice

ALIGN = 64  # bytes; keeps every tensor aligned for any dtype and the buffer a whole number of words
CHECKSUM_BYTES = 32


class ChecksumMismatch(RuntimeError):
    """Received weights do not hash to the checksum the publisher recorded; they were not applied."""


class TornSnapshot(RuntimeError):
    """The publisher rewrote a shared-memory snapshot while it was being read; fetch again."""


@dataclass(frozen=True)
class TensorSpec:
    """Where one state-dict entry lives in the flat buffer (``offset`` in bytes, ALIGN-aligned)."""

    name: str
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Layout:
    """The ordered tensors of a state dict inside one flat buffer of ``nbytes`` (a multiple of ALIGN)."""

    tensors: tuple[TensorSpec, ...]
    nbytes: int

    @classmethod
    def from_state_dict(cls, state_dict: Mapping[str, "torch.Tensor"]) -> "Layout":
        """Pack in state-dict order; an entry viewing the same storage as an earlier one aliases it.

        Aliasing is decided once, when a channel is created: later state dicts may hold separate
        copies of tied tensors (``pack_into`` checks that they hold the same bits)."""
        specs, seen, offset = [], {}, 0  # type: ignore[var-annotated]  # filled below, types obvious
        for name, t in state_dict.items():
            dtype = str(t.dtype).removeprefix("torch.")
            key = (t.device, t.data_ptr(), dtype, tuple(t.shape), t.stride())
            if t.is_contiguous() and t.numel() > 0 and key in seen:
                specs.append(TensorSpec(name, dtype, tuple(t.shape), seen[key]))
                continue
            seen[key] = offset
            specs.append(TensorSpec(name, dtype, tuple(t.shape), offset))
            offset += _round_up(t.numel() * t.element_size(), ALIGN)
        return cls(tuple(specs), offset)

    def to_json(self) -> bytes:
        """Canonical encoding: equal layouts give equal bytes (it is hashed into the checksum)."""
        rows = [[s.name, s.dtype, list(s.shape), s.offset] for s in self.tensors]
        return json.dumps({"nbytes": self.nbytes, "tensors": rows}, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "Layout":
        obj = json.loads(data)
        specs = tuple(TensorSpec(n, d, tuple(s), o) for n, d, s, o in obj["tensors"])
        return cls(specs, obj["nbytes"])

    def check_matches(self, state_dict: Mapping[str, "torch.Tensor"]) -> None:
        """Raise ValueError naming the first difference between ``state_dict`` and this layout."""
        names = [s.name for s in self.tensors]
        if list(state_dict) != names:
            missing = sorted(set(names) - set(state_dict))
            extra = sorted(set(state_dict) - set(names))
            raise ValueError(
                f"state dict keys differ from the channel layout (missing {missing[:5]}, unexpected "
                f"{extra[:5]}, or reordered); publish the same model the channel was created for"
            )
        for spec in self.tensors:
            t = state_dict[spec.name]
            if str(t.dtype).removeprefix("torch.") != spec.dtype or tuple(t.shape) != spec.shape:
                raise ValueError(f"{spec.name}: got {t.dtype} {tuple(t.shape)}, the channel layout has {spec.dtype} {spec.shape}")


@dataclass(frozen=True)
class WeightSnapshot:
    """One published version as tensors viewing a flat buffer (read them, never write them).

    ``checksum`` is empty when the publisher did not compute one (shared memory with
    ``checksum=False``). Both transports double-buffer instead of allocating per version, so the
    views stay intact until the buffer is reused, at the second update after this one at the
    earliest; ``still_valid()`` turns False from then on. Copy out (``load_into``) before that.
    """

    version: int
    state_dict: dict[str, "torch.Tensor"]
    checksum: bytes
    still_valid: Callable[[], bool] = field(default=lambda: True, repr=False)


class WeightPublisher(Protocol):
    """Trainer end of a weight channel."""

    def publish(self, version: int, state_dict: Mapping[str, "torch.Tensor"]) -> None:
        """Make ``version`` (greater than every earlier one) the newest; copies ``state_dict``."""
        ...

    def close(self) -> None: ...


class WeightChannel(Protocol):
    """Rollout end of a weight channel: what a generation worker holds."""

    @property
    def version(self) -> int:
        """The newest version this end has fetched; -1 before the first."""
        ...

    def fetch(self) -> WeightSnapshot | None:
        """The newest published version if it is newer than ``version`` (and make it ``version``)."""
        ...

    def close(self) -> None: ...


def load_into(model: "torch.nn.Module", snapshot: WeightSnapshot) -> None:
    """Copy a snapshot into ``model`` (strict key match); raise TornSnapshot if it was rewritten meanwhile."""
    model.load_state_dict(snapshot.state_dict, strict=True)
    if not snapshot.still_valid():
        raise TornSnapshot(f"version {snapshot.version} was overwritten during the copy; fetch again")


def checksum(layout: Layout, flat: "Buffer | bytes") -> bytes:
    """blake2b-256 over the canonical layout and the flat bytes (hashlib releases the GIL while hashing)."""
    h = checksum_hasher(layout)
    h.update(flat)  # type: ignore[arg-type]  # numpy arrays are buffers; its stubs say otherwise
    return h.digest()


def checksum_hasher(layout: Layout) -> "hashlib.blake2b":
    """A hashlib object primed with the layout: ``update`` it with the flat bytes in order, in pieces."""
    h = hashlib.blake2b(digest_size=CHECKSUM_BYTES)
    h.update(layout.to_json())
    return h


def tensor_views(layout: Layout, buffer: "Buffer") -> dict[str, "torch.Tensor"]:
    """Tensors over ``buffer`` (``layout.nbytes`` long); no copy."""
    import torch

    views = {}
    for spec in layout.tensors:
        dtype = getattr(torch, spec.dtype)
        if spec.numel == 0:
            views[spec.name] = torch.empty(spec.shape, dtype=dtype)
            continue
        flat = torch.frombuffer(buffer, dtype=dtype, count=spec.numel, offset=spec.offset)
        views[spec.name] = flat.view(spec.shape)
    return views


def pack_into(layout: Layout, state_dict: Mapping[str, "torch.Tensor"], views: Mapping[str, "torch.Tensor"]) -> None:
    """Copy ``state_dict`` into ``views`` (from ``tensor_views``) after checking it fits ``layout``."""
    import torch

    layout.check_matches(state_dict)
    written: dict[int, int] = {}  # offset -> data_ptr of the tensor copied there
    with torch.no_grad():
        for spec in layout.tensors:
            src = state_dict[spec.name].detach()
            if spec.numel == 0:
                continue
            if spec.offset not in written:
                written[spec.offset] = src.data_ptr()
                views[spec.name].copy_(src)
            elif written[spec.offset] != src.data_ptr() and not _same_bits(views[spec.name], src):
                raise ValueError(
                    f"{spec.name} is tied to an earlier tensor in the channel layout but now "
                    f"holds other values; untie it in the model the channel was created for"
                )


def _same_bits(a: "torch.Tensor", b: "torch.Tensor") -> bool:
    import torch

    return torch.equal(a.reshape(-1).view(torch.uint8), b.to(a.device).contiguous().reshape(-1).view(torch.uint8))


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align
