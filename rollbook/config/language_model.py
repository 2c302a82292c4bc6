"""The student's architecture, or the local directory it loads from: one ``ModelConfig`` for the
trainer, the rollout worker and the proxy (``[trainer.model]``, ``--model.*``), which all build the
same student with ``rollbook.language_models.build_student``."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


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
