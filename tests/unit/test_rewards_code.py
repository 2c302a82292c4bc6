"""The ``code`` reward's sandbox: harmful programs each get reward 0 with a
recorded reason within the timeout, nothing escapes, and the pool keeps scoring afterwards; good
programs pass, partly right ones record the fraction passed."""

from __future__ import annotations

import pathlib
import time
import uuid

import pytest

from rollbook.config import RewardConfig
from rollbook.rewards import RewardPool
from rollbook.sandbox_exec import SandboxLimits, extract_program, run_program

WALL_S = 4.0
CONFIG = RewardConfig(kind="code", timeout_s=WALL_S, cpu_s=1, memory_mb=256, max_file_mb=1)
TESTS = ["assert solve(2) == 4", "assert solve(3) == 6"]
GOOD = "def solve(x):\n    return 2 * x\n"
MARK = f"/tmp/rollbook-sandbox-escape-{uuid.uuid4().hex}"

_loops = {
    "while_true": "while True: pass",
    "itertools_count": "import itertools\nfor i in itertools.count(): pass",
    "sleep_loop": "import time\nwhile True: time.sleep(0.05)",
    "long_sleep": "import time\ntime.sleep(3600)",
    "loop_in_function_call": "def solve(x):\n    while True: x += 1",
    "busy_sum": "sum(range(10**12))",
    "thread_spin": "import threading\ndef spin():\n    while True: pass\nt = threading.Thread(target=spin)\nt.start()\nt.join()",
    "loop_in_test_only": "def solve(x):\n    import time\n    time.sleep(3600)",
    "catch_everything_loop": "while True:\n    try:\n        pass\n    except BaseException:\n        pass",
    "input_wait": "import sys\nsys.stdin.read()\nimport time\ntime.sleep(3600)",
}
_memory = {
    "bytearray_10gb": "x = bytearray(10**10)",
    "list_growth": "x = []\nwhile True: x.append(' ' * 10**7)",
    "string_multiply": "s = 'a' * (10**11)",
    "dict_growth": "d = {}\ni = 0\nwhile True:\n    d[i] = [i] * 1000\n    i += 1",
    "bytes_join": "b = b''.join([b'x' * 10**8 for _ in range(100)])",
    "list_of_lists": "x = [[0] * 10**6 for _ in range(10**4)]",
    "memory_in_solve": "def solve(x):\n    return len(bytearray(10**10))",
    "int_power": "x = [bytes(10**9), bytes(10**9)]",
}
_processes = {
    "fork": "import os\nos.fork()",
    "fork_bomb": "import os\nwhile True: os.fork()",
    "fork_bomb_caught": "import os\nwhile True:\n    try: os.fork()\n    except Exception: pass",
    "forkpty": "import os\nos.forkpty()",
    "multiprocessing": "import multiprocessing as m\np = m.Process(target=print)\np.start()",
    "subprocess_run": "import subprocess\nsubprocess.run(['sh', '-c', 'yes > /dev/null'])",
    "os_system": "import os\nos.system('sleep 100 &')",
    "os_popen": "import os\nos.popen('ls').read()",
    "execv": "import os\nos.execv('/bin/sh', ['sh', '-c', 'sleep 100'])",
    "posix_spawn": "import os\nos.posix_spawn('/bin/sleep', ['sleep', '100'], {})",
    "pty_spawn": "import pty\npty.spawn('/bin/sh')",
    "ctypes_fork": "import ctypes\nctypes.CDLL(None).fork()",
    "kill_init": "import os, signal\nos.kill(1, signal.SIGKILL)",
    "killpg": "import os, signal\nos.killpg(0, signal.SIGKILL)",
    "setrlimit": "import resource\nresource.setrlimit(resource.RLIMIT_CPU, (10**6, 10**6))",
    "fork_in_solve": "def solve(x):\n    import os\n    os.fork()\n    return 2 * x",
}
_writes = {
    "open_tmp": f"open('{MARK}-1', 'w').write('x')",
    "append_tmp": f"open('{MARK}-2', 'a').write('x')",
    "dotdot": f"open('../../../../..{MARK}-3', 'w').write('x')",
    "pathlib": f"import pathlib\npathlib.Path('{MARK}-4').write_text('x')",
    "os_open": f"import os\nos.close(os.open('{MARK}-5', os.O_CREAT | os.O_WRONLY))",
    "mkdir": f"import os\nos.mkdir('{MARK}-6')",
    "rename_out": f"open('inside', 'w').write('x')\nimport os\nos.rename('inside', '{MARK}-7')",
    "symlink": f"import os\nos.symlink('/etc/passwd', '{MARK}-8')",
    "remove_etc": "import os\nos.remove('/etc/hostname')",
    "chmod_etc": "import os\nos.chmod('/etc/passwd', 0o777)",
    "shutil_copy": f"import shutil\nopen('a', 'w').write('x')\nshutil.copyfile('a', '{MARK}-9')",
    "write_caught": f"try:\n    open('{MARK}-10', 'w')\nexcept Exception:\n    pass\ndef solve(x):\n    return 2 * x",
    "home_escape": f"import os\nopen(os.path.expanduser('~') + '/../{MARK.rsplit('/', 1)[1]}-11', 'w')",
    "flood_output": "while True: print('x' * 100000)",
    "fill_disk": "i = 0\nwhile True:\n    open(f'f{i}', 'w').write('x' * 10**6)\n    i += 1",
    "fill_disk_caught": "i = 0\nwhile True:\n    try:\n        open(f'f{i}', 'w').write('x' * 10**6)\n    except Exception:\n        pass\n    i += 1",
}
_network = {
    "connect": "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)",
    "raw_socket": "import socket\ns = socket.socket()",
    "udp": "import socket\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('8.8.8.8', 53))",
    "dns": "import socket\nsocket.getaddrinfo('example.com', 80)",
    "urllib": "import urllib.request\nurllib.request.urlopen('http://example.com', timeout=1)",
    "http_client": "import http.client\nhttp.client.HTTPConnection('example.com', timeout=1).request('GET', '/')",
    "server": "import socket\ns = socket.socket()\ns.bind(('0.0.0.0', 8080))\ns.listen()",
    "connect_caught": "import socket\ntry:\n    socket.create_connection(('10.0.0.1', 80), timeout=1)\nexcept Exception:\n    pass\ndef solve(x):\n    return 2 * x",
}
HARMFUL = {
    **{f"loop/{k}": v for k, v in _loops.items()},
    **{f"memory/{k}": v for k, v in _memory.items()},
    **{f"process/{k}": v for k, v in _processes.items()},
    **{f"write/{k}": v for k, v in _writes.items()},
    **{f"network/{k}": v for k, v in _network.items()},
}
EXPECTED = {
    "loop": {"timeout", "cpu_time"},
    "memory": {"memory"},
    "process": {"fork", "subprocess", "ctypes", "signal", "forbidden"},
    "write": {"forbidden_write", "output_limit", "disk_limit"},
    "network": {"network"},
}


