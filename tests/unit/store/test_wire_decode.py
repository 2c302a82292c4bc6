"""The store's fast reading of ``SubmitRequest`` bytes (``prepare.decode_request``: the C helper's
walk over the request's packed arrays, else the ``ingest_view.proto`` payloads) gives exactly what
the ordinary parse gives, or the ordinary parse's error, with the C helper (``store/_varint.c``)
and without it.

Run: ``python -m pytest tests/unit/store/test_wire_decode.py -q``.
"""

from __future__ import annotations

import contextlib
import math
import pathlib
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollbook.client import encode_submit_request
from rollbook.config import IngestConfig
from rollbook.store import prepare
from rollbook.store.prepare import MalformedRequest, decode_request, parse_message
from rollbook.trajectories import SCALAR_TYPES, TrajectoryColumns, decode, decode_messages, trajectory_from_dict, varint_bytes
from rollbook.v1 import ingest_view_pb2 as view_pb
from rollbook.v1 import rollbook_pb2 as pb
from rollbook.validator.ingest import check, check_batch
from tests.unit.validator import test_ingest_fuzz as fuzz

ARRAYS = ("prompt_token_ids", "output_token_ids", "output_logprobs", "output_versions")
SCALARS = [f.name for f in pb.Trajectory.DESCRIPTOR.fields if f.name not in ARRAYS]
OPTIONAL = [f.name for f in pb.Trajectory.DESCRIPTOR.fields if f.has_presence]


def reference(data: bytes) -> TrajectoryColumns:
    return decode_messages(parse_message(pb.SubmitRequest, data).trajectories)


def assert_same_batch(got: TrajectoryColumns, want: TrajectoryColumns) -> None:
    assert len(got) == len(want) and got.ids == want.ids
    for name in ("prompt", "tokens", "logprobs", "versions"):
        g, w = getattr(got, name), getattr(want, name)
        assert g.values.dtype == w.values.dtype, name
        assert g.offsets.tolist() == w.offsets.tolist(), name
        assert g.values.tobytes() == w.values.tobytes(), name  # bit for bit: NaN payloads, -0.0
        if g.stats is not None:
            assert_row_stats(g)
    for a, b in zip(got.msgs, want.msgs):
        for field in SCALARS:
            x, y = getattr(a, field), getattr(b, field)
            assert x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y)), field
        for field in OPTIONAL:
            assert a.HasField(field) == b.HasField(field), field
    for name, type_ in SCALAR_TYPES.items():  # the Arrow arrays the store builds its rows from
        g, w = got.array(name), want.array(name)
        assert g.type == w.type == type_, name
        assert [same(x, y) for x, y in zip(g.to_pylist(), w.to_pylist())] == [True] * len(w), name
        assert got.column(name) == w.to_pylist() or all(map(same, got.column(name), w.to_pylist())), name


def assert_row_stats(ragged) -> None:
    """The C helper's per-row statistics are what numpy finds in each row."""
    for i in range(len(ragged.offsets) - 1):
        row = ragged.row(i)
        if ragged.values.dtype.kind == "f":
            finite = row[np.isfinite(row)].astype(np.float64)
            assert ragged.stats.flag[i] == (len(finite) < len(row)), i
            assert ragged.stats.least[i] == (finite.min() if len(finite) else np.inf), i
            assert ragged.stats.greatest[i] == (finite.max() if len(finite) else -np.inf), i
        else:
            assert ragged.stats.flag[i] == bool((row[1:] < row[:-1]).any()), i  # compared: a diff overflows
            assert ragged.stats.least[i] == (row.min() if len(row) else np.iinfo(np.int64).max), i
            assert ragged.stats.greatest[i] == (row.max() if len(row) else np.iinfo(np.int64).min), i


def same(x, y) -> bool:
    return x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))


@contextlib.contextmanager
def without_c_helper():
    saved, prepare._varint = prepare._varint, None
    try:
        yield
    finally:
        prepare._varint = saved


