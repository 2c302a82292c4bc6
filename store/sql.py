"""The read-only SQL sandbox behind ``Query`` and ``rollbook query``.

Five fences, each enough on its own for the common attacks:
1. exactly one statement, and its type must be SELECT (which covers WITH, FROM-first, VALUES,
   DESCRIBE, SHOW and SUMMARIZE) or EXPLAIN: DDL, DML, COPY, ATTACH, INSTALL/LOAD, SET, PRAGMA and
   CALL are refused before execution;
2. its syntax tree (``json_serialize_sql``) names no file-reading function (``read_*``, ``glob``,
   ``*_scan``, ...) and no table that is not a plain identifier (``FROM 'some/file'``): DuckDB lets
   even a locked-down database read its own files, so these are refused by name;
3. the statement runs inside a ``READ ONLY`` transaction, so even a SELECT with a side effect
   (``nextval``) cannot write;
4. the database is opened with external access disabled and its configuration locked
   (``SANDBOX_CONFIG``): no file reads or writes, no extensions, no ATTACH, no SET;
5. a per-query timeout (the cursor is interrupted) and a row cap.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass
from typing import Iterator

import duckdb
import pyarrow as pa

SANDBOX_CONFIG = {
    "enable_external_access": False,
    "autoinstall_known_extensions": False,
    "autoload_known_extensions": False,
    "allow_community_extensions": False,
    "lock_configuration": True,
}

_ALLOWED = {duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN}


class QueryError(ValueError):
    """A refused or failed query; the message is meant for the user (DuckDB's own text included)."""


@dataclass
class QueryLimits:
    max_rows: int = 100_000
    timeout_s: float = 30.0
    batch_rows: int = 8192


def check_statement(con: duckdb.DuckDBPyConnection, sql: str) -> None:
    """Raise ``QueryError`` unless ``sql`` is exactly one read-only statement."""
    try:
        statements = con.extract_statements(sql)
    except duckdb.Error as exc:
        raise QueryError(str(exc)) from exc
    if len(statements) != 1:
        raise QueryError(f"exactly one statement per query, got {len(statements)}")
    kind = statements[0].type
    if kind not in _ALLOWED:
        raise QueryError(
            f"{kind.name} statements are not allowed: the SQL endpoint is read-only "
            "(SELECT, WITH, DESCRIBE, SHOW, SUMMARIZE, EXPLAIN)"
        )
    query = _EXPLAIN.sub("", sql, count=1) if kind == duckdb.StatementType.EXPLAIN else sql
    tree = json.loads(con.execute("SELECT json_serialize_sql(?)", [query]).fetchone()[0])
    if tree.get("error"):
        raise QueryError(f"cannot analyse the statement: {tree.get('error_message', 'unknown error')}")
    _check_tree(tree)


_EXPLAIN = re.compile(r"^\s*EXPLAIN(\s+ANALY[SZ]E)?\s+", re.IGNORECASE)
_FILE_FUNCTION = re.compile(r"^(read_\w+|glob|sniff_csv|parquet_\w+|\w+_scan|iceberg_\w+|delta_\w+|query_table)$", re.IGNORECASE)
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _check_tree(node) -> None:
    """Refuse file-reading functions and file-path table references anywhere in the tree."""
    if isinstance(node, dict):
        name = node.get("function_name")
        if isinstance(name, str) and _FILE_FUNCTION.match(name):
            raise QueryError(f"function {name}() is not allowed: the SQL endpoint reads only the ledger's tables")
        if node.get("type") == "BASE_TABLE" and not _IDENTIFIER.match(str(node.get("table_name", ""))):
            raise QueryError(f"table reference {node.get('table_name')!r} is not allowed: only the ledger's tables can be read")
        for value in node.values():
            _check_tree(value)
    elif isinstance(node, list):
        for value in node:
            _check_tree(value)


def run_query(cursor: duckdb.DuckDBPyConnection, sql: str, limits: QueryLimits) -> Iterator[tuple[pa.RecordBatch, bool]]:
    """Yield ``(batch, truncated)`` pairs; the first pair may hold an empty batch carrying the
    schema. ``truncated`` is True on the last batch when the row cap cut the result."""
    check_statement(cursor, sql)
    timer = threading.Timer(limits.timeout_s, cursor.interrupt)
    timer.start()
    cursor.execute("BEGIN TRANSACTION READ ONLY")
    try:
        try:
            reader = cursor.sql(sql).to_arrow_reader(limits.batch_rows)
        except duckdb.InterruptException as exc:
            raise QueryError(f"query exceeded its timeout of {limits.timeout_s:g} s") from exc
        except duckdb.Error as exc:
            raise QueryError(str(exc)) from exc
        if reader is None:  # a statement without a result set
            return
        yield from _capped(reader, limits)
    finally:
        timer.cancel()
        try:
            cursor.execute("ROLLBACK")
        except duckdb.Error:
            pass


def _capped(reader: pa.RecordBatchReader, limits: QueryLimits) -> Iterator[tuple[pa.RecordBatch, bool]]:
    rows = 0
    yield pa.RecordBatch.from_pylist([], schema=reader.schema), False  # the schema, even for 0 rows
    while True:
        try:
            batch = reader.read_next_batch()
        except StopIteration:
            return
        except pa.ArrowException as exc:
            raise QueryError(_interrupt_message(exc, limits)) from exc
        except duckdb.Error as exc:
            raise QueryError(_interrupt_message(exc, limits)) from exc
        room = limits.max_rows - rows
        if batch.num_rows >= room and _has_more(batch.num_rows, room, reader):
            yield batch.slice(0, room), True
            return
        rows += batch.num_rows
        yield batch, False


def _has_more(num_rows: int, room: int, reader: pa.RecordBatchReader) -> bool:
    if num_rows > room:
        return True
    try:
        nxt = reader.read_next_batch()
    except StopIteration:
        return False
    return nxt.num_rows > 0


def _interrupt_message(exc: Exception, limits: QueryLimits) -> str:
    text = str(exc)
    if "Interrupt" in text or "interrupt" in text:
        return f"query exceeded its timeout of {limits.timeout_s:g} s"
    return text
