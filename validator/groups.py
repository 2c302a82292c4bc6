"""Group- and pull-time evidence rules over the ledger's DuckDB tables.

A stored trajectory moves ``pending`` -> ``ready`` -> ``leased`` -> ``trained`` (column
``trajectories.status``), or leaves ``trajectories`` for ``rejections`` with a reason:

- ``settle`` (after every fold and before every pull): retry orphans first (attempts of one call,
  ``(model_id, session_id, request_id)``, that the caller did not consume, or, when none is marked,
  all but the latest by ``created_at``; and every unconsumed attempt of a call whose consumed
  attempt was rejected: ``RETRY_ORPHAN``), then groups whose members are all in and rewarded become
  ``ready``; the incomplete-group policy handles the others (``INCOMPLETE_GROUP``). A group is the
  rows of one model with one ``group_id`` (``GROUP_KEY``): counted, completed, served and
  normalized per model.
- ``expire_leases``: unacked leases past their time return their rows to ``ready``.
- ``reject_stale``: rows the trainer can no longer use (``trainer_version - min_version > eta``)
  become ``STALE``; versions only grow, so a stale row never becomes fresh again. Under ``wait`` and
  ``drop`` the rest of a group that lost a member so goes with it (``INCOMPLETE_GROUP``).

Every function runs inside the caller's DuckDB transaction and takes ``now`` explicitly.
"""

from __future__ import annotations

from typing import Any

import duckdb

from rollbook.config import ValidatorConfig
from rollbook.validator.reasons import Reason

# A group is the samples of one prompt from one policy: the rows of one model with one group_id
# (the same group_id under two models is two groups). GROUP_KEY names it in one string (the model
# id's length first, so no two (model_id, group_id) pairs meet); a row with no group_id is a group
# of one. GROUP_NAME is the name shown in the `groups` table and in details.
GROUP_KEY = (
    "CASE WHEN group_id = '' THEN 'traj:' || trajectory_id ELSE length(model_id) || ':' || model_id || ':' || group_id END"
)
GROUP_NAME = "CASE WHEN group_id = '' THEN 'traj:' || trajectory_id ELSE group_id END"


def one_row(result: duckdb.DuckDBPyConnection) -> tuple[Any, ...]:
    """The one row of an executed aggregate or DML statement (``count(*)``, an UPDATE's row count),
    which DuckDB always returns; its ``fetchone()`` is typed Optional for the queries that may not."""
    row = result.fetchone()
    if row is None:
        raise RuntimeError("a statement that always returns one row returned none")
    return row


def reject_rows(
    con: duckdb.DuckDBPyConnection, select_sql: str, reason: Reason, stage: str, now: float, params: list | None = None
) -> int:
    """Move rows out of ``trajectories`` into ``rejections``. ``select_sql`` yields
    ``(trajectory_id, detail)``."""
    con.execute(f"CREATE OR REPLACE TEMP TABLE _reject AS {select_sql}", params or [])
    (n,) = one_row(con.execute("SELECT count(*) FROM _reject"))
    if n:
        con.execute(
            """INSERT INTO rejections BY NAME
               SELECT t.trajectory_id, ? AS reason, r.detail, ? AS stage, t.session_id, t.group_id, t.request_id,
                      t.model_id, t.domain, t.worker_id, t.num_output_tokens::BIGINT AS num_output_tokens, ? AS rejected_at,
                      t.consumed, t.created_at, t.parent_request_id, t.branched, t.tenant
               FROM trajectories t JOIN _reject r USING (trajectory_id)""",
            [str(reason), stage, now],
        )
        con.execute("DELETE FROM trajectories WHERE trajectory_id IN (SELECT trajectory_id FROM _reject)")
    con.execute("DROP TABLE _reject")
    return int(n)


