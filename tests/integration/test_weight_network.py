"""The network weight channel over a real gRPC server on 127.0.0.1, port 0.

Run: python -m pytest tests/integration/test_weight_network.py -q
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from rollbook.config import WeightStreamConfig
from rollbook.language_models import build_tiny_model
from rollbook.v1 import weights_pb2, weights_pb2_grpc
from rollbook.weights import ChecksumMismatch, NetworkPublisher, NetworkReceiver, checksum, create_weight_server
from rollbook.weights.network import WeightServicer, stream_update
from tests.weight_helpers import SPEC, adamw_step, assert_bit_equal


class CorruptingServicer(WeightServicer):
    """Flips one bit in the ``nth`` data chunk of every stream: a transport that damages bytes."""

    def __init__(self, publisher: NetworkPublisher, nth: int, *, armed: bool = True) -> None:
        super().__init__(publisher)
        self.nth, self.armed = nth, armed

    def Fetch(self, request, context):
        n = 0
        for chunk in super().Fetch(request, context):
            if chunk.WhichOneof("body") == "data":
                if n == self.nth and self.armed:
                    data = bytearray(chunk.data)
                    data[-1] ^= 0x01
                    chunk = weights_pb2.WeightChunk(data=bytes(data))
                n += 1
            yield chunk


class DeltaAnywayServicer(WeightServicer):
    """A buggy server: offers the newest delta whatever the caller holds, unless it insists on full."""

    def __init__(self, publisher: NetworkPublisher) -> None:
        super().__init__(publisher)
        self.requests: list[tuple[int, bool]] = []

    def Fetch(self, request, context):
        self.requests.append((request.have_version, request.full))
        published = self._publisher.latest
        have = request.have_version if request.full else published.delta.base_version
        yield from stream_update(published, have, request.full, self._publisher.config.chunk_bytes)


def serve(servicer: WeightServicer) -> tuple[grpc.Server, str]:
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    weights_pb2_grpc.add_WeightServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
def channel():
    """(model, publisher, receiver) around a real server from create_weight_server."""
    model = build_tiny_model(SPEC)
    publisher = NetworkPublisher(WeightStreamConfig(chunk_bytes=16 << 10, anchor_every=20))
    server, port = create_weight_server(publisher, "127.0.0.1", 0)
    server.start()
    receiver = NetworkReceiver(f"127.0.0.1:{port}")
    yield model, publisher, receiver
    receiver.close()
    server.stop(None)


def test_full_copy_round_trips_bit_exactly_then_reports_up_to_date(channel):
    model, publisher, receiver = channel
    assert receiver.fetch() is None  # nothing published yet

    publisher.publish(0, model.state_dict())
    snap = receiver.fetch()

    assert snap.version == 0 == receiver.version and receiver.last_kind == "full"
    assert_bit_equal(snap.state_dict, model.state_dict())
    assert snap.checksum == publisher.latest.checksum
    assert receiver.fetch() is None


def test_sparse_adamw_step_travels_as_a_delta_and_round_trips_bit_exactly(channel):
    model, publisher, receiver = channel
    publisher.publish(0, model.state_dict())
    full = receiver.fetch()
    adamw_step(model, train_only="layers.1.mlp")
    publisher.publish(1, model.state_dict())

    snap = receiver.fetch()

    assert snap.version == 1 and receiver.last_kind == "delta"
    # every element of the three 64x128 MLP matrices moved: 4-byte index + 4-byte value each
    assert receiver.last_payload_bytes == 3 * 64 * 128 * 8 < publisher.latest.layout.nbytes
    assert_bit_equal(snap.state_dict, model.state_dict())
    # double buffering: the earlier snapshot stays intact until the second update after it
    assert full.still_valid() and not torch.equal(
        full.state_dict["model.layers.1.mlp.up_proj.weight"], snap.state_dict["model.layers.1.mlp.up_proj.weight"]
    )
    adamw_step(model, train_only="layers.1.mlp", seed=2)
    publisher.publish(2, model.state_dict())
    assert_bit_equal(receiver.fetch().state_dict, model.state_dict())
    assert snap.still_valid() and not full.still_valid()


def test_dense_adamw_step_is_sent_full_because_its_delta_would_be_larger(channel):
    model, publisher, receiver = channel
    publisher.publish(0, model.state_dict())
    receiver.fetch()
    adamw_step(model)  # weight decay moves every element
    publisher.publish(1, model.state_dict())

    snap = receiver.fetch()

    assert publisher.latest.delta is None and receiver.last_kind == "full"
    assert_bit_equal(snap.state_dict, model.state_dict())


def test_caller_two_versions_behind_gets_a_full_copy_not_a_delta(channel):
    model, publisher, receiver = channel
    publisher.publish(0, model.state_dict())
    receiver.fetch()
    for version in (1, 2):
        adamw_step(model, train_only="layers.1.mlp", seed=version)
        publisher.publish(version, model.state_dict())

    snap = receiver.fetch()

    assert publisher.latest.delta.base_version == 1 and receiver.last_kind == "full"
    assert_bit_equal(snap.state_dict, model.state_dict())


def test_receiver_refuses_a_delta_on_the_wrong_base_and_fetches_a_full_copy():
    model = build_tiny_model(SPEC)
    publisher = NetworkPublisher(WeightStreamConfig(chunk_bytes=16 << 10))
    servicer = DeltaAnywayServicer(publisher)
    server, target = serve(servicer)
    receiver = NetworkReceiver(target)
    try:
        publisher.publish(0, model.state_dict())
        adamw_step(model, train_only="layers.1.mlp", seed=1)
        publisher.publish(1, model.state_dict())
        adamw_step(model, train_only="layers.1.mlp", seed=2)
        publisher.publish(2, model.state_dict())  # its delta's base is 1; the receiver holds nothing

        snap = receiver.fetch()

        assert servicer.requests == [(-1, False), (-1, True)]
        assert snap.version == 2 and receiver.last_kind == "full"
        assert_bit_equal(snap.state_dict, model.state_dict())
    finally:
        receiver.close()
        server.stop(None)


def test_every_anchor_every_th_publish_is_sent_full():
    model = build_tiny_model(SPEC)
    publisher = NetworkPublisher(WeightStreamConfig(anchor_every=2))
    server, port = create_weight_server(publisher)
    server.start()
    receiver = NetworkReceiver(f"127.0.0.1:{port}")
    kinds = []
    try:
        for version in range(4):
            adamw_step(model, train_only="layers.1.mlp", seed=version)
            publisher.publish(version, model.state_dict())
            receiver.fetch()
            kinds.append(receiver.last_kind)
        assert kinds == ["full", "delta", "full", "delta"]
    finally:
        receiver.close()
        server.stop(None)


def test_corrupted_full_chunk_is_detected_and_nothing_applied():
    model = build_tiny_model(SPEC)
    publisher = NetworkPublisher(WeightStreamConfig(chunk_bytes=16 << 10))
    server, target = serve(CorruptingServicer(publisher, nth=1))
    receiver = NetworkReceiver(target)
    try:
        publisher.publish(0, model.state_dict())
        with pytest.raises(ChecksumMismatch, match="version 0 \\(full\\) does not match its checksum"):
            receiver.fetch()
        assert receiver.version == -1
    finally:
        receiver.close()
        server.stop(None)


def test_corrupted_delta_chunk_is_detected_and_the_base_version_kept():
    model = build_tiny_model(SPEC)
    publisher = NetworkPublisher(WeightStreamConfig(chunk_bytes=16 << 10))
    servicer = CorruptingServicer(publisher, nth=1, armed=False)
    server, target = serve(servicer)
    receiver = NetworkReceiver(target)
    try:
        publisher.publish(0, model.state_dict())
        base = receiver.fetch()
        adamw_step(model, train_only="layers.1.mlp")
        publisher.publish(1, model.state_dict())
        servicer.armed = True
        with pytest.raises(ChecksumMismatch, match="version 1"):
            receiver.fetch()
        assert receiver.version == 0 and base.version == 0

        servicer.armed = False  # the same delta, undamaged, still applies on the kept base
        snap = receiver.fetch()
        assert receiver.last_kind == "delta"
        assert_bit_equal(snap.state_dict, model.state_dict())
    finally:
        receiver.close()
        server.stop(None)


def test_stream_in_flight_keeps_serving_its_version_across_publishes():
    # 16 MiB: more than gRPC sends ahead of a reader that has not asked for it yet
    state = {"w": torch.arange(4 << 20, dtype=torch.float32)}
    publisher = NetworkPublisher(WeightStreamConfig(chunk_bytes=64 << 10))
    server, port = create_weight_server(publisher)
    server.start()
    try:
        publisher.publish(0, state)
        want = publisher.latest.checksum
        stub = weights_pb2_grpc.WeightServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        stream = stub.Fetch(weights_pb2.WeightFetchRequest(have_version=-1))
        header = next(stream).header
        for version in (1, 2, 3):  # recycled buffers must not include the one this stream still reads
            state["w"].add_(1.0)
            publisher.publish(version, state)

        chunks = [chunk.data for chunk in stream]

        assert header.version == 0 and header.checksum == want
        assert all(len(c) <= 64 << 10 for c in chunks) and len(chunks) == 256
        assert checksum(publisher.latest.layout, b"".join(chunks)) == want
    finally:
        server.stop(None)


def test_have_version_newer_than_anything_published_is_failed_precondition(channel):
    model, publisher, receiver = channel
    stub = weights_pb2_grpc.WeightServiceStub(receiver._channel)
    for have, latest in ((0, -1), (9, 3)):  # a trainer restarted with nothing or an older version
        if latest >= 0:
            publisher.publish(latest, model.state_dict())
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Fetch(weights_pb2.WeightFetchRequest(have_version=have)))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"newer than the latest published {latest}" in err.value.details()


def test_chunks_larger_than_three_mib_are_refused_with_the_limit():
    with pytest.raises(ValueError, match="less than or equal to 3145728"):
        WeightStreamConfig(chunk_bytes=8 << 20)
