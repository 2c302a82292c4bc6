"""Weight channel pieces on one host: layout and packing, bit-exact deltas, the shared-memory channel.

Run: python -m pytest tests/unit/test_weights.py -q
"""

from __future__ import annotations

import hashlib
import multiprocessing
import threading
import uuid

import numpy as np
import pytest
import torch

from rollbook.language_models import TinyModelSpec, build_tiny_model
from rollbook.weights import (
    ChecksumMismatch,
    Layout,
    SharedMemoryPublisher,
    SharedMemoryReceiver,
    TornSnapshot,
    checksum,
    load_into,
)
from rollbook.weights.base import ALIGN, pack_into, tensor_views
from rollbook.weights.delta import apply_delta, compute_delta, delta_from_bytes
from tests.weight_helpers import SPEC, adamw_step, assert_bit_equal, bits


def pack(state_dict: dict[str, torch.Tensor]) -> tuple[Layout, np.ndarray]:
    layout = Layout.from_state_dict(state_dict)
    flat = np.zeros(layout.nbytes, dtype=np.uint8)
    pack_into(layout, state_dict, tensor_views(layout, flat))
    return layout, flat


def floats_from_bits(words: list[int]) -> torch.Tensor:
    return torch.from_numpy(np.array(words, dtype=np.uint32).view(np.float32))


def shm_name() -> str:
    return f"rollbook-test-{uuid.uuid4().hex[:12]}"


# --- layout and packing ---------------------------------------------------------------------------


def test_layout_aligns_every_tensor_and_ties_shared_storage_to_one_offset():
    sd = build_tiny_model(SPEC).state_dict()
    layout = Layout.from_state_dict(sd)
    offsets = {s.name: s.offset for s in layout.tensors}
    assert all(s.offset % ALIGN == 0 for s in layout.tensors) and layout.nbytes % ALIGN == 0
    # tie_word_embeddings: lm_head.weight is the embedding's storage, so it travels once
    assert offsets["lm_head.weight"] == offsets["model.embed_tokens.weight"]
    assert Layout.from_json(layout.to_json()) == layout


def test_pack_round_trips_raw_bits_of_mixed_dtypes_including_negative_zero_and_nan_payloads():
    nan_payload = floats_from_bits([0x7FC00123])  # a NaN with a payload
    sd = {
        "a": torch.tensor([0.0, -0.0, float("inf")]),
        "nan": nan_payload,
        "b": torch.arange(5, dtype=torch.bfloat16),
        "i": torch.tensor([[1, -2], [3, 4]], dtype=torch.int64),
        "empty": torch.empty(0, 3),
    }
    layout, flat = pack(sd)
    assert_bit_equal(tensor_views(layout, flat), sd)


def test_pack_refuses_a_state_dict_of_another_shape_with_the_offending_name():
    layout = Layout.from_state_dict({"w": torch.zeros(2, 3)})
    with pytest.raises(ValueError, match=r"w: got torch.float32 \(3, 2\)"):
        pack_into(layout, {"w": torch.zeros(3, 2)}, {"w": torch.zeros(2, 3)})
    with pytest.raises(ValueError, match="keys differ"):
        pack_into(layout, {"v": torch.zeros(2, 3)}, {"w": torch.zeros(2, 3)})


def test_pack_refuses_tied_tensors_that_now_hold_different_values():
    shared = torch.ones(4)
    layout = Layout.from_state_dict({"emb": shared, "head": shared})
    flat = np.zeros(layout.nbytes, dtype=np.uint8)
    pack_into(layout, {"emb": torch.ones(4), "head": torch.ones(4)}, tensor_views(layout, flat))
    with pytest.raises(ValueError, match="head is tied"):
        pack_into(layout, {"emb": torch.ones(4), "head": torch.zeros(4)}, tensor_views(layout, flat))


def test_checksum_changes_with_one_bit_of_the_weights():
    layout, flat = pack({"w": torch.zeros(4)})
    flipped = flat.copy()
    flipped[0] ^= 1
    assert checksum(layout, flat) == checksum(layout, flat.copy())
    assert checksum(layout, flat) != checksum(layout, flipped)


# --- deltas -------------------------------------------------------------------------------------


def test_delta_after_one_adamw_step_round_trips_bit_exactly():
    model = build_tiny_model(SPEC)
    base_layout, base = pack(model.state_dict())
    adamw_step(model)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    layout, new = pack(want)
    assert layout.nbytes > base_layout.nbytes  # the clones are no longer tied: a layout of their own
    layout = base_layout
    new = np.zeros_like(base)
    pack_into(layout, want, tensor_views(layout, new))  # tied in the layout, equal bits: accepted

    delta = compute_delta(base, new, base_version=0, version=1)
    wire = delta_from_bytes(delta.to_bytes(), num_changed=len(delta.indices), index_bytes=4, base_version=0, version=1)
    got = apply_delta(base, wire)

    assert 0 < len(delta.indices) <= new.nbytes // 4
    assert_bit_equal(tensor_views(layout, got), want)
    assert checksum(layout, got) == checksum(layout, new)
    assert not np.array_equal(base, got)  # the base buffer is left untouched


