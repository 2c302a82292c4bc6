"""The evidence chain, hardened. Each case is a way, reachable from outside over the
real gRPC path, an exported row could differ from what was experienced or a value ingest
let through; each test here drives one case through a real ``rollbook serve`` process (or an
in-process ``create_server``, still a real gRPC server over a real DuckDB file) and checks the
documented behaviour (docs/evidence.md).

Run: python -m pytest tests/integration/test_evidence_hardening.py -q
"""

from __future__ import annotations

import math
import struct
import time

import grpc
import pytest

from rollbook.config import ValidatorConfig
from rollbook.trajectories import trajectory_from_dict, varint_bytes
from rollbook.v1 import rollbook_pb2 as pb
from tests.integration.procs import InProcessStore, ServeProcess, ids_in, rows, rpc_code, trajectory

MODEL = "hard-model"
VOCAB = 64
SUBMIT = "/rollbook.v1.TrajectoryStore/Submit"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    proc = ServeProcess(tmp_path_factory.mktemp("hardening") / "rollbook.duckdb")
    client = proc.client()
    _own_model(client, MODEL, versions=(0, 1, 2))
    yield client
    client.close()
    proc.stop()


def _own_model(client, model_id: str, versions=(0,)) -> None:
    client.register_model(model_id, vocab_size=VOCAB)
    for v in versions:
        client.publish_version(model_id, v)


def _pull(client, model_id: str, *, trainer_id: str = "hard", trainer_version: int = 0, max_staleness: int = 100):
    return client.pull_batch(
        trainer_id=trainer_id, trainer_version=trainer_version, max_staleness=max_staleness, num_samples=1000, model_id=model_id
    )


def _served(batch) -> dict[str, float]:
    return dict(zip(batch.table.column("trajectory_id").to_pylist(), batch.table.column("reward").to_pylist()))


def _rejections(client, model_id: str) -> dict[str, tuple[str, str]]:
    return {
        r["trajectory_id"]: (r["reason"], r["detail"])
        for r in rows(client, f"SELECT trajectory_id, reason, detail FROM rejections WHERE model_id = '{model_id}'")
    }


def _raw_submit(client, payload: bytes) -> list[pb.SubmitResponse]:
    """One Submit stream carrying ``payload`` as it is (bytes a protobuf library would never write)."""
    return list(client._submit(iter([payload]), timeout=60))


# ---- 1. a consumed attempt rejected at ingest: no unconsumed attempt of its call trains ------------


@pytest.mark.parametrize("order", ["same-batch", "rejected-after-ready"])
def test_consumed_attempt_rejected_at_ingest_orphans_the_unconsumed_ones(store, order):
    model = f"consumed-rej-{order}"
    _own_model(store, model)
    t0 = time.time()
    unconsumed = trajectory(
        f"{order}-a0",
        model_id=model,
        request_id=f"call-{order}",
        session_id=f"s-{order}",
        attempt=0,
        consumed=False,
        created_at=t0,
    )
    bad = trajectory(
        f"{order}-a1",
        model_id=model,
        request_id=f"call-{order}",
        session_id=f"s-{order}",
        attempt=1,
        consumed=True,
        created_at=t0 + 1,
        output_logprobs=[-0.5, math.nan, -0.5, -0.5],
    )
    if order == "same-batch":
        verdicts = store.submit([unconsumed, bad]).verdicts
    else:  # the unconsumed attempt is already rewarded and its group of one ready when the consumed one arrives
        verdicts = dict(store.submit([unconsumed]).verdicts)
        assert rows(store, f"SELECT status FROM trajectories WHERE trajectory_id = '{order}-a0'") == [{"status": "ready"}]
        verdicts.update(store.submit([bad]).verdicts)
    assert verdicts[f"{order}-a0"].status == pb.Verdict.ACCEPTED
    assert (verdicts[f"{order}-a1"].status, verdicts[f"{order}-a1"].reason) == (pb.Verdict.REJECTED, "NONFINITE_LOGPROB")
    assert _pull(store, model).num_rows == 0
    rejected = _rejections(store, model)
    assert rejected[f"{order}-a0"][0] == "RETRY_ORPHAN"
    assert f"{order}-a1" in rejected[f"{order}-a0"][1] and "NONFINITE_LOGPROB" in rejected[f"{order}-a0"][1]
    assert ids_in(store, "trajectories", f"model_id = '{model}'") == set()


