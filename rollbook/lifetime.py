"""Children of ``rollbook run`` die with it, however it dies.

``rollbook run`` stops the store, proxy, rollout worker and agent it started when it exits or gets
SIGTERM (rollbook/run/main.py). A SIGKILL (the OOM killer, a scheduler's hard kill, ``subprocess.run``'s
timeout, pytest-timeout) runs no cleanup, and those children used to outlive it as orphans: a store
still holding the ledger's DuckDB file, an agent still calling a proxy, both burning CPU until
someone found them. Linux's ``PR_SET_PDEATHSIG`` closes that gap: the kernel sends the child SIGTERM
when its parent dies, and the child stops as it does on any SIGTERM (the store flushes and closes).

The parent marks the environment of each child it starts (``child_env``); the child, early in its
``main``, calls ``tie_to_parent``, which asks for the signal and then checks the parent is still the
one that started it (it may have died between the fork and the request). The mark is removed from
the child's environment, so the child's own children are not tied to a grandparent. Elsewhere than
Linux the call does nothing (the cleanup on exit and SIGTERM still holds).

A service (``rollbook serve``, ``rollout``, ``proxy``) waits on ``stop_event``: set by SIGINT or
SIGTERM, and, in a tied child, by a thread that watches for the parent's death itself (the child is
then reparented, so ``getppid`` changes) in case the signal never acts; it then says so, with what
the kernel held for the signal (``signal_state``). Its signal handler takes no lock
(``StopEvent``): the former ``lambda: event.set()`` deadlocked a store against itself now and then
when the signal landed while its main thread was inside ``event.wait`` (the store outlived its
SIGKILLed run, every thread idle).

A helper process that holds nothing to save (a reward pool's process, a store's SQL sandbox) calls
``exit_with_parent`` instead: a thread that ends it once its parent is gone. Those are started by
whichever thread needs one first, and ``PR_SET_PDEATHSIG`` fires when the *thread* that started a
process ends, not its process; and a pool process spawned by ``multiprocessing`` waits on a queue
whose writing end it holds itself, so its parent's death never wakes it.

A script that is not Rollbook's (the online mode's agent) is run through this module, which ties
itself and then runs the script as ``__main__``::

    python -m rollbook.lifetime examples/arithmetic_agent.py --proxy URL ...
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys
import threading
import time

PARENT_PID = "ROLLBOOK_PARENT_PID"  # the pid of the process that started this one (rollbook/environment.py)
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_tied_to: int | None = None  # the parent's pid once tie_to_parent succeeded
WATCH_S = 0.5  # how often the watcher asks for the parent
SIGNAL_GRACE_S = 2.0  # after the parent is gone, how long the watcher leaves the death signal's handler to act


def child_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` plus the mark that ties a child started from it to this process."""
    return {**env, PARENT_PID: str(os.getpid())}


def tie_to_parent() -> bool:
    """In a child started with ``child_env``: SIGTERM when the parent dies. True when tied; False when
    not marked or not on Linux. Exits (status 1) when the parent that marked it is already gone."""
    from rollbook import environment as env

    mark = env.get(PARENT_PID)
    os.environ.pop(PARENT_PID, None)  # our own children are not tied to our parent
    if mark is None or not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        print(f"rollbook: cannot ask to be stopped with the parent (errno {ctypes.get_errno()})", file=sys.stderr)
        return False
    if os.getppid() != int(mark):
        sys.exit(f"rollbook: the process that started this one (pid {mark}) is gone; stopping")
    global _tied_to
    _tied_to = int(mark)
    return True


def parent_alive() -> bool:
    """False once the process this one was tied to (``tie_to_parent``) has died: its child is then
    reparented (to init or a subreaper), so ``getppid`` changes. True when not tied."""
    return _tied_to is None or os.getppid() == _tied_to


def exit_with_parent(parent: int | None = None) -> None:
    """In a helper process: exit (status 1, no cleanup) within ``WATCH_S`` of the death of ``parent``
    (the pid that started this process; None: ``getppid()`` now), or now if this process already
    belongs to another (``parent`` died before the call). Pass ``parent`` where it is known: a process
    whose parent is pid 1 (a container's first process) cannot tell from ``getppid()`` alone."""
    if parent is None:
        parent = os.getppid()
    elif os.getppid() != parent:
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(WATCH_S)
        os._exit(1)

    threading.Thread(target=watch, name="rollbook-parent-watch", daemon=True).start()


class StopEvent(threading.Event):
    """A ``threading.Event`` that a signal handler may set (``signal_set``). ``Event.set`` takes the
    event's lock, and a handler runs on the main thread between two bytecodes, possibly while that
    thread holds the very lock inside ``wait``: the handler then waits for itself forever. A store
    hung that way with its parent dead (the kernel sends the parent-death signal again at each
    reparenting, so it came twice): its main thread inside ``Event.wait``, ``Event.set`` from the
    handler nested within, the parent watcher queued behind (py-spy, 1 in 22 SIGKILLed runs). The
    handler only flips a flag; ``is_set`` reads it and ``wait`` polls it."""

    POLL_S = 0.1  # how soon a waiter sees a signal

    def __init__(self) -> None:
        super().__init__()
        self.signalled = False

    def signal_set(self, *_: object) -> None:
        """For ``signal.signal``: takes no lock."""
        self.signalled = True

    def is_set(self) -> bool:
        return self.signalled or super().is_set()

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.is_set():
            left = self.POLL_S if deadline is None else min(self.POLL_S, deadline - time.monotonic())
            if left <= 0:
                return False
            super().wait(left)
        return True


def stop_event() -> StopEvent:
    """An event set by SIGINT or SIGTERM and, after ``tie_to_parent``, once the parent is gone (a line
    on stderr then says that no signal came, with ``signal_state``). Call from the main thread (signal
    handlers)."""
    stop = StopEvent()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop.signal_set)
    if _tied_to is not None:
        threading.Thread(target=_watch_parent, args=(stop,), name="rollbook-parent-watch", daemon=True).start()
    return stop


def _watch_parent(stop: threading.Event) -> None:
    while not stop.wait(WATCH_S):
        if not parent_alive():
            # the kernel sends the death signal as it reparents; its handler runs on the main thread's
            # next poll, so give it that before saying it never came
            if not stop.wait(SIGNAL_GRACE_S):
                print(
                    f"rollbook: the process that started this one (pid {_tied_to}) is gone and no SIGTERM "
                    f"came ({signal_state()}); stopping",
                    file=sys.stderr,
                    flush=True,
                )
                stop.set()
            return


def signal_state() -> str:
    """This process's signal masks as the kernel reports them (/proc/self/status: pending to a thread,
    pending to the process, blocked, ignored, caught; hex bit masks, bit 14 is SIGTERM), or "" where
    there is no /proc."""
    try:
        with open("/proc/self/status") as status:
            lines = status.read().splitlines()
    except OSError:
        return ""
    return ", ".join(
        " ".join(line.split()) for line in lines if line.startswith(("SigPnd:", "ShdPnd:", "SigBlk:", "SigIgn:", "SigCgt:"))
    )


def main(argv: list[str]) -> None:
    """``python -m rollbook.lifetime SCRIPT ARGS...``: tie to the parent, run SCRIPT as ``__main__``."""
    if not argv:
        sys.exit("usage: python -m rollbook.lifetime SCRIPT [ARGS...]")
    tie_to_parent()
    # SIGTERM ends the script as Ctrl-C would not: SystemExit runs its finally blocks and atexit
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))  # as `python SCRIPT` would
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
