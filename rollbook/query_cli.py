"""``rollbook query``: SQL through the server, or straight on the DuckDB file when it is down.

Offline, the file is opened read-only with the same sandbox as the server. Batches the server
acknowledged but had not yet folded into DuckDB when it stopped (a kill -9) are still in the
write-ahead log beside the file; they are overlaid as temporary views so the answer includes every
acknowledged row, without writing to the file.
"""

from __future__ import annotations

import argparse
import io
import json
import pathlib
import sys

import pyarrow as pa

from rollbook import env
from rollbook.env import DEFAULT_SERVER


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
        print(f"rollbook query: result cut at {table.num_rows} rows (--max-rows)", file=sys.stderr)
    return 0


def _via_server(server: str, args: argparse.Namespace, *, fallback: bool) -> pa.Table | None:
    import grpc

    from rollbook.cli_common import store_client as _client

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
                raise SystemExit(1)
            print(f"rollbook query: error: {exc.details()}", file=sys.stderr)
            raise SystemExit(1)


def _via_file(path: pathlib.Path, args: argparse.Namespace) -> pa.Table | None:
    import duckdb

    from rollbook.store.sql import SANDBOX_CONFIG, QueryError, QueryLimits, run_query

    if not path.exists():
        print(f"rollbook query: error: no such ledger file {path}", file=sys.stderr)
        return None
    try:
        con = duckdb.connect(str(path), read_only=True, config=SANDBOX_CONFIG)
    except duckdb.IOException as exc:
        print(f"rollbook query: error: cannot open {path} ({exc}); if a server holds it, use --server", file=sys.stderr)
        return None
    try:
        _overlay_unfolded_log(con, path)
        limits = QueryLimits(max_rows=args.max_rows or 100_000, timeout_s=args.timeout or 30.0)
        batches, truncated = [], False
        for batch, cut in run_query(con, args.sql, limits):  # not a cursor: the overlay views are per connection
            batches.append(batch)
            truncated = truncated or cut
        table = pa.Table.from_batches(batches)
        return table.replace_schema_metadata({"rollbook.truncated": "true" if truncated else "false"})
    except QueryError as exc:
        print(f"rollbook query: error: {exc}", file=sys.stderr)
        return None
    finally:
        con.close()


def _overlay_unfolded_log(con, path: pathlib.Path) -> None:
    from rollbook.store import wal

    root = path.with_name(path.name + ".log")
    if not root.exists():
        return
    folded = dict(con.execute("SELECT segment, folded_batches FROM _log_state").fetchall())
    batches = [b for seg in wal.list_segments(root) for b in wal.read_segment(root, seg) if b.index >= folded.get(seg, 0)]
    catalog = con.execute("SELECT current_database()").fetchall()[0][0]  # fetchone() would leave the result open
    for kind, table_name in (("trajectories", "trajectories"), ("rejections", "rejections")):
        tables = [getattr(b, kind) for b in batches if getattr(b, kind) is not None]
        if not tables:
            continue
        con.register(f"_unfolded_{kind}", pa.concat_tables(tables))
        con.execute(f'CREATE TEMP VIEW {table_name} AS SELECT * FROM "{catalog}".main.{table_name} '
                    f"UNION ALL BY NAME SELECT * FROM _unfolded_{kind}")  # the table has columns the log lacks (status)
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


def _cell(value, max_width: int) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, float):
        text = f"{value:.6g}"
    elif isinstance(value, list):
        text = "[" + ", ".join(str(v) for v in value[:8]) + (f", ... ({len(value)})]" if len(value) > 8 else "]")
    else:
        text = str(value)
    return text if len(text) <= max_width else text[: max_width - 3] + "..."