# ---- 2. SetReward by session: the latest consumed-or-only attempt ----------------------------------


def test_session_reward_goes_to_the_latest_consumed_or_only_attempt(store):
    model = "session-reward"
    _own_model(store, model)
    t0 = time.time()
    session = "sess-latest"
    call_1 = [
        trajectory(
            f"r1-a{k}",
            model_id=model,
            session_id=session,
            request_id="r1",
            attempt=k,
            consumed=(k == 1),
            created_at=t0 + k,
            reward=None,
        )
        for k in range(2)
    ]
    call_2 = [
        trajectory(
            "r2-a0",
            model_id=model,
            session_id=session,
            request_id="r2",
            attempt=0,
            consumed=False,
            created_at=t0 + 10,
            reward=None,
        )
    ]
    assert store.submit(call_1 + call_2).accepted == 3
    assert store.set_reward(0.75, session_id=session) == "r2-a0"
    assert rows(
        store, f"SELECT trajectory_id, original_reward FROM trajectories WHERE model_id = '{model}' ORDER BY trajectory_id"
    ) == [{"trajectory_id": "r1-a1", "original_reward": None}, {"trajectory_id": "r2-a0", "original_reward": 0.75}]


# ---- 3. a group with members stale for this pull is never served short -----------------------------


def test_group_with_stale_members_is_not_served_partially_under_wait(store):
    model = "stale-group"
    _own_model(store, model, versions=(0, 1, 2))
    members = [
        trajectory(f"sg-{i}", model_id=model, group_id="sg", group_size=4, version=0 if i < 2 else 2, reward=float(i))
        for i in range(4)
    ]
    assert store.submit(members).accepted == 4
    batch = _pull(store, model, trainer_version=2, max_staleness=1)
    assert batch.num_rows == 0, _served(batch)
    rejected = _rejections(store, model)
    assert {t: r for t, (r, _) in rejected.items()} == {
        "sg-0": "STALE",
        "sg-1": "STALE",
        "sg-2": "INCOMPLETE_GROUP",
        "sg-3": "INCOMPLETE_GROUP",
    }
    assert "STALE" in rejected["sg-2"][1] and "wait" in rejected["sg-2"][1]
    assert _pull(store, model, trainer_version=2, max_staleness=1).num_rows == 0


def test_whole_fresh_group_beside_it_is_still_served_normalized_over_all_members(store):
    model = "stale-group-fresh"
    _own_model(store, model, versions=(0, 1, 2))
    fresh = [trajectory(f"fg-{i}", model_id=model, group_id="fg", group_size=4, version=2, reward=float(i)) for i in range(4)]
    store.submit(fresh + [trajectory("old-solo", model_id=model, group_id="", version=0)])
    served = _served(_pull(store, model, trainer_version=2, max_staleness=1))
    assert sorted(served) == ["fg-0", "fg-1", "fg-2", "fg-3"]
    std = math.sqrt(sum((r - 1.5) ** 2 for r in range(4)) / 4)
    for i in range(4):
        assert served[f"fg-{i}"] == pytest.approx((i - 1.5) / (std + 1e-5))


# ---- 4. rewards are bounded ------------------------------------------------------------------------


@pytest.mark.parametrize("reward", [1e200, -1e200, 1e6 * 1.5])
def test_huge_finite_reward_is_rejected_at_ingest(store, reward):
    tid = f"huge-{reward:g}"
    verdict = store.submit([trajectory(tid, model_id=MODEL, reward=reward)]).verdicts[tid]
    assert (verdict.status, verdict.reason) == (pb.Verdict.REJECTED, "REWARD_OUT_OF_RANGE"), verdict.detail
    assert ids_in(store, "trajectories", f"trajectory_id = '{tid}'") == set()


def test_a_reward_at_the_bound_is_accepted(store):
    assert store.submit([trajectory("edge-reward", model_id=MODEL, reward=-1e6)]).accepted == 1


