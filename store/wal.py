"""The write-ahead log: fsync'd Arrow IPC segments that make a ``Submit`` durable.

Each group commit appends one record batch of trajectories and/or one of rejections to the open
segment pair (``NNNNNNNN.traj.arrow`` / ``NNNNNNNN.rej.arrow``, Arrow IPC stream format) and fsyncs
before any verdict is sent. The ledger later folds the batches into DuckDB and records, in the same
DuckDB transaction, how many batches of each segment it has folded (``_log_state``); a segment that
is fully folded and closed is deleted. After a kill -9 the tail of the last segment may be torn: the
reader stops at the last complete batch (nothing after it was ever acknowledged) and a new segment
is opened, so the log is never appended to past a torn tail.
"""

from __future__ import annotations

import os
import pathlib
import time
from dataclasses import dataclass, field
from typing import Callable

import pyarrow as pa

from rollbook.store.schema import REJECTION_SCHEMA, TRAJECTORY_SCHEMA

KINDS = {"traj": TRAJECTORY_SCHEMA, "rej": REJECTION_SCHEMA}


@dataclass
class LogBatch:
    """One committed group: its segment, its index in that segment, and the rows."""

    segment: int
    index: int
    trajectories: pa.Table | None
    rejections: pa.Table | None
    committed_at: float = field(default_factory=time.monotonic)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.trajectories, self.rejections) if t is not None)


def _path(root: pathlib.Path, segment: int, kind: str) -> pathlib.Path:
    return root / f"{segment:08d}.{kind}.arrow"


class _SegmentFile:
    def __init__(self, path: pathlib.Path, schema: pa.Schema):
        self.file = open(path, "wb")
        self.writer = pa.ipc.new_stream(self.file, schema)

    def append(self, batch: pa.RecordBatch) -> None:
        self.writer.write_batch(batch)
        self.file.flush()

    def sync(self) -> None:
        os.fsync(self.file.fileno())

    def close(self) -> None:
        self.writer.close()
        self.file.close()


class WriteAheadLog:
    """Appends commit groups to the current segment; rotates by size."""

    def __init__(self, root: pathlib.Path, *, first_segment: int, segment_bytes: int = 64 << 20,
                 on_rotate: Callable[[int, int], None] | None = None):
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self.segment_bytes = segment_bytes
        self.segment = first_segment
        self.on_rotate = on_rotate
        self._open()

    def _open(self) -> None:
        self.files = {kind: _SegmentFile(_path(self.root, self.segment, kind), schema) for kind, schema in KINDS.items()}
        self.index = 0
        self.bytes = 0
        _fsync_dir(self.root)

    def append(self, trajectories: pa.Table | None, rejections: pa.Table | None) -> LogBatch:
        """Write one group durably. Every group writes a batch to both files (possibly empty) so
        that batch ``index`` means the same commit in both."""
        for kind, table in (("traj", trajectories), ("rej", rejections)):
            one = _one_batch(table, KINDS[kind])
            self.files[kind].append(one)
            self.bytes += one.nbytes
        for f in self.files.values():
            f.sync()
        batch = LogBatch(self.segment, self.index, trajectories, rejections)
        self.index += 1
        if self.bytes >= self.segment_bytes:
            self.rotate()
        return batch

    def rotate(self) -> None:
        for f in self.files.values():
            f.close()
        if self.on_rotate is not None:
            self.on_rotate(self.segment, self.index)
        self.segment += 1
        self._open()

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def list_segments(root: pathlib.Path) -> list[int]:
    return sorted({int(p.name.split(".")[0]) for p in root.glob("*.arrow")})


def read_segment(root: pathlib.Path, segment: int) -> list[LogBatch]:
    """The complete commit groups of a segment (a torn tail is ignored)."""
    per_kind = {kind: _read_batches(_path(root, segment, kind)) for kind in KINDS}
    n = min(len(per_kind["traj"]), len(per_kind["rej"]))
    return [
        LogBatch(segment, i, _nonempty(per_kind["traj"][i]), _nonempty(per_kind["rej"][i]))
        for i in range(n)
    ]


def remove_segment(root: pathlib.Path, segment: int) -> None:
    for kind in KINDS:
        _path(root, segment, kind).unlink(missing_ok=True)


def _nonempty(batch: pa.RecordBatch) -> pa.Table | None:
    return pa.Table.from_batches([batch]) if batch.num_rows else None


def _read_batches(path: pathlib.Path) -> list[pa.RecordBatch]:
    """All complete record batches of one IPC stream file, stopping quietly at a torn tail."""
    if not path.exists():
        return []
    out: list[pa.RecordBatch] = []
    try:
        reader = pa.ipc.open_stream(pa.BufferReader(path.read_bytes()))
        while True:
            try:
                out.append(reader.read_next_batch())
            except StopIteration:
                break
    except (pa.ArrowInvalid, OSError, EOFError):
        pass  # torn tail after a crash: everything before it is intact
    return out


def _one_batch(table: pa.Table | None, schema: pa.Schema) -> pa.RecordBatch:
    """Exactly one record batch per kind and commit, so batch indexes agree across both files."""
    if table is None or table.num_rows == 0:
        return pa.RecordBatch.from_pylist([], schema=schema)
    return table.combine_chunks().to_batches(max_chunksize=table.num_rows)[0]


def _fsync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
