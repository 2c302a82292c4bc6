"""The SQL sandbox: user queries run in separate, limited processes over a read-only snapshot.

Why: a query run on the ledger's own DuckDB instance can invalidate it (an internal error on a
recursive CTE), take the host's memory, read files through one of DuckDB's many table functions,
or write the ledger (``checkpoint()``). A deny-list cannot keep up with DuckDB, so the guarantee
comes from what the query's engine can reach (docs/sql.md):

- **Snapshot.** ``Snapshots`` asks the ledger for a consistent copy of its database file
  (``Ledger.snapshot``: fold, CHECKPOINT and copy under the ledger's lock; a reflink clone where
  the file system has one) into a private folder, only when the ledger changed since the last one
  and the last one is older than ``snapshot_max_age_s``. The ledger's files are never opened by a
  sandbox.
- **Worker processes.** ``SandboxPool`` keeps ``workers`` long-lived processes
  (``python -m rollbook.store.sandbox``), started lazily and respawned when one dies. Each sets its
  own limits before importing DuckDB: a data-segment limit (``RLIMIT_DATA``: heap and anonymous
  mappings, so an allocation outside DuckDB's buffer manager fails too), no core files, a file-size
  limit, a lower CPU priority; it dies with the server (``PR_SET_PDEATHSIG``). It opens the snapshot
  read-only with external access disabled, the configuration locked, extension autoloading off,
  DuckDB's ``memory_limit``, its ``threads`` and a temp directory that is its own empty folder with
  a size limit.
- **Bounds the server enforces.** The statement fence (``rollbook.store.sql``) runs in the worker;
  the worker interrupts the query at its timeout, and the server SIGKILLs the worker
  ``kill_grace_s`` later if it has not answered (a single long function call ignores interrupts),
  then starts a fresh one. Results stream back as Arrow IPC chunks, capped in rows and bytes (the
  worker cuts and says so; the server also stops reading past the cap). At most ``workers`` queries
  run at once and ``queue`` wait; more are refused with RESOURCE_EXHAUSTED.

Protocol (pipes): the server writes one JSON line per query to the worker's stdin; the worker
answers with frames ``kind (1 byte) + length (8 bytes, big-endian) + payload``: ``C`` a chunk (an
Arrow IPC stream), then ``E`` (JSON ``{"truncated": bool}``) or ``X`` (JSON ``{"code", "message"}``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pathlib
import select
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from typing import Callable, Iterator, Protocol

from rollbook.store.sql import INTERNAL, INVALID, RESOURCES, QueryError, QueryLimits

log = logging.getLogger("rollbook.store.sandbox")

_HEADER = struct.Struct(">cQ")


class Busy(QueryError):
    """Every sandbox is busy and the queue is full."""

    def __init__(self, message: str):
        super().__init__(message, RESOURCES)


# ---- snapshots ------------------------------------------------------------------------------------


class SnapshotSource(Protocol):
    def changed_since(self, generation: int) -> bool: ...

    def snapshot(self, dest: pathlib.Path) -> int: ...


class Snapshot:
    def __init__(self, path: pathlib.Path, generation: int):
        self.path = path
        self.generation = generation
        self.taken = time.monotonic()
        self.refs = 0
        self.retired = False

    def remove(self) -> None:
        for p in (self.path, self.path.with_name(self.path.name + ".wal")):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()


class Snapshots:
    """The current read-only snapshot of a ledger; a new one only when the ledger changed and the
    current one is at least ``max_age_s`` old. Old snapshots are deleted once no query uses them."""

    def __init__(self, source: SnapshotSource, directory: pathlib.Path, max_age_s: float = 0.0):
        self.source = source
        self.directory = directory
        self.max_age_s = max_age_s
        self.directory.mkdir(parents=True, exist_ok=True)
        self._current: Snapshot | None = None
        self._lock = threading.Lock()
        self._serial = 0
        self.taken = 0  # snapshots made (tests and stats)

    def acquire(self) -> Snapshot:
        with self._lock:
            cur = self._current
            if cur is None or (self.source.changed_since(cur.generation)
                               and time.monotonic() - cur.taken >= self.max_age_s):
                self._serial += 1
                path = self.directory / f"snapshot-{self._serial}.duckdb"
                generation = self.source.snapshot(path)
                self.taken += 1
                self._current = Snapshot(path, generation)
                if cur is not None:
                    cur.retired = True
                    if cur.refs == 0:
                        cur.remove()
            self._current.refs += 1
            return self._current

    def release(self, snap: Snapshot) -> None:
        with self._lock:
            snap.refs -= 1
            if snap.retired and snap.refs == 0:
                snap.remove()

    def close(self) -> None:
        with self._lock:
            if self._current is not None:
                self._current.remove()
                self._current = None


class FixedSnapshot:
    """A snapshot that never changes (``rollbook query --db``: a prepared private copy)."""

    def __init__(self, path: pathlib.Path):
        self.snap = Snapshot(path, 0)

    def acquire(self) -> Snapshot:
        return self.snap

    def release(self, snap: Snapshot) -> None:
        pass

    def close(self) -> None:
        pass


def clone_file(src: pathlib.Path, dest: pathlib.Path) -> str:
    """Copy ``src`` to ``dest``: a reflink clone (FICLONE) where the file system has one, else a
    kernel-side copy. Returns ``"reflink"`` or ``"copy"``."""
    import fcntl

    ficlone = 0x40049409
    with open(src, "rb") as fin, open(dest, "wb") as fout:
        try:
            fcntl.ioctl(fout.fileno(), ficlone, fin.fileno())
            return "reflink"
        except OSError:
            pass
        shutil.copyfileobj(fin, fout, 16 << 20) if not hasattr(os, "sendfile") else _sendfile(fin, fout)
    return "copy"


def _sendfile(fin, fout) -> None:
    size = os.fstat(fin.fileno()).st_size
    offset = 0
    while offset < size:
        n = os.sendfile(fout.fileno(), fin.fileno(), offset, min(size - offset, 1 << 30))
        if n == 0:
            break
        offset += n


# ---- the pool (server side) -------------------------------------------------------------------------


class _Worker:
    """One sandbox process and the pipes to it."""

    def __init__(self, limits: QueryLimits, workdir: pathlib.Path, index: int):
        self.temp_dir = workdir / f"worker-{index}-{time.monotonic_ns()}"
        self.temp_dir.mkdir(mode=0o700)
        settings = {
            "memory_limit_mb": limits.memory_limit_mb,
            "process_limit_mb": limits.process_limit_mb,
            "threads": limits.threads,
            "temp_dir": str(self.temp_dir),
            "temp_limit_mb": limits.temp_limit_mb,
        }
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "PYTHONPATH", "VIRTUAL_ENV")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rollbook.store.sandbox", json.dumps(settings)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=self.temp_dir,
            env=env, close_fds=True)
        self.killed = False  # by the server (timeout); then an EOF means "timed out", not "crashed"

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        self.killed = True
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()

    def reap(self) -> None:
        self.kill()
        for f in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                f.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def send(self, request: dict) -> None:
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()

    def read_exact(self, n: int, deadline: float) -> bytes:
        fd = self.proc.stdout.fileno()
        parts, got = [], 0
        while got < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise TimeoutError
            data = os.read(fd, min(n - got, 1 << 20))
            if not data:
                raise EOFError
            parts.append(data)
            got += len(data)
        return b"".join(parts)


class SandboxPool:
    """Runs queries in ``limits.workers`` sandbox processes over snapshots from ``snapshots``."""

    def __init__(self, limits: QueryLimits, workdir: pathlib.Path, snapshots: Snapshots | FixedSnapshot):
        self.limits = limits
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.snapshots = snapshots
        self._cond = threading.Condition()
        self._idle: list[_Worker | None] = [None] * limits.workers  # None: not started yet
        self._waiting = 0
        self._closed = False
        self.respawns = 0

    def run(self, sql: str, *, max_rows: int = 0, timeout_s: float = 0.0) -> Iterator[tuple[bytes, bool]]:
        """Yield ``(arrow_ipc, truncated)`` chunks; ``truncated`` is True only on the last chunk
        when a cap cut the result. Raises ``QueryError`` (its ``code`` says which status)."""
        timeout = self.limits.timeout(timeout_s)
        rows = self.limits.rows(max_rows)
        deadline = time.monotonic() + timeout
        worker = self._checkout(deadline, timeout)
        try:
            started = time.monotonic()
            snap = self.snapshots.acquire()
            deadline += time.monotonic() - started  # the snapshot is the store's own work, not the query's
            try:
                yield from self._execute(worker, snap.path, sql, rows, timeout, deadline)
            finally:
                self.snapshots.release(snap)
        finally:
            self._checkin(worker)

    # -- workers --

    def _checkout(self, deadline: float, timeout: float) -> _Worker:
        with self._cond:
            if self._closed:
                raise QueryError("the store is shutting down", RESOURCES)
            if not self._idle and self._waiting >= self.limits.queue:
                raise Busy(f"too many concurrent queries: {self.limits.workers} running and {self.limits.queue} "
                           "waiting (query_workers, query_queue); retry later")
            self._waiting += 1
            try:
                while not self._idle:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise QueryError(f"query exceeded its timeout of {timeout:g} s waiting for a free sandbox", RESOURCES)
                    self._cond.wait(remaining)
                worker = self._idle.pop()
            finally:
                self._waiting -= 1
        if worker is None or not worker.alive:
            if worker is not None:
                worker.reap()
                self.respawns += 1
            worker = _Worker(self.limits, self.workdir, len(self._idle))
        return worker

    def _checkin(self, worker: _Worker) -> None:
        if not worker.alive or worker.killed:
            worker.reap()
            self.respawns += 1
            worker = _Worker(self.limits, self.workdir, 0) if not self._closed else None  # start the replacement now
        with self._cond:
            if self._closed:
                if worker is not None:
                    worker.reap()
                return
            self._idle.append(worker)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
        for w in idle:
            if w is not None:
                w.reap()
        self.snapshots.close()
        shutil.rmtree(self.workdir, ignore_errors=True)

    # -- one query --

    def _execute(self, worker: _Worker, db: pathlib.Path, sql: str, rows: int, timeout: float,
                 deadline: float) -> Iterator[tuple[bytes, bool]]:
        lim = self.limits
        remaining = max(deadline - time.monotonic(), 0.05)
        hard_deadline = deadline + lim.kill_grace_s
        watchdog = threading.Timer(hard_deadline - time.monotonic(), worker.kill)
        watchdog.daemon = True
        watchdog.start()
        timed_out = QueryError(f"query exceeded its timeout of {timeout:g} s")
        try:
            try:
                worker.send({"db": str(db), "sql": sql, "max_rows": rows, "timeout_s": remaining,
                             "timeout_label": timeout, "max_bytes": lim.max_result_bytes,
                             "batch_rows": lim.batch_rows, "chunk_bytes": lim.chunk_bytes,
                             "max_chunk_bytes": lim.max_chunk_bytes, "fence": lim.fence})
            except (BrokenPipeError, OSError) as exc:
                worker.kill()
                raise QueryError("the query's sandbox process was not running; retry", INTERNAL) from exc
            held: bytes | None = None
            received = 0
            while True:
                try:
                    kind, length = _HEADER.unpack(worker.read_exact(_HEADER.size, hard_deadline))
                    if length > lim.max_chunk_bytes + (1 << 20):
                        worker.kill()
                        raise QueryError(f"the sandbox sent a chunk of {length} bytes, over the cap", INTERNAL)
                    payload = worker.read_exact(length, hard_deadline)
                except TimeoutError:
                    worker.kill()
                    raise timed_out from None
                except EOFError:
                    if time.monotonic() >= hard_deadline - 0.05 or worker.killed:
                        worker.kill()
                        raise timed_out from None
                    message = _death(worker)
                    worker.kill()
                    raise QueryError(message, INTERNAL) from None
                if kind == b"C":
                    received += length
                    if received > lim.max_result_bytes + lim.max_chunk_bytes + (1 << 20):
                        worker.kill()
                        raise QueryError("the result exceeded the server's byte cap", RESOURCES)
                    if held is not None:
                        yield held, False
                    held = payload
                elif kind == b"E":
                    end = json.loads(payload)
                    truncated = bool(end.get("truncated"))
                    if end.get("exit"):
                        worker.kill()  # it exits after this answer; a fresh one takes its place
                    if held is not None or truncated:
                        yield held or b"", truncated
                    return
                elif kind == b"X":
                    err = json.loads(payload)
                    if err.get("exit"):
                        worker.kill()  # it is exiting anyway; do not hand it another query
                    raise QueryError(err["message"], err.get("code", INVALID))
                else:
                    worker.kill()
                    raise QueryError(f"the sandbox sent an unknown frame {kind!r}", INTERNAL)
        except GeneratorExit:  # the caller went away mid-stream: the worker may be blocked writing
            worker.kill()
            raise
        finally:
            watchdog.cancel()


def _death(worker: _Worker) -> str:
    with contextlib.suppress(subprocess.TimeoutExpired):
        worker.proc.wait(timeout=5)
    rc = worker.proc.returncode
    how = f"signal {signal.Signals(-rc).name}" if rc is not None and rc < 0 else f"exit code {rc}"
    return (f"the query's sandbox process died ({how}), most likely at its memory or resource limits; "
            "the store itself is unaffected")


# ---- the worker (its own process) ------------------------------------------------------------------


def _worker_main(settings: dict) -> None:
    import resource

    _die_with_parent()
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

    state = {"db": None, "con": None}
    for line in sys.stdin.buffer:
        request = json.loads(line)
        try:
            con = _open(duckdb, state, request["db"], settings)
            truncated = _serve_one(duckdb, con, request, out)
            _send(out, b"E", json.dumps({"truncated": truncated, "exit": _bloated(settings)}).encode())
        except QueryError as exc:
            # after a timeout or running out of memory, start afresh: what the allocator kept is
            # outside DuckDB's accounting, and the next query would meet the process limit early
            fresh = exc.code != INVALID or "timeout" in str(exc) or _bloated(settings)
            _send(out, b"X", json.dumps({"code": exc.code, "message": str(exc), "exit": fresh}).encode())
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
            if _bloated(settings):
                return


def _bloated(settings: dict) -> bool:
    """Whether this process holds more than half its memory limit after a query (memory DuckDB
    freed but the allocator kept): then it exits after answering and the server starts a fresh one."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) >> 10 > 256 + settings["memory_limit_mb"] // 2
    except OSError:
        pass
    return False


