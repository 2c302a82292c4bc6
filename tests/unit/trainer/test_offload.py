"""The AdamW state off the trainer's device between steps (trainer/offload.py, ``trainer.offload_optimizer``):
the state comes back bit for bit into new storage, the trainer moves it at the right points, and the
steps it takes are the steps it takes without it."""

from __future__ import annotations

import pytest
import torch

from rollbook.config import TrainerConfig
from rollbook.language_models import TinyModelSpec, build_tiny_model
from rollbook.trainer.loop import Trainer
from rollbook.trainer.offload import offload_optimizer, onload_optimizer
from tests.unit.trainer.test_loop import FakeStore


def _stepped_adamw(device: str) -> torch.optim.AdamW:
    """AdamW after two steps on a tiny model on ``device``: exp_avg, exp_avg_sq and step all set."""
    torch.manual_seed(0)
    model = build_tiny_model(TinyModelSpec(vocab_size=16)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.tensor([[1, 2, 3]], device=device)).logits.sum().backward()
        optimizer.step()
    return optimizer


def _state(optimizer: torch.optim.Optimizer) -> dict[tuple[int, str], torch.Tensor]:
    return {(i, k): v for i, s in enumerate(optimizer.state.values()) for k, v in s.items()}


def _check_round_trip(optimizer: torch.optim.Optimizer) -> None:
    before = {key: (t.clone(), t.device, t.data_ptr()) for key, t in _state(optimizer).items()}
    assert {k for _, k in before} == {"exp_avg", "exp_avg_sq", "step"}

    moved = offload_optimizer(optimizer)
    assert len(moved.entries) == len(before) and moved.num_bytes == sum(v.nbytes for v, _, _ in before.values())
    for key, t in _state(optimizer).items():
        value, device, pointer = before[key]
        assert t.device.type == "cpu" and t.data_ptr() != pointer  # fresh host storage, on the CPU too
        assert t.is_pinned() == (device.type == "cuda")
        assert torch.equal(t.cpu(), value.cpu()) and t.dtype == value.dtype and t.stride() == value.stride()

    offloaded = {key: t.data_ptr() for key, t in _state(optimizer).items()}  # alive in ``moved`` until the end
    onload_optimizer(moved)
    for key, t in _state(optimizer).items():
        value, device, _ = before[key]
        # back where it was (``step`` on the CPU), in storage of its own (the original's address may be reused)
        assert t.device == device and t.data_ptr() != offloaded[key]
        assert torch.equal(t, value)


def test_offload_then_onload_gives_back_the_same_bits_in_new_storage_on_the_cpu():
    _check_round_trip(_stepped_adamw("cpu"))


@pytest.mark.gpu
def test_offload_moves_cuda_state_into_pinned_host_memory_and_back():
    optimizer = _stepped_adamw("cuda")
    allocated = torch.cuda.memory_allocated()
    moved = offload_optimizer(optimizer)
    assert torch.cuda.memory_allocated() <= allocated - moved.num_bytes // 2  # exp_avg, exp_avg_sq left the GPU
    onload_optimizer(moved)
    _check_round_trip(optimizer)


def _trainer(tmp_path, store, **overrides) -> Trainer:
    config = TrainerConfig(
        **{"run_dir": str(tmp_path), "num_steps": 3, "num_samples": 4, "model": {"vocab_size": 32}, **overrides}
    )
    torch.manual_seed(0)
    return Trainer(config, store, model=build_tiny_model(TinyModelSpec(vocab_size=32)))


def test_a_trainer_with_offload_takes_exactly_the_steps_it_takes_without_and_reports_the_copies(tmp_path):
    """Three steps on the same batches, offload on and off: the same parameters and losses to the bit.
    The state is off the device after every step and back on it whenever AdamW steps."""
    plain, offloading = _trainer(tmp_path / "a", FakeStore()), _trainer(tmp_path / "b", FakeStore(), offload_optimizer=True)
    on_device_at_update: list[bool] = []
    step = offloading.optimizer.step

    def spying_step(*args, **kwargs):
        on_device_at_update.append(offloading._offloaded is None)
        return step(*args, **kwargs)

    offloading.optimizer.step = spying_step  # type: ignore[method-assign]
    plain_stats, stats = plain.run(), offloading.run()

    assert on_device_at_update == [True, True, True]
    assert offloading._offloaded is not None and len(offloading._offloaded.entries) == 3 * len(list(plain.model.parameters()))
    for a, b in zip(plain.model.parameters(), offloading.model.parameters()):
        assert torch.equal(a, b)
    assert [s["loss/total"] for s in stats] == [s["loss/total"] for s in plain_stats]
    assert stats[0]["perf/onload_s"] == 0.0  # the first step had nothing off the device
    assert all(s["perf/offload_s"] > 0 for s in stats) and all(s["perf/onload_s"] > 0 for s in stats[1:])
    assert not any("perf/offload_s" in s or "perf/onload_s" in s for s in plain_stats)


def test_a_checkpoint_taken_while_offloaded_resumes_into_the_same_training(tmp_path):
    """The checkpoint is written with the state in host memory; a resumed trainer loads it onto the
    device and its next step equals the uninterrupted one's."""
    whole = _trainer(tmp_path / "whole", FakeStore(), offload_optimizer=True, num_steps=3)
    whole.run()
    first = _trainer(tmp_path / "split", FakeStore(), offload_optimizer=True, num_steps=2)
    first.run()
    resumed = _trainer(tmp_path / "split", FakeStore(), offload_optimizer=True, num_steps=3)
    resumed.client.leases = 2  # the fake store's third batch
    resumed.run()
    for a, b in zip(whole.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
