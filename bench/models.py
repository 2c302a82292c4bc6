"""Models the benchmarks share, built from a config in code (random weights; nothing is downloaded)."""

from __future__ import annotations


def qwen2_half_billion(seed: int, max_positions: int = 4096):
    """A Qwen2 of the 0.5B shape (24 layers, hidden 896, 14 heads over 2 key/value heads, a tied
    151,936-token vocabulary), float32 on the CPU, at least 4,096 positions."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=151_936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=max(4096, max_positions),
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).float()