def assert_decodes_like_the_ordinary_parse(data: bytes) -> None:
    """With the C helper (when built) and without it."""
    try:
        want = reference(data)
    except MalformedRequest as exc:
        want, error = None, str(exc)
    for context in (contextlib.nullcontext(), without_c_helper()):
        with context:
            if want is None:
                with pytest.raises(MalformedRequest) as got:
                    decode_request(data)
                assert str(got.value) == error
            else:
                assert_same_batch(decode_request(data), want)


def traj(**fields) -> pb.Trajectory:
    d = dict(
        trajectory_id="t",
        model_id="m",
        prompt_token_ids=[1, 200, 70000],
        output_token_ids=[5, 151935, 0],
        output_logprobs=[-0.5, -1.0, -2.0],
        output_versions=[3, 3, 4],
        temperature=0.7,
        top_p=1.0,
    )
    d.update(fields)
    return trajectory_from_dict(d)


def field(number: int, wire_type: int, payload: bytes) -> bytes:
    return varint_bytes(number << 3 | wire_type) + payload


def length_delimited(number: int, payload: bytes) -> bytes:
    return field(number, 2, varint_bytes(len(payload)) + payload)


def request(*trajectories: bytes) -> bytes:
    return b"".join(length_delimited(1, t) for t in trajectories)


# ---- the view mirrors the contract -----------------------------------------------------------------


def test_the_view_is_the_trajectory_field_for_field_with_the_packed_arrays_as_bytes():
    contract, view = pb.Trajectory.DESCRIPTOR, view_pb.TrajectoryView.DESCRIPTOR
    assert [(f.name, f.number) for f in view.fields] == [(f.name, f.number) for f in contract.fields]
    for c in contract.fields:
        v = view.fields_by_name[c.name]
        if c.name in ARRAYS:
            assert c.is_repeated and v.is_repeated and v.type == v.TYPE_BYTES, c.name
        else:
            assert (v.type, v.is_repeated, v.has_presence) == (c.type, c.is_repeated, c.has_presence), c.name
    outer = view_pb.SubmitRequestView.DESCRIPTOR.fields
    assert [(f.name, f.number, f.message_type.full_name) for f in outer] == [("trajectories", 1, "rollbook.v1.TrajectoryView")]
    assert [f.number for f in pb.SubmitRequest.DESCRIPTOR.fields] == [1]


# ---- packed encodings (what every protobuf library writes) ---------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        {},
        dict(prompt_token_ids=[], output_token_ids=[], output_logprobs=[], output_versions=[]),
        dict(output_token_ids=[-1, -(2**31), 2**31 - 1, 0]),  # negative int32: ten-byte varints
        dict(output_versions=[0, 2**40, 2**63 - 1], output_token_ids=[1, 2, 3]),
        dict(output_versions=[-5, 1, 127]),
        dict(output_token_ids=[0, 1, 127], prompt_token_ids=[127]),  # every byte < 128: the one-byte path
        dict(output_logprobs=[float("nan"), float("-inf"), -0.0, 3.5e38]),
        dict(reward=float("nan"), top_k=-1, attempt=7, group_size=4, consumed=True, created_at=1.5e9),
        dict(request_id="turn-2.1", parent_request_id="turn-1.0", branched=True),
    ],
)
def test_one_packed_trajectory_decodes_like_the_ordinary_parse(fields):
    assert_decodes_like_the_ordinary_parse(encode_submit_request([traj(**fields)]))


def test_a_batch_with_empty_and_multibyte_rows_keeps_each_row_apart():
    msgs = [
        traj(trajectory_id="a"),
        traj(trajectory_id="b", output_token_ids=[], prompt_token_ids=[]),
        traj(trajectory_id="c", output_token_ids=[300] * 5, output_versions=[1] * 2),
        traj(trajectory_id="d"),
    ]
    data = encode_submit_request(msgs)
    assert_decodes_like_the_ordinary_parse(data)
    batch = decode_request(data)
    assert batch.tokens.row(2).tolist() == [300] * 5 and batch.versions.row(2).tolist() == [1, 1]
    assert batch.tokens.lengths.tolist() == [3, 0, 5, 3]


