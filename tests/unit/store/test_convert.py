"""Wire contract -> storage schema: ``trajectory_from_dict``, ``decode`` and the Arrow tables.

Run: ``python -m pytest tests/unit/store/test_convert.py -q``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pytest

from rollbook.store.convert import decode, rejections_table, rows_to_table, trajectory_from_dict
from rollbook.store.schema import REJECTION_SCHEMA, TRAJECTORY_SCHEMA
from rollbook.v1 import rollbook_pb2 as pb


def _dict(**fields) -> dict:
    d = dict(trajectory_id="t", model_id="m", prompt_token_ids=[7, 8], output_token_ids=[1, 2, 3],
             output_logprobs=[-0.5, -1.0, -2.0], output_versions=[3, 3, 4], temperature=0.7, top_p=0.9, reward=1.5)
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
    msg = trajectory_from_dict(_dict(output_token_ids=np.array([4, 5], np.int64), output_logprobs=np.array([-1, -2], np.float32),
                                     output_versions=np.array([0, 1]), group_size=np.uint32(3), temperature=np.float32(0.5),
                                     reward=np.float64(2.0), created_at=np.float64(12.5)))
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


def test_decode_exposes_the_token_arrays_with_the_schema_dtypes():
    row = decode(trajectory_from_dict(_dict()))
    assert row.trajectory_id == "t"
    assert (row.prompt.dtype, row.tokens.dtype, row.logprobs.dtype, row.versions.dtype) == (
        np.int32, np.int32, np.float32, np.int64)
    assert row.tokens.tolist() == [1, 2, 3] and row.versions.tolist() == [3, 3, 4]


def test_rows_to_table_fills_every_column_of_the_one_schema():
    rows = [decode(trajectory_from_dict(_dict())), decode(trajectory_from_dict(_dict(trajectory_id="u", reward=None, prompt_token_ids=[])))]
    table = rows_to_table(rows, received_at=99.0)
    assert table.schema == TRAJECTORY_SCHEMA
    got = table.to_pylist()
    assert got[0]["output_logprobs"] == [-0.5, -1.0, -2.0] and got[0]["output_versions"] == [3, 3, 4]
    assert (got[0]["num_prompt_tokens"], got[0]["num_output_tokens"]) == (2, 3)
    assert (got[0]["min_version"], got[0]["max_version"]) == (3, 4)
    assert got[0]["reward"] == got[0]["original_reward"] == 1.5
    assert got[1]["reward"] is None and got[1]["original_reward"] is None
    assert got[1]["prompt_token_ids"] == [] and got[1]["num_prompt_tokens"] == 0
    assert got[0]["top_k"] is None  # unset optional -> NULL, not 0
    assert {r["received_at"] for r in got} == {99.0}


def test_rejections_table_records_reason_detail_and_size():
    msg = trajectory_from_dict(_dict(session_id="s", worker_id="w"))
    table = rejections_table([(msg, "NONFINITE_LOGPROB", "output_logprobs[0] = nan")], "ingest", 5.0)
    assert table.schema == REJECTION_SCHEMA
    [r] = table.to_pylist()
    assert (r["trajectory_id"], r["reason"], r["detail"], r["stage"]) == ("t", "NONFINITE_LOGPROB", "output_logprobs[0] = nan", "ingest")
    assert (r["session_id"], r["worker_id"], r["num_output_tokens"], r["rejected_at"]) == ("s", "w", 3, 5.0)


def test_an_empty_batch_builds_an_empty_table():
    assert rows_to_table([], 0.0).equals(pa.Table.from_pylist([], schema=TRAJECTORY_SCHEMA))
    assert rejections_table([], "ingest", 0.0).equals(pa.Table.from_pylist([], schema=REJECTION_SCHEMA))
