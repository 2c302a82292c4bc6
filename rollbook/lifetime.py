"""Children of ``rollbook run`` die with it, however it dies.

``rollbook run`` stops the store, proxy, rollout worker and agent it started when it exits or gets
SIGTERM (rollbook/run.py). A SIGKILL (the OOM killer, a scheduler's hard kill, ``subprocess.run``'s
timeout, pytest-timeout) runs no cleanup, and those children used to outlive it as orphans: a store
still holding the ledger's DuckDB file, an agent still calling a proxy, both burning CPU until
someone found them. Linux's ``PR_SET_PDEATHSIG`` closes that gap: the kernel sends the child SIGTERM
when its parent dies, and the child stops as it does on any SIGTERM (the store flushes and closes).

The parent marks the environment of each child it starts (``child_env``); the child, early in its
``main``, calls ``tie_to_parent``, which asks for the signal and then checks the parent is still the
one that started it (it may have died between the fork and the request). The mark is removed from
the child's environment, so the child's own children are not tied to a grandparent. Elsewhere than
Linux the call does nothing (the cleanup on exit and SIGTERM still holds).

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

PARENT_PID = "ROLLBOOK_PARENT_PID"  # the pid of the process that started this one (rollbook/env.py)
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def child_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` plus the mark that ties a child started from it to this process."""
    return {**env, PARENT_PID: str(os.getpid())}


def tie_to_parent() -> bool:
    """In a child started with ``child_env``: SIGTERM when the parent dies. True when tied; False when
    not marked or not on Linux. Exits (status 1) when the parent that marked it is already gone."""
    from rollbook import env

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
    return True


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