def settle(con: duckdb.DuckDBPyConnection, config: ValidatorConfig, now: float) -> dict[str, int]:
    """Resolve retry orphans, then promote complete groups to ``ready``; returns counts."""
    # held rows (store/governance.py) wait outside the flow: not counted, never promoted
    (pending,) = one_row(con.execute("SELECT count(*) FROM trajectories WHERE status = 'pending' AND eligibility = 'eligible'"))
    # even with nothing pending: a consumed attempt rejected after its unconsumed retry became ready
    # orphans that retry (checked from the consumed rejections, usually none, not from every ready row)
    if pending == 0 and not _ready_attempt_of_a_rejected_consumed_call(con):
        return {"retry_orphans": 0, "incomplete_groups": 0, "ready": 0}
    counts = {"retry_orphans": _retry_orphans(con, now)}
    if pending == 0:
        return {**counts, "incomplete_groups": 0, "ready": 0}
    counts["incomplete_groups"] = _incomplete_groups(con, config, now)
    counts["ready"] = _promote_ready(con, config, now)
    return counts


# One logical call: a request_id names a call within its session and model, so two sessions (or two
# models) that both number their calls "turn-0" are different calls.
CALL_KEY = "model_id, session_id, request_id"


def _ready_attempt_of_a_rejected_consumed_call(con: duckdb.DuckDBPyConnection) -> bool:
    return (
        con.execute(
            """SELECT 1 FROM rejections r WHERE r.consumed AND r.request_id <> '' AND EXISTS (
             SELECT 1 FROM trajectories t WHERE t.status = 'ready' AND NOT t.consumed AND t.model_id = r.model_id
               AND t.session_id = r.session_id AND t.request_id = r.request_id) LIMIT 1"""
        ).fetchone()
        is not None
    )


def _retry_orphans(con: duckdb.DuckDBPyConnection, now: float) -> int:
    # Rank the attempts of every call that has a pending attempt: an attempt already served (leased
    # or trained) wins, since it cannot be taken back; then a consumed one, then the latest
    # created_at. A `ready` attempt is not served yet, so a consumed attempt arriving later replaces
    # it. A consumed attempt that was itself rejected (at ingest, or later) still was the completion
    # the caller used: no unconsumed attempt of that call may train in its place.
    con.execute(
        f"""CREATE OR REPLACE TEMP TABLE _orphans AS
           WITH touched AS (
             SELECT DISTINCT {CALL_KEY} FROM trajectories WHERE status = 'pending' AND request_id <> ''
             UNION
             SELECT DISTINCT {CALL_KEY} FROM trajectories t
             WHERE status = 'ready' AND request_id <> '' AND NOT consumed AND EXISTS (
               SELECT 1 FROM rejections r WHERE r.consumed AND r.model_id = t.model_id
                 AND r.session_id = t.session_id AND r.request_id = t.request_id)),
           lost AS (
             SELECT {CALL_KEY}, arg_min(trajectory_id, rejected_at) AS lost_id, arg_min(reason, rejected_at) AS lost_reason
             FROM rejections JOIN touched USING ({CALL_KEY}) WHERE consumed GROUP BY ALL),
           ranked AS (
             SELECT trajectory_id, model_id, group_id, status, attempt, request_id, consumed, lost_id, lost_reason,
                    row_number() OVER w AS rk, first_value(trajectory_id) OVER w AS kept,
                    first_value(consumed) OVER w AS kept_consumed
             FROM trajectories JOIN touched USING ({CALL_KEY}) LEFT JOIN lost USING ({CALL_KEY})
             WINDOW w AS (PARTITION BY {CALL_KEY} ORDER BY (status IN ('leased', 'trained')) DESC, consumed DESC,
                          created_at DESC, trajectory_id DESC))
           SELECT trajectory_id, status, {GROUP_KEY} AS gkey,
                  CASE WHEN lost_id IS NOT NULL AND NOT consumed THEN
                    'attempt ' || attempt || ' of request ' || request_id || ' was not consumed; the consumed attempt ' ||
                    lost_id || ' was rejected (' || lost_reason || '), and only the consumed attempt may train'
                  ELSE
                    'attempt ' || attempt || ' of request ' || request_id || ' is not the one kept: ' || kept ||
                    CASE WHEN kept_consumed THEN ' (consumed by the caller)' ELSE ' (latest created_at, none marked consumed)' END
                  END AS detail
           FROM ranked WHERE status IN ('pending', 'ready') AND (rk > 1 OR (lost_id IS NOT NULL AND NOT consumed))"""
    )
    # a ready group that loses a member to its replacement attempt waits again until that one is rewarded
    con.execute(
        f"""UPDATE trajectories SET status = 'pending'
            WHERE status = 'ready' AND {GROUP_KEY} IN (SELECT gkey FROM _orphans WHERE status = 'ready')"""
    )
    n = reject_rows(con, "SELECT trajectory_id, detail FROM _orphans", Reason.RETRY_ORPHAN, "group", now)
    con.execute("DROP TABLE _orphans")
    return n


