"""The optimizer state off the trainer's device between steps (``trainer.offload_optimizer``).

    moved = offload_optimizer(trainer.optimizer)   # after the step's last optimizer.step()
    ...                                            # between steps: a colocated rollout round has the memory
    onload_optimizer(moved)                        # before the next step's first optimizer.step()

What moves: every tensor of ``optimizer.state`` (AdamW's ``exp_avg``, ``exp_avg_sq`` and ``step``).
Offloading copies each into newly allocated host memory (pinned when it was on CUDA, so the copy
runs by DMA) and the optimizer's state holds the copy from then on: the device memory goes back to
torch's caching allocator, where whatever runs next in the process (a colocated engine's KV cache)
reuses it. Onloading copies each into newly allocated memory on the device it came from (``step``,
which AdamW keeps on the CPU, goes back to the CPU). The values are the same bits both ways. On the
CPU both directions are copies from host memory into new host memory: the same path, nothing
saved, which is why the option is off by default. Sharded state (FSDP2's ``DTensor``s) stays where
it is: each rank holds only its share, and the checkpoint's gather of it is a collective on the
device (trainer/distributed.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rollbook import devices


@dataclass
class Offloaded:
    """The state tensors ``offload_optimizer`` moved: where each is held (a parameter's state dict
    and its key) and the device it came from."""

    entries: list[tuple[dict, str, torch.device]] = field(default_factory=list)

    @property
    def num_bytes(self) -> int:
        return sum(state[key].nbytes for state, key, _ in self.entries)


def offload_optimizer(optimizer: torch.optim.Optimizer) -> Offloaded:
    """Move every (non-sharded) state tensor of ``optimizer`` into new host memory; returns what moved,
    for ``onload_optimizer``. The copies are complete when it returns."""
    moved = Offloaded()
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and not _sharded(value):
                state[key] = _fresh_copy(value, torch.device("cpu"), pin=value.device.type == "cuda")
                moved.entries.append((state, key, value.device))
    _synchronize({device for _, _, device in moved.entries})
    return moved


def onload_optimizer(moved: Offloaded) -> None:
    """Move what ``offload_optimizer`` moved back into new memory on the device each came from; the
    copies are complete when it returns."""
    for state, key, device in moved.entries:
        state[key] = _fresh_copy(state[key], device, pin=False)
    _synchronize({device for _, _, device in moved.entries})


def _fresh_copy(tensor: torch.Tensor, device: torch.device, *, pin: bool) -> torch.Tensor:
    """``tensor``'s values in newly allocated storage on ``device`` (same shape, strides and dtype)."""
    out = torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, device=device, pin_memory=pin)
    # asynchronous between pinned host memory and the GPU; the caller synchronizes
    out.copy_(tensor, non_blocking=pin or tensor.is_pinned())
    return out


def _synchronize(moved_from: set[torch.device]) -> None:
    for device in moved_from:
        devices.synchronize(device)


def _sharded(tensor: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)
