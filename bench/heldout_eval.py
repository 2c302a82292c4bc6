"""Held-out reward of saved models with many samples per problem (docs/RESULTS.md, "The MOPD demo").

A run's own evaluation draws ``rollout.num_eval_samples`` answers per held-out problem (4 in
configs/demo.toml: about ±0.03 of sampling noise on 60 problems). This evaluates finished models
again on the same held-out problems with more samples, one JSON line per model:

    python bench/heldout_eval.py --seed 0 --samples 32 OUT/mopd_rl-s0/hf/step-000200 OUT/rl-s0/hf/step-000200

``--seed`` is the run's ``rollout.seed`` (it picks the held-out problems; bench/demo_seeds.py sets it
to the seed), ``--num_problems`` its ``rollout.num_eval_tasks``. The toy tasks' tokenizer
(rollbook.tasks.TOKENIZER) is the one the demo's models use. Answers are sampled at ``--temperature``
(the rollout's, 1.0) and scored by the task's verifier, as the run's sampled evaluation is.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from rollbook.models import load_model
from rollbook.rollout.engine import GenerationRequest, NativeEngine
from rollbook.tasks import DOMAINS, TOKENIZER, make_tasks, score


def evaluate(
    path: str, domains: list[str], seed: int, num_problems: int, samples: int, temperature: float, max_new_tokens: int
) -> dict:
    model = load_model(path).eval()
    engine = NativeEngine(model, seed=seed, pad_token_id=TOKENIZER.pad_token_id, max_batch_size=256)
    row: dict = {"model": path, "seed": seed, "samples": samples, "temperature": temperature}
    start = time.perf_counter()
    for name in domains:
        tasks = [t for t in make_tasks(DOMAINS[name], "heldout", num_problems, seed, allow_fewer=True) for _ in range(samples)]
        requests = [
            GenerationRequest(
                prompt_token_ids=TOKENIZER.encode(t.prompt, add_bos=True),
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                stop_token_ids=[TOKENIZER.eos_token_id],
            )
            for t in tasks
        ]
        results = engine.generate(requests, seed=seed)
        outcomes = [score(t, TOKENIZER.decode(r.output_token_ids)) for t, r in zip(tasks, results)]
        rewards = [o.reward for o in outcomes if o.status == "ok" and o.reward is not None]
        row[name] = round(sum(rewards) / len(rewards), 4) if rewards else None
        row[f"{name}_problems"] = len(tasks) // samples
        row[f"{name}_errors"] = len(outcomes) - len(rewards)  # a crashed verifier, counted apart as the run does
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="+", help="model directories (a run's hf/step-N, or a warm-started model)")
    p.add_argument(
        "--domains",
        default="addition,program",
        help="comma-separated, of " + ", ".join(sorted(DOMAINS)) + " (arithmetic and reverse in their default shapes)",
    )
    p.add_argument("--seed", type=int, default=0, help="the runs' rollout.seed: which held-out problems")
    p.add_argument("--num_problems", type=int, default=60, help="held-out problems per domain (rollout.num_eval_tasks)")
    p.add_argument("--samples", type=int, default=32, help="answers per problem")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max_new_tokens", type=int, default=14)
    args = p.parse_args()
    domains = args.domains.split(",")
    unknown = [d for d in domains if d not in DOMAINS]
    if unknown:
        p.error(f"unknown domain(s) {unknown}; known: {sorted(DOMAINS)}")
    for path in args.models:
        row = evaluate(path, domains, args.seed, args.num_problems, args.samples, args.temperature, args.max_new_tokens)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
