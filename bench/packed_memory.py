"""Peak memory of one packed micro-batch's training step: the trainer's path against a dense one.

    python bench/packed_memory.py --json            # 2k to 16k tokens, a 151,936-token vocabulary; a few minutes
    python bench/packed_memory.py --json --device cuda --dtype bfloat16   # scripts/gpu_check.sh

One forward + backward of the sampled tokens' log-probs (the policy-gradient surrogate
``-(advantage * logp).mean()``) over one packed micro-batch of ``--tokens`` tokens: 32 sequences of
equal length, a quarter prompt and three quarters output, of a small Llama-style model with a
Qwen2-sized vocabulary (``--vocab``, hidden 256, 2 layers, tied embeddings; built in code). Two paths
on the same model and batch:

- ``chunked``: the trainer's (trainer/packing.py ``packed_logprobs``): attention per sequence, no
  mask; the LM head ``--chunk-tokens`` output positions at a time under activation checkpointing.
- ``dense`` (the baseline, what a packed trainer without those does; kept here as a reference): a
  dense additive block-diagonal mask ``[1, 1, T, T]`` and the logits of every output position at
  once, ``[T_out, V]`` float32 and their log-softmax.

Each path and size runs in a fresh child process. CPU: the peak resident memory of the step (the
kernel's high-water mark, reset after the model and batch are built: ``/proc/self/clear_refs``)
minus the resident memory before it; the parent kills a child past ``--limit-gib`` resident and
reports that size as not fitting (``null``), so the machine never swaps. CUDA: the peak of
``torch.cuda.max_memory_allocated`` over the step minus what was allocated before it. The smallest
size also checks that both paths give the same log-probs and the same gradients of the step's loss
(``max_abs_logp_diff``, ``max_abs_grad_diff``; float32 on the CPU).

A benchmark, not a test: it asserts nothing; tests/integration/test_bench_packed_memory.py runs it small.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SEQUENCES = 32


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON line instead of a table")
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192, 16384], help="micro-batch sizes (tokens)")
    parser.add_argument("--vocab", type=int, default=151_936, help="vocabulary size")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--chunk-tokens", type=int, default=1024, help="trainer.logprob_chunk_tokens")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--limit-gib", type=float, default=16.0, help="CPU: a child past this resident memory is stopped")
    parser.add_argument("--num-threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--child", nargs=2, metavar=("PATH", "TOKENS"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.child:
        print(json.dumps(child(args, args.child[0], int(args.child[1]))))
        return
    rows = []
    for tokens in sorted(args.tokens):
        row: dict = {"tokens": tokens, "output_tokens": _output_tokens(tokens)}
        for path in ("chunked", "dense"):
            row[path] = run_child(args, path, tokens)
        rows.append(row)
    smallest = min(args.tokens)
    import torch  # after the children: the parent stays small

    diff, grad_diff = compare(args, smallest, torch)
    largest = rows[-1]
    report = {
        "bench": "packed_memory",
        "device": args.device,
        "dtype": args.dtype,
        "vocab_size": args.vocab,
        "hidden_size": args.hidden_size,
        "num_layers": args.num_layers,
        "sequences": SEQUENCES,
        "chunk_tokens": args.chunk_tokens,
        "limit_gib": args.limit_gib,
        "sizes": [
            {
                "tokens": r["tokens"],
                "output_tokens": r["output_tokens"],
                "chunked_peak_mib": r["chunked"].get("peak_mib"),
                "dense_peak_mib": r["dense"].get("peak_mib"),
                "chunked_s": r["chunked"].get("seconds"),
                "dense_s": r["dense"].get("seconds"),
                **({"dense_error": r["dense"]["error"]} if "error" in r["dense"] else {}),
                **({"chunked_error": r["chunked"]["error"]} if "error" in r["chunked"] else {}),
            }
            for r in rows
        ],
        "max_abs_logp_diff": diff,
        "max_abs_grad_diff": grad_diff,
        "largest_tokens": largest["tokens"],
        "largest_chunked_peak_mib": largest["chunked"].get("peak_mib"),
        "largest_dense_peak_mib": largest["dense"].get("peak_mib"),
    }
    fitting = [r for r in rows if r["dense"].get("peak_mib") and r["chunked"].get("peak_mib")]
    if fitting:
        r = fitting[-1]
        report["dense_over_chunked_at"] = r["tokens"]
        report["dense_over_chunked"] = round(r["dense"]["peak_mib"] / r["chunked"]["peak_mib"], 2)
    if args.json:
        print(json.dumps(report))
    else:
        for s in report["sizes"]:
            print(f"{s['tokens']:>6} tokens: chunked {s['chunked_peak_mib']} MiB, dense {s['dense_peak_mib']} MiB")


def run_child(args: argparse.Namespace, path: str, tokens: int) -> dict:
    """One path at one size in a fresh process; ``{"error": ...}`` when it does not fit or fails."""
    argv = [sys.executable, __file__, "--child", path, str(tokens), *_shared_flags(args)]
    child_proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    limit_kib = args.limit_gib * 2**20
    peak_kib = 0
    while child_proc.poll() is None:
        rss = _rss_kib(child_proc.pid)
        peak_kib = max(peak_kib, rss)
        if args.device == "cpu" and rss > limit_kib:
            child_proc.kill()
            child_proc.wait()
            return {"error": f"over {args.limit_gib:g} GiB resident: does not fit", "peak_mib": None}
        time.sleep(0.02)
    out, err = child_proc.communicate()
    if child_proc.returncode != 0:
        last = (err.strip().splitlines() or ["(no output)"])[-1]
        return {"error": f"exit {child_proc.returncode}: {last[:300]}", "peak_mib": None}
    return json.loads(out.strip().splitlines()[-1])


def child(args: argparse.Namespace, path: str, tokens: int) -> dict:
    import gc

    import torch

    from rollbook import devices

    torch.set_num_threads(args.num_threads)
    device = devices.resolve_device(args.device)
    model, packed = build(args, tokens, torch)
    model = devices.place_trained(model, device)
    packed = packed.to(device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    else:
        before = _rss_kib(os.getpid()) * 1024
        _reset_peak_rss()
    start = time.perf_counter()
    with devices.autocast(device, args.dtype):
        logp = step_logprobs(path, model, packed, args.chunk_tokens, torch)
        loss = -(packed.advantages * logp).mean()
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
    else:
        peak = _peak_rss_kib() * 1024 - before
    return {"peak_mib": round(peak / 2**20, 1), "seconds": round(time.perf_counter() - start, 3), "loss": float(loss)}


def step_logprobs(path: str, model, packed, chunk_tokens: int, torch):
    from rollbook.trainer.packing import packed_logprobs

    if path == "chunked":
        return packed_logprobs(model, packed, packed.temperature, chunk_tokens=chunk_tokens)
    mask = _dense_block_causal_mask(packed.cu_seqlens, torch)
    logits = model(
        input_ids=packed.input_ids,
        attention_mask=mask,
        position_ids=packed.position_ids,
        use_cache=False,
        logits_to_keep=packed.output_index,
    ).logits[0]  # [T_out, V]
    log_probs = (logits.float() / packed.temperature[:, None]).log_softmax(-1)
    return log_probs.gather(-1, packed.output_token_ids[:, None])[:, 0]


def compare(args: argparse.Namespace, tokens: int, torch) -> tuple[float, float]:
    """Both paths' log-probs and gradients of the step's loss at ``tokens``, in this process (float32
    on the CPU): the max difference of each."""
    model, packed = build(args, tokens, torch)
    logps, grads = [], []
    for path in ("dense", "chunked"):
        model.zero_grad(set_to_none=True)
        logp = step_logprobs(path, model, packed, args.chunk_tokens, torch)
        (-(packed.advantages * logp).mean()).backward()
        logps.append(logp.detach())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    return float((logps[0] - logps[1]).abs().max()), float((grads[0] - grads[1]).abs().max())


def build(args: argparse.Namespace, tokens: int, torch):
    from rollbook.language_models import TinyModelSpec, build_tiny_model
    from rollbook.trainer.packing import pack_sequences

    length = tokens // SEQUENCES
    prompt = max(1, length // 4)
    spec = TinyModelSpec(
        vocab_size=args.vocab,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        intermediate_size=2 * args.hidden_size,
        max_position_embeddings=max(512, length),
    )
    model = build_tiny_model(spec, seed=0)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (SEQUENCES, length), generator=gen).tolist()
    [packed] = pack_sequences(
        [s[:prompt] for s in ids],
        [s[prompt:] for s in ids],
        advantages=torch.randn(SEQUENCES, generator=gen).tolist(),
        temperatures=[1.0] * SEQUENCES,
    )
    return model, packed


def _dense_block_causal_mask(cu_seqlens, torch):
    """The baseline's additive mask ``[1, 1, T, T]``: 0 where a query may attend (same sequence,
    not later), the dtype's minimum elsewhere."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths)
    pos = torch.arange(seq.numel(), device=cu_seqlens.device)
    allowed = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
    mask = torch.zeros(allowed.shape, dtype=torch.float32, device=cu_seqlens.device)
    return mask.masked_fill_(~allowed, torch.finfo(torch.float32).min)[None, None]


def _output_tokens(tokens: int) -> int:
    length = tokens // SEQUENCES
    return SEQUENCES * (length - max(1, length // 4))


def _shared_flags(args: argparse.Namespace) -> list[str]:
    return [
        *("--vocab", str(args.vocab), "--hidden-size", str(args.hidden_size), "--num-layers", str(args.num_layers)),
        *("--chunk-tokens", str(args.chunk_tokens), "--device", args.device, "--dtype", args.dtype),
        *("--num-threads", str(args.num_threads)),
    ]


def _rss_kib(pid: int) -> int:
    return _status_kib(pid, "VmRSS")


def _peak_rss_kib() -> int:
    return _status_kib(os.getpid(), "VmHWM")


def _status_kib(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _reset_peak_rss() -> None:
    """Reset the kernel's resident high-water mark (VmHWM) of this process to its current size."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


if __name__ == "__main__":
    main()
