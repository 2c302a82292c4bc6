"""Weight channels: move policy weights from the trainer to rollout workers.

- ``shm``: one host; the trainer writes a double-buffered file in /dev/shm, workers map it (zero copy).
- ``network``: any hosts; a gRPC stream of full copies or deltas against the previous version.
- ``cuda_ipc``: one GPU host; the trainer shares a double-buffered device buffer once through CUDA IPC,
  workers copy from it device to device (no host copy).

Both ends are protocols in ``base`` (``WeightPublisher``, ``WeightChannel``); see docs/design.md,
"Rollout, weights and placement". Benchmark: ``python bench/weights.py --json``.
"""

from rollbook.weights.base import (
    ChecksumMismatch,
    Layout,
    TornSnapshot,
    WeightChannel,
    WeightPublisher,
    WeightSnapshot,
    checksum,
    load_into,
)
from rollbook.weights.cuda_ipc import CudaIpcPublisher, CudaIpcReceiver
from rollbook.weights.network import NetworkPublisher, NetworkReceiver, create_weight_server
from rollbook.weights.shm import SharedMemoryPublisher, SharedMemoryReceiver

__all__ = [
    "ChecksumMismatch",
    "CudaIpcPublisher",
    "CudaIpcReceiver",
    "Layout",
    "NetworkPublisher",
    "NetworkReceiver",
    "SharedMemoryPublisher",
    "SharedMemoryReceiver",
    "TornSnapshot",
    "WeightChannel",
    "WeightPublisher",
    "WeightSnapshot",
    "checksum",
    "create_weight_server",
    "load_into",
]
