"""The ``rollbook.v1.TrajectoryStore`` gRPC servicer: thin methods over the ledger and the sandbox.

The server is ``grpc.aio`` (store/server.py): an open stream is a coroutine, not a thread, so idle or
slow streams cannot starve other callers. ``AsyncStore`` is the async face: it authorizes every call
(store/access.py: role keys, numeric field ranges), enforces the stream limits, and runs the
blocking work (``TrajectoryStoreService``'s plain methods: DuckDB, fsync, Arrow) on bounded thread
pools, one for Submit batches, one for queries and one for the other RPCs. Those plain methods take a
``SyncContext`` whose ``abort`` raises, so their bodies read like ordinary servicer methods.

Handlers are registered by hand (``handlers()``) rather than through the generated
``add_..._to_server`` so that a request that does not parse as its message answers
``INVALID_ARGUMENT`` with the decoder's message instead of gRPC's generic ``INTERNAL``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, TypeAlias, TypeVar

import grpc
import pyarrow as pa

from rollbook.store.access import OPEN, Caller, Denied, KeyRing, field_error
from rollbook.store.governance import GovernError
from rollbook.store.ledger import (
    InvalidReward,
    InvalidStatus,
    Ledger,
    ModelConflict,
    ModelNotRegistered,
    NotRewardable,
    Outcome,
    UnknownTrajectory,
    UnknownVersion,
)
from rollbook.store.prepare import MalformedRequest, Prepared, parse_message, prepare_bytes
from rollbook.store.sql import QueryError, QueryLimits
from rollbook.trajectories import varint_bytes
from rollbook.v1 import rollbook_pb2 as pb
from rollbook.validator.pull import InvalidPull, LeaseError, NotLeaseOwner, UnknownLease

if TYPE_CHECKING:  # pragma: no cover
    from rollbook.store.sandbox import SandboxPool

log = logging.getLogger("rollbook.store.service")

_STATUS = {"ACCEPTED": pb.Verdict.ACCEPTED, "DUPLICATE": pb.Verdict.DUPLICATE, "REJECTED": pb.Verdict.REJECTED}


class _Malformed:
    """Stands in for a request that did not parse."""

    def __init__(self, error: str):
        self.error = error


Message = TypeVar("Message")
# What a handler body gets: its request message, or the stand-in for bytes that did not parse
# (``_tolerant``), which the body turns into INVALID_ARGUMENT first thing (``_parsed``).
Request: TypeAlias = Message | _Malformed


def _tolerant(message_type: type[Message]) -> Callable[[bytes], Message | _Malformed]:
    def parse(data: bytes) -> Message | _Malformed:
        try:
            return parse_message(message_type, data)
        except MalformedRequest as exc:
            return _Malformed(str(exc))

    return parse


def _parsed(request: Message | _Malformed, context: SyncContext, message_type: type[Message]) -> Message:
    """``request`` as its ``message_type``, or INVALID_ARGUMENT with the decoder's message if it did not parse."""
    if isinstance(request, _Malformed):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
    if not isinstance(request, message_type):  # a handler registered with the wrong message type: a bug
        raise TypeError(f"expected {message_type.__name__}, got {type(request).__name__}")
    return request


def submit_response(outcomes: Sequence[Outcome]) -> bytes:
    """The serialized ``SubmitResponse`` of ``outcomes``, written field by field: the bytes protobuf
    gives for it with one ``Verdict`` per outcome, without a message object per row."""
    out = []
    for o in outcomes:
        body = _string_field(0x0A, o.trajectory_id) + _STATUS_FIELD[o.status]
        if o.reason:
            body += _string_field(0x1A, o.reason)
        if o.detail:
            body += _string_field(0x22, o.detail)
        out.append(b"\x0a" + varint_bytes(len(body)) + body)
    return b"".join(out)


def _string_field(tag: int, value: str) -> bytes:
    """A string field (``tag``: its number << 3 | 2, one byte); nothing for "" (proto3 omits it)."""
    if not value:
        return b""
    data = value.encode()
    return bytes([tag]) + varint_bytes(len(data)) + data


# Verdict.status (field 2, a varint) of each outcome status
_STATUS_FIELD = {name: b"\x10" + varint_bytes(number) for name, number in _STATUS.items()}


