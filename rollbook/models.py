"""Causal language models for the trainer, the rollout engine and teachers.

Models are Hugging Face ``transformers`` causal LMs, either loaded from a local directory or built
from a tiny config in code; nothing is ever downloaded. torch and transformers are imported lazily so
that the CLI and the store never pay for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import torch


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


def build_tiny_model(spec: TinyModelSpec, *, seed: int = 0, dtype: "torch.dtype | None" = None):
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
    return model.to(dtype or torch.float32)


def load_model(path: str, *, dtype: "torch.dtype | None" = None):
    """Load a causal LM from a local directory (``local_files_only``: never touches a hub)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype or torch.float32)