def test_set_reward_out_of_range_is_invalid_argument(store):
    store.submit([trajectory("later-huge", model_id=MODEL, reward=None)])
    for reward in (1e200, -1e7):
        assert rpc_code(lambda: store.set_reward(reward, trajectory_id="later-huge")) == grpc.StatusCode.INVALID_ARGUMENT
    assert rows(store, "SELECT original_reward FROM trajectories WHERE trajectory_id = 'later-huge'") == [
        {"original_reward": None}
    ]


# ---- 5. pulls name their model; a lease is acked by its own trainer --------------------------------


def test_pull_without_model_id_is_refused_and_stales_nothing(store):
    model = "any-model-victim"
    _own_model(store, model, versions=(0,))
    store.submit([trajectory(f"victim-{i}", model_id=model, reward=None) for i in range(3)])
    call = lambda: store.pull_batch(
        trainer_id="other", trainer_version=100, max_staleness=0, num_samples=10, model_id=""
    )  # the proto default, once "any model"
    assert rpc_code(call) == grpc.StatusCode.INVALID_ARGUMENT
    assert rows(store, f"SELECT count(*) AS n FROM rejections WHERE model_id = '{model}'") == [{"n": 0}]
    assert len(ids_in(store, "trajectories", f"model_id = '{model}'")) == 3


def test_ack_by_another_trainer_is_permission_denied(store):
    model = "ack-owner"
    _own_model(store, model)
    store.submit([trajectory("owned", model_id=model)])
    batch = _pull(store, model, trainer_id="owner")
    assert batch.num_rows == 1
    assert rpc_code(lambda: store.ack_batch(batch.lease_id, "intruder")) == grpc.StatusCode.PERMISSION_DENIED
    assert rpc_code(lambda: store.ack_batch(batch.lease_id, "")) == grpc.StatusCode.PERMISSION_DENIED
    assert rows(store, f"SELECT count(acked_at) AS n FROM leases WHERE lease_id = '{batch.lease_id}'") == [{"n": 0}]
    assert store.ack_batch(batch.lease_id, "owner") == 1


def test_pull_without_trainer_id_is_refused(store):
    call = lambda: store.pull_batch(trainer_id="", trainer_version=0, max_staleness=0, num_samples=10, model_id=MODEL)
    assert rpc_code(call) == grpc.StatusCode.INVALID_ARGUMENT


# ---- 6. limits and documented behaviour -----------------------------------------------------------

STRING_FIELDS = [
    "trajectory_id",
    "session_id",
    "group_id",
    "request_id",
    "task_id",
    "domain",
    "model_id",
    "worker_id",
    "finish_reason",
]


@pytest.mark.parametrize("name", STRING_FIELDS)
def test_every_string_field_over_256_chars_is_oversized(store, name):
    t = trajectory(f"long-{name}", model_id=MODEL)
    t[name] = "x" * 257
    result = store.submit([t])
    (verdict,) = result.verdicts.values()
    assert (verdict.status, verdict.reason) == (pb.Verdict.REJECTED, "OVERSIZED"), verdict.detail
    assert name in verdict.detail and "256" in verdict.detail


def test_a_1_mib_task_id_is_oversized_and_256_chars_are_fine(store):
    verdicts = store.submit(
        [
            trajectory("mib-task", model_id=MODEL, task_id="t" * (1 << 20)),
            trajectory("ok-task", model_id=MODEL, task_id="t" * 256, worker_id="w" * 256),
        ]
    ).verdicts
    assert verdicts["mib-task"].reason == "OVERSIZED"
    assert verdicts["ok-task"].status == pb.Verdict.ACCEPTED


def test_request_ids_are_scoped_per_session_and_model(store):
    model = "scoped-requests"
    _own_model(store, model)
    same_call_name = [
        trajectory(f"turn0-{s}", model_id=model, session_id=s, request_id="turn-0", consumed=False) for s in ("sess-a", "sess-b")
    ]
    assert store.submit(same_call_name).accepted == 2
    assert sorted(_served(_pull(store, model))) == ["turn0-sess-a", "turn0-sess-b"]
    assert _rejections(store, model) == {}


