"""Re-scoring throughput: ``rollbook replay reward`` over a ledger of stored trajectories, against
calling the same reward on the same decoded texts in a loop (what a user would do by hand).

    python bench/rescore.py --json                          # one JSON line; 10,000 rows, about a minute on 2 cores
    python bench/rescore.py --json --num-trajectories 2000 --workers 0 2

The ledger is made through the store's own ingest path (``Ledger.submit``: validation, the
write-ahead log, the fold into DuckDB) in a temporary run directory, with the ``config.json`` a
``rollbook run`` of the toy domains would write: ``--num-trajectories`` answers to the arithmetic and
reversal tasks of that config, in groups of 8, right about half the time (``make_ledger``; the tests
reuse it). Then, per reward (``math``, math-verify; ``bench.rescore:digit_match``, a ``module:function``
reward giving the share of answer characters in place) and per ``--workers``:

- ``replay``: ``rescore()`` (the command's code, in process): open the ledger, the selection through
  the SQL sandbox over a snapshot, decoding, the reward pool in chunks, a commit per 512 rows, into a
  fresh reward version. Timed from the call to its return (a pool's start and the snapshot included).
- ``baseline``: read the same rows from the DuckDB file (``duckdb.connect``, one SELECT), decode each
  output with the run's tokenizer, call the reward function on it in a loop in this process, and
  insert the results into a table of the same file: no pool, no sandbox, no resume, no per-row error
  record (``rollbook.rewards.score_row`` is the loop's guard against a raising verifier).

Reported per case: rows, seconds, rows/s of both (one baseline per reward), ``replay_over_baseline``
(rows/s over rows/s), and ``same_scores``: the replay's scores equal the baseline's row for row (a
score that differs fails the run). A benchmark, not a test: it asserts nothing about time. Progress
on stderr.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the pool's processes import bench.rescore:digit_match

GROUP_SIZE = 8
MODEL_ID = "tiny"


def digit_match(completion: str, row: Mapping[str, Any]) -> float:
    """A ``module:function`` reward: the share of the reference's characters the completion has in
    place (over the longer of the two), a graded variant of the toy domains' exact match."""
    got, want = completion.strip(), str(row["answer"])
    width = max(len(got), len(want))
    return sum(a == b for a, b in zip(got, want)) / width if width else 1.0


def make_ledger(
    run_dir: pathlib.Path, num_trajectories: int, *, seed: int = 0, domains: tuple[str, ...] = ("arithmetic", "reverse")
) -> pathlib.Path:
    """A run directory with a ledger of ``num_trajectories`` toy-task trajectories written through
    ``Ledger.submit`` (groups of ``GROUP_SIZE``, each answer right with probability 1/2, the toy
    verifier's reward as ``reward``) and the ``config.json`` of a toy run. Returns the ledger's path."""
    from rollbook.config import RunConfig, write_resolved
    from rollbook.store.ledger import Ledger
    from rollbook.tasks import TOKENIZER, build_domains, make_tasks, score
    from rollbook.v1 import rollbook_pb2 as pb

    config = RunConfig.model_validate({"run_dir": str(run_dir), "rollout": {"domains": list(domains), "num_digits": 2}})
    write_resolved(config, run_dir)
    built = build_domains(config.rollout)
    tasks = [
        t
        for d in built.values()
        for t in make_tasks(d, "train", config.rollout.num_train_tasks, config.rollout.seed, allow_fewer=True)
    ]
    rng = random.Random(seed)
    db = run_dir / "rollbook.duckdb"
    ledger = Ledger(db)
    try:
        ledger.register_model(MODEL_ID, TOKENIZER.vocab_size)
        ledger.publish_version(MODEL_ID, 0, "")
        batch: list[pb.Trajectory] = []
        now = time.time()
        for i in range(num_trajectories):
            if i % GROUP_SIZE == 0:
                task, group_id = rng.choice(tasks), uuid.uuid4().hex
            right = rng.random() < 0.5
            text = task.answer if right else "".join(rng.choice("0123456789abcde") for _ in range(len(task.answer)))
            output = TOKENIZER.encode(text) + [TOKENIZER.eos_token_id]
            outcome = score(task, text, built)
            batch.append(
                pb.Trajectory(
                    trajectory_id=uuid.uuid4().hex,
                    session_id=f"s{i}",
                    group_id=group_id,
                    group_size=GROUP_SIZE,
                    request_id=f"r{i}",
                    consumed=True,
                    task_id=task.task_id,
                    domain=task.domain,
                    model_id=MODEL_ID,
                    prompt_token_ids=TOKENIZER.encode(task.prompt, add_bos=True),
                    output_token_ids=output,
                    output_logprobs=[-0.5] * len(output),
                    output_versions=[0] * len(output),
                    temperature=1.0,
                    top_p=1.0,
                    finish_reason="stop",
                    reward=outcome.reward,
                    worker_id="bench",
                    created_at=now,
                )
            )
            if len(batch) == 1000:
                ledger.submit(batch)
                batch = []
        if batch:
            ledger.submit(batch)
    finally:
        ledger.close()
    return db