# The one mapping from the domain errors a handler body may raise to the status the RPC answers
# (checked along the exception's class hierarchy, so a subclass comes first). Anything else escaping
# a body is a bug and answers INTERNAL, never a status a client would act on (a stray KeyError is not
# "not found").
DOMAIN_STATUS: dict[type[Exception], grpc.StatusCode] = {
    InvalidReward: grpc.StatusCode.INVALID_ARGUMENT,
    InvalidPull: grpc.StatusCode.INVALID_ARGUMENT,
    UnknownTrajectory: grpc.StatusCode.NOT_FOUND,
    UnknownVersion: grpc.StatusCode.NOT_FOUND,
    InvalidStatus: grpc.StatusCode.INVALID_ARGUMENT,
    UnknownLease: grpc.StatusCode.NOT_FOUND,
    NotLeaseOwner: grpc.StatusCode.PERMISSION_DENIED,
    NotRewardable: grpc.StatusCode.FAILED_PRECONDITION,
    ModelNotRegistered: grpc.StatusCode.FAILED_PRECONDITION,
    ModelConflict: grpc.StatusCode.FAILED_PRECONDITION,
    GovernError: grpc.StatusCode.INVALID_ARGUMENT,
    LeaseError: grpc.StatusCode.FAILED_PRECONDITION,  # expired and re-leased (after its subclasses above)
}


def status_of(exc: BaseException) -> grpc.StatusCode | None:
    """The status ``exc`` answers (``DOMAIN_STATUS``), or None for an error that is not the caller's."""
    return next((DOMAIN_STATUS[c] for c in type(exc).__mro__ if c in DOMAIN_STATUS), None)


