"""Held-out reward of saved models with many samples per problem (docs/RESULTS.md, "The MOPD demo").

A run's own evaluation draws ``rollout.num_eval_samples`` answers per held-out problem (4 in
configs/demo.toml: about ±0.03 of sampling noise on 60 problems). This evaluates finished models
again on the same held-out problems with more samples, one JSON line per model:

    python bench/heldout_eval.py --seed 0 --samples 32 OUT/mopd_rl-s0/hf/step-000300 OUT/rl-s0/hf/step-000300

``--seed`` is the run's ``rollout.seed`` (it picks the held-out problems; bench/demo_seeds.py sets it
to the seed), ``--num_problems`` its ``rollout.num_eval_tasks``. The toy tasks' tokenizer
(rollbook.tasks.TOKENIZER) is the one the demo's models use. The evaluation is the run's own
(``RolloutWorker.evaluate``): answers sampled at ``--temperature`` (the rollout's, 1.0), scored by the
task's verifier; the greedy answer of each problem comes with it (``DOMAIN_greedy``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from rollbook.config import RolloutConfig
from rollbook.language_models import load_model
from rollbook.rollout.engine import NativeEngine
from rollbook.rollout.worker import RolloutWorker
from rollbook.tasks import DOMAINS, TOKENIZER


def evaluate(
    path: str, domains: list[str], seed: int, num_problems: int, samples: int, temperature: float, max_new_tokens: int
) -> dict:
    """One model's row: the rollout worker's own evaluation (``RolloutWorker.evaluate``, what a run
    logs), one domain at a time, with ``samples`` answers per problem drawn with ``seed``."""
    model = load_model(path).eval()
    engine = NativeEngine(model, seed=seed, pad_token_id=TOKENIZER.pad_token_id, max_batch_size=256)
    config = RolloutConfig(
        domains=domains,
        seed=seed,
        num_train_tasks=1,
        num_eval_tasks=num_problems,
        num_eval_samples=samples,
        eval_seed=seed,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
    )
    row: dict = {"model": path, "seed": seed, "samples": samples, "temperature": temperature}
    start = time.perf_counter()
    # closed before the next model: its scheduler thread and reward processes end here, not at exit
    with engine, RolloutWorker(engine, config, model_id="heldout-eval") as worker:
        for name in domains:
            tasks = [t for t in worker.eval_tasks if t.domain == name]
            out = worker.evaluate(tasks)
            sampled = out.get(f"eval/sampled/{name}")
            row[name] = round(sampled, 4) if sampled is not None else None
            row[f"{name}_greedy"] = round(out[f"eval/{name}"], 4) if f"eval/{name}" in out else None
            row[f"{name}_problems"] = len(tasks)
            row[f"{name}_errors"] = int(out["eval/errors"])  # a crashed verifier, counted apart as the run does
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
