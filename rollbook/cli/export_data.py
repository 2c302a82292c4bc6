"""``rollbook export-data``: selected trajectories as Parquet or JSON Lines for training elsewhere, their
decoded texts redacted (emails, phone numbers, API keys, IP addresses, rules of your own).

    rollbook export-data --server 127.0.0.1:50551 --where "domain = 'chat' AND reward > 0" \\
        --redact all --out exports/chat.parquet
    rollbook export-data --db runs/exp1/rollbook.duckdb --redact email,phone,api_key,ip,mypkg.pii:find \\
        --format jsonl --ids hash --hash-salt-file salt.txt --out exports/exp1.jsonl

**Rows through SQL, in the sandbox.** The rows are ``SELECT * FROM trajectories WHERE (<--where>)``,
the predicate checked first to be exactly one condition (``rollbook.cli.replay.check_predicate``:
it cannot close the WHERE and add a UNION, a LIMIT, ...), and run by the store's SQL sandbox: with
``--server`` through the ``Query`` RPC (reader key from the environment), with ``--db`` over a
private copy of the file as ``rollbook query --db`` makes it (``rollbook.cli.query.private_copy``,
the server down). No statement runs outside the sandbox. The one write is the export's audit row
(``_audit_hook``: through ``Govern`` with the admin key, or, with ``--db``, appended to the stopped
store's ledger); an export whose row cannot be written is removed. Rows are read in pages ordered by ``trajectory_id`` (keyset paging: each page starts after
the last id of the one before), so an export of any size stays within the server's row and byte
caps and every selected row comes once. Through a running server each page reads the ledger as it
is then: a row added meanwhile with a larger id is exported, one with a smaller id is not.

**What is written** (``export_data``; docs/export.md): one row per trajectory with its identifying
and evidence columns, ``prompt_text`` and ``output_text`` (the token ids decoded with the tokenizer,
then redacted), and the token ids dropped (the default: ids decode back to the unredacted text),
kept, or replaced by a salted SHA-256 of each list. The file is written under a temporary name
beside ``--out`` and renamed into place once complete; an existing file is refused unless
``--force``. One JSON summary line goes to stdout (rows, counts per rule, path, format), progress
to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import math
import os
import pathlib
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import IO, TYPE_CHECKING, Any

from rollbook.errors import CommandError, ConfigError

if TYPE_CHECKING:  # pragma: no cover
    import pyarrow as pa

    from rollbook.redact import Rule
    from rollbook.tokenizers import Tokenizer

FORMATS = ("parquet", "jsonl")
ID_MODES = ("drop", "keep", "hash")
SUFFIXES = {".parquet": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl"}
# the columns copied from each row, in this order, with their export types (``tenant`` only when the
# ledger has it); docs/schema.md says what each one means
COLUMNS = (
    ("trajectory_id", "string"),
    ("session_id", "string"),
    ("group_id", "string"),
    ("model_id", "string"),
    ("task_id", "string"),
    ("domain", "string"),
    ("reward", "float64"),
    ("status", "string"),
    ("created_at", "float64"),
)
OPTIONAL_COLUMNS = (("tenant", "string"),)
ID_COLUMNS = ("prompt_token_ids", "output_token_ids")
TEXT_COLUMNS = {"prompt_token_ids": "prompt_text", "output_token_ids": "output_text"}
HASH_SUFFIX = "_sha256"
PAGE_ROWS = 4096  # rows per query; a page the server's byte cap cuts shorter just makes more pages
PAGE = "SELECT * FROM trajectories WHERE (\n{predicate}\n){after}\nORDER BY trajectory_id\nLIMIT {limit}"
SALT_BYTES = 32  # a random salt's size, for --ids hash without --hash-salt-file

RunSQL = Callable[[str], "tuple[pa.Table, bool]"]  # one statement -> (rows, cut by a cap)


# ---- the library function ----------------------------------------------------------------------


def export_data(
    rows: pa.Table | Iterable[pa.Table],
    *,
    tokenizer: Tokenizer,
    rules: str | Sequence[Rule],
    fmt: str,
    out: str | os.PathLike[str],
    ids: str = "drop",
    hash_salt: bytes | str | None = None,
    force: bool = False,
    on_done: Callable[[dict[str, Any]], None] | None = None,
    progress: IO[str] | None = None,
) -> dict[str, Any]:
    """Write ``rows`` (trajectories' rows: one table, or pages of them) to ``out`` as ``fmt``
    (``parquet`` or ``jsonl``) with their texts decoded by ``tokenizer`` and redacted by ``rules`` (a
    ``rollbook.redact`` comma list, or parsed rules).

    ``ids``: ``drop`` leaves the token ids out; ``keep`` writes them as stored (they decode to the
    unredacted text); ``hash`` writes ``prompt_token_ids_sha256`` / ``output_token_ids_sha256``, the
    hex SHA-256 of ``hash_salt`` followed by the ids as little-endian int32 (a random salt when none
    is given: the hashes then compare only within this file). The file appears at ``out`` complete or
    not at all (a temporary file beside it, renamed); an existing ``out`` is a ``CommandError`` unless
    ``force``. Returns ``{"rows", "counts" (per rule, zeros included), "path", "format", "ids"}``,
    after which ``on_done`` (if given) receives the same dict."""
    import pyarrow as pa

    from rollbook.redact import parse_rules

    if fmt not in FORMATS:
        raise ConfigError(f"export format {fmt!r}: one of {', '.join(FORMATS)}")
    if ids not in ID_MODES:
        raise ConfigError(f"ids {ids!r}: one of {', '.join(ID_MODES)}")
    if hash_salt is not None and ids != "hash":
        raise ConfigError(f"a hash salt is for ids='hash' (ids is {ids!r})")
    parsed = parse_rules(rules) if isinstance(rules, str) else tuple(rules)
    salt = os.urandom(SALT_BYTES) if hash_salt is None else hash_salt.encode() if isinstance(hash_salt, str) else hash_salt
    path = pathlib.Path(out)
    _refuse_existing(path, force)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    counts = dict.fromkeys((r.name for r in parsed), 0)
    done = _Progress(progress)
    writer: _Writer | None = None
    try:
        for page in [rows] if isinstance(rows, pa.Table) else rows:
            table = _export_table(page, tokenizer, parsed, ids, salt, counts)
            writer = writer or _Writer(tmp, fmt, table.schema)
            writer.write(table)
            done.add(table.num_rows, counts)
        if writer is None:  # no rows: an empty file with the columns a ledger without tenants has
            writer = _Writer(tmp, fmt, _export_schema(ids, tenant=False))
        writer.close()
        _refuse_existing(path, force)  # again: a file that appeared while this one was written wins
        os.replace(tmp, path)
        from rollbook.fsync import fsync_dir

        fsync_dir(path.parent)
    except BaseException:
        if writer is not None:
            writer.abort()
        tmp.unlink(missing_ok=True)
        raise
    done.add(0, counts, final=True)
    summary = {"rows": done.rows, "counts": counts, "path": str(path), "format": fmt, "ids": ids}
    if on_done is not None:
        on_done(summary)
    return summary


def _refuse_existing(path: pathlib.Path, force: bool) -> None:
    if path.is_dir():
        raise CommandError(f"{path} is a directory: --out names the file to write")
    if path.exists() and not force:
        raise CommandError(f"{path} exists: pass --force to replace it")


def _export_schema(ids: str, *, tenant: bool) -> pa.Schema:
    import pyarrow as pa

    fields = [pa.field(name, getattr(pa, kind)()) for name, kind in COLUMNS]
    fields += [pa.field(name, getattr(pa, kind)()) for name, kind in OPTIONAL_COLUMNS if tenant]
    fields += [pa.field(text, pa.string()) for text in TEXT_COLUMNS.values()]
    if ids == "keep":
        fields += [pa.field(name, pa.list_(pa.int32())) for name in ID_COLUMNS]
    elif ids == "hash":
        fields += [pa.field(name + HASH_SUFFIX, pa.string()) for name in ID_COLUMNS]
    return pa.schema(fields)


def _export_table(
    page: pa.Table, tokenizer: Tokenizer, rules: Sequence[Rule], ids: str, salt: bytes, counts: dict[str, int]
) -> pa.Table:
    """One page of trajectories' rows as export rows; ``counts`` gains the page's redactions."""
    import pyarrow as pa

    from rollbook.redact import redact

    missing = [name for name, _ in COLUMNS if name not in page.column_names]
    missing += [name for name in ID_COLUMNS if name not in page.column_names]
    if missing:
        raise ValueError(f"rows lack column(s) {', '.join(missing)}: export_data takes rows of trajectories (SELECT *)")
    tenant = all(name in page.column_names for name, _ in OPTIONAL_COLUMNS)
    schema = _export_schema(ids, tenant=tenant)
    columns: dict[str, Any] = {}
    for name in schema.names:
        if name in page.column_names and name not in ID_COLUMNS:
            columns[name] = page.column(name).cast(schema.field(name).type)
    for id_column, text_column in TEXT_COLUMNS.items():
        lists = page.column(id_column).to_pylist()
        texts = []
        for token_ids in lists:
            done = redact(tokenizer.decode(token_ids or []), rules)
            for rule, n in done.counts.items():
                counts[rule] += n
            texts.append(done.text)
        columns[text_column] = pa.array(texts, pa.string())
        if ids == "keep":
            columns[id_column] = page.column(id_column).cast(pa.list_(pa.int32()))
        elif ids == "hash":
            columns[id_column + HASH_SUFFIX] = pa.array([hash_ids(token_ids or [], salt) for token_ids in lists], pa.string())
    return pa.table([columns[name] for name in schema.names], schema=schema)


def hash_ids(token_ids: Sequence[int], salt: bytes) -> str:
    """The hex SHA-256 of ``salt`` followed by ``token_ids`` as little-endian int32: equal lists under
    one salt hash alike (duplicates and joins still work), and without the salt a guessed text cannot
    be checked against the hash."""
    import numpy as np

    return hashlib.sha256(salt + np.asarray(token_ids, dtype="<i4").tobytes()).hexdigest()


class _Writer:
    """Parquet (zstd, one row group per page) or JSON Lines (UTF-8, one object per row) into ``path``,
    fsync'd on close."""

    def __init__(self, path: pathlib.Path, fmt: str, schema: pa.Schema) -> None:
        import pyarrow.parquet as pq

        self.path, self.fmt = path, fmt
        self.file = open(path, "wb")
        self.parquet = pq.ParquetWriter(self.file, schema, compression="zstd") if fmt == "parquet" else None

    def write(self, table: pa.Table) -> None:
        if self.parquet is not None:
            self.parquet.write_table(table)
            return
        lines = (json.dumps(row, ensure_ascii=False, allow_nan=False) + "\n" for row in table.to_pylist())
        self.file.write("".join(lines).encode())

    def close(self) -> None:
        if self.parquet is not None:
            self.parquet.close()
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            if self.parquet is not None:
                self.parquet.close()
        self.file.close()


class _Progress:
    """Rows written and redactions so far on ``stream``, at most once per ``every_s`` (and at the end)."""

    def __init__(self, stream: IO[str] | None, every_s: float = 1.0) -> None:
        self.stream, self.every_s = stream, every_s
        self.started = self.last = time.monotonic()
        self.rows, self.shown = 0, -1

    def add(self, rows: int, counts: dict[str, int], *, final: bool = False) -> None:
        self.rows += rows
        now = time.monotonic()
        if self.stream is None or (self.shown == self.rows if final else now - self.last < self.every_s):
            return
        self.last, self.shown = now, self.rows
        rate = self.rows / (now - self.started) if now > self.started else 0.0
        found = ", ".join(f"{rule} {n}" for rule, n in counts.items())
        print(f"rollbook export-data: {self.rows} rows, {rate:.0f} rows/s; redacted: {found}", file=self.stream, flush=True)


# ---- rows through the SQL sandbox --------------------------------------------------------------


def page_sql(predicate: str, after: str | None, limit: int = PAGE_ROWS) -> str:
    """The statement of one page: the checked predicate as the whole first condition, then the keyset
    condition (a quoted literal: the sandbox's query takes no parameters)."""
    keyset = "" if after is None else "\nAND trajectory_id > '" + after.replace("'", "''") + "'"
    return PAGE.format(predicate=predicate, after=keyset, limit=limit)


def paged_rows(run: RunSQL, predicate: str, page_rows: int | None = None) -> Iterator[pa.Table]:
    """Every row of ``trajectories`` the predicate selects, in pages of at most ``page_rows``
    (``PAGE_ROWS``) in ``trajectory_id`` order. A page a cap cut short (``run`` says so) is followed
    by the next one from where it stopped."""
    page_rows = page_rows or PAGE_ROWS
    after: str | None = None
    while True:
        table, truncated = run(page_sql(predicate, after, page_rows))
        if table.num_rows == 0:
            if truncated:
                raise CommandError(f"the row after trajectory_id {after!r} alone is larger than the query result cap")
            return
        yield table
        if table.num_rows < page_rows and not truncated:
            return
        after = table.column("trajectory_id")[-1].as_py()


def check_predicate(predicate: str) -> str:
    """``predicate`` refused (``ConfigError``) unless it is exactly one condition on ``trajectories``
    (the same check ``rollbook replay reward`` makes: no UNION, ORDER BY, LIMIT, GROUP BY, unbalanced
    parenthesis). Parsed only; the sandbox runs it."""
    from rollbook.cli.replay import check_predicate as check

    try:
        check(predicate)
    except ConfigError as exc:  # replay words it for its own statement; the rule is the same
        raise ConfigError(str(exc).replace("SELECT trajectory_id FROM", "SELECT * FROM")) from None
    return predicate


def server_source(args: argparse.Namespace, server: str) -> contextlib.AbstractContextManager[RunSQL]:
    """Pages through ``Query`` on the store at ``server`` (the reader key and TLS settings of the
    flags and the environment, ``rollbook.cli.store_flags``)."""
    import grpc

    from rollbook.cli.store_flags import store_client
    from rollbook.errors import unreachable

    @contextlib.contextmanager
    def source() -> Iterator[RunSQL]:
        args.server = server
        with store_client(args, timeout_s=max(args.timeout, 30.0)) as client:

            def run(sql: str) -> tuple[pa.Table, bool]:
                try:
                    table = client.query(sql, max_rows=PAGE_ROWS, timeout_s=args.timeout)
                except grpc.RpcError as exc:
                    code, details = exc.code(), exc.details()
                    if code == grpc.StatusCode.INVALID_ARGUMENT:
                        raise ConfigError(f"--where: {details}") from None
                    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                        raise CommandError(f"{details}; narrow --where or raise --timeout") from None
                    reason = unreachable(exc, server)
                    raise CommandError(reason or f"{code.name}: {details}") from None
                metadata = table.schema.metadata or {}
                return table, metadata.get(b"rollbook.truncated") == b"true"

            yield run

    return source()


@contextlib.contextmanager
def file_source(db: pathlib.Path, timeout_s: float) -> Iterator[RunSQL]:
    """Pages from a private copy of the ledger file (its unfolded log folded in), queried by one
    sandbox process: ``rollbook query --db``'s path (``rollbook.cli.query.sandbox_over_copy``). The
    ledger's files are only read."""
    import pyarrow as pa

    from rollbook.cli.query import sandbox_over_copy
    from rollbook.store.sql import INVALID, TIMEOUT, QueryError, QueryLimits

    limits = QueryLimits(workers=1, queue=0, max_rows=PAGE_ROWS, timeout_s=timeout_s or QueryLimits.timeout_s)
    with sandbox_over_copy(db, limits) as pool:

        def run(sql: str) -> tuple[pa.Table, bool]:
            try:
                chunks = list(pool.run(sql))
            except QueryError as exc:
                if exc.code == INVALID:
                    raise ConfigError(f"--where: {exc}") from None
                if exc.code == TIMEOUT:
                    raise CommandError(f"{exc}; narrow --where or raise --timeout") from None
                raise CommandError(str(exc)) from None
            tables = [pa.ipc.open_stream(io.BytesIO(ipc)).read_all() for ipc, _ in chunks if ipc]
            table = pa.concat_tables(tables) if tables else pa.table({"trajectory_id": pa.array([], pa.string())})
            return table, any(cut for _, cut in chunks)

        yield run


# ---- the command -------------------------------------------------------------------------------


def add_parser(sub: argparse._SubParsersAction) -> None:
    """``rollbook export-data`` (``rollbook/cli/main.py`` calls this)."""
    p = sub.add_parser(
        "export-data",
        help="export selected trajectories as Parquet or JSONL with their decoded texts redacted",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Export the trajectories a SQL condition selects, one row each: trajectory_id, session_id,\n"
        "group_id, model_id, task_id, domain, reward, status, created_at (and tenant), prompt_text and\n"
        "output_text (the token ids decoded, every span a rule finds replaced by [REDACTED:<rule>]), and\n"
        "the token ids dropped (default), kept, or hashed. Rows come through the store's SQL sandbox:\n"
        "--server (the Query RPC, reader key from the environment) or --db (a private copy of a stopped\n"
        "store's file, as rollbook query --db reads it); the ledger is never written. The file appears\n"
        "complete or not at all; an existing one is refused unless --force. One JSON line on stdout\n"
        "(rows, counts per rule, path, format), progress on stderr. Detectors miss what does not look\n"
        "like what they know: redaction is one layer of defense, not a guarantee. docs/export.md.",
        epilog="examples:\n"
        "  rollbook export-data --server 127.0.0.1:50551 --where \"domain = 'chat'\" --out chat.parquet\n"
        "  rollbook export-data --db runs/exp1/rollbook.duckdb --redact email,phone,ip,mypkg.pii:find \\\n"
        "      --format jsonl --ids hash --hash-salt-file salt.txt --out exp1.jsonl",
    )
    p.add_argument(
        "--where",
        default="TRUE",
        metavar="PREDICATE",
        help="SQL condition on trajectories selecting the rows, run in the store's SQL sandbox: any read-only "
        "expression over its columns, subqueries on the ledger's tables included (default: every row)",
    )
    p.add_argument(
        "--format",
        choices=FORMATS,
        default=None,
        help="parquet or jsonl (default: from --out's suffix: .parquet, .jsonl or .ndjson)",
    )
    p.add_argument(
        "--redact",
        default="all",
        metavar="RULES",
        help="comma list of rules: email, phone, api_key, ipv4, ipv6, ip (both), all (every built-in), "
        "package.module:function (yours: text -> (start, end) spans) (default: %(default)s)",
    )
    p.add_argument("--out", required=True, metavar="PATH", help="the file to write")
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--server", default=None, help="store address HOST:PORT (default: env ROLLBOOK_SERVER, else 127.0.0.1:50551)"
    )
    source.add_argument("--db", default=None, metavar="PATH", help="a stopped store's ledger file, read through a private copy")
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="Hugging Face tokenizer directory to decode the ids with (default: the toy tasks' character tokenizer)",
    )
    p.add_argument(
        "--ids",
        choices=ID_MODES,
        default="drop",
        help="token ids: drop them, keep them (they decode to the unredacted text), or hash each list "
        "(salted SHA-256) (default: %(default)s)",
    )
    p.add_argument(
        "--hash-salt-file",
        default=None,
        metavar="PATH",
        help="the salt for --ids hash: this file's bytes (a final newline dropped); default: a random salt, "
        "so hashes compare only within one export",
    )
    p.add_argument(
        "--phone-regions",
        default="US",
        metavar="CODES",
        help="regions whose national phone numbers (no +country code) are recognized, e.g. US,GB,DE (default: %(default)s)",
    )
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument("--reason", default="", help="why the export is made (recorded in the store's audit table)")
    p.add_argument("--timeout", type=float, default=0.0, help="each page query's timeout in seconds (0 = the sandbox's, 30)")
    from rollbook.cli.store_flags import client_flags

    client_flags(p)
    p.set_defaults(func=run_export_command)


