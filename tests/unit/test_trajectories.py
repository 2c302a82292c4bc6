"""The shared data model (``rollbook/trajectories.py``): ``trajectory_from_dict``, ``decode``, the
columnar ``TrajectoryColumns``, ``Ragged`` and ``varint_bytes``.

Run: ``python -m pytest tests/unit/test_trajectories.py -q``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from rollbook.trajectories import Ragged, decode, decode_messages, trajectory_from_dict, varint_bytes
from rollbook.v1 import rollbook_pb2 as pb


def _dict(**fields) -> dict:
    d = dict(
        trajectory_id="t",
        model_id="m",
        prompt_token_ids=[7, 8],
        output_token_ids=[1, 2, 3],
        output_logprobs=[-0.5, -1.0, -2.0],
        output_versions=[3, 3, 4],
        temperature=0.7,
        top_p=0.9,
        reward=1.5,
    )
    d.update(fields)
    return d


def test_unknown_keys_raise_value_error_naming_them():
    with pytest.raises(ValueError, match=r"unknown Trajectory field\(s\) \['logprobs', 'rewrad'\]"):
        trajectory_from_dict(_dict(rewrad=1.0, logprobs=[-1.0]))


def test_known_keys_build_the_message_field_by_field():
    msg = trajectory_from_dict(_dict(group_size=4, attempt=2, consumed=True, top_k=50, finish_reason="stop"))
    assert isinstance(msg, pb.Trajectory)
    assert (msg.trajectory_id, msg.group_size, msg.attempt, msg.consumed, msg.top_k) == ("t", 4, 2, True, 50)
    assert list(msg.output_token_ids) == [1, 2, 3] and list(msg.output_versions) == [3, 3, 4]
    assert msg.temperature == pytest.approx(0.7) and msg.reward == 1.5


def test_none_leaves_an_optional_field_unset():
    msg = trajectory_from_dict(_dict(reward=None, top_k=None, temperature=None))
    assert not msg.HasField("reward") and not msg.HasField("top_k") and not msg.HasField("temperature")
    assert msg.HasField("top_p")


def test_numpy_arrays_and_scalars_are_accepted():
    msg = trajectory_from_dict(
        _dict(
            output_token_ids=np.array([4, 5], np.int64),
            output_logprobs=np.array([-1, -2], np.float32),
            output_versions=np.array([0, 1]),
            group_size=np.uint32(3),
            temperature=np.float32(0.5),
            reward=np.float64(2.0),
            created_at=np.float64(12.5),
        )
    )
    assert list(msg.output_token_ids) == [4, 5] and list(msg.output_logprobs) == [-1.0, -2.0]
    assert (msg.group_size, msg.temperature, msg.reward, msg.created_at) == (3, 0.5, 2.0, 12.5)


def test_a_dataclass_goes_through_asdict():
    @dataclasses.dataclass
    class Sample:
        trajectory_id: str
        output_token_ids: list[int]
        reward: float | None = None

    msg = trajectory_from_dict(dataclasses.asdict(Sample("d", [1])))
    assert msg.trajectory_id == "d" and not msg.HasField("reward")


def test_the_call_tree_fields_default_to_no_parent_and_not_branched():
    first = trajectory_from_dict(_dict(request_id="turn-0.0"))
    edited = trajectory_from_dict(_dict(request_id="turn-2.1", parent_request_id="turn-1.0", branched=np.bool_(True)))
    assert (first.parent_request_id, first.branched) == ("", False)
    assert (edited.parent_request_id, edited.branched) == ("turn-1.0", True)
    assert trajectory_from_dict(_dict(parent_request_id=None, branched=None)) == trajectory_from_dict(_dict())
    batch = decode_messages([first, edited])
    assert batch.column("parent_request_id") == ["", "turn-1.0"] and batch.column("branched") == [False, True]


def test_decode_exposes_the_token_arrays_with_the_schema_dtypes():
    row = decode(trajectory_from_dict(_dict()))
    assert row.trajectory_id == "t"
    assert (row.prompt.dtype, row.tokens.dtype, row.logprobs.dtype, row.versions.dtype) == (
        np.int32,
        np.int32,
        np.float32,
        np.int64,
    )
    assert row.tokens.tolist() == [1, 2, 3] and row.versions.tolist() == [3, 3, 4]


def test_decode_messages_keeps_each_repeated_field_flat_with_row_offsets():
    batch = decode_messages([trajectory_from_dict(_dict()), trajectory_from_dict(_dict(trajectory_id="u", prompt_token_ids=[]))])
    assert len(batch) == 2 and batch.ids == ["t", "u"]
    assert batch.tokens.values.tolist() == [1, 2, 3, 1, 2, 3] and batch.tokens.offsets.tolist() == [0, 3, 6]
    assert batch.prompt.offsets.tolist() == [0, 2, 2] and batch.prompt.lengths.tolist() == [2, 0]
    assert (batch.prompt.values.dtype, batch.tokens.values.dtype, batch.logprobs.values.dtype, batch.versions.values.dtype) == (
        np.int32,
        np.int32,
        np.float32,
        np.int64,
    )
    row = batch.row(1)
    assert row.trajectory_id == "u" and row.prompt.tolist() == [] and row.versions.tolist() == [3, 3, 4]


def test_ragged_reduce_gives_the_empty_value_for_empty_rows():
    rows = Ragged(np.array([5, 1, 7, 2]), np.array([0, 2, 2, 2, 4, 4]))
    assert rows.reduce(np.maximum, -1).tolist() == [5, -1, -1, 7, -1]
    assert rows.reduce(np.add, 0).tolist() == [6, 0, 0, 9, 0]
    flags = Ragged(np.array([False, True, False]), np.array([0, 1, 1, 3]))
    assert flags.reduce(np.logical_or, False).tolist() == [False, False, True]
    assert flags.reduce(np.add, 0, dtype=np.int64).tolist() == [0, 0, 1]
    assert Ragged(np.zeros(0), np.zeros(1, np.int64)).reduce(np.maximum, 0).tolist() == []


def test_varint_bytes_is_the_protobuf_encoding():
    for n in (0, 1, 127, 128, 300, 2**31 - 1, 2**40, 2**63):
        encoded = varint_bytes(n)
        assert all(b >= 0x80 for b in encoded[:-1]) and encoded[-1] < 0x80
        assert sum((b & 0x7F) << 7 * i for i, b in enumerate(encoded)) == n
        holder = pb.Trajectory.FromString(bytes([14 << 3 | 2]) + varint_bytes(len(encoded)) + encoded)  # packed int64
        assert list(holder.output_versions) == [n if n < 2**63 else n - 2**64]
