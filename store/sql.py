"""What the SQL endpoint (``Query``, ``rollbook query``) allows, and its limits.

The guarantee that a query cannot hurt the store comes from where it runs, not from this module:
every user statement executes in a sandbox process (``rollbook.store.sandbox``) on a read-only
snapshot of the ledger, with external access disabled, its own memory limit and process limits,
and a timeout the server enforces by killing the process. See docs/sql.md.

This module holds the statement fence the sandbox applies first, as defense in depth (the tests
check that the sandbox holds with the fence switched off):
1. exactly one statement, and its type must be SELECT (which covers WITH, FROM-first, VALUES,
   DESCRIBE, SHOW and SUMMARIZE) or EXPLAIN: DDL, DML, COPY, ATTACH, INSTALL/LOAD, SET, PRAGMA and
   CALL are refused before execution;
2. its syntax tree (``json_serialize_sql``) names no function that reads files, runs nested SQL
   (``query()``, ``json_execute_serialized_sql``) or touches the database's state
   (``checkpoint()``, logs), and no table that is not a plain identifier (``FROM 'some/file'``).
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass
from typing import Any

import duckdb

SANDBOX_CONFIG = {
    "enable_external_access": False,
    "autoinstall_known_extensions": False,
    "autoload_known_extensions": False,
    "allow_community_extensions": False,
    "lock_configuration": True,
}

_ALLOWED = {duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN}

# gRPC status names a QueryError maps to (store/service.py)
INVALID, RESOURCES, INTERNAL = "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "INTERNAL"
TIMEOUT = "DEADLINE_EXCEEDED"  # the query ran past its timeout
CODES = (INVALID, RESOURCES, INTERNAL, TIMEOUT)


class QueryError(ValueError):
    """A refused or failed query; the message is meant for the user (DuckDB's own text included).
    ``code`` names the gRPC status it answers with. ``memory`` marks a failure for want of memory
    (or a sandbox process that died), which can depend on what earlier queries left in the process."""

    def __init__(self, message: str, code: str = INVALID, *, memory: bool = False):
        super().__init__(message)
        self.code = code
        self.memory = memory


@dataclass
class QueryLimits:
    """The server's bounds on one query and on the sandbox that runs them (``StoreConfig.query_*``,
    rollbook/config/store.py, which states the same defaults: this module runs in the sandbox
    process, which does not load the config; tests/unit/test_config_home.py checks they agree)."""

    max_rows: int = 100_000
    timeout_s: float = 30.0  # the default and the maximum a caller may ask for
    batch_rows: int = 8192
    max_result_bytes: int = 256 << 20
    chunk_bytes: int = 2 << 20  # Arrow bytes per QueryChunk
    max_chunk_bytes: int = 60 << 20  # a single piece larger than this cannot be sent (gRPC message limit)
    memory_limit_mb: int = 1024  # DuckDB's memory_limit in each sandbox process
    process_headroom_mb: int = 768  # the process's data limit (RLIMIT_DATA) is memory_limit_mb + this
    threads: int = 2  # DuckDB threads per sandbox process
    temp_limit_mb: int = 1024  # spill space per sandbox process (0: no spilling)
    workers: int = 2  # sandbox processes; at most this many queries run at once
    queue: int = 8  # queries that may wait for a free sandbox; more are RESOURCE_EXHAUSTED
    kill_grace_s: float = 2.0  # a query still running this long past its timeout is SIGKILLed
    snapshot_max_age_s: float = 0.0  # a snapshot younger than this is reused even if the ledger changed
    fence: bool = True  # the statement fence (tests switch it off to show the sandbox holds alone)

    def timeout(self, asked: float) -> float:
        """The timeout of one query: the caller's when it is a finite positive number no larger
        than the server's; otherwise (0, negative, NaN, inf, too large) the server's."""
        if not isinstance(asked, (int, float)) or not math.isfinite(asked) or asked <= 0:
            return self.timeout_s
        return min(float(asked), self.timeout_s)

    def rows(self, asked: int) -> int:
        return min(asked, self.max_rows) if asked and asked > 0 else self.max_rows

    @property
    def process_limit_mb(self) -> int:
        return self.memory_limit_mb + self.process_headroom_mb


def check_statement(con: duckdb.DuckDBPyConnection, sql: str) -> None:
    """Raise ``QueryError`` unless ``sql`` is exactly one read-only statement."""
    try:
        statements = con.extract_statements(sql)
    except duckdb.Error as exc:
        raise QueryError(str(exc)) from exc
    except ValueError as exc:  # a statement type the Python client has no name for (UPDATE EXTENSIONS)
        raise QueryError(f"this kind of statement is not allowed: the SQL endpoint is read-only ({exc})") from exc
    if len(statements) != 1:
        raise QueryError(f"exactly one statement per query, got {len(statements)}")
    try:
        kind = statements[0].type
    except ValueError as exc:
        raise QueryError(f"this kind of statement is not allowed: the SQL endpoint is read-only ({exc})") from exc
    if kind not in _ALLOWED:
        raise QueryError(
            f"{kind.name} statements are not allowed: the SQL endpoint is read-only "
            "(SELECT, WITH, DESCRIBE, SHOW, SUMMARIZE, EXPLAIN)"
        )
    query = _EXPLAIN.sub("", sql, count=1) if kind == duckdb.StatementType.EXPLAIN else sql
    row = con.execute("SELECT json_serialize_sql(?)", [query]).fetchone()
    if row is None:  # a scalar SELECT always has its row
        raise QueryError("could not parse the statement")
    text = row[0]
    tree = _parse_tree(text)
    if tree.get("error"):
        raise QueryError(f"cannot analyse the statement: {tree.get('error_message', 'unknown error')}")
    _check_tree(tree)


MAX_TREE_DEPTH = 20_000


def _parse_tree(text: str) -> dict:
    """The serialized syntax tree; a tree too deep for the JSON parser is refused with a reason
    (``SELECT 1+1+...+1`` with thousands of terms), never a RecursionError."""
    old = sys.getrecursionlimit()
    try:
        sys.setrecursionlimit(max(old, MAX_TREE_DEPTH + 1000))
        return json.loads(text)
    except RecursionError as exc:
        raise QueryError(f"the statement is nested too deeply to analyse (over {MAX_TREE_DEPTH} levels)") from exc
    finally:
        sys.setrecursionlimit(old)


_EXPLAIN = re.compile(r"^\s*EXPLAIN(\s+ANALY[SZ]E)?\s+", re.IGNORECASE)
_FILE_FUNCTION = re.compile(
    r"^(read_\w+|glob|sniff_csv|parquet_\w+|\w+_scan|iceberg_\w+|delta_\w+|query|query_table|"
    r"json_execute_serialized_sql|checkpoint|force_checkpoint|truncate_duckdb_logs|write_log|duckdb_logs\w*|"
    r"getenv|setseed|load_aws_credentials|which_secret|duckdb_secrets|read_single_\w+|python_\w+|"
    r"\w+_external_resource\w*|\w+_grammar_extension|enable_\w+|disable_\w+)$",
    re.IGNORECASE,
)
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _check_tree(tree: Any) -> None:
    """Refuse denied functions and file-path table references anywhere in the tree (iteratively:
    a deep tree must not overflow Python's stack)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            name = node.get("function_name")
            if isinstance(name, str) and _FILE_FUNCTION.match(name):
                raise QueryError(f"function {name}() is not allowed: the SQL endpoint reads only the ledger's tables")
            if node.get("type") == "BASE_TABLE" and not _IDENTIFIER.match(str(node.get("table_name", ""))):
                raise QueryError(
                    f"table reference {node.get('table_name')!r} is not allowed: only the ledger's tables can be read"
                )
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
