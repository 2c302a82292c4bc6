"""The write-ahead log: what a reader gets back after a clean close, a rotation, and a torn tail.

Run: ``python -m pytest tests/unit/store/test_wal.py -q``.
"""

from __future__ import annotations

import os
import pathlib

import pyarrow as pa
import pytest

from rollbook.store import wal
from rollbook.store.schema import REJECTION_SCHEMA, TRAJECTORY_SCHEMA


def _traj_table(ids: list[str]) -> pa.Table:
    n = len(ids)
    cols = {f.name: pa.nulls(n, f.type) for f in TRAJECTORY_SCHEMA}
    cols["trajectory_id"] = pa.array(ids)
    cols["output_token_ids"] = pa.array([[1, 2, 3]] * n, pa.list_(pa.int32()))
    cols["output_logprobs"] = pa.array([[-0.5, -1.0, -1.5]] * n, pa.list_(pa.float32()))
    cols["num_output_tokens"] = pa.array([3] * n, pa.int32())
    return pa.table(cols, schema=TRAJECTORY_SCHEMA)


def _rej_table(ids: list[str]) -> pa.Table:
    cols = {f.name: pa.nulls(len(ids), f.type) for f in REJECTION_SCHEMA}
    cols["trajectory_id"] = pa.array(ids)
    cols["reason"] = pa.array(["NONFINITE_LOGPROB"] * len(ids))
    return pa.table(cols, schema=REJECTION_SCHEMA)


def _ids(table: pa.Table | None) -> list[str]:
    return [] if table is None else table.column("trajectory_id").to_pylist()


def _write_three(root: pathlib.Path) -> tuple[wal.WriteAheadLog, dict[str, list[int]]]:
    """Three commit groups in segment 1; returns the log (left open, as a crash leaves it) and each
    file's size after every group."""
    log = wal.WriteAheadLog(root, first_segment=1)
    sizes: dict[str, list[int]] = {"traj": [], "rej": []}
    groups = [(["a0", "a1"], ["r0"]), (["b0"], None), (["c0", "c1", "c2"], ["r1", "r2"])]
    for trajs, rejs in groups:
        log.append([_traj_table(trajs)], [_rej_table(rejs)] if rejs else [])
        for kind in sizes:
            sizes[kind].append((root / f"00000001.{kind}.arrow").stat().st_size)
    return log, sizes


def test_complete_segment_reads_back_every_group_in_order(tmp_path):
    log, _ = _write_three(tmp_path)
    log.close()
    batches = wal.read_segment(tmp_path, 1)
    assert [(b.segment, b.index) for b in batches] == [(1, 0), (1, 1), (1, 2)]
    assert [_ids(b.trajectories) for b in batches] == [["a0", "a1"], ["b0"], ["c0", "c1", "c2"]]
    assert [_ids(b.rejections) for b in batches] == [["r0"], [], ["r1", "r2"]]
    assert batches[1].rejections is None  # an empty group half reads back as None
    assert batches[0].trajectories.schema == TRAJECTORY_SCHEMA
    assert batches[0].trajectories.column("output_logprobs").to_pylist() == [[-0.5, -1.0, -1.5]] * 2


def test_unclosed_segment_after_a_crash_reads_back_every_synced_group(tmp_path):
    _write_three(tmp_path)  # never closed: no end-of-stream marker
    assert [_ids(b.trajectories) for b in wal.read_segment(tmp_path, 1)] == [["a0", "a1"], ["b0"], ["c0", "c1", "c2"]]


@pytest.mark.parametrize("kind", ["traj", "rej"])
def test_torn_tail_mid_batch_returns_only_the_complete_groups(tmp_path, kind):
    _, sizes = _write_three(tmp_path)
    path = tmp_path / f"00000001.{kind}.arrow"
    os.truncate(path, (sizes[kind][1] + sizes[kind][2]) // 2)  # inside the third group's batch
    batches = wal.read_segment(tmp_path, 1)
    assert [_ids(b.trajectories) for b in batches] == [["a0", "a1"], ["b0"]]
    assert [_ids(b.rejections) for b in batches] == [["r0"], []]


@pytest.mark.parametrize("cut", [1, 7, "second-group"])
def test_torn_tail_at_any_point_never_raises_and_never_returns_a_partial_group(tmp_path, cut):
    _, sizes = _write_three(tmp_path)
    size = sizes["traj"][1] - 3 if cut == "second-group" else cut
    os.truncate(tmp_path / "00000001.traj.arrow", size)
    batches = wal.read_segment(tmp_path, 1)
    expected = [["a0", "a1"]] if cut == "second-group" else []
    assert [_ids(b.trajectories) for b in batches] == expected


def test_a_missing_half_means_no_complete_group(tmp_path):
    _write_three(tmp_path)
    (tmp_path / "00000001.rej.arrow").unlink()
    assert wal.read_segment(tmp_path, 1) == []


def test_rotation_starts_a_new_segment_and_reports_the_closed_ones(tmp_path):
    rotated: list[tuple[int, int]] = []
    log = wal.WriteAheadLog(tmp_path, first_segment=5, segment_bytes=1, on_rotate=lambda s, n: rotated.append((s, n)))
    for i in range(3):
        batch = log.append([_traj_table([f"t{i}"])], [])
        assert (batch.segment, batch.index) == (5 + i, 0)
    log.close()
    assert rotated == [(5, 1), (6, 1), (7, 1)]
    assert wal.list_segments(tmp_path) == [5, 6, 7, 8]
    assert [_ids(b.trajectories) for s in (5, 6, 7) for b in wal.read_segment(tmp_path, s)] == [["t0"], ["t1"], ["t2"]]
    assert wal.read_segment(tmp_path, 8) == []
    wal.remove_segment(tmp_path, 5)
    assert wal.list_segments(tmp_path) == [6, 7, 8]


def test_a_segment_written_before_the_call_tree_columns_reads_back_with_their_defaults(tmp_path):
    """Acknowledged rows logged by an older store replay with no parent and not branched (the values
    of a trajectory that does not set the fields), not as a torn tail."""
    from rollbook.store.schema import ADDED_COLUMNS

    old = {kind: pa.schema([f for f in schema if f.name not in ADDED_COLUMNS]) for kind, schema in wal.KINDS.items()}
    tables = {"traj": _traj_table(["old-a", "old-b"]), "rej": _rej_table(["old-r"])}
    for kind, schema in old.items():
        segment = wal._SegmentFile(tmp_path / f"00000001.{kind}.arrow", schema)
        segment.append([tables[kind].select(schema.names)])
        segment.close()
    [batch] = wal.read_segment(tmp_path, 1)
    assert batch.trajectories.schema == TRAJECTORY_SCHEMA and batch.rejections.schema == REJECTION_SCHEMA
    for table, ids in ((batch.trajectories, ["old-a", "old-b"]), (batch.rejections, ["old-r"])):
        assert _ids(table) == ids
        assert table.column("parent_request_id").to_pylist() == [""] * len(ids)
        assert table.column("branched").to_pylist() == [False] * len(ids)
    assert batch.trajectories.column("output_token_ids").to_pylist() == [[1, 2, 3]] * 2
