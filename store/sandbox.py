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
  (``python -m rollbook.store.sandbox_worker``), started lazily and respawned when one dies. Each sets its
  own limits before importing DuckDB: a data-segment limit (``RLIMIT_DATA``: heap and anonymous
  mappings, so an allocation outside DuckDB's buffer manager fails too), no core files, a file-size
  limit, a lower CPU priority; it exits within a second of the server (a thread watches the
  parent). It opens the snapshot read-only with external access disabled, the configuration
  locked, extension autoloading off,
  DuckDB's ``memory_limit``, its ``threads`` and a temp directory that is its own empty folder with
  a size limit.
- **The same answer whatever ran before.** Memory DuckDB frees stays with the process's allocator
  (outside DuckDB's accounting, inside the data limit), so a worker exits after a query that leaves
  it holding much (``sandbox_worker._bloated``), after running out of memory and after a timeout,
  and a fresh one takes its place. Should a query still run out of memory (or its process die) in
  a worker that served queries before, it is run once more in a fresh process, with its whole
  timeout, and that answer stands: a query that succeeds in a fresh worker succeeds after any
  others.
- **Bounds the server enforces.** The statement fence (``rollbook.store.sql``) runs in the worker;
  the worker interrupts the query at its timeout, and the server SIGKILLs the worker
  ``kill_grace_s`` later if it has not answered (a single long function call ignores interrupts),
  then starts a fresh one; either way the answer is DEADLINE_EXCEEDED. Results stream back as Arrow IPC chunks, capped in rows and bytes (the
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
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Protocol

from rollbook.store.sandbox_worker import HEADER as _HEADER
from rollbook.store.sql import CODES, INTERNAL, RESOURCES, TIMEOUT, QueryError, QueryLimits

log = logging.getLogger("rollbook.store.sandbox")


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
        self.path = pathlib.Path(path).absolute()  # workers run in their own directories
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
    current one is at least ``max_age_s`` old. Old snapshots are deleted once no query uses them.

    A tenant's reader (``acquire(scope)``) gets a snapshot of its own, derived from the current one
    (store/governance.py ``build_tenant_snapshot``: only that tenant's rows are in the file), made
    once per base snapshot and scope."""

    def __init__(self, source: SnapshotSource, directory: pathlib.Path, max_age_s: float = 0.0):
        self.source = source
        self.directory = pathlib.Path(directory).absolute()
        self.max_age_s = max_age_s
        self.directory.mkdir(parents=True, exist_ok=True)
        self._current: Snapshot | None = None
        self._scoped: dict[tuple[str, frozenset[str] | None], tuple[Snapshot, Snapshot]] = {}  # scope -> (base, derived)
        self._lock = threading.Lock()
        self._serial = 0
        self.taken = 0  # snapshots made (tests and stats)

    def acquire(self, scope: tuple[str, frozenset[str] | None] | None = None) -> Snapshot:
        """The current snapshot; with ``scope`` = (tenant, bound models or None), that tenant's view of it."""
        with self._lock:
            cur = self._current
            if cur is None or (self.source.changed_since(cur.generation) and time.monotonic() - cur.taken >= self.max_age_s):
                self._serial += 1
                path = self.directory / f"snapshot-{self._serial}.duckdb"
                generation = self.source.snapshot(path)
                self.taken += 1
                new = Snapshot(path, generation)
                self._current = new
                if cur is not None:
                    self._retire(cur)
                cur = new
            if scope is not None:
                cur = self._derived(cur, scope)
            cur.refs += 1
            return cur

    def _derived(self, base: Snapshot, scope: tuple[str, frozenset[str] | None]) -> Snapshot:
        from rollbook.store.governance import build_tenant_snapshot

        known = self._scoped.get(scope)
        if known is not None and known[0] is base:
            return known[1]
        self._serial += 1
        path = self.directory / f"snapshot-{self._serial}-{scope[0]}.duckdb"
        build_tenant_snapshot(base.path, path, scope[0], scope[1])
        derived = Snapshot(path, base.generation)
        self._scoped[scope] = (base, derived)
        if known is not None:
            self._retire(known[1])
        return derived

    def _retire(self, snap: Snapshot) -> None:
        snap.retired = True
        if snap.refs == 0:
            snap.remove()

    def release(self, snap: Snapshot) -> None:
        with self._lock:
            snap.refs -= 1
            if snap.retired and snap.refs == 0:
                snap.remove()

    def drop(self) -> None:
        """Retire every snapshot (each is deleted once no query reads it): the next query takes a new one."""
        with self._lock:
            for _, derived in self._scoped.values():
                self._retire(derived)
            self._scoped.clear()
            if self._current is not None:
                self._retire(self._current)
                self._current = None

    def close(self) -> None:
        with self._lock:
            for _, derived in self._scoped.values():
                derived.remove()
            self._scoped.clear()
            if self._current is not None:
                self._current.remove()
                self._current = None


class FixedSnapshot:
    """A snapshot that never changes (``rollbook query --db``: a prepared private copy)."""

    def __init__(self, path: pathlib.Path):
        self.snap = Snapshot(path, 0)

    def acquire(self, scope: tuple[str, frozenset[str] | None] | None = None) -> Snapshot:
        if scope is not None:
            raise ValueError("a fixed snapshot has no tenant views")
        return self.snap

    def release(self, snap: Snapshot) -> None:
        pass

    def drop(self) -> None:
        pass

    def close(self) -> None:
        pass


def clone_file(src: pathlib.Path | int, dest: pathlib.Path) -> str:
    """Copy ``src`` to ``dest``: a reflink clone (FICLONE) where the file system has one, else a
    kernel-side copy. Returns ``"reflink"`` or ``"copy"``.

    ``src`` may be a file descriptor open for reading (copied from offset 0, its own offset left as
    it was): the ledger copies its own file through one it keeps open, because closing any
    descriptor of a file drops every POSIX lock the process holds on it, DuckDB's lock on the ledger
    included (store/ledger.py ``snapshot``)."""
    import fcntl

    ficlone = 0x40049409
    if isinstance(src, int):
        with open(dest, "wb") as fout:
            try:
                fcntl.ioctl(fout.fileno(), ficlone, src)
                return "reflink"
            except OSError:
                pass
            offset = 0
            while sent := os.sendfile(fout.fileno(), src, offset, 1 << 30):  # no copy through this process
                offset += sent
        return "copy"
    with open(src, "rb") as fin, open(dest, "wb") as fout:
        try:
            fcntl.ioctl(fout.fileno(), ficlone, fin.fileno())
            return "reflink"
        except OSError:
            pass
    shutil.copyfile(src, dest)  # sendfile(2) on Linux: no copy through this process
    return "copy"


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
            "parent": os.getpid(),  # it exits when this store dies (rollbook/lifetime.py exit_with_parent)
        }
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "PYTHONPATH", "VIRTUAL_ENV")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rollbook.store.sandbox_worker", json.dumps(settings)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=self.temp_dir,  # stderr: the server's log
            env=env,
            close_fds=True,
        )
        stdin, stdout = self.proc.stdin, self.proc.stdout
        assert stdin is not None and stdout is not None  # both are PIPE above
        self.stdin, self.stdout = stdin, stdout
        self.killed = False  # by the server (timeout); then an EOF means "timed out", not "crashed"
        self.queries = 0  # queries sent to this process

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        self.killed = True
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()

    def reap(self) -> None:
        self.kill()
        for f in (self.stdin, self.stdout):
            with contextlib.suppress(OSError):
                f.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def send(self, request: dict) -> None:
        self.stdin.write(json.dumps(request).encode() + b"\n")
        self.stdin.flush()

    def read_exact(self, n: int, deadline: float) -> bytes:
        fd = self.stdout.fileno()
        poller = select.poll()  # not select(): a busy server's descriptors pass FD_SETSIZE
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        parts, got = [], 0
        while got < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not poller.poll(remaining * 1000):
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
        self.workdir = pathlib.Path(workdir).absolute()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.snapshots = snapshots
        self._cond = threading.Condition()
        self._idle: list[_Worker | None] = [None] * limits.workers  # None: not started yet
        self._waiting = 0
        self._closed = False
        self.respawns = 0

    def run(
        self,
        sql: str,
        *,
        max_rows: int = 0,
        timeout_s: float = 0.0,
        scope: tuple[str, frozenset[str] | None] | None = None,
    ) -> Iterator[tuple[bytes, bool]]:
        """Yield ``(arrow_ipc, truncated)`` chunks; ``truncated`` is True only on the last chunk
        when a cap cut the result. ``scope`` (tenant, bound models): run over that tenant's view of
        the ledger. Raises ``QueryError`` (its ``code`` says which status)."""
        timeout = self.limits.timeout(timeout_s)
        rows = self.limits.rows(max_rows)
        deadline = time.monotonic() + timeout
        worker = self._checkout(deadline, timeout)
        try:
            started = time.monotonic()
            try:
                snap = self.snapshots.acquire(scope)
            except Exception as exc:  # disk full, ...: the query fails, the store goes on
                log.exception("could not snapshot the ledger for a query")
                raise QueryError(f"could not snapshot the ledger for this query: {exc}", INTERNAL) from exc
            deadline += time.monotonic() - started  # the snapshot is the store's own work, not the query's
            answered = False
            try:
                try:
                    for chunk in self._execute(worker, snap.path, sql, rows, timeout, deadline):
                        answered = True
                        yield chunk
                except QueryError as exc:
                    if answered or not exc.memory or worker.queries <= 1:
                        raise
                    # Out of memory in a process that ran queries before: what those left behind may
                    # be the cause. The answer is a fresh process's, with the query's whole timeout.
                    worker.reap()
                    self.respawns += 1
                    worker = _Worker(self.limits, self.workdir, 0)
                    yield from self._execute(worker, snap.path, sql, rows, timeout, time.monotonic() + timeout)
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
                raise Busy(
                    f"too many concurrent queries: {self.limits.workers} running and {self.limits.queue} "
                    "waiting (query_workers, query_queue); retry later"
                )
            self._waiting += 1
            try:
                while not self._idle:
                    if self._closed:
                        raise QueryError("the store is shutting down", RESOURCES)
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise QueryError(f"query exceeded its timeout of {timeout:g} s waiting for a free sandbox", TIMEOUT)
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

    def _checkin(self, returned: _Worker) -> None:
        worker: _Worker | None = returned
        if not returned.alive or returned.killed:
            returned.reap()
            self.respawns += 1
            worker = _Worker(self.limits, self.workdir, 0) if not self._closed else None  # start the replacement now
        with self._cond:
            if self._closed or worker is None:
                if worker is not None:
                    worker.reap()
                return
            self._idle.append(worker)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._cond.notify_all()
        for w in idle:
            if w is not None:
                w.reap()
        self.snapshots.close()
        shutil.rmtree(self.workdir, ignore_errors=True)

    # -- one query --

    def _execute(
        self, worker: _Worker, db: pathlib.Path, sql: str, rows: int, timeout: float, deadline: float
    ) -> Iterator[tuple[bytes, bool]]:
        lim = self.limits
        remaining = max(deadline - time.monotonic(), 0.05)
        hard_deadline = deadline + lim.kill_grace_s
        watchdog = threading.Timer(hard_deadline - time.monotonic(), worker.kill)
        watchdog.daemon = True
        watchdog.start()
        timed_out = QueryError(f"query exceeded its timeout of {timeout:g} s", TIMEOUT)
        worker.queries += 1
        try:
            try:
                worker.send(
                    {
                        "db": str(db),
                        "sql": sql,
                        "max_rows": rows,
                        "timeout_s": remaining,
                        "timeout_label": timeout,
                        "max_bytes": lim.max_result_bytes,
                        "batch_rows": lim.batch_rows,
                        "chunk_bytes": lim.chunk_bytes,
                        "max_chunk_bytes": lim.max_chunk_bytes,
                        "fence": lim.fence,
                    }
                )
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
                    raise QueryError(message, INTERNAL, memory=True) from None
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
                    code = err.get("code") if err.get("code") in CODES else INTERNAL
                    raise QueryError(str(err.get("message", "the query failed")), code, memory=bool(err.get("memory")))
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
    how = f"exit code {rc}"
    if rc is not None and rc < 0:
        try:
            how = f"signal {signal.Signals(-rc).name}"
        except ValueError:
            how = f"signal {-rc}"
    return (
        f"the query's sandbox process died ({how}), most likely at its memory or resource limits; the store itself is unaffected"
    )
