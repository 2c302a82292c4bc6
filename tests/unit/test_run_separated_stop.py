"""``rollbook run --placement separated`` stops its rollout worker with SIGTERM and waits a bounded
time (rollbook/run/separated.py ``_wait_or_kill``): a worker that does not stop is killed, with a
line saying so, instead of the finished run failing on the wait."""

from __future__ import annotations

import signal
import subprocess
import sys

from rollbook.run.separated import WORKER_STOP_S, _wait_or_kill


def _child(code: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "up\n"  # its handler is in place
    return proc


def test_a_worker_that_ignores_sigterm_is_killed_after_the_wait_and_the_run_says_so(capfd):
    proc = _child("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('up', flush=True)\ntime.sleep(60)\n")
    proc.terminate()
    _wait_or_kill(proc, 1.0)
    assert proc.returncode == -signal.SIGKILL
    assert f"rollout worker (pid {proc.pid}) still running 1 s after SIGTERM: killing it" in capfd.readouterr().err


def test_a_worker_that_stops_on_sigterm_keeps_its_own_exit_status(capfd):
    proc = _child(
        "import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *_: sys.exit(3))\nprint('up', flush=True)\ntime.sleep(60)\n"
    )
    proc.terminate()
    _wait_or_kill(proc, 30.0)
    assert proc.returncode == 3 and "killing it" not in capfd.readouterr().err
    assert WORKER_STOP_S > 120  # above the worker's own flush bound (rollout/main.py)
