"""The student's architecture, or the local directory it loads from: one ``ModelConfig`` for the
trainer, the rollout worker and the proxy (``[trainer.model]``, ``--model.*``), which all build the
same student with ``rollbook.language_models.build_student``."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

DEVICE_PATTERN = r"^(auto|cpu|cuda(:[0-9]+)?|npu(:[0-9]+)?)$"
"""What a ``device`` field takes: ``auto`` (CUDA when torch sees it, then an Ascend NPU when torch_npu is
installed and sees one, else the CPU), ``cpu``, ``cuda``, ``cuda:N``, ``npu``, ``npu:N``. That the device
exists is checked where a model is placed (``rollbook.devices.resolve_device``): one line, exit 2."""

Dtype = Literal["float32", "bfloat16"]
"""What a ``dtype`` field takes: the compute precision of a model's forward passes."""


def device_field(what: str) -> Any:
    """The ``device`` field of a config section whose models run on it (``what`` says which)."""
    return Field("auto", pattern=DEVICE_PATTERN, description=f"Device of {what}: auto, cpu, cuda, cuda:N, npu, npu:N.")


def dtype_field(what: str, detail: str) -> Any:
    """The ``dtype`` field of a config section (``what``: its models; ``detail``: how it applies there)."""
    return Field("float32", description=f"Precision of {what}: float32 or bfloat16. {detail}")


class ModelConfig(BaseModel):
    """The student's architecture (or where to load it): built alike by the trainer and by a rollout
    worker before its first weights arrive."""

    model_config = ConfigDict(extra="forbid")

    path: str | None = Field(
        None,
        description="Local Hugging Face directory of the student (config.json + weights, e.g. saved with "
        "save_pretrained; nothing is downloaded): the trainer and the rollout worker load the same directory and its "
        "config.json vocab_size is what the store registers. None builds a tiny model from the fields below.",
    )
    vocab_size: int | None = Field(
        None, ge=2, description="Tiny model: vocabulary size; None = the task tokenizer's (rollbook/tasks.py). Ignored with path."
    )
    hidden_size: int = Field(64, ge=8, description="Tiny model: hidden size.")
    num_layers: int = Field(2, ge=1, description="Tiny model: number of decoder layers.")
    num_heads: int = Field(4, ge=1, description="Tiny model: attention heads.")
    num_kv_heads: int = Field(2, ge=1, description="Tiny model: key/value heads (grouped-query attention).")
    intermediate_size: int = Field(128, ge=8, description="Tiny model: MLP width.")
    seed: int = Field(0, description="Initialisation seed of the tiny model.")
