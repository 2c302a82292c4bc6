"""A new ledger seeded with stored groups of another ledger: the rows a ``[replay]`` run trains on
(rollbook/run/from_ledger.py; docs/replay.md, "Train from the ledger").

The seeded rows enter the new file as its store would have left them after settling: ``ready``,
whole groups, every member rewarded, each group in the ``groups`` table. Its trainer then leases
them, has them normalized and acks them through the ordinary pull (``validator/pull.py``), so the
new ledger gets its own leases, train steps and policy versions, and the source is never written
(the caller hands a cursor on a private copy of it).

**Whole groups only.** A group is the stored rows of one model with one ``group_id``
(``validator.groups.GROUP_KEY``); normalization runs over its members, so a group the selection cuts
(some members selected, some not), a group with a member that has no reward to train on (no
``original_reward``, or no ``ok`` score in the reward version), and a group still waiting in the
source for members (``pending`` and short of ``group_size``) are left out, and counted
(``SeedResult``).

**What a seeded row keeps.** Everything the source stored (tokens, behavior log-probs, the source
run's ``output_versions``, ``original_reward``, ``created_at``, ``worker_id``), except: ``model_id`` is
the new run's (its trainer pulls its own model's rows), ``reward`` is empty until its pull
normalizes it, ``status`` is ``ready``, and ``received_at`` is the seeding time plus a microsecond per
row in the source's group order (oldest group first), epoch after epoch, so the pull, which serves
the oldest groups first, goes through the selection in the source's order, one epoch at a time.

**Epochs.** Epoch 1 keeps the source's ids; epoch ``k > 1`` is a copy whose ``trajectory_id``,
``group_id`` and ``session_id`` (those not empty) end in ``@k``: one trajectory id is one row of the
ledger (the idempotency key), one group id one normalization group. The source id of any seeded row
is its id without that suffix.

**A reward version** named for the run is copied with the rows: its ``ok`` scores under the new ids
(``scored_at`` kept) and its ``reward_version_runs`` row (its reward, settings and predicate kept,
the counts those of the copy), so a store with ``validator.reward_version`` serves it as for any
version.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import duckdb
import pyarrow as pa

from rollbook.store import reward_versions, schema
from rollbook.validator.groups import GROUP_KEY, GROUP_NAME

if TYPE_CHECKING:  # pragma: no cover
    import pathlib

CHUNK_ROWS = 2048  # rows read from the source and inserted at a time (their token lists in memory)
ROW_SPACING_S = 1e-6  # received_at between consecutive seeded rows

# the stored columns a seeded row copies (every column of the schema)
COLUMNS = [f.name for f in schema.TRAJECTORY_SCHEMA]
VERSION_COLUMNS = ("v_reward", "v_status", "v_error", "v_info", "v_scored_at")


class SeedError(ValueError):
    """The selection cannot be seeded as asked (the caller words it for the user)."""


@dataclass
class SeedResult:
    """What one seeding found and did. Rows and groups are per epoch unless named ``total``."""

    selected: int = 0  # distinct ids the selection returned
    archived: int = 0  # of those, not in ``trajectories`` (moved into the archive): left out
    groups: int = 0  # whole groups seeded
    rows: int = 0  # their rows
    epochs: int = 1
    partial_groups: int = 0  # groups the selection cut: left out
    partial_rows: int = 0  # their selected rows
    unrewarded_groups: int = 0  # a member without a reward to train on
    unrewarded_rows: int = 0
    waiting_groups: int = 0  # still pending in the source, short of their group_size
    waiting_rows: int = 0
    max_token_id: int = -1  # the largest prompt or output token id seeded
    source_model_id: str = ""
    reward_version: str | None = None
    domains: dict[str, int] = field(default_factory=dict)  # rows per domain

    @property
    def total_rows(self) -> int:
        return self.rows * self.epochs

    def as_dict(self) -> dict:
        return {**asdict(self), "total_rows": self.total_rows}

    def left_out(self) -> str:
        """The groups left out and why, in one phrase ('' when none)."""
        parts = [
            f"{g} groups ({r} selected rows) {why}"
            for g, r, why in (
                (self.partial_groups, self.partial_rows, "only partly selected"),
                (self.unrewarded_groups, self.unrewarded_rows, "with a member without a reward"),
                (self.waiting_groups, self.waiting_rows, "still waiting for members"),
            )
            if g
        ]
        if self.archived:
            parts.append(f"{self.archived} selected rows in the archive")
        return "; ".join(parts)


def create_ledger(path: pathlib.Path) -> duckdb.DuckDBPyConnection:
    """A new, empty ledger file with every table a store makes (``schema.DDL``), for ``seed``."""
    con = duckdb.connect(str(path))
    for ddl in schema.DDL:
        con.execute(ddl)
    schema.upgrade(con)
    return con


def seed(
    source: duckdb.DuckDBPyConnection,
    dest: duckdb.DuckDBPyConnection,
    selected: pa.Table,
    *,
    model_id: str,
    epochs: int = 1,
    reward_version: str | None = None,
    now: float,
    chunk_rows: int = CHUNK_ROWS,
) -> SeedResult:
    """Copy the whole groups ``selected`` (a table of ``trajectory_id``) picks in ``source`` into
    ``dest`` (``create_ledger``'s), ``epochs`` times, as ready rows of ``model_id`` (the module's
    docstring), in one transaction of ``dest``. ``source`` is only read. Raises ``SeedError`` for a
    reward version ``source`` does not hold and for a selection of several models' rows."""
    if epochs < 1:
        raise SeedError(f"epochs must be >= 1, got {epochs}")
    if reward_version is not None and reward_versions.state(source, reward_version) is None:
        known = [n for (n,) in source.execute("SELECT name FROM reward_version_runs ORDER BY name").fetchall()]
        raise SeedError(
            f"the source ledger has no reward version {reward_version!r} (it has: {', '.join(known) or 'none'}; "
            "`rollbook replay reward` makes one)"
        )
    result = SeedResult(epochs=epochs, reward_version=reward_version)
    rows = _plan(source, selected, reward_version, result)
    if rows.num_rows == 0:
        return result
    dest.execute("BEGIN")
    try:
        if reward_version is not None:
            _begin_version(source, dest, reward_version, result.total_rows, now)
        for chunk in _chunks(source, rows, reward_version, chunk_rows):
            dest.register("_chunk", chunk)
            for epoch in range(1, epochs + 1):
                _insert(dest, epoch, model_id, reward_version, now, offset=(epoch - 1) * result.rows)
            dest.unregister("_chunk")
        dest.execute(
            f"""INSERT INTO groups
                SELECT model_id, {GROUP_NAME} AS gname, greatest(max(group_size), 1), count(*), count(*), 'ready', ?, NULL
                FROM trajectories GROUP BY model_id, gname""",
            [now],
        )
        if reward_version is not None:
            reward_versions.finish(dest, reward_version, now)
        dest.execute("COMMIT")
    except BaseException:
        dest.execute("ROLLBACK")
        raise
    return result


