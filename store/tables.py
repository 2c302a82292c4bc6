"""Decoded trajectories (``rollbook.trajectories.TrajectoryColumns``) -> Arrow tables in the store's
schemas (``store/schema.py``): the single place where the wire contract becomes the storage schema."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from rollbook.store.schema import DEFAULT_TENANT, METADATA_TYPE, REJECTION_SCHEMA, TRAJECTORY_SCHEMA
from rollbook.trajectories import Ragged, TrajectoryColumns
from rollbook.v1 import rollbook_pb2 as pb


def trajectories_table(
    batch: TrajectoryColumns,
    received_at: float,
    keep: np.ndarray | None = None,
    *,
    tenant: str = DEFAULT_TENANT,
    held: Sequence[str | None] | None = None,
) -> pa.Table:
    """The rows of ``batch`` (those where ``keep`` is True, or all) -> one Arrow table
    (``original_reward`` = the reward as submitted), stamped with the submitting key's ``tenant``.
    ``held[i]`` is the reason the ingest rules hold row ``i`` from training (None: eligible). Kept
    rows must have equal-length token, log-prob and version arrays (the evidence rules guarantee it)."""
    lists = {
        "prompt_token_ids": batch.prompt.to_arrow(pa.int32()),
        "output_token_ids": batch.tokens.to_arrow(pa.int32()),
        "output_logprobs": batch.logprobs.to_arrow(pa.float32()),
        "output_versions": batch.versions.to_arrow(pa.int64()),
    }
    idx = None if keep is None or keep.all() else np.flatnonzero(keep)
    versions = batch.versions
    cols: dict[str, Any] = {name: batch.array(name) for name in _SCALAR_COLUMNS}
    if idx is not None:
        taken = pa.array(idx)
        lists = {name: array.take(taken) for name, array in lists.items()}
        cols = {name: array.take(taken) for name, array in cols.items()}
        versions = Ragged(
            lists["output_versions"].flatten().to_numpy(), lists["output_versions"].offsets.to_numpy().astype(np.int64)
        )
    lengths = versions.lengths
    n = len(lengths)
    reasons = [None] * n if held is None else (list(held) if idx is None else [held[int(i)] for i in idx])
    cols.update(
        {
            "tenant": pa.array([tenant] * n, pa.string()),
            "metadata": _metadata(batch, idx, n),
            "eligibility": pa.array(["eligible" if r is None else "held" for r in reasons], pa.string()),
            "eligibility_reason": pa.array([r or "" for r in reasons], pa.string()),
        }
    )
    cols.update(lists)
    cols.update(
        {
            "num_prompt_tokens": pa.array(np.diff(lists["prompt_token_ids"].offsets.to_numpy())),
            "num_output_tokens": pa.array(lengths.astype(np.int32)),
            "min_version": pa.array(versions.reduce(np.minimum, 0), mask=lengths == 0),
            "max_version": pa.array(versions.reduce(np.maximum, 0), mask=lengths == 0),
            "original_reward": cols["reward"],
            "received_at": pa.array(np.full(n, received_at)),
        }
    )
    return pa.Table.from_arrays([cols[f.name] for f in TRAJECTORY_SCHEMA], schema=TRAJECTORY_SCHEMA)


def _metadata(batch: TrajectoryColumns, idx: np.ndarray | None, n: int) -> pa.Array:
    """The metadata maps of the kept rows (``idx``, or all), null where a row sends none."""
    sent = batch.metadata_rows()
    if not len(sent):
        return pa.nulls(n, METADATA_TYPE)
    metadata = batch.column("metadata")
    rows = range(len(batch)) if idx is None else idx
    return pa.array([list(metadata[i].items()) or None for i in rows], METADATA_TYPE)


# the stored columns that are the message's own scalar fields
_SCALAR_COLUMNS = [
    f.name
    for f in TRAJECTORY_SCHEMA
    if f.name in pb.Trajectory.DESCRIPTOR.fields_by_name and not pa.types.is_list(f.type) and not pa.types.is_map(f.type)
]


def rejections_table(
    batch: TrajectoryColumns, rejected: Sequence[tuple[int, str, str]], stage: str, at: float, *, tenant: str = DEFAULT_TENANT
) -> pa.Table:
    """(row index, reason, detail) triples of ``batch`` -> one Arrow table in ``REJECTION_SCHEMA``,
    stamped with the submitting key's ``tenant``."""
    rows = [i for i, _, _ in rejected]
    num_tokens = batch.tokens.lengths
    cols = {
        name: [batch.column(name)[i] for i in rows]
        for name in (
            "trajectory_id",
            "session_id",
            "group_id",
            "request_id",
            "model_id",
            "domain",
            "worker_id",
            "consumed",
            "created_at",
            "parent_request_id",
            "branched",
        )
    }
    cols.update(
        {
            "reason": [r for _, r, _ in rejected],
            "detail": [d for _, _, d in rejected],
            "stage": [stage] * len(rejected),
            "num_output_tokens": [int(num_tokens[i]) for i in rows],
            "rejected_at": [at] * len(rejected),
            "tenant": [tenant] * len(rejected),
        }
    )
    return pa.Table.from_pydict(cols, schema=REJECTION_SCHEMA)
