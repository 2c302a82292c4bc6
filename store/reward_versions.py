"""Named reward versions: the ledger's outputs scored again by another reward, beside the rewards
they were trained with (``rollbook replay reward``, rollbook/cli/replay.py; docs/replay.md).

Two tables (``rollbook.store.schema`` creates them with the others; docs/schema.md):

- ``reward_versions``: one row per (``name``, ``trajectory_id``), the primary key: the reward, or
  ``status = 'error'`` with the verifier's reason (never a 0.0 standing for a failure), the verifier's
  record (``info``) and when it was scored. ``trajectories.original_reward`` and every other row of the
  ledger stay as they were.
- ``reward_version_runs``: one row per name, what the version is (the reward as given, its settings,
  the ``--where`` predicate, the tokenizer and where the rows' references came from), how many rows
  its selection had at the last start, how many are scored and how many of those are errors, and
  ``finished_at`` once every selected row was scored.

**Exactly once, across kill -9.** Scores are written in batches, each in one ledger transaction that
inserts the batch's rows and adds their counts to the ``reward_version_runs`` row: a batch is in the
ledger whole or not at all, and the counters always equal the rows. A start skips every trajectory
already scored under the name (``unscored_sql``), so a command killed at any point and run again scores
what is missing, each row once; the primary key makes a second row for the same pair an error
rather than a silent double. A name is one reward over one predicate: starting it again with another
reward, other settings or another predicate is refused (``VersionMismatch``).

The functions take the connection of a transaction the caller opened (``Ledger.transaction``), or a
cursor for reads; only the process that holds the ledger (a stopped store's file, opened by the
command) writes here.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import duckdb
    import pyarrow as pa

# Created by the store with the other tables (rollbook.store.schema.DDL).
DDL = [
    """CREATE TABLE IF NOT EXISTS reward_versions (
  name VARCHAR, trajectory_id VARCHAR, reward DOUBLE, status VARCHAR, error VARCHAR, info JSON, scored_at DOUBLE,
  PRIMARY KEY (name, trajectory_id))""",
    """CREATE TABLE IF NOT EXISTS reward_version_runs (
  name VARCHAR PRIMARY KEY, reward VARCHAR, reward_config JSON, predicate VARCHAR, tokenizer VARCHAR,
  rows_from VARCHAR, selected BIGINT, scored BIGINT, errors BIGINT, starts BIGINT, started_at DOUBLE,
  updated_at DOUBLE, finished_at DOUBLE)""",
]

TABLES = ("reward_versions", "reward_version_runs")

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:+-]{0,127}$")

# The Arrow columns ``write`` takes (one row per scored trajectory).
SCORE_COLUMNS = ("trajectory_id", "reward", "status", "error", "info")


class VersionMismatch(ValueError):
    """The name already holds another reward version (another reward, settings or predicate)."""


@dataclass(frozen=True)
class VersionSpec:
    """What a reward version is: ``name``; ``reward``, the reward as the user named it (a kind,
    ``module:function`` or ``run``); ``reward_config``, its settings as canonical JSON; ``predicate``,
    the ``--where`` that selects its rows; ``tokenizer`` and ``rows_from``, how outputs were decoded
    and where each row's reference (answer, tests) came from (recorded, not compared: a resumed
    version may find its tokenizer directory moved)."""

    name: str
    reward: str
    reward_config: str
    predicate: str
    tokenizer: str = ""
    rows_from: str = ""


@dataclass(frozen=True)
class VersionState:
    """A version's ``reward_version_runs`` row as a start left it."""

    spec: VersionSpec
    selected: int
    scored: int
    errors: int
    starts: int
    finished: bool


def one_row(result: duckdb.DuckDBPyConnection) -> tuple[Any, ...]:
    """The one row of an aggregate, which DuckDB always returns, fetched to the end so the connection
    is free for the next statement. Here rather than ``rollbook.validator.groups.one_row`` so that
    ``rollbook.store.schema``, which takes ``DDL`` from this module, stays free of the validator."""
    rows = result.fetchall()
    if len(rows) != 1:
        raise RuntimeError(f"a statement that always returns one row returned {len(rows)}")
    return rows[0]


def _at_most_one(result: duckdb.DuckDBPyConnection) -> tuple[Any, ...] | None:
    rows = result.fetchall()
    return rows[0] if rows else None


def check_name(name: str) -> None:
    """Refuse a name that cannot be typed in SQL without quoting troubles or is too long."""
    if not NAME.match(name):
        raise ValueError(
            f"reward version name {name!r}: 1 to 128 characters, letters, digits and _ . : + - (starting with a letter or digit)"
        )