# The state of every group with a pending member (the only groups settling acts on): members of those
# groups alone are read, so its cost follows the waiting rows, not the trained history beside them.
# A row with no group_id is a group of one, so only the pending ones of those are read.
_GROUP_STATE = f"""
    SELECT {GROUP_KEY} AS gkey, any_value(model_id) AS model_id, any_value({GROUP_NAME}) AS gname,
           greatest(max(group_size), 1) AS expected, count(*) AS members,
           count(original_reward) AS rewarded, min(received_at) AS first_at,
           bool_or(status = 'pending') AS has_pending
    FROM trajectories
    SEMI JOIN (SELECT DISTINCT model_id, group_id FROM trajectories WHERE status = 'pending' AND eligibility = 'eligible')
      USING (model_id, group_id)
    WHERE eligibility = 'eligible' AND (group_id <> '' OR status = 'pending')
    GROUP BY gkey"""


def _incomplete_groups(con: duckdb.DuckDBPyConnection, config: ValidatorConfig, now: float) -> int:
    policy = config.incomplete_group_policy
    if policy == "drop":
        condition = "members < expected AND rewarded = members"
        detail = "'group has ' || members || ' of ' || expected || ' members, all rewarded; policy drop'"
    elif policy == "wait":
        condition = f"members < expected AND first_at < {now - config.group_timeout_s!r}"
        detail = f"'group has ' || members || ' of ' || expected || ' members after {config.group_timeout_s:g} s; policy wait'"
    else:  # keep: after the timeout only the unrewarded members are lost
        return reject_rows(
            con,
            f"""WITH g AS ({_GROUP_STATE})
                SELECT t.trajectory_id, 'no reward after {config.group_timeout_s:g} s; policy keep serves the rest' AS detail
                FROM trajectories t JOIN g ON g.gkey = {_t_key()}
                WHERE g.has_pending AND t.status = 'pending' AND t.eligibility = 'eligible' AND t.original_reward IS NULL
                  AND g.first_at < {now - config.group_timeout_s!r}""",
            Reason.INCOMPLETE_GROUP,
            "group",
            now,
        )
    return reject_rows(
        con,
        f"""WITH g AS ({_GROUP_STATE})
            SELECT t.trajectory_id, {detail} AS detail
            FROM trajectories t JOIN g ON g.gkey = {_t_key()}
            WHERE g.has_pending AND t.status = 'pending' AND t.eligibility = 'eligible' AND {condition}""",
        Reason.INCOMPLETE_GROUP,
        "group",
        now,
    )


