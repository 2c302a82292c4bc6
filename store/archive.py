"""The archive: trained rows aged out of the ledger's DuckDB file into Parquet files, still read
through the same table names.

Why: a run's trajectories (token ids, log-probs and versions per token) are nearly all of the
ledger's bytes, and once trained they never change. Moved into Parquet, partitioned by model and
day, they leave DuckDB small (snapshots for the SQL sandbox copy less) and can be read in place by
polars, DuckDB or Spark, on a shared file system too (docs/schema.md, "The archive").

**What moves.** Rows of ``trajectories`` whose status is ``trained`` and whose acked lease matches a
``Criterion``: acked at least ``older_than_s`` ago, or at a trainer step ``<= up_to_step``. Every
other table stays in DuckDB (``leases``, ``rewards``, ``groups``, ``train_steps`` are small and are
what a moved row is joined with). The ledger keeps each moved row's id, session and creation time in
``_archive_index``: a ``trajectory_id`` is an idempotency key forever, and ``SetReward`` by session
must know when a session's last interaction was moved.

**Layout** (hive partitioning)::

    ROOT/trajectories/model_id=M/date=YYYY-MM-DD/part-MOVE-K.parquet

``ROOT`` is ``archive/`` beside the ledger unless named; ``M`` is percent-encoded (``urllib.parse.
quote``, as DuckDB, polars and Spark decode it); the date is the UTC day the store received the row.
Each file holds every column of ``trajectories``, ``model_id`` and ``status`` included, so one file
read alone is still whole. Files are written once and never changed.

**Crash safety: a two-phase move.** A kill -9 at any point loses and doubles nothing:

1. *plan*: pick the rows, name their files, and commit the planned paths to ``_archive_moves``;
2. *write*: each file under a temporary name (``.NAME.tmp`` in its partition folder), fsync'd,
   renamed into place, its folder fsync'd;
3. *commit*: one DuckDB transaction deletes the rows (all of them still ``trained``, else nothing),
   records the files in ``archive_files``, the rows in ``_archive_index``, and deletes the plan.

A plan still recorded when the ledger opens is a move that never committed: its files (temporary or
renamed) are deleted, then the plan (``recover``). Readers only ever open the files ``archive_files``
records, so they never see a half-done move; the rows of one are still in DuckDB. ``CRASH_POINTS``
names the points the tests kill the mover at (``ROLLBOOK_ARCHIVE_CRASH_AT``).

**Reading.** A snapshot of a ledger with recorded files is opened by ``open_with_archive``: an
in-memory catalog with a view per table over the snapshot (attached read-only as ``ledger``), and
for each archived table a view that is the snapshot's rows ``UNION ALL`` a pyarrow dataset over
exactly the recorded files (``add_archived_views``, per cursor). The Parquet files are read by
pyarrow from trusted code, not by DuckDB's file functions: the query's DuckDB keeps external access
off with no allowed path, so a user statement still cannot name a file to read or write
(``read_parquet`` and friends stay refused, by the fence and by DuckDB itself).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import pathlib
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from rollbook.fsync import fsync_dir

if TYPE_CHECKING:  # pragma: no cover
    import duckdb
    import pyarrow as pa

    from rollbook.config import AgeingConfig

log = logging.getLogger("rollbook.store.archive")

ARCHIVE_DIR = "archive"  # the default root, beside the ledger
ARCHIVED_TABLES = ("trajectories",)  # tables whose rows move; their views union the archive in
LEDGER_CATALOG = "ledger"  # the snapshot's catalog when a reader opens it with its archive
MOVE_BYTES = 256 << 20  # a move holds at most about this many bytes of rows in memory (one row at least)
ROW_GROUP_ROWS = 16_384  # Parquet row groups: small enough for readers to skip by statistics
CRASH_POINTS = ("planned", "writing", "written", "renamed", "committed")

# Bytes a row takes in memory, estimated from its token counts: prompt ids (4 bytes), output ids,
# log-probs and versions (4 + 4 + 8), plus the scalar columns.
_ROW_BYTES = "(coalesce(num_prompt_tokens, 0) * 4 + coalesce(num_output_tokens, 0) * 16 + 256)"
# The UTC day a row was received, as days since 1970-01-01 (pure arithmetic: no time zone setting).
_DAY = "CAST(floor(coalesce(received_at, created_at, 0) / 86400) AS BIGINT)"
_EPOCH = datetime.date(1970, 1, 1)


class MoveConflict(RuntimeError):
    """The rows a move wrote changed before it committed (they should not: trained rows are final);
    the move is rolled back and its files deleted."""


@dataclass(frozen=True)
class Criterion:
    """Which trained rows move: acked at least ``older_than_s`` seconds before ``now``, or acked at a
    trainer step ``<= up_to_step``; ``max_rows`` caps one call (the oldest-trained rows first)."""

    older_than_s: float | None = None
    up_to_step: int | None = None
    max_rows: int | None = None

    def __post_init__(self) -> None:
        if (self.older_than_s is None) == (self.up_to_step is None):
            raise ValueError("give exactly one of older_than_s and up_to_step")
        if self.older_than_s is not None and not self.older_than_s >= 0:
            raise ValueError(f"older_than_s must be >= 0, got {self.older_than_s}")
        if self.max_rows is not None and self.max_rows < 0:
            raise ValueError(f"max_rows must be >= 0, got {self.max_rows}")

    def condition(self, now: float) -> tuple[str, list[Any]]:
        """SQL over the acked lease ``l`` (``trained_at``, ``step``) and its parameters."""
        if self.older_than_s is not None:
            return "l.trained_at <= ?", [now - self.older_than_s]
        return "l.step <= ?", [self.up_to_step]


@dataclass
class MoveResult:
    """What one ``Ledger.age`` call moved."""

    rows: int = 0
    output_tokens: int = 0
    bytes: int = 0
    files: list[str] = field(default_factory=list)
    moves: int = 0
    root: str = ""


@dataclass(frozen=True)
class _File:
    path: pathlib.Path
    model_id: str
    date: datetime.date
    start: int  # row slice of the move's table
    stop: int

    @property
    def temporary(self) -> pathlib.Path:
        return temporary_name(self.path)


def default_root(db_path: pathlib.Path) -> pathlib.Path:
    """``archive/`` beside the ledger file (``RUN_DIR/archive`` in a run)."""
    return pathlib.Path(db_path).absolute().parent / ARCHIVE_DIR


def partition_dir(root: pathlib.Path, table: str, model_id: str, date: datetime.date) -> pathlib.Path:
    """``ROOT/TABLE/model_id=M/date=YYYY-MM-DD``, ``M`` percent-encoded (a ``/`` or ``=`` in a model id
    stays one folder name; DuckDB, polars and Spark decode it back)."""
    return root / table / f"model_id={quote(model_id, safe='')}" / f"date={date.isoformat()}"


def temporary_name(path: pathlib.Path) -> pathlib.Path:
    """Where ``path`` is written before its rename: a hidden file in the same folder, which no
    ``*.parquet`` glob matches."""
    return path.with_name(f".{path.name}.tmp")


def _crash_at(point: str) -> None:
    """The crash tests' hook: the process dies here, as under kill -9, when ``ROLLBOOK_ARCHIVE_CRASH_AT``
    names ``point``."""
    from rollbook import environment

    if environment.archive_crash_point() == point:
        log.warning("ROLLBOOK_ARCHIVE_CRASH_AT=%s: killing this process mid-move", point)
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # the signal is on its way


def _make_dirs(path: pathlib.Path) -> None:
    """``mkdir -p`` whose new folders survive a crash (each parent fsync'd after its child appears)."""
    missing: list[pathlib.Path] = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):
            d.mkdir()
        fsync_dir(d.parent)


