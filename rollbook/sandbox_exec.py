"""Run an untrusted Python program against tests in a sandboxed subprocess (the ``code`` reward).

    limits = SandboxLimits(wall_s=5, cpu_s=4, memory_mb=256)
    result = run_program("def add(a, b):\\n    return a + b", ["assert add(1, 2) == 3"], limits)
    result.passed, result.total, result.reason        # 1, 1, "ok"

What is enforced, and how (docs/design.md, "Rewards, datasets and tokenizers"):

- **time**: a wall-clock timeout (the parent kills the process group) and ``RLIMIT_CPU`` (SIGXCPU,
  then SIGKILL one second later);
- **memory and disk**: ``RLIMIT_AS`` (address space; an allocation past it is a ``MemoryError``),
  ``RLIMIT_FSIZE`` on each written file (and so on the captured output), at most ``max_files`` opens
  for writing (so at most ``max_files * max_file_mb`` written), ``RLIMIT_NOFILE``, no core files;
- **its own directory**: a fresh temporary directory, the working directory and ``HOME``/``TMPDIR``,
  deleted afterwards; writing, creating, renaming or removing anything outside it is refused by an
  audit hook (``sys.addaudithook``, which Python code cannot remove) and recorded as a violation;
- **processes**: ``fork``, ``subprocess``, ``os.system``/``exec*``/``posix_spawn``, signals to other
  processes and ``ctypes`` are refused by the same hook; ``RLIMIT_NPROC`` is set too (the kernel does
  not apply it to root); the program runs in its own session and the whole process group is killed
  afterwards, and, where the platform allows (``unshare``), in its own PID namespace whose processes
  all die with it;
- **network**: in a fresh network namespace (``unshare --user --net``: no interface but an unconfigured
  loopback) where the platform allows; the hook also refuses creating sockets and name lookups, so
  without namespaces socket use is still refused at the Python level.

The program runs on the standard library only (``-I -S``: no site-packages, no environment).

What is *not* enforced: reading files outside the directory (the interpreter needs its standard
library); native code that bypasses the audit hook (extension modules already importable, other
than ``ctypes``/``_posixsubprocess`` which are refused); and the pass/fail report itself is written by
the harness in the same process as the program, tagged with a nonce the program is not given, which
stops printing a fake result but not a program that digs the nonce out of the harness's stack frames
(``sys._getframe`` cannot be refused: the standard library needs it; ``gc.get_objects`` is refused). A
verifier for adversarial policies should run this inside a container or VM as well.

A misbehaving program is never an exception here: the result has ``passed`` = 0 (or what passed before
the misbehaviour was seen, with a violation still making the reward 0) and a ``reason``.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

# Reasons, in the order a result's reason is chosen when several apply.
VIOLATIONS = ("forbidden_write", "disk_limit", "network", "fork", "subprocess", "ctypes", "signal", "forbidden")
REASONS = (
    "ok",
    "tests_failed",
    "no_tests",
    *VIOLATIONS,
    "memory",
    "timeout",
    "cpu_time",
    "output_limit",
    "program_error",
    "no_result",
    "killed",
    "sandbox_error",
)


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0
    cpu_s: int = 5
    memory_mb: int = 512
    max_file_mb: int = 16
    max_open_files: int = 64
    max_files: int = 32  # opens for writing; with max_file_mb, a bound on the bytes written
    max_processes: int = 1
    network_namespace: bool = True  # use unshare when the platform allows


@dataclass
class SandboxResult:
    passed: int
    total: int
    reason: str
    detail: str = ""
    wall_s: float = 0.0
    violations: list[str] = field(default_factory=list)

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0

    @property
    def all_passed(self) -> bool:
        return self.reason == "ok" and self.total > 0 and self.passed == self.total


# The harness runs in the sandboxed interpreter (python -I -S -c HARNESS): reads the nonce and the job
# from stdin, installs the audit hook, runs the program and each test in one namespace, writes
# NONCE + JSON to the result pipe.
HARNESS = r"""
def main():
    import sys, os, json
    nonce = sys.stdin.readline().strip()
    job = json.loads(sys.stdin.read())
    fd, root = job["result_fd"], os.path.realpath(job["root"])
    max_files, opened = job["max_files"], [0]
    violations = []
    block = {"os.fork": "fork", "os.forkpty": "fork", "os.system": "subprocess", "os.exec": "subprocess",
             "os.posix_spawn": "subprocess", "os.spawn": "subprocess", "subprocess.Popen": "subprocess",
             "pty.spawn": "subprocess", "os.kill": "signal", "os.killpg": "signal", "signal.pthread_kill": "signal",
             "socket.__new__": "network", "socket.connect": "network", "socket.bind": "network",
             "socket.sendto": "network", "socket.sendmsg": "network", "socket.getaddrinfo": "network",
             "socket.gethostbyname": "network", "socket.gethostbyaddr": "network", "socket.getnameinfo": "network",
             "ctypes.dlopen": "ctypes", "ctypes.dlsym": "ctypes", "ctypes.cdata": "ctypes",
             "resource.setrlimit": "forbidden", "resource.prlimit": "forbidden", "os.chroot": "forbidden",
             "os.setuid": "forbidden", "gc.get_objects": "forbidden", "gc.get_referrers": "forbidden",
             "gc.get_referents": "forbidden"}
    block_imports = {"ctypes": "ctypes", "_ctypes": "ctypes", "_posixsubprocess": "subprocess"}
    write_paths = {"os.remove": (0,), "os.rename": (0, 1), "os.replace": (0, 1), "os.rmdir": (0,), "os.mkdir": (0,),
                   "os.chmod": (0,), "os.chown": (0,), "os.symlink": (0, 1), "os.link": (0, 1), "os.truncate": (0,),
                   "os.utime": (0,), "shutil.rmtree": (0,), "os.mkfifo": (0,), "os.mknod": (0,),
                   "shutil.copyfile": (1,), "shutil.copytree": (1,), "shutil.move": (1,), "os.removexattr": (0,),
                   "os.setxattr": (0,)}
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    realpath, join, sep, getcwd, write = os.path.realpath, os.path.join, os.sep, os.getcwd, os.write
    dumps = json.dumps

    def inside(path):
        if isinstance(path, int):
            return True  # an fd already open: opening it was checked
        if isinstance(path, bytes):
            path = path.decode("utf-8", "surrogateescape")
        path = str(path)
        if path == "/dev/null":
            return True
        full = realpath(join(getcwd(), path))
        return full == root or full.startswith(root + sep)

    def refuse(kind, what):
        violations.append(kind + ": " + what)
        if len(violations) <= 8:  # said at once, so a program that catches the refusal and then hangs is still caught
            data = (nonce + dumps({"violation": kind + ": " + what[:200]}) + "\n").encode()
            while data:
                data = data[write(fd, data):]
        raise PermissionError("sandbox: " + kind + " refused (" + what + ")")

    def hook(event, args):
        kind = block.get(event)
        if kind is not None:
            refuse(kind, event)
        if event == "import" and args and args[0] in block_imports:
            refuse(block_imports[args[0]], "import " + args[0])
        elif event == "open":
            path, mode, flags = (list(args) + [None, None, None])[:3]
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (isinstance(flags, int) and flags & write_flags)
            if writing and not inside(path):
                refuse("forbidden_write", "open " + repr(path))
            if writing and not isinstance(path, int):
                opened[0] += 1
                if opened[0] > max_files:  # with RLIMIT_FSIZE per file, this bounds the bytes it can write
                    refuse("disk_limit", "more than %d files opened for writing" % max_files)
        elif event in write_paths:
            for i in write_paths[event]:
                if i < len(args) and args[i] is not None and not inside(args[i]):
                    refuse("forbidden_write", event + " " + repr(args[i]))

    def describe(exc):
        return type(exc).__name__ + ": " + str(exc)[:300]

    program, tests = job["program"], job["tests"]
    del job
    sys.addaudithook(hook)
    ns = {"__name__": "__main__", "__builtins__": __builtins__}
    program_error, memory, results = "", False, []
    try:
        exec(compile(program, "solution.py", "exec"), ns)
    except MemoryError as exc:
        program_error, memory = describe(exc), True
    except BaseException as exc:
        program_error = describe(exc)
    for i, test in enumerate(tests):
        if program_error:
            results.append(False)
            continue
        try:
            exec(compile(test, "test_%d.py" % i, "exec"), ns)
            results.append(True)
        except MemoryError:
            memory = True
            results.append(False)
        except BaseException:
            results.append(False)
    data = (nonce + dumps({"results": results, "program_error": program_error, "memory": memory,
                           "violations": list(violations)}) + "\n").encode()
    while data:
        data = data[write(fd, data):]

