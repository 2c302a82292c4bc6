"""The standing hostile Submit suite (the non-SQL half; test_sql_hostile.py is the SQL half).

Against one real ``rollbook serve`` with all four role keys, from a seeded generator (the same
payloads every run):
- more than 10,000 hostile payloads: trajectories that break one ingest rule each (mixed into the
  same batches as good ones, on several concurrent streams), byte-mutated and random wire payloads
  (one stream each), good-looking trajectories sent with no key, a wrong key or another role's key,
  and replays of good trajectories;
- the good trajectories beside them.
Afterwards: the store is up and answers every RPC, every good trajectory is stored exactly once,
nothing from an unauthorized stream and no rule-breaking trajectory is stored, every stored row keeps
the documented invariants (docs/evidence.md), and the server's resident memory is back near its
start. The counts are printed even where pytest captures output (.ci/run).
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import math
import os
import time

import grpc
import numpy as np
import pytest

from rollbook.client import encode_submit_request
from rollbook.trajectories import trajectory_from_dict
from rollbook.v1 import rollbook_pb2 as pb
from rollbook.v1 import rollbook_pb2_grpc as pb_grpc
from tests.integration.conftest import VOCAB, register, rows, start_store, traj
from tests.integration.test_access import ROLE_OF_RPC, _call

SEED = 20261130
KEYS = {
    "worker_key": "hostile-worker-7c1f0e9d3b2a",
    "trainer_key": "hostile-trainer-4e8d2c6a1f09",
    "reader_key": "hostile-reader-b5a3917e2d4c",
    "admin_key": "hostile-admin-0f2e4d6c8b1a",
}
NUM_GOOD = 6000
NUM_HOSTILE_ROWS = 9000  # rule-breaking trajectories inside mixed batches
NUM_WIRE = 800  # mutated or random wire payloads, one stream each
NUM_UNAUTHORIZED = 240  # streams with no key / a wrong key / another role's key
BATCH = 64
STREAMS = 4
SUBMIT = "/rollbook.v1.TrajectoryStore/Submit"


def _bearer(key):
    return [] if key is None else [("authorization", f"Bearer {key}")]


WORKER = _bearer(KEYS["worker_key"])


# ---- the generator -------------------------------------------------------------------------------


def _good(i: int, rng: np.random.Generator) -> dict:
    n = int(rng.integers(1, 48))
    return traj(
        f"g-{i}",
        n=n,
        version=int(rng.integers(0, 2)),
        reward=float(rng.integers(0, 2)),
        output_token_ids=[int(x) for x in rng.integers(0, VOCAB, n)],
        output_logprobs=[float(x) for x in -rng.exponential(1.0, n)],
    )


def _break(t: dict, kind: str, rng: np.random.Generator) -> dict:
    """``t`` made to break exactly the rule ``kind`` (each one REJECTED by docs/evidence.md)."""
    n = len(t["output_token_ids"])
    j = int(rng.integers(0, n))
    lp, tok, ver = list(t["output_logprobs"]), list(t["output_token_ids"]), list(t["output_versions"])
    if kind == "empty_output":
        t.update(output_token_ids=[], output_logprobs=[], output_versions=[])
    elif kind == "missing_logprobs":
        t["output_logprobs"] = []
    elif kind == "short_logprobs":
        t["output_logprobs"] = lp[:-1] if n > 1 else []
    elif kind == "long_versions":
        t["output_versions"] = ver + [ver[-1]]
    elif kind == "negative_token":
        tok[j] = -int(rng.integers(1, 2**31 - 1))
        t["output_token_ids"] = tok
    elif kind == "negative_prompt_token":
        t["prompt_token_ids"] = [1, -7, 3]
    elif kind == "token_out_of_vocab":
        tok[j] = int(rng.integers(VOCAB, 2**31 - 1))
        t["output_token_ids"] = tok
    elif kind in ("nan_logprob", "inf_logprob", "neg_inf_logprob", "positive_logprob"):
        lp[j] = {
            "nan_logprob": math.nan,
            "inf_logprob": math.inf,
            "neg_inf_logprob": -math.inf,
            "positive_logprob": float(rng.uniform(0.5, 1e30)),
        }[kind]
        t["output_logprobs"] = lp
    elif kind == "decreasing_versions":
        t["output_versions"] = [1] * j + [0] * (n - j) if j > 0 else [1] + [0] * max(n - 1, 1)
        if len(t["output_versions"]) != n:
            t["output_token_ids"] = tok + [5]
            t["output_logprobs"] = lp + [-0.1]
    elif kind == "negative_version":
        t["output_versions"] = [-int(rng.integers(1, 2**40))] * n
    elif kind == "future_version":
        t["output_versions"] = [int(rng.integers(2, 2**62))] * n
    elif kind == "unregistered_model":
        t["model_id"] = f"no-such-model-{int(rng.integers(0, 1 << 30))}"
    elif kind in ("nan_reward", "inf_reward"):
        t["reward"] = math.nan if kind == "nan_reward" else -math.inf
    elif kind == "oversized_id":
        t["trajectory_id"] = t["trajectory_id"] + "x" * int(rng.integers(300, 5000))
    elif kind == "oversized_session":
        t["session_id"] = "s" * int(rng.integers(300, 5000))
    elif kind == "missing_id":
        t["trajectory_id"] = ""
    else:
        raise AssertionError(kind)
    return t


BREAKS = (
    "empty_output",
    "missing_logprobs",
    "short_logprobs",
    "long_versions",
    "negative_token",
    "negative_prompt_token",
    "token_out_of_vocab",
    "nan_logprob",
    "inf_logprob",
    "neg_inf_logprob",
    "positive_logprob",
    "decreasing_versions",
    "negative_version",
    "future_version",
    "unregistered_model",
    "nan_reward",
    "inf_reward",
    "oversized_id",
    "oversized_session",
    "missing_id",
)


def _mixed_batches(rng: np.random.Generator, good: list[pb.Trajectory]):
    """Batches of good, rule-breaking and replayed trajectories in random order, with the expected
    status of each position (ACCEPTED for a first good, REJECTED for a rule breaker; a replay's
    verdict is DUPLICATE only once its original was answered, so replays go in a later phase)."""
    kinds = collections.Counter()
    items: list[tuple[str, pb.Trajectory, str]] = [("good", t, "ACCEPTED") for t in good]
    for i in range(NUM_HOSTILE_ROWS):
        kind = BREAKS[int(rng.integers(0, len(BREAKS)))]
        kinds[kind] += 1
        t = _break(traj(f"h-{i}", n=int(rng.integers(1, 32))), kind, rng)
        items.append((kind, trajectory_from_dict(t), "REJECTED"))
    order = rng.permutation(len(items))
    items = [items[k] for k in order]
    return [items[k : k + BATCH] for k in range(0, len(items), BATCH)], kinds


def _wire_payloads(rng: np.random.Generator, good_bytes: bytes) -> list[tuple[str, bytes]]:
    """Mutations of a valid one-trajectory request (flipped, inserted, deleted bytes, truncations,
    absurd length prefixes) and random byte strings."""
    out = []
    for i in range(NUM_WIRE):
        data = bytearray(good_bytes.replace(b"m-template", f"m-{i:08d}".encode()[:10]))
        kind = ("flip", "insert", "delete", "truncate", "length", "random")[i % 6]
        if kind == "flip":
            for _ in range(int(rng.integers(1, 6))):
                data[int(rng.integers(0, len(data)))] ^= 1 << int(rng.integers(0, 8))
        elif kind == "insert":
            k = int(rng.integers(0, len(data)))
            data[k:k] = rng.bytes(int(rng.integers(1, 16)))
        elif kind == "delete":
            k = int(rng.integers(0, len(data) - 1))
            del data[k : k + int(rng.integers(1, 8))]
        elif kind == "truncate":
            data = data[: int(rng.integers(1, len(data)))]
        elif kind == "length":  # the outer length prefix claims far more (or less) than is there
            data[1:2] = bytes([0xFF, 0xFF, 0xFF, 0xFF, 0x0F]) if i % 2 else bytes([0x01])
        else:
            data = bytearray(rng.bytes(int(rng.integers(0, 4096))))
        out.append((kind, bytes(data)))
    return out


# ---- the suite -----------------------------------------------------------------------------------


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _stream(channel, payloads: list[bytes], metadata) -> list[pb.SubmitResponse]:
    call = channel.stream_stream(SUBMIT, request_serializer=None, response_deserializer=pb.SubmitResponse.FromString)
    return list(call(iter(payloads), metadata=metadata, timeout=120))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    s = start_store(tmp_path_factory.mktemp("hostile") / "rollbook.duckdb", **KEYS)
    yield s
    s.kill()


def test_hostile_submit_suite(store, capsys):
    t_start = time.monotonic()
    rng = np.random.default_rng(SEED)
    counts = collections.Counter()
    with store.client() as client:
        register(client)
        client.submit([traj(f"warm-{i}") for i in range(256)])  # the ledger's first allocations
        client.query("SELECT count(*) FROM trajectories")
    rss_start = _rss_mb(store.proc.pid)

    good = [trajectory_from_dict(_good(i, rng)) for i in range(NUM_GOOD)]
    batches, kinds = _mixed_batches(rng, good)
    counts.update({f"rule:{k}": v for k, v in kinds.items()})
    template = encode_submit_request([trajectory_from_dict(traj("m-template", n=8))])
    wire = _wire_payloads(rng, template)
    unauthorized = [
        (who, trajectory_from_dict(traj(f"u-{i}")))
        for i, who in zip(range(NUM_UNAUTHORIZED), itertools.cycle(("none", "wrong", "reader", "trainer")))
    ]

    options = [("grpc.max_send_message_length", 128 << 20), ("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.insecure_channel(store.address, options=options) for _ in range(STREAMS)]
    mismatches: list[str] = []

    def mixed(lane: int) -> None:
        mine = batches[lane::STREAMS]
        responses = _stream(channels[lane], [encode_submit_request([t for _, t, _ in b]) for b in mine], WORKER)
        assert len(responses) == len(mine)
        for b, r in zip(mine, responses):
            assert len(r.verdicts) == len(b)
            for (kind, t, want), v in zip(b, r.verdicts):
                if pb.Verdict.Status.Name(v.status) != want:
                    mismatches.append(f"{kind} {t.trajectory_id[:40]}: {pb.Verdict.Status.Name(v.status)} {v.reason}")

    def wire_lane(lane: int) -> collections.Counter:
        c = collections.Counter()
        for kind, payload in wire[lane::STREAMS]:
            try:
                _stream(channels[lane], [payload], WORKER)
                c[f"wire:{kind}:answered"] += 1
            except grpc.RpcError as exc:
                assert exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED), (kind, exc)
                c[f"wire:{kind}:{exc.code().name}"] += 1
        return c

    def unauthorized_lane(lane: int) -> collections.Counter:
        c = collections.Counter()
        keys = {"none": None, "wrong": "not-a-key-of-anyone-1234", "reader": KEYS["reader_key"], "trainer": KEYS["trainer_key"]}
        for who, t in unauthorized[lane::STREAMS]:
            try:
                _stream(channels[lane], [encode_submit_request([t])], _bearer(keys[who]))
                c["unauthorized:SERVED"] += 1
            except grpc.RpcError as exc:
                c[f"unauthorized:{who}:{exc.code().name}"] += 1
        return c

    with concurrent.futures.ThreadPoolExecutor(3 * STREAMS) as pool:
        futures = [pool.submit(mixed, lane) for lane in range(STREAMS)]
        futures += [pool.submit(wire_lane, lane) for lane in range(STREAMS)]
        futures += [pool.submit(unauthorized_lane, lane) for lane in range(STREAMS)]
        for f in futures:
            result = f.result()
            if isinstance(result, collections.Counter):
                counts.update(result)
    assert not mismatches, (len(mismatches), mismatches[:10])

    # replays of good trajectories, in batches with fresh rule breakers: DUPLICATE, never stored twice
    replays = [good[int(k)] for k in rng.choice(NUM_GOOD, 500, replace=False)]
    responses = _stream(channels[0], [encode_submit_request(replays[k : k + BATCH]) for k in range(0, 500, BATCH)], WORKER)
    assert [v.status for r in responses for v in r.verdicts] == [pb.Verdict.DUPLICATE] * 500
    counts["replay:DUPLICATE"] = 500
    for ch in channels:
        ch.close()

    hostile_total = NUM_HOSTILE_ROWS + NUM_WIRE + NUM_UNAUTHORIZED + 500
    assert hostile_total >= 10_000
    assert counts["unauthorized:SERVED"] == 0
    assert store.alive

    # every RPC still answers (with the key of its role)
    with grpc.insecure_channel(store.address) as channel:
        stub = pb_grpc.TrajectoryStoreStub(channel)
        for rpc, role in ROLE_OF_RPC.items():
            try:
                _call(stub, rpc, _bearer(KEYS[f"{role}_key"]))
            except grpc.RpcError as exc:
                assert exc.code() in (grpc.StatusCode.NOT_FOUND,), (rpc, exc.code(), exc.details())

    with store.client() as client:
        stored = rows(
            client,
            "SELECT count(*) AS n, count(DISTINCT trajectory_id) AS d, "
            "count(*) FILTER (WHERE trajectory_id LIKE 'g-%') AS good, "
            "count(*) FILTER (WHERE trajectory_id LIKE 'h-%' OR trajectory_id LIKE 'u-%') AS bad "
            "FROM trajectories",
        )[0]
        assert stored["n"] == stored["d"]  # nothing stored twice
        assert stored["good"] == NUM_GOOD
        assert stored["bad"] == 0
        broken = rows(
            client,
            """
            SELECT trajectory_id FROM trajectories
             WHERE len(output_token_ids) = 0 OR len(output_logprobs) <> len(output_token_ids)
                OR len(output_versions) <> len(output_token_ids)
                OR list_bool_or(list_transform(output_logprobs, lambda x: isnan(x) OR isinf(x) OR x > 1e-3))
                OR list_bool_or(list_transform(output_token_ids, lambda x: x < 0 OR x >= 512))
                OR list_bool_or(list_transform(output_versions, lambda x: x < 0 OR x > 1))
             LIMIT 5""",
        )
        assert broken == []
        rejected = rows(client, "SELECT count(*) AS n FROM rejections WHERE trajectory_id LIKE 'h-%'")[0]["n"]
        mutated_stored = rows(client, "SELECT count(*) AS n FROM trajectories WHERE trajectory_id LIKE 'm-%'")[0]["n"]

    time.sleep(1.0)
    rss_end = _rss_mb(store.proc.pid)
    elapsed = time.monotonic() - t_start
    with capsys.disabled():  # the counts show in .ci/run's output, passing or not
        print(f"\nhostile Submit suite (seed {SEED}) in {elapsed:.1f} s on {os.cpu_count()} CPUs:")
        print(
            f"  hostile payloads: {hostile_total} = {NUM_HOSTILE_ROWS} rule-breaking trajectories in mixed batches "
            f"+ {NUM_WIRE} mutated/random wire payloads + {NUM_UNAUTHORIZED} unauthorized streams + 500 replays"
        )
        print(
            f"  good trajectories: {NUM_GOOD}, stored exactly once: {stored['good']}; rule breakers stored: {stored['bad']}, "
            f"recorded in rejections: {rejected}; mutated wire payloads that still parsed as valid and were stored: {mutated_stored}"
        )
        for key in sorted(counts):
            print(f"    {key:40s} {counts[key]}")
        print(f"  server RSS: {rss_start:.0f} MB at start, {rss_end:.0f} MB after")
    assert rss_end < rss_start * 1.5 + 200, (rss_start, rss_end)
