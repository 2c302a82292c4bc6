"""The CPU-heavy half of a ``Submit``: parse the request bytes, decode the token arrays, run the
evidence rules, build the Arrow tables. Pure (no store state but the registry), and done outside
every lock; the ledger then only deduplicates and group-commits (``Ledger.commit``).

``decode_request`` reads the bytes through the ingest view (``ingest_view.proto``), which checks
them (UTF-8 strings, wire types) and shows any field sent otherwise than the contract says. The C
helper ``_varint.packed`` then walks the request bytes once, without the GIL, and decodes every
trajectory's fields straight into flat buffers, no Python object per row: the four packed arrays
(one flat array each with the rows' offsets, and each row's least and greatest value and its step
down or non-finite value, which the evidence rules read instead of the values), every singular
scalar field (strings in Arrow's layout, numbers with a presence flag: ``TrajectoryColumns.arrays``)
and how many metadata entries each row sends. Where the helper is not built or declines, the scalar
fields are read from the view row by row and its raw payloads become numpy arrays in a few bulk
operations (float32 log-probs are reinterpreted in place; a varint column is decoded in one call
over the batch's joined payloads, by ``_varint.decode`` or else by upb, or taken byte for byte when
every value is below 128). A packed field may arrive in several records, which concatenate, but
protobuf decodes each record on its own and refuses one that ends inside a value; so do both
readings (a varint split across two records, a float32 cut in two). Whatever they cannot take
exactly falls back to the ordinary parse, which also words the error.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
from google.protobuf.message import DecodeError
from google.protobuf.message import Message as ProtoMessage
from google.protobuf.unknown_fields import UnknownFieldSet

from rollbook.config import IngestConfig
from rollbook.store.access import OPEN, Caller
from rollbook.store.detect import Scanner
from rollbook.store.governance import Policy, hold_reasons
from rollbook.store.tables import rejections_table, trajectories_table
from rollbook.trajectories import (
    OPTIONAL_FIELDS,
    SCALAR_TYPES,
    Ragged,
    RowStats,
    TrajectoryColumns,
    decode_messages,
    varint_bytes,
)
from rollbook.v1 import ingest_view_pb2 as view_pb
from rollbook.v1 import rollbook_pb2 as pb
from rollbook.validator import ingest
from rollbook.validator.ingest import Registry

try:
    from rollbook.store import _varint  # type: ignore[attr-defined]  # C extension, no stub; built at install (store/_varint.c)
except ImportError:  # not built (no C compiler): upb alone, same results
    _varint = None

Message = TypeVar("Message", bound=ProtoMessage)  # a generated message class


class MalformedRequest(ValueError):
    """The bytes are not a well-formed message of the expected type (-> INVALID_ARGUMENT)."""


@dataclass
class Prepared:
    """One validated, converted batch, not yet deduplicated or committed.

    ``verdicts[i]`` is None for a valid row or ``(code, detail)``; ``trajectories`` holds the valid
    rows and ``rejections`` the others, each in batch order."""

    ids: list[str]
    verdicts: list[tuple[str, str] | None]
    trajectories: pa.Table | None
    rejections: pa.Table | None


def prepare(
    batch: TrajectoryColumns,
    registry: Registry,
    config: IngestConfig,
    *,
    validate: bool,
    now: float,
    caller: Caller = OPEN,
    policies: dict[str, Policy] | None = None,
    scanner: Scanner | None = None,
) -> Prepared:
    """Validate and convert ``batch`` as submitted by ``caller``: a key bound to models may submit
    for those alone (``Denied``, PERMISSION_DENIED, for the whole batch: nothing is stored); every
    row is stamped with the key's tenant, and the models' ``policies`` may hold valid rows from
    training (store/governance.py ``hold_reasons``)."""
    if caller.models is not None:
        for model_id in sorted(set(batch.column("model_id"))):
            caller.check_model("Submit", model_id)
    checked = ingest.check_batch(batch, registry, config) if validate else [None] * len(batch)
    verdicts = [None if v is None else (str(v[0]), v[1]) for v in checked]
    bad = [(i, v[0], v[1]) for i, v in enumerate(verdicts) if v is not None]
    keep = np.array([v is None for v in verdicts], dtype=bool) if bad else None
    held = hold_reasons(batch, caller.tenant, policies, scanner, [v is None for v in verdicts]) if policies else None
    return Prepared(
        ids=batch.ids,
        verdicts=verdicts,
        trajectories=trajectories_table(batch, now, keep, tenant=caller.tenant, held=held) if len(bad) < len(batch) else None,
        rejections=rejections_table(batch, bad, "ingest", now, tenant=caller.tenant) if bad else None,
    )


def prepare_bytes(
    data: bytes,
    registry: Registry,
    config: IngestConfig,
    *,
    validate: bool,
    now: float,
    caller: Caller = OPEN,
    policies: dict[str, Policy] | None = None,
    scanner: Scanner | None = None,
) -> Prepared:
    """``prepare`` for a serialized ``SubmitRequest``; raises ``MalformedRequest`` (and ``Denied``)."""
    return prepare(
        decode_request(data), registry, config, validate=validate, now=now, caller=caller, policies=policies, scanner=scanner
    )


def decode_request(data: bytes) -> TrajectoryColumns:
    """A serialized ``SubmitRequest`` -> its decoded ``TrajectoryColumns``; raises ``MalformedRequest``.

    Returns what ``decode_messages(parse_message(pb.SubmitRequest, data).trajectories)`` returns,
    only faster for the usual, packed encoding (tests/unit/store/test_wire_decode.py)."""
    try:
        view = view_pb.SubmitRequestView.FromString(data)
    except (DecodeError, RuntimeError, ValueError):
        view = None  # the ordinary parse below finds and words the error
    if view is not None and not _view_has_unknown_fields(view):  # unpacked arrays land among the unknown fields here
        walked = _walk(data, len(view.trajectories))
        if walked is not None:
            (prompt, tokens, logprobs, versions), scalars, metadata_sent = walked
            return TrajectoryColumns(view.trajectories, prompt, tokens, logprobs, versions, scalars, metadata_sent)
        try:
            return _decode_view(view.trajectories)
        except _NotExact:
            pass
    return decode_messages(parse_message(pb.SubmitRequest, data).trajectories)


class _NotExact(Exception):
    """The view cannot decode this batch exactly; parse it the ordinary way."""


def _view_has_unknown_fields(view: view_pb.SubmitRequestView) -> bool:
    """``_has_unknown_fields`` for the view, exactly and faster: its only nested messages are the
    trajectories, which nest none."""
    return len(UnknownFieldSet(view)) > 0 or any(len(UnknownFieldSet(t)) for t in view.trajectories)


# the packed arrays in TrajectoryColumns order: (field number, the C helper's kind, numpy dtype)
_PACKED = (
    (pb.Trajectory.PROMPT_TOKEN_IDS_FIELD_NUMBER, 0, np.int32),
    (pb.Trajectory.OUTPUT_TOKEN_IDS_FIELD_NUMBER, 0, np.int32),
    (pb.Trajectory.OUTPUT_LOGPROBS_FIELD_NUMBER, 2, np.float32),
    (pb.Trajectory.OUTPUT_VERSIONS_FIELD_NUMBER, 1, np.int64),
)
# the singular scalar fields the C helper decodes beside them: (name, field number, kind, Arrow
# type, optional); kind 3 a string, 4 a varint, 5 a double, 6 a float
_SCALAR_KINDS = {pa.string(): 3, pa.uint32(): 4, pa.int32(): 4, pa.bool_(): 4, pa.float64(): 5, pa.float32(): 6}
_SCALARS = tuple(
    (name, pb.Trajectory.DESCRIPTOR.fields_by_name[name].number, _SCALAR_KINDS[type_], type_, name in OPTIONAL_FIELDS)
    for name, type_ in SCALAR_TYPES.items()
)
_SPEC = (
    *((number, kind) for number, kind, _ in _PACKED),
    *((number, kind) for _, number, kind, _, _ in _SCALARS),
    (pb.Trajectory.METADATA_FIELD_NUMBER, 7),  # kind 7: how many map entries each row sends
)
_NUMPY = {pa.uint32(): np.uint32, pa.int32(): np.int32, pa.bool_(): np.bool_, pa.float64(): np.float64, pa.float32(): np.float32}


def _walk(data: bytes, rows: int) -> tuple[list[Ragged], dict[str, pa.Array], np.ndarray] | None:
    """The four packed arrays and every singular scalar field decoded by the C helper straight from
    the request bytes: flat arrays with each row's offsets, and one Arrow array a scalar field (no
    Python object per row); None where the helper is not built or declines (then the view's
    payloads and fields are read)."""
    if _varint is None:
        return None
    walked = _varint.packed(data, _SPEC)
    if walked is None or walked[0] != rows:
        return None
    columns = walked[1]
    arrays = []
    for (values, offsets, least, greatest, flag), (_, kind, dtype) in zip(columns, _PACKED):
        found = np.float64 if kind == 2 else np.int64  # each row's least and greatest value
        stats = RowStats(
            np.frombuffer(least, dtype=found), np.frombuffer(greatest, dtype=found), np.frombuffer(flag, dtype=np.bool_)
        )
        arrays.append(Ragged(np.frombuffer(values, dtype=dtype), np.frombuffer(offsets, dtype=np.int64), stats))
    scalars = {}
    for (first, second), (name, _, kind, type_, optional) in zip(columns[len(_PACKED) : -1], _SCALARS):
        if kind == 3:  # (the rows' UTF-8 bytes, int32 offsets): already Arrow's layout; the view's parse checked the UTF-8
            scalars[name] = pa.Array.from_buffers(type_, rows, [None, pa.py_buffer(second), pa.py_buffer(first)])
            continue
        values = np.frombuffer(first, dtype=np.int64 if kind == 4 else np.float64 if kind == 5 else np.float32)
        if kind == 4:  # a varint: its low 32 bits for (u)int32, nonzero for bool, as protobuf reads it
            values = values.astype(_NUMPY[type_])
        absent = np.frombuffer(second, dtype=np.bool_) if optional else None
        scalars[name] = pa.array(values, type=type_, mask=None if absent is None else ~absent)
    return arrays, scalars, np.frombuffer(columns[-1][0], dtype=np.int64) > 0


def _decode_view(msgs: Sequence[view_pb.TrajectoryView]) -> TrajectoryColumns:
    return TrajectoryColumns(
        msgs=msgs,
        prompt=_varints(msgs, "prompt_token_ids", np.int32),
        tokens=_varints(msgs, "output_token_ids", np.int32),
        logprobs=_float32s(msgs, "output_logprobs"),
        versions=_varints(msgs, "output_versions", np.int64),
    )


def _payloads(msgs: Sequence[view_pb.TrajectoryView], name: str) -> tuple[bytes, np.ndarray, np.ndarray]:
    """The field's packed payloads of every row joined, each row's byte offsets into them, and the
    end offset of every record (a field sent in several records is their concatenation, as the
    protobuf encoding says; but each record must decode on its own, so the caller checks that no
    value straddles a record boundary: protobuf refuses a record that ends inside a value)."""
    blobs, ends, at = [], [], 0
    for m in msgs:
        pieces = getattr(m, name)
        if len(pieces) == 1:
            blob = pieces[0]
        else:
            blob, end = b"".join(pieces), at
            for piece in pieces[:-1]:  # the row's last record ends with the row: checked by the caller
                end += len(piece)
                ends.append(end)
        blobs.append(blob)
        at += len(blob)
    offsets = np.zeros(len(blobs) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, blobs), np.int64, len(blobs)), out=offsets[1:])
    return b"".join(blobs), offsets, np.asarray(ends, dtype=np.int64)


def _float32s(msgs: Sequence[view_pb.TrajectoryView], name: str) -> Ragged:
    raw, offsets, ends = _payloads(msgs, name)
    if (offsets % 4).any() or (ends % 4).any():  # a record of 4k+1..3 bytes: protobuf refuses it
        raise _NotExact(name)
    return Ragged(np.frombuffer(raw, dtype="<f4").astype(np.float32, copy=False), offsets // 4)


def _varints(msgs: Sequence[view_pb.TrajectoryView], name: str, dtype: type) -> Ragged:
    raw, offsets, ends = _payloads(msgs, name)
    last = np.frombuffer(raw, dtype=np.uint8) < 0x80  # the final byte of each varint
    lengths = np.diff(offsets)
    if not last[offsets[1:][lengths > 0] - 1].all():
        raise _NotExact(f"{name}: a varint runs past the end of its row")
    if len(ends) and not last[ends[ends > 0] - 1].all():
        raise _NotExact(f"{name}: a varint runs past the end of its record")
    if last.all():  # every value below 128: one byte each
        return Ragged(np.frombuffer(raw, dtype=np.uint8).astype(dtype), offsets)
    row_offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(_row_counts(last, offsets), out=row_offsets[1:])
    if _varint is not None:  # C, without the GIL; any doubt (-1) goes on to upb
        values = np.empty(row_offsets[-1], dtype=np.int64)
        if _varint.decode(raw, values) == len(values):  # int32: the low 32 bits, as upb
            return Ragged(values.astype(dtype, copy=False), row_offsets)
    try:  # one upb call over the joined payloads: the real field's decoding, int32/int64 truncation included
        holder = pb.Trajectory.FromString(_FIELD_TAGS[name] + varint_bytes(len(raw)) + raw)
    except (DecodeError, RuntimeError, ValueError):
        raise _NotExact(name) from None
    values = np.asarray(getattr(holder, name), dtype=dtype)
    if len(values) != row_offsets[-1]:
        raise _NotExact(name)
    return Ragged(values, row_offsets)


def _row_counts(mask: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """The True values in each row of ``mask`` (rows at ``offsets``): one ``count_nonzero`` a row,
    several times faster on a batch's payloads than a ``reduceat`` that casts bool to int64."""
    bounds = offsets.tolist()
    return np.fromiter((np.count_nonzero(mask[a:b]) for a, b in zip(bounds, bounds[1:])), np.int64, len(bounds) - 1)


