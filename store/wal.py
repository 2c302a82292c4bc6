"""The write-ahead log: fsync'd Arrow IPC segments that make a ``Submit`` durable.

Each group commit appends the record batches of its trajectories and of its rejections to the open
segment pair (``NNNNNNNN.traj.arrow`` / ``NNNNNNNN.rej.arrow``, Arrow IPC stream format), closes the
commit in both files with an empty marker batch (custom metadata ``rollbook.commit_end``), and
fsyncs before any verdict is sent. A commit counts only when both files hold its marker. The ledger later folds the batches into DuckDB and records, in the same
DuckDB transaction, how many batches of each segment it has folded (``_log_state``); a segment that
is fully folded and closed is deleted. After a kill -9 the tail of the last segment may be torn: the
reader stops at the last complete batch (nothing after it was ever acknowledged) and a new segment
is opened, so the log is never appended to past a torn tail.
"""

from __future__ import annotations

import os
import pathlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pyarrow as pa

from rollbook.fsync import fsync_dir
from rollbook.store.schema import ADDED_COLUMNS, REJECTION_SCHEMA, TRAJECTORY_SCHEMA

if TYPE_CHECKING:  # pragma: no cover
    import duckdb

KINDS = {"traj": TRAJECTORY_SCHEMA, "rej": REJECTION_SCHEMA}


@dataclass
class LoggedCommit:
    """One committed group: its segment, its index in that segment, the rows, and their size (the
    bytes the commit added to the log when it was written, else the tables' buffers)."""

    segment: int
    index: int
    trajectories: pa.Table | None
    rejections: pa.Table | None
    committed_at: float = field(default_factory=time.monotonic)
    nbytes: int = -1

    def __post_init__(self) -> None:
        if self.nbytes < 0:
            self.nbytes = sum(t.nbytes for t in (self.trajectories, self.rejections) if t is not None)


def _path(root: pathlib.Path, segment: int, kind: str) -> pathlib.Path:
    return root / f"{segment:08d}.{kind}.arrow"


class _SegmentFile:
    """One segment file: an Arrow IPC stream written through Arrow's own file (no Python file object
    on the write path, which would take the interpreter lock for every buffer)."""

    def __init__(self, path: pathlib.Path, schema: pa.Schema):
        self.file = pa.OSFile(str(path), "wb")
        self.writer = pa.ipc.new_stream(self.file, schema)
        self.marker = pa.RecordBatch.from_pylist([], schema=schema)

    def append(self, tables: list[pa.Table]) -> int:
        """Write the tables' batches (no copy) and the commit-end marker; returns the bytes written."""
        start = self.file.tell()
        for table in tables:
            self.writer.write_table(table)
        self.writer.write_batch(self.marker, custom_metadata=_COMMIT_END)
        self.file.flush()
        return self.file.tell() - start

    def sync(self) -> None:
        os.fsync(self.file.fileno())

    def close(self) -> None:
        self.writer.close()
        self.file.close()


class WriteAheadLog:
    """Appends commit groups to the current segment; rotates by size."""

    def __init__(
        self,
        root: pathlib.Path,
        *,
        first_segment: int,
        segment_bytes: int = 64 << 20,
        on_rotate: Callable[[int, int], None] | None = None,
    ):
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
        fsync_dir(self.root)

    def append(self, trajectories: list[pa.Table], rejections: list[pa.Table]) -> LoggedCommit:
        """Write one group durably: commit ``index`` of this segment, closed by a marker in both
        files (so a commit torn in either file is ignored on replay)."""
        written = self.files["traj"].append(trajectories) + self.files["rej"].append(rejections)
        self.bytes += written
        for f in self.files.values():
            f.sync()
        batch = LoggedCommit(self.segment, self.index, _concat(trajectories), _concat(rejections), nbytes=written)
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


def log_root(db_path: pathlib.Path) -> pathlib.Path:
    """The write-ahead log's folder beside a ledger file (``rollbook.duckdb`` -> ``rollbook.duckdb.log``)."""
    return db_path.with_name(db_path.name + ".log")


def unfolded(con: duckdb.DuckDBPyConnection, root: pathlib.Path) -> list[LoggedCommit]:
    """The logged commits a ledger database (``con``, its ``_log_state`` table) has not folded yet,
    in log order: what the store replays on start and ``rollbook query --db`` adds to its copy."""
    folded = dict(con.execute("SELECT segment, folded_batches FROM _log_state").fetchall())
    return [b for seg in list_segments(root) for b in read_segment(root, seg) if b.index >= folded.get(seg, 0)]


def list_segments(root: pathlib.Path) -> list[int]:
    return sorted({int(p.name.split(".")[0]) for p in root.glob("*.arrow")})


def read_segment(root: pathlib.Path, segment: int) -> list[LoggedCommit]:
    """The complete commit groups of a segment (a torn tail is ignored)."""
    per_kind = {kind: _read_commits(_path(root, segment, kind), KINDS[kind]) for kind in KINDS}
    n = min(len(per_kind["traj"]), len(per_kind["rej"]))
    return [LoggedCommit(segment, i, per_kind["traj"][i], per_kind["rej"][i]) for i in range(n)]


def remove_segment(root: pathlib.Path, segment: int) -> None:
    for kind in KINDS:
        _path(root, segment, kind).unlink(missing_ok=True)


_COMMIT_END = {"rollbook.commit_end": "1"}


def _concat(tables: list[pa.Table]) -> pa.Table | None:
    present = [t for t in tables if t is not None and t.num_rows]
    return pa.concat_tables(present) if present else None


def _conform(batches: list[pa.RecordBatch], schema: pa.Schema) -> pa.Table:
    """The batches as one table in ``schema``; a segment written before a column was added to the
    schema gets that column instead of failing to read: the call tree's columns with the values of a
    trajectory that does not set them (``ADDED_COLUMNS``: no parent, not branched), the others
    (``rejections.consumed``, ``rejections.created_at``) as NULLs."""
    if batches[0].schema.equals(schema):
        return pa.Table.from_batches(batches, schema=schema)
    table = pa.Table.from_batches(batches)
    for f in schema:
        if f.name not in table.column_names:
            n = table.num_rows
            column = pa.array([ADDED_COLUMNS[f.name]] * n, f.type) if f.name in ADDED_COLUMNS else pa.nulls(n, f.type)
            table = table.append_column(f, column)
    return table.select(schema.names).cast(schema)


def _read_commits(path: pathlib.Path, schema: pa.Schema) -> list[pa.Table | None]:
    """Each complete commit of one IPC stream file as a table (None when it held no rows),
    stopping quietly at a torn tail: a commit without its end marker never happened."""
    if not path.exists():
        return []
    commits: list[pa.Table | None] = []
    current: list[pa.RecordBatch] = []
    try:
        reader = pa.ipc.open_stream(pa.BufferReader(path.read_bytes()))
        while True:
            try:
                batch, metadata = reader.read_next_batch_with_custom_metadata()
            except StopIteration:
                break
            if metadata is not None and metadata.get(b"rollbook.commit_end") == b"1":
                commits.append(_conform(current, schema) if current else None)
                current = []
            elif batch.num_rows:
                current.append(batch)
    except (pa.ArrowInvalid, OSError, EOFError):
        pass  # torn tail after a crash: every commit before it is intact
    return commits
