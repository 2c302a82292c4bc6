"""``StoreClient``: the Python client of the trajectory store.

    from rollbook.client import StoreClient
    client = StoreClient("127.0.0.1:50551", admin_key=..., trainer_key=...)   # or StoreClient.from_env(address)
    client.register_model("tiny", vocab_size=64)
    client.publish_version("tiny", 0, checksum="...")
    result = client.submit(trajectories)          # iterable of Trajectory messages or dicts
    table = client.query("SELECT domain, avg(reward) FROM trajectories GROUP BY ALL")

``submit`` batches on the wire, keeps at most ``max_in_flight`` batches unacknowledged, and when
the stream breaks (store restarted, network blip) reconnects and resends every unacknowledged
batch. Resending is safe: ``trajectory_id`` is an idempotency key, so a batch the store had
already committed comes back ``DUPLICATE`` and nothing is stored twice.

Keys: each call sends the key of its role (worker: submit, set_reward, get_model; trainer: pull_batch,
ack_batch, publish_version, set_version_status, report_train_step; reader: query, stats; admin: register_model) as
``authorization: Bearer <key>``, or the admin key when the client has no key of that role, or none
(a store on loopback with that role's key unset lets it through). ``tls`` (``rollbook.tls.ClientTLS``)
makes the channel a TLS one. docs/security.md has the table.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
import pyarrow as pa

from rollbook.tls import ClientTLS, channel
from rollbook.trajectories import trajectory_from_dict, varint_bytes
from rollbook.v1 import rollbook_pb2 as pb
from rollbook.v1 import rollbook_pb2_grpc as pb_grpc

log = logging.getLogger("rollbook.client")

MAX_MESSAGE_BYTES = 64 << 20
# The statuses after which a Submit is resent: the stream broke, or the store is down, restarting or
# failed to commit (nothing of an unanswered batch was acknowledged, and trajectory_id makes a resend
# a DUPLICATE, never a second row). The one list; the spooling submitter (rollout/submitter.py) adds
# what only it may wait out.
RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
    }
)
STATUS_NAMES = {pb.Verdict.ACCEPTED: "ACCEPTED", pb.Verdict.DUPLICATE: "DUPLICATE", pb.Verdict.REJECTED: "REJECTED"}


@dataclass
class SubmitResult:
    """Verdicts of one ``submit`` call, by trajectory id (the last verdict received wins)."""

    verdicts: dict[str, pb.Verdict] = field(default_factory=dict)
    accepted: int = 0
    duplicates: int = 0
    rejected: int = 0
    reconnects: int = 0
    resent_batches: int = 0

    def add(self, verdict: pb.Verdict) -> None:
        self.verdicts[verdict.trajectory_id] = verdict
        if verdict.status == pb.Verdict.ACCEPTED:
            self.accepted += 1
        elif verdict.status == pb.Verdict.DUPLICATE:
            self.duplicates += 1
        else:
            self.rejected += 1

    def rejected_by_reason(self) -> dict[str, int]:
        return dict(collections.Counter(v.reason for v in self.verdicts.values() if v.status == pb.Verdict.REJECTED))


@dataclass
class PulledBatch:
    """A leased batch: ``lease_id`` ("" when nothing was ready), the rows, and their statistics."""

    lease_id: str
    table: pa.Table
    stats: dict

    @property
    def num_rows(self) -> int:
        return self.table.num_rows


@dataclass(frozen=True)
class ModelInfo:
    """A registered model (``get_model``). ``max_staleness`` and ``samples_per_version`` are what
    its trainer announced with its last ``publish_version`` (None: nothing announced yet)."""

    model_id: str
    vocab_size: int
    latest_version: int  # -1: no version published
    max_staleness: int | None
    samples_per_version: int | None


class TrainerClient(Protocol):
    """What the trainer (``rollbook.trainer.loop.Trainer``) needs from the store: the trainer-role
    calls. ``StoreClient`` is one; unit tests pass hand-written fakes (tests/unit/trainer/test_loop.py)."""

    def pull_batch(self, **fields: Any) -> PulledBatch:
        """Lease a batch; ``fields`` are ``PullBatchRequest``'s."""
        ...

    def ack_batch(self, lease_id: str, trainer_id: str) -> int:
        """Confirm a checkpointed lease; returns its rows."""
        ...

    def report_train_step(
        self,
        *,
        step: int,
        trainer_id: str,
        version: int,
        lease_id: str,
        started_at: float,
        finished_at: float,
        stats: Mapping[str, Any],
    ) -> None:
        """Write one ``train_steps`` row."""
        ...

    def publish_version(
        self,
        model_id: str,
        version: int,
        checksum: str = "",
        *,
        max_staleness: int | None = None,
        samples_per_version: int | None = None,
    ) -> int:
        """Add a version to the registry, announcing the trainer's staleness contract; returns the latest."""
        ...