def test_packed_batches_take_the_bulk_path_and_unpacked_ones_the_ordinary_parse(monkeypatch):
    """Guards the speed, not the results: both paths agree, so only this notices a bulk path that
    always falls back."""
    calls = []
    monkeypatch.setattr(prepare, "parse_message", lambda *args: calls.append(args) or parse_message(*args))
    decode_request(encode_submit_request([traj(trajectory_id=str(i)) for i in range(8)]))
    assert calls == []
    decode_request(request(field(1, 2, varint_bytes(1) + b"u") + field(12, 0, varint_bytes(5))))
    assert len(calls) == 1


def test_an_empty_request_is_an_empty_batch():
    assert len(decode_request(b"")) == 0
    assert_decodes_like_the_ordinary_parse(b"")


# ---- encodings the view hands back to the ordinary parse ------------------------------------------


def test_unpacked_arrays_are_decoded_by_the_ordinary_parse():
    unpacked = (
        field(1, 2, varint_bytes(1) + b"u")
        + b"".join(field(12, 0, varint_bytes(v)) for v in (5, 300, 7))
        + b"".join(field(13, 5, struct.pack("<f", -1.0)) for _ in range(3))
        + b"".join(field(14, 0, varint_bytes(2)) for _ in range(3))
    )
    assert_decodes_like_the_ordinary_parse(request(unpacked))
    assert decode_request(request(unpacked)).tokens.values.tolist() == [5, 300, 7]


def test_a_packed_array_sent_in_pieces_is_their_concatenation():
    pieces = (
        length_delimited(1, b"p")
        + length_delimited(12, varint_bytes(1) + varint_bytes(300))
        + length_delimited(12, varint_bytes(2))
        + length_delimited(13, struct.pack("<2f", -1, -2))
        + length_delimited(13, struct.pack("<f", -3))
    )
    assert_decodes_like_the_ordinary_parse(request(pieces))
    batch = decode_request(request(pieces))
    assert batch.tokens.values.tolist() == [1, 300, 2] and batch.logprobs.values.tolist() == [-1, -2, -3]


@pytest.mark.parametrize(
    "records",
    [
        length_delimited(12, b"\x85") + length_delimited(12, b"\x00"),  # one varint (5) split across two records
        length_delimited(14, b"\xff\xff") + length_delimited(14, b"\x01"),
        length_delimited(11, b"\x80") + length_delimited(11, b"\x01") + length_delimited(12, b"\x01"),
        length_delimited(13, struct.pack("<f", -1.0)[:3]) + length_delimited(13, struct.pack("<f", -1.0)[3:]),
        length_delimited(13, struct.pack("<2f", -1, -2)[:6]) + length_delimited(13, struct.pack("<2f", -1, -2)[6:]),
    ],
    ids=["tokens", "versions", "prompt", "float-3+1", "float-6+2"],
)
def test_a_value_split_across_two_packed_records_is_refused_like_protobuf_refuses_it(records):
    """Each record of a packed field must decode on its own (protobuf: a record ending inside a value
    is corrupt), so the concatenation must not be read as a different, valid value."""
    data = request(length_delimited(1, b"s") + records)
    with pytest.raises(MalformedRequest):
        reference(data)
    assert_decodes_like_the_ordinary_parse(data)


def test_empty_records_and_whole_values_in_several_records_take_the_bulk_path(monkeypatch):
    calls = []
    monkeypatch.setattr(prepare, "parse_message", lambda *args: calls.append(args) or parse_message(*args))
    pieces = (
        length_delimited(1, b"e")
        + length_delimited(12, b"")
        + length_delimited(12, b"\x85\x00")
        + length_delimited(12, b"")
        + length_delimited(12, b"\x01")
        + length_delimited(13, b"")
        + length_delimited(13, struct.pack("<2f", -1, -2))
    )
    data = request(pieces, pieces)
    assert decode_request(data).tokens.values.tolist() == [5, 1, 5, 1]
    assert calls == []
    assert_decodes_like_the_ordinary_parse(data)


