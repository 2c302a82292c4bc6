"""Causal language models for the trainer, the rollout engine and teachers.

``build_student`` is shared by the trainer and the rollout worker (both build the same student from
the same ``ModelConfig``, rollbook/config/language_model.py), so it lives here, below both
(``docs/design.md``, "What each folder may import").
Models are Hugging Face ``transformers`` causal LMs, either loaded from a local directory or built
from a tiny config in code; nothing is ever downloaded. torch and transformers are imported lazily so
that the CLI and the store never pay for them.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rollbook.config import ModelConfig

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import PreTrainedModel


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


def quiet_transformers() -> None:
    """No tqdm bars from transformers or huggingface_hub ("Loading weights", "Writing model shards"):
    they would interleave with the console and break one-line errors."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    try:
        from huggingface_hub.utils import disable_progress_bars
    except ImportError:  # pragma: no cover - an older huggingface_hub
        return
    disable_progress_bars()


def check_model_dir(path: str | os.PathLike, what: str = "model") -> pathlib.Path:
    """``path`` as a Path when it is a local Hugging Face model directory (a folder with config.json);
    a one-line ``ConfigError`` naming ``what`` otherwise (so a typo never reaches a hub lookup)."""
    from rollbook.errors import ConfigError

    p = pathlib.Path(path)
    if not p.is_dir():
        raise ConfigError(f"{what} {str(path)!r}: no such directory (a local Hugging Face model directory is needed)")
    if not (p / "config.json").is_file():
        raise ConfigError(f"{what} {str(path)!r}: not a Hugging Face model directory (no config.json)")
    return p


def load_model(path: str | os.PathLike, *, dtype: "torch.dtype | None" = None, what: str = "model") -> "PreTrainedModel":
    """Load a causal LM from a local Hugging Face directory (``local_files_only``: never touches a
    hub), fp32 unless ``dtype``; ``what`` names it in the error for a directory that is not one."""
    import torch
    from transformers import AutoModelForCausalLM

    p = check_model_dir(path, what)
    quiet_transformers()
    return AutoModelForCausalLM.from_pretrained(p, local_files_only=True, dtype=dtype or torch.float32)


def model_vocab_size(model) -> int:
    """Rows of a causal LM's input embedding: the ids it can read and, untied or tied, emit (a
    checkpoint's ``config.vocab_size`` may be padded past its tokenizer's size; this is the bound)."""
    return int(model.get_input_embeddings().weight.shape[0])


def student_vocab_size(m: ModelConfig) -> int:
    """The vocabulary size of the student a ``ModelConfig`` builds, without building it: the loaded
    directory's ``config.json`` ``vocab_size`` for ``path``, else ``vocab_size`` or the task
    tokenizer's. This is what ``RegisterModel`` gets, so the store's token-range rule matches the model."""
    if m.path:
        config = json.loads((check_model_dir(m.path, "model.path") / "config.json").read_text())
        text = config.get("text_config") or {}
        vocab = config.get("vocab_size") or text.get("vocab_size")
        if not isinstance(vocab, int) or vocab < 2:
            from rollbook.errors import ConfigError

            raise ConfigError(f"model.path {m.path!r}: config.json has no vocab_size")
        return vocab
    from rollbook.tasks import TOKENIZER

    return m.vocab_size or TOKENIZER.vocab_size


def generation_eos_ids(m: ModelConfig | None) -> list[int]:
    """The end-of-sequence ids the model's own generation config lists: ``eos_token_id`` of
    ``path``'s generation_config.json (an int or a list: Qwen and Llama-3 instruct models list several),
    or of its config.json when it has no generation_config.json (as transformers falls back). None for
    the built-in tiny model, whose config names no eos (``build_tiny_model``), and for no model."""
    if m is None or not m.path:
        return []
    root = pathlib.Path(m.path)
    for name in ("generation_config.json", "config.json"):
        if (root / name).is_file():
            value = json.loads((root / name).read_text()).get("eos_token_id")
            ids = value if isinstance(value, list) else [] if value is None else [value]
            return [int(i) for i in ids]
    return []


def stop_token_ids(eos_token_id: int | None, model: ModelConfig | None = None, configured: Sequence[int] = ()) -> list[int]:
    """Every token id that ends a completion of ``model``, each once, the tokenizer's ``eos_token_id``
    first: that eos, the model's generation-config eos ids (``generation_eos_ids``), the ``configured``
    ones (``rollout.stop_token_ids``). The one definition of the stop set: the rollout worker and its
    evaluation take it through ``rollout/worker.py`` ``use_model_stops``, the online evaluation and the
    proxy call it with their tokenizer's eos."""
    ids = ([] if eos_token_id is None else [int(eos_token_id)]) + generation_eos_ids(model) + [int(i) for i in configured]
    return list(dict.fromkeys(ids))


def build_student(m: ModelConfig, *, seed: int | None = None) -> "PreTrainedModel":
    """A model for a ``ModelConfig``: loaded from ``path``, or a fresh tiny one (vocabulary: the task
    tokenizer's unless set)."""
    from rollbook.tasks import TOKENIZER

    if m.path:
        return load_model(m.path, what="model.path")
    spec = TinyModelSpec(
        vocab_size=m.vocab_size or TOKENIZER.vocab_size,
        hidden_size=m.hidden_size,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads,
        intermediate_size=m.intermediate_size,
    )
    return build_tiny_model(spec, seed=m.seed if seed is None else seed)
