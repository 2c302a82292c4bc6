"""The CUDA IPC weight channel (rollbook/weights/cuda_ipc.py). On the CPU the same code runs over
torch's shared memory, which is how most of these run anywhere; the ``gpu`` cases share device memory.

Run: python -m pytest tests/unit/test_weights_cuda_ipc.py -q
"""

from __future__ import annotations

import copy
import hashlib
import multiprocessing
import os
import pathlib
import signal
import threading
import uuid

import pytest
import torch

from rollbook.language_models import TinyModelSpec, build_tiny_model
from rollbook.weights import CudaIpcPublisher, CudaIpcReceiver, TornSnapshot, load_into
from tests.weight_helpers import SPEC, adamw_step, assert_bit_equal, bits


def channel_name() -> str:
    return f"rollbook-test-ipc-{uuid.uuid4().hex[:12]}"


def digests(state_dict: dict[str, torch.Tensor]) -> dict[str, str]:
    return {k: hashlib.blake2b(bits(v).cpu().numpy().tobytes()).hexdigest() for k, v in state_dict.items()}


@pytest.fixture
def model_and_publisher():
    model = build_tiny_model(SPEC)
    publisher = CudaIpcPublisher(channel_name(), model.state_dict())
    yield model, publisher
    publisher.close()


def test_fetch_returns_views_of_the_newest_version_and_none_when_up_to_date(model_and_publisher):
    model, publisher = model_and_publisher
    receiver = CudaIpcReceiver(publisher.name)
    assert receiver.fetch() is None and receiver.version == -1  # nothing published yet

    publisher.publish(7, model.state_dict())
    snap = receiver.fetch()
    assert snap.version == 7 == receiver.version and receiver.fetch() is None
    assert snap.checksum == b""  # nothing hashed: that would bring the bytes to the host
    assert_bit_equal(snap.state_dict, model.state_dict())
    tied = snap.state_dict["lm_head.weight"].data_ptr() == snap.state_dict["model.embed_tokens.weight"].data_ptr()
    assert tied  # the tied embedding travels once
    target = build_tiny_model(SPEC, seed=1)
    load_into(target, snap)
    assert_bit_equal(target.state_dict(), model.state_dict())


def test_snapshot_stays_valid_until_the_publisher_reuses_its_slot(model_and_publisher):
    model, publisher = model_and_publisher
    receiver = CudaIpcReceiver(publisher.name)
    publisher.publish(1, model.state_dict())
    snap = receiver.fetch()
    target = build_tiny_model(SPEC, seed=1)

    publisher.publish(2, model.state_dict())  # goes to the other slot
    assert snap.still_valid()
    load_into(target, snap)
    publisher.publish(3, model.state_dict())  # rewrites snap's slot
    assert not snap.still_valid()
    with pytest.raises(TornSnapshot):
        load_into(target, snap)
    assert receiver.fetch().version == 3


def test_reader_racing_a_publisher_never_accepts_a_torn_version():
    # every version is a constant tensor, so a torn read shows up as mixed values
    state = {"w": torch.zeros(1 << 16)}
    publisher = CudaIpcPublisher(channel_name(), state)
    receiver = CudaIpcReceiver(publisher.name)
    num_versions, accepted = 300, 0

    def publish_all() -> None:
        for v in range(1, num_versions + 1):
            state["w"].fill_(float(v))
            publisher.publish(v, state)

    writer = threading.Thread(target=publish_all)
    writer.start()
    try:
        while writer.is_alive() or receiver.version < num_versions:
            snap = receiver.fetch()
            if snap is None:
                continue
            seen = snap.state_dict["w"].clone()
            if snap.still_valid():
                assert torch.all(seen == snap.version), snap.version
                accepted += 1
    finally:
        writer.join()
        publisher.close()
    assert accepted > 0 and receiver.version == num_versions


def test_publish_refuses_old_versions_other_models_and_ties_that_diverged(model_and_publisher):
    model, publisher = model_and_publisher
    publisher.publish(5, model.state_dict())
    with pytest.raises(ValueError, match="not newer"):
        publisher.publish(5, model.state_dict())
    other = build_tiny_model(TinyModelSpec(vocab_size=128, hidden_size=32, num_heads=2, num_kv_heads=1))
    with pytest.raises(ValueError, match="model.embed_tokens.weight"):
        publisher.publish(6, other.state_dict())
    # a cast copies tied tensors apart: equal copies are accepted, and travel once
    untied = {k: v.clone() for k, v in model.state_dict().items()}
    publisher.publish(6, untied)
    untied["lm_head.weight"] = untied["lm_head.weight"] + 1
    with pytest.raises(ValueError, match="lm_head.weight is tied"):
        publisher.publish(7, untied)