class Abort(Exception):
    """Raised by ``SyncContext.abort``; the async face turns it into the RPC's status."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class SyncContext:
    """What a blocking handler body gets instead of a ``grpc.ServicerContext``."""

    def __init__(self, metadata: Sequence[tuple[str, str | bytes]] | None = (), peer: str = "", caller: Caller = OPEN):
        self._metadata = tuple(metadata or ())
        self._peer = peer
        self.caller = caller  # who is calling (store/access.py: role, tenant, bound models)

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        raise Abort(code, details)

    def invocation_metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        return self._metadata

    def peer(self) -> str:
        return self._peer


class TrajectoryStoreService:
    """The blocking bodies of the RPCs (roles and numeric field ranges were checked before)."""

    def __init__(self, ledger: Ledger, *, query_limits: QueryLimits):
        self.ledger = ledger
        self.query_limits = query_limits
        self.sandbox = _sandbox(ledger, query_limits)

    def call(self, rpc: str, request: Any, context: SyncContext) -> Any:
        """Run the unary RPC ``rpc``'s body; a domain error becomes ``Abort`` with its status
        (``DOMAIN_STATUS``), anything else propagates (INTERNAL)."""
        try:
            return getattr(self, rpc)(request, context)
        except Denied as exc:
            raise Abort(exc.code, exc.message) from None
        except tuple(DOMAIN_STATUS) as exc:
            code = status_of(exc)
            assert code is not None  # exc is one of DOMAIN_STATUS's classes
            raise Abort(code, str(exc)) from None

    # ---- Submit ---------------------------------------------------------------------------------

    def submit_batch(self, data: bytes, caller: Caller = OPEN) -> bytes:
        """One Submit batch (raw bytes) from ``caller``: prepared (parsed, decoded, checked against
        the models the key is bound to, validated, stamped with its tenant, converted), deduplicated
        and group-committed across streams (the ledger's leader/follower commit), answered. Runs on
        the ingest pool; a stream's batches run one after another, in order."""
        try:
            prepared = self._prepare(data, caller)
        except MalformedRequest as exc:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        except Denied as exc:
            raise Abort(exc.code, exc.message) from None
        try:
            outcomes = self.ledger.commit(prepared)
        except Exception as exc:  # commit failed: nothing in this batch was acknowledged
            log.exception("submit failed")
            raise Abort(grpc.StatusCode.UNAVAILABLE, f"commit failed, retry: {exc}") from None
        return submit_response(outcomes)

    def _prepare(self, data: bytes, caller: Caller) -> Prepared:
        return prepare_bytes(
            data,
            self.ledger.registry,
            self.ledger.ingest_config,
            validate=self.ledger.validate,
            now=time.time(),
            caller=caller,
            policies=self.ledger.policies,
        )

    # ---- control --------------------------------------------------------------------------------

    def RegisterModel(self, message: Request[pb.RegisterModelRequest], context: SyncContext) -> pb.RegisterModelResponse:
        request = _parsed(message, context, pb.RegisterModelRequest)
        if not request.model_id or request.vocab_size == 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "model_id and a positive vocab_size are required")
        self.ledger.register_model(request.model_id, request.vocab_size)
        return pb.RegisterModelResponse()

    def PublishVersion(self, message: Request[pb.PublishVersionRequest], context: SyncContext) -> pb.PublishVersionResponse:
        request = _parsed(message, context, pb.PublishVersionRequest)
        context.caller.check_model("PublishVersion", request.model_id)
        if request.version < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"version must be >= 0, got {request.version}")
        latest = self.ledger.publish_version(
            request.model_id,
            request.version,
            request.checksum,
            max_staleness=request.max_staleness if request.HasField("max_staleness") else None,
            samples_per_version=request.samples_per_version if request.HasField("samples_per_version") else None,
        )
        return pb.PublishVersionResponse(latest_version=latest)

    def SetVersionStatus(self, message: Request[pb.SetVersionStatusRequest], context: SyncContext) -> pb.SetVersionStatusResponse:
        request = _parsed(message, context, pb.SetVersionStatusRequest)
        if not request.model_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "model_id is required")
        context.caller.check_model("SetVersionStatus", request.model_id)
        self.ledger.set_version_status(request.model_id, request.version, request.status, request.gate_json)
        return pb.SetVersionStatusResponse()

    def GetModel(self, message: Request[pb.GetModelRequest], context: SyncContext) -> pb.GetModelResponse:
        request = _parsed(message, context, pb.GetModelRequest)
        if not request.model_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "model_id is required")
        context.caller.check_model("GetModel", request.model_id)
        entry = self.ledger.model_entry(request.model_id)
        return pb.GetModelResponse(
            model_id=entry.model_id,
            vocab_size=entry.vocab_size,
            latest_version=entry.latest_version,
            max_staleness=entry.max_staleness,
            samples_per_version=entry.samples_per_version,
        )

    # ---- reading --------------------------------------------------------------------------------

    def Query(self, message: Request[pb.QueryRequest], context: SyncContext) -> Generator[pb.QueryChunk, None, None]:
        request = _parsed(message, context, pb.QueryRequest)
        # Runs in a sandbox process over a snapshot (store/sandbox.py, docs/sql.md); the timeout
        # and caps are the server's (a NaN, inf, negative or zero timeout means the default). A
        # tenant's reader queries a snapshot that holds its tenant's rows alone (docs/governance.md).
        caller = context.caller
        scope = None if caller.sees_all else (caller.tenant, caller.models)
        try:
            for ipc, truncated in self.sandbox.run(
                request.sql, max_rows=request.max_rows, timeout_s=request.timeout_seconds, scope=scope
            ):
                yield pb.QueryChunk(arrow_ipc=ipc, truncated=truncated)
        except QueryError as exc:
            context.abort(getattr(grpc.StatusCode, exc.code, grpc.StatusCode.INVALID_ARGUMENT), str(exc))

    def GetStats(self, message: Request[pb.GetStatsRequest], context: SyncContext) -> pb.GetStatsResponse:
        _parsed(message, context, pb.GetStatsRequest)  # no fields; only its parse is checked
        if not context.caller.sees_all:
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"GetStats counts every tenant's rows; the key {context.caller.name!r} reads tenant "
                f"{context.caller.tenant!r} alone: use Query (e.g. SELECT count(*) FROM trajectories)",
            )
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

    def SetReward(self, message: Request[pb.SetRewardRequest], context: SyncContext) -> pb.SetRewardResponse:
        request = _parsed(message, context, pb.SetRewardRequest)
        caller = context.caller
        tid = self.ledger.set_reward(
            request.reward,
            trajectory_id=request.trajectory_id,
            session_id=request.session_id,
            tenant=None if caller.sees_all else caller.tenant,
        )
        return pb.SetRewardResponse(trajectory_id=tid)

    def PullBatch(self, message: Request[pb.PullBatchRequest], context: SyncContext) -> bytes:
        """A ``PullBatchResponse``, already encoded (its Arrow payload copied once, not three times)."""
        request = _parsed(message, context, pb.PullBatchRequest)
        if context.caller.models is not None:
            if not request.model_id:
                context.abort(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"PullBatch: the key {context.caller.name!r} is bound to models; name one (model_id)",
                )
            context.caller.check_model("PullBatch", request.model_id)
        batch = self.ledger.pull_batch(request)  # the message as it came (validator.pull.check_request)
        payload = _ipc(batch.table.to_batches() or [pa.RecordBatch.from_pylist([], schema=batch.table.schema)])
        head = pb.PullBatchResponse(
            lease_id=batch.lease_id, num_rows=batch.table.num_rows, stats_json=json.dumps(batch.stats, sort_keys=True)
        )
        return with_bytes_field(head.SerializeToString(), pb.PullBatchResponse.ARROW_IPC_FIELD_NUMBER, payload)

    def AckBatch(self, message: Request[pb.AckBatchRequest], context: SyncContext) -> pb.AckBatchResponse:
        request = _parsed(message, context, pb.AckBatchRequest)
        n = self.ledger.ack_batch(request.lease_id, request.trainer_id)
        return pb.AckBatchResponse(num_rows=n)

    def ReportTrainStep(self, message: Request[pb.ReportTrainStepRequest], context: SyncContext) -> pb.ReportTrainStepResponse:
        request = _parsed(message, context, pb.ReportTrainStepRequest)
        try:
            json.loads(request.stats_json or "{}")
        except json.JSONDecodeError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"stats_json is not JSON: {exc}")
        self.ledger.record_train_step(
            request.step,
            request.trainer_id,
            request.version,
            request.lease_id,
            request.started_at,
            request.finished_at,
            request.stats_json or "{}",
        )
        return pb.ReportTrainStepResponse()

    # ---- governance ----------------------------------------------------------------------------

    def Govern(self, message: Request[pb.GovernRequest], context: SyncContext) -> pb.GovernResponse:
        request = _parsed(message, context, pb.GovernRequest)
        caller, action = context.caller, request.action
        if action in ("hold", "release"):
            if not request.predicate.strip():
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{action} needs a predicate (--where)")
            ids = self._matching_ids(request.predicate)
            n, audit_id = self.ledger.set_eligibility(
                ids, "held" if action == "hold" else "eligible", reason=request.reason, caller=caller, predicate=request.predicate
            )
        elif action == "policy":
            if not request.model_id:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "policy needs a model_id")
            n, audit_id = self.ledger.set_policy(
                request.model_id,
                list(request.tenants) or None,
                request.require_consent,
                caller=caller,
                detectors=list(request.detectors),
            )
        elif action == "forget":
            if not request.predicate.strip():
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "forget needs a predicate (--where)")
            ids = self._matching_ids(request.predicate)
            n, audit_id, lineage = self.ledger.forget(ids, reason=request.reason, caller=caller, predicate=request.predicate)
            return pb.GovernResponse(rows=n, audit_id=audit_id, lineage_json=json.dumps(lineage, sort_keys=True))
        elif action == "export":
            try:
                detail = json.loads(request.detail_json or "{}")
            except json.JSONDecodeError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"detail_json is not JSON: {exc}")
            if not isinstance(detail, dict):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "detail_json must be one JSON object")
            n = detail.get("rows", 0) if isinstance(detail.get("rows", 0), int) else 0
            audit_id = self.ledger.record_audit(
                caller, action, predicate=request.predicate, reason=request.reason, rows=n, detail=detail
            )
        else:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"action must be hold, release, policy, export or forget; got {action!r}"
            )
        return pb.GovernResponse(rows=n, audit_id=audit_id)

    GOVERN_PAGE = 100_000

    def _matching_ids(self, predicate: str) -> list[str]:
        """The ids of ``trajectories`` rows where ``predicate`` holds, evaluated in the SQL sandbox
        over a snapshot of every tenant's rows (the predicate never runs on the ledger itself), in
        pages of ``GOVERN_PAGE`` ids."""
        ids: list[str] = []
        last = ""
        size = self.query_limits.rows(self.GOVERN_PAGE)  # the server's row cap may be lower
        while True:
            # the predicate inside its own subquery: whatever it says, the paging applies to its rows
            sql = (
                f"SELECT trajectory_id FROM (SELECT trajectory_id FROM trajectories WHERE ({predicate}\n)) "
                f"WHERE trajectory_id > '{last.replace(chr(39), chr(39) * 2)}' ORDER BY trajectory_id LIMIT {size}"
            )
            try:
                page: list[str] = []
                for ipc, _truncated in self.sandbox.run(sql, max_rows=size):
                    table = pa.ipc.open_stream(ipc).read_all()
                    page.extend(table.column(0).to_pylist())
            except QueryError as exc:
                raise GovernError(f"the predicate failed in the SQL sandbox: {exc}") from None
            ids.extend(page)
            if len(page) < size or not page:
                return ids
            if page[-1] <= last:  # a page that does not advance would repeat forever
                raise GovernError("the predicate's rows do not page by trajectory_id; narrow it")
            last = page[-1]


