"""The CPU-heavy half of a ``Submit``: parse the request bytes, decode the token arrays, run the
evidence rules, build the Arrow tables. Pure (no store state but the registry), and done outside
every lock; the ledger then only deduplicates and group-commits (``Ledger.commit``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pyarrow as pa
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet

from rollbook.store.convert import Row, decode, rejections_table, rows_to_table
from rollbook.v1 import rollbook_pb2 as pb
from rollbook.validator import ingest
from rollbook.validator.ingest import IngestConfig, Registry


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


def prepare_rows(rows: list[Row], registry: Registry, config: IngestConfig, *, validate: bool, now: float) -> Prepared:
    checked = ingest.check_batch(rows, registry, config) if validate else [None] * len(rows)
    verdicts = [None if v is None else (str(v[0]), v[1]) for v in checked]
    valid = [r for r, v in zip(rows, verdicts) if v is None]
    bad = [(r.msg, v[0], v[1]) for r, v in zip(rows, verdicts) if v is not None]
    return Prepared(
        ids=[r.trajectory_id for r in rows],
        verdicts=verdicts,
        trajectories=rows_to_table(valid, now) if valid else None,
        rejections=rejections_table(bad, "ingest", now) if bad else None,
    )


def prepare_bytes(data: bytes, registry: Registry, config: IngestConfig, *, validate: bool, now: float) -> Prepared:
    """``prepare_rows`` for a serialized ``SubmitRequest``; raises ``MalformedRequest``."""
    request = parse_message(pb.SubmitRequest, data)
    return prepare_rows([decode(t) for t in request.trajectories], registry, config, validate=validate, now=now)


def parse_message(message_type, data: bytes):
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


def _has_unknown_fields(message) -> bool:
    """Whether any (nested) unknown field was kept: discarding them changes the serialized size
    (checked in C; harmless, the store keeps no unknown fields)."""
    before = message.ByteSize()
    message.DiscardUnknownFields()
    return message.ByteSize() != before


def _wrong_wire_type(message) -> str | None:
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
def _message_fields(descriptor) -> tuple:
    return tuple(fd for fd in descriptor.fields if fd.message_type is not None and not fd.message_type.GetOptions().map_entry)
