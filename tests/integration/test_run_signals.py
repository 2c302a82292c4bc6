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
            str(REPO / "configs" / "smoke.toml"),
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
        if "no SIGTERM came" in rest:  # the parent-death signal missed; the watcher stopped it (rollbook/lifetime.py)
            warnings.warn(f"a child missed its parent-death signal:\n{rest[-3000:]}", stacklevel=1)
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


def _kill_parent_and_wait(parent: subprocess.Popen, pids: list[int], seconds: float) -> list[int]:
    """SIGKILL ``parent`` (no cleanup runs), then wait up to ``seconds`` for ``pids`` to end; the
    ones still alive."""
    parent.kill()
    parent.wait(timeout=30)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _clean_up(parent: subprocess.Popen, pids: list[int]) -> None:
    """Whatever a failing test left running must not outlive it."""
    if parent.poll() is None:
        parent.kill()
        parent.wait()
    for p in pids:
        if p and _alive(p):
            os.kill(p, signal.SIGKILL)


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
        assert not _kill_parent_and_wait(parent, [child], 30), "the script outlived its killed parent"
    finally:
        _clean_up(parent, [child])


def _orphan(tmp_path, child_cmd: list[str], *, block_sigterm: bool) -> tuple[subprocess.Popen, int]:
    """A parent process that starts ``child_cmd`` tied to it (``child_env``), with SIGTERM blocked in
    the mask the child inherits when ``block_sigterm`` (so the parent-death signal stays pending in
    the child: one way a child can miss it), echoes the child's first line and pid, then sleeps."""
    parent_code = (
        "import os, signal, subprocess, sys, time\n"
        "from rollbook.lifetime import child_env\n"
        + ("signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})\n" if block_sigterm else "")
        + f"c = subprocess.Popen({child_cmd!r}, env=child_env(dict(os.environ)), stdout=subprocess.PIPE, stderr=open({str(tmp_path / 'child.err')!r}, 'w'), text=True)\n"
        "print(c.stdout.readline().strip(), flush=True)\n"
        "print(c.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLBOOK_")}
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True, env=env)
    assert parent.stdout is not None
    first = parent.stdout.readline().strip()
    return parent, int(parent.stdout.readline()) if first else 0


def test_parent_alive_turns_false_when_the_parent_dies_even_if_its_signal_is_blocked(tmp_path):
    """``rollbook.lifetime.parent_alive`` does not depend on the death signal: a tied child that
    cannot receive it (SIGTERM blocked) still sees its parent gone, and ``signal_state`` shows the
    signal pending and blocked (bit 14, 0x4000)."""
    child_code = (
        "import time\n"
        "from rollbook.lifetime import parent_alive, signal_state, tie_to_parent\n"
        "assert tie_to_parent() and parent_alive()\n"
        "print('up', flush=True)\n"
        "while parent_alive():\n"
        "    time.sleep(0.05)\n"
        "import sys\n"
        "print('orphaned:', signal_state(), file=sys.stderr, flush=True)\n"
    )
    parent, child = _orphan(tmp_path, [sys.executable, "-c", child_code], block_sigterm=True)
    try:
        assert child and _alive(child)
        assert not _kill_parent_and_wait(parent, [child], 30), "parent_alive() stayed True after the parent was killed"
        err = (tmp_path / "child.err").read_text()
        masks = dict(part.split(": ") for part in err.split("orphaned: ", 1)[1].strip().split(", "))
        assert int(masks["SigBlk"], 16) & (1 << (signal.SIGTERM - 1)), err  # blocked, as the parent set it
        pending = int(masks["ShdPnd"], 16) | int(masks["SigPnd"], 16)
        assert pending & (1 << (signal.SIGTERM - 1)), err  # the death signal came and waits, blocked
    finally:
        _clean_up(parent, [child])


