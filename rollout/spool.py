"""``Spool``: a bounded, durable FIFO of trajectory batches on local disk.

Rollout workers keep generating while the store is down; their batches wait here and are replayed
in order when it returns (``rollbook.rollout.submitter``). A full spool blocks ``put`` instead of
dropping anything.

    spool = Spool("runs/w0/spool", max_bytes=256 << 20)
    seq = spool.put(trajectories)          # durable when it returns; blocks while the spool is full
    seq, request = spool.peek()            # the oldest batch, a rollbook.v1.SubmitRequest
    spool.remove(seq)                      # after every verdict of that batch arrived

On disk, one file per batch: ``{seq:012d}-{crc32:08x}.batch`` holding one serialized
``SubmitRequest``. It is written to ``{seq}.tmp``, fsync'd, renamed, and the directory fsync'd, so a
crash leaves either the whole batch or a temp file, which reopening deletes. The sequence number
fixes the order (it continues from the highest pending one on reopen); the CRC in the name catches a damaged file, which ``peek`` moves to ``corrupt/``
with a log line instead of crashing. ``.lock`` (an flock) keeps a second ``Spool`` off the
directory, since two writers would hand out the same sequence numbers.

Size bound: ``put`` waits while the spool holds ``>= max_bytes``, so the spool may exceed
``max_bytes`` by at most one batch (a batch larger than ``max_bytes`` still gets in alone).
"""

from __future__ import annotations

import fcntl
import logging
import os
import pathlib
import re
import threading
import time
import zlib

from google.protobuf.message import DecodeError

from rollbook.fsync import fsync_dir
from rollbook.v1 import rollbook_pb2 as pb

log = logging.getLogger("rollbook.rollout")

_BATCH_NAME = re.compile(r"^(\d{12})-([0-9a-f]{8})\.batch$")


class SpoolFull(TimeoutError):
    """``put`` waited ``timeout`` seconds and the spool still held ``max_bytes`` or more."""


class Spool:
    def __init__(self, directory: str | os.PathLike, *, max_bytes: int):
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.directory = pathlib.Path(directory)
        self.max_bytes = max_bytes
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_file = _lock_directory(self.directory)
        self._cond = threading.Condition()
        self._write_lock = threading.Lock()  # one writer at a time, so files appear in seq order
        self._files: dict[int, pathlib.Path] = {}  # seq -> file, insertion order == seq order
        self._sizes: dict[int, int] = {}
        self._nbytes = 0
        self._next_seq = self._scan()

    # ---- public -----------------------------------------------------------------------------------

    def put(self, trajectories: list[pb.Trajectory], *, timeout: float | None = None) -> int:
        """Write one batch durably and return its sequence number. Blocks while the spool holds
        ``>= max_bytes``; raises ``SpoolFull`` if that lasts ``timeout`` seconds (None: forever)."""
        if not trajectories:
            raise ValueError("a spool batch needs at least one trajectory")
        data = pb.SubmitRequest(trajectories=trajectories).SerializeToString()
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._write_lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            raise SpoolFull(f"spool {self.directory}: another put held it for {timeout} s")
        try:
            self._wait_for_room(None if deadline is None else max(0.0, deadline - time.monotonic()))
            seq = self._next_seq
            self._next_seq += 1
            path = self._write(seq, data)
            with self._cond:
                self._files[seq], self._sizes[seq] = path, len(data)
                self._nbytes += len(data)
                self._cond.notify_all()
        finally:
            self._write_lock.release()
        return seq

    def peek(self, *, timeout: float = 0.0) -> tuple[int, pb.SubmitRequest] | None:
        """The oldest batch as ``(seq, SubmitRequest)``, waiting up to ``timeout`` seconds for one;
        None when the spool is (still) empty. Corrupt files are moved aside and skipped."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                while not self._files:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return None
                    self._cond.wait(remaining)
                seq, path = next(iter(self._files.items()))
                request = self._read(path)
                if request is not None:
                    return seq, request
                self._forget(seq)
                _move_aside(path, self.directory / "corrupt")

    def remove(self, seq: int) -> None:
        """Delete batch ``seq`` (the caller has every verdict of it). Not fsync'd: a removal lost
        in a crash only means the batch is replayed, and the store answers DUPLICATE."""
        with self._cond:
            path = self._files[seq]
            self._forget(seq)
        path.unlink()

    def wait_until_empty(self, timeout: float | None = None) -> bool:
        """True once no batch is pending; False if ``timeout`` seconds pass first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._files, timeout)

    @property
    def nbytes(self) -> int:
        """Bytes of pending batches (file contents)."""
        return self._nbytes

    def __len__(self) -> int:
        return len(self._files)

    def close(self) -> None:
        """Release the directory lock; pending batches stay on disk for the next ``Spool``."""
        self._lock_file.close()

    def __enter__(self) -> "Spool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- private ----------------------------------------------------------------------------------

    def _scan(self) -> int:
        """Index the batches a previous process left, delete its temp files; returns the next seq."""
        last = 0
        for path in sorted(self.directory.iterdir()):
            if path.suffix == ".tmp":
                log.info("spool %s: deleting %s, a batch interrupted mid-write", self.directory, path.name)
                path.unlink()
            elif m := _BATCH_NAME.match(path.name):
                seq = int(m.group(1))
                self._files[seq], self._sizes[seq] = path, path.stat().st_size
                self._nbytes += self._sizes[seq]
                last = seq
        if self._files:
            log.info("spool %s: %d pending batch(es), %d bytes, to replay", self.directory, len(self._files), self._nbytes)
        return last + 1

    def _wait_for_room(self, timeout: float | None) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self._nbytes < self.max_bytes, timeout):
                raise SpoolFull(
                    f"spool {self.directory} still holds >= {self.max_bytes} bytes after waiting; "
                    "the store has been unreachable too long, or max_bytes is too small"
                )

    def _write(self, seq: int, data: bytes) -> pathlib.Path:
        tmp = self.directory / f"{seq:012d}.tmp"
        path = self.directory / f"{seq:012d}-{zlib.crc32(data):08x}.batch"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(self.directory)
        return path

    def _read(self, path: pathlib.Path) -> pb.SubmitRequest | None:
        data = path.read_bytes()
        expected = _BATCH_NAME.match(path.name).group(2)
        if f"{zlib.crc32(data):08x}" != expected:
            log.error(
                "spool batch %s is corrupt (CRC %08x, name says %s); moving it to corrupt/", path.name, zlib.crc32(data), expected
            )
            return None
        try:
            return pb.SubmitRequest.FromString(data)
        except DecodeError as exc:
            log.error("spool batch %s does not parse (%s); moving it to corrupt/", path.name, exc)
            return None

    def _forget(self, seq: int) -> None:
        """Drop ``seq`` from the index (caller holds ``_cond``)."""
        del self._files[seq]
        self._nbytes -= self._sizes.pop(seq)
        self._cond.notify_all()


def _lock_directory(directory: pathlib.Path):
    lock_file = open(directory / ".lock", "a+")
    try:
        fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock_file.close()
        raise RuntimeError(
            f"spool {directory} is in use by another Spool (its .lock is held); give each rollout worker its own spool directory"
        ) from None
    return lock_file


def _move_aside(path: pathlib.Path, corrupt_dir: pathlib.Path) -> None:
    corrupt_dir.mkdir(exist_ok=True)
    target = corrupt_dir / path.name
    n = 1
    while target.exists():
        target, n = corrupt_dir / f"{path.name}.{n}", n + 1
    os.replace(path, target)