def test_unknown_field_numbers_are_still_accepted():
    newer_client = traj().SerializeToString() + field(99, 0, varint_bytes(1))
    assert_decodes_like_the_ordinary_parse(request(newer_client))


@pytest.mark.parametrize(
    "bad",
    [
        length_delimited(12, b"\x80\x80"),  # a varint that never ends
        length_delimited(12, b"\x81") + length_delimited(1, b"x"),
        length_delimited(13, b"\x00\x00\x80"),  # 3 bytes of float32
        length_delimited(12, b"\xff" * 11 + b"\x01"),  # an 12-byte varint
        field(19, 0, varint_bytes(1)),  # reward (double) sent as a varint
    ],
)
def test_broken_payloads_get_the_ordinary_parse_error(bad):
    data = request(traj().SerializeToString() + bad)
    with pytest.raises(MalformedRequest):
        reference(data)
    assert_decodes_like_the_ordinary_parse(data)


def test_a_varint_cut_at_the_end_of_one_row_does_not_borrow_the_next_rows_bytes():
    cut = length_delimited(1, b"a") + length_delimited(12, b"\x81")  # continuation bit set, payload ends
    data = request(cut, traj(trajectory_id="b").SerializeToString())
    with pytest.raises(MalformedRequest):
        decode_request(data)


# ---- the C helper ---------------------------------------------------------------------------------


def c_decode(encoded: bytes, capacity: int) -> tuple[int, list[int]]:
    varint = pytest.importorskip("rollbook.store._varint", reason="the C helper is not built here")
    out = np.zeros(capacity, dtype=np.int64)
    n = varint.decode(encoded, out)
    return n, out[: max(n, 0)].tolist()


def test_the_c_helper_decodes_varints_like_protobuf():
    values = [0, 1, 127, 128, 300, 2**31 - 1, 2**40, 2**63 - 1, 2**63, 2**64 - 1]
    encoded = b"".join(varint_bytes(v) for v in values)
    assert c_decode(encoded, len(values)) == (len(values), [v - 2**64 if v >= 2**63 else v for v in values])
    assert c_decode(b"", 0) == (0, [])


@pytest.mark.parametrize(
    "encoded, capacity",
    [
        (b"\x80", 1),  # cut off
        (b"\x01\x80\x80", 2),
        (b"\xff" * 9 + b"\x02", 1),  # bits above 64
        (b"\xff" * 10 + b"\x01", 1),  # eleven bytes
        (b"\x01\x02\x03", 2),  # more values than room
    ],
)
def test_the_c_helper_declines_what_it_cannot_take_exactly(encoded, capacity):
    assert c_decode(encoded, capacity)[0] == -1


def test_packed_batches_are_read_by_the_c_walker_not_the_views_payloads(monkeypatch):
    """Guards the speed: the walker agrees with the other readings (the properties below), so only
    this notices one that always declines."""
    pytest.importorskip("rollbook.store._varint", reason="the C helper is not built here")
    monkeypatch.setattr(prepare, "_decode_view", lambda msgs: pytest.fail("read through the view's payloads"))
    msgs = [traj(trajectory_id=str(i), output_token_ids=[i, 300, 2**31 - 1], output_versions=[0, 1, 2**40]) for i in range(5)]
    batch = decode_request(encode_submit_request(msgs))
    assert set(batch.arrays) == set(SCALAR_TYPES)  # the scalar fields came with them, not row by row
    assert_same_batch(batch, reference(encode_submit_request(msgs)))


