"""Write a tiny Hugging Face model directory and sample datasets for ``configs/byod.toml``, built
here from nothing (no download): a BPE tokenizer trained with the ``tokenizers`` library on a small
built-in corpus (with a chat template), a freshly initialised tiny Llama of that vocabulary, both
saved with ``save_pretrained``, and JSONL files of math word problems (numeric answers) and code rows
(write a function; hidden asserts).

    python examples/make_tiny_hf_model.py --out .            # models/my-llm/, data/*.jsonl
    rollbook run --config configs/byod.toml --trainer.model.path models/my-llm

The model is untrained (a smoke test of the loop on your own-model path: its rewards stay near 0);
put a real checkpoint's directory in its place for real training. Deterministic for a seed.
"""

from __future__ import annotations

import argparse
import json
import pathlib

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
USER, ASSISTANT, SYSTEM = "<|user|>", "<|assistant|>", "<|system|>"

# {bos}, the tools (if any) as <|system|>{json}...<|eos|>, then each message as <|role|>content<|eos|>,
# an assistant's tool calls after its content as <tool_call>{"name": ..., "arguments": {...}}</tool_call>
# (the Hermes / Qwen format, which `rollbook proxy` parses); the generation prompt opens the assistant turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}{{ '<|system|>' }}{% for tool in tools %}{{ tool | tojson }}{% endfor %}{{ eos_token }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}"
    "{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% if message['tool_calls'] is defined and message['tool_calls'] %}{% for call in message['tool_calls'] %}"
    "{{ '<tool_call>' + ({'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson) + '</tool_call>' }}"
    "{% endfor %}{% endif %}"
    "{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def math_rows(n: int) -> list[dict]:
    """Word problems with numeric answers; every third a chat row (a ``messages`` list)."""
    rows = []
    for i in range(n):
        a, b = 2 + i % 17, 1 + (3 * i) % 11
        if i % 2:
            question, answer = f"Tom has {a} apples and buys {b} more. How many apples does he have?", a + b
        else:
            question, answer = f"A box holds {a} pens. How many pens are in {b} boxes?", a * b
        row: dict = {"id": f"math-{i}", "domain": "math", "answer": str(answer)}
        if i % 3 == 0:
            row["messages"] = [
                {"role": "system", "content": "Answer with a number in \\boxed{}."},
                {"role": "user", "content": question},
            ]
        else:
            row["question"] = question + " Answer in \\boxed{}."
        rows.append(row)
    return rows


def code_rows(n: int) -> list[dict]:
    """Write a function ``solve``; the asserts are hidden from the prompt and run in the sandbox."""
    rows = []
    for i in range(n):
        k = 2 + i % 7
        rows.append(
            {
                "id": f"code-{i}",
                "domain": "code",
                "question": f"Write a Python function solve(x) that returns x times {k}.\n",
                "tests": [f"assert solve({x}) == {x * k}" for x in (1, 3, 10)],
            }
        )
    return rows


def corpus(rows: list[dict]) -> list[str]:
    texts = [r.get("question") or " ".join(m["content"] for m in r["messages"]) for r in rows]
    texts += [f"The answer is \\boxed{{{r['answer']}}}." for r in rows if "answer" in r]
    texts += ["def solve(x):\n    return x * 3\n", "```python\n```", "</answer>"]
    return texts


def save_tokenizer(directory: pathlib.Path, texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(
        texts,
        trainer=trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[PAD, BOS, EOS, USER, ASSISTANT, SYSTEM],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[USER, ASSISTANT, SYSTEM],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(directory))
    return tokenizer


def save_model(directory: pathlib.Path, tokenizer, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(str(directory))


def write_jsonl(path: pathlib.Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=".", help="root folder: writes models/my-llm/ and data/{math,code}_train.jsonl")
    parser.add_argument("--vocab-size", type=int, default=512, help="BPE vocabulary size to train")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    root = pathlib.Path(args.out)
    math, code = math_rows(64), code_rows(32)
    model_dir = root / "models" / "my-llm"
    model_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = save_tokenizer(model_dir, corpus(math + code), args.vocab_size)
    save_model(model_dir, tokenizer, args.seed)
    write_jsonl(root / "data" / "math_train.jsonl", math)
    write_jsonl(root / "data" / "code_train.jsonl", code)
    print(f"model + tokenizer (vocabulary {len(tokenizer)}): {model_dir}")
    print(
        f"datasets: {root / 'data' / 'math_train.jsonl'} ({len(math)} rows), {root / 'data' / 'code_train.jsonl'} ({len(code)} rows)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
