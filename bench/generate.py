"""Generation throughput: the native engine against Hugging Face ``generate`` on the same model.

    python bench/generate.py --json          # one JSON line; about 20 s on 2 idle CPU cores
    python bench/generate.py --json --device cuda --dtype bfloat16 --model qwen2-0.5b --num-threads 4

Two scenarios, each run by both sides on the same model, prompts, device and dtype (task prompts of
the toy domains, 6-21 tokens; no stop tokens, so every request samples exactly its
``max_new_tokens``; temperature 1, no top-p/top-k):

- ``static``: one batch of ``--batch-size`` requests of ``--max-new-tokens`` each.
  ``NativeEngine.generate`` against ``model.generate(..., do_sample=True, use_cache=True)`` on the
  left-padded batch. The fastest of ``--repeats`` runs counts (interleaved); ``ratio_cpu`` is the
  same ratio in process CPU time, steadier on a shared machine.
- ``arrivals``: ``--num-requests`` requests arriving one by one (Poisson, ``--arrival-rate`` per
  second; 0 derives it from the static run: ``--load`` times what the engine sustained there), each
  wanting a number of tokens drawn uniformly from ``--min-new-tokens``..``--max-new-tokens``. The
  engine takes each with ``submit`` as it arrives (continuous batching); the Hugging Face server
  takes whatever has queued (at most ``--batch-size``) whenever it is free and runs it as one static
  batch to that batch's longest request (the shorter ones' surplus tokens are dropped, uncounted).
  Reported per side: tokens/s (requested tokens over the time from the first arrival to the last
  completion) and the mean and 90th-percentile latency from arrival to completion.

``ratio``: engine tokens/s over Hugging Face tokens/s. ``static.bandwidth``: what one decode step of
the static batch must read (every weight once, plus the KV cache of the batch at its mean length,
``bytes_per_step``), over the engine's mean time per step (its static run over ``--max-new-tokens``
steps, prefill included), as a fraction of the device's memory bandwidth (``--bandwidth-gbs``, or
the data sheet of a known GPU: H200, H100, A100; none on the CPU unless given). ``--model qwen2-0.5b`` builds a Qwen2 of the
0.5B shape (24 layers, hidden 896, 151,936-token vocabulary) from a config in code, random weights,
nothing downloaded. ``--dtype bfloat16`` holds the model in bfloat16 (rollbook/devices.py ``place``).
On CUDA each timing ends with ``torch.cuda.synchronize``. A benchmark, not a test: it asserts
nothing about time. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON line instead of a summary")
    parser.add_argument("--model", default="tiny", choices=["tiny", "qwen2-0.5b"], help="tiny: the Llama of --hidden-size etc.")
    parser.add_argument("--hidden-size", type=int, default=128, help="width of the tiny Llama")
    parser.add_argument("--num-layers", type=int, default=4, help="depth of the tiny Llama")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, auto (rollbook/devices.py)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the model's dtype")
    parser.add_argument("--num-threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--batch-size", type=int, default=64, help="static batch; also the engine's slots and HF's largest batch")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens per request (static); the most (arrivals)")
    parser.add_argument("--min-new-tokens", type=int, default=8, help="the fewest tokens an arriving request wants")
    parser.add_argument("--num-requests", type=int, default=192, help="requests arriving over time")
    parser.add_argument("--arrival-rate", type=float, default=0.0, help="requests/s; 0: --load x the engine's static rate")
    parser.add_argument("--load", type=float, default=1.0, help="offered load relative to the engine's static throughput")
    parser.add_argument("--repeats", type=int, default=3, help="timed static runs per side; the fastest counts")
    parser.add_argument("--seed", type=int, default=0, help="prompts, lengths, arrival times and sampling")
    parser.add_argument("--bandwidth-gbs", type=float, default=None, help="memory bandwidth, GB/s (default: a known GPU's)")
    args = parser.parse_args()
    if not 1 <= args.min_new_tokens <= args.max_new_tokens:
        parser.error("need 1 <= --min-new-tokens <= --max-new-tokens")
    return args


def main() -> None:
    args = parse_args()
    sys.path.insert(0, str(ROOT))  # bench.models
    import torch

    from rollbook import devices
    from rollbook.rollout.engine import GenerationRequest, NativeEngine

    torch.set_num_threads(args.num_threads)
    device = devices.resolve_device(args.device)
    model = devices.place(build_model(args), device, args.dtype)
    prompts = task_prompts(args.num_requests + args.batch_size, args.seed)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    max_len = max(len(p) for p in prompts) + args.max_new_tokens
    engine = NativeEngine(model, seed=args.seed, max_batch_size=args.batch_size, max_seq_len=max_len)
    hf = HFServer(model, device, args.seed)

    def request(prompt: list[int], n: int) -> GenerationRequest:
        return GenerationRequest(prompt_token_ids=prompt, max_new_tokens=n, temperature=1.0)

    report: dict = {
        "bench": "generate",
        "model": args.model,
        "device": str(device),
        "dtype": args.dtype,
        "num_threads": args.num_threads,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    # -- static ----------------------------------------------------------------------------------
    batch = [request(p, args.max_new_tokens) for p in prompts[: args.batch_size]]
    engine.generate(batch[:2])  # warm-up of both
    hf.generate([r.prompt_token_ids for r in batch[:2]], 4)
    best = {"engine": float("inf"), "hf": float("inf"), "engine_cpu": float("inf"), "hf_cpu": float("inf")}
    for repeat in range(args.repeats):  # interleaved, so that load from other processes hits both alike
        for side in ("engine", "hf"):
            start, start_cpu = time.perf_counter(), time.process_time()
            if side == "engine":
                engine.generate(batch)
            else:
                hf.generate([r.prompt_token_ids for r in batch], args.max_new_tokens)
            sync()
            best[side] = min(best[side], time.perf_counter() - start)
            best[f"{side}_cpu"] = min(best[f"{side}_cpu"], time.process_time() - start_cpu)
            log(f"static {side} repeat {repeat}: {best[side]:.2f} s")
    tokens = args.batch_size * args.max_new_tokens
    static = {"batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens, "tokens": tokens}
    for side in ("engine", "hf"):
        static[f"{side}_seconds"] = round(best[side], 3)
        static[f"{side}_tokens_per_s"] = round(tokens / best[side], 1)
    static["ratio"] = round(static["engine_tokens_per_s"] / static["hf_tokens_per_s"], 2)
    static["ratio_cpu"] = round(best["hf_cpu"] / best["engine_cpu"], 2)
    static["bandwidth"] = decode_bandwidth(model, device, args, batch, best["engine"])
    report["static"] = static
    # -- arrivals --------------------------------------------------------------------------------
    rng = random.Random(args.seed)
    wants = [rng.randint(args.min_new_tokens, args.max_new_tokens) for _ in range(args.num_requests)]
    mean_want = sum(wants) / len(wants)
    rate = args.arrival_rate or args.load * static["engine_tokens_per_s"] / mean_want
    arrivals, t = [], 0.0
    for _ in wants:
        arrivals.append(t)
        t += rng.expovariate(rate)
    work = [request(p, n) for p, n in zip(prompts[args.batch_size :], wants)]
    arriving = {
        "num_requests": args.num_requests,
        "new_tokens": [args.min_new_tokens, args.max_new_tokens],
        "arrival_rate": round(rate, 2),
        "load": args.load if not args.arrival_rate else None,
        "tokens": sum(wants),
    }
    for side, run in (("engine", run_engine_arrivals), ("hf", run_hf_arrivals)):
        log(f"arrivals {side}: {args.num_requests} requests at {rate:.1f}/s")
        makespan, latencies = run(engine if side == "engine" else hf, work, arrivals, args.batch_size, sync)
        latencies.sort()
        arriving[f"{side}_seconds"] = round(makespan, 3)
        arriving[f"{side}_tokens_per_s"] = round(sum(wants) / makespan, 1)
        arriving[f"{side}_latency_mean_s"] = round(sum(latencies) / len(latencies), 3)
        arriving[f"{side}_latency_p90_s"] = round(latencies[int(0.9 * (len(latencies) - 1))], 3)
    arriving["ratio"] = round(arriving["engine_tokens_per_s"] / arriving["hf_tokens_per_s"], 2)
    report["arrivals"] = arriving
    engine.close()
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:>12}: {value}")


# data-sheet memory bandwidth, GB/s, by a substring of torch.cuda.get_device_name()
KNOWN_BANDWIDTH_GBS = {"H200": 4800.0, "H100 NVL": 3900.0, "H100 PCIe": 2000.0, "H100": 3350.0, "A100": 2039.0}


def decode_bandwidth(model, device, args: argparse.Namespace, batch, engine_seconds: float) -> dict:
    """Bytes one static decode step reads (weights once + the batch's KV cache at its mean length),
    the engine's mean seconds per step, and their ratio to the device's memory bandwidth."""
    import torch

    config = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    element = next(model.parameters()).element_size()
    mean_len = sum(len(r.prompt_token_ids) for r in batch) / len(batch) + args.max_new_tokens / 2
    kv_bytes = 2 * config.num_hidden_layers * kv_heads * head_dim * element * mean_len * len(batch)
    step_s = engine_seconds / args.max_new_tokens
    out = {
        "bytes_per_step": int(weight_bytes + kv_bytes),
        "weight_bytes": weight_bytes,
        "kv_bytes": int(kv_bytes),
        "step_s": round(step_s, 6),
    }
    gbs = args.bandwidth_gbs
    if gbs is None and device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        gbs = next((v for k, v in KNOWN_BANDWIDTH_GBS.items() if k in name), None)
        out["device_name"] = name
    if gbs:
        out["bandwidth_gbs"] = gbs
        out["fraction_of_bandwidth"] = round((weight_bytes + kv_bytes) / step_s / (gbs * 1e9), 4)
    return out


def build_model(args: argparse.Namespace):
    """The tiny Llama of the size flags, or a Qwen2 of the 0.5B shape (random weights), float32 on the CPU."""

    from rollbook.language_models import TinyModelSpec, build_tiny_model
    from rollbook.tasks import TOKENIZER

    if args.model == "tiny":
        spec = TinyModelSpec(
            vocab_size=TOKENIZER.vocab_size,
            hidden_size=args.hidden_size,
            num_layers=args.num_layers,
            intermediate_size=2 * args.hidden_size,
        )
        return build_tiny_model(spec, seed=args.seed)
    from bench.models import qwen2_half_billion

    return qwen2_half_billion(args.seed)


def task_prompts(n: int, seed: int) -> list[list[int]]:
    """``n`` encoded task prompts of the toy domains, in a seeded order (their ids are valid in either model)."""
    from rollbook.tasks import DOMAINS, TOKENIZER, make_tasks

    per_domain = -(-n // len(DOMAINS))
    tasks = [t for name in sorted(DOMAINS) for t in make_tasks(DOMAINS[name], "train", per_domain, seed=seed)]
    random.Random(seed).shuffle(tasks)
    return [TOKENIZER.encode(t.prompt, add_bos=True) for t in tasks[:n]]


class HFServer:
    """``model.generate`` on left-padded static batches, sampling at temperature 1 from the full
    distribution (top-k and top-p off: transformers' default top-k is 50)."""

    def __init__(self, model, device, seed: int) -> None:
        self.model, self.device, self.seed = model, device, seed

    def generate(self, prompts: list[list[int]], max_new_tokens: int):
        import torch

        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        torch.manual_seed(self.seed)
        with torch.inference_mode():
            return self.model.generate(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                do_sample=True,
                use_cache=True,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                pad_token_id=0,
                eos_token_id=None,
            )


def run_engine_arrivals(engine, work, arrivals, batch_size, sync) -> tuple[float, list[float]]:
    """Submit each request at its arrival time; the makespan and each request's latency."""
    done_at: list[float] = [0.0] * len(work)
    finished = threading.Semaphore(0)
    start = time.perf_counter()
    for i, (request, at) in enumerate(zip(work, arrivals)):
        time.sleep(max(0.0, start + at - time.perf_counter()))

        def on_done(future, i=i) -> None:
            done_at[i] = time.perf_counter() - start
            finished.release()

        engine.submit(request).add_done_callback(on_done)
    for _ in work:
        finished.acquire()
    sync()
    return max(done_at), [d - a for d, a in zip(done_at, arrivals)]


def run_hf_arrivals(hf, work, arrivals, batch_size, sync) -> tuple[float, list[float]]:
    """Whenever free, run what has arrived (at most ``batch_size``) as one static batch."""
    done_at: list[float] = [0.0] * len(work)
    start, next_up = time.perf_counter(), 0
    while next_up < len(work):
        now = time.perf_counter() - start
        if arrivals[next_up] > now:
            time.sleep(arrivals[next_up] - now)
            now = arrivals[next_up]
        take = [i for i in range(next_up, len(work)) if arrivals[i] <= now][:batch_size]
        hf.generate([list(work[i].prompt_token_ids) for i in take], max(work[i].max_new_tokens for i in take))
        sync()
        finished = time.perf_counter() - start
        for i in take:
            done_at[i] = finished
        next_up = take[-1] + 1
    return max(done_at), [d - a for d, a in zip(done_at, arrivals)]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
