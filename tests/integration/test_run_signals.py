"""``rollbook run`` stopped with SIGTERM (``kill PID``, a scheduler's cancel) or killed with SIGKILL (the
OOM killer, a timeout) takes its children with it: the ``rollbook serve`` it started does not live
on as an orphan holding the ledger and its port, nor does a script it runs (rollbook/lifetime.py).

Run: ``python -m pytest tests/integration/test_run_signals.py -q``.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
import warnings

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def _children(pid: int) -> set[int]:
    out: set[int] = set()
    for task in pathlib.Path(f"/proc/{pid}/task").glob("*"):
        try:
            out |= {int(c) for c in (task / "children").read_text().split()}
        except OSError:
            pass
    return out


def _alive(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; its parent has not reaped it yet


@pytest.mark.parametrize(
    "placement,sig",
    [
        ("colocated", signal.SIGTERM),
        ("separated", signal.SIGTERM),
        ("colocated", signal.SIGKILL),
        ("separated", signal.SIGKILL),
    ],
    ids=["colocated-sigterm", "separated-sigterm", "colocated-sigkill", "separated-sigkill"],
)
def test_a_signal_stops_the_run_and_the_processes_it_started(tmp_path, placement, sig):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLBOOK_")}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rollbook.cli",
            "run",
            "--config",
            str(REPO / "configs" / "quickstart.toml"),
            "--run_dir",
            str(tmp_path / "run"),
            "--num_steps",
            "200",
            "--warm_start.student_steps",
            "0",
            "--placement",
            placement,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    children: set[int] = set()
    try:
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:  # the store is up once run prints its address
            seen.append(line)
            if line.startswith("store: ") and placement == "colocated":
                break
            if "rollout" in line and placement == "separated":  # the rollout process is up too
                break
        else:
            raise AssertionError("run ended before starting its store:\n" + "".join(seen))
        children = _children(proc.pid)
        assert children, "run started no child process"
        proc.send_signal(sig)
        proc.wait(timeout=60)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_alive(c) for c in children):
            time.sleep(0.2)
        survivors = {c: _describe(c) for c in children if _alive(c)}
        assert not survivors, f"children outlived the run by 30 s: {survivors}\n{_rest(proc, children)}"
        assert proc.returncode != 0  # stopped, not finished
        rest = _rest(proc, children)
        if "Timeout (0:00:" in rest:  # the store's stop hung and its watchdog ended it: say where
            warnings.warn(f"a child's stop hung; its watchdog ended it:\n{rest[-6000:]}", stacklevel=1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for c in children:  # an orphan left by a failing run must not outlive the test
            if _alive(c):
                os.kill(c, signal.SIGKILL)


def _describe(pid: int) -> str:
    """A live process's command line, state, signal masks (pending, shared pending, blocked, ignored,
    caught: was the SIGTERM its parent's death should send delivered, and is it handled?) and where
    each of its threads sleeps in the kernel."""
    proc = pathlib.Path(f"/proc/{pid}")
    try:
        cmd = (proc / "cmdline").read_text().replace("\0", " ").strip()
        status = (proc / "status").read_text().splitlines()
        state = ", ".join(line.replace("\t", " ") for line in status if line.startswith(("State:", "PPid:", "Sig", "ShdPnd:")))
        threads = [f"{(t / 'comm').read_text().strip()}@{(t / 'wchan').read_text()}" for t in (proc / "task").iterdir()]
    except (OSError, StopIteration):
        return "gone"
    return f"{cmd} ({state}; threads {threads})"


def _rest(proc: subprocess.Popen, children: set[int]) -> str:
    """What the run and its children printed after the store's address (all of it once they are gone;
    a survivor is killed first, since it holds the pipe open)."""
    for c in children:
        if _alive(c):
            os.kill(c, signal.SIGKILL)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.read() if proc.stdout else ""), daemon=True)
    reader.start()
    reader.join(timeout=10)
    return out[0] if out else "(output not readable)"


def test_a_store_whose_stop_hangs_prints_its_stacks_and_exits():
    """``rollbook serve`` arms a watchdog when it starts to stop (store/server.py): a hang past it
    prints every thread's stack and exits, so a store never outlives its run by more than that."""
    code = "from rollbook.store.server import _exit_if_stuck\nimport time\n_exit_if_stuck(1)\ntime.sleep(60)\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert done.returncode == 1, done  # the watchdog's exit, not the end of the sleep (0)
    assert "Timeout (0:00:01)!" in done.stderr and 'File "<string>", line 4' in done.stderr, done.stderr


def test_a_script_run_through_lifetime_stops_when_its_parent_is_killed(tmp_path):
    """The online mode's agent path: ``python -m rollbook.lifetime SCRIPT`` started by a parent that
    then dies by SIGKILL, with no chance to clean up."""
    script = tmp_path / "sleeper.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    parent_code = (
        "import os, subprocess, sys, time\n"
        "from rollbook.lifetime import child_env\n"
        f"c = subprocess.Popen([sys.executable, '-m', 'rollbook.lifetime', {str(script)!r}], env=child_env(dict(os.environ)), stdout=subprocess.PIPE, text=True)\n"
        "assert c.stdout.readline() == 'up\\n'\n"
        "print(c.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLBOOK_")}
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True, env=env)
    child = 0
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert _alive(child)
        parent.kill()
        parent.wait(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _alive(child):
            time.sleep(0.2)
        assert not _alive(child), "the script outlived its killed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if child and _alive(child):
            os.kill(child, signal.SIGKILL)