def _version_ok(version: str | None) -> str:
    """SQL: the row (``trajectories``) has a reward to train on."""
    if version is None:
        return "original_reward IS NOT NULL"
    return "trajectory_id IN (SELECT trajectory_id FROM reward_versions WHERE name = $version AND status = 'ok')"


def _plan(source: duckdb.DuckDBPyConnection, selected: pa.Table, version: str | None, result: SeedResult) -> pa.Table:
    """The rows to seed (``row_id``, ``ord``: their order) of the eligible whole groups, oldest group
    first; fills ``result``'s counts."""
    source.register("_selected", pa.table({"trajectory_id": selected.column("trajectory_id").cast(pa.string())}))
    params: dict = {} if version is None else {"version": version}
    try:
        source.execute(
            f"""CREATE OR REPLACE TEMP TABLE _seed_members AS
                WITH sel AS (SELECT DISTINCT trajectory_id FROM _selected),
                touched AS (SELECT DISTINCT {GROUP_KEY} AS gkey FROM trajectories SEMI JOIN sel USING (trajectory_id))
                SELECT rowid AS row_id, trajectory_id, model_id, domain, status, group_size, received_at,
                       {GROUP_KEY} AS gkey, trajectory_id IN (SELECT trajectory_id FROM sel) AS picked,
                       {_version_ok(version)} AS rewarded
                FROM trajectories WHERE {GROUP_KEY} IN (SELECT gkey FROM touched)""",
            params,
        )
        (result.selected,) = _one(source.execute("SELECT count(DISTINCT trajectory_id) FROM _selected"))
        (in_ledger,) = _one(source.execute("SELECT count(*) FROM _seed_members WHERE picked"))
        result.archived = result.selected - in_ledger
        source.execute(
            """CREATE OR REPLACE TEMP TABLE _seed_groups AS
               SELECT gkey, count(*) FILTER (picked) AS picked, min(received_at) AS first_at,
                      CASE WHEN count(*) FILTER (picked) < count(*) THEN 'partial'
                           WHEN NOT bool_and(rewarded) THEN 'unrewarded'
                           WHEN count(*) < greatest(max(group_size), 1) AND bool_or(status IS NULL OR status = 'pending')
                             THEN 'waiting'
                           ELSE 'seed' END AS verdict
               FROM _seed_members GROUP BY gkey"""
        )
        for verdict, groups, picked in source.execute(
            "SELECT verdict, count(*), sum(picked) FROM _seed_groups GROUP BY verdict"
        ).fetchall():
            if verdict != "seed":
                setattr(result, f"{verdict}_groups", int(groups))
                setattr(result, f"{verdict}_rows", int(picked))
            else:
                result.groups, result.rows = int(groups), int(picked)
        models = [
            m
            for (m,) in source.execute(
                "SELECT DISTINCT model_id FROM _seed_members JOIN _seed_groups USING (gkey) WHERE verdict = 'seed' ORDER BY 1"
            ).fetchall()
        ]
        if len(models) > 1:
            raise SeedError(
                f"the selection holds rows of {len(models)} models ({', '.join(models)}): a run trains one; "
                f"add e.g. model_id = '{models[0]}' to the condition"
            )
        result.source_model_id = models[0] if models else ""
        result.domains = dict(
            source.execute(
                "SELECT domain, count(*) FROM _seed_members JOIN _seed_groups USING (gkey) WHERE verdict = 'seed' "
                "GROUP BY domain ORDER BY domain"
            ).fetchall()
        )
        rows = source.sql(
            """SELECT m.row_id, row_number() OVER (ORDER BY g.first_at, m.gkey, m.trajectory_id) - 1 AS ord
               FROM _seed_members m JOIN _seed_groups g USING (gkey) WHERE g.verdict = 'seed' ORDER BY ord"""
        ).to_arrow_table()
        if rows.num_rows:
            source.register("_seed_rows", rows)
            (top,) = _one(
                source.execute(
                    "SELECT max(greatest(coalesce(list_max(prompt_token_ids), -1), coalesce(list_max(output_token_ids), -1))) "
                    "FROM trajectories WHERE rowid IN (SELECT row_id FROM _seed_rows)"
                )
            )
            source.unregister("_seed_rows")
            result.max_token_id = int(top)
    finally:
        source.execute("DROP TABLE IF EXISTS _seed_members")
        source.execute("DROP TABLE IF EXISTS _seed_groups")
        source.unregister("_selected")
    return rows