# ---- the move (the ledger's side) ----------------------------------------------------------------------


def move(
    cursor: Callable[[], duckdb.DuckDBPyConnection],
    transaction: Callable[[], contextlib.AbstractContextManager[duckdb.DuckDBPyConnection]],
    criterion: Criterion,
    root: pathlib.Path,
    *,
    now: float | None = None,
    should_stop: Callable[[], bool] | None = None,
    move_bytes: int = MOVE_BYTES,
) -> MoveResult:
    """Move every trained row ``criterion`` picks into Parquet under ``root``, in moves of at most
    about ``move_bytes`` each (each one a complete two-phase move, module docstring). ``cursor``
    reads the ledger without its lock (trained rows are final); ``transaction`` is the ledger's
    write transaction. The caller runs one move at a time (``Ledger.age``)."""
    root = pathlib.Path(root).absolute()
    now = time.time() if now is None else now
    result = MoveResult(root=str(root))
    left = criterion.max_rows
    while left is None or left > 0:
        if should_stop is not None and should_stop():
            break
        cur = cursor()
        try:
            ids = _pick(cur, criterion, now, move_bytes, left)
            if not ids:
                break
            rows = _read_rows(cur, ids)
        finally:
            cur.close()
        move_id, files = _plan(root, rows)
        moved = _move_once(transaction, move_id, rows, files)
        result.rows += rows.num_rows
        result.output_tokens += moved[1]
        result.bytes += moved[0]
        result.files += [str(f.path) for f in files]
        result.moves += 1
        if left is not None:
            left -= rows.num_rows
    return result


