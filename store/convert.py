"""Protobuf ``Trajectory`` messages -> decoded rows -> one Arrow table in ``TRAJECTORY_SCHEMA``.

This is the single place where the wire contract becomes the storage schema. Repeated fields are
read with ``np.asarray`` (the protobuf container exposes a buffer), so a 1,000-token trajectory
costs a few microseconds here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa

from rollbook.store.schema import REJECTION_SCHEMA, TRAJECTORY_SCHEMA
from rollbook.v1 import rollbook_pb2 as pb


@dataclass(slots=True)
class Row:
    """One decoded trajectory: the message plus its token arrays as numpy."""

    msg: pb.Trajectory
    trajectory_id: str
    prompt: np.ndarray  # int32 [P]
    tokens: np.ndarray  # int32 [T]
    logprobs: np.ndarray  # float32 [T] (when valid)
    versions: np.ndarray  # int64 [T] (when valid)


def decode(msg: pb.Trajectory) -> Row:
    return Row(
        msg=msg,
        trajectory_id=msg.trajectory_id,
        prompt=np.asarray(msg.prompt_token_ids, dtype=np.int32),
        tokens=np.asarray(msg.output_token_ids, dtype=np.int32),
        logprobs=np.asarray(msg.output_logprobs, dtype=np.float32),
        versions=np.asarray(msg.output_versions, dtype=np.int64),
    )


def _list_array(parts: Sequence[np.ndarray], value_type: pa.DataType) -> pa.ListArray:
    lengths = np.fromiter((len(p) for p in parts), dtype=np.int32, count=len(parts))
    offsets = np.zeros(len(parts) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate(parts) if parts else np.zeros(0, value_type.to_pandas_dtype())
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=value_type))


def _optional(msg: pb.Trajectory, field: str) -> Any:
    return getattr(msg, field) if msg.HasField(field) else None


def rows_to_table(rows: Sequence[Row], received_at: float) -> pa.Table:
    """Accepted rows -> one Arrow table (``original_reward`` = the reward as submitted)."""
    msgs = [r.msg for r in rows]
    rewards = [_optional(m, "reward") for m in msgs]
    prompt = _list_array([r.prompt for r in rows], pa.int32())
    versions = _list_array([r.versions for r in rows], pa.int64())
    flat_versions = versions.values.to_numpy()  # every accepted row has >= 1 version
    cols = {
        "trajectory_id": [m.trajectory_id for m in msgs],
        "session_id": [m.session_id for m in msgs],
        "group_id": [m.group_id for m in msgs],
        "group_size": [m.group_size for m in msgs],
        "request_id": [m.request_id for m in msgs],
        "attempt": [m.attempt for m in msgs],
        "consumed": [m.consumed for m in msgs],
        "task_id": [m.task_id for m in msgs],
        "domain": [m.domain for m in msgs],
        "model_id": [m.model_id for m in msgs],
        "prompt_token_ids": prompt,
        "output_token_ids": _list_array([r.tokens for r in rows], pa.int32()),
        "output_logprobs": _list_array([r.logprobs for r in rows], pa.float32()),
        "output_versions": versions,
        "num_prompt_tokens": np.diff(prompt.offsets.to_numpy()),
        "num_output_tokens": np.diff(versions.offsets.to_numpy()),
        "min_version": np.minimum.reduceat(flat_versions, versions.offsets.to_numpy()[:-1]),
        "max_version": np.maximum.reduceat(flat_versions, versions.offsets.to_numpy()[:-1]),
        "temperature": [_optional(m, "temperature") for m in msgs],
        "top_p": [_optional(m, "top_p") for m in msgs],
        "top_k": [_optional(m, "top_k") for m in msgs],
        "finish_reason": [m.finish_reason for m in msgs],
        "reward": rewards,
        "original_reward": rewards,
        "worker_id": [m.worker_id for m in msgs],
        "created_at": [m.created_at for m in msgs],
        "received_at": [received_at] * len(msgs),
    }
    return pa.Table.from_pydict(cols, schema=TRAJECTORY_SCHEMA)


def rejections_table(items: Sequence[tuple[pb.Trajectory, str, str]], stage: str, at: float) -> pa.Table:
    """(message, reason, detail) triples -> one Arrow table in ``REJECTION_SCHEMA``."""
    msgs = [m for m, _, _ in items]
    cols = {
        "trajectory_id": [m.trajectory_id for m in msgs],
        "reason": [r for _, r, _ in items],
        "detail": [d for _, _, d in items],
        "stage": [stage] * len(items),
        "session_id": [m.session_id for m in msgs],
        "group_id": [m.group_id for m in msgs],
        "request_id": [m.request_id for m in msgs],
        "model_id": [m.model_id for m in msgs],
        "domain": [m.domain for m in msgs],
        "worker_id": [m.worker_id for m in msgs],
        "num_output_tokens": [len(m.output_token_ids) for m in msgs],
        "rejected_at": [at] * len(items),
    }
    return pa.Table.from_pydict(cols, schema=REJECTION_SCHEMA)


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
