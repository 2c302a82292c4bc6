"""Bad input over the wire: every case gets a precise verdict or status code, the store stays up,
and no partial row is left behind (bad ids are absent from ``trajectories``; where a verdict was
given they are in ``rejections`` with its reason).

Run: ``python -m pytest tests/integration/test_bad_input.py -q``.
"""

from __future__ import annotations

import itertools

import grpc
import numpy as np
import pytest

from rollbook.trajectories import trajectory_from_dict
from rollbook.v1 import rollbook_pb2 as pb
from rollbook.v1 import rollbook_pb2_grpc as pb_grpc
from tests.integration.conftest import count, register, rows, start_store, submit_raw, traj

SUBMIT = "/rollbook.v1.TrajectoryStore/Submit"
LIMIT = 64 << 20  # the documented largest message (StoreConfig.max_message_bytes)
_probes = itertools.count()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    s = start_store(tmp_path_factory.mktemp("bad") / "rollbook.duckdb")
    with s.client() as client:
        register(client)
    yield s
    s.kill()


@pytest.fixture
def channel(store):
    with grpc.insecure_channel(store.address, options=[("grpc.max_send_message_length", 2 * LIMIT)]) as ch:
        yield ch


def assert_alive_and_clean(store, bad_ids: list[str], rejected: dict[str, str] | None = None) -> None:
    """The server still takes a normal submit and query; the bad ids left no partial row."""
    assert store.alive
    probe = f"alive-{next(_probes)}"
    with store.client() as client:
        assert client.submit([traj(probe)]).accepted == 1
        assert count(client, "trajectories", f"trajectory_id = '{probe}'") == 1
        quoted = ", ".join(f"'{t}'" for t in bad_ids)
        assert count(client, "trajectories", f"trajectory_id IN ({quoted})") == 0
        got = {
            r["trajectory_id"]: r["reason"]
            for r in rows(client, f"SELECT trajectory_id, reason FROM rejections WHERE trajectory_id IN ({quoted})")
        }
    assert got == (rejected or {})


def _raw_submit(channel, payload: bytes) -> list[pb.SubmitResponse]:
    call = channel.stream_stream(SUBMIT, request_serializer=lambda b: b, response_deserializer=pb.SubmitResponse.FromString)
    return list(call(iter([payload]), timeout=60))


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _request_with(trajectory_bytes: bytes) -> bytes:
    """A SubmitRequest holding one Trajectory given as raw bytes (field 1, length-delimited)."""
    return b"\x0a" + _varint(len(trajectory_bytes)) + trajectory_bytes


def _valid_bytes(tid: str, **drop: bool) -> bytes:
    t = traj(tid)
    for name in drop:
        t.pop(name)
    return trajectory_from_dict(t).SerializeToString()


# ---- does not parse -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "payload",
    [b"\xff\xff\xff", b"\x0a\x05ab", b"\x0a" + b"\xff" * 10, b"\x07"],
    ids=["garbage", "truncated-length", "overlong-varint", "bad-tag"],
)
def test_bytes_that_do_not_parse_are_invalid_argument(store, channel, payload):
    with pytest.raises(grpc.RpcError) as err:
        _raw_submit(channel, payload)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not parse as rollbook.v1.SubmitRequest" in err.value.details()
    assert_alive_and_clean(store, [])


WRONG_WIRE_TYPES = {
    # (tag bytes = field_number << 3 | wire_type, then a value of that wire type)
    "reward-as-varint": ("reward", b"\x98\x01" + b"\x05"),  # field 19 is a double (I64)
    "tokens-as-fixed32": ("output_token_ids", b"\x65" + b"\x01\x00\x00\x00"),  # 12 is int32: VARINT or packed LEN
    "logprobs-as-varint": ("output_logprobs", b"\x68" + b"\x01"),  # 13 is float: I32 or packed LEN
    "trajectory-id-as-varint": ("trajectory_id", b"\x08\x07"),  # 1 is a string
    "temperature-as-fixed64": ("temperature", b"\x79" + b"\x00" * 8),  # 15 is a float (I32)
}


@pytest.mark.parametrize("field,extra", list(WRONG_WIRE_TYPES.values()), ids=list(WRONG_WIRE_TYPES))
def test_a_field_with_the_wrong_wire_type_is_invalid_argument_or_rejected_never_accepted(store, channel, field, extra):
    tid = f"wire-{field}"
    body = _valid_bytes(tid, **{field: True}) + extra
    if field == "trajectory_id":
        body = _valid_bytes(tid) + extra  # the id is there too; the wrong-typed copy must not slip by
    try:
        responses = _raw_submit(channel, _request_with(body))
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "wire type" in exc.details() or "does not parse" in exc.details()
        assert_alive_and_clean(store, [tid])
        return
    [verdict] = [v for r in responses for v in r.verdicts]
    assert verdict.status == pb.Verdict.REJECTED, f"{field} with a wrong wire type was {pb.Verdict.Status.Name(verdict.status)}"
    assert_alive_and_clean(store, [tid], {tid: verdict.reason})


def test_a_top_level_field_with_the_wrong_wire_type_is_invalid_argument(store, channel):
    with pytest.raises(grpc.RpcError) as err:
        _raw_submit(channel, b"\x08\x01")  # SubmitRequest.trajectories (1) as a varint
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert_alive_and_clean(store, [])