def _pick(cur: duckdb.DuckDBPyConnection, criterion: Criterion, now: float, move_bytes: int, limit: int | None) -> list[str]:
    """The ids of the next move: qualifying trained rows, oldest-trained first, until about
    ``move_bytes`` of them (at least one)."""
    condition, params = criterion.condition(now)
    sql = f"""
        WITH trained AS (
          SELECT trajectory_id, max(acked_at) AS trained_at, max(step) AS step
          FROM leases WHERE acked_at IS NOT NULL GROUP BY trajectory_id),
        picked AS (
          SELECT t.trajectory_id, l.trained_at,
                 sum({_ROW_BYTES}) OVER (ORDER BY l.trained_at, t.trajectory_id ROWS UNBOUNDED PRECEDING)
                   - {_ROW_BYTES} AS before
          FROM trajectories t JOIN trained l USING (trajectory_id)
          WHERE t.status = 'trained' AND {condition})
        SELECT trajectory_id FROM picked WHERE before < ? ORDER BY trained_at, trajectory_id
        {"LIMIT ?" if limit is not None else ""}"""
    args = [*params, move_bytes] + ([limit] if limit is not None else [])
    return [tid for (tid,) in cur.execute(sql, args).fetchall()]


def _read_rows(cur: duckdb.DuckDBPyConnection, ids: list[str]) -> pa.Table:
    """The picked rows, every column of ``trajectories`` in its order plus ``_day``, sorted by
    partition (model, day), then by arrival."""
    import pyarrow as pa

    cur.register("_archive_pick", pa.table({"trajectory_id": pa.array(ids, pa.string())}))
    try:
        return cur.sql(
            f"""SELECT t.*, {_DAY} AS _day FROM trajectories t
                WHERE t.status = 'trained' AND t.trajectory_id IN (SELECT trajectory_id FROM _archive_pick)
                ORDER BY t.model_id, _day, t.received_at, t.trajectory_id"""
        ).to_arrow_table()
    finally:
        cur.unregister("_archive_pick")


