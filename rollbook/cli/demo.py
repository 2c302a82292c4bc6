"""``rollbook demo``: start a store on a run directory, feed it a generated workload, ask it SQL.

The workload imitates asynchronous rollout workers: groups of samples per prompt, two policy
versions, some retried requests, and a sprinkle of broken evidence (NaN log-probs, length
mismatches, vLLM's -9999 sentinel, an unregistered model) so that the rejection ledger has
something to show. Everything goes through a real ``rollbook serve`` process and gRPC.
"""

from __future__ import annotations

import argparse
import pathlib
import secrets
import time
import uuid

import numpy as np

from rollbook.cli.query import format_table
from rollbook.client import StoreClient
from rollbook.run.store_process import StoreProcess

QUESTIONS = [
    (
        "Accepted evidence by domain",
        "SELECT domain, count(*) AS trajectories, sum(num_output_tokens) AS tokens, round(avg(reward), 3) AS mean_reward "
        "FROM trajectories GROUP BY domain ORDER BY domain",
    ),
    (
        "Why trajectories were rejected",
        "SELECT reason, count(*) AS n, any_value(detail) AS example FROM rejections GROUP BY reason ORDER BY n DESC",
    ),
    (
        "Tokens per policy version (mixed-version sequences counted in both)",
        "SELECT v AS version, count(*) AS tokens FROM (SELECT unnest(output_versions) AS v FROM trajectories) GROUP BY v ORDER BY v",
    ),
    ("Policy versions published", "SELECT model_id, version, checksum FROM policy_versions ORDER BY version"),
]


def generate_workload(num: int, *, model_id: str, seed: int = 0, bad_every: int = 25) -> list[dict]:
    rng = np.random.default_rng(seed)
    run = uuid.uuid4().hex[:8]
    out = []
    for i in range(num):
        n = int(rng.integers(8, 64))
        v0 = int(rng.integers(0, 2))
        switch = int(rng.integers(0, n)) if v0 == 0 and rng.random() < 0.2 else n
        t = {
            "trajectory_id": f"{run}-{i}",
            "session_id": f"{run}-s{i // 4}",
            "group_id": f"{run}-g{i // 4}",
            "group_size": 4,
            "request_id": f"{run}-r{i}",
            "consumed": True,
            "task_id": f"task-{i // 4}",
            "domain": ["arithmetic", "reverse"][(i // 4) % 2],
            "model_id": model_id,
            "prompt_token_ids": rng.integers(0, 64, 12).tolist(),
            "output_token_ids": rng.integers(0, 64, n).tolist(),
            "output_logprobs": (-rng.exponential(1.0, n)).tolist(),
            "output_versions": [v0 if k < switch else v0 + 1 for k in range(n)],
            "temperature": 1.0,
            "top_p": 1.0,
            "finish_reason": "stop",
            "reward": float(rng.random() < 0.5),
            "worker_id": f"worker-{i % 2}",
            "created_at": time.time(),
        }
        if i % bad_every == bad_every - 1:
            kind = (i // bad_every) % 4
            if kind == 0:
                t["output_logprobs"][0] = float("nan")
            elif kind == 1:
                t["output_logprobs"] = t["output_logprobs"][:-1]
            elif kind == 2:
                t["output_logprobs"][-1] = -9999.0
            else:
                t["model_id"] = "not-registered"
        out.append(t)
    return out


def run_demo(args: argparse.Namespace) -> int:
    run_dir = pathlib.Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    db = run_dir / "rollbook.duckdb"
    store = StoreProcess(db, admin_key=secrets.token_hex(16), trainer_key=secrets.token_hex(16))
    print(f"store: {store.address}, ledger {db}")
    try:
        with StoreClient(store.address, admin_key=store.admin_key, trainer_key=store.trainer_key) as client:
            client.register_model("demo-model", vocab_size=64)
            for version in (0, 1, 2):
                client.publish_version("demo-model", version, checksum=f"demo-{version}")
            workload = generate_workload(args.num_trajectories, model_id="demo-model")
            t0 = time.perf_counter()
            result = client.submit(workload, batch_size=64)
            dt = time.perf_counter() - t0
            print(
                f"submitted {len(workload)} trajectories in {dt:.2f} s: {result.accepted} accepted, "
                f"{result.rejected} rejected, {result.duplicates} duplicates"
            )
            again = client.submit(workload[:100])
            print(f"resubmitted 100: {again.duplicates} DUPLICATE, nothing stored twice")
            for title, sql in QUESTIONS:
                print(f"\n== {title}\n   {sql}\n")
                print(format_table(client.query(sql)))
    finally:
        store.stop()
    print(f'ledger left at {db}; ask it more with:\n  rollbook query --db {db} "SELECT * FROM trajectories LIMIT 5"')
    return 0
