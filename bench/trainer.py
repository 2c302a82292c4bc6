"""Trainer step overhead: a decoupled-PPO + MOPD step on packed tokens against a bare SFT-style step.

    python bench/trainer.py --json          # one JSON line; under a minute on 2 idle CPU cores

    python bench/trainer.py --json --device cuda --dtype bfloat16 --model qwen2-0.5b \
        --num-sequences 64 --max-tokens 16384 --prompt-len 64 --output-len 448   # scripts/gpu_check.sh

Both steps run on the same model, the same packed micro-batches (same document-masked attention
and position ids), the same device, dtype and AdamW optimizer, alternating in one run:

- ``step``: per micro-batch ``packed_logprobs`` (forward with grad, the LM head a chunk of positions
  at a time under activation checkpointing), ``decoupled_ppo_loss`` + ``mopd_loss`` through
  ``combined_loss``, backward; then one AdamW step. The proximal and teacher log-probs are inputs,
  computed before the step.
- ``bare``: per micro-batch the decoder's hidden states, the LM head on every output position at
  once, ``cross_entropy`` on the output tokens, backward; then the same AdamW step.
- ``whole``: the trainer's own update (``Trainer.update`` in trainer/loop.py, the code ``rollbook
  train`` runs) on the same sequences as a pulled batch: decoupled PPO + MOPD (``distill_coef`` 1,
  the two teachers), proximal log-probs as configured (``--proximal``, default ``recompute``), the
  teacher scoring each micro-batch, gradient clipping, AdamW, the step's statistics.

``--dtype bfloat16`` runs both under autocast with float32 master weights (rollbook/devices.py), as
the trainer does; the teachers are held in bfloat16, as they are under a float32 student with
``--teacher-dtype bfloat16`` (``trainer.teacher_dtype``). ``--model qwen2-0.5b`` builds a Qwen2 model of
the 0.5B shape (24 layers, hidden 896, 151,936-token vocabulary) from a config in code.

``whole_over_bare`` is what a user pays for the RL + MOPD step over the SFT step they know (target
<= 1.3: a bare step plus the teacher's forward). ``step_over_bare`` is the loss machinery's share
alone (target <= 1.15). The forward-only passes are timed apart, on the same micro-batches:
``teacher_score_s`` (two teachers, domain routing: each scores only its half of the sequences, in
micro-batches of its own domain, as the trainer packs a routed batch) and
``proximal_recompute_s``, the no-grad forward of the whole batch that a proximal recompute would be
(the trainer runs none with one minibatch: the first minibatch's training forward gives it). The
breakdown ``whole_shares`` divides ``whole_s`` into the student's forward + backward + AdamW
(``step_s``), the teacher's forward (``teacher_score_s``) and the rest (packing, the proximal and
statistics bookkeeping, gradient clipping). Times are medians over ``--repeats``
after one warm-up of each, measurements interleaved so that load from other processes hits all
alike; ``step_over_bare_cpu`` is the same ratio in process CPU time, steadier on a shared machine.
The default (8192 tokens in 8 micro-batches of 1024) runs in under a minute on 2 idle cores. On an
oversubscribed machine two threads mostly wait for each other; ``--num-threads 1`` is then the
steadier measurement. On CUDA each timing is taken after ``torch.cuda.synchronize``.
A benchmark, not a test: it asserts nothing about time.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON line instead of a summary")
    parser.add_argument("--num-sequences", type=int, default=32, help="sequences per optimizer step")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per sequence")
    parser.add_argument("--output-len", type=int, default=224, help="output tokens per sequence")
    parser.add_argument("--max-tokens", type=int, default=1024, help="tokens per packed micro-batch")
    parser.add_argument("--hidden-size", type=int, default=256, help="width of the tiny Llama")
    parser.add_argument("--num-layers", type=int, default=4, help="depth of the tiny Llama")
    parser.add_argument("--vocab-size", type=int, default=64, help="vocabulary of the tiny Llama")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats of each measurement (median)")
    parser.add_argument("--num-threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N (rollbook/devices.py)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the trainer's dtype")
    parser.add_argument(
        "--teacher-dtype", default=None, choices=["float32", "bfloat16"], help="trainer.teacher_dtype (default: --dtype)"
    )
    parser.add_argument(
        "--model",
        default="tiny",
        choices=["tiny", "qwen2-0.5b"],
        help="tiny: the Llama of --hidden-size etc.; qwen2-0.5b: that shape",
    )
    parser.add_argument("--chunk-tokens", type=int, default=1024, help="trainer.logprob_chunk_tokens")
    parser.add_argument(
        "--proximal", default="recompute", choices=["recompute", "loglinear", "behavior"], help="the whole step's loss.proximal"
    )
    parser.add_argument("--num-minibatches", type=int, default=1, help="the whole step's trainer.num_minibatches")
    args = parser.parse_args()
    if args.prompt_len < 1 or args.output_len < 1 or args.repeats < 1:
        parser.error("--prompt-len, --output-len and --repeats must be >= 1")
    if args.prompt_len + args.output_len > args.max_tokens:
        parser.error("--max-tokens must hold one sequence (--prompt-len + --output-len)")
    return args


def main() -> None:
    args = parse_args()
    sys.path.insert(0, str(ROOT))  # bench.models
    import torch

    from rollbook import devices
    from rollbook.trainer.loop import _Rows
    from rollbook.trainer.packing import packed_logprobs
    from rollbook.trainer.teachers import DomainRouter, LocalTeacher

    torch.set_num_threads(args.num_threads)
    device = devices.resolve_device(args.device)
    devices.resolve_dtype(args.dtype, device)
    vocab = build_model(args, 0).config.vocab_size if args.model != "tiny" else args.vocab_size
    model = devices.place_trained(build_model(args, 0), device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    teachers = {
        name: LocalTeacher(devices.place(build_model(args, seed), device, args.teacher_dtype or args.dtype))
        for name, seed in (("a", 1), ("b", 2))
    }
    teacher = DomainRouter(teachers)
    batches, domains, table = make_batches(args, torch, vocab)
    batches = [b.to(device) for b in batches]
    trainer = whole_step_trainer(args, model, teacher)
    rows = _Rows.from_table(table)
    autocast = lambda: devices.autocast(device, args.dtype)  # noqa: E731

    proximal = [None] * len(batches)
    teacher_logp = [None] * len(batches)

    def recompute_proximal() -> None:
        with torch.no_grad(), autocast():
            proximal[:] = [packed_logprobs(model, b, b.temperature, chunk_tokens=args.chunk_tokens) for b in batches]

    def score_teachers() -> None:
        with autocast():
            teacher_logp[:] = [teacher.score(b, d) for b, d in zip(batches, domains)]

    def step() -> None:
        with autocast():
            rl_step(model, optimizer, batches, proximal, teacher_logp, args.chunk_tokens)

    def bare() -> None:
        with autocast():
            bare_step(model, optimizer, batches)

    def whole() -> None:
        trainer.update(rows)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    # in a real step's order: the step consumes the proximal and teacher log-probs just computed
    runs = {"proximal": recompute_proximal, "teacher": score_teachers, "step": step, "bare": bare, "whole": whole}
    timings = {name: [] for name in runs}
    cpu_times = {name: [] for name in runs}
    for repeat in range(args.repeats + 1):  # repeat 0 is the warm-up
        for name, run in runs.items():
            sync()
            start, start_cpu = time.perf_counter(), time.process_time()
            run()
            sync()
            if repeat:
                timings[name].append(time.perf_counter() - start)
                cpu_times[name].append(time.process_time() - start_cpu)
    median = {name: statistics.median(t) for name, t in timings.items()}
    report = {
        "bench": "trainer",
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": args.dtype,
        "teacher_dtype": args.teacher_dtype or args.dtype,
        "model": args.model,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "tokens_per_step": sum(b.num_tokens for b in batches),
        "output_tokens_per_step": sum(b.num_output_tokens for b in batches),
        "num_micro_batches": len(batches),
        "hidden_size": model.config.hidden_size,
        "num_layers": model.config.num_hidden_layers,
        "vocab_size": vocab,
        "chunk_tokens": args.chunk_tokens,
        "num_threads": args.num_threads,
        "repeats": args.repeats,
        "step_s": round(median["step"], 3),
        "bare_s": round(median["bare"], 3),
        "whole_s": round(median["whole"], 3),
        "whole_over_bare": round(median["whole"] / median["bare"], 3),
        "whole_over_bare_cpu": round(statistics.median(cpu_times["whole"]) / statistics.median(cpu_times["bare"]), 3),
        "whole_shares": {
            "student_fwd_bwd_adamw": round(median["step"] / median["whole"], 3),
            "teacher_forward": round(median["teacher"] / median["whole"], 3),
            "rest": round(1 - (median["step"] + median["teacher"]) / median["whole"], 3),
        },
        "proximal": args.proximal,
        "num_minibatches": args.num_minibatches,
        "step_over_bare": round(median["step"] / median["bare"], 3),
        "step_over_bare_cpu": round(statistics.median(cpu_times["step"]) / statistics.median(cpu_times["bare"]), 3),
        "proximal_recompute_s": round(median["proximal"], 3),
        "teacher_score_s": round(median["teacher"], 3),
        "step_tokens_per_s": round(sum(b.num_tokens for b in batches) / median["step"], 1),
    }
    if device.type == "cuda":
        report["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:>24}: {value}")


def build_model(args: argparse.Namespace, seed: int):
    """The benchmark's model, float32 on the CPU: the tiny Llama of the size flags, or a Qwen2 of the
    0.5B shape (built from a config, random weights; nothing is downloaded)."""

    from rollbook.language_models import TinyModelSpec, build_tiny_model

    if args.model == "tiny":
        spec = TinyModelSpec(
            vocab_size=args.vocab_size,
            hidden_size=args.hidden_size,
            num_layers=args.num_layers,
            intermediate_size=2 * args.hidden_size,
            max_position_embeddings=args.prompt_len + args.output_len,
        )
        return build_tiny_model(spec, seed=seed)
    from bench.models import qwen2_half_billion

    return qwen2_half_billion(seed, args.prompt_len + args.output_len)


def make_batches(args: argparse.Namespace, torch, vocab: int):
    """Random prompts and outputs with engine-like evidence (behavior log-probs near the model's): the
    packed micro-batches, their sequences' domains, and the same rows as the pulled batch's Arrow
    table the trainer reads (``Trainer.update``)."""
    import pyarrow as pa

    from rollbook.trainer.packing import pack_sequences

    gen = torch.Generator().manual_seed(0)
    n = args.num_sequences
    prompts = torch.randint(0, vocab, (n, args.prompt_len), generator=gen).tolist()
    outputs = torch.randint(0, vocab, (n, args.output_len), generator=gen).tolist()
    behavior = (-torch.rand(n, args.output_len, generator=gen) * 4 - 2).tolist()  # ~ log(1/64) +- 2
    advantages = torch.randn(n, generator=gen).tolist()
    batches = pack_sequences(
        prompts, outputs, max_tokens=args.max_tokens, behavior_logprobs=behavior, advantages=advantages, temperatures=[1.0] * n
    )
    domain_of = ["a" if i < n // 2 else "b" for i in range(n)]  # each micro-batch one teacher's, as the trainer packs them
    domains = [[domain_of[i] for i in b.sequence_ids.tolist()] for b in batches]
    table = pa.table(
        {
            "prompt_token_ids": prompts,
            "output_token_ids": outputs,
            "output_logprobs": behavior,
            "output_versions": [[0] * args.output_len] * n,
            "advantage": pa.array(advantages, pa.float32()),
            "temperature": [1.0] * n,
            "domain": domain_of,
        }
    )
    return batches, domains, table


def whole_step_trainer(args: argparse.Namespace, model, teacher):
    """The trainer ``rollbook train`` runs, on the benchmark's model and teachers (no store: only its
    ``update`` is called), with the step's settings: MOPD on, the packing and chunking of the others."""
    import tempfile

    from rollbook.config import TrainerConfig
    from rollbook.trainer.loop import Trainer

    config = TrainerConfig.model_validate(
        {
            "run_dir": tempfile.mkdtemp(prefix="rollbook-bench-trainer-"),
            "device": args.device,
            "dtype": args.dtype,
            "teacher_dtype": args.teacher_dtype,
            "lr": 1e-5,
            "micro_batch_tokens": args.max_tokens,
            "logprob_chunk_tokens": args.chunk_tokens,
            "num_minibatches": args.num_minibatches,
            "loss": {"distill_coef": 1.0, "proximal": args.proximal},
        }
    )
    return Trainer(config, None, model=model, teacher=teacher)