def test_delta_sees_sign_of_zero_and_nan_payload_changes_and_skips_equal_nans():
    # words: 0.0 -> -0.0 (bits differ), NaN -> same NaN (bits equal), NaN -> another NaN, 1.0 -> 1.0
    before = floats_from_bits([0x00000000, 0x7FC00000, 0x7FC00000, 0x3F800000])
    after = floats_from_bits([0x80000000, 0x7FC00000, 0x7FC00001, 0x3F800000])
    _, base = pack({"w": before})
    layout, new = pack({"w": after})
    delta = compute_delta(base, new, base_version=3, version=4)
    assert delta.indices.tolist() == [0, 2]
    assert torch.equal(bits(tensor_views(layout, apply_delta(base, delta))["w"]), bits(after))


def test_delta_with_an_index_past_the_buffer_is_refused():
    _, base = pack({"w": torch.zeros(16)})
    payload = np.array([10_000], dtype="<u4").tobytes() + np.array([1], dtype="<u4").tobytes()
    delta = delta_from_bytes(payload, num_changed=1, index_bytes=4, base_version=0, version=1)
    with pytest.raises(ValueError, match="past the"):
        apply_delta(base, delta)
    with pytest.raises(ValueError, match="expected 16"):
        delta_from_bytes(payload, num_changed=2, index_bytes=4, base_version=0, version=1)


# --- shared memory ------------------------------------------------------------------------------


@pytest.fixture
def model_and_publisher():
    model = build_tiny_model(SPEC)
    publisher = SharedMemoryPublisher(shm_name(), model.state_dict(), checksum=True)
    yield model, publisher
    publisher.close()


def test_shm_fetch_returns_views_over_the_mapping_and_none_when_up_to_date(model_and_publisher):
    model, publisher = model_and_publisher
    receiver = SharedMemoryReceiver(publisher.name)
    assert receiver.fetch() is None and receiver.version == -1  # nothing published yet

    publisher.publish(7, model.state_dict())
    snap = receiver.fetch()
    assert snap.version == 7 == receiver.version and receiver.fetch() is None
    assert_bit_equal(snap.state_dict, model.state_dict())
    # zero copy: a second receiver sees the very same bytes at the same place in the same slot
    again = SharedMemoryReceiver(publisher.name).fetch()
    tied = snap.state_dict["lm_head.weight"].data_ptr() == snap.state_dict["model.embed_tokens.weight"].data_ptr()
    assert tied and again.checksum == snap.checksum


def test_shm_snapshot_stays_valid_until_the_publisher_reuses_its_slot(model_and_publisher):
    model, publisher = model_and_publisher
    receiver = SharedMemoryReceiver(publisher.name)
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


def test_shm_reader_racing_a_publisher_never_accepts_a_torn_version():
    # every version is a constant tensor, so a torn read shows up as mixed values
    state = {"w": torch.zeros(1 << 16)}
    publisher = SharedMemoryPublisher(shm_name(), state)
    receiver = SharedMemoryReceiver(publisher.name)
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
            if snap.still_valid():  # seqlock validate: what we copied is that version, whole
                assert torch.all(seen == snap.version), snap.version
                accepted += 1
    finally:
        writer.join()
        publisher.close()
    assert accepted > 0 and receiver.version == num_versions


def test_shm_publish_refuses_old_versions_and_other_models(model_and_publisher):
    model, publisher = model_and_publisher
    publisher.publish(5, model.state_dict())
    with pytest.raises(ValueError, match="not newer"):
        publisher.publish(5, model.state_dict())
    other = build_tiny_model(TinyModelSpec(vocab_size=128, hidden_size=32, num_heads=2, num_kv_heads=1))
    with pytest.raises(ValueError, match="model.embed_tokens.weight"):
        publisher.publish(6, other.state_dict())


def test_shm_receiver_refuses_bytes_that_do_not_match_the_checksum(model_and_publisher):
    model, publisher = model_and_publisher
    publisher.publish(1, model.state_dict())
    for views in publisher._slots:  # corrupt the mapped bytes behind the publisher's back
        bits(views["model.norm.weight"])[0] ^= 1
    with pytest.raises(ChecksumMismatch, match="version 1"):
        SharedMemoryReceiver(publisher.name).fetch()


def test_shm_receiver_without_a_publisher_says_to_start_it():
    with pytest.raises(FileNotFoundError, match="start the publisher"):
        SharedMemoryReceiver(shm_name())


def _read_in_child(name: str, queue) -> None:
    """Runs in a spawned process: map the buffer, verify it, report per-tensor hashes."""
    receiver = SharedMemoryReceiver(name, verify=True)
    snap = receiver.fetch()
    hashes = {k: hashlib.blake2b(bits(v).numpy().tobytes()).hexdigest() for k, v in snap.state_dict.items()}
    layout, flat = pack(snap.state_dict)  # repack what we see, independently of the mapping
    queue.put((snap.version, snap.checksum, checksum(layout, flat), hashes))


def test_shm_second_process_maps_the_buffer_and_verifies_contents_and_checksum(model_and_publisher):
    model, publisher = model_and_publisher
    publisher.publish(1, model.state_dict())
    adamw_step(model)
    publisher.publish(2, model.state_dict())  # slot 0; slot 1 still holds version 1

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_read_in_child, args=(publisher.name, queue))
    child.start()
    version, recorded, recomputed, hashes = queue.get(timeout=120)
    child.join(timeout=30)

    assert child.exitcode == 0 and version == 2
    assert recorded == recomputed and len(recorded) == 32
    want = {k: hashlib.blake2b(bits(v).numpy().tobytes()).hexdigest() for k, v in model.state_dict().items()}
    assert hashes == want
