"""One SQL sandbox process: ``python -m rollbook.store.sandbox_worker SETTINGS_JSON``.

Started by ``rollbook.store.sandbox.SandboxPool`` (the design is described there and in
docs/sql.md). It limits itself before importing DuckDB (data segment, core files, file size, CPU
priority), watches its parent, then answers one query per JSON line on stdin with frames on
stdout: ``kind (1 byte) + length (8 bytes, big-endian) + payload``, ``C`` an Arrow IPC chunk,
then ``E`` (``{"truncated", "exit"}``) or ``X`` (``{"code", "message", "exit", "memory"}``). ``exit``
says this process ends after the answer (a fatal DuckDB error, a timeout, memory it should give
back); ``memory`` that the query failed for want of memory.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import struct
import sys
import threading
from collections.abc import Iterator
from types import ModuleType
from typing import IO, TYPE_CHECKING, Any

from rollbook.lifetime import exit_with_parent
from rollbook.store.sql import INTERNAL, INVALID, RESOURCES, TIMEOUT, QueryError

if TYPE_CHECKING:  # pragma: no cover
    import duckdb as duckdb_types
    import pyarrow as pa_types

HEADER = struct.Struct(">cQ")
_HEADER = HEADER


def main(settings: dict) -> None:
    import resource

    exit_with_parent(settings.get("parent"))  # no orphaned query keeps burning CPU (rollbook/lifetime.py)
    with contextlib.suppress(OSError):
        os.nice(10)  # the store's own work (ingest, pulls) comes first on a busy machine
    data = settings["process_limit_mb"] << 20
    resource.setrlimit(resource.RLIMIT_DATA, (data, data))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    fsize = (max(settings["temp_limit_mb"], 1) + 64) << 20
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    out = os.fdopen(os.dup(1), "wb", buffering=0)  # the protocol; anything printed goes to stderr
    os.dup2(2, 1)

    import duckdb  # after the limits: nothing DuckDB allocates escapes them

    state: dict[str, Any] = {"db": None, "con": None, "archive": {}}
    for line in sys.stdin.buffer:
        request = json.loads(line)
        try:
            con = _open(duckdb, state, request["db"], settings)
            truncated = _serve_one(duckdb, con, request, out, state["archive"])
            fresh = _bloated(settings)
            _send(out, b"E", json.dumps({"truncated": truncated, "exit": fresh}).encode())
        except QueryError as exc:
            # after a timeout or running out of memory, start afresh: what the allocator kept is
            # outside DuckDB's accounting, and the next query would meet the process limit early
            fresh = exc.code != INVALID or _bloated(settings)
            answer = {"code": exc.code, "message": str(exc), "exit": fresh, "memory": exc.memory}
            _send(out, b"X", json.dumps(answer).encode())
            if fresh:
                return
        except _Fatal as exc:
            _send(out, b"X", json.dumps({"code": INTERNAL, "message": str(exc), "exit": True}).encode())
            return  # this DuckDB instance may be invalid: exit, the server starts a fresh process
        except Exception as exc:  # anything unforeseen: answer, then start afresh
            message = f"the query failed in its sandbox: {type(exc).__name__}: {exc}"
            _send(out, b"X", json.dumps({"code": INTERNAL, "message": message, "exit": True}).encode())
            return
        else:
            if fresh:
                return


def _bloated(settings: dict) -> bool:
    """Whether this process kept much memory after a query (memory DuckDB freed but the allocator
    kept): more than half its memory limit resident, or its data segment (what ``RLIMIT_DATA``
    counts, the allocator's arenas included) past three quarters of the process limit. Then it exits
    after answering and the server starts a fresh one, so the next query meets the limits as a
    fresh process does."""
    status: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmData:")):
                    status[line.split(":")[0]] = int(line.split()[1]) >> 10  # MiB
    except OSError:
        return False
    resident = status.get("VmRSS", 0) > 256 + settings["memory_limit_mb"] // 2
    return resident or status.get("VmData", 0) * 4 > settings["process_limit_mb"] * 3


class _Fatal(Exception):
    pass


def _open(duckdb: ModuleType, state: dict, db: str, settings: dict) -> duckdb_types.DuckDBPyConnection:
    """The connection to snapshot ``db`` (kept while queries read the same snapshot). A snapshot whose
    ledger moved rows into the archive is opened through ``rollbook.store.archive.open_with_archive``:
    the same table names, the archived rows read by pyarrow from exactly the recorded files, and this
    DuckDB still without any file access."""
    from rollbook.store import archive

    if state["db"] == db and (not state["archive"] or archive.still_attached(state["con"])):
        return state["con"]
    if state["con"] is not None:
        state["con"].close()
        state["db"] = state["con"] = None
        state["archive"] = {}
    config = {
        "enable_external_access": False,
        "autoinstall_known_extensions": False,
        "autoload_known_extensions": False,
        "allow_community_extensions": False,
        "allow_unsigned_extensions": False,
        "memory_limit": f"{settings['memory_limit_mb']}MB",
        "threads": settings["threads"],
        "lock_configuration": True,
    }
    if settings["temp_limit_mb"] > 0:
        config["temp_directory"] = settings["temp_dir"]
        config["max_temp_directory_size"] = f"{settings['temp_limit_mb']}MB"
    else:
        config["temp_directory"] = ""
    try:
        con = duckdb.connect(db, read_only=True, config=config)
        files = archive.recorded_files(con)
        if files:
            con.close()
            import pyarrow as pa

            pa.set_cpu_count(settings["threads"])  # pyarrow decodes the archive's Parquet beside DuckDB's threads
            try:
                con, state["archive"] = archive.open_with_archive(duckdb, db, config, files)
            except (OSError, pa.ArrowException) as exc:  # a recorded file gone or unreadable
                raise QueryError(
                    f"cannot open the ledger's archive ({type(exc).__name__}: {exc}); every file archive_files "
                    "records must be readable where it was written",
                    INTERNAL,
                ) from exc
    except duckdb.Error as exc:
        raise QueryError(f"cannot open the ledger snapshot: {exc}", INTERNAL) from exc
    state["db"], state["con"] = db, con
    return con


def _send(out: IO[bytes], kind: bytes, payload: bytes) -> None:
    out.write(_HEADER.pack(kind, len(payload)) + payload)


def _serve_one(
    duckdb: ModuleType, con: duckdb_types.DuckDBPyConnection, request: dict, out: IO[bytes], archived: dict | None = None
) -> bool:
    import pyarrow as pa

    from rollbook.store.sql import check_statement

    sql = request["sql"]
    label = request["timeout_label"]
    cur = con.cursor()
    if archived:  # before the user's statement: its cursor's views of the archived tables
        from rollbook.store.archive import add_archived_views

        add_archived_views(cur, archived)
    timer = threading.Timer(request["timeout_s"], cur.interrupt)
    timer.daemon = True
    try:
        try:
            if request.get("fence", True):
                check_statement(cur, sql)
            timer.start()
            cur.execute("BEGIN TRANSACTION READ ONLY")
            reader = cur.sql(sql).to_arrow_reader(request["batch_rows"])
            if reader is None:
                raise QueryError("the statement returned no result set")
            return _stream(pa, reader, request, out)
        except QueryError:
            raise
        except RecursionError as exc:
            raise QueryError("the statement is nested too deeply") from exc
        except MemoryError as exc:
            raise QueryError(_oom_message("", request), RESOURCES, memory=True) from exc
        except (duckdb.FatalException, duckdb.InternalException) as exc:
            raise _Fatal(f"the query hit an internal DuckDB error in its sandbox (the store is unaffected): {exc}") from exc
        except duckdb.InterruptException as exc:
            raise QueryError(f"query exceeded its timeout of {label:g} s", TIMEOUT) from exc
        except duckdb.OutOfMemoryException as exc:
            raise QueryError(_oom_message(str(exc), request), RESOURCES, memory=True) from exc
        except (duckdb.Error, pa.ArrowException) as exc:
            text = str(exc)
            if "INTERRUPT" in text.upper():
                raise QueryError(f"query exceeded its timeout of {label:g} s", TIMEOUT) from exc
            if "Out of Memory" in text or "bad allocation" in text:
                raise QueryError(_oom_message(text, request), RESOURCES, memory=True) from exc
            if "invalidated" in text or "INTERNAL Error" in text or "FATAL Error" in text:
                raise _Fatal(f"the query hit an internal DuckDB error in its sandbox (the store is unaffected): {text}") from exc
            raise QueryError(text) from exc
    finally:
        timer.cancel()
        with contextlib.suppress(Exception):
            cur.close()


def _oom_message(text: str, request: dict) -> str:
    first = text.splitlines()[0] if text else "out of memory"
    return f"query exceeded the sandbox's memory limit ({first}); narrow it (filters, LIMIT, fewer columns)"


def _stream(pa: ModuleType, reader: pa_types.RecordBatchReader, request: dict, out: IO[bytes]) -> bool:
    """Send the result in chunks of about ``chunk_bytes``, cut at ``max_rows`` rows and
    ``max_bytes`` bytes; returns whether it was cut."""
    max_rows, max_bytes = request["max_rows"], request["max_bytes"]
    chunk_bytes, max_piece = request["chunk_bytes"], request["max_chunk_bytes"]
    schema = reader.schema
    rows = size = 0
    pending: list = []
    pending_bytes = 0
    sent = False
    truncated = False

    def flush(force: bool = False) -> None:
        nonlocal pending, pending_bytes, sent
        if pending or (force and not sent):
            sink = pa.BufferOutputStream()
            with pa.ipc.new_stream(sink, schema) as writer:
                for b in pending:
                    writer.write_batch(b)
            _send(out, b"C", sink.getvalue().to_pybytes())
            pending, pending_bytes, sent = [], 0, True

    while not truncated:
        try:
            batch = reader.read_next_batch()
        except StopIteration:
            break
        if batch.num_rows == 0:
            continue
        room = max_rows - rows
        if room <= 0:
            truncated = True
            break
        if batch.num_rows > room:
            batch, truncated = batch.slice(0, room), True
        for piece in _pieces(batch, chunk_bytes):
            nbytes = piece.nbytes
            if nbytes > max_piece or size + nbytes > max_bytes:
                fit = _rows_fitting(piece, min(max_piece, max_bytes - size))
                if fit == 0 and rows == 0:
                    raise QueryError(
                        f"the first row alone is larger than the result cap ({min(max_piece, max_bytes) >> 20} MiB); "
                        "select less (substr, fewer columns)",
                        RESOURCES,
                    )
                piece = piece.slice(0, fit)
                nbytes = piece.nbytes
                truncated = True
            if piece.num_rows:
                pending.append(piece)
                pending_bytes += nbytes
                size += nbytes
                rows += piece.num_rows
            if pending_bytes >= chunk_bytes:
                flush()
            if truncated:
                break
    flush(force=True)
    return truncated


def _pieces(batch: pa_types.RecordBatch, chunk_bytes: int) -> Iterator[pa_types.RecordBatch]:
    if batch.nbytes <= chunk_bytes or batch.num_rows <= 1:
        yield batch
        return
    per = max(1, int(batch.num_rows * chunk_bytes / batch.nbytes))
    for start in range(0, batch.num_rows, per):
        yield batch.slice(start, per)


def _rows_fitting(batch: pa_types.RecordBatch, budget: int) -> int:
    lo, hi = 0, batch.num_rows
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if batch.slice(0, mid).nbytes <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
