"""Trajectories as the wire carries them, and decoded into columns: the data model that the client,
the validator and the store share (so none of them reaches into another for it).

``TrajectoryColumns`` keeps each repeated field of a whole batch as one flat numpy array plus row
offsets (``Ragged``, Arrow's list layout), so the evidence rules run over the batch at once and the
store builds its Arrow list columns from those arrays without a copy per row. ``decode_messages``
builds it from parsed messages (``np.asarray`` on each repeated container); the store's ``Submit``
path builds it straight from the request bytes (``rollbook.store.prepare.decode_request``).
``trajectory_from_dict`` and ``varint_bytes`` are the client side: a message from a plain dict, and
the varint framing of hand-built requests.

Imports nothing of rollbook but the wire stubs (``docs/design.md``, "What each folder may import").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import numpy as np
import pyarrow as pa
from google.protobuf.descriptor import FieldDescriptor

from rollbook.v1 import rollbook_pb2 as pb


@dataclass(slots=True)
class RowStats:
    """Each row's least and greatest value and a flag, found while the rows were decoded (the store's
    C helper, store/_varint.c). For integers (int64) the flag marks a value below the one before it;
    for floats (float64 of the values) a NaN or an infinity, least and greatest being over the finite
    values. A row without values has least > greatest."""

    least: np.ndarray
    greatest: np.ndarray
    flag: np.ndarray  # bool


@dataclass(slots=True)
class Ragged:
    """Variable-length rows as one flat array and ``n + 1`` int64 offsets (row ``i`` is
    ``values[offsets[i]:offsets[i + 1]]``), with each row's ``RowStats`` when the decoder found them."""

    values: np.ndarray
    offsets: np.ndarray
    stats: RowStats | None = field(default=None, repr=False, compare=False)
    _lengths: np.ndarray | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_parts(cls, parts: Sequence[np.ndarray], dtype: type) -> "Ragged":
        offsets = np.zeros(len(parts) + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, parts), np.int64, len(parts)), out=offsets[1:])
        values: np.ndarray = np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)
        return cls(values, offsets)

    @property
    def lengths(self) -> np.ndarray:
        if self._lengths is None:
            self._lengths = self.offsets[1:] - self.offsets[:-1]
        return self._lengths

    def row(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i] : self.offsets[i + 1]]

    def to_arrow(self, value_type: pa.DataType) -> pa.ListArray:
        return pa.ListArray.from_arrays(pa.array(self.offsets.astype(np.int32)), pa.array(self.values, type=value_type))

    def reduce(self, ufunc: np.ufunc, empty: Any, dtype: Any = None) -> np.ndarray:
        """``ufunc`` over each row (``np.maximum``, ``np.logical_or``, ...) in ``dtype`` (default: the
        values'); ``empty`` for empty rows."""
        starts, lengths = self.offsets[:-1], self.lengths
        if self.stats is not None and dtype is None and self.values.dtype.kind in "iu" and ufunc in (np.maximum, np.minimum):
            found = self.stats.greatest if ufunc is np.maximum else self.stats.least
            return np.where(lengths > 0, found, empty).astype(self.values.dtype)
        if len(starts) and lengths.all():
            return ufunc.reduceat(self.values, starts, dtype=dtype)
        out = np.full(len(starts), empty, dtype=dtype or self.values.dtype)
        nonempty = lengths > 0
        if nonempty.any():  # reduceat over the non-empty rows only: each runs to the next one's start
            out[nonempty] = ufunc.reduceat(self.values, starts[nonempty], dtype=dtype)
        return out


@dataclass(slots=True)
class TrajectoryRow:
    """One decoded trajectory: the message (its scalar fields) plus its token arrays as numpy."""

    msg: Any  # pb.Trajectory, or the store's ingest view of one (same scalar fields)
    trajectory_id: str
    prompt: np.ndarray  # int32 [P]
    tokens: np.ndarray  # int32 [T]
    logprobs: np.ndarray  # float32 [T] (when valid)
    versions: np.ndarray  # int64 [T] (when valid)


