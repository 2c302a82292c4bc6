"""Hugging Face fixtures built locally, for tests that need a real tokenizer (and model) directory:
nothing is downloaded.

    from tests.hf_fixtures import save_bpe_tokenizer, save_tiny_model_dir
    path = save_bpe_tokenizer(tmp_path / "tok")          # AutoTokenizer.from_pretrained(path) works
    model_dir = save_tiny_model_dir(tmp_path / "model")   # + a tiny Llama of its vocabulary (AutoModelForCausalLM)
    tok = AutoTokenizer.from_pretrained(path)            # eos "<|eos|>", pad "<|pad|>", a jinja chat template

``save_bpe_tokenizer`` trains a small byte-level BPE with the ``tokenizers`` library on a built-in
corpus (arithmetic word problems, answers, Python snippets), wraps it in ``PreTrainedTokenizerFast``
with special tokens and ``CHAT_TEMPLATE`` (tools and Hermes-style tool calls included), and
``save_pretrained``s it. Deterministic for a corpus.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterable

from examples.make_tiny_hf_model import CHAT_TEMPLATE as EXAMPLE_CHAT_TEMPLATE

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
USER, ASSISTANT = "<|user|>", "<|assistant|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, USER, ASSISTANT]

# {bos}, the tools (if any) as <|system|>{json}...<|eos|>, then each message as <|role|>content<|eos|>,
# an assistant's tool calls as Hermes <tool_call> blocks: the template of examples/make_tiny_hf_model.py
CHAT_TEMPLATE = EXAMPLE_CHAT_TEMPLATE


def corpus() -> list[str]:
    lines = []
    for a in range(1, 30):
        for b in (2, 3, 5, 7, 12):
            lines.append(f"Tom has {a} apples and buys {b} more. How many apples does he have? {a + b}")
            lines.append(f"What is {a} times {b}? The answer is \\boxed{{{a * b}}}.")
            lines.append(f"def solve(x):\n    return x * {b}\nassert solve({a}) == {a * b}")
    lines += ["system user assistant", "Answer with a number.", "Write a function solve(x).", "```python\n```"]
    return lines


def train_bpe(texts: Iterable[str] | None = None, vocab_size: int = 400):
    """A byte-level BPE ``tokenizers.Tokenizer`` with ``SPECIAL_TOKENS`` at ids 0..4."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(list(texts if texts is not None else corpus()), trainer=trainer)
    return tok


def make_fast_tokenizer(vocab_size: int = 400):
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(vocab_size=vocab_size),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[USER, ASSISTANT],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_bpe_tokenizer(directory: str | pathlib.Path, vocab_size: int = 400) -> pathlib.Path:
    """Train, wrap and ``save_pretrained`` the tokenizer into ``directory``; returns it."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    make_fast_tokenizer(vocab_size).save_pretrained(str(directory))
    return directory


def save_tiny_model_dir(directory: str | pathlib.Path, *, vocab_size: int = 400, seed: int = 0, **spec) -> pathlib.Path:
    """A complete Hugging Face model directory: the BPE tokenizer above and a freshly initialised tiny
    Llama (``rollbook.language_models.build_tiny_model``) of its vocabulary, its config naming the tokenizer's
    bos/eos/pad ids, both ``save_pretrained`` into ``directory`` (``AutoModelForCausalLM`` and
    ``AutoTokenizer`` load it with ``local_files_only``). ``spec``: ``TinyModelSpec`` fields."""
    from rollbook.language_models import TinyModelSpec, build_tiny_model

    directory = save_bpe_tokenizer(directory, vocab_size=vocab_size)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    model = build_tiny_model(TinyModelSpec(vocab_size=len(tok), **spec), seed=seed)
    model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = (
        tok.bos_token_id,
        tok.eos_token_id,
        tok.pad_token_id,
    )
    model.generation_config.bos_token_id = tok.bos_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(str(directory))
    return directory


def save_head64_model_dir(directory: str | pathlib.Path, *, vocab_size: int):
    """A tiny Llama with attention heads of size 64 (which vLLM's attention kernels take), no tokenizer,
    ``save_pretrained`` into ``directory``; returns the model."""
    from rollbook.language_models import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(vocab_size=vocab_size, hidden_size=128, num_heads=2, num_kv_heads=2, intermediate_size=256)
    model = build_tiny_model(spec)
    model.save_pretrained(str(directory))
    return model