def rl_step(model, optimizer, batches, proximal, teacher_logp, chunk_tokens: int) -> None:
    from rollbook.trainer.losses import combined_loss, decoupled_ppo_loss, mopd_loss
    from rollbook.trainer.packing import packed_logprobs

    total = sum(b.num_output_tokens for b in batches)
    for b, prox, teach in zip(batches, proximal, teacher_logp):
        logp = packed_logprobs(model, b, b.temperature, chunk_tokens=chunk_tokens)
        common = (logp, prox, b.behavior_logprobs)
        rl = decoupled_ppo_loss(*common, b.advantages, b.loss_mask, eps_clip=0.2, behavior_weight_cap=5.0)
        distill = mopd_loss(*common, teach, b.loss_mask, adv_clip=5.0, behavior_weight_cap=5.0)
        loss, _ = combined_loss(rl, distill, rl_coef=1.0, distill_coef=1.0)
        (loss * (b.num_output_tokens / total)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def bare_step(model, optimizer, batches) -> None:
    import torch.nn.functional as F

    from rollbook.trainer.packing import packed_hidden

    total = sum(b.num_output_tokens for b in batches)
    for b in batches:
        logits = model.get_output_embeddings()(packed_hidden(model, b))
        loss = F.cross_entropy(logits.float(), b.output_token_ids, reduction="sum") / total
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