def _sandbox(ledger: Ledger, limits: QueryLimits) -> SandboxPool:
    """The query sandbox: worker processes over snapshots in ``<db>.sandbox/`` (same file system
    as the ledger, so a reflink clone can work), stopped when the ledger closes."""
    from rollbook.store.sandbox import SandboxPool, Snapshots

    workdir = ledger.db_path.with_name(ledger.db_path.name + ".sandbox")
    shutil.rmtree(workdir, ignore_errors=True)  # a previous run's leftovers (killed server)
    workdir.mkdir(mode=0o700)
    pool = SandboxPool(limits, workdir / "workers", Snapshots(ledger, workdir / "snapshots", limits.snapshot_max_age_s))
    ledger.on_close(pool.close)
    ledger.on_forget(pool.snapshots.drop)  # a snapshot may hold forgotten rows
    return pool


def _ipc(batches: list[pa.RecordBatch]) -> pa.Buffer:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batches[0].schema) as writer:
        for b in batches:
            writer.write_batch(b)
    return sink.getvalue()


def with_bytes_field(message: bytes, number: int, payload: pa.Buffer | bytes) -> bytes:
    """``message`` (an encoded protobuf message) with the length-delimited field ``number`` set to
    ``payload``, appended: an encoding is a sequence of fields, so the concatenation parses as the
    message with that field set (the field must be unset in ``message``). The payload is copied once;
    setting it on the message and serializing copies it twice."""
    view = memoryview(payload)
    if not view.nbytes:  # proto3 leaves an empty bytes field out
        return message
    return b"".join((message, varint_bytes(number << 3 | 2), varint_bytes(view.nbytes), view))