def test_a_rejected_id_resubmitted_is_duplicate_and_the_detail_says_why(store):
    bad = trajectory("fixed-later", model_id=MODEL, output_logprobs=[-0.5, 0.5, -0.5, -0.5])
    assert store.submit([bad]).verdicts["fixed-later"].reason == "POSITIVE_LOGPROB"
    fixed = trajectory("fixed-later", model_id=MODEL)
    verdict = store.submit([fixed]).verdicts["fixed-later"]
    assert verdict.status == pb.Verdict.DUPLICATE
    assert "REJECTED" in verdict.detail and "new trajectory_id" in verdict.detail
    assert ids_in(store, "trajectories", "trajectory_id = 'fixed-later'") == set()


# ---- 7. values ingest let through -------------------------------------------------------------------

VALUE_CASES = [
    ("temperature-nan", {"temperature": math.nan}, "INVALID_SAMPLING_PARAMS"),
    ("temperature-inf", {"temperature": math.inf}, "INVALID_SAMPLING_PARAMS"),
    ("temperature-negative", {"temperature": -0.5}, "INVALID_SAMPLING_PARAMS"),
    ("top-p-nan", {"top_p": math.nan}, "INVALID_SAMPLING_PARAMS"),
    ("top-p-above-1", {"top_p": 1.5}, "INVALID_SAMPLING_PARAMS"),
    ("top-p-zero", {"top_p": 0.0}, "INVALID_SAMPLING_PARAMS"),
    ("top-k-below-minus-1", {"top_k": -2}, "INVALID_SAMPLING_PARAMS"),
    ("created-at-nan", {"created_at": math.nan}, "NONFINITE_CREATED_AT"),
    ("created-at-inf", {"created_at": -math.inf}, "NONFINITE_CREATED_AT"),
    ("group-size-huge", {"group_size": 2**32 - 1}, "INVALID_GROUP_SIZE"),
]


@pytest.mark.parametrize("name,fields,code", VALUE_CASES, ids=[c[0] for c in VALUE_CASES])
def test_values_ingest_let_through_get_a_reason_code(store, name, fields, code):
    tid = f"value-{name}"
    verdict = store.submit([trajectory(tid, model_id=MODEL, **fields)]).verdicts[tid]
    assert (verdict.status, verdict.reason) == (pb.Verdict.REJECTED, code), verdict.detail
    assert rows(store, f"SELECT reason FROM rejections WHERE trajectory_id = '{tid}'") == [{"reason": code}]


def test_temperature_zero_and_top_p_one_are_fine(store):
    assert store.submit([trajectory("greedy", model_id=MODEL, temperature=0.0, top_p=1.0, top_k=-1)]).accepted == 1


def test_group_size_2_to_the_64_minus_1_is_not_stored_wrapped(store):
    wire = trajectory_from_dict(trajectory("gs-wrap", model_id=MODEL)).SerializeToString()
    wire += varint_bytes(4 << 3 | 0) + varint_bytes(2**64 - 1)  # the last value of a scalar field wins
    (response,) = _raw_submit(store, varint_bytes(1 << 3 | 2) + varint_bytes(len(wire)) + wire)
    (verdict,) = response.verdicts
    assert (verdict.status, verdict.reason) == (pb.Verdict.REJECTED, "INVALID_GROUP_SIZE"), verdict.detail
    assert ids_in(store, "trajectories", "trajectory_id = 'gs-wrap'") == set()


def test_a_2_mib_finish_reason_is_oversized(store):
    verdict = store.submit([trajectory("fat-finish", model_id=MODEL, finish_reason="f" * (2 << 20))]).verdicts["fat-finish"]
    assert (verdict.status, verdict.reason) == (pb.Verdict.REJECTED, "OVERSIZED")


def _packed(number: int, payload: bytes) -> bytes:
    return varint_bytes(number << 3 | 2) + varint_bytes(len(payload)) + payload