@dataclass(slots=True)
class TrajectoryColumns:
    """One decoded batch of trajectories: the messages (for their scalar fields) and the four repeated
    fields as ``Ragged`` columns."""

    msgs: Sequence[Any]
    prompt: Ragged  # int32
    tokens: Ragged  # int32
    logprobs: Ragged  # float32
    versions: Ragged  # int64
    # scalar fields already decoded into Arrow arrays of SCALAR_TYPES (the store's Submit path
    # decodes them with the packed arrays); any other is read from ``msgs`` when asked for
    arrays: dict[str, pa.Array] = field(default_factory=dict, repr=False)
    # per row, whether it sends metadata entries, when the decoder counted them (else read from msgs)
    metadata_sent: np.ndarray | None = field(default=None, repr=False)
    _columns: dict[str, list] = field(default_factory=dict, repr=False)

    def __len__(self) -> int:
        return len(self.msgs)

    @property
    def ids(self) -> list[str]:
        return self.column("trajectory_id")

    def column(self, name: str) -> list:
        """One scalar field of every row (``None`` where an optional field is unset), read once."""
        values = self._columns.get(name)
        if values is None:
            if name in self.arrays:
                values = self.arrays[name].to_pylist()
            elif name in OPTIONAL_FIELDS:
                values = [getattr(m, name) if m.HasField(name) else None for m in self.msgs]
            else:
                values = list(map(attrgetter(name), self.msgs))
            self._columns[name] = values
        return values

    def array(self, name: str) -> pa.Array:
        """One scalar field of every row as an Arrow array of its ``SCALAR_TYPES`` type (null where an
        optional field is unset), read once."""
        values = self.arrays.get(name)
        if values is None:
            values = self.arrays[name] = pa.array(self.column(name), type=SCALAR_TYPES[name])
        return values

    def numbers(self, name: str, unset: float = np.nan) -> np.ndarray:
        """A numeric (or bool) scalar field of every row as float64, ``unset`` where an optional field
        is unset."""
        values = self.array(name)
        if values.null_count:
            return values.cast(pa.float64()).fill_null(unset).to_numpy()
        return values.to_numpy(zero_copy_only=False).astype(np.float64, copy=False)

    def byte_lengths(self, name: str) -> np.ndarray:
        """A string field's UTF-8 length in bytes, every row (at least its length in characters)."""
        values = self.array(name)
        buffer = values.buffers()[1]
        if buffer is None:  # no rows
            return np.zeros(len(values), np.int32)
        offsets = np.frombuffer(buffer, np.int32, len(values) + 1, values.offset * 4)
        return offsets[1:] - offsets[:-1]

    def metadata_rows(self) -> np.ndarray:
        """The indices of the rows that send metadata entries."""
        if self.metadata_sent is not None:
            return np.flatnonzero(self.metadata_sent)
        return np.flatnonzero(np.fromiter(map(bool, self.column("metadata")), bool, len(self)))

    def row(self, i: int) -> TrajectoryRow:
        m = self.msgs[i]
        return TrajectoryRow(
            m, m.trajectory_id, self.prompt.row(i), self.tokens.row(i), self.logprobs.row(i), self.versions.row(i)
        )


# the fields a Trajectory may leave unset (None), as opposed to their default
OPTIONAL_FIELDS = frozenset(f.name for f in pb.Trajectory.DESCRIPTOR.fields if f.has_presence)

_ARROW_TYPES = {
    FieldDescriptor.TYPE_STRING: pa.string(),
    FieldDescriptor.TYPE_UINT32: pa.uint32(),
    FieldDescriptor.TYPE_INT32: pa.int32(),
    FieldDescriptor.TYPE_BOOL: pa.bool_(),
    FieldDescriptor.TYPE_FLOAT: pa.float32(),
    FieldDescriptor.TYPE_DOUBLE: pa.float64(),
}
# every singular scalar field of a Trajectory and its Arrow type (the store keeps these types)
SCALAR_TYPES: dict[str, pa.DataType] = {
    f.name: _ARROW_TYPES[f.type] for f in pb.Trajectory.DESCRIPTOR.fields if f.type in _ARROW_TYPES and not f.is_repeated
}


def decode(msg: pb.Trajectory) -> TrajectoryRow:
    return TrajectoryRow(
        msg=msg,
        trajectory_id=msg.trajectory_id,
        prompt=np.asarray(msg.prompt_token_ids, dtype=np.int32),
        tokens=np.asarray(msg.output_token_ids, dtype=np.int32),
        logprobs=np.asarray(msg.output_logprobs, dtype=np.float32),
        versions=np.asarray(msg.output_versions, dtype=np.int64),
    )


def decode_messages(msgs: Sequence[pb.Trajectory]) -> TrajectoryColumns:
    rows = [decode(m) for m in msgs]
    return TrajectoryColumns(
        msgs=list(msgs),
        prompt=Ragged.from_parts([r.prompt for r in rows], np.int32),
        tokens=Ragged.from_parts([r.tokens for r in rows], np.int32),
        logprobs=Ragged.from_parts([r.logprobs for r in rows], np.float32),
        versions=Ragged.from_parts([r.versions for r in rows], np.int64),
    )


def varint_bytes(n: int) -> bytes:
    """``n >= 0`` as a protobuf base-128 varint."""
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_INT_FIELDS = {"group_size", "attempt", "top_k"}
_FLOAT_FIELDS = {"temperature", "top_p", "reward", "created_at"}


def trajectory_from_dict(d: Mapping[str, Any]) -> pb.Trajectory:
    """Build a ``Trajectory`` from a plain dict (or a dataclass via ``dataclasses.asdict``).

    Unknown keys raise ``ValueError`` naming them; ``None`` values leave a field unset (so an
    optional ``reward`` can be omitted). Sequences may be lists, tuples or numpy arrays.
    """
    known = set(pb.Trajectory.DESCRIPTOR.fields_by_name)
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"unknown Trajectory field(s) {unknown}; known fields: {sorted(known)}")
    kwargs: dict[str, Any] = {}
    for key, value in d.items():
        if value is None:
            continue
        if isinstance(value, np.ndarray):
            value = value.tolist()
        elif key in _INT_FIELDS:
            value = int(value)
        elif key in _FLOAT_FIELDS:
            value = float(value)
        kwargs[key] = value
    return pb.Trajectory(**kwargs)
