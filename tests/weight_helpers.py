"""Helpers shared by the weight-channel tests (unit and integration): bit-exact comparison of state
dicts and one AdamW step on the tiny model."""

from __future__ import annotations

import torch

from rollbook.language_models import TinyModelSpec

SPEC = TinyModelSpec(vocab_size=128)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes of a tensor, so -0.0 != 0.0 and NaN payloads compare exactly."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bit_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert torch.equal(bits(got[name]), bits(want[name])), name


def adamw_step(model: torch.nn.Module, *, train_only: str | None = None, seed: int = 0) -> None:
    """One AdamW step on a random batch; with ``train_only``, parameters whose name lacks it are
    frozen (a sparse delta)."""
    for name, p in model.named_parameters():
        p.requires_grad_(train_only is None or train_only in name)
    torch.manual_seed(seed)
    ids = torch.randint(0, SPEC.vocab_size, (2, 8))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.01)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    model.zero_grad()