# each packed varint field's tag (field number << 3 | wire type 2): one byte for fields 1-15
_FIELD_TAGS = {
    name: bytes([pb.Trajectory.DESCRIPTOR.fields_by_name[name].number << 3 | 2])
    for name in ("prompt_token_ids", "output_token_ids", "output_versions")
}


def parse_message(message_type: type[Message], data: bytes) -> Message:
    """Parse ``data``; a known field sent with the wrong wire type is refused too (upb would keep it
    as an unknown field and leave the real one unset: a reward would silently vanish). Unknown field
    numbers stay legal, so newer clients keep working."""
    try:
        message = message_type.FromString(data)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise MalformedRequest(f"request does not parse as {message_type.DESCRIPTOR.full_name}: {exc}") from None
    if _has_unknown_fields(message):  # rare: parse again for the precise, slower check
        wrong = _wrong_wire_type(message_type.FromString(data))
        if wrong:
            raise MalformedRequest(f"request does not parse as {message_type.DESCRIPTOR.full_name}: {wrong}")
    return message


def _has_unknown_fields(message: Any) -> bool:  # any protobuf message
    """Whether any (nested) unknown field was kept: discarding them changes the serialized size
    (checked in C; harmless, the store keeps no unknown fields)."""
    before = message.ByteSize()
    message.DiscardUnknownFields()
    return message.ByteSize() != before


def _wrong_wire_type(message: Any) -> str | None:
    descriptor = message.DESCRIPTOR
    fields = descriptor.fields_by_number
    for unknown in UnknownFieldSet(message):
        if unknown.field_number in fields:
            name = fields[unknown.field_number].full_name
            return f"field {name} (number {unknown.field_number}) arrived with wire type {unknown.wire_type}"
    for fd in _message_fields(descriptor):
        if not fd.is_repeated and not message.HasField(fd.name):
            continue
        value = getattr(message, fd.name)
        for sub in value if fd.is_repeated else [value]:
            wrong = _wrong_wire_type(sub)
            if wrong:
                return wrong
    return None


@functools.cache
def _message_fields(descriptor: Any) -> tuple:
    return tuple(fd for fd in descriptor.fields if fd.message_type is not None and not fd.message_type.GetOptions().map_entry)