def test_unknown_field_numbers_stay_legal_for_newer_clients(store, channel):
    body = _valid_bytes("wire-unknown-field") + b"\xf8\x07\x01"  # field 127: not in this contract
    [response] = _raw_submit(channel, _request_with(body))
    assert [v.status for v in response.verdicts] == [pb.Verdict.ACCEPTED]


def test_unary_rpcs_answer_garbage_with_invalid_argument(store, channel):
    for method in ("GetStats", "RegisterModel", "PublishVersion", "Query", "GetModel"):
        call = channel.unary_unary(
            f"/rollbook.v1.TrajectoryStore/{method}", request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        with pytest.raises(grpc.RpcError) as err:
            call(b"\xff\xff\xff", timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
    assert_alive_and_clean(store, [])


# ---- evidence rules at the wire -----------------------------------------------------------------


def test_empty_ids_are_missing_id_and_recorded(store, channel):
    stub = pb_grpc.TrajectoryStoreStub(channel)
    marker = "empty-id-session"
    [verdicts] = submit_raw(stub, [traj("", session_id=marker), traj("", session_id=marker), traj("empty-id-neighbour")])
    assert [(v.trajectory_id, v.status, v.reason) for v in verdicts] == [
        ("", pb.Verdict.REJECTED, "MISSING_ID"),
        ("", pb.Verdict.REJECTED, "MISSING_ID"),
        ("empty-id-neighbour", pb.Verdict.ACCEPTED, ""),
    ]
    with store.client() as client:
        assert count(client, "rejections", f"session_id = '{marker}' AND reason = 'MISSING_ID'") == 2
        assert count(client, "trajectories", "trajectory_id = ''") == 0
    assert_alive_and_clean(store, [])


def test_a_million_token_output_is_oversized(store, channel):
    n = 1_000_000
    big = traj("million-tokens", n=1)
    big.update(
        output_token_ids=np.arange(n, dtype=np.int32) % 500,
        output_logprobs=np.full(n, -0.5, np.float32),
        output_versions=np.zeros(n, np.int64),
    )
    [[verdict]] = submit_raw(pb_grpc.TrajectoryStoreStub(channel), [big])
    assert (verdict.status, verdict.reason) == (pb.Verdict.REJECTED, "OVERSIZED")
    assert str(n) in verdict.detail
    with store.client() as client:
        assert rows(client, "SELECT num_output_tokens FROM rejections WHERE trajectory_id = 'million-tokens'") == [
            {"num_output_tokens": n}
        ]
    assert_alive_and_clean(store, ["million-tokens"], {"million-tokens": "OVERSIZED"})


def test_a_message_above_the_64_mib_limit_is_resource_exhausted(store, channel):
    tid = "x" * 16
    body = trajectory_from_dict(traj(tid)).SerializeToString()
    filler = b"\xfa\x07" + _varint(LIMIT) + b"\0" * LIMIT  # field 127, LEN: pushes the message over 64 MiB
    payload = _request_with(body + filler)
    assert len(payload) > LIMIT
    with pytest.raises(grpc.RpcError) as err:
        _raw_submit(channel, payload)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    del payload, filler
    assert_alive_and_clean(store, [tid])


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_nonfinite_logprobs_are_nonfinite_logprob(store, channel, value):
    tid = f"nonfinite-{value}"
    lp = [-0.25] * 16
    lp[5] = value
    [[verdict]] = submit_raw(pb_grpc.TrajectoryStoreStub(channel), [traj(tid, output_logprobs=lp)])
    assert (verdict.status, verdict.reason) == (pb.Verdict.REJECTED, "NONFINITE_LOGPROB")
    assert "output_logprobs[5]" in verdict.detail
    assert_alive_and_clean(store, [tid], {tid: "NONFINITE_LOGPROB"})


@pytest.mark.parametrize("field,length", [("output_logprobs", 15), ("output_logprobs", 17), ("output_versions", 3)])
def test_mismatched_lengths_are_length_mismatch(store, channel, field, length):
    tid = f"mismatch-{field}-{length}"
    t = traj(tid)
    t[field] = t[field][:1] * length
    [[verdict]] = submit_raw(pb_grpc.TrajectoryStoreStub(channel), [t])
    assert (verdict.status, verdict.reason) == (pb.Verdict.REJECTED, "LENGTH_MISMATCH")
    assert_alive_and_clean(store, [tid], {tid: "LENGTH_MISMATCH"})


def test_bad_rows_in_a_batch_do_not_hold_back_or_corrupt_the_good_ones(store, channel):
    batch = [
        traj("mixed-good-0"),
        traj("mixed-nan", output_logprobs=[float("nan")] * 16),
        traj("mixed-good-1"),
        traj("mixed-short", output_versions=[0]),
        traj("mixed-good-2"),
    ]
    [verdicts] = submit_raw(pb_grpc.TrajectoryStoreStub(channel), batch)
    assert [v.status for v in verdicts] == [
        pb.Verdict.ACCEPTED,
        pb.Verdict.REJECTED,
        pb.Verdict.ACCEPTED,
        pb.Verdict.REJECTED,
        pb.Verdict.ACCEPTED,
    ]
    with store.client() as client:
        assert count(client, "trajectories", "trajectory_id LIKE 'mixed-good-%' AND num_output_tokens = 16") == 3
    assert_alive_and_clean(
        store, ["mixed-nan", "mixed-short"], {"mixed-nan": "NONFINITE_LOGPROB", "mixed-short": "LENGTH_MISMATCH"}
    )