def test_a_store_stops_when_its_parent_dies_even_if_the_death_signal_cannot_reach_it(tmp_path):
    """``rollbook serve`` started by a process whose SIGTERM is blocked inherits that mask, so the
    kernel's parent-death SIGTERM never reaches its handler; its wait loop asks ``parent_alive`` and
    stops anyway, saying so, and shuts down as on SIGTERM (the ledger closed: a new store opens it)."""
    db = tmp_path / "ledger.duckdb"
    cmd = [sys.executable, "-m", "rollbook.cli", "serve", "--db", str(db), "--port", "0", "--log-level", "WARNING"]
    parent, store = _orphan(tmp_path, cmd, block_sigterm=True)
    try:
        assert store and _alive(store), (tmp_path / "child.err").read_text()
        survivors = _kill_parent_and_wait(parent, [store], 40)
        err = (tmp_path / "child.err").read_text()
        assert not survivors, f"the store outlived its killed parent by 40 s: {_describe(store)}\n{err}"
        assert "is gone and no SIGTERM came" in err and "shutting down" in err, err
    finally:
        _clean_up(parent, [store])
    import duckdb

    with duckdb.connect(str(db)) as con:  # closed, not abandoned: the lock is free and the tables are there
        assert con.sql("SELECT count(*) FROM trajectories").fetchall() == [(0,)]


def test_a_reward_pool_process_exits_when_the_process_that_started_the_pool_is_killed(tmp_path):
    """A ``multiprocessing`` pool process waits on a queue whose writing end it holds itself, so a
    SIGKILL of its parent never wakes it: ``RewardPool``'s processes watch for it (rollbook/rewards.py,
    ``lifetime.exit_with_parent``). Without that they lived on, reparented to init, for good."""
    parent_code = (
        "import os, time\n"
        "from rollbook.rewards import RewardConfig, RewardPool\n"
        "pool = RewardPool({'addition': RewardConfig(kind='exact')}, max_workers=1)\n"
        "scored = pool.result(pool.submit('addition', '5', {'answer': '5'}))\n"
        "assert scored.outcome.reward == 1.0, scored\n"
        "print(*(p.pid for p in pool._pool()._processes.values()), flush=True)\n"
        "time.sleep(600)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLBOOK_")}
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True, env=env)
    workers: list[int] = []
    try:
        assert parent.stdout is not None
        workers = [int(p) for p in parent.stdout.readline().split()]
        assert workers and all(_alive(w) for w in workers)
        survivors = _kill_parent_and_wait(parent, workers, 20)
        assert not survivors, {w: _describe(w) for w in survivors}
    finally:
        _clean_up(parent, workers)


def test_exit_with_parent_exits_at_once_when_the_named_parent_is_not_its_parent():
    """A helper whose parent died before it could watch (it was reparented already) exits at the call;
    one started by the named parent goes on."""
    code = "import os, sys\nfrom rollbook.lifetime import exit_with_parent\nexit_with_parent(int(sys.argv[1]))\nprint('on')\n"
    gone = subprocess.run([sys.executable, "-c", code, "999999999"], capture_output=True, text=True, timeout=30)
    assert (gone.returncode, gone.stdout) == (1, ""), gone
    mine = subprocess.run([sys.executable, "-c", code, str(os.getpid())], capture_output=True, text=True, timeout=30)
    assert (mine.returncode, mine.stdout) == (0, "on\n"), mine


def test_a_signal_landing_while_the_main_thread_holds_the_stop_events_lock_does_not_deadlock():
    """A signal handler runs on the main thread between two bytecodes, possibly inside ``Event.wait``
    with the event's lock held; ``Event.set`` from the handler then waits for that lock forever (a
    store hung so, its parent dead: rollbook/lifetime.py ``StopEvent``). Here the main thread holds
    the lock when SIGTERM lands: the lifetime event's handler takes no lock, and a plain Event's
    does (the control: it hangs)."""
    code = (
        "import os, signal, sys, threading\n"
        "from rollbook.lifetime import stop_event\n"
        "if sys.argv[1] == 'lifetime':\n"
        "    stop = stop_event()\n"
        "else:\n"
        "    stop = threading.Event()\n"
        "    signal.signal(signal.SIGTERM, lambda *_: stop.set())\n"
        "with stop._cond:  # as inside Event.wait\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    sum(range(10000))  # bytecodes: the handler runs here\n"
        "print(stop.is_set(), stop.wait(1), flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, "lifetime"], capture_output=True, text=True, timeout=30)
    assert done.stdout == "True True\n", done
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([sys.executable, "-c", code, "plain"], capture_output=True, text=True, timeout=5)