@dataclass(frozen=True)
class StreamLimits:
    """Bounds on open streams (StoreConfig's fields of the same names; docs/security.md)."""

    max_submit_streams: int = 1024
    max_submit_streams_per_host: int = 256
    stream_idle_timeout_s: float = 120.0


@dataclass
class Pools:
    """Where blocking work runs: Submit batches, queries, everything else."""

    ingest: Executor
    query: Executor
    control: Executor


_END = object()


class _Stepper:
    """Steps a blocking generator from pool threads; ``close`` waits for a step in progress."""

    def __init__(self, gen: Generator):
        self.gen, self.lock = gen, threading.Lock()

    def step(self) -> Any:  # the next item, or _END
        with self.lock:
            return next(self.gen, _END)

    def close(self) -> None:
        with self.lock:
            self.gen.close()


class AsyncStore:
    """The ``grpc.aio`` face of ``TrajectoryStoreService``: authorization, field checks, stream
    limits, and the hop of blocking work onto ``pools``. Runs on the server's event loop thread
    (the stream counters need no lock)."""

    def __init__(self, service: TrajectoryStoreService, keys: KeyRing, limits: StreamLimits, pools: Pools):
        self.service, self.keys, self.limits, self.pools = service, keys, limits, pools
        self.open_streams = 0
        self.streams_by_host: dict[str, int] = {}

    async def _admit(self, rpc: str, request: Any, context: grpc.aio.ServicerContext) -> SyncContext:
        metadata = context.invocation_metadata()
        try:
            caller = self.keys.authorize(rpc, metadata)
        except Denied as exc:
            await context.abort(exc.code, exc.message)
        if request is not None and not isinstance(request, _Malformed):
            error = field_error(rpc, request)
            if error:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
        return SyncContext(metadata, context.peer(), caller)

    def unary(self, rpc: str, pool: Executor) -> Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]:
        """The async handler of the unary RPC ``rpc``: admit, then its body on ``pool``."""

        async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
            ctx = await self._admit(rpc, request, context)
            try:
                return await asyncio.get_running_loop().run_in_executor(pool, self.service.call, rpc, request, ctx)
            except Abort as exc:
                await context.abort(exc.code, exc.details)

        handle.__name__ = rpc
        return handle

    async def Query(self, request: Request[pb.QueryRequest], context: grpc.aio.ServicerContext) -> AsyncIterator[pb.QueryChunk]:
        ctx = await self._admit("Query", request, context)
        loop = asyncio.get_running_loop()
        stepper = _Stepper(self.service.Query(request, ctx))
        try:
            while True:
                try:
                    chunk = await loop.run_in_executor(self.pools.query, stepper.step)
                except Abort as exc:
                    await context.abort(exc.code, exc.details)
                if chunk is _END:
                    return
                yield chunk
        finally:
            self.pools.query.submit(stepper.close)  # after a step still running (a cancelled call)

    async def Submit(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        """Batches are read and answered in order; each one's work runs on the ingest pool while this
        coroutine waits (no thread is held between batches). A stream over the per-host or total
        limit is refused with RESOURCE_EXHAUSTED; one that sends nothing (or reads no answer) for
        ``stream_idle_timeout_s`` is closed with DEADLINE_EXCEEDED (a client retries it)."""
        admitted = await self._admit("Submit", None, context)
        host = context.peer().rsplit(":", 1)[0]
        limits = self.limits
        if self.open_streams >= limits.max_submit_streams:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the store holds its limit of {limits.max_submit_streams} open Submit streams; retry later",
            )
        if self.streams_by_host.get(host, 0) >= limits.max_submit_streams_per_host:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{host} holds its limit of {limits.max_submit_streams_per_host} open Submit streams; "
                "close some or send on fewer streams",
            )
        self.open_streams += 1
        self.streams_by_host[host] = self.streams_by_host.get(host, 0) + 1
        loop = asyncio.get_running_loop()
        await context.send_initial_metadata(())  # the stream is admitted (a client may wait for this)
        idle = limits.stream_idle_timeout_s
        try:
            while True:
                try:
                    async with asyncio.timeout(idle):  # no task per call, unlike wait_for
                        data = await context.read()
                except TimeoutError:
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"Submit stream idle for {idle:g} s; closed")
                if data is grpc.aio.EOF:
                    return
                try:
                    response = await loop.run_in_executor(self.pools.ingest, self.service.submit_batch, data, admitted.caller)
                except Abort as exc:
                    await context.abort(exc.code, exc.details)
                try:
                    async with asyncio.timeout(idle):
                        await context.write(response)
                except TimeoutError:
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"Submit stream read no answer for {idle:g} s; closed")
        finally:
            self.open_streams -= 1
            left = self.streams_by_host[host] - 1
            if left:
                self.streams_by_host[host] = left
            else:
                del self.streams_by_host[host]


