"""``rollbook query``: SQL through the server, or straight on the DuckDB file when it is down.

Offline, the query runs in the same sandbox as the server's (``rollbook.store.sandbox``): a limited
worker process over a private copy of the file. Batches the server acknowledged but had not yet
folded into DuckDB when it stopped (a kill -9) are still in the write-ahead log beside the file;
they are folded into the copy (``status`` NULL) so the answer includes every acknowledged row,
without writing to the ledger's files.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import pathlib
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pyarrow as pa

from rollbook import environment as env
from rollbook.environment import DEFAULT_SERVER
from rollbook.errors import CommandError

if TYPE_CHECKING:  # pragma: no cover
    import duckdb

    from rollbook.store.sandbox import SandboxPool
    from rollbook.store.sql import QueryLimits


def run_query_command(args: argparse.Namespace) -> int:
    server = args.server or env.get("ROLLBOOK_SERVER") or (None if args.db else DEFAULT_SERVER)
    table = None
    if server:
        table = _via_server(server, args, fallback=bool(args.db))
    if table is None:
        if not args.db:
            print(f"rollbook query: error: store at {server} is not reachable (give --db PATH to read the file)", file=sys.stderr)
            return 1
        table = _via_file(pathlib.Path(args.db), args)
        if table is None:
            return 1
    _write(table, args.format, args.output)
    if table.schema.metadata and table.schema.metadata.get(b"rollbook.truncated") == b"true":
        print(f"rollbook query: result cut at {table.num_rows} rows (--max-rows, or the server's byte cap)", file=sys.stderr)
    return 0


def _via_server(server: str, args: argparse.Namespace, *, fallback: bool) -> pa.Table | None:
    import grpc

    from rollbook.cli.store_flags import store_client as _client

    args.server = server
    with _client(args, timeout_s=max(args.timeout, 30.0)) as client:
        try:
            return client.query(args.sql, max_rows=args.max_rows, timeout_s=args.timeout)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE and fallback:
                print(f"rollbook query: store at {server} is down; reading {args.db} read-only", file=sys.stderr)
                return None
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                print(f"rollbook query: error: store at {server} is not reachable", file=sys.stderr)
                raise SystemExit(1) from None
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # the query's timeout (or no answer in time)
                print(f"rollbook query: error: {exc.details()}; narrow the query or raise --timeout", file=sys.stderr)
                raise SystemExit(1) from None
            print(f"rollbook query: error: {exc.details()}", file=sys.stderr)
            raise SystemExit(1) from None


@contextlib.contextmanager
def sandbox_over_copy(path: pathlib.Path, limits: QueryLimits | None = None) -> Iterator[SandboxPool]:
    """The same sandbox as the server's (rollbook.store.sandbox) over the file of a stopped store: a
    private copy in a temporary folder (``private_copy``: the unfolded log folded in), queried by one
    limited read-only worker process. Raises ``CommandError`` for a missing file or one a running
    store holds. ``rollbook query --db``, ``rollbook export-data --db`` and ``rollbook lineage --db``."""
    import tempfile

    import duckdb

    from rollbook.store.sandbox import FixedSnapshot, SandboxPool
    from rollbook.store.sql import QueryLimits

    if not path.is_file():
        raise CommandError(f"no such ledger file {path}")
    with tempfile.TemporaryDirectory(prefix="rollbook-copy-") as tmp:
        snapshot = pathlib.Path(tmp) / "snapshot.duckdb"
        try:
            private_copy(path, snapshot)
        except duckdb.IOException as exc:
            raise CommandError(f"cannot open {path} ({exc}); if a server holds it, use --server") from None
        pool = SandboxPool(limits or QueryLimits(workers=1, queue=0), pathlib.Path(tmp) / "workers", FixedSnapshot(snapshot))
        try:
            yield pool
        finally:
            pool.close()


def _via_file(path: pathlib.Path, args: argparse.Namespace) -> pa.Table | None:
    """``args.sql`` over the file (``sandbox_over_copy``); None, with the reason on stderr, when it cannot run."""
    from rollbook.client import read_query_chunks
    from rollbook.store.sql import QueryError

    try:
        with sandbox_over_copy(path) as pool:
            chunks = list(pool.run(args.sql, max_rows=args.max_rows, timeout_s=args.timeout))
    except (CommandError, QueryError) as exc:
        print(f"rollbook query: error: {exc}", file=sys.stderr)
        return None
    from rollbook.v1 import rollbook_pb2 as pb

    return read_query_chunks(pb.QueryChunk(arrow_ipc=ipc, truncated=cut) for ipc, cut in chunks)


def private_copy(path: pathlib.Path, dest: pathlib.Path) -> None:
    """Copy the ledger (and DuckDB's own .wal) while holding a read-only connection, so no server
    writes meanwhile; then fold the acknowledged log batches DuckDB lacks into the copy (their
    ``status`` NULL) and checkpoint it. The ledger's files are only read."""
    import duckdb

    from rollbook.store.sandbox import clone_file

    own_wal = path.with_name(path.name + ".wal")
    guard = duckdb.connect(str(path), read_only=True)  # fails while a server holds the file
    source = open(path, "rb")  # closed after the guard: closing it would drop the guard's lock
    try:
        clone_file(source.fileno(), dest)
        if own_wal.exists():
            clone_file(own_wal, dest.with_name(dest.name + ".wal"))
    finally:
        guard.close()
        source.close()
    con = duckdb.connect(str(dest))
    try:
        from rollbook.store import schema

        for ddl in schema.DDL:  # a file made by an older store gets today's columns, as a store opening it would
            con.execute(ddl)
        schema.upgrade(con)
        _fold_unfolded_log(con, path)
        con.execute("CHECKPOINT")
    finally:
        con.close()


def _fold_unfolded_log(con: duckdb.DuckDBPyConnection, path: pathlib.Path) -> None:
    from rollbook.store import wal

    root = wal.log_root(path)
    if not root.exists():
        return
    batches = wal.unfolded(con, root)
    for kind in ("trajectories", "rejections"):
        tables = [getattr(b, kind) for b in batches if getattr(b, kind) is not None]
        if not tables:
            continue
        con.register(f"_unfolded_{kind}", pa.concat_tables(tables))
        # not yet seen by the validator; eligibility as the ingest rules set it (a fold's columns)
        status = ", NULL::VARCHAR AS status, 'ingest' AS eligibility_set_by, received_at AS eligibility_set_at"
        status = status if kind == "trajectories" else ""
        con.execute(f"INSERT INTO {kind} BY NAME SELECT *{status} FROM _unfolded_{kind}")
        con.unregister(f"_unfolded_{kind}")
    if batches:
        print(f"rollbook query: including {len(batches)} acknowledged batch(es) not yet folded into {path.name}", file=sys.stderr)


def _write(table: pa.Table, fmt: str, output: str | None) -> None:
    if fmt == "parquet":
        import pyarrow.parquet as pq

        if output is None and sys.stdout.isatty():
            raise SystemExit("rollbook query: error: --format parquet needs --output FILE (or a pipe)")
        pq.write_table(table, output or sys.stdout.buffer)
        return
    if fmt == "csv":
        import pyarrow.csv as pacsv

        buf = io.BytesIO()
        pacsv.write_csv(_plain(table), buf)
        text = buf.getvalue().decode()
    elif fmt == "json":
        text = "".join(json.dumps(row, default=str) + "\n" for row in table.to_pylist())
    else:
        text = format_table(table)
    if output:
        pathlib.Path(output).write_text(text)
    else:
        sys.stdout.write(text)


def _plain(table: pa.Table) -> pa.Table:
    """CSV cannot hold lists: render nested columns as JSON text."""
    cols = []
    for col in table.columns:
        if pa.types.is_nested(col.type):
            col = pa.array([json.dumps(v) for v in col.to_pylist()], pa.string())
        cols.append(col)
    return pa.table(cols, names=table.column_names)


def format_table(table: pa.Table, *, max_width: int = 48) -> str:
    """A plain aligned text table (lists are abbreviated)."""
    names = table.column_names
    rows = [[_cell(v, max_width) for v in row.values()] for row in table.to_pylist()]
    widths = [max([len(n)] + [len(r[i]) for r in rows]) for i, n in enumerate(names)]
    line = lambda cells: " | ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
    out = [line(names), "-+-".join("-" * w for w in widths)] + [line(r) for r in rows]
    out.append(f"({table.num_rows} row{'s' if table.num_rows != 1 else ''})")
    return "\n".join(out) + "\n"


def _cell(value: object, max_width: int) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, float):
        text = f"{value:.6g}"
    elif isinstance(value, list):
        text = "[" + ", ".join(str(v) for v in value[:8]) + (f", ... ({len(value)})]" if len(value) > 8 else "]")
    else:
        text = str(value)
    return text if len(text) <= max_width else text[: max_width - 3] + "..."