def as_trajectory(item: pb.Trajectory | Mapping[str, Any]) -> pb.Trajectory:
    return item if isinstance(item, pb.Trajectory) else trajectory_from_dict(item)


KEY_ROLES = ("worker", "trainer", "reader", "admin")


class StoreClient:
    def __init__(
        self,
        address: str,
        *,
        worker_key: str | None = None,
        trainer_key: str | None = None,
        reader_key: str | None = None,
        admin_key: str | None = None,
        tls: ClientTLS | None = None,
        timeout_s: float = 60.0,
    ):
        self.address = address
        self.worker_key, self.trainer_key, self.reader_key, self.admin_key = worker_key, trainer_key, reader_key, admin_key
        self.tls = tls
        self.timeout_s = timeout_s
        self.channel = channel(
            address,
            tls,
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                # reconnect within ~1 s of a restarted store instead of gRPC's default backoff (up to 120 s)
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000),
            ],
        )
        self.stub = pb_grpc.TrajectoryStoreStub(self.channel)
        # Submit sends requests already serialized (encode_submit_request), skipping a copy of every
        # trajectory into a SubmitRequest message
        self._submit = self.channel.stream_stream(
            "/rollbook.v1.TrajectoryStore/Submit", request_serializer=None, response_deserializer=pb.SubmitResponse.FromString
        )

    @classmethod
    def from_env(cls, address: str, **kwargs: Any) -> "StoreClient":
        """A client with the keys of ``ROLLBOOK_{WORKER,TRAINER,READER,ADMIN}_KEY`` and the TLS
        settings of ``ROLLBOOK_TLS_CA`` / ``ROLLBOOK_TLS_CLIENT_CERT`` / ``ROLLBOOK_TLS_CLIENT_KEY``;
        ``kwargs`` that are not None win."""
        from rollbook import environment as env

        values: dict[str, Any] = {f"{r}_key": env.role_key(r) for r in KEY_ROLES}
        values["tls"] = ClientTLS.from_env()
        values.update({k: v for k, v in kwargs.items() if v is not None})
        return cls(address, **values)

    def _auth(self, role: str) -> list[tuple[str, str]]:
        return _auth(getattr(self, f"{role}_key") or self.admin_key)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "StoreClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- submit ---------------------------------------------------------------------------------

    def submit(
        self,
        trajectories: Iterable[pb.Trajectory | Mapping[str, Any]],
        *,
        batch_size: int = 64,
        max_in_flight: int = 4,
        retry_deadline_s: float = 300.0,
    ) -> SubmitResult:
        """Stream ``trajectories`` to the store; returns every verdict. Retries (reconnect and
        resend the unacknowledged batches) until ``retry_deadline_s`` passes without progress."""
        if batch_size < 1 or max_in_flight < 1:
            raise ValueError("batch_size and max_in_flight must be >= 1")
        return _SubmitSession(self, trajectories, batch_size, max_in_flight, retry_deadline_s).run()

    # ---- control --------------------------------------------------------------------------------

    def register_model(self, model_id: str, vocab_size: int) -> None:
        self.stub.RegisterModel(
            pb.RegisterModelRequest(model_id=model_id, vocab_size=vocab_size),
            metadata=self._auth("admin"),
            timeout=self.timeout_s,
        )

    def publish_version(
        self,
        model_id: str,
        version: int,
        checksum: str = "",
        *,
        max_staleness: int | None = None,
        samples_per_version: int | None = None,
    ) -> int:
        """Add ``version`` to the model's registry (trainer key); returns the latest published version.
        ``max_staleness`` and ``samples_per_version`` announce the trainer's staleness contract, which
        rollout workers read with ``get_model`` and run their gate with (None: not announced)."""
        response = self.stub.PublishVersion(
            pb.PublishVersionRequest(
                model_id=model_id,
                version=version,
                checksum=checksum,
                max_staleness=max_staleness,
                samples_per_version=samples_per_version,
            ),
            metadata=self._auth("trainer"),
            timeout=self.timeout_s,
        )
        return response.latest_version

    def set_version_status(self, model_id: str, version: int, status: str, gate: Mapping[str, Any] | None = None) -> None:
        """Record the promotion gate's verdict on published ``version`` (trainer key; docs/gate.md):
        ``status`` 'promoted', 'refused' or 'rolled_back', ``gate`` its figures (JSON-serializable).
        NOT_FOUND for a version never published; recording it again replaces the verdict."""
        self.stub.SetVersionStatus(
            pb.SetVersionStatusRequest(
                model_id=model_id, version=version, status=status, gate_json=json.dumps(dict(gate)) if gate else ""
            ),
            metadata=self._auth("trainer"),
            timeout=self.timeout_s,
        )

    def get_model(self, model_id: str) -> ModelInfo:
        """The store's entry for ``model_id`` (worker key): vocabulary, latest version and the
        staleness contract its trainer announced. FAILED_PRECONDITION if it is not registered."""
        r = self.stub.GetModel(pb.GetModelRequest(model_id=model_id), metadata=self._auth("worker"), timeout=self.timeout_s)
        return ModelInfo(
            r.model_id,
            r.vocab_size,
            r.latest_version,
            r.max_staleness if r.HasField("max_staleness") else None,
            r.samples_per_version if r.HasField("samples_per_version") else None,
        )

    def set_reward(self, reward: float, *, trajectory_id: str = "", session_id: str = "") -> str:
        response = self.stub.SetReward(
            pb.SetRewardRequest(trajectory_id=trajectory_id, session_id=session_id, reward=reward),
            metadata=self._auth("worker"),
            timeout=self.timeout_s,
        )
        return response.trajectory_id

    def stats(self) -> pb.GetStatsResponse:
        return self.stub.GetStats(pb.GetStatsRequest(), metadata=self._auth("reader"), timeout=self.timeout_s)

    # ---- governance (admin key; docs/governance.md) -----------------------------------------------

    def govern(
        self,
        action: str,
        *,
        where: str = "",
        reason: str = "",
        model_id: str = "",
        tenants: Sequence[str] = (),
        require_consent: bool = False,
        detectors: Sequence[str] = (),
        detail: Mapping[str, Any] | None = None,
    ) -> pb.GovernResponse:
        """One governance action (admin key): ``hold``/``release`` the ``trajectories`` rows where the
        SQL predicate ``where`` holds (evaluated in the SQL sandbox), set a model's tenant ``policy``
        (``tenants`` empty: every tenant; ``detectors``: redaction rules whose hit holds a row), or record an ``export``/``forget`` done elsewhere in the
        audit table (``detail``). Returns the rows changed and the audit row's id."""
        return self.stub.Govern(
            pb.GovernRequest(
                action=action,
                predicate=where,
                reason=reason,
                model_id=model_id,
                tenants=list(tenants),
                require_consent=require_consent,
                detectors=list(detectors),
                detail_json=json.dumps(dict(detail)) if detail else "",
            ),
            metadata=self._auth("admin"),
            timeout=max(self.timeout_s or 0, 120),  # a predicate over a large ledger takes a while
        )

    # ---- trainer side -----------------------------------------------------------------------------

    def pull_batch(self, **fields: Any) -> "PulledBatch":
        """Lease ready, validated rows (whole groups) of ``model_id`` no staler than ``max_staleness``
        versions. ``fields`` are those of ``PullBatchRequest``, described in rollbook.proto (the one
        place they are spelled; an unknown name raises ``ValueError``). ``model_id`` and
        ``trainer_id`` are required (the store answers INVALID_ARGUMENT)."""
        response = self.stub.PullBatch(pb.PullBatchRequest(**fields), metadata=self._auth("trainer"), timeout=self.timeout_s)
        table = pa.ipc.open_stream(pa.py_buffer(response.arrow_ipc)).read_all()  # no copy of the payload
        return PulledBatch(response.lease_id, table, json.loads(response.stats_json or "{}"))

    def ack_batch(self, lease_id: str, trainer_id: str) -> int:
        """Confirm a lease once the step that used it is checkpointed (idempotent). Only the trainer
        the lease was issued to may (another ``trainer_id`` gets PERMISSION_DENIED)."""
        return self.stub.AckBatch(
            pb.AckBatchRequest(lease_id=lease_id, trainer_id=trainer_id), metadata=self._auth("trainer"), timeout=self.timeout_s
        ).num_rows

    def report_train_step(
        self,
        *,
        step: int,
        trainer_id: str,
        version: int,
        lease_id: str,
        started_at: float,
        finished_at: float,
        stats: Mapping[str, Any],
    ) -> None:
        """Write one row of ``train_steps`` (trainer key); re-reporting a step replaces it."""
        self.stub.ReportTrainStep(
            pb.ReportTrainStepRequest(
                step=step,
                trainer_id=trainer_id,
                version=version,
                lease_id=lease_id,
                started_at=started_at,
                finished_at=finished_at,
                stats_json=json.dumps(dict(stats), sort_keys=True),
            ),
            metadata=self._auth("trainer"),
            timeout=self.timeout_s,
        )

    # ---- SQL ------------------------------------------------------------------------------------

    def query(self, sql: str, *, max_rows: int = 0, timeout_s: float = 0.0) -> pa.Table:
        """Run one read-only statement; the table's schema metadata has ``rollbook.truncated``
        set to ``true`` when the server's row cap cut the result."""
        chunks = self.stub.Query(
            pb.QueryRequest(sql=sql, max_rows=max_rows, timeout_seconds=timeout_s),
            metadata=self._auth("reader"),
            timeout=self.timeout_s + (timeout_s or 0),
        )
        return read_query_chunks(chunks)