def _chunks(source: duckdb.DuckDBPyConnection, rows: pa.Table, version: str | None, chunk_rows: int) -> Iterator[pa.Table]:
    """The rows' stored columns (and their version's score), ``chunk_rows`` at a time in ``ord``
    order: the ids were planned on the light columns, the lists are read per chunk by ``rowid``."""
    scores = ", ".join(f"NULL AS {c}" for c in VERSION_COLUMNS)
    join = ""
    params: list = []
    if version is not None:
        scores = "v.reward AS v_reward, v.status AS v_status, v.error AS v_error, v.info::VARCHAR AS v_info, v.scored_at AS v_scored_at"
        join = "LEFT JOIN reward_versions v ON v.name = ? AND v.trajectory_id = t.trajectory_id"
        params = [version]
    columns = ", ".join(f"t.{c}" for c in COLUMNS)
    for start in range(0, rows.num_rows, chunk_rows):
        source.register("_seed_chunk", rows.slice(start, chunk_rows))
        chunk = source.sql(
            f"""SELECT c.ord, {columns}, {scores}
                FROM _seed_chunk c JOIN trajectories t ON t.rowid = c.row_id {join} ORDER BY c.ord""",
            params=params,
        ).to_arrow_table()
        source.unregister("_seed_chunk")
        yield chunk


def _suffixed(column: str) -> str:
    """SQL: ``column`` with the epoch's suffix ``$tag`` (``@k``: epoch ``$epoch`` > 1, a value not empty)."""
    return f"CASE WHEN $epoch = 1 OR {column} = '' THEN {column} ELSE {column} || $tag END"


def _insert(dest: duckdb.DuckDBPyConnection, epoch: int, model_id: str, version: str | None, now: float, *, offset: int) -> None:
    """One epoch's copy of the registered ``_chunk`` into ``trajectories`` (and the version's scores)."""
    tag = {"epoch": epoch, "tag": f"@{epoch}"}
    params = {**tag, "model": model_id, "base": now, "offset": offset, "spacing": ROW_SPACING_S}
    dest.execute(
        f"""INSERT INTO trajectories BY NAME
            SELECT * EXCLUDE (ord, {", ".join(VERSION_COLUMNS)}) REPLACE (
                     {_suffixed("trajectory_id")} AS trajectory_id,
                     {_suffixed("group_id")} AS group_id,
                     {_suffixed("session_id")} AS session_id,
                     $model AS model_id,
                     NULL::DOUBLE AS reward,
                     $base + ($offset + ord) * $spacing AS received_at),
                   'ready' AS status
            FROM _chunk""",
        params,
    )
    if version is not None:
        dest.execute(
            f"""INSERT INTO reward_versions
                SELECT $name, {_suffixed("trajectory_id")}, v_reward, v_status, v_error, v_info::JSON, v_scored_at FROM _chunk""",
            {**tag, "name": version},
        )


def _begin_version(source: duckdb.DuckDBPyConnection, dest: duckdb.DuckDBPyConnection, name: str, rows: int, now: float) -> None:
    """The version's ``reward_version_runs`` row in ``dest``: the source's reward, settings, predicate,
    tokenizer and rows' origin, with the copy's counts (every seeded row scored ok)."""
    known = reward_versions.state(source, name)
    assert known is not None  # checked by seed()
    reward_versions.begin(dest, known.spec, rows, now)
    dest.execute("UPDATE reward_version_runs SET scored = ?, errors = 0 WHERE name = ?", [rows, name])


def _one(result: duckdb.DuckDBPyConnection) -> tuple:
    return reward_versions.one_row(result)


def manifest_text(result: SeedResult, **extra: object) -> str:
    """``result`` (and ``extra``) as the JSON a run directory keeps beside its seeded ledger."""
    return json.dumps({**extra, "seeded": result.as_dict()}, indent=2, sort_keys=True) + "\n"