@pytest.mark.parametrize(
    "trajectory",
    [
        field(12, 0, varint_bytes(5)),  # sent unpacked
        length_delimited(12, b"\x85") + length_delimited(12, b"\x00"),  # a value split across records
        length_delimited(13, b"\x00\x00\x80"),  # 3 bytes of float32
        length_delimited(14, b"\xff" * 10 + b"\x01"),  # eleven bytes
        length_delimited(14, b"\xff" * 9 + b"\x02"),  # bits above 64
        field(7, 3, b""),  # a group
        b"\x80",  # a tag cut off
        field(1, 2, varint_bytes(50) + b"short"),  # a length past the end
    ],
    ids=["unpacked", "split", "float-3", "eleven-bytes", "above-64-bits", "group", "cut-tag", "long-length"],
)
def test_the_c_walker_declines_what_it_cannot_take_exactly(trajectory):
    varint = pytest.importorskip("rollbook.store._varint", reason="the C helper is not built here")
    assert varint.packed(request(trajectory), prepare._SPEC) is None
    assert varint.packed(request(length_delimited(1, b"ok")), prepare._SPEC) is not None


@pytest.mark.parametrize(
    "extra",
    [
        length_delimited(1, b"second-id"),  # a string sent twice: the last one counts
        field(4, 0, varint_bytes(9)),  # group_size twice
        field(19, 1, struct.pack("<d", 2.5)),  # reward twice
        field(15, 5, struct.pack("<f", 0.25)),  # temperature twice
        field(7, 0, varint_bytes(2)),  # a bool sent as 2: true
        field(17, 0, varint_bytes(2**64 - 1)),  # top_k -1 as ten bytes
        field(4, 0, varint_bytes(2**33 + 5)),  # a uint32 sent wider: its low 32 bits
    ],
    ids=["string-twice", "varint-twice", "double-twice", "float-twice", "bool-2", "top-k-ten-bytes", "wide-uint32"],
)
def test_scalar_fields_sent_twice_or_wide_decode_like_the_ordinary_parse(extra):
    data = request(traj(trajectory_id="first", group_size=2, reward=1.0, consumed=False).SerializeToString() + extra)
    assert_decodes_like_the_ordinary_parse(data)


def test_the_c_walker_declines_a_singular_field_sent_twice_or_with_another_wire_type():
    varint = pytest.importorskip("rollbook.store._varint", reason="the C helper is not built here")
    once = traj(trajectory_id="a").SerializeToString()
    assert varint.packed(request(once), prepare._SPEC) is not None
    assert varint.packed(request(once + length_delimited(1, b"b")), prepare._SPEC) is None  # sent twice
    assert varint.packed(request(once + length_delimited(4, b"\x01")), prepare._SPEC) is None  # group_size as bytes


def test_the_c_walker_gives_each_scalar_field_as_arrow_buffers_with_presence():
    varint = pytest.importorskip("rollbook.store._varint", reason="the C helper is not built here")
    rows = [traj(trajectory_id="é", reward=0.5, top_k=-1), traj(trajectory_id="", top_p=None)]
    n, columns = varint.packed(encode_submit_request(rows), prepare._SPEC)
    spec = dict(zip([number for number, _ in prepare._SPEC], columns))
    data, offsets = spec[1]  # trajectory_id
    assert n == 2 and data == "é".encode() and np.frombuffer(offsets, np.int32).tolist() == [0, 2, 2]
    values, present = spec[19]  # reward: optional
    assert np.frombuffer(values, np.float64).tolist() == [0.5, 0.0] and list(present) == [1, 0]
    values, present = spec[17]  # top_k: a ten-byte varint, kept as int64
    assert np.frombuffer(values, np.int64).tolist() == [-1, 0] and list(present) == [1, 0]
    values, present = spec[16]  # top_p: a float
    assert np.frombuffer(values, np.float32).tolist() == [1.0, 0.0] and list(present) == [1, 0]


