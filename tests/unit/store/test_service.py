"""The servicer's status mapping (store/service.py ``DOMAIN_STATUS``): each domain error answers its
status; any other exception escaping a handler is a bug and must not look like a domain answer
(a stray ``KeyError`` is not NOT_FOUND, a stray ``ValueError`` not INVALID_ARGUMENT).

Fakes only (a ledger that raises what it is told); the real store answers the same through gRPC in
tests/integration/test_store_grpc.py and test_leases.py.

Run: ``python -m pytest tests/unit/store/test_service.py -q``.
"""

from __future__ import annotations

import grpc
import pytest

from rollbook.store import service as service_module
from rollbook.store.ledger import InvalidReward, ModelNotRegistered, NotRewardable, Outcome, UnknownTrajectory
from rollbook.store.service import Abort, SyncContext, TrajectoryStoreService
from rollbook.store.sql import QueryLimits
from rollbook.v1 import rollbook_pb2 as pb
from rollbook.validator.pull import InvalidPull, LeaseError, NotLeaseOwner, UnknownLease


class RaisingLedger:
    def __init__(self, exc: BaseException):
        self.exc = exc

    def set_reward(self, *args, **kwargs):
        raise self.exc

    def publish_version(self, *args, **kwargs):
        raise self.exc

    def ack_batch(self, *args, **kwargs):
        raise self.exc

    def pull_batch(self, *args, **kwargs):
        raise self.exc


REQUESTS = {
    "SetReward": pb.SetRewardRequest(trajectory_id="t", reward=1.0),
    "PublishVersion": pb.PublishVersionRequest(model_id="m", version=1),
    "AckBatch": pb.AckBatchRequest(lease_id="l", trainer_id="t"),
    "PullBatch": pb.PullBatchRequest(trainer_id="t", model_id="m", num_samples=1),
}


@pytest.fixture(autouse=True)
def no_sandbox(monkeypatch):
    monkeypatch.setattr(service_module, "_sandbox", lambda ledger, limits: None)  # no Query here


def call(rpc: str, exc: BaseException):
    service = TrajectoryStoreService(RaisingLedger(exc), query_limits=QueryLimits())
    return service.call(rpc, REQUESTS[rpc], SyncContext())


@pytest.mark.parametrize(
    "rpc, exc, code",
    [
        ("SetReward", UnknownTrajectory("unknown trajectory 't'"), grpc.StatusCode.NOT_FOUND),
        ("SetReward", NotRewardable("trajectory 't' is already leased"), grpc.StatusCode.FAILED_PRECONDITION),
        ("SetReward", InvalidReward("NONFINITE_REWARD: reward = nan"), grpc.StatusCode.INVALID_ARGUMENT),
        ("PublishVersion", ModelNotRegistered("model 'm' is not registered"), grpc.StatusCode.FAILED_PRECONDITION),
        ("AckBatch", UnknownLease("unknown lease 'l'"), grpc.StatusCode.NOT_FOUND),
        ("AckBatch", NotLeaseOwner("lease l was issued to trainer 'u'"), grpc.StatusCode.PERMISSION_DENIED),
        ("AckBatch", LeaseError("lease l expired and its rows went to another lease"), grpc.StatusCode.FAILED_PRECONDITION),
        ("PullBatch", InvalidPull("model_id is required"), grpc.StatusCode.INVALID_ARGUMENT),
    ],
)
def test_each_domain_error_answers_its_status_with_its_message(rpc, exc, code):
    with pytest.raises(Abort) as aborted:
        call(rpc, exc)
    assert aborted.value.code == code and aborted.value.details == str(exc)


@pytest.mark.parametrize("rpc", sorted(REQUESTS))
@pytest.mark.parametrize(
    "bug",
    [KeyError("row_id"), ValueError("bad cast"), LookupError("x"), RuntimeError("boom")],
    ids=["KeyError", "ValueError", "LookupError", "RuntimeError"],
)
def test_any_other_exception_is_not_mapped_to_a_domain_status(rpc, bug):
    with pytest.raises(type(bug)) as raised:  # escapes the handler: grpc answers INTERNAL
        call(rpc, bug)
    assert raised.value is bug


@pytest.mark.parametrize("size", [0, 1, 127, 128, 300_000])
def test_a_bytes_field_appended_to_an_encoded_message_parses_as_the_message_with_it_set(size):
    import pyarrow as pa

    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    head = pb.PullBatchResponse(lease_id="lease-1", num_rows=7, stats_json='{"a": 1}')
    encoded = service_module.with_bytes_field(
        head.SerializeToString(), pb.PullBatchResponse.ARROW_IPC_FIELD_NUMBER, pa.py_buffer(payload)
    )
    expected = pb.PullBatchResponse(lease_id="lease-1", num_rows=7, stats_json='{"a": 1}', arrow_ipc=payload)
    assert pb.PullBatchResponse.FromString(encoded) == expected
    assert len(encoded) == len(expected.SerializeToString())


@pytest.mark.parametrize(
    "outcomes",
    [
        [],
        [Outcome("t-1", "ACCEPTED"), Outcome("t-2", "DUPLICATE")],
        [Outcome("", "REJECTED", "MISSING_ID", "trajectory_id is empty")],  # proto3 leaves "" out
        [Outcome("é" * 90, "REJECTED", "OVERSIZED", "d" * 300)],  # lengths over 127: two-byte varints
        [Outcome("x", "ACCEPTED"), Outcome("y", "REJECTED", "NAN_LOGPROB", "")],
    ],
)
def test_the_submit_response_is_written_as_protobuf_writes_it(outcomes):
    want = pb.SubmitResponse(
        verdicts=[
            pb.Verdict(trajectory_id=o.trajectory_id, status=pb.Verdict.Status.Value(o.status), reason=o.reason, detail=o.detail)
            for o in outcomes
        ]
    )
    got = service_module.submit_response(outcomes)
    assert got == want.SerializeToString()
    assert pb.SubmitResponse.FromString(got) == want
