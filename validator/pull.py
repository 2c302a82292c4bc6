"""Serving validated batches to the trainer: ``lease_batch`` and ``ack_lease``.

``lease_batch`` (inside the ledger's transaction): expire old leases, settle groups, reject what
has gone stale for this trainer version, pick whole ready groups (oldest first) up to the asked
number of samples or groups, normalize their rewards (``validator.normalize``; singletons follow the
configured policy), write the normalized reward back beside ``original_reward``, record the lease
per row in ``leases`` (with the row's index in the served batch, ``position``, and the ``advantage``
it was served with: the step the trainer runs on it is replayed from them, ``rollbook replay step``),
and return the rows as Arrow with rejection-aware statistics. With
``ValidatorConfig.reward_version`` the rewards normalized are that named version's
(``reward_versions``, docs/replay.md) and only groups it scores whole are served.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rollbook.config import ValidatorConfig
from rollbook.v1 import rollbook_pb2 as pb
from rollbook.validator.groups import GROUP_KEY, expire_leases, one_row, reject_rows, reject_stale, settle
from rollbook.validator.normalize import normalize_rewards
from rollbook.validator.reasons import Reason

# Columns served to the trainer (docs/schema.md describes them; `advantage` is the normalized
# sequence-level reward, broadcast over the output tokens by the trainer). The session's call tree
# (`session_id`, `request_id`, `parent_request_id`, `branched`) links a batch's turns of one session.
BATCH_COLUMNS = [
    "trajectory_id",
    "session_id",
    "request_id",
    "parent_request_id",
    "branched",
    "group_id",
    "task_id",
    "domain",
    "model_id",
    "prompt_token_ids",
    "output_token_ids",
    "output_logprobs",
    "output_versions",
    "min_version",
    "temperature",
    "top_p",
    "top_k",
    "original_reward",
]


class InvalidPull(ValueError):
    """The pull cannot be served as asked (the store answers INVALID_ARGUMENT)."""


class LeaseError(ValueError):
    """The lease cannot be acknowledged: it expired and its rows went to another lease."""


class UnknownLease(LeaseError):
    """No such lease."""


class NotLeaseOwner(LeaseError):
    """The lease was issued to another trainer (``trainer_id``); only that trainer may ack it."""


def check_request(req: pb.PullBatchRequest) -> None:
    """Refuse a pull that cannot be served safely (``InvalidPull``: the store answers INVALID_ARGUMENT).

    A pull is the wire message itself, ``PullBatchRequest`` (``rollbook.proto`` describes each field):
    the client builds it from its caller's keywords and the store hands it here unchanged, so its
    fields are spelled in one place.

    ``model_id`` is required: staleness compares ``trainer_version`` with one model's policy
    versions, so a pull across models would judge every other model's rows by this trainer's
    version (and reject them as STALE for good). ``trainer_id`` is required: only the trainer a
    lease was issued to may ack it."""
    if req.num_samples == 0 and req.num_groups == 0:
        raise InvalidPull("ask for num_samples > 0 or num_groups > 0")
    if req.max_staleness < 0 or req.lease_seconds < 0:
        raise InvalidPull("max_staleness and lease_seconds must be >= 0")
    if not req.model_id:
        raise InvalidPull("model_id is required: a trainer pulls the rows of the one model it trains")
    if not req.trainer_id:
        raise InvalidPull("trainer_id is required: it owns the lease (only it may AckBatch)")


@dataclass
class LeasedBatch:
    """What one pull leased: the lease id (empty when nothing was ready), the rows (Arrow, reward
    normalized) and the pull's statistics. The client's side of the same answer is
    ``rollbook.client.PulledBatch``."""

    lease_id: str
    table: pa.Table
    stats: dict


def lease_batch(con: duckdb.DuckDBPyConnection, req: pb.PullBatchRequest, config: ValidatorConfig, now: float) -> LeasedBatch:
    check_request(req)
    events = {"expired_rows": expire_leases(con, now)}
    events.update(settle(con, config, now))
    events["stale"] = reject_stale(
        con, req.model_id, req.trainer_version, req.max_staleness, now, policy=config.incomplete_group_policy
    )
    rows = _pick_groups(con, req, config.reward_version)
    if rows.num_rows == 0:
        return LeasedBatch("", rows, {"events": events, "num_samples": 0})
    gkeys = np.asarray(rows.column("gkey").to_pylist(), dtype=object)
    if config.reward_version:
        raw = _version_rewards(con, rows, config.reward_version)
    else:
        raw = rows.column("original_reward").to_numpy(zero_copy_only=False).astype(np.float64)
    norm = normalize_rewards(raw, gkeys, config.norm)
    if norm.dropped.any():
        dropped = pa.table({"trajectory_id": rows.column("trajectory_id").filter(pa.array(norm.dropped))})
        con.register("_dropped", dropped)
        events["singletons_dropped"] = reject_rows(
            con,
            "SELECT trajectory_id, 'group of one; singleton_policy drop' AS detail FROM _dropped",
            Reason.SINGLETON_DROPPED,
            "pull",
            now,
        )
        con.unregister("_dropped")
        keep = pa.array(~norm.dropped)
        rows, norm_values, raw = rows.filter(keep), norm.normalized[~norm.dropped], raw[~norm.dropped]
    else:
        norm_values = norm.normalized
    lease_id = uuid.uuid4().hex
    table = rows.drop_columns(["gkey"]).append_column("reward", pa.array(norm_values, pa.float64()))
    table = table.append_column("advantage", pa.array(norm_values, pa.float32()))
    _record_lease(con, table, lease_id, req, now)
    table = table.drop_columns(["row_id"])
    stats = _batch_stats(con, table, raw, norm_values, req, events)
    if config.reward_version:  # the rewards served came from this version, not original_reward
        stats["reward_version"] = config.reward_version
    return LeasedBatch(lease_id, table, stats)


def _pick_groups(con: duckdb.DuckDBPyConnection, req: pb.PullBatchRequest, version: str | None = None) -> pa.Table:
    """Whole ready groups, oldest first, up to num_groups or num_samples (at least one group); with a
    reward ``version``, only groups whose every member has an ok score in it.

    Two phases, because carrying list columns through a join or a sort costs far more than
    reading them: pick row ids on the light columns, then fetch the heavy ones by ``rowid``."""
    model_filter = "AND model_id = $model"
    # a prefix of the groups in age order: up to n groups, or while the running row count fits in
    # n samples (the first group always, so a group larger than n is not stuck forever)
    limit = "g.rank <= $n" if req.num_groups else "(g.upto <= $n OR g.rank = 1)"
    params: dict = {"n": req.num_groups or req.num_samples, "model": req.model_id}
    scored = "TRUE"
    if version:
        scored = "trajectory_id IN (SELECT trajectory_id FROM reward_versions WHERE name = $version AND status = 'ok')"
        params["version"] = version
    picked = con.sql(
        f"""WITH ready AS (
              SELECT rowid AS row_id, trajectory_id, received_at, {GROUP_KEY} AS gkey, {scored} AS scored
              FROM trajectories WHERE status = 'ready' AND eligibility = 'eligible' {model_filter}),
            g AS (SELECT gkey, count(*) AS n, min(received_at) AS first_at FROM ready GROUP BY gkey HAVING bool_and(scored)),
            ordered AS (
              SELECT gkey, row_number() OVER (ORDER BY first_at, gkey) AS rank,
                     sum(n) OVER (ORDER BY first_at, gkey) AS upto
              FROM g)
            SELECT r.row_id, r.gkey, row_number() OVER (ORDER BY g.rank, r.trajectory_id) AS pos
            FROM ready r JOIN ordered g USING (gkey)
            WHERE {limit}""",
        params=params,
    ).to_arrow_table()
    if picked.num_rows == 0:
        return con.sql(
            f"SELECT rowid AS row_id, {', '.join(BATCH_COLUMNS)}, {GROUP_KEY} AS gkey FROM trajectories LIMIT 0"
        ).to_arrow_table()
    # in the picked order (groups together, oldest first), sorted here rather than by an Arrow take
    # afterwards (which copies every list column); the rowid bounds let the scan skip what lies outside
    lo, hi = pc.min_max(picked.column("row_id")).values()
    con.register("_picked", picked)
    rows = con.sql(
        f"""SELECT t.rowid AS row_id, {", ".join("t." + c for c in BATCH_COLUMNS)}, p.gkey
            FROM trajectories t JOIN _picked p ON t.rowid = p.row_id
            WHERE t.rowid BETWEEN $lo AND $hi ORDER BY p.pos""",
        params={"lo": lo.as_py(), "hi": hi.as_py()},
    ).to_arrow_table()
    con.unregister("_picked")
    return rows


def _version_rewards(con: duckdb.DuckDBPyConnection, rows: pa.Table, version: str) -> np.ndarray:
    """The rewards of reward version ``version`` for ``rows``, in their order (``_pick_groups`` took
    only groups it scores ok, member for member)."""
    con.register("_served", pa.table({"trajectory_id": rows.column("trajectory_id")}))
    found = dict(
        con.execute(
            "SELECT v.trajectory_id, v.reward FROM reward_versions v SEMI JOIN _served s USING (trajectory_id) "
            "WHERE v.name = ? AND v.status = 'ok'",
            [version],
        ).fetchall()
    )
    con.unregister("_served")
    return np.array([found[t] for t in rows.column("trajectory_id").to_pylist()], dtype=np.float64)


def _record_lease(con: duckdb.DuckDBPyConnection, table: pa.Table, lease_id: str, req: pb.PullBatchRequest, now: float) -> None:
    """One ``leases`` row per served row, in the served order: ``position`` is the row's index in
    ``table``, ``advantage`` the float32 the trainer receives (a later lease of the row, after this one
    expired, may normalize it otherwise and rewrite ``trajectories.reward``; this one stays)."""
    leased = pa.table(
        {
            "row_id": table.column("row_id"),
            "trajectory_id": table.column("trajectory_id"),
            "reward": table.column("reward"),
            "position": pa.array(np.arange(table.num_rows, dtype=np.int32)),
            "advantage": table.column("advantage"),
        }
    )
    con.register("_leased", leased)
    con.execute(
        """INSERT INTO leases (lease_id, trajectory_id, trainer_id, step, trainer_version, issued_at, expires_at, position, advantage)
           SELECT ?, trajectory_id, ?, ?, ?, ?, ?, position, advantage FROM _leased""",
        [lease_id, req.trainer_id, req.step, req.trainer_version, now, now + req.lease_seconds],
    )
    con.execute(
        """UPDATE trajectories SET status = 'leased', reward = _leased.reward
           FROM _leased WHERE trajectories.rowid = _leased.row_id"""
    )
    con.unregister("_leased")


def _batch_stats(
    con: duckdb.DuckDBPyConnection,
    table: pa.Table,
    raw: np.ndarray,
    normalized: np.ndarray,
    req: pb.PullBatchRequest,
    events: dict,
) -> dict:
    tokens = int(pc.sum(pc.list_value_length(table.column("output_token_ids"))).as_py() or 0)
    staleness = req.trainer_version - table.column("min_version").to_numpy()
    hist = {str(int(k)): int(v) for k, v in zip(*np.unique(staleness, return_counts=True))}
    return {
        "events": events,
        "num_samples": table.num_rows,
        "num_groups": len(set(table.column("group_id").to_pylist())),
        "num_tokens": tokens,
        "staleness_histogram": hist,
        "reward/mean_before": float(raw.mean()) if len(raw) else None,
        "reward/mean_after": float(normalized.mean()) if len(normalized) else None,
        "ledger": ledger_token_stats(con),
    }


def ledger_token_stats(con: duckdb.DuckDBPyConnection) -> dict:
    """Rejection-aware token counts over the whole ledger, rows moved into the archive included."""
    (valid,) = one_row(
        con.execute(
            "SELECT (SELECT coalesce(sum(num_output_tokens), 0) FROM trajectories) "
            "+ (SELECT coalesce(sum(num_output_tokens), 0) FROM archive_files)"
        )
    )
    by_reason = dict(con.execute("SELECT reason, coalesce(sum(num_output_tokens), 0) FROM rejections GROUP BY reason").fetchall())
    rejected = int(sum(by_reason.values()))
    total = int(valid) + rejected
    return {
        "total_tokens": total,
        "valid_tokens": int(valid),
        "rejected_tokens": rejected,
        "rejected_tokens_by_reason": {k: int(v) for k, v in by_reason.items()},
        "masked_token_ratio": rejected / total if total else 0.0,
    }


def ack_lease(con: duckdb.DuckDBPyConnection, lease_id: str, now: float, trainer_id: str | None = None) -> int:
    """Mark a lease's rows trained. Idempotent; an expired lease whose rows were neither re-leased
    nor rejected since (e.g. ``STALE``) is still accepted (the trainer checkpointed it), otherwise
    ``LeaseError``. With ``trainer_id`` (the store always passes it) the lease must have been issued
    to that trainer, else ``NotLeaseOwner``."""
    total, acked, expired, owner = one_row(
        con.execute(
            "SELECT count(*), count(acked_at), count(expired_at), any_value(trainer_id) FROM leases WHERE lease_id = ?",
            [lease_id],
        )
    )
    if total == 0:
        raise UnknownLease(f"unknown lease {lease_id!r}")
    if trainer_id is not None and trainer_id != owner:
        raise NotLeaseOwner(f"lease {lease_id} was issued to trainer {owner!r}, not {trainer_id!r}; only it may ack")
    if acked == total:
        return total
    if expired:
        (taken,) = one_row(
            con.execute(
                """SELECT count(*) FROM leases a JOIN leases b USING (trajectory_id)
               WHERE a.lease_id = ? AND b.lease_id <> ? AND b.issued_at > a.issued_at""",
                [lease_id, lease_id],
            )
        )
        trained = one_row(
            con.execute(
                """SELECT count(*) FROM trajectories WHERE status IN ('trained') AND trajectory_id IN
               (SELECT trajectory_id FROM leases WHERE lease_id = ?)""",
                [lease_id],
            )
        )[0]
        (gone,) = one_row(
            con.execute(  # rejected since it expired (e.g. STALE): such a row never also trains
                """SELECT count(*) FROM leases WHERE lease_id = ? AND trajectory_id NOT IN
               (SELECT trajectory_id FROM trajectories)""",
                [lease_id],
            )
        )
        if taken or trained or gone:
            raise LeaseError(f"lease {lease_id} expired and its rows went to another lease or to rejections; do not train on it")
    con.execute("UPDATE leases SET acked_at = ?, expired_at = NULL WHERE lease_id = ?", [now, lease_id])
    # the row's status first: row groups of trained history alone are skipped by their zone maps
    con.execute(
        "UPDATE trajectories SET status = 'trained' WHERE status <> 'trained' "
        "AND trajectory_id IN (SELECT trajectory_id FROM leases WHERE lease_id = ?)",
        [lease_id],
    )
    return total