def run_export_command(args: argparse.Namespace, *, on_done: Callable[[dict[str, Any]], None] | None = None) -> int:
    """The command: everything the flags can get wrong is refused before a row is read."""
    from rollbook import environment as env
    from rollbook.redact import parse_rules
    from rollbook.tasks import TOKENIZER
    from rollbook.tokenizers import load_tokenizer

    out = pathlib.Path(args.out)
    fmt = args.format or SUFFIXES.get(out.suffix.lower())
    if fmt is None:
        raise ConfigError(f"--out {out}: give --format parquet or jsonl (or a .parquet, .jsonl or .ndjson name)")
    if not math.isfinite(args.timeout) or args.timeout < 0:
        raise ConfigError(f"--timeout {args.timeout:g}: seconds >= 0 (0: the sandbox's default, 30)")
    rules = parse_rules(args.redact, phone_regions=args.phone_regions.split(","))
    salt = _read_salt(args.hash_salt_file, args.ids)
    _refuse_existing(out, args.force)
    predicate = check_predicate(args.where)
    try:
        tokenizer = load_tokenizer(args.tokenizer, default=TOKENIZER)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--tokenizer: {exc}") from None
    if args.ids == "keep":
        print("rollbook export-data: --ids keep: the token ids decode to the unredacted text", file=sys.stderr)
    # --db wins: `rollbook` fills an unset --server from the environment for every command but query
    server = None if args.db else (args.server or env.server())
    audit = on_done or _audit_hook(args, predicate, server)
    source = file_source(pathlib.Path(args.db), args.timeout) if server is None else server_source(args, server)
    with source as run:
        summary = export_data(
            paged_rows(run, predicate),
            tokenizer=tokenizer,
            rules=rules,
            fmt=fmt,
            out=out,
            ids=args.ids,
            hash_salt=salt,
            force=args.force,
            on_done=audit,
            progress=sys.stderr,
        )
    print(json.dumps(summary), flush=True)
    return 0