def _plan(root: pathlib.Path, rows: pa.Table) -> tuple[str, list[_File]]:
    """A new move id (time-ordered, unique) and one file per (model, day) of the sorted rows, named
    after it."""
    move_id = f"{time.time_ns() // 1_000_000:013d}-{uuid.uuid4().hex[:8]}"
    models = rows.column("model_id").to_pylist()
    days = rows.column("_day").to_pylist()
    files: list[_File] = []
    start = 0
    for i in range(1, len(models) + 1):
        if i == len(models) or (models[i], days[i]) != (models[start], days[start]):
            date = _EPOCH + datetime.timedelta(days=int(days[start]))
            folder = partition_dir(root, "trajectories", models[start], date)
            files.append(_File(folder / f"part-{move_id}-{len(files):04d}.parquet", models[start], date, start, i))
            start = i
    return move_id, files


def _move_once(
    transaction: Callable[[], contextlib.AbstractContextManager[duckdb.DuckDBPyConnection]],
    move_id: str,
    rows: pa.Table,
    files: list[_File],
) -> tuple[int, int]:
    """Plan, write, commit one move (module docstring); returns (bytes written, output tokens)."""
    import pyarrow.compute as pc

    started = time.time()
    with transaction() as con:  # 1. plan
        con.execute("INSERT INTO _archive_moves VALUES (?, ?, ?)", [move_id, [str(f.path) for f in files], started])
    _crash_at("planned")
    body = rows.drop_columns(["_day"])
    try:
        sizes = []
        for i, f in enumerate(files):  # 2. write, fsync
            _make_dirs(f.path.parent)
            sizes.append(_write_file(body.slice(f.start, f.stop - f.start), f.temporary))
            if i == 0:
                _crash_at("writing")
        _crash_at("written")
        for f in files:  # rename into place, fsync the folders
            os.replace(f.temporary, f.path)
        for folder in {f.path.parent for f in files}:
            fsync_dir(folder)
        _crash_at("renamed")
        tokens = [int(pc.sum(body.column("num_output_tokens").slice(f.start, f.stop - f.start)).as_py() or 0) for f in files]
        ids = body.select(["trajectory_id", "session_id", "created_at"])
        with transaction() as con:  # 3. commit: rows out, files and index in, plan gone
            con.register("_archive_moved", ids)
            try:
                (deleted,) = con.execute(
                    "DELETE FROM trajectories WHERE status = 'trained' AND trajectory_id IN "
                    "(SELECT trajectory_id FROM _archive_moved)"
                ).fetchone() or (0,)
                if deleted != body.num_rows:
                    raise MoveConflict(
                        f"archive move {move_id}: {body.num_rows} trained rows were written but {deleted} were still "
                        "there to delete; rolled back"
                    )
                con.execute("INSERT INTO _archive_index SELECT trajectory_id, session_id, created_at FROM _archive_moved")
            finally:
                con.unregister("_archive_moved")
            con.executemany(
                "INSERT INTO archive_files VALUES (?, 'trajectories', ?, ?, ?, ?, ?, ?, ?)",
                [
                    [str(f.path), f.model_id, f.date, f.stop - f.start, tok, size, move_id, time.time()]
                    for f, tok, size in zip(files, tokens, sizes)
                ],
            )
            con.execute("DELETE FROM _archive_moves WHERE move_id = ?", [move_id])
    except BaseException:
        # Not committed: take the files back now rather than at the next start. (A kill -9 leaves
        # this to recover(); a failure here too leaves the plan row for it.)
        with contextlib.suppress(Exception):
            _remove_files([f.path for f in files])
            with transaction() as con:
                con.execute("DELETE FROM _archive_moves WHERE move_id = ?", [move_id])
        raise
    _crash_at("committed")
    log.info("archived %d rows in %d file(s) (move %s)", body.num_rows, len(files), move_id)
    return sum(sizes), sum(tokens)


def _write_file(table: pa.Table, path: pathlib.Path) -> int:
    """Write ``table`` to ``path`` as Parquet and fsync it; returns its size."""
    import pyarrow.parquet as pq

    with open(path, "wb") as out:
        pq.write_table(table, out, compression="zstd", row_group_size=ROW_GROUP_ROWS)
        out.flush()
        os.fsync(out.fileno())
        return out.tell()


