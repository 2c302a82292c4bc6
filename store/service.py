"""The ``rollbook.v1.TrajectoryStore`` gRPC servicer: thin methods over the ledger and the sandbox.

Handlers are registered by hand (``handlers()``) rather than through the generated
``add_..._to_server`` so that a request that does not parse as its message answers
``INVALID_ARGUMENT`` with the decoder's message instead of gRPC's generic ``INTERNAL``.
"""

from __future__ import annotations

import hmac
import io
import json
import logging
import shutil
import time
from typing import Callable, Iterator

import grpc
import pyarrow as pa

from rollbook.store.ledger import Ledger, NotRewardable, Outcome
from rollbook.store.prepare import MalformedRequest, Prepared, parse_message, prepare_bytes
from rollbook.store.sql import QueryError, QueryLimits
from rollbook.v1 import rollbook_pb2 as pb
from rollbook.validator.pull import LeaseError, NotLeaseOwner, PullRequest, UnknownLease, check_request

log = logging.getLogger("rollbook.store.service")

_STATUS = {"ACCEPTED": pb.Verdict.ACCEPTED, "DUPLICATE": pb.Verdict.DUPLICATE, "REJECTED": pb.Verdict.REJECTED}


class _Malformed:
    """Stands in for a request that did not parse."""

    def __init__(self, error: str):
        self.error = error


def _tolerant(message_type) -> Callable[[bytes], object]:
    def parse(data: bytes):
        try:
            return parse_message(message_type, data)
        except MalformedRequest as exc:
            return _Malformed(str(exc))

    return parse


def _check_parsed(request, context: grpc.ServicerContext) -> None:
    if isinstance(request, _Malformed):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)


def _verdict(o: Outcome) -> pb.Verdict:
    return pb.Verdict(trajectory_id=o.trajectory_id, status=_STATUS[o.status], reason=o.reason, detail=o.detail)


class TrajectoryStoreService:
    def __init__(self, ledger: Ledger, *, admin_key: str | None, trainer_key: str | None,
                 query_limits: QueryLimits):
        self.ledger = ledger
        self.admin_key = admin_key
        self.trainer_key = trainer_key
        self.query_limits = query_limits
        self.sandbox = _sandbox(ledger, query_limits)

    # ---- Submit ---------------------------------------------------------------------------------

    def Submit(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext):
        """Each batch (raw bytes) is prepared (parsed, decoded, validated, converted), deduplicated
        and group-committed across streams, and answered, all in this handler thread and in order;
        clients keep several batches in flight. (Reader/worker/committer thread hand-offs, and
        worker processes, were measured slower on the 2-core reference machine.)"""
        for data in request_iterator:
            try:
                prepared = self._prepare(data)
            except MalformedRequest as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            try:
                outcomes = self.ledger.commit(prepared)
            except Exception as exc:  # commit failed: nothing in this batch was acknowledged
                log.exception("submit failed")
                context.abort(grpc.StatusCode.UNAVAILABLE, f"commit failed, retry: {exc}")
            yield pb.SubmitResponse(verdicts=[_verdict(o) for o in outcomes])

    def _prepare(self, data: bytes) -> Prepared:
        return prepare_bytes(data, self.ledger.registry, self.ledger.ingest_config,
                             validate=self.ledger.validate, now=time.time())

    # ---- control --------------------------------------------------------------------------------

    def RegisterModel(self, request, context):
        _check_parsed(request, context)
        self._require(context, self.admin_key, "admin")
        if not request.model_id or request.vocab_size == 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "model_id and a positive vocab_size are required")
        self.ledger.register_model(request.model_id, request.vocab_size)
        return pb.RegisterModelResponse()

    def PublishVersion(self, request, context):
        _check_parsed(request, context)
        self._require(context, self.trainer_key, "trainer")
        if request.version < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"version must be >= 0, got {request.version}")
        try:
            latest = self.ledger.publish_version(request.model_id, request.version, request.checksum)
        except KeyError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc.args[0]))
        return pb.PublishVersionResponse(latest_version=latest)

    def _require(self, context: grpc.ServicerContext, key: str | None, role: str) -> None:
        if key is None:
            return  # no key configured: only allowed on loopback (checked at server creation)
        given = ""
        for k, v in context.invocation_metadata():
            if k == "authorization" and v.startswith("Bearer "):
                given = v[len("Bearer "):]
        if not hmac.compare_digest(given.encode(), key.encode()):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"missing or wrong {role} key")

    # ---- reading --------------------------------------------------------------------------------

    def Query(self, request, context):
        _check_parsed(request, context)
        # Runs in a sandbox process over a snapshot (store/sandbox.py, docs/sql.md); the timeout
        # and caps are the server's (a NaN, inf, negative or zero timeout means the default).
        try:
            for ipc, truncated in self.sandbox.run(request.sql, max_rows=request.max_rows,
                                                   timeout_s=request.timeout_seconds):
                yield pb.QueryChunk(arrow_ipc=ipc, truncated=truncated)
        except QueryError as exc:
            context.abort(getattr(grpc.StatusCode, exc.code, grpc.StatusCode.INVALID_ARGUMENT), str(exc))

    def GetStats(self, request, context):
        _check_parsed(request, context)
        stats = self.ledger.stats()
        return pb.GetStatsResponse(
            accepted=stats["accepted"],
            duplicates=stats["duplicates"],
            rejected=stats["rejected"],
            rejected_by_reason=stats["rejected_by_reason"],
            accepted_tokens=stats["accepted_tokens"],
            rejected_tokens=stats["rejected_tokens"],
            stats_json=json.dumps(stats, sort_keys=True),
        )

    # ---- rewards and batches --------------------------------------------------------------------

    def SetReward(self, request, context):
        _check_parsed(request, context)
        try:
            tid = self.ledger.set_reward(request.reward, trajectory_id=request.trajectory_id, session_id=request.session_id)
        except KeyError as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc.args[0]))
        except NotRewardable as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.SetRewardResponse(trajectory_id=tid)

    def PullBatch(self, request, context):
        _check_parsed(request, context)
        if request.num_samples == 0 and request.num_groups == 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "ask for num_samples > 0 or num_groups > 0")
        if request.max_staleness < 0 or request.lease_seconds < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_staleness and lease_seconds must be >= 0")
        pull_request = PullRequest(
            trainer_id=request.trainer_id, trainer_version=request.trainer_version, max_staleness=request.max_staleness,
            num_samples=request.num_samples, num_groups=request.num_groups, step=request.step,
            model_id=request.model_id, lease_seconds=request.lease_seconds)
        try:
            check_request(pull_request)  # model_id and trainer_id are required
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        batch = self.ledger.pull_batch(pull_request)
        payload = _ipc(batch.table.to_batches() or [pa.RecordBatch.from_pylist([], schema=batch.table.schema)])
        return pb.PullBatchResponse(lease_id=batch.lease_id, arrow_ipc=payload, num_rows=batch.table.num_rows,
                                    stats_json=json.dumps(batch.stats, sort_keys=True))

    def AckBatch(self, request, context):
        _check_parsed(request, context)
        try:
            n = self.ledger.ack_batch(request.lease_id, request.trainer_id)
        except UnknownLease as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except NotLeaseOwner as exc:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        except LeaseError as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return pb.AckBatchResponse(num_rows=n)


    def ReportTrainStep(self, request, context):
        _check_parsed(request, context)
        self._require(context, self.trainer_key, "trainer")
        try:
            json.loads(request.stats_json or "{}")
        except json.JSONDecodeError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"stats_json is not JSON: {exc}")
        self.ledger.record_train_step(request.step, request.trainer_id, request.version, request.lease_id,
                                      request.started_at, request.finished_at, request.stats_json or "{}")
        return pb.ReportTrainStepResponse()