def baseline(db: pathlib.Path, reward: str, name: str) -> tuple[float, dict[str, float | None]]:
    """By hand: read, decode, call the reward in a loop, insert the results. Seconds and the scores."""
    import duckdb
    import pyarrow as pa

    from rollbook.config import RewardConfig
    from rollbook.rescore import RowSource, load_run_config, run_tokenizer
    from rollbook.rewards import build_reward, score_row

    started = time.perf_counter()
    config = load_run_config(db.parent / "config.json")
    tokenizer, _ = run_tokenizer(config)
    rows = RowSource.for_run(config)
    verifier = build_reward(RewardConfig(kind=reward))
    con = duckdb.connect(str(db))
    try:
        read = con.execute(
            "SELECT trajectory_id, task_id, domain, prompt_token_ids, output_token_ids FROM trajectories"
        ).fetchall()
        scores: dict[str, float | None] = {}
        for tid, task_id, domain, prompt, output in read:
            row, _ = rows.row(task_id, domain, prompt, tokenizer)
            outcome = score_row(verifier, tokenizer.completion_text(output), row).outcome
            scores[tid] = outcome.reward if outcome.status == "ok" else None
        con.register("_scores", pa.table({"trajectory_id": list(scores), "reward": list(scores.values())}))
        con.execute(f"CREATE TABLE {name} AS SELECT * FROM _scores")
    finally:
        con.close()
    return time.perf_counter() - started, scores


def replay_case(
    db: pathlib.Path, reward: str, workers: int, expected: dict[str, float | None], baseline_s: float
) -> dict[str, Any]:
    """One replay of ``reward`` with ``workers`` pool processes into a fresh version, checked row for
    row against the baseline's scores."""
    import duckdb

    from rollbook.cli.replay import rescore

    name = f"bench-{reward.rsplit(':', 1)[-1].replace('.', '-')}-w{workers}"
    print(f"bench/rescore: {reward}, {workers} worker(s): replay ...", file=sys.stderr, flush=True)
    started = time.perf_counter()
    result = rescore(db, reward=reward, name=name, workers=workers, progress=sys.stderr)
    replay_s = time.perf_counter() - started
    con = duckdb.connect(str(db), read_only=True)
    try:
        got = dict(con.execute("SELECT trajectory_id, reward FROM reward_versions WHERE name = ?", [name]).fetchall())
    finally:
        con.close()
    if got != expected:
        differ = [t for t in expected if got.get(t) != expected[t]][:3]
        raise SystemExit(
            f"bench/rescore: {reward}: replay and baseline disagree, e.g. {[(t, got.get(t), expected[t]) for t in differ]}"
        )
    rows = result.scored
    return {
        "reward": reward,
        "workers": workers,
        "rows": rows,
        "errors": result.errors,
        "replay_s": round(replay_s, 3),
        "replay_rows_per_s": round(rows / replay_s, 1),
        "baseline_s": round(baseline_s, 3),
        "baseline_rows_per_s": round(len(expected) / baseline_s, 1),
        "replay_over_baseline": round((rows / replay_s) / (len(expected) / baseline_s), 3),
        "same_scores": True,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-trajectories", type=int, default=10_000)
    p.add_argument("--workers", type=int, nargs="+", default=[2, 0], help="reward pool sizes to run (0: in process)")
    p.add_argument("--rewards", nargs="+", default=["math", "bench.rescore:digit_match"])
    p.add_argument("--json", action="store_true", help="print one JSON line")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rollbook-bench-rescore-") as tmp:
        run_dir = pathlib.Path(tmp) / "run"
        started = time.perf_counter()
        db = make_ledger(run_dir, args.num_trajectories)
        made_s = time.perf_counter() - started
        print(f"bench/rescore: {args.num_trajectories} trajectories stored in {made_s:.1f} s", file=sys.stderr, flush=True)
        cases = []
        for i, reward in enumerate(args.rewards):
            print(f"bench/rescore: {reward}: baseline ...", file=sys.stderr, flush=True)
            baseline_s, expected = baseline(db, reward, f"baseline_{i}")
            cases += [replay_case(db, reward, workers, expected, baseline_s) for workers in args.workers]
    report = {"bench": "rescore", "num_trajectories": args.num_trajectories, "ledger_s": round(made_s, 2), "cases": cases}
    if args.json:
        print(json.dumps(report), flush=True)
    else:
        for case in cases:
            print(case)
    return 0


if __name__ == "__main__":
    sys.exit(main())
