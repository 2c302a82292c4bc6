"""Shared-memory weight channel for one host: the trainer writes, workers map the same pages.

The publisher owns a file in ``/dev/shm`` (RAM-backed). Receivers map it read-only and build tensors
as views over it with ``torch.frombuffer``: fetching a version copies nothing, and a worker cannot
scribble on the trainer's weights (a write through a view is a SIGSEGV in the worker). Linux only.
A new publisher with the same name replaces the file; receivers of the old one must reopen.

File layout (byte offsets)::

    [0, 4096)        control page: int64 words (see _Ctrl) and one checksum per slot
    [4096, ...)      the Layout as canonical JSON (fixed for the life of the channel)
    slot 0, slot 1   two flat buffers, page aligned: double buffering

Concurrency: one publisher, any number of receivers, a seqlock per slot. ``publish`` writes into the
slot that is *not* the latest: it makes the slot's sequence number odd, copies the weights and
header, makes it even, then points LATEST at it. ``fetch`` reads LATEST and the slot's sequence
number, reads the header (and hashes the data when verifying), and accepts only if the sequence number
is still the same even value. So a receiver never returns a half-written version, and its views stay
intact until the publisher reuses that slot, i.e. until the *second* publish after it:
``snapshot.still_valid()`` answers whether that happened (seqlock validate), and ``load_into``
raises ``TornSnapshot`` when it happened during the copy. A worker that takes longer than one
publish interval to copy or use its views must check it.
The ordering argument relies on the CPU not reordering the stores of ``publish`` as seen by another
core, which holds on x86-64 (TSO); aarch64 offers no such guarantee to Python code.

Run a producer/consumer pair: see tests/unit/test_weights.py (a spawned process maps it).
"""

from __future__ import annotations

import mmap
import os
import time
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from rollbook.weights.base import (
    CHECKSUM_BYTES,
    ChecksumMismatch,
    Layout,
    TornSnapshot,
    WeightSnapshot,
    checksum,
    pack_into,
    tensor_views,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch

SHM_DIR = "/dev/shm"
PAGE = 4096
MAGIC = 0x52424B5745494731  # "RBKWEIG1": bump the last digit when the file layout changes
MAX_TRIES = 100_000  # a reader retries only while the publisher laps it; this bounds a livelock


class _Ctrl:
    """Indices of the int64 words in the control page."""

    MAGIC, LAYOUT_BYTES, LATEST, HAS_CHECKSUM = 0, 1, 2, 3
    SEQ = (8, 10)  # per slot: odd while being written
    VERSION = (9, 11)  # per slot: -1 until first written
    CHECKSUM_AT = 256  # byte offset of slot 0's digest; slot 1's follows


class SharedMemoryPublisher:
    """Trainer end. Creates ``/dev/shm/<name>`` sized for ``template`` (a state dict of the model)."""

    def __init__(
        self, name: str, template: Mapping[str, "torch.Tensor"], *, checksum: bool = False, shm_dir: str = SHM_DIR
    ) -> None:
        """``checksum=True`` hashes every version (blake2b, several times a memcpy) so receivers can
        verify it; off by default because same-host memory has no transport to corrupt it and the
        seqlock already rules out torn reads."""
        self.name, self.layout = name, Layout.from_state_dict(template)
        self.path = _path(shm_dir, name)
        self._checksum = checksum
        self._version = -1
        self._mm, self._ctrl = _create(self.path, self.layout, checksum)
        self._bufs = _slot_buffers(self._mm, self.layout)
        self._slots = [tensor_views(self.layout, buf) for buf in self._bufs]

    def publish(self, version: int, state_dict: Mapping[str, "torch.Tensor"]) -> None:
        if version <= self._version:
            raise ValueError(f"version {version} is not newer than the published {self._version}")
        i = 1 - int(self._ctrl[_Ctrl.LATEST])
        seq = int(self._ctrl[_Ctrl.SEQ[i]])
        self._ctrl[_Ctrl.SEQ[i]] = seq + 1  # odd: readers of slot i retry
        pack_into(self.layout, state_dict, self._slots[i])
        if self._checksum:
            digest = checksum(self.layout, self._bufs[i])
            at = _Ctrl.CHECKSUM_AT + i * CHECKSUM_BYTES
            self._mm[at : at + CHECKSUM_BYTES] = digest
        self._ctrl[_Ctrl.VERSION[i]] = version
        self._ctrl[_Ctrl.SEQ[i]] = seq + 2
        self._ctrl[_Ctrl.LATEST] = i
        self._version = version

    def close(self) -> None:
        """Remove the file; receivers that mapped it keep their mapping until they drop it."""
        if self._mm is None:
            return
        os.unlink(self.path)
        # Never mmap.close(): tensors from torch.frombuffer would dangle. Dropping the last
        # reference unmaps once no view is left.
        self._mm = self._ctrl = self._bufs = self._slots = None


class SharedMemoryReceiver:
    """Rollout end. Maps ``/dev/shm/<name>`` read-only; ``fetch`` returns views, never copies."""

    def __init__(self, name: str, *, verify: bool = True, shm_dir: str = SHM_DIR) -> None:
        """``verify`` checks each fetched version against its checksum when the publisher wrote one."""
        self.path = _path(shm_dir, name)
        self._verify = verify
        self._version = -1
        self._mm, self._ctrl, self.layout = _attach(self.path)
        self._bufs = _slot_buffers(self._mm, self.layout)
        with warnings.catch_warnings():  # the mapping is read-only on purpose; torch warns about it
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            self._slots = [tensor_views(self.layout, buf) for buf in self._bufs]

    @property
    def version(self) -> int:
        return self._version

    def fetch(self) -> WeightSnapshot | None:
        for _ in range(MAX_TRIES):
            i = int(self._ctrl[_Ctrl.LATEST])
            seq = int(self._ctrl[_Ctrl.SEQ[i]])
            if seq % 2 == 1:  # the publisher lapped us and is rewriting this slot
                time.sleep(0)
                continue
            snapshot = self._read_slot(i, seq)
            if int(self._ctrl[_Ctrl.SEQ[i]]) != seq:
                continue
            if snapshot is not None:
                self._version = snapshot.version
            return snapshot
        raise TornSnapshot(f"{self.path}: the publisher kept rewriting; gave up after {MAX_TRIES} tries")

    def close(self) -> None:
        """Drop this end's references; the pages unmap once no snapshot view is left."""
        self._mm = self._ctrl = self._bufs = self._slots = None

    def _read_slot(self, i: int, seq: int) -> WeightSnapshot | None:
        """The slot's version if newer than ours (caller validates ``seq`` afterwards)."""
        version = int(self._ctrl[_Ctrl.VERSION[i]])
        if version <= self._version:
            return None
        digest = b""
        if self._ctrl[_Ctrl.HAS_CHECKSUM]:
            at = _Ctrl.CHECKSUM_AT + i * CHECKSUM_BYTES
            digest = bytes(self._mm[at : at + CHECKSUM_BYTES])
            if self._verify and checksum(self.layout, self._bufs[i]) != digest:
                if int(self._ctrl[_Ctrl.SEQ[i]]) == seq:
                    raise ChecksumMismatch(f"{self.path}: version {version} does not match its checksum")
        ctrl = self._ctrl
        return WeightSnapshot(version, dict(self._slots[i]), digest, still_valid=lambda: int(ctrl[_Ctrl.SEQ[i]]) == seq)


def _path(shm_dir: str, name: str) -> str:
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"shared-memory name must be a plain file name, got {name!r}")
    return os.path.join(shm_dir, name)