def test_the_c_walker_skips_other_fields_and_keeps_each_rows_offsets():
    varint = pytest.importorskip("rollbook.store._varint", reason="the C helper is not built here")
    rows = [
        traj(trajectory_id="a", output_token_ids=[1, 2], output_logprobs=[-1, -2], output_versions=[3, 3]),
        traj(trajectory_id="b"),
    ]
    data = encode_submit_request(rows) + field(9, 0, varint_bytes(1)) + field(8, 1, b"\0" * 8) + field(6, 5, b"\0" * 4)
    n, columns = varint.packed(data, prepare._SPEC)
    tokens, offsets, least, greatest, flag = columns[1]
    assert np.frombuffer(least, np.int64).tolist() == [1, 0] and np.frombuffer(greatest, np.int64).tolist() == [2, 151935]
    assert list(flag) == [0, 1]  # 5, 151935, 0: a step down
    assert n == 2
    assert np.frombuffer(tokens, np.int32).tolist() == [1, 2, 5, 151935, 0]
    assert np.frombuffer(offsets, np.int64).tolist() == [0, 2, 5]


def test_the_c_helper_is_built_where_a_compiler_is_available():
    """The install compiles it (pyproject ext-modules); without it the store is correct but slower."""
    import shutil
    import sysconfig

    if shutil.which("cc") is None or not (pathlib.Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        pytest.skip("no C compiler or Python headers here")
    assert prepare._varint is not None, "store/_varint.c was not built: reinstall with pip install -e ."


# ---- properties ------------------------------------------------------------------------------------

int32s = st.lists(st.integers(-(2**31), 2**31 - 1), max_size=20)
int64s = st.lists(st.integers(-(2**63), 2**63 - 1), max_size=20)
floats = st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), max_size=20)
trajectories = st.builds(
    traj,
    trajectory_id=st.text(max_size=5),
    prompt_token_ids=int32s | st.lists(st.integers(0, 127), max_size=20),
    output_token_ids=int32s | st.lists(st.integers(0, 151_935), max_size=20),
    output_logprobs=floats,
    output_versions=int64s | st.lists(st.integers(0, 9), max_size=20),
    reward=st.none() | st.floats(allow_nan=True),
    temperature=st.none() | st.floats(width=32, allow_nan=True),
    top_p=st.none() | st.floats(width=32),
    top_k=st.none() | st.integers(-(2**31), 2**31 - 1),
    group_size=st.integers(0, 2**32 - 1),
    attempt=st.integers(0, 2**32 - 1),
    consumed=st.booleans(),
    created_at=st.floats(allow_nan=True),
    domain=st.text(max_size=5),
    parent_request_id=st.text(max_size=5),
    branched=st.booleans(),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(trajectories, max_size=6))
def test_any_batch_decodes_like_the_ordinary_parse(msgs):
    assert_decodes_like_the_ordinary_parse(encode_submit_request(msgs))


def packed_payload(name: str, values) -> bytes:
    if name == "output_logprobs":
        return struct.pack(f"<{len(values)}f", *values)
    return b"".join(varint_bytes(v & (2**64 - 1)) for v in values)  # negative ints: ten-byte varints


@st.composite
def split_into_records(draw, msg: pb.Trajectory) -> bytes:
    """``msg`` with each packed array cut into one to four records at any byte (inside a varint or a
    float32 too, or nowhere), the records of different fields interleaved in any order."""
    scalars = pb.Trajectory()
    scalars.CopyFrom(msg)
    queues = []
    for name in ARRAYS:
        scalars.ClearField(name)
        payload = packed_payload(name, getattr(msg, name))
        if not payload and draw(st.booleans(), label="omit"):
            continue
        cuts = sorted(draw(st.lists(st.integers(0, len(payload)), max_size=3), label="cuts"))
        bounds = [0, *cuts, len(payload)]
        queues.append([length_delimited(ARRAY_NUMBERS[name], payload[a:b]) for a, b in zip(bounds, bounds[1:])])
    records = []
    while queues:  # a random interleaving that keeps each field's records in order
        queue = queues[draw(st.integers(0, len(queues) - 1), label="field")]
        records.append(queue.pop(0))
        queues = [q for q in queues if q]
    return scalars.SerializeToString() + b"".join(records)