def _remove_files(paths: list[pathlib.Path]) -> None:
    folders = set()
    for p in paths:
        for f in (p, temporary_name(p)):
            with contextlib.suppress(FileNotFoundError):
                f.unlink()
                folders.add(f.parent)
    for folder in folders:
        with contextlib.suppress(FileNotFoundError):
            fsync_dir(folder)


def recover(con: duckdb.DuckDBPyConnection) -> int:
    """Roll back every move that planned but never committed (a crash in phase 1 or 2): delete its
    files, renamed or temporary, then its plan. Returns the number of moves rolled back. Run by the
    ledger when it opens, before anything reads the archive."""
    plans = con.execute("SELECT move_id, paths FROM _archive_moves ORDER BY move_id").fetchall()
    for move_id, paths in plans:
        recorded = {p for (p,) in con.execute("SELECT path FROM archive_files WHERE move_id = ?", [move_id]).fetchall()}
        _remove_files([pathlib.Path(p) for p in paths if p not in recorded])
        con.execute("DELETE FROM _archive_moves WHERE move_id = ?", [move_id])
        log.warning("rolled back archive move %s, which never committed: removed its %d planned file(s)", move_id, len(paths))
    return len(plans)


def archived_totals(con: duckdb.DuckDBPyConnection) -> tuple[int, int, int]:
    """(rows, output tokens, files) in the archive."""
    row = con.execute(
        "SELECT coalesce(sum(num_rows), 0), coalesce(sum(num_output_tokens), 0), count(*) FROM archive_files"
    ).fetchone()
    return (int(row[0]), int(row[1]), int(row[2])) if row else (0, 0, 0)


# ---- reading (a snapshot with its archive) -------------------------------------------------------------


def recorded_files(con: duckdb.DuckDBPyConnection, table: str = "archive_files") -> dict[str, list[str]]:
    """The recorded archive files per table, in the order they were moved (empty for a file made
    before the archive existed); ``table``: where ``archive_files`` is (``base.main.archive_files``
    for an attached file)."""
    import duckdb

    try:
        rows = con.execute(f"SELECT table_name, path FROM {table} ORDER BY move_id, path").fetchall()
    except duckdb.CatalogException:
        return {}
    files: dict[str, list[str]] = {}
    for table, path in rows:
        files.setdefault(table, []).append(path)
    return files


def open_with_archive(
    duckdb_module: ModuleType, db: str, config: dict[str, Any], files: dict[str, list[str]]
) -> tuple[duckdb.DuckDBPyConnection, dict[str, Any]]:
    """A connection that reads the snapshot ``db`` and its archive through the ledger's table names,
    and the datasets ``add_archived_views`` needs on each cursor.

    An in-memory catalog holds a view per table of ``db`` (attached read-only as ``LEDGER_CATALOG``),
    so ``SHOW TABLES`` lists the same names as on the ledger; an archived table's view is made per
    cursor. ``config`` is the connection's DuckDB configuration: its ``enable_external_access`` and
    ``lock_configuration`` are applied after the attach (which needs file access), as the ledger's own
    connection does (store/ledger.py ``_connect``). Each archived table's dataset is a pyarrow dataset
    over exactly its recorded ``files``, with the table's own Arrow schema: a column a file lacks
    (added to the ledger after the file was written) reads NULL."""
    import pyarrow.dataset as ds

    early = {k: v for k, v in config.items() if k not in ("enable_external_access", "lock_configuration")}
    con = duckdb_module.connect(":memory:", config=early)
    try:
        path = db.replace("'", "''")
        con.execute(f"ATTACH '{path}' AS {LEDGER_CATALOG} (READ_ONLY)")
        tables = [
            name
            for (name,) in con.execute(
                "SELECT table_name FROM duckdb_tables() WHERE database_name = ? AND schema_name = 'main' ORDER BY table_name",
                [LEDGER_CATALOG],
            ).fetchall()
        ]
        datasets: dict[str, Any] = {}
        for name in tables:
            if name in files:
                schema = con.sql(f"SELECT * FROM {LEDGER_CATALOG}.main.{_quoted(name)} LIMIT 0").to_arrow_table().schema
                datasets[name] = ds.dataset(files[name], schema=schema, format="parquet")
            else:
                con.execute(f"CREATE VIEW {_quoted(name)} AS SELECT * FROM {LEDGER_CATALOG}.main.{_quoted(name)}")
        for key in ("enable_external_access", "lock_configuration"):
            if key in config:
                con.execute(f"SET {key} = {str(bool(config[key])).lower()}")
    except BaseException:
        con.close()
        raise
    return con, datasets