def _offsets(layout: Layout) -> tuple[int, int]:
    """(offset of slot 0, distance between slots), both page aligned."""
    first = -(-(PAGE + len(layout.to_json())) // PAGE) * PAGE
    return first, -(-max(layout.nbytes, 1) // PAGE) * PAGE


def _slot_buffers(mm: mmap.mmap, layout: Layout) -> list[memoryview]:
    first, stride = _offsets(layout)
    return [memoryview(mm)[first + i * stride : first + i * stride + layout.nbytes] for i in (0, 1)]


def _create(path: str, layout: Layout, has_checksum: bool) -> tuple[mmap.mmap, np.ndarray]:
    """Write the file under a temporary name and rename it, so receivers never see it half made."""
    text = layout.to_json()
    first, stride = _offsets(layout)
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, first + 2 * stride)
        mm = mmap.mmap(fd, first + 2 * stride)
    finally:
        os.close(fd)
    ctrl = np.ndarray((PAGE // 8,), dtype=np.int64, buffer=mm)
    mm[PAGE : PAGE + len(text)] = text
    ctrl[_Ctrl.LAYOUT_BYTES], ctrl[_Ctrl.LATEST] = len(text), 0
    ctrl[_Ctrl.HAS_CHECKSUM] = int(has_checksum)
    ctrl[list(_Ctrl.VERSION)] = -1
    ctrl[_Ctrl.MAGIC] = MAGIC
    os.rename(tmp, path)  # replaces a stale file of a crashed run with the same name
    return mm, ctrl


def _attach(path: str) -> tuple[mmap.mmap, np.ndarray, Layout]:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise FileNotFoundError(f"no shared-memory weights at {path}; start the publisher first") from None
    try:
        mm = mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    ctrl = np.ndarray((PAGE // 8,), dtype=np.int64, buffer=mm)
    if ctrl[_Ctrl.MAGIC] != MAGIC:
        raise ValueError(f"{path} is not a rollbook weight buffer of this format (magic {int(ctrl[0]):#x})")
    n = int(ctrl[_Ctrl.LAYOUT_BYTES])
    return mm, ctrl, Layout.from_json(mm[PAGE : PAGE + n])