ARRAY_NUMBERS = {name: pb.Trajectory.DESCRIPTOR.fields_by_name[name].number for name in ARRAYS}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(trajectories, min_size=1, max_size=4), st.data())
def test_packed_arrays_split_into_records_anywhere_decode_like_the_ordinary_parse_or_fail_like_it(msgs, data):
    """Protobuf concatenates the records of a packed field but refuses a record that ends inside a
    value; the bulk decoder must accept exactly the same inputs, with the same values."""
    encoded = [data.draw(split_into_records(m), label=f"row{i}") for i, m in enumerate(msgs)]
    assert_decodes_like_the_ordinary_parse(request(*encoded))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(trajectories, min_size=1, max_size=4), st.data())
def test_records_cut_only_between_values_are_accepted_as_the_concatenation(msgs, data):
    encoded = []
    for m in msgs:
        scalars = pb.Trajectory()
        scalars.CopyFrom(m)
        records = b""
        for name in ARRAYS:
            scalars.ClearField(name)
            values = list(getattr(m, name))
            cuts = sorted(data.draw(st.lists(st.integers(0, len(values)), max_size=3), label="cuts"))
            bounds = [0, *cuts, len(values)]
            records += b"".join(
                length_delimited(ARRAY_NUMBERS[name], packed_payload(name, values[a:b])) for a, b in zip(bounds, bounds[1:])
            )
        encoded.append(scalars.SerializeToString() + records)
    want = reference(request(*encoded))
    assert_same_batch(want, reference(encode_submit_request(msgs)))
    assert_decodes_like_the_ordinary_parse(request(*encoded))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(trajectories, min_size=1, max_size=3), st.data())
def test_any_corruption_decodes_like_the_ordinary_parse_or_fails_like_it(msgs, data):
    raw = bytearray(encode_submit_request(msgs))
    for _ in range(data.draw(st.integers(1, 4), label="edits")):
        if not raw:
            break
        at = data.draw(st.integers(0, len(raw) - 1), label="at")
        edit = data.draw(st.sampled_from(["flip", "cut", "insert"]), label="edit")
        if edit == "flip":
            raw[at] ^= 1 << data.draw(st.integers(0, 7), label="bit")
        elif edit == "cut":
            del raw[at:]
        else:
            raw[at:at] = bytes([data.draw(st.integers(0, 255), label="byte")])
    assert_decodes_like_the_ordinary_parse(bytes(raw))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), config=fuzz.configs | st.just(IngestConfig()))
def test_the_evidence_rules_on_the_c_helpers_columns_give_the_verdicts_of_check_row_by_row(data, config):
    """The store's batches come with each row's ranges found while decoding, and the rules read those
    instead of the values: they must reject exactly what ``check`` rejects row by row."""
    registry = data.draw(fuzz.small_registries(), label="registry")
    msgs = data.draw(st.lists(fuzz.near_valid_for(registry) | fuzz.trajectories(), min_size=1, max_size=6), label="batch")
    batch = decode_request(encode_submit_request(msgs))
    if prepare._varint is not None:
        assert batch.logprobs.stats is not None and batch.versions.stats is not None
    assert check_batch(batch, registry, config) == [check(decode(m), registry, config) for m in msgs]


@pytest.mark.parametrize("field_number", [1, 9, 22])  # trajectory_id, domain, parent_request_id
def test_a_string_that_is_not_utf8_is_refused_like_the_ordinary_parse(field_number):
    data = request(traj().SerializeToString() + length_delimited(field_number, b"\xff\xfe"))
    with pytest.raises(MalformedRequest, match="UTF-8"):
        reference(data)
    assert_decodes_like_the_ordinary_parse(data)