def add_archived_views(cur: duckdb.DuckDBPyConnection, datasets: dict[str, Any]) -> None:
    """On ``cur`` (a fresh cursor: temporary views belong to it), each archived table as the
    snapshot's rows ``UNION ALL`` its archive's. DuckDB pushes projections and filters into the
    Parquet scan; the files are opened by pyarrow, never by the query's DuckDB."""
    for name, dataset in datasets.items():
        live = cur.sql(f"SELECT * FROM {LEDGER_CATALOG}.main.{_quoted(name)}")
        live.union(cur.from_arrow(dataset)).create_view(name, replace=True)


def still_attached(con: duckdb.DuckDBPyConnection) -> bool:
    """Whether the snapshot is still attached to ``con`` (with the statement fence off, a query could
    DETACH it; the sandbox then opens the snapshot again)."""
    row = con.execute("SELECT count(*) FROM duckdb_databases() WHERE database_name = ?", [LEDGER_CATALOG]).fetchone()
    return bool(row and row[0])


def connect_snapshot(db: pathlib.Path) -> duckdb.DuckDBPyConnection:
    """A read-only connection to a private copy of a ledger (``rollbook report``) that sees archived
    rows through the same table names, as the SQL endpoint does."""
    import duckdb

    con = duckdb.connect(str(db), read_only=True)
    files = recorded_files(con)
    if not files:
        return con
    con.close()
    con, datasets = open_with_archive(duckdb, str(db), {}, files)
    add_archived_views(con, datasets)
    return con


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


# ---- the schedule (inside a running store) ---------------------------------------------------------------


class Schedule:
    """Ages the running store's ledger every ``config.interval_s`` seconds (``[store.ageing]``), on a
    thread of its own: it reads and writes Parquet without the ledger's lock, which it takes only for
    the two short transactions of each move. Stopped (between two moves) before the ledger closes."""

    def __init__(self, ledger: Any, config: AgeingConfig):
        self.ledger = ledger
        self.config = config
        self.root = pathlib.Path(config.archive_dir) if config.archive_dir is not None else default_root(ledger.db_path)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rollbook-ageing", daemon=True)
        self.passes = 0  # completed passes (tests)

    def start(self) -> Schedule:
        self.ledger.on_close(self.stop)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def criterion(self) -> Criterion | None:
        """This pass's rows: by age, or every step but the newest ``keep_steps`` (None: nothing trained yet)."""
        if self.config.older_than_s is not None:
            return Criterion(older_than_s=self.config.older_than_s)
        cur = self.ledger.cursor()
        try:
            row = cur.execute("SELECT max(step) FROM leases WHERE acked_at IS NOT NULL").fetchone()
        finally:
            cur.close()
        if row is None or row[0] is None:
            return None
        return Criterion(up_to_step=int(row[0]) - int(self.config.keep_steps or 0))

    def _run(self) -> None:
        while not self._stop.wait(self.config.interval_s):
            try:
                criterion = self.criterion()
                if criterion is not None:
                    moved = self.ledger.age(criterion, self.root, should_stop=self._stop.is_set)
                    if moved.rows:
                        log.info(
                            "ageing: moved %d trained rows into %d file(s) under %s", moved.rows, len(moved.files), self.root
                        )
            except Exception:
                log.exception("ageing pass failed; the next one retries")
            self.passes += 1