SPLIT_RECORDS = {
    # one varint (0x85 0x00 = 5) cut across two packed records: protobuf refuses the first record
    "tokens": (_packed(12, b"\x85") + _packed(12, b"\x00") + _packed(13, struct.pack("<f", -0.5)) + _packed(14, b"\x00")),
    "versions": (_packed(12, b"\x05") + _packed(13, struct.pack("<f", -0.5)) + _packed(14, b"\x80") + _packed(14, b"\x00")),
    "logprobs": (
        _packed(12, b"\x05")
        + _packed(13, struct.pack("<f", -0.5)[:3])
        + _packed(13, struct.pack("<f", -0.5)[3:])
        + _packed(14, b"\x00")
    ),
}


@pytest.mark.parametrize("name", sorted(SPLIT_RECORDS))
def test_a_value_split_across_packed_records_is_invalid_argument(store, name):
    tid = f"split-{name}"
    scalars = trajectory(tid, model_id=MODEL)
    for array in ("output_token_ids", "output_logprobs", "output_versions"):
        scalars[array] = []
    wire = trajectory_from_dict(scalars).SerializeToString() + SPLIT_RECORDS[name]
    with pytest.raises(grpc.RpcError) as err:
        _raw_submit(store, varint_bytes(1 << 3 | 2) + varint_bytes(len(wire)) + wire)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (
        ids_in(store, "trajectories", f"trajectory_id = '{tid}'") | ids_in(store, "rejections", f"trajectory_id = '{tid}'")
        == set()
    )


def test_the_same_values_in_whole_packed_records_are_accepted(store):
    scalars = trajectory("split-whole", model_id=MODEL)
    for array in ("output_token_ids", "output_logprobs", "output_versions"):
        scalars[array] = []
    wire = (
        trajectory_from_dict(scalars).SerializeToString()
        + _packed(12, b"\x85\x00")
        + _packed(12, b"")
        + _packed(13, struct.pack("<f", -0.5))
        + _packed(14, b"\x00")
    )
    (response,) = _raw_submit(store, varint_bytes(1 << 3 | 2) + varint_bytes(len(wire)) + wire)
    assert response.verdicts[0].status == pb.Verdict.ACCEPTED, response.verdicts[0].detail
    assert rows(store, "SELECT output_token_ids FROM trajectories WHERE trajectory_id = 'split-whole'") == [
        {"output_token_ids": [5]}
    ]


# ---- the same rules with the other incomplete-group policies (in-process server) ------------------


@pytest.fixture
def configured_store(tmp_path):
    started: list[InProcessStore] = []

    def start(**validator):
        s = InProcessStore(tmp_path / f"store{len(started)}.duckdb", validator=ValidatorConfig(**validator))
        started.append(s)
        client = s.client()
        _own_model(client, MODEL, versions=(0, 1, 2))
        return client

    yield start
    for s in started:
        s.stop()


def test_group_with_stale_members_under_keep_is_served_with_its_true_size(configured_store):
    client = configured_store(incomplete_group_policy="keep")
    client.submit(
        [
            trajectory(f"kg-{i}", model_id=MODEL, group_id="kg", group_size=4, version=0 if i < 2 else 2, reward=float(i))
            for i in range(4)
        ]
    )
    served = _served(_pull(client, MODEL, trainer_version=2, max_staleness=1))
    assert sorted(served) == ["kg-2", "kg-3"]  # keep: the true size, as documented
    assert served["kg-2"] == pytest.approx(-1.0, abs=1e-3) and served["kg-3"] == pytest.approx(1.0, abs=1e-3)


def test_group_with_stale_members_under_drop_is_rejected_whole(configured_store):
    client = configured_store(incomplete_group_policy="drop")
    client.submit(
        [
            trajectory(f"dg-{i}", model_id=MODEL, group_id="dg", group_size=4, version=0 if i < 2 else 2, reward=float(i))
            for i in range(4)
        ]
    )
    assert _pull(client, MODEL, trainer_version=2, max_staleness=1).num_rows == 0
    assert {t: r for t, (r, _) in _rejections(client, MODEL).items()} == {
        "dg-0": "STALE",
        "dg-1": "STALE",
        "dg-2": "INCOMPLETE_GROUP",
        "dg-3": "INCOMPLETE_GROUP",
    }