def handlers(store: AsyncStore) -> grpc.GenericRpcHandler:
    def unary(name: str, req: type, pool: Executor) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(
            store.unary(name, pool),
            request_deserializer=_tolerant(req),
            response_serializer=lambda m: m if isinstance(m, bytes) else m.SerializeToString(),  # PullBatch encodes its own
        )

    control = store.pools.control
    return grpc.method_handlers_generic_handler(
        "rollbook.v1.TrajectoryStore",
        {
            "Submit": grpc.stream_stream_rpc_method_handler(
                store.Submit,
                request_deserializer=None,  # raw bytes: parsed in submit_batch
                response_serializer=None,  # encoded in submit_batch
            ),
            "Query": grpc.unary_stream_rpc_method_handler(
                store.Query,
                request_deserializer=_tolerant(pb.QueryRequest),
                response_serializer=pb.QueryChunk.SerializeToString,
            ),
            "SetReward": unary("SetReward", pb.SetRewardRequest, control),
            "PullBatch": unary("PullBatch", pb.PullBatchRequest, control),
            "AckBatch": unary("AckBatch", pb.AckBatchRequest, control),
            "PublishVersion": unary("PublishVersion", pb.PublishVersionRequest, control),
            "RegisterModel": unary("RegisterModel", pb.RegisterModelRequest, control),
            "GetStats": unary("GetStats", pb.GetStatsRequest, control),
            "ReportTrainStep": unary("ReportTrainStep", pb.ReportTrainStepRequest, control),
            "GetModel": unary("GetModel", pb.GetModelRequest, control),
            "SetVersionStatus": unary("SetVersionStatus", pb.SetVersionStatusRequest, control),
            "Govern": unary("Govern", pb.GovernRequest, control),
        },
    )
