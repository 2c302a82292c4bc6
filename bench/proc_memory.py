"""Peak memory of a process tree, per role, for bench/placement.py (Linux ``/proc`` only).

    with TreeMemory(proc.pid, root_role="trainer") as mem:
        proc.wait()
    mem.report()   # {"peak_rss_mib_by_role": {"store": ..., "trainer": ...}, "largest_process_mib": ..., ...}

A thread walks the descendants of the root process every ``interval_s`` (0.5 s) and reads each one's
``VmHWM`` (the kernel's own high-water mark of its resident set, so a peak between two samples is
not missed while the process lives) and its ``Pss`` (``smaps_rollup``: shared pages divided among the
processes that map them, so the sum over processes does not count torch's libraries once per process).
A process that lives less than one interval may be missed; one that exits keeps the last value read.

Roles come from the command line (``ROLES``; first match wins); a process that matches none (a
reward-pool or SQL-sandbox process, multiprocessing's resource tracker) takes its parent's role, and
the root takes ``root_role``. A process is classified again at every sample, since a Ray worker
becomes an actor only after it started.
"""

from __future__ import annotations

import os
import threading
from collections import defaultdict

ROLES = (  # (part of the command line, role)
    ("ray::TrainerRank", "trainer"),
    ("ray::RolloutActor", "rollout"),
    ("rollbook.cli serve", "store"),
    ("rollbook.cli rollout", "rollout"),
    ("rollbook.cli proxy", "rollout"),
    ("ray::", "ray"),  # idle workers, and Ray's own services below
    ("site-packages/ray/", "ray"),
)


def role_of(cmdline: str, parent_role: str) -> str:
    for part, role in ROLES:
        if part in cmdline:
            return role
    return parent_role


def descendants(root: int) -> list[tuple[int, int]]:
    """``(pid, parent pid)`` of ``root`` and every process below it, parents first."""
    children: dict[int, list[int]] = defaultdict(list)
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                ppid = int(f.read().rpartition(")")[2].split()[1])  # the name may hold spaces and parentheses
        except (OSError, ValueError, IndexError):
            continue
        children[ppid].append(int(entry.name))
    out, todo = [], [(root, 0)]
    while todo:
        pid, parent = todo.pop(0)
        out.append((pid, parent))
        todo += [(child, pid) for child in children.get(pid, [])]
    return out


def _kib(path: str, fields: tuple[str, ...]) -> dict[str, int]:
    found = {}
    with open(path) as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in fields:
                found[name] = int(rest.split()[0])
    return found


class TreeMemory:
    """Samples the tree under ``root`` in a thread from ``__enter__`` to ``__exit__`` (or ``stop``)."""

    def __init__(self, root: int, *, root_role: str, interval_s: float = 0.5):
        self.root, self.root_role, self.interval_s = root, root_role, interval_s
        self.peak_kib: dict[int, int] = {}  # pid -> VmHWM
        self.role: dict[int, str] = {}
        self.cmdline: dict[int, str] = {}
        self.peak_pss_total_kib = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-memory", daemon=True)

    def __enter__(self) -> TreeMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def pids(self, role: str | None = None) -> list[int]:
        """Processes of the tree alive now (of ``role``, when given), by a fresh walk."""
        alive = []
        for pid, parent in descendants(self.root):
            self._classify(pid, parent)
            if role is None or self.role.get(pid) == role:
                alive.append(pid)
        return alive

    def _classify(self, pid: int, parent: int) -> None:
        """Read afresh every time: a Ray worker process starts idle and becomes an actor later
        (its title then changes to ``ray::TrainerRank...``); its peak counts for its latest role."""
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # exited: keep what was read before
            return
        if not cmd:  # a zombie's command line is empty
            return
        self.cmdline[pid] = cmd
        self.role[pid] = self.root_role if pid == self.root else role_of(cmd, self.role.get(parent, self.root_role))

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.interval_s):
                self.sample()
                return

    def sample(self) -> None:
        pss_total = 0
        for pid, parent in descendants(self.root):
            self._classify(pid, parent)
            if pid not in self.role:  # gone before it could be read
                continue
            try:
                status = _kib(f"/proc/{pid}/status", ("VmHWM", "VmRSS"))
                pss_total += _kib(f"/proc/{pid}/smaps_rollup", ("Pss",)).get("Pss", 0)
            except OSError:  # exited since the walk
                continue
            hwm = status.get("VmHWM", status.get("VmRSS", 0))  # a zombie has neither: 0
            self.peak_kib[pid] = max(self.peak_kib.get(pid, 0), hwm)
        self.peak_pss_total_kib = max(self.peak_pss_total_kib, pss_total)
        self.samples += 1

    def report(self) -> dict:
        by_role: dict[str, int] = {}
        count: dict[str, int] = defaultdict(int)
        for pid, kib in self.peak_kib.items():
            if kib == 0:
                continue
            role = self.role[pid]
            by_role[role] = max(by_role.get(role, 0), kib)
            count[role] += 1
        mib = lambda kib: round(kib / 1024, 1)
        return {
            "peak_rss_mib_by_role": {role: mib(kib) for role, kib in sorted(by_role.items())},
            "processes_by_role": dict(sorted(count.items())),
            "largest_process_mib": mib(max(by_role.values(), default=0)),
            "peak_pss_mib_total": mib(self.peak_pss_total_kib),
            "memory_samples": self.samples,
        }