def _audit_hook(args: argparse.Namespace, predicate: str, server: str | None) -> Callable[[dict[str, Any]], None]:
    """What records the export in the store's ``audit`` table (action ``export``, the predicate, the
    counts per rule): through ``Govern`` with the admin key (checked before a row is read), or, with
    ``--db``, by opening the stopped store's ledger. An export whose audit row cannot be written is
    removed: no export leaves without its record."""
    from rollbook.client import StoreClient

    if server is not None:
        with StoreClient.from_env(server) as probe:
            if probe.admin_key is None:
                raise CommandError(
                    "an export is recorded in the store's audit table, which takes the admin key: set ROLLBOOK_ADMIN_KEY"
                )

    def record(summary: dict[str, Any]) -> None:
        detail = {**summary, "redact": args.redact}
        try:
            if server is not None:
                with StoreClient.from_env(server) as client:
                    client.govern("export", where=predicate, reason=args.reason, detail=detail)
            else:
                from rollbook.store.access import Caller
                from rollbook.store.ledger import Ledger

                ledger = Ledger(args.db)
                try:
                    ledger.record_audit(
                        Caller("admin", name="export-data --db"), "export", predicate=predicate, reason=args.reason,
                        rows=int(summary["rows"]), detail=detail,
                    )  # fmt: skip
                finally:
                    ledger.close()
        except Exception as exc:
            pathlib.Path(summary["path"]).unlink(missing_ok=True)
            raise CommandError(f"the export's audit row could not be written, so the export was removed: {exc}") from None

    return record


def _read_salt(path: str | None, ids: str) -> bytes | None:
    if path is None:
        return None
    if ids != "hash":
        raise ConfigError(f"--hash-salt-file is for --ids hash (--ids is {ids})")
    try:
        salt = pathlib.Path(path).read_bytes().removesuffix(b"\n")
    except OSError as exc:
        raise ConfigError(f"--hash-salt-file: cannot read {path} ({exc.strerror})") from None
    if not salt:
        raise ConfigError(f"--hash-salt-file {path} is empty: a salt needs bytes (e.g. head -c 32 /dev/urandom > {path})")
    return salt


def main(argv: list[str] | None = None) -> int:
    """``python -m rollbook.cli.export_data FLAGS``: the subcommand on its own, with the ``rollbook``
    command's error handling (a ``ConfigError`` exits 2, a ``CommandError`` 1, one line each)."""
    parser = argparse.ArgumentParser(prog="rollbook")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["export-data", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except ConfigError as exc:
        print(f"rollbook export-data: error: {exc}", file=sys.stderr)
        return 2
    except CommandError as exc:
        print(f"rollbook export-data: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
