"""What ``rollbook proxy`` costs per call: the engine called directly against the same engine behind the
proxy, driven by the official ``openai`` client, in the same run with the same concurrent clients.

- ``direct_rps`` / ``direct_latency_ms_*``: the engine fed directly from one thread in this
  process, ``--clients`` calls in flight at all times (``NativeEngine.submit``: a finished call is
  replaced by the next at once), one chat prompt (the proxy's own
  rendering); the engine is the proxy's served model (same seed, same weights, same torch thread
  count). One feeding thread, not one per client: the engine's batch at that concurrency without
  the interpreter-lock contention of many Python threads, the limit the proxy is measured against.
- ``proxy_rps`` / ``proxy_latency_ms_*``: the same number of threads, each with its own session
  and ``openai.OpenAI`` client, calling ``/v1/chat/completions`` of a real ``rollbook proxy``
  subprocess that records every completion in a real ``rollbook serve`` subprocess (fresh DuckDB
  file). Afterwards the store must hold exactly one trajectory per call, or the run fails. The
  proxy decodes in an engine process of its own (``ProxyConfig.engine_process``, its default);
  ``--engine-in-proxy`` runs the engine in the proxy's process instead, for comparison.
- ``added_latency_ms_mean`` / ``added_latency_ms_p50``: proxy minus direct, per call;
  ``proxy_over_direct_rps``: the throughput ratio. ``*_tokens_per_call``: generation stops at
  ``<eos>`` in both, so the work per call is the same in distribution; compare it too.
- ``proxy_phase_cpu_cores``: the CPU cores each process used while the proxy served (median over
  rounds, from ``/proc``; null where there is none): its engine process (``null`` with
  ``--engine-in-proxy``), the proxy, the store, and the clients (this process's threads, the direct
  engine idle then). On a small machine they share the cores the engine decodes on.
- ``ttft_ms_mean`` / ``stream_call_ms_mean`` / ``ttft_over_call``: then, with the proxy otherwise
  idle, streamed calls (``stream=True``, ``max_tokens`` ``--stream-tokens``) one after another
  until ``--ttft-calls`` of them produced exactly ``--stream-tokens`` tokens (the untrained model
  ends some answers early with ``<eos>``; those are not counted): time from sending the request to
  the first chunk with text, the whole call, and the mean of their per-call ratio.

Both sides keep ``--clients`` calls in flight until ``--clients * --calls`` calls have finished:
the direct side refills the engine as a call finishes, and on the proxy side each client thread
takes the next call from a shared count (no client has a fixed quota, whose slowest clients would
leave the engine a tail of a few calls). The two sides alternate ``--rounds`` times with the same
engine, proxy and clients; the report gives medians over rounds and the ratio of each round
(``proxy_over_direct_rps_all``), so a machine that slows down part way through moves both sides.
Timing runs from a barrier (every client built and its session started) to the last answer.

    python bench/proxy.py --json                         # one JSON line on stdout, progress on stderr
    python bench/proxy.py --clients 8 --calls 50 --max-tokens 16
    python bench/proxy.py --json --clients 16 --calls 20 --max-tokens 64   # 16 concurrent sessions
    python bench/proxy.py --json --clients 16 --calls 12 --max-tokens 64 --hidden-size 256 --num-layers 4   # a wider model
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODEL = "tiny"
PROMPT = [{"role": "user", "content": "12+34="}]


def _progress(message: str) -> None:
    print(f"[proxy bench] {message}", file=sys.stderr, flush=True)


def _start(args: list[str], env: dict, log: pathlib.Path, prefix: str = "listening on ") -> tuple[subprocess.Popen, str]:
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rollbook.cli", *args], stdout=subprocess.PIPE, stderr=out, text=True, env=env
        )
    line = proc.stdout.readline() if proc.stdout else ""
    if not line.startswith(prefix):
        proc.kill()
        raise SystemExit(f"{args[0]} did not start: {line!r}\n{log.read_text(errors='replace')[-2000:]}")
    return proc, line.removeprefix(prefix).strip()


def _stat(path: pathlib.Path) -> list[str]:
    """The fields of a ``/proc/<pid>/stat`` after the command name (state, ppid, ...)."""
    return path.read_text().rsplit(")", 1)[1].split()


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` (every thread) from ``/proc``; None where there is none."""
    try:
        fields = _stat(pathlib.Path(f"/proc/{pid}/stat"))
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (the proxy's engine process)."""
    found = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(_stat(stat)[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


class _CpuMeter:
    """CPU cores each named group of processes used while ``measure`` ran (None without ``/proc``)."""

    def __init__(self, groups: dict[str, list[int]]) -> None:
        self.groups = groups

    def measure(self, fn: Callable[[], dict]) -> dict:
        before = {name: [_cpu_seconds(p) for p in pids] for name, pids in self.groups.items()}
        t0 = time.perf_counter()
        result = fn()
        elapsed = time.perf_counter() - t0
        cores: dict[str, float | None] = {}
        for name, pids in self.groups.items():
            after = [_cpu_seconds(p) for p in pids]
            pairs = list(zip(before[name], after))
            ok = pairs and all(a is not None and b is not None for a, b in pairs)
            cores[name] = sum(b - a for a, b in pairs) / elapsed if ok else None  # type: ignore[operator]
        return {**result, "cpu_cores": cores}


def _run_clients(callers: list[Callable[[], int]], calls: int) -> dict:
    """One thread per caller (each call returns its answer's tokens) until ``len(callers) * calls``
    calls were made: a thread takes the next call from the shared count when its last one returns, as
    the direct side refills the engine, so both keep ``len(callers)`` calls in flight to the end (a
    fixed quota per thread would leave the engine a tail of the slowest clients' last calls)."""
    barrier = threading.Barrier(len(callers) + 1)
    latencies: list[float] = []
    tokens: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    remaining = [len(callers) * calls]

    def take() -> bool:
        with lock:
            if remaining[0] <= 0 or errors:
                return False
            remaining[0] -= 1
            return True

    def worker(fn: Callable[[], int]) -> None:
        barrier.wait()
        try:
            while take():
                t0 = time.perf_counter()
                n = fn()
                dt = time.perf_counter() - t0
                with lock:
                    latencies.append(dt)
                    tokens.append(n)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(fn,)) for fn in callers]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return {
        "rps": len(latencies) / elapsed,
        "latency_mean": statistics.fmean(latencies),
        "latency_p50": statistics.median(latencies),
        "tokens_per_call": statistics.fmean(tokens),
    }


def _run_engine(engine, request, num_clients: int, calls: int) -> dict:
    """``num_clients`` requests in flight on ``engine`` from this thread, each replaced when it
    finishes until ``num_clients * calls`` have finished."""
    import concurrent.futures

    latencies: list[float] = []
    tokens: list[int] = []
    total, submitted = num_clients * calls, 0
    pending: dict = {}
    t0 = time.perf_counter()
    while len(latencies) < total:
        while submitted < total and len(pending) < num_clients:
            pending[engine.submit(request)] = time.perf_counter()
            submitted += 1
        done, _ = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
        now = time.perf_counter()
        for future in done:
            latencies.append(now - pending.pop(future))
            tokens.append(len(future.result().output_token_ids))
    elapsed = time.perf_counter() - t0
    return {
        "rps": total / elapsed,
        "latency_mean": statistics.fmean(latencies),
        "latency_p50": statistics.median(latencies),
        "tokens_per_call": statistics.fmean(tokens),
    }


def _time_to_first_token(openai, url: str, control, sessions: list[dict], tokens: int, wanted: int) -> tuple[dict, int]:
    """Streamed calls one at a time until ``wanted`` answers of exactly ``tokens`` tokens (at most
    ``20 * wanted`` calls); returns the timings and how many calls were made."""
    started = control(url, "/rollbook/sessions", {"task_id": "bench-stream"}, None)
    sessions.append(started)
    oai = openai.OpenAI(base_url=url + "/v1", api_key=started["api_key"], max_retries=0, timeout=300)
    firsts, totals, calls = [], [], 0
    while len(totals) < wanted and calls < 20 * wanted:
        calls += 1
        t0 = time.perf_counter()
        first, produced = None, 0
        for chunk in oai.chat.completions.create(
            model=MODEL, messages=PROMPT, max_tokens=tokens, stream=True, stream_options={"include_usage": True}
        ):
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - t0
            if chunk.usage is not None:
                produced = chunk.usage.completion_tokens
        total = time.perf_counter() - t0
        if produced == tokens and first is not None:
            firsts.append(first)
            totals.append(total)
    if not totals:
        raise SystemExit(f"no streamed call of {tokens} tokens in {calls} calls")
    return {
        "ttft_ms_mean": round(1000 * statistics.fmean(firsts), 2),
        "stream_call_ms_mean": round(1000 * statistics.fmean(totals), 2),
        "ttft_over_call": round(statistics.fmean(f / t for f, t in zip(firsts, totals)), 4),
        "stream_tokens": tokens,
        "stream_calls_timed": len(totals),
    }, calls


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print exactly one JSON line on stdout")
    p.add_argument("--clients", type=int, default=4, help="concurrent clients (default: %(default)s)")
    p.add_argument("--calls", type=int, default=25, help="calls per client (default: %(default)s)")
    p.add_argument(
        "--rounds", type=int, default=3, help="direct / proxy rounds, alternating; medians reported (default: %(default)s)"
    )
    p.add_argument("--max-tokens", type=int, default=8, help="max_tokens of every call (default: %(default)s)")
    p.add_argument("--stream-tokens", type=int, default=64, help="max_tokens of the streamed calls (default: %(default)s)")
    p.add_argument("--ttft-calls", type=int, default=10, help="streamed calls of full length to time (default: %(default)s)")
    p.add_argument("--hidden-size", type=int, default=None, help="the served tiny model's width (default: ModelConfig's)")
    p.add_argument("--num-layers", type=int, default=None, help="the served tiny model's depth (default: ModelConfig's)")
    p.add_argument("--work-dir", default=None, help="where the temporary run dir goes")
    p.add_argument(
        "--engine-in-proxy",
        action="store_true",
        help="run the proxy's engine in the proxy's own process (engine_process = false), sharing its interpreter lock",
    )
    p.add_argument(
        "--proxy-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for `rollbook proxy`, e.g. --proxy-arg=--submit_linger_s=0.2 (repeatable)",
    )
    args = p.parse_args(argv)
    if min(args.clients, args.calls, args.rounds, args.max_tokens, args.stream_tokens, args.ttft_calls) < 1:
        raise SystemExit("--clients, --calls, --rounds, --max-tokens, --stream-tokens and --ttft-calls must be >= 1")

    import openai
    import torch

    from rollbook.client import StoreClient
    from rollbook.config import ModelConfig
    from rollbook.language_models import build_student
    from rollbook.rollout.engine import GenerationRequest, NativeEngine
    from rollbook.rollout.proxy.render import renderer
    from rollbook.rollout.proxy.server import torch_threads

    available = torch.get_num_threads()
    render = renderer()
    prompt_ids = render.chat_prompt([(m["role"], m["content"]) for m in PROMPT])
    shape = {k: v for k, v in (("hidden_size", args.hidden_size), ("num_layers", args.num_layers)) if v is not None}
    engine_model = build_student(ModelConfig(**shape))
    engine = NativeEngine(engine_model, version=0, seed=0)
    torch.set_num_threads(torch_threads(None, engine.num_parameters, available))  # as `rollbook proxy` does
    request = GenerationRequest(prompt_token_ids=prompt_ids, max_new_tokens=args.max_tokens, stop_token_ids=[render.eos_token_id])
    engine.generate([request])  # warm-up (lazy initialisation), not timed

    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLBOOK_")}
    with tempfile.TemporaryDirectory(dir=args.work_dir, prefix="proxy-bench-") as tmp:
        work = pathlib.Path(tmp)
        store, address = _start(
            ["serve", "--db", str(work / "rollbook.duckdb"), "--port", "0", "--log-level", "WARNING"], env, work / "serve.log"
        )
        proxy = None
        try:
            with StoreClient(address) as client:
                client.register_model(MODEL, vocab_size=render.vocab_size)
                client.publish_version(MODEL, 0)
            proxy, url = _start(
                [
                    "proxy",
                    "--port",
                    "0",
                    "--server",
                    address,
                    "--model_id",
                    MODEL,
                    "--log-level",
                    "WARNING",
                    *(f"--model.{k}={v}" for k, v in shape.items()),
                    "--max_tokens_limit",
                    str(max(256, args.max_tokens)),
                    f"--engine_process={str(not args.engine_in_proxy).lower()}",
                    *args.proxy_arg,
                ],
                env,
                work / "proxy.log",
            )

            from examples.arithmetic_agent import control

            sessions: list[dict] = []

            def proxy_client(i: int) -> Callable[[], int]:
                started = control(url, "/rollbook/sessions", {"task_id": f"bench-{i}"}, None)
                sessions.append(started)
                oai = openai.OpenAI(base_url=url + "/v1", api_key=started["api_key"], max_retries=0, timeout=300)
                oai.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=args.max_tokens)  # warm-up, recorded too

                def call() -> int:
                    done = oai.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=args.max_tokens)
                    return done.usage.completion_tokens if done.usage else 0

                return call

            callers = [proxy_client(i) for i in range(args.clients)]
            # CPU per process while the proxy serves (the clients are this process's threads then)
            meter = _CpuMeter(
                {"engine": _children(proxy.pid), "proxy": [proxy.pid], "store": [store.pid], "clients": [os.getpid()]}
            )
            direct_rounds, proxy_rounds = [], []
            for r in range(args.rounds):
                _progress(
                    f"round {r + 1}/{args.rounds}: direct, {args.clients} in flight x {args.calls} calls, max_tokens {args.max_tokens}"
                )
                direct_rounds.append(_run_engine(engine, request, args.clients, args.calls))
                _progress(f"round {r + 1}/{args.rounds}: proxy at {url}, the same load through the openai client")
                proxy_rounds.append(meter.measure(lambda: _run_clients(callers, args.calls)))
                _progress(
                    f"round {r + 1}: direct {direct_rounds[-1]['rps']:.1f} calls/s, proxy {proxy_rounds[-1]['rps']:.1f} calls/s"
                )
            _progress(f"streamed calls of {args.stream_tokens} tokens, one at a time: time to first token")
            streamed, stream_calls = _time_to_first_token(openai, url, control, sessions, args.stream_tokens, args.ttft_calls)
            for started in sessions:  # the end call submits each session's last (held) completion
                control(url, f"/rollbook/sessions/{started['session_id']}/end", {}, started["api_key"])
            expected = args.clients * (args.rounds * args.calls + 1) + stream_calls
            deadline = time.monotonic() + 120
            with StoreClient(address) as client:
                while True:
                    stored = client.query("SELECT count(*) AS n FROM trajectories").to_pylist()[0]["n"]
                    if stored == expected or time.monotonic() > deadline:
                        break
                    time.sleep(0.2)
            if stored != expected:
                raise SystemExit(f"the store holds {stored} trajectories, expected {expected} (one per call)")
            _progress(f"store: {stored} trajectories, one per call (checked)")
        finally:
            engine.close()  # its scheduler thread ends here, not while the interpreter exits
            if proxy is not None:
                proxy.terminate()
                proxy.wait(30)
            store.terminate()
            store.wait(60)

    def median(rounds: list[dict], key: str, scale: float = 1.0) -> float:
        return round(scale * statistics.median(r[key] for r in rounds), 2)

    ratios = [p["rps"] / d["rps"] for d, p in zip(direct_rounds, proxy_rounds)]
    report = {
        "direct_rps": median(direct_rounds, "rps"),
        "proxy_rps": median(proxy_rounds, "rps"),
        "proxy_over_direct_rps": round(statistics.median(ratios), 3),
        "proxy_over_direct_rps_all": [round(r, 3) for r in ratios],
        "direct_latency_ms_mean": median(direct_rounds, "latency_mean", 1000),
        "proxy_latency_ms_mean": median(proxy_rounds, "latency_mean", 1000),
        "added_latency_ms_mean": round(
            1000 * statistics.median(p["latency_mean"] - d["latency_mean"] for d, p in zip(direct_rounds, proxy_rounds)), 2
        ),
        "added_latency_ms_p50": round(
            1000 * statistics.median(p["latency_p50"] - d["latency_p50"] for d, p in zip(direct_rounds, proxy_rounds)), 2
        ),
        "proxy_phase_cpu_cores": {
            name: None
            if any(r["cpu_cores"][name] is None for r in proxy_rounds)
            else round(statistics.median(r["cpu_cores"][name] for r in proxy_rounds), 3)
            for name in proxy_rounds[0]["cpu_cores"]
        },
        **streamed,
        "direct_tokens_per_call": round(statistics.fmean(r["tokens_per_call"] for r in direct_rounds), 2),
        "proxy_tokens_per_call": round(statistics.fmean(r["tokens_per_call"] for r in proxy_rounds), 2),
        "clients": args.clients,
        "calls_per_client": args.calls,
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "stored_trajectories": stored,
        "model": {"hidden_size": engine_model.config.hidden_size, "num_layers": engine_model.config.num_hidden_layers},
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "engine_process": not args.engine_in_proxy,
    }
    print(json.dumps(report) if args.json else json.dumps(report, indent=2), flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # examples/ (the agent's control helper)
    sys.exit(main())