def _promote_ready(con: duckdb.DuckDBPyConnection, config: ValidatorConfig, now: float) -> int:
    complete = "members >= expected"
    if config.incomplete_group_policy == "keep":
        complete = f"(members >= expected OR first_at < {now - config.group_timeout_s!r})"
    con.execute(
        f"""CREATE OR REPLACE TEMP TABLE _ready AS
            WITH g AS ({_GROUP_STATE})
            SELECT gkey, model_id, gname, expected, members FROM g WHERE has_pending AND rewarded = members AND {complete}"""
    )
    (n,) = one_row(
        con.execute(
            f"""UPDATE trajectories SET status = 'ready'
            WHERE status = 'pending' AND eligibility = 'eligible' AND {GROUP_KEY} IN (SELECT gkey FROM _ready)"""
        )
    )
    con.execute(
        """INSERT OR REPLACE INTO groups
           SELECT model_id, gname, expected, members, members, 'ready', ?, NULL FROM _ready""",
        [now],
    )
    con.execute("DROP TABLE _ready")
    return int(n)


def expire_leases(con: duckdb.DuckDBPyConnection, now: float) -> int:
    """Unacked leases past ``expires_at`` are expired; their rows return to ``ready``."""
    (expired,) = one_row(
        con.execute(
            "UPDATE leases SET expired_at = ? WHERE acked_at IS NULL AND expired_at IS NULL AND expires_at < ?", [now, now]
        )
    )
    if expired == 0:
        return 0
    (n,) = one_row(
        con.execute(
            """UPDATE trajectories SET status = 'ready'
           WHERE status = 'leased' AND trajectory_id NOT IN (
             SELECT trajectory_id FROM leases WHERE acked_at IS NULL AND expired_at IS NULL)"""
        )
    )
    return int(n)


def reject_stale(
    con: duckdb.DuckDBPyConnection, model_id: str, trainer_version: int, max_staleness: int, now: float, *, policy: str = "wait"
) -> int:
    """Reject as ``STALE`` the waiting rows of ``model_id`` this trainer can no longer use; returns
    their number. Under the ``wait`` and ``drop`` policies a group that lost a member this way can
    never be whole again, and a group is never served short of its size: its other waiting members
    are rejected with it (``INCOMPLETE_GROUP``, stage ``pull``). Under ``keep`` they stay, and the
    group is served with its true size."""
    if not model_id:
        raise ValueError("model_id is required: staleness is relative to one model's versions")
    con.execute(
        f"""CREATE OR REPLACE TEMP TABLE _stale AS
            SELECT trajectory_id, {GROUP_KEY} AS gkey, {GROUP_NAME} AS gname,
                   'trainer version ' || $1 || ' minus oldest token version ' || min_version || ' = ' ||
                   ($1 - min_version) || ' > max_staleness ' || $2 AS detail
            FROM trajectories WHERE status IN ('pending', 'ready') AND eligibility = 'eligible' AND $1 - min_version > $2
              AND model_id = $3""",
        [trainer_version, max_staleness, model_id],
    )
    n = reject_rows(con, "SELECT trajectory_id, detail FROM _stale", Reason.STALE, "pull", now)
    if n and policy != "keep":
        reject_rows(
            con,
            f"""SELECT t.trajectory_id,
                       'group ' || s.gname || ' lost ' || s.n || ' member(s) to STALE at this pull (e.g. ' || s.example ||
                       '); policy {policy} never serves a group short of its size' AS detail
                FROM trajectories t
                JOIN (SELECT gkey, any_value(gname) AS gname, count(*) AS n, min(trajectory_id) AS example
                      FROM _stale GROUP BY gkey) s
                  ON s.gkey = {_t_key()}
                WHERE t.status IN ('pending', 'ready') AND t.eligibility = 'eligible'""",
            Reason.INCOMPLETE_GROUP,
            "pull",
            now,
        )
    con.execute("DROP TABLE _stale")
    return n


def _t_key() -> str:
    """``GROUP_KEY`` of the rows of ``trajectories t``."""
    return (
        "CASE WHEN t.group_id = '' THEN 'traj:' || t.trajectory_id "
        "ELSE length(t.model_id) || ':' || t.model_id || ':' || t.group_id END"
    )