def test_closing_the_publisher_stops_receivers_and_invalidates_their_snapshots(model_and_publisher):
    model, publisher = model_and_publisher
    receiver = CudaIpcReceiver(publisher.name)
    publisher.publish(1, model.state_dict())
    snap = receiver.fetch()
    publisher.close()
    assert not snap.still_valid() and receiver.fetch() is None
    with pytest.raises(FileNotFoundError, match="start the publisher"):
        CudaIpcReceiver(publisher.name)


def _publish_and_die(name: str) -> None:
    """Runs in a spawned process: publish one version, then be killed before closing anything."""
    publisher = CudaIpcPublisher(name, {"w": torch.ones(4)})
    publisher.publish(1, {"w": torch.ones(4)})
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_receiver_refuses_a_missing_channel_and_one_left_by_a_killed_publisher():
    with pytest.raises(FileNotFoundError, match="start the publisher first"):
        CudaIpcReceiver(channel_name())
    name = channel_name()
    child = multiprocessing.get_context("spawn").Process(target=_publish_and_die, args=(name,))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == -signal.SIGKILL
    try:
        with pytest.raises(FileNotFoundError, match=f"pid {child.pid}\\) that is gone"):
            CudaIpcReceiver(name)  # its control file is still there; its lock went with it
        CudaIpcPublisher(name, {"w": torch.ones(4)}).close()  # a new publisher takes the name over
    finally:
        pathlib.Path("/dev/shm", name).unlink(missing_ok=True)


def test_the_rollout_worker_opens_the_channel_from_its_spec(model_and_publisher):
    from rollbook.rollout.main import open_channel

    model, publisher = model_and_publisher
    publisher.publish(1, model.state_dict())
    channel = open_channel(f"cuda-ipc:{publisher.name}")
    assert isinstance(channel, CudaIpcReceiver) and channel.fetch().version == 1


def _load_in_child(name: str, device: str, queue) -> None:
    """Runs in a spawned process: open the channel, load the newest version into a model of our own
    on ``device``, report what was loaded and where the views live."""
    torch.set_num_threads(1)
    receiver = CudaIpcReceiver(name)
    snap = receiver.fetch()
    model = build_tiny_model(SPEC, seed=1).to(device)
    load_into(model, snap)
    devices = {str(t.device) for t in snap.state_dict.values()}
    queue.put((snap.version, devices, digests(model.state_dict())))


def _in_children(name: str, device: str, count: int) -> list[tuple]:
    ctx = multiprocessing.get_context("spawn")
    out = []
    for _ in range(count):  # one after the other: each opens the buffer the one before let go of
        queue = ctx.Queue()
        child = ctx.Process(target=_load_in_child, args=(name, device, queue))
        child.start()
        out.append(queue.get(timeout=120))
        child.join(timeout=30)
        assert child.exitcode == 0
    return out


def test_second_processes_open_the_shared_buffer_and_load_it(model_and_publisher):
    model, publisher = model_and_publisher
    publisher.publish(1, model.state_dict())
    adamw_step(model)
    publisher.publish(2, model.state_dict())  # slot 0; slot 1 still holds version 1

    for version, devices, loaded in _in_children(publisher.name, "cpu", 2):
        assert version == 2 and devices == {"cpu"}
        assert loaded == digests(model.state_dict())


@pytest.mark.gpu
def test_cuda_second_process_copies_the_trainers_device_buffer_device_to_device():
    trained = build_tiny_model(SPEC)  # trained on the CPU, published from a copy on the GPU

    def published() -> dict[str, torch.Tensor]:  # a bfloat16 cast copies the tied embedding apart
        on_gpu = copy.deepcopy(trained).to("cuda")
        return {k: v.to(torch.bfloat16) for k, v in on_gpu.state_dict().items()}

    template = copy.deepcopy(trained).to("cuda", torch.bfloat16).state_dict()  # tied, as the model is
    publisher = CudaIpcPublisher(channel_name(), template)
    try:
        assert publisher.device == torch.device("cuda", torch.cuda.current_device())
        publisher.publish(1, published())
        adamw_step(trained)
        state = published()
        publisher.publish(2, state)
        want = digests({k: v.float() for k, v in state.items()})  # the children's models are float32
        for version, devices, loaded in _in_children(publisher.name, "cuda", 2):
            assert version == 2 and devices == {str(publisher.device)}  # views over the publisher's memory
            assert loaded == want
        snap = CudaIpcReceiver(publisher.name).fetch()  # in this process: the publisher's own buffer
        assert snap.version == 2 and all(t.is_cuda for t in snap.state_dict.values())
        assert_bit_equal(snap.state_dict, state)
    finally:
        publisher.close()
