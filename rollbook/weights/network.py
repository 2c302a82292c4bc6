"""Network weight channel: the trainer serves versions over gRPC, workers pull full copies or deltas.

The trainer process owns a ``NetworkPublisher`` and serves it with ``create_weight_server``; each
rollout worker holds a ``NetworkReceiver`` and calls ``fetch()`` between requests. A fetch is one
``WeightService.Fetch`` stream (proto/rollbook/v1/weights.proto): a header, then the payload in chunks
of at most ``chunk_bytes`` (far below gRPC's 4 MiB message limit).

What the server sends a caller holding ``have_version`` when ``version`` is the newest:
- nothing (UP_TO_DATE) when ``have_version == version``;
- a DELTA when ``have_version`` is the version published just before, ``version`` is not an anchor
  (every ``anchor_every``-th publish is one, starting with the first) and the delta is smaller than
  the flat buffer; the receiver applies it only on exactly that base and otherwise asks for FULL;
- a FULL copy otherwise; FAILED_PRECONDITION when ``have_version`` is newer than anything published.
Every version carries its checksum (base.checksum); the receiver hashes what it assembled and raises
``ChecksumMismatch``, keeping its previous version, when they differ.

Serve in-process: ``server, port = create_weight_server(publisher); server.start()``. TLS: pass
``tls=ServerTLS(...)`` to ``create_weight_server`` and ``tls=ClientTLS(...)`` to ``NetworkReceiver``
(rollbook/tls.py, docs/security.md).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import numpy as np

from rollbook.config import WeightStreamConfig
from rollbook.v1 import weights_pb2 as pb
from rollbook.v1 import weights_pb2_grpc
from rollbook.weights.base import (
    ChecksumMismatch,
    Layout,
    TensorSpec,
    WeightSnapshot,
    checksum,
    checksum_hasher,
    pack_into,
    tensor_views,
)
from rollbook.weights.delta import Delta, apply_delta, compute_delta, delta_from_bytes

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from rollbook.tls import ClientTLS, ServerTLS

MAX_MESSAGE_BYTES = 8 << 20  # both ends; a header lists every tensor, a chunk is <= 3 MiB


@dataclass(frozen=True)
class Published:
    """One published version; its buffer is not reused while a stream still reads it."""

    version: int
    layout: Layout
    flat: np.ndarray  # uint8 [layout.nbytes], read-only
    checksum: bytes
    delta: Delta | None  # against the version published just before; None at anchors or when not smaller


class NetworkPublisher:
    """Trainer end: keeps the newest version (and its delta) in memory for ``WeightServicer``.

    Flat buffers are recycled rather than allocated per publish (fresh pages cost more to fault in
    than the copy itself): a version's buffer returns to the pool once it is neither the newest nor
    read by an open stream, so two buffers suffice while no stream lags behind a publish.
    ``publish`` is called from one thread; streams are served from the server's threads.
    """

    def __init__(self, config: WeightStreamConfig | None = None) -> None:
        self.config = config or WeightStreamConfig()
        self.latest: Published | None = None
        self._num_published = 0
        self._lock = threading.Lock()
        self._readers: dict[int, int] = {}  # id(Published) -> open streams
        self._pool: list[np.ndarray] = []

    def publish(self, version: int, state_dict: Mapping[str, "torch.Tensor"]) -> None:
        """Pack, hash and diff ``state_dict``; its layout must match the first one published."""
        prev = self.latest
        if prev is not None and version <= prev.version:
            raise ValueError(f"version {version} is not newer than the published {prev.version}")
        layout = prev.layout if prev is not None else Layout.from_state_dict(state_dict)
        flat = self._take_buffer(layout.nbytes)
        pack_into(layout, state_dict, tensor_views(layout, flat))
        flat.flags.writeable = False
        delta = None
        if prev is not None and self._num_published % self.config.anchor_every != 0:
            delta = compute_delta(prev.flat, flat, base_version=prev.version, version=version)
            delta = delta if delta.smaller_than_full(layout.nbytes) else None
        published = Published(version, layout, flat, checksum(layout, flat), delta)
        with self._lock:
            self.latest = published
            self._num_published += 1
            if prev is not None and self._readers.get(id(prev), 0) == 0 and len(self._pool) < 2:
                self._pool.append(prev.flat)

    def acquire(self) -> Published | None:
        """The newest version, held for a stream until ``release``."""
        with self._lock:
            published = self.latest
            if published is not None:
                self._readers[id(published)] = self._readers.get(id(published), 0) + 1
            return published

    def release(self, published: Published) -> None:
        with self._lock:
            self._readers[id(published)] -= 1
            if self._readers[id(published)] == 0:
                del self._readers[id(published)]
                if published is not self.latest and len(self._pool) < 2:
                    self._pool.append(published.flat)

    def close(self) -> None:
        with self._lock:
            self.latest, self._pool = None, []

    def _take_buffer(self, nbytes: int) -> np.ndarray:
        with self._lock:
            flat = self._pool.pop() if self._pool else None
        if flat is None or flat.nbytes != nbytes:
            return np.zeros(nbytes, dtype=np.uint8)  # zeroed: the padding is hashed, and stays zero
        flat.flags.writeable = True
        return flat


class WeightServicer(weights_pb2_grpc.WeightServiceServicer):
    def __init__(self, publisher: NetworkPublisher) -> None:
        self._publisher = publisher

    def Fetch(self, request: pb.WeightFetchRequest, context: grpc.ServicerContext) -> Iterator[pb.WeightChunk]:
        published = self._publisher.acquire()  # one version for the whole stream
        try:
            latest = -1 if published is None else published.version
            if request.have_version > latest:
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"have_version {request.have_version} is newer than the latest published "
                    f"{latest}; was the trainer restored from an older checkpoint?",
                )
            yield from stream_update(published, request.have_version, request.full, self._publisher.config.chunk_bytes)
        finally:
            if published is not None:
                self._publisher.release(published)


def create_weight_server(
    publisher: NetworkPublisher, host: str = "127.0.0.1", port: int = 0, *, num_workers: int = 8, tls: "ServerTLS | None" = None
) -> tuple[grpc.Server, int]:
    """A server (not started) serving ``publisher``, and the port it bound (``port=0`` picks one);
    TLS (and client certificates, with ``tls.client_ca``) when ``tls`` is given."""
    from rollbook.tls import add_port

    options = [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0),
    ]
    server = grpc.server(ThreadPoolExecutor(max_workers=num_workers), options=options)
    weights_pb2_grpc.add_WeightServiceServicer_to_server(WeightServicer(publisher), server)
    bound = add_port(server, f"[{host}]:{port}" if ":" in host else f"{host}:{port}", tls)
    if bound == 0:
        raise OSError(f"could not bind {host}:{port}")
    return server, bound


def stream_update(published: Published | None, have_version: int, full: bool, chunk_bytes: int) -> Iterator[pb.WeightChunk]:
    """The messages answering a caller that holds ``have_version`` (see the module docstring)."""
    if published is None or have_version == published.version:
        version = -1 if published is None else published.version
        yield pb.WeightChunk(header=pb.WeightHeader(kind=pb.WEIGHT_UPDATE_KIND_UP_TO_DATE, version=version))
        return
    delta = published.delta
    if not full and delta is not None and delta.base_version == have_version:
        header = _header(published, pb.WEIGHT_UPDATE_KIND_DELTA, delta.nbytes)
        header.base_version, header.num_changed = delta.base_version, len(delta.indices)
        header.index_bytes = delta.indices.dtype.itemsize
        parts = [delta.indices.view(np.uint8), delta.values.view(np.uint8)]
    else:
        header = _header(published, pb.WEIGHT_UPDATE_KIND_FULL, published.layout.nbytes)
        parts = [published.flat]
    yield pb.WeightChunk(header=header)
    for part in parts:
        view = memoryview(part)  # type: ignore[arg-type]  # numpy arrays are buffers
        for start in range(0, len(view), chunk_bytes):
            yield pb.WeightChunk(data=bytes(view[start : start + chunk_bytes]))


class NetworkReceiver:
    """Rollout end: pulls from a ``WeightService`` at ``target`` ("host:port").

    Double-buffered like shared memory: an update is assembled in the buffer that does not hold the
    current version, so a refused update leaves the current version intact, and a snapshot's views
    stay intact until the second update after it starts (``snapshot.still_valid()`` tells).
    ``last_kind`` ("full", "delta", "" before the first) and ``last_payload_bytes`` describe the
    latest update applied.
    """

    def __init__(self, target: str, *, timeout_s: float = 120.0, tls: "ClientTLS | None" = None) -> None:
        from rollbook.tls import channel

        options: list[tuple[str, object]] = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            # A worker often starts before the trainer serves: gRPC's reconnect backoff would grow
            # toward 120 s and leave it on no weights long after the server is up; keep it short.
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.min_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 2000),
        ]
        self._channel = channel(target, tls, options)
        self._stub = weights_pb2_grpc.WeightServiceStub(self._channel)
        self._timeout_s = timeout_s
        self._version = -1
        self._layout: Layout | None = None  # none until the first fetch
        self._bufs: list[np.ndarray | None] = [None, None]
        self._epochs = [0, 0]  # bumped when a buffer starts being rewritten
        self._current = 0  # index of the buffer holding `version`
        self._scratch = bytearray()  # delta payloads, reused
        self.last_kind, self.last_payload_bytes = "", 0

    @property
    def version(self) -> int:
        return self._version

    def fetch(self) -> WeightSnapshot | None:
        return self._fetch(full=False)

    def close(self) -> None:
        self._channel.close()

    def _fetch(self, full: bool) -> WeightSnapshot | None:
        request = pb.WeightFetchRequest(have_version=self._version, full=full)
        stream = self._stub.Fetch(request, timeout=self._timeout_s)
        header = next(stream).header
        if header.kind == pb.WEIGHT_UPDATE_KIND_UP_TO_DATE:
            return None
        if header.kind not in (pb.WEIGHT_UPDATE_KIND_FULL, pb.WEIGHT_UPDATE_KIND_DELTA):
            raise ChecksumMismatch(f"stream did not start with a header (kind {header.kind})")
        layout = _layout_from_proto(header)
        is_delta = header.kind == pb.WEIGHT_UPDATE_KIND_DELTA
        if is_delta and (full or header.base_version != self._version or layout != self._layout):
            stream.cancel()  # not applicable to what we hold: never apply, ask for a full copy
            if full:
                raise ChecksumMismatch(f"asked for a full copy, got a delta on {header.base_version}")
            return self._fetch(full=True)
        spare = 1 - self._current
        self._epochs[spare] += 1
        out = self._buffer(spare, layout.nbytes)
        digest = self._apply_delta(header, stream, out) if is_delta else self._receive_full(header, layout, stream, out)
        if digest != header.checksum:
            raise ChecksumMismatch(
                f"version {header.version} ({'delta' if is_delta else 'full'}) does not "
                f"match its checksum; kept version {self._version}"
            )
        self._current, self._version, self._layout = spare, header.version, layout
        self.last_kind, self.last_payload_bytes = ("delta" if is_delta else "full"), header.payload_bytes
        epochs, epoch = self._epochs, self._epochs[spare]
        return WeightSnapshot(
            header.version, tensor_views(layout, out), header.checksum, still_valid=lambda: epochs[spare] == epoch
        )

    def _receive_full(self, header: pb.WeightHeader, layout: Layout, stream, out: np.ndarray) -> bytes:
        """Chunks straight into ``out``, hashed as they arrive (overlapping the transfer)."""
        if header.payload_bytes != layout.nbytes:
            raise ChecksumMismatch(f"full payload of {header.payload_bytes} bytes for a {layout.nbytes}-byte layout")
        hasher = checksum_hasher(layout)
        _receive(stream, memoryview(out), hasher)  # type: ignore[arg-type]  # numpy arrays are buffers
        return hasher.digest()

    def _apply_delta(self, header: pb.WeightHeader, stream, out: np.ndarray) -> bytes:
        """The current buffer with the delta applied, written into ``out``; returns its checksum."""
        if len(self._scratch) < header.payload_bytes:
            self._scratch = bytearray(header.payload_bytes)
        payload = memoryview(self._scratch)[: header.payload_bytes]
        _receive(stream, payload)
        try:
            delta = delta_from_bytes(
                payload,
                num_changed=header.num_changed,
                index_bytes=header.index_bytes,
                base_version=header.base_version,
                version=header.version,
            )
            apply_delta(self._bufs[self._current], delta, out=out)
        except ValueError as e:
            raise ChecksumMismatch(f"version {header.version}: corrupt delta payload: {e}") from e
        return checksum(self._layout, out)

    def _buffer(self, i: int, nbytes: int) -> np.ndarray:
        if self._bufs[i] is None or self._bufs[i].nbytes != nbytes:
            self._bufs[i] = np.zeros(nbytes, dtype=np.uint8)
        return self._bufs[i]


def _header(published: Published, kind: "pb.WeightUpdateKind", payload_bytes: int) -> pb.WeightHeader:
    specs = [pb.WeightTensorSpec(name=s.name, dtype=s.dtype, shape=s.shape, offset=s.offset) for s in published.layout.tensors]
    return pb.WeightHeader(
        kind=kind,
        version=published.version,
        checksum=published.checksum,
        layout=specs,
        flat_bytes=published.layout.nbytes,
        payload_bytes=payload_bytes,
    )


def _layout_from_proto(header: pb.WeightHeader) -> Layout:
    specs = tuple(TensorSpec(s.name, s.dtype, tuple(s.shape), s.offset) for s in header.layout)
    return Layout(specs, header.flat_bytes)


def _receive(stream: Iterator[pb.WeightChunk], out: memoryview, hasher=None) -> None:
    """Fill ``out`` from the data chunks; ChecksumMismatch when they do not add up to ``len(out)``."""
    filled = 0
    for chunk in stream:
        n = len(chunk.data)
        if chunk.WhichOneof("body") != "data" or filled + n > len(out):
            raise ChecksumMismatch(f"stream sent a second header or more than {len(out)} payload bytes")
        out[filled : filled + n] = chunk.data
        if hasher is not None:
            hasher.update(chunk.data)
        filled += n
    if filled != len(out):
        raise ChecksumMismatch(f"stream ended after {filled} of {len(out)} payload bytes")