class _Fatal(Exception):
    pass


def _open(duckdb, state: dict, db: str, settings: dict):
    if state["db"] == db:
        return state["con"]
    if state["con"] is not None:
        state["con"].close()
        state["db"] = state["con"] = None
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
    except duckdb.Error as exc:
        raise QueryError(f"cannot open the ledger snapshot: {exc}", INTERNAL) from exc
    state["db"], state["con"] = db, con
    return con


def _send(out, kind: bytes, payload: bytes) -> None:
    out.write(_HEADER.pack(kind, len(payload)) + payload)


def _serve_one(duckdb, con, request: dict, out) -> bool:
    import pyarrow as pa

    from rollbook.store.sql import check_statement

    sql = request["sql"]
    label = request["timeout_label"]
    cur = con.cursor()
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
            raise QueryError(_oom_message("", request), RESOURCES) from exc
        except (duckdb.FatalException, duckdb.InternalException) as exc:
            raise _Fatal(f"the query hit an internal DuckDB error in its sandbox (the store is unaffected): {exc}") from exc
        except duckdb.InterruptException as exc:
            raise QueryError(f"query exceeded its timeout of {label:g} s") from exc
        except duckdb.OutOfMemoryException as exc:
            raise QueryError(_oom_message(str(exc), request), RESOURCES) from exc
        except (duckdb.Error, pa.ArrowException) as exc:
            text = str(exc)
            if "INTERRUPT" in text.upper():
                raise QueryError(f"query exceeded its timeout of {label:g} s") from exc
            if "Out of Memory" in text or "bad allocation" in text:
                raise QueryError(_oom_message(text, request), RESOURCES) from exc
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


def _stream(pa, reader, request: dict, out) -> bool:
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
                        "select less (substr, fewer columns)", RESOURCES)
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


def _pieces(batch, chunk_bytes: int):
    if batch.nbytes <= chunk_bytes or batch.num_rows <= 1:
        yield batch
        return
    per = max(1, int(batch.num_rows * chunk_bytes / batch.nbytes))
    for start in range(0, batch.num_rows, per):
        yield batch.slice(start, per)


def _rows_fitting(batch, budget: int) -> int:
    lo, hi = 0, batch.num_rows
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if batch.slice(0, mid).nbytes <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the server dies (no orphaned query keeps burning CPU)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:
        os._exit(1)


if __name__ == "__main__":
    _worker_main(json.loads(sys.argv[1]))
