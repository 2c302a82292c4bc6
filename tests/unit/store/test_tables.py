"""Decoded trajectories -> the store's Arrow tables (``store/tables.py``).

Run: ``python -m pytest tests/unit/store/test_tables.py -q``.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from rollbook.store.schema import REJECTION_SCHEMA, TRAJECTORY_SCHEMA
from rollbook.store.tables import rejections_table, trajectories_table
from rollbook.trajectories import decode_messages, trajectory_from_dict


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


def test_trajectories_table_fills_every_column_of_the_one_schema():
    batch = decode_messages(
        [trajectory_from_dict(_dict()), trajectory_from_dict(_dict(trajectory_id="u", reward=None, prompt_token_ids=[]))]
    )
    table = trajectories_table(batch, received_at=99.0)
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
    assert [(r["parent_request_id"], r["branched"]) for r in got] == [("", False)] * 2  # unset: no parent, not branched


def test_both_tables_carry_the_call_tree():
    batch = decode_messages(
        [
            trajectory_from_dict(_dict(trajectory_id="a", request_id="turn-1.0", parent_request_id="turn-0.1")),
            trajectory_from_dict(_dict(trajectory_id="b", request_id="turn-2.0", parent_request_id="turn-1.0", branched=True)),
        ]
    )
    kept = trajectories_table(batch, 1.0).to_pylist()
    assert [(r["parent_request_id"], r["branched"]) for r in kept] == [("turn-0.1", False), ("turn-1.0", True)]
    [r] = rejections_table(batch, [(1, "OVERSIZED", "x")], "ingest", 2.0).to_pylist()
    assert (r["trajectory_id"], r["request_id"], r["parent_request_id"], r["branched"]) == ("b", "turn-2.0", "turn-1.0", True)


def test_trajectories_table_keeps_only_the_rows_asked_for():
    batch = decode_messages(
        [
            trajectory_from_dict(_dict(trajectory_id="a")),
            trajectory_from_dict(_dict(trajectory_id="bad", output_logprobs=[-1.0])),  # lengths disagree
            trajectory_from_dict(
                _dict(trajectory_id="c", output_token_ids=[9, 9, 9, 9], output_logprobs=[-1.0] * 4, output_versions=[5, 6, 6, 7])
            ),
        ]
    )
    table = trajectories_table(batch, 1.0, keep=np.array([True, False, True]))
    got = table.to_pylist()
    assert [r["trajectory_id"] for r in got] == ["a", "c"]
    assert got[1]["output_token_ids"] == [9, 9, 9, 9] and got[1]["output_versions"] == [5, 6, 6, 7]
    assert [(r["num_output_tokens"], r["min_version"], r["max_version"]) for r in got] == [(3, 3, 4), (4, 5, 7)]


def test_rejections_table_records_reason_detail_and_size():
    batch = decode_messages(
        [trajectory_from_dict(_dict(trajectory_id="ok")), trajectory_from_dict(_dict(session_id="s", worker_id="w"))]
    )
    table = rejections_table(batch, [(1, "NONFINITE_LOGPROB", "output_logprobs[0] = nan")], "ingest", 5.0)
    assert table.schema == REJECTION_SCHEMA
    [r] = table.to_pylist()
    assert (r["trajectory_id"], r["reason"], r["detail"], r["stage"]) == (
        "t",
        "NONFINITE_LOGPROB",
        "output_logprobs[0] = nan",
        "ingest",
    )
    assert (r["session_id"], r["worker_id"], r["num_output_tokens"], r["rejected_at"]) == ("s", "w", 3, 5.0)


def test_an_empty_batch_builds_an_empty_table():
    empty = decode_messages([])
    assert trajectories_table(empty, 0.0).equals(pa.Table.from_pylist([], schema=TRAJECTORY_SCHEMA))
    assert rejections_table(empty, [], "ingest", 0.0).equals(pa.Table.from_pylist([], schema=REJECTION_SCHEMA))