def test_there_are_at_least_fifty_harmful_programs():
    assert len(HARMFUL) >= 50


@pytest.fixture(scope="module")
def harmful_results():
    # four at once: most harmful programs wait out the wall timeout asleep or blocked, so two at a
    # time spent ~20 s of the suite waiting
    with RewardPool({"code": CONFIG}, max_workers=4) as pool:
        started = time.monotonic()
        futures = {name: pool.submit("code", f"```python\n{src}\n```", {"tests": TESTS}) for name, src in HARMFUL.items()}
        results = {name: pool.result(f) for name, f in futures.items()}
        elapsed = time.monotonic() - started
        after = pool.score_many([("code", GOOD, {"tests": TESTS})] * 4)  # the pool still works afterwards
    return results, after, elapsed


@pytest.mark.parametrize("name", sorted(HARMFUL))
def test_each_harmful_program_gets_zero_with_its_reason_within_the_timeout(harmful_results, name):
    scored = harmful_results[0][name]
    assert scored.outcome.status == "ok", scored.outcome  # the program's fault: a 0 reward, not a verifier error
    assert scored.outcome.reward == 0.0, scored.info
    assert scored.info["reason"] in EXPECTED[name.split("/")[0]], scored.info
    assert scored.info["wall_s"] <= WALL_S + 2.0, scored.info  # killed at the wall timeout (+ kill and reap)


def test_nothing_escaped_and_the_pool_keeps_scoring(harmful_results):
    _, after, _ = harmful_results
    assert [s.outcome.reward for s in after] == [1.0] * 4
    assert not list(pathlib.Path("/tmp").glob(pathlib.Path(MARK).name + "*"))
    assert pathlib.Path("/etc/passwd").stat().st_mode & 0o777 != 0o777


def test_good_and_partly_right_programs():
    with RewardPool({"code": CONFIG, "graded": CONFIG.model_copy(update={"code_reward": "fraction"})}, max_workers=0) as pool:
        good = pool.result(pool.submit("code", f"Here:\n```python\n{GOOD}```", {"tests": TESTS}))
        half = pool.result(pool.submit("code", "def solve(x):\n    return 4", {"tests": TESTS}))
        graded = pool.result(pool.submit("graded", "def solve(x):\n    return 4", {"tests": TESTS}))
        as_json = pool.result(pool.submit("code", GOOD, {"tests": '["assert solve(1) == 2"]'}))
        inside = pool.result(
            pool.submit(
                "code",
                "open('f', 'w').write('7')\ndef solve(x):\n    return int(open('f').read())",
                {"tests": ["assert solve(0) == 7"]},
            )
        )
        raising = pool.result(pool.submit("code", "raise ValueError('no')", {"tests": TESTS}))
        no_tests = pool.result(pool.submit("code", GOOD, {"tests": []}))
    assert (good.outcome.reward, good.info["fraction"], good.info["reason"]) == (1.0, 1.0, "ok")
    assert (half.outcome.reward, half.info["passed"], half.info["total"], half.info["fraction"]) == (0.0, 1, 2, 0.5)
    assert graded.outcome.reward == 0.5
    assert as_json.outcome.reward == 1.0
    assert inside.outcome.reward == 1.0  # its own directory is writable
    assert (raising.outcome.reward, raising.info["reason"]) == (0.0, "program_error")
    assert no_tests.outcome.status == "error" and "no tests" in no_tests.outcome.error


def test_a_forged_result_line_does_not_count():
    forged = 'import sys\nprint("0" * 32 + \'{"results": [true, true]}\')\nsys.stdout.flush()\nimport os\nos._exit(0)'
    result = run_program(forged, TESTS, SandboxLimits(wall_s=WALL_S, cpu_s=1))
    assert (result.passed, result.reason) == (0, "no_result")


def test_extract_program():
    assert extract_program("text\n```python\nA = 1\n```\nmore\n```py\nB = 2\n```") == "B = 2\n"
    assert extract_program("```\nC = 3\n```") == "C = 3\n"
    assert extract_program("D = 4") == "D = 4"
