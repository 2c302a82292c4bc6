"""Generation throughput: the native engine with its KV cache against a naive loop without one.

    python bench/generate.py --json          # one JSON line; default run: about 10 s on 2 idle CPU cores

Both runs use the same model, the same batch of task prompts, the same sampling seed and the same
step-by-step engine; the naive loop (``NativeEngine(use_kv_cache=False)``) recomputes every sequence
from its first token at every step. No stop tokens, so both sample exactly
``batch_size * max_new_tokens`` tokens (and, with the same seed, the same ones: ``same_tokens``).
A benchmark, not a test: it asserts nothing about time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON line instead of a summary")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts generated together")
    parser.add_argument("--max-new-tokens", type=int, default=96, help="tokens sampled per prompt")
    parser.add_argument("--hidden-size", type=int, default=128, help="width of the tiny Llama")
    parser.add_argument("--num-layers", type=int, default=4, help="depth of the tiny Llama")
    parser.add_argument("--num-threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per engine; the fastest counts")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    import torch

    from rollbook.language_models import TinyModelSpec, build_tiny_model
    from rollbook.rollout.engine import GenerationRequest, NativeEngine
    from rollbook.tasks import DOMAINS, TOKENIZER, make_tasks

    torch.set_num_threads(args.num_threads)
    spec = TinyModelSpec(
        vocab_size=TOKENIZER.vocab_size,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        intermediate_size=2 * args.hidden_size,
    )
    model = build_tiny_model(spec).to(args.device)
    per_domain = -(-args.batch_size // len(DOMAINS))
    tasks = [t for name in sorted(DOMAINS) for t in make_tasks(DOMAINS[name], "train", per_domain, seed=0)]
    requests = [
        GenerationRequest(prompt_token_ids=TOKENIZER.encode(t.prompt, add_bos=True), max_new_tokens=args.max_new_tokens)
        for t in tasks[: args.batch_size]
    ]
    report = {
        "bench": "generate",
        "device": args.device,
        "batch_size": len(requests),
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "hidden_size": args.hidden_size,
        "num_layers": args.num_layers,
    }
    outputs = {}
    for name, use_kv_cache in (("kv_cache", True), ("no_cache", False)):
        engine = NativeEngine(model, seed=0, use_kv_cache=use_kv_cache, max_batch_size=len(requests))
        engine.generate([dataclasses.replace(r, max_new_tokens=4) for r in requests[:2]])  # warm-up
        seconds = float("inf")
        for _ in range(args.repeats):  # the fastest repeat: least disturbed by other processes
            start = time.perf_counter()
            results = engine.generate(requests)
            seconds = min(seconds, time.perf_counter() - start)
        outputs[name] = [r.output_token_ids for r in results]
        report[f"{name}_seconds"] = round(seconds, 3)
        report[f"{name}_tokens_per_s"] = round(sum(len(r.output_token_ids) for r in results) / seconds, 1)
    report["ratio"] = round(report["kv_cache_tokens_per_s"] / report["no_cache_tokens_per_s"], 2)
    report["same_tokens"] = outputs["kv_cache"] == outputs["no_cache"]
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:>24}: {value}")


if __name__ == "__main__":
    main()
