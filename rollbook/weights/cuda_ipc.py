"""CUDA IPC weight channel for one GPU host: workers copy the trainer's published weights device to device.

Spec ``cuda-ipc:NAME`` (``rollbook rollout --weights``). The publisher allocates one flat buffer on its
device holding two slots (double buffering), each a ``Layout`` of the template state dict, and shares
it once through CUDA IPC (``torch.multiprocessing.reductions.reduce_tensor``: a ``cudaIpcMemHandle`` of
the allocation, the buffer's offset in it, torch's reference-count slot). A receiver opens the handle
once and builds tensors over the same device memory: a fetch copies nothing, and ``load_into`` copies
device to device into the worker's model. No byte passes through host memory.

What a receiver needs besides the device memory sits in a small control file ``/dev/shm/NAME``
(RAM-backed, mapped by both ends, as ``shm.py`` does)::

    [0, 4096)   control page: int64 words (see _Ctrl): magic, LATEST, a sequence number and a version per slot
    [4096, ...) the Layout as canonical JSON, then the pickled IPC handle (both fixed for the channel's life)

Concurrency is ``shm.py``'s seqlock per slot: ``publish`` makes the spare slot's sequence number odd,
copies the weights into it, waits for the copies to finish on the device (``torch.cuda.synchronize``:
the data must be in device memory before the slot is announced), makes the number even, then points
LATEST at the slot. ``fetch`` reads LATEST and the slot's number and accepts the version only while
that number is the same even value. The views stay intact until the publisher reuses the slot, at the
second publish after it: ``snapshot.still_valid()`` waits for this process's copies on the device, then
checks the sequence number, so ``load_into`` raises ``TornSnapshot`` when the slot was rewritten during
the copy. The ordering argument is ``shm.py``'s (x86-64 store order for the control words).

No checksum: hashing would bring every byte to the host. Device memory has no transport in between to
corrupt it, and the seqlock rules out torn reads. The views are writable (CUDA IPC maps read-write): a
worker must only read them.

The handle names the GPU by UUID, not by index, so the two ends may see different
``CUDA_VISIBLE_DEVICES`` as long as the receiver sees the publisher's GPU; if the receiver's model lives
on another GPU, ``load_into`` copies between the two (peer to peer where the GPUs allow it). Opening a
handle in the process that exported it is not possible in CUDA, so a receiver in the publisher's own
process uses the publisher's buffer directly. A publisher that exited leaves its control file behind;
a receiver refuses it (``FileNotFoundError``, so ``rollbook rollout`` waits for a live publisher): the
publisher holds an exclusive ``flock`` on the file while it lives.
torch counts one consumer per export; the buffer lives as long as the publisher, so several receivers
are safe while it runs. Memory: two copies of the published weights on the trainer's GPU. A trainer
whose allocator uses expandable segments (``PYTORCH_CUDA_ALLOC_CONF``) exports the buffer the way torch
exports those, which the receiver's torch and kernel must support.

On the CPU the same code runs over torch's shared memory instead (a tensor shared with
``torch.multiprocessing``'s ``file_system`` strategy, which any process on the host can open by name):
that is how the unit tests exercise it without a GPU. On a CPU-only host ``shm:NAME`` is the better
channel (mapped read-only, optionally checksummed).

Run a producer/consumer pair: see tests/unit/test_weights_cuda_ipc.py (a spawned process opens it).
Measured against the other channels by ``python bench/weights.py --device cuda``.
"""

from __future__ import annotations

import fcntl
import io
import mmap
import os
import pickle
import time
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from rollbook.weights.base import Layout, TornSnapshot, WeightSnapshot, pack_into
from rollbook.weights.shm import MAX_TRIES, PAGE, SHM_DIR, _path

if TYPE_CHECKING:  # pragma: no cover
    import torch

MAGIC = 0x52424B4355495031  # "RBKCUIP1": bump the last digit when the control file changes
_DEVICE_ARG = 6  # rebuild_cuda_tensor's storage_device argument, the GPU's index (a UUID in the file)
_LOCAL: dict[str, weakref.ref] = {}  # path -> the flat buffer of a publisher in this process