def read_query_chunks(chunks: Iterable[pb.QueryChunk]) -> pa.Table:
    tables, truncated = [], False
    for chunk in chunks:
        truncated = truncated or chunk.truncated
        if chunk.arrow_ipc:
            tables.append(pa.ipc.open_stream(pa.py_buffer(chunk.arrow_ipc)).read_all())
    table = pa.concat_tables(tables) if tables else pa.table({})
    return table.replace_schema_metadata({"rollbook.truncated": "true" if truncated else "false"})


def _auth(key: str | None) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")] if key else []


class _SubmitSession:
    """One ``submit`` call: a source of batches, the unacknowledged window, reconnects."""

    def __init__(
        self,
        client: "StoreClient",
        trajectories: Iterable[pb.Trajectory | Mapping[str, Any]],
        batch_size: int,
        max_in_flight: int,
        retry_deadline_s: float,
    ):
        self.client = client
        self.submit = client._submit
        self.source = _batches(trajectories, batch_size)
        self.max_in_flight = max_in_flight
        self.retry_deadline_s = retry_deadline_s
        self.unacked: collections.deque[_EncodedRequest] = collections.deque()
        self.cond = threading.Condition()
        self.exhausted = False
        self.result = SubmitResult()

    def run(self) -> SubmitResult:
        attempt, last_progress, backoff = 0, time.monotonic(), 0.05
        while True:
            acked_before = len(self.result.verdicts)
            try:
                self._stream(attempt)
                return self.result
            except grpc.RpcError as exc:
                if exc.code() not in RETRYABLE:
                    raise
                if len(self.result.verdicts) > acked_before:
                    last_progress, backoff = time.monotonic(), 0.05
                if time.monotonic() - last_progress > self.retry_deadline_s:
                    raise
                log.warning("submit stream broke (%s); resending %d batch(es)", exc.code().name, len(self.unacked))
                time.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                attempt += 1
                self.result.reconnects += 1

    def _stream(self, attempt: int) -> None:
        with self.cond:
            self.attempt = attempt
            resend = list(self.unacked)
        self.result.resent_batches += len(resend)
        # fail fast while the store is down (UNAVAILABLE), so the retry loop's deadline applies
        responses = self.submit(self._requests(attempt, resend), wait_for_ready=False, metadata=self.client._auth("worker"))
        try:
            for response in responses:
                with self.cond:
                    request = self.unacked.popleft()
                    self.cond.notify_all()
                if len(response.verdicts) != request.count:
                    raise RuntimeError("store answered with the wrong number of verdicts")
                for verdict in response.verdicts:
                    self.result.add(verdict)
        finally:
            with self.cond:
                self.attempt = -1  # stop this attempt's request generator
                self.cond.notify_all()

    def _requests(self, attempt: int, resend: list[_EncodedRequest]) -> Iterator[bytes]:
        yield from (batch.payload for batch in resend)
        while True:
            with self.cond:
                while len(self.unacked) >= self.max_in_flight and self.attempt == attempt:
                    self.cond.wait()
                if self.attempt != attempt:
                    return
                request = next(self.source, None)
                if request is None:
                    self.exhausted = True
                    # keep the stream open until every batch is answered, then half-close
                    while self.unacked and self.attempt == attempt:
                        self.cond.wait()
                    return
                self.unacked.append(request)
            yield request.payload


@dataclass(slots=True)
class _EncodedRequest:
    payload: bytes  # a serialized SubmitRequest
    count: int  # its trajectories


def _batches(trajectories: Iterable, batch_size: int) -> Iterator[_EncodedRequest]:
    batch: list[pb.Trajectory] = []
    for item in trajectories:
        batch.append(as_trajectory(item))
        if len(batch) == batch_size:
            yield _EncodedRequest(encode_submit_request(batch), len(batch))
            batch = []
    if batch:
        yield _EncodedRequest(encode_submit_request(batch), len(batch))


def encode_submit_request(trajectories: Iterable[pb.Trajectory]) -> bytes:
    """The bytes of ``SubmitRequest(trajectories=...)``, framed by hand from each trajectory's own
    serialization (building the message would first copy every trajectory into it)."""
    parts: list[bytes] = []
    for t in trajectories:
        data = t.SerializeToString()
        parts += (_TRAJECTORIES_TAG, varint_bytes(len(data)), data)
    return b"".join(parts)


_TRAJECTORIES_TAG = bytes([pb.SubmitRequest.DESCRIPTOR.fields_by_name["trajectories"].number << 3 | 2])
