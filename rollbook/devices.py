"""Where a model runs and in what precision: the ``device`` and ``dtype`` fields of the trainer
(``[trainer]``), the rollout side (``[rollout]``, which the worker, the colocated engine and the
evaluators read) and the proxy (``rollbook proxy``), or once for a whole run (``device``/``dtype`` at
the top of a ``rollbook run`` config).

    device = resolve_device("auto")                     # cuda when torch sees it, else npu, else cpu
    dtype = resolve_dtype("bfloat16", device)           # refused where the device cannot compute in it
    engine_model = place(build_student(m), "cuda:0", "bfloat16")      # an inference copy, all bf16
    with autocast(device, "bfloat16"):                  # the trainer's forward passes (fp32 master weights)
        loss = ...

Precision: a model that is only run forward (the rollout engine, teachers, the KL reference) is held in
the dtype itself. The trained student keeps float32 master weights (and so float32 gradients and
AdamW state) and runs its forward passes under ``torch.autocast`` to the dtype, the usual mixed
precision: matmuls in bfloat16, reductions such as the norms' in float32, and the packed log-probs
are taken in float32 from the logits (trainer/packing.py). The weights the trainer publishes and
the Hugging Face exports it writes are cast to the dtype, so a bfloat16 run ships bfloat16.

A wrong setting is a ``ConfigError``: one line, exit 2 (``cuda`` without CUDA, ``npu`` without
torch_npu, ``cuda:3`` on a machine with two, ``bfloat16`` on a GPU without it). torch and torch_npu
are imported here lazily: the configs that name a device import none of this.
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING

from rollbook.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    import torch

DTYPES = ("float32", "bfloat16")


def resolve_device(name: str) -> torch.device:
    """The ``torch.device`` a ``device`` field names, checked to exist here; ``auto`` is CUDA when torch
    sees a GPU, else an Ascend NPU when torch_npu is installed and sees one, else the CPU."""
    import torch

    kind, _, index = name.partition(":")
    if kind == "auto" and not index:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        if _npu_available(quiet=True):
            return torch.device("npu", 0)
        return torch.device("cpu")
    if kind == "cpu" and not index:
        return torch.device("cpu")
    if kind == "cuda":
        if not torch.cuda.is_available():
            built = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            raise ConfigError(
                f"device {name!r}: torch {torch.__version__} ({built}) sees no CUDA device; use device = 'cpu' or 'auto'"
            )
        return _indexed(
            torch.device("cuda", int(index) if index else torch.cuda.current_device()), torch.cuda.device_count(), name
        )
    if kind == "npu":
        _npu_available(quiet=False)
        return _indexed(torch.device("npu", int(index) if index else 0), torch.npu.device_count(), name)  # type: ignore[attr-defined]  # torch_npu adds torch.npu
    raise ConfigError(f"device {name!r}: expected auto, cpu, cuda, cuda:N, npu or npu:N")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The ``torch.dtype`` a ``dtype`` field names, checked to be one ``device`` can compute in."""
    import torch

    if name not in DTYPES:
        raise ConfigError(f"dtype {name!r}: expected one of {', '.join(DTYPES)}")
    dtype = getattr(torch, name)
    if dtype is torch.bfloat16:
        if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
            gpu = torch.cuda.get_device_name(device)
            raise ConfigError(f"dtype 'bfloat16': {gpu} ({device}) has no bfloat16 arithmetic; use dtype = 'float32'")
        if device.type == "npu" and not _npu_bf16(device):
            raise ConfigError(f"dtype 'bfloat16': the NPU at {device} has no bfloat16 arithmetic; use dtype = 'float32'")
    return dtype


def check(device: str, dtype: str) -> None:
    """Refuse a device or dtype this machine cannot give (a ``ConfigError``); a command calls it on
    its settings before it starts anything, so a bad one costs nothing."""
    resolve_dtype(dtype, resolve_device(device))


def place(model: torch.nn.Module, device: str | torch.device, dtype: str) -> torch.nn.Module:
    """``model`` moved to ``device`` and cast to ``dtype`` (floating parameters and buffers), in place;
    for a model that only runs forward (engine, teacher, reference)."""
    where = resolve_device(device) if isinstance(device, str) else device
    return model.to(device=where, dtype=resolve_dtype(dtype, where))


def place_trained(model: torch.nn.Module, device: str | torch.device) -> torch.nn.Module:
    """The trained student on ``device``, its master weights float32 whatever the dtype of its forward
    passes (``autocast``)."""
    import torch

    where = resolve_device(device) if isinstance(device, str) else device
    return model.to(device=where, dtype=torch.float32)


def autocast(device: torch.device, dtype: str) -> contextlib.AbstractContextManager:
    """The context of a trained model's forward passes: ``torch.autocast`` to ``dtype`` on the
    device's type, or nothing at float32.

    Its cast cache is off: one context spans a whole update, and a cached bfloat16 copy of a weight
    would outlive an optimizer step (the next minibatch's forward on the old weights) and, under
    FSDP2, a unit's re-gathered parameters (a no-grad pass's copy standing in for the next pass's,
    which then has no gradient to the weights). Each forward casts the weights anew."""
    import torch

    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=getattr(torch, dtype), cache_enabled=False)


def cast_floating(state: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    """A state dict with its floating tensors in ``dtype`` (the others as they are); the tensors
    themselves when they already are."""
    import torch

    target = getattr(torch, dtype)
    return {k: v.to(target) if v.is_floating_point() and v.dtype != target else v for k, v in state.items()}


def synchronize(device: torch.device) -> None:
    """Wait until the work queued on ``device`` is done (so a time measured around it is the work's, and
    host memory it copies into can be read); nothing to wait for on the CPU."""
    import torch

    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def _indexed(device: torch.device, count: int, name: str) -> torch.device:
    if device.index is not None and device.index >= count:
        raise ConfigError(f"device {name!r}: this machine has {count} such device(s) (0 to {count - 1})")
    return device


@functools.cache
def _npu_import() -> str | None:
    """None when torch_npu imports, else why not."""
    try:
        import torch_npu  # noqa: F401  # registers torch.npu
    except ImportError as exc:
        missing = exc.name or "torch_npu"
        return "torch_npu is not installed" if missing == "torch_npu" else f"torch_npu needs {missing}, which is not installed"
    except Exception as exc:  # noqa: BLE001 - a broken CANN install raises anything; say it in one line
        return f"torch_npu failed to import: {' '.join(str(exc).split())}"
    return None


def _npu_available(*, quiet: bool) -> bool:
    import torch

    why = _npu_import()
    if why is None and torch.npu.is_available():  # type: ignore[attr-defined]  # torch_npu adds torch.npu
        return True
    if quiet:
        return False
    raise ConfigError(f"device 'npu': {why or 'torch_npu sees no NPU'}; use device = 'cpu' or 'auto'")


def _npu_bf16(device: torch.device) -> bool:
    import torch

    supported = getattr(torch.npu, "is_bf16_supported", None)  # type: ignore[attr-defined]
    return bool(supported()) if supported is not None else True
