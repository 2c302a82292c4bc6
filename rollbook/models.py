"""Causal language models for the trainer, the rollout engine and teachers.

``ModelConfig`` and ``build_student`` are shared by the trainer and the rollout worker (both build
the same student), so they live here, below both (``docs/design.md``, "What each folder may import").
Models are Hugging Face ``transformers`` causal LMs, either loaded from a local directory or built
from a tiny config in code; nothing is ever downloaded. torch and transformers are imported lazily so
that the CLI and the store never pay for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import PreTrainedModel


class ModelConfig(BaseModel):
    """The student's architecture (or where to load it): built alike by the trainer and by a rollout
    worker before its first weights arrive."""

    model_config = ConfigDict(extra="forbid")

    path: str | None = Field(None, description="Local directory of a transformers causal LM; None builds a tiny model from the fields below.")
    vocab_size: int | None = Field(None, ge=2, description="Tiny model: vocabulary size; None = the task tokenizer's (rollbook/tasks.py).")
    hidden_size: int = Field(64, ge=8, description="Tiny model: hidden size.")
    num_layers: int = Field(2, ge=1, description="Tiny model: number of decoder layers.")
    num_heads: int = Field(4, ge=1, description="Tiny model: attention heads.")
    num_kv_heads: int = Field(2, ge=1, description="Tiny model: key/value heads (grouped-query attention).")
    intermediate_size: int = Field(128, ge=8, description="Tiny model: MLP width.")
    seed: int = Field(0, description="Initialisation seed of the tiny model.")


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of a tiny Llama-style model that trains on CPU in seconds."""

    vocab_size: int
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = True


def build_tiny_model(spec: TinyModelSpec, *, seed: int = 0, dtype: "torch.dtype | None" = None) -> "PreTrainedModel":
    """A freshly initialised ``LlamaForCausalLM`` of the given shape (fp32 by default, eager/sdpa)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        intermediate_size=spec.intermediate_size,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    return model.to(dtype or torch.float32)  # type: ignore[arg-type]  # transformers' decorator hides nn.Module.to(dtype)


def load_model(path: str, *, dtype: "torch.dtype | None" = None) -> "PreTrainedModel":
    """Load a causal LM from a local directory (``local_files_only``: never touches a hub)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype or torch.float32)


def build_student(m: ModelConfig, *, seed: int | None = None) -> "PreTrainedModel":
    """A model for a ``ModelConfig``: loaded from ``path``, or a fresh tiny one (vocabulary: the task
    tokenizer's unless set)."""
    from rollbook.tasks import TOKENIZER

    if m.path:
        return load_model(m.path)
    spec = TinyModelSpec(vocab_size=m.vocab_size or TOKENIZER.vocab_size, hidden_size=m.hidden_size,
                         num_layers=m.num_layers, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads,
                         intermediate_size=m.intermediate_size)
    return build_tiny_model(spec, seed=m.seed if seed is None else seed)
