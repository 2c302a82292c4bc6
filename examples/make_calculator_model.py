"""Write a tiny Hugging Face model directory that knows the calculator game's tool format, for the
tool-using agent (examples/calculator_agent.py) and ``configs/calculator.toml``: built here from
nothing (no download), as a user's supervised checkpoint would be.

1. A byte-level BPE tokenizer trained on the game's texts, with the tools-aware chat template of
   examples/make_tiny_hf_model.py (tools in a system block, Hermes ``<tool_call>`` JSON calls).
2. A freshly initialised tiny Llama of that vocabulary.
3. Supervised steps on demonstrations of the game on the training problems, rendered exactly as
   ``rollbook proxy`` renders the agent's calls (the second call's prompt extends the first's token
   for token): the ``mul`` call with the problem's numbers, then the tool's result as the answer.
   Every ``--check-every`` steps it plays the game greedily on training problems it set apart
   (tool call parsed, run, answer checked) and stops at ``--target``: a partly taught model, whose
   held-out reward an online run then raises.

    python examples/make_calculator_model.py --out .        # models/calculator-llm/
    rollbook run --config configs/calculator.toml

Deterministic for a seed.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # the repository root, for rollbook and examples

from examples.calculator_agent import solve_operands  # noqa: E402
from examples.make_tiny_hf_model import save_tokenizer  # noqa: E402
from rollbook.run.online import CALCULATOR_TOOLS, CalculatorGame  # noqa: E402


def tool_call_text(a: int, b: int) -> str:
    """The demonstrated call, as the chat template writes an assistant's tool call."""
    return "<tool_call>" + json.dumps({"name": "mul", "arguments": {"a": a, "b": b}}) + "</tool_call>"


def corpus(problems: list[tuple[int, int]]) -> list[str]:
    texts = [json.dumps(t) for t in CALCULATOR_TOOLS] * 20
    for a, b in problems:
        texts += [f"what is {a} times {b}?", tool_call_text(a, b), str(a * b)]
    return texts


def demonstration(game, a: int, b: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, output) pairs of the right play of ``a`` times ``b`` (a ``CalculatorGame``'s prompts)."""
    eos = game.render.eos_token_id
    prompt, messages = game.first_prompt(f"what is {a} times {b}?")
    call = game.render.hf.encode(tool_call_text(a, b), add_special_tokens=False) + [eos]
    answer = game.render.hf.encode(str(a * b), add_special_tokens=False) + [eos]
    second = game.answer_prompt(prompt, messages, call)
    assert second is not None
    return [(prompt, call), (second, answer)]


def greedy(model, prompt: list[int], eos: int, max_new_tokens: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos,
        )
    return out[0, len(prompt) :].tolist()


def solved(model, game, a: int, b: int, max_new_tokens: int = 32) -> bool:
    """Greedy play of one problem: a tool call, then the answer (or the first answer if no call)."""
    eos = game.render.eos_token_id
    prompt, messages = game.first_prompt(f"what is {a} times {b}?")
    first = greedy(model, prompt, eos, max_new_tokens)
    second = game.answer_prompt(prompt, messages, first)
    final = first if second is None else greedy(model, second, eos, max_new_tokens)
    return game.render.decode(final).strip() == str(a * b)


def teach(model, game, train, check, *, steps: int, target: float, check_every: int, batch_size: int, lr: float, seed: int):
    import torch

    rng = random.Random(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    accuracy = 0.0
    for step in range(1, steps + 1):
        model.train()
        pairs = [p for a, b in rng.sample(train, batch_size) for p in demonstration(game, a, b)]
        width = max(len(p) + len(o) for p, o in pairs)
        ids = torch.full((len(pairs), width), game.render.eos_token_id)
        labels = torch.full((len(pairs), width), -100)
        mask = torch.zeros((len(pairs), width), dtype=torch.long)
        for i, (p, o) in enumerate(pairs):
            ids[i, : len(p) + len(o)] = torch.tensor(p + o)
            labels[i, len(p) : len(p) + len(o)] = torch.tensor(o)
            mask[i, : len(p) + len(o)] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % check_every == 0:
            model.eval()
            accuracy = sum(solved(model, game, a, b) for a, b in check) / len(check)
            print(json.dumps({"step": step, "loss": round(loss.item(), 4), "greedy_accuracy": accuracy}), flush=True)
            if accuracy >= target:
                break
    return accuracy


def build(
    model_dir: pathlib.Path,
    train: list[tuple[int, int]],
    check: list[tuple[int, int]],
    *,
    vocab_size: int = 512,
    hidden_size: int = 128,
    num_layers: int = 2,
    steps: int = 3000,
    target: float = 0.8,
    check_every: int = 25,
    batch_size: int = 32,
    lr: float = 3e-3,
    seed: int = 0,
) -> float:
    """Tokenizer, model and supervised steps into ``model_dir``; returns the last greedy accuracy."""
    from rollbook.language_models import TinyModelSpec, build_tiny_model
    from rollbook.rollout.proxy.render import HFRenderer

    model_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = save_tokenizer(model_dir, corpus(train + check), vocab_size)
    model = build_tiny_model(
        TinyModelSpec(
            vocab_size=len(tokenizer), hidden_size=hidden_size, num_layers=num_layers, intermediate_size=2 * hidden_size
        ),
        seed=seed,
    )
    for config in (model.config, model.generation_config):
        config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
        config.pad_token_id = tokenizer.pad_token_id
    # the game's renderer reads the directory's tokenizer and generation config; the weights are
    # written once taught, so a build killed half way leaves no model that looks built
    model.config.save_pretrained(str(model_dir))
    model.generation_config.save_pretrained(str(model_dir))
    for stale in model_dir.glob("*.safetensors"):
        stale.unlink()
    game = CalculatorGame(HFRenderer(str(model_dir)))
    accuracy = teach(
        model,
        game,
        train,
        check,
        steps=steps,
        target=target,
        check_every=check_every,
        batch_size=min(batch_size, len(train)),
        lr=lr,
        seed=seed,
    )
    model.save_pretrained(str(model_dir))
    return accuracy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=".", help="root folder: writes models/calculator-llm/")
    parser.add_argument("--problems", type=int, default=2000, help="training problems (the multiply domain's train split)")
    parser.add_argument("--vocab-size", type=int, default=512, help="BPE vocabulary size to train")
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3000, help="most supervised steps")
    parser.add_argument("--target", type=float, default=0.8, help="stop at this greedy accuracy on set-apart training problems")
    parser.add_argument("--check-every", type=int, default=25)
    parser.add_argument("--batch-size", type=int, default=32, help="problems per step (two demonstrated calls each)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from rollbook.tasks import MultiplyDomain, make_tasks

    model_dir = pathlib.Path(args.out) / "models" / "calculator-llm"
    problems = [solve_operands(t.prompt) for t in make_tasks(MultiplyDomain(), "train", args.problems, args.seed)]
    check = problems[: min(64, len(problems) // 4)]  # set apart: the accuracy is on problems it did not train on
    accuracy = build(
        model_dir,
        problems[len(check) :],
        check,
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        steps=args.steps,
        target=args.target,
        check_every=args.check_every,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
    )
    print(f"model + tokenizer: {model_dir}; greedy accuracy {accuracy:.3f} on {len(check)} set-apart training problems")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