class _Ctrl:
    """Indices of the int64 words in the control page."""

    MAGIC, LAYOUT_BYTES, LATEST, HANDLE_BYTES, SLOT_STRIDE, PID, CLOSED = 0, 1, 2, 3, 4, 5, 6
    SEQ = (8, 10)  # per slot: odd while being written
    VERSION = (9, 11)  # per slot: -1 until first written


class CudaIpcPublisher:
    """Trainer end. Allocates the two slots on ``device`` (default: the template's) and creates
    ``/dev/shm/<name>`` for receivers; ``template`` is a state dict of the model to publish."""

    def __init__(
        self,
        name: str,
        template: Mapping[str, torch.Tensor],
        *,
        device: str | torch.device | None = None,
        shm_dir: str = SHM_DIR,
    ) -> None:
        import torch

        self.name, self.layout = name, Layout.from_state_dict(template)
        self.path = _path(shm_dir, name)
        self.device = torch.device(device) if device is not None else _device_of(template)
        if self.device.type not in ("cuda", "cpu"):
            raise ValueError(f"CUDA IPC shares CUDA (or, for tests, CPU) memory, not {self.device}")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._stride = _round_up(max(self.layout.nbytes, 1), PAGE)
        self._flat = torch.zeros(2 * self._stride, dtype=torch.uint8, device=self.device)  # zeroed padding
        handle = _export(self._flat)  # before the views: on the CPU this moves the storage into shared memory
        self._slots = [device_views(self.layout, self._flat, i * self._stride) for i in (0, 1)]
        self._version = -1
        self._mm, self._ctrl, self._lock_fd = _create(self.path, self.layout, handle, self._stride)
        _LOCAL[self.path] = weakref.ref(self._flat)

    @property
    def version(self) -> int:
        return self._version

    def publish(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> None:
        if self._ctrl is None:
            raise RuntimeError(f"{self.path}: the publisher is closed")
        if version <= self._version:
            raise ValueError(f"version {version} is not newer than the published {self._version}")
        i = 1 - int(self._ctrl[_Ctrl.LATEST])
        seq = int(self._ctrl[_Ctrl.SEQ[i]])
        self._ctrl[_Ctrl.SEQ[i]] = seq + 1  # odd: readers of slot i retry
        pack_into(self.layout, _shared_ties(self.layout, state_dict), self._slots[i])
        _synchronize(self.device)  # in device memory before any receiver is told
        self._ctrl[_Ctrl.VERSION[i]] = version
        self._ctrl[_Ctrl.SEQ[i]] = seq + 2
        self._ctrl[_Ctrl.LATEST] = i
        self._version = version

    def close(self) -> None:
        """Tell receivers to stop reading, remove the file and drop the buffer (torch keeps device
        memory a receiver still maps until it lets go)."""
        if self._ctrl is None:
            return
        self._ctrl[_Ctrl.CLOSED] = 1
        _LOCAL.pop(self.path, None)
        try:
            if os.fstat(self._lock_fd).st_ino == os.stat(self.path).st_ino:
                os.unlink(self.path)
        except FileNotFoundError:  # removed by hand
            pass
        os.close(self._lock_fd)
        self._mm = self._ctrl = self._slots = self._flat = None  # type: ignore[assignment]


class CudaIpcReceiver:
    """Rollout end. Opens the publisher's buffer once; ``fetch`` returns views over it on the
    publisher's GPU (no copy), ``load_into`` copies them into a model."""

    def __init__(self, name: str, *, shm_dir: str = SHM_DIR) -> None:
        self.path = _path(shm_dir, name)
        self._version = -1
        self._mm, self._ctrl, self.layout, handle = _attach(self.path)
        local = _LOCAL.get(self.path)
        flat = local() if local is not None and int(self._ctrl[_Ctrl.PID]) == os.getpid() else None
        self._flat = flat if flat is not None else _import(handle)
        self.device = self._flat.device
        stride = int(self._ctrl[_Ctrl.SLOT_STRIDE])
        self._slots = [device_views(self.layout, self._flat, i * stride) for i in (0, 1)]

    @property
    def version(self) -> int:
        return self._version

    def fetch(self) -> WeightSnapshot | None:
        if self._ctrl is None or self._ctrl[_Ctrl.CLOSED]:
            return None  # the publisher closed: nothing newer will come through this channel
        for _ in range(MAX_TRIES):
            i = int(self._ctrl[_Ctrl.LATEST])
            seq = int(self._ctrl[_Ctrl.SEQ[i]])
            if seq % 2 == 1:  # the publisher lapped us and is rewriting this slot
                time.sleep(0)
                continue
            version = int(self._ctrl[_Ctrl.VERSION[i]])
            if int(self._ctrl[_Ctrl.SEQ[i]]) != seq:
                continue
            if version <= self._version:
                return None
            self._version = version
            return WeightSnapshot(version, dict(self._slots[i]), b"", still_valid=self._validator(i, seq))
        raise TornSnapshot(f"{self.path}: the publisher kept rewriting; gave up after {MAX_TRIES} tries")

    def close(self) -> None:
        """Drop this end's references; the device memory is let go once no snapshot view is left."""
        self._mm = self._ctrl = self._slots = self._flat = None  # type: ignore[assignment]

    def _validator(self, i: int, seq: int):
        ctrl, device = self._ctrl, self.device

        def still_valid() -> bool:
            _synchronize(device)  # this process's copies out of the slot are done before we look
            return int(ctrl[_Ctrl.SEQ[i]]) == seq and not ctrl[_Ctrl.CLOSED]

        return still_valid


def device_views(layout: Layout, flat: torch.Tensor, start: int = 0) -> dict[str, torch.Tensor]:
    """Tensors over the uint8 tensor ``flat`` from byte ``start`` on, on its device; no copy."""
    import torch

    views = {}
    for spec in layout.tensors:
        dtype = getattr(torch, spec.dtype)
        if spec.numel == 0:
            views[spec.name] = torch.empty(spec.shape, dtype=dtype, device=flat.device)
            continue
        begin = start + spec.offset
        views[spec.name] = flat[begin : begin + spec.numel * dtype.itemsize].view(dtype).view(spec.shape)
    return views


def _shared_ties(layout: Layout, state_dict: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """Separate but equal copies of tensors the layout ties (a dtype cast makes them) replaced by the
    first, compared here on their device: ``pack_into`` would compare them on the host."""
    import torch

    first: dict[int, torch.Tensor] = {}
    out: dict[str, torch.Tensor] | None = None
    for spec in layout.tensors:
        t = state_dict.get(spec.name)
        if t is None or spec.numel == 0:
            continue
        f = first.setdefault(spec.offset, t)
        if f is t or f.data_ptr() == t.data_ptr() or f.shape != t.shape or f.dtype != t.dtype:
            continue  # the same tensor, or a mismatch check_matches reports
        same = torch.equal(_bytes(f), _bytes(t.to(f.device)))
        if not same:
            raise ValueError(
                f"{spec.name} is tied to an earlier tensor in the channel layout but now "
                f"holds other values; untie it in the model the channel was created for"
            )
        out = dict(state_dict) if out is None else out
        out[spec.name] = f
    return state_dict if out is None else out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _device_of(template: Mapping[str, torch.Tensor]) -> torch.device:
    import torch

    for t in template.values():
        return t.device
    return torch.device("cpu")


def _synchronize(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        if torch.cuda.current_device() != device.index:  # a model on another GPU copies on that one
            torch.cuda.synchronize()


def _export(flat: torch.Tensor) -> bytes:
    """What another process needs to open ``flat``: the CUDA IPC handle (its GPU by UUID), or on the
    CPU the shared-memory file torch moved it into."""
    from torch.multiprocessing.reductions import reduce_tensor

    if flat.is_cuda:
        _, args = reduce_tensor(flat)
        args = (*args[:_DEVICE_ARG], _gpu_uuid(args[_DEVICE_ARG]), *args[_DEVICE_ARG + 1 :])
        return pickle.dumps(("cuda", args))
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as tmp

    buf = io.BytesIO()
    strategy = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")  # a file any process can open by name, not a descriptor
    try:
        ForkingPickler(buf).dump(flat)  # reduce_tensor, through torch's registered reductions
    finally:
        tmp.set_sharing_strategy(strategy)
    return pickle.dumps(("cpu", buf.getvalue()))


def _import(handle: bytes) -> torch.Tensor:
    """The publisher's flat buffer in this process, over the same memory."""
    kind, payload = pickle.loads(handle)  # noqa: S301  # written by the publisher, a file of this user
    if kind == "cpu":
        flat = pickle.loads(payload)  # noqa: S301
        flat.untyped_storage()._shared_incref()  # the load consumed the export's reference: keep one for the next receiver
        return flat
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = (*payload[:_DEVICE_ARG], _gpu_index(payload[_DEVICE_ARG]), *payload[_DEVICE_ARG + 1 :])
    return rebuild_cuda_tensor(*args)


def _gpu_uuid(index: int | str) -> str:
    import torch

    if isinstance(index, str):  # already a UUID (a library that patches torch's reductions does this)
        return index
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return str(uuid) if uuid is not None else str(index)


def _gpu_index(uuid: str) -> int:
    import torch

    for i in range(torch.cuda.device_count()):
        if str(getattr(torch.cuda.get_device_properties(i), "uuid", i)) == uuid:
            return i
    if uuid.isdigit():
        return int(uuid)
    raise RuntimeError(
        f"the publisher's GPU {uuid} is not visible to this process (CUDA_VISIBLE_DEVICES); "
        "CUDA IPC shares memory between processes on one GPU host"
    )


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def _create(path: str, layout: Layout, handle: bytes, stride: int) -> tuple[mmap.mmap, np.ndarray, int]:
    """Write the file under a temporary name and rename it, so receivers never see it half made.
    Returns its mapping, the control words and a descriptor holding an exclusive ``flock`` on it for as
    long as the publisher lives (the kernel drops it when the process ends, however it ends)."""
    text = layout.to_json()
    size = PAGE + len(text) + len(handle)
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        raise
    ctrl = np.ndarray((PAGE // 8,), dtype=np.int64, buffer=mm)
    mm[PAGE : PAGE + len(text)] = text
    mm[PAGE + len(text) : size] = handle
    ctrl[_Ctrl.LAYOUT_BYTES], ctrl[_Ctrl.HANDLE_BYTES], ctrl[_Ctrl.SLOT_STRIDE] = len(text), len(handle), stride
    ctrl[_Ctrl.PID], ctrl[_Ctrl.LATEST] = os.getpid(), 0
    ctrl[list(_Ctrl.VERSION)] = -1
    ctrl[_Ctrl.MAGIC] = MAGIC
    os.rename(tmp, path)  # replaces a stale file of a crashed run with the same name
    return mm, ctrl, fd


def _attach(path: str) -> tuple[mmap.mmap, np.ndarray, Layout, bytes]:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise FileNotFoundError(f"no CUDA IPC weights at {path}; start the publisher first") from None
    try:
        mm = mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ)
        alive = _locked(fd)
    finally:
        os.close(fd)
    ctrl = np.ndarray((PAGE // 8,), dtype=np.int64, buffer=mm)
    if ctrl[_Ctrl.MAGIC] != MAGIC:
        raise ValueError(f"{path} is not a rollbook CUDA IPC weight channel of this format (magic {int(ctrl[0]):#x})")
    pid = int(ctrl[_Ctrl.PID])
    if ctrl[_Ctrl.CLOSED] or not alive:
        raise FileNotFoundError(f"{path} was left by a publisher (pid {pid}) that is gone; start the publisher again")
    n, h = int(ctrl[_Ctrl.LAYOUT_BYTES]), int(ctrl[_Ctrl.HANDLE_BYTES])
    return mm, ctrl, Layout.from_json(mm[PAGE : PAGE + n]), bytes(mm[PAGE + n : PAGE + n + h])


def _locked(fd: int) -> bool:
    """Whether a publisher holds the file's lock, i.e. is alive (in any PID namespace)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False