def begin(con: duckdb.DuckDBPyConnection, spec: VersionSpec, selected: int, now: float) -> VersionState:
    """Start (or resume) version ``spec.name`` over a selection of ``selected`` rows, in the caller's
    transaction. A new name gets its row; a known one must be the same reward over the same predicate
    (else ``VersionMismatch``), and its row takes the new selection size (rows that arrived since
    the last start and match the predicate are scored too), one more start, and no ``finished_at``
    until ``finish`` says the selection is scored again."""
    check_name(spec.name)
    found = _at_most_one(
        con.execute(
            "SELECT reward, reward_config, predicate, scored, errors, starts, finished_at FROM reward_version_runs WHERE name = ?",
            [spec.name],
        )
    )
    if found is None:
        con.execute(
            "INSERT INTO reward_version_runs VALUES (?, ?, ?, ?, ?, ?, ?, 0, 0, 1, ?, ?, NULL)",
            [spec.name, spec.reward, spec.reward_config, spec.predicate, spec.tokenizer, spec.rows_from, selected, now, now],
        )
        return VersionState(spec, selected, 0, 0, 1, False)
    reward, config, predicate, scored, errors, starts, finished_at = found
    check_same(VersionSpec(spec.name, reward, config, predicate), spec)
    con.execute(
        "UPDATE reward_version_runs SET selected = ?, starts = starts + 1, updated_at = ?, tokenizer = ?, rows_from = ?, "
        "finished_at = NULL WHERE name = ?",
        [selected, now, spec.tokenizer, spec.rows_from, spec.name],
    )
    return VersionState(spec, selected, int(scored), int(errors), int(starts) + 1, finished_at is not None)


def check_same(known: VersionSpec, spec: VersionSpec) -> None:
    """Raise ``VersionMismatch`` unless ``spec`` is the reward, settings and predicate that version
    ``known`` was made with (the tokenizer and the rows' source may have moved)."""
    differs = [
        f"{what} {was!r} (now {asked!r})"
        for what, was, asked in (
            ("reward", known.reward, spec.reward),
            ("settings", known.reward_config, spec.reward_config),
            ("--where", known.predicate, spec.predicate),
        )
        if was != asked
    ]
    if differs:
        raise VersionMismatch(
            f"reward version {spec.name!r} was made with another " + "; ".join(differs) + ": run it again with the "
            "same --reward, options and --where to continue it, or give the new one another --name"
        )


def unscored_sql(selected: str, columns: str = "t.trajectory_id") -> str:
    """SQL for ``columns`` of the trajectories (alias ``t``) whose id is in the registered relation
    ``selected`` (column ``trajectory_id``) and not yet scored under the name given as parameter
    ``$name``: what a start still has to score (the command picks ``t.rowid`` here and reads the lists
    by rowid a batch at a time). Ids of the selection not in ``trajectories`` (rows moved into the
    archive) are left out."""
    return (
        f"SELECT {columns} FROM trajectories t SEMI JOIN {selected} s USING (trajectory_id) "
        "WHERE NOT EXISTS (SELECT 1 FROM reward_versions r WHERE r.name = $name AND r.trajectory_id = t.trajectory_id)"
    )


def write(con: duckdb.DuckDBPyConnection, name: str, scores: pa.Table, now: float) -> tuple[int, int]:
    """Insert one batch of ``scores`` (``SCORE_COLUMNS``; ``info`` JSON text) under ``name`` and add
    its counts to the version's row, in the caller's transaction. Returns (rows, errors). A pair
    already scored raises DuckDB's constraint error: the caller skips scored rows, so one here is a
    bug, never a second score."""
    if scores.num_rows == 0:
        return 0, 0
    con.register("_scores", scores)
    try:
        con.execute(
            "INSERT INTO reward_versions SELECT ?, trajectory_id, reward, status, error, info::JSON, ? FROM _scores",
            [name, now],
        )
        (errors,) = one_row(con.execute("SELECT count(*) FROM _scores WHERE status <> 'ok'"))
    except BaseException:
        with contextlib.suppress(Exception):  # the failed transaction refuses even this; its rollback drops the view
            con.unregister("_scores")
        raise
    con.unregister("_scores")
    con.execute(
        "UPDATE reward_version_runs SET scored = scored + ?, errors = errors + ?, updated_at = ? WHERE name = ?",
        [scores.num_rows, int(errors), now, name],
    )
    return scores.num_rows, int(errors)


def finish(con: duckdb.DuckDBPyConnection, name: str, now: float) -> None:
    """Mark the version's selection scored (``finished_at``), in the caller's transaction."""
    con.execute("UPDATE reward_version_runs SET finished_at = ?, updated_at = ? WHERE name = ?", [now, now, name])


def state(con: duckdb.DuckDBPyConnection, name: str) -> VersionState | None:
    """The version's ``reward_version_runs`` row, None for an unknown name."""
    found = _at_most_one(
        con.execute(
            "SELECT reward, reward_config, predicate, tokenizer, rows_from, selected, scored, errors, starts, finished_at "
            "FROM reward_version_runs WHERE name = ?",
            [name],
        )
    )
    if found is None:
        return None
    reward, config, predicate, tokenizer, rows_from, selected, scored, errors, starts, finished_at = found
    spec = VersionSpec(name, reward, config, predicate, tokenizer or "", rows_from or "")
    return VersionState(spec, int(selected), int(scored), int(errors), int(starts), finished_at is not None)