def _sandbox(ledger: Ledger, limits: QueryLimits):
    """The query sandbox: worker processes over snapshots in ``<db>.sandbox/`` (same file system
    as the ledger, so a reflink clone can work), stopped when the ledger closes."""
    from rollbook.store.sandbox import SandboxPool, Snapshots

    workdir = ledger.db_path.with_name(ledger.db_path.name + ".sandbox")
    shutil.rmtree(workdir, ignore_errors=True)  # a previous run's leftovers (killed server)
    workdir.mkdir(mode=0o700)
    pool = SandboxPool(limits, workdir / "workers", Snapshots(ledger, workdir / "snapshots", limits.snapshot_max_age_s))
    ledger.on_close(pool.close)
    return pool


def _ipc(batches: list[pa.RecordBatch]) -> bytes:
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, batches[0].schema) as writer:
        for b in batches:
            writer.write_batch(b)
    return sink.getvalue()


def handlers(service: TrajectoryStoreService) -> grpc.GenericRpcHandler:
    def unary(name, req):
        return grpc.unary_unary_rpc_method_handler(
            getattr(service, name), request_deserializer=_tolerant(req), response_serializer=lambda m: m.SerializeToString()
        )

    return grpc.method_handlers_generic_handler(
        "rollbook.v1.TrajectoryStore",
        {
            "Submit": grpc.stream_stream_rpc_method_handler(
                service.Submit, request_deserializer=None,  # raw bytes: parsed in _prepare
                response_serializer=pb.SubmitResponse.SerializeToString,
            ),
            "Query": grpc.unary_stream_rpc_method_handler(
                service.Query, request_deserializer=_tolerant(pb.QueryRequest),
                response_serializer=pb.QueryChunk.SerializeToString,
            ),
            "SetReward": unary("SetReward", pb.SetRewardRequest),
            "PullBatch": unary("PullBatch", pb.PullBatchRequest),
            "AckBatch": unary("AckBatch", pb.AckBatchRequest),
            "PublishVersion": unary("PublishVersion", pb.PublishVersionRequest),
            "RegisterModel": unary("RegisterModel", pb.RegisterModelRequest),
            "GetStats": unary("GetStats", pb.GetStatsRequest),
            "ReportTrainStep": unary("ReportTrainStep", pb.ReportTrainStepRequest),
        },
    )