main()
"""


@functools.cache
def isolation_prefix() -> tuple[str, ...]:
    """The ``unshare`` command line that gives the program its own user, network and PID namespaces,
    or fewer, or none, whichever works here (probed once per process)."""
    exe = shutil.which("unshare")
    if exe is None:
        return ()
    for flags in (("--user", "--net", "--pid", "--fork", "--kill-child"), ("--user", "--net")):
        try:
            probe = subprocess.run([exe, *flags, "true"], capture_output=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            continue
        if probe.returncode == 0:
            return (exe, *flags)
    return ()


def _set_limits(limits: SandboxLimits) -> None:
    """In the child between fork and exec (``preexec_fn``)."""
    mem = limits.memory_mb << 20
    for which, value in (
        (resource.RLIMIT_AS, mem),
        (resource.RLIMIT_DATA, mem),
        (resource.RLIMIT_FSIZE, limits.max_file_mb << 20),
        (resource.RLIMIT_NOFILE, limits.max_open_files),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(which, (value, value))
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
    try:  # the kernel exempts root; for anyone else it caps forks whatever the audit hook misses
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_processes + 1, limits.max_processes + 1))
    except (ValueError, OSError):
        pass


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_program(program: str, tests: Sequence[str], limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run ``program`` then each of ``tests`` (Python statements, e.g. asserts) in one fresh sandboxed
    interpreter; a test passes when it runs without raising. Never raises for anything the program does."""
    tests = [str(t) for t in tests]
    if not tests:
        return SandboxResult(0, 0, "no_tests", "the row has no tests")
    start = time.monotonic()
    root = tempfile.mkdtemp(prefix="rollbook-sandbox-")
    nonce = secrets.token_hex(16)
    read_fd, write_fd = os.pipe()
    proc = None
    try:
        prefix = isolation_prefix() if limits.network_namespace else ()
        python = os.path.realpath(sys.executable)  # the base interpreter; -I -S: no site, no environment
        env = {"HOME": root, "TMPDIR": root, "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
        job = json.dumps({"program": program, "tests": tests, "root": root, "result_fd": write_fd, "max_files": limits.max_files})
        proc = subprocess.Popen(
            [*prefix, python, "-I", "-S", "-c", HARNESS],
            cwd=root,
            env=env,
            stdin=subprocess.PIPE,
            stdout=open(os.path.join(root, ".stdout"), "wb"),
            stderr=open(os.path.join(root, ".stderr"), "wb"),
            pass_fds=(write_fd,),
            start_new_session=True,
            preexec_fn=lambda: _set_limits(limits),
            close_fds=True,
        )
        os.close(write_fd)
        write_fd = -1
        assert proc.stdin is not None  # stdin=PIPE above
        try:
            proc.stdin.write((nonce + "\n" + job).encode())
            proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        timed_out, cpu_s = _wait(proc, start + limits.wall_s)
        os.set_blocking(read_fd, False)
        raw = b""
        try:
            while len(raw) < 1 << 20:
                chunk = os.read(read_fd, 65536)
                if not chunk:
                    break
                raw += chunk
        except BlockingIOError:
            pass
        stderr = _tail(os.path.join(root, ".stderr"))
        cpu_exceeded = cpu_s >= limits.cpu_s - 0.05
        return _verdict(raw, nonce, len(tests), proc.returncode, timed_out, cpu_exceeded, stderr, time.monotonic() - start)
    except Exception as exc:  # the sandbox itself failed (cannot start a process, ...): not the program's fault
        return SandboxResult(0, len(tests), "sandbox_error", f"{type(exc).__name__}: {exc}", time.monotonic() - start)
    finally:
        if proc is not None and proc.poll() is None:
            _kill_group(proc)
            proc.wait()
        for fd in (read_fd, write_fd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        shutil.rmtree(root, ignore_errors=True)


def _wait(proc: subprocess.Popen, deadline: float) -> tuple[bool, float]:
    """Wait for the child until ``deadline``, then kill its process group. Returns (timed out, CPU
    seconds of the child and the descendants it waited for: under ``unshare --fork`` the program)."""
    timed_out = False
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            timed_out = True
            _kill_group(proc)
            pid, status, usage = os.wait4(proc.pid, 0)
            break
        time.sleep(0.01)
    proc.returncode = os.waitstatus_to_exitcode(status)
    _kill_group(proc)  # whatever it left behind in its group
    return timed_out, usage.ru_utime + usage.ru_stime


def _tail(path: str, limit: int = 2000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - limit))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _verdict(
    raw: bytes, nonce: str, total: int, returncode: int, timed_out: bool, cpu_exceeded: bool, stderr: str, wall_s: float
) -> SandboxResult:
    report, said = None, []
    for line in raw.decode("utf-8", "replace").splitlines():
        if line.startswith(nonce):
            try:
                obj = json.loads(line[len(nonce) :])
            except ValueError:
                continue
            if "violation" in obj:
                said.append(str(obj["violation"]))
            else:
                report = obj
    if said and report is None:  # refused something, then never finished (caught the refusal and hung, ...)
        kind = said[0].split(":", 1)[0]
        return SandboxResult(0, total, kind if kind in VIOLATIONS else "forbidden", said[0][:300], wall_s, said)
    if report is None:  # the harness did not finish: why?
        if cpu_exceeded or returncode == -signal.SIGXCPU:
            reason, detail = "cpu_time", "CPU time limit"
        elif timed_out:
            reason, detail = "timeout", "wall-clock timeout"
        elif "MemoryError" in stderr or "Cannot allocate memory" in stderr:
            reason, detail = "memory", "memory limit"
        elif returncode == -signal.SIGXFSZ or "File too large" in stderr:
            reason, detail = "output_limit", "file size limit"
        elif "sandbox:" in stderr:
            kind = stderr.split("sandbox:", 1)[1].split()[0]
            reason, detail = (kind if kind in VIOLATIONS else "forbidden"), stderr.strip().splitlines()[-1][:300]
        else:
            reason, detail = (
                ("killed" if returncode == -signal.SIGKILL else "no_result"),
                f"exit status {returncode}; " + (stderr.strip().splitlines() or [""])[-1][:300],
            )
        return SandboxResult(0, total, reason, detail, wall_s)
    results = [bool(r) for r in report.get("results", [])][:total]
    passed = sum(results)
    violations = [str(v) for v in report.get("violations", [])]
    if violations:
        kind = violations[0].split(":", 1)[0]
        return SandboxResult(passed, total, kind if kind in VIOLATIONS else "forbidden", violations[0][:300], wall_s, violations)
    if report.get("memory"):
        return SandboxResult(passed, total, "memory", report.get("program_error") or "MemoryError in a test", wall_s)
    if "File too large" in report.get("program_error", ""):
        return SandboxResult(0, total, "output_limit", report["program_error"], wall_s)
    if report.get("program_error"):
        return SandboxResult(0, total, "program_error", report["program_error"], wall_s)
    if passed == total:
        return SandboxResult(passed, total, "ok", "", wall_s)
    return SandboxResult(passed, total, "tests_failed", f"{total - passed} of {total} tests failed", wall_s)


def extract_program(completion: str) -> str:
    """The code of a completion: the last fenced block (```python ... ``` or ``` ... ```) when there is
    one, else the whole text."""
    if "```" not in completion:
        return completion
    parts = completion.split("```")
    blocks = [parts[i] for i in range(1, len(parts), 2)]
    if not blocks:
        return completion
    block = blocks[-1]
    first, _, rest = block.partition("\n")
    return rest if first.strip().isidentifier() or not first.strip() else block
