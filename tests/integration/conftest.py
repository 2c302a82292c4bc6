"""Shared helpers for the store's integration tests: a real ``rollbook serve`` process on a real
DuckDB file, trajectory builders, and a ``rollbook`` CLI runner.

Every store here is ``python -m rollbook.cli serve --db FILE --port 0`` in its own process; tests
talk to it through the generated stubs or ``rollbook.client.StoreClient``. Nothing is mocked.

Run: ``python -m pytest tests/integration -q``.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from rollbook.client import StoreClient
from rollbook.v1 import rollbook_pb2 as pb
from rollbook.v1 import rollbook_pb2_grpc as pb_grpc

MODEL = "tiny"
VOCAB = 512
START_TIMEOUT_S = 60.0


def clean_env(**extra: str) -> dict[str, str]:
    """The environment for child processes: no ROLLBOOK_* settings leak in from the caller."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLBOOK_")}
    env.update(extra)
    return env


class StoreProcess:
    """One ``rollbook serve`` child. ``address`` is HOST:PORT from its first stdout line; stderr goes
    to ``LOG`` beside the database so a failing test can show it."""

    def __init__(
        self,
        db: pathlib.Path,
        *,
        port: int = 0,
        env: dict[str, str] | None = None,
        admin_key: str | None = None,
        trainer_key: str | None = None,
        worker_key: str | None = None,
        reader_key: str | None = None,
        args: tuple[str, ...] = (),
        client_tls: Any = None,
    ):
        self.db = pathlib.Path(db)
        self.admin_key, self.trainer_key = admin_key, trainer_key
        self.keys = {"worker_key": worker_key, "trainer_key": trainer_key, "reader_key": reader_key, "admin_key": admin_key}
        self.client_tls = client_tls  # rollbook.tls.ClientTLS for a store started with --tls-cert
        env = dict(env if env is not None else clean_env())
        env.update({f"ROLLBOOK_{name.upper()}": key for name, key in self.keys.items() if key})
        self.log_path = self.db.with_name(self.db.name + f".serve-{time.monotonic_ns()}.log")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "rollbook.cli",
                    "serve",
                    "--db",
                    str(db),
                    "--port",
                    str(port),
                    "--log-level",
                    "WARNING",
                    *args,
                ],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=env,
            )
        line = _readline(self.proc, START_TIMEOUT_S)
        if not line.startswith("listening on "):
            self.kill()
            raise RuntimeError(f"store did not start (exit {self.proc.returncode}): {line!r}\n{self.log()}")
        self.address = line.removeprefix("listening on ").strip()
        self.port = int(self.address.rsplit(":", 1)[1])

    def client(self, **kwargs: Any) -> StoreClient:
        """A client holding every key the store was started with (and its TLS settings)."""
        given = {k: v for k, v in {**self.keys, "tls": self.client_tls}.items() if v is not None}
        return StoreClient(self.address, **{**given, **kwargs})

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait: the graceful path (drain, fold, close)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"store ignored SIGTERM for {timeout} s\n{self.log()}") from None

    def kill(self) -> None:
        """SIGKILL: nothing is drained, folded or closed."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=60)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return out[0] if out else ""


def start_store(db: pathlib.Path, *, port: int = 0, attempts: int = 10, **kwargs: Any) -> StoreProcess:
    """Start a store; on a fixed port retry a few times in case the port is briefly busy."""
    for attempt in range(attempts):
        try:
            return StoreProcess(db, port=port, **kwargs)
        except RuntimeError:
            if port == 0 or attempt == attempts - 1:
                raise
            time.sleep(0.5)
    raise AssertionError("unreachable")


@pytest.fixture
def stores() -> Iterator[list[StoreProcess]]:
    """Append every store a test starts; whatever is still running at teardown is killed."""
    started: list[StoreProcess] = []
    yield started
    for store in started:
        store.kill()


def traj(tid: str, *, n: int = 16, version: int = 0, model_id: str = MODEL, **fields: Any) -> dict:
    """A valid trajectory as a dict (``StoreClient.submit`` takes dicts); ``fields`` override."""
    t = {
        "trajectory_id": tid,
        "session_id": f"s-{tid}",
        "group_id": f"g-{tid}",
        "group_size": 1,
        "request_id": f"r-{tid}",
        "consumed": True,
        "task_id": "task",
        "domain": "arithmetic",
        "model_id": model_id,
        "prompt_token_ids": [1, 2, 3],
        "output_token_ids": [(7 * i + 5) % VOCAB for i in range(n)],
        "output_logprobs": [-0.25] * n,
        "output_versions": [version] * n,
        "temperature": 1.0,
        "top_p": 1.0,
        "finish_reason": "stop",
        "reward": 1.0,
        "worker_id": "w0",
        "created_at": 1.0,
    }
    t.update(fields)
    return t


def register(client: StoreClient, versions: tuple[int, ...] = (0, 1)) -> None:
    client.register_model(MODEL, vocab_size=VOCAB)
    for v in versions:
        client.publish_version(MODEL, v, checksum=f"sha-{v}")


def submit_raw(stub: pb_grpc.TrajectoryStoreStub, *batches: list[dict]) -> list[list[pb.Verdict]]:
    """One Submit stream through the generated stub; the verdict lists, one per batch, in order."""
    from rollbook.trajectories import trajectory_from_dict

    requests = [pb.SubmitRequest(trajectories=[trajectory_from_dict(t) for t in b]) for b in batches]
    return [list(r.verdicts) for r in stub.Submit(iter(requests), timeout=60)]


def rows(client: StoreClient, sql: str) -> list[dict]:
    return client.query(sql).to_pylist()


def count(client: StoreClient, table: str, where: str = "TRUE") -> int:
    return rows(client, f"SELECT count(*) AS n FROM {table} WHERE {where}")[0]["n"]


def rollbook_cli(*args: str, timeout: float = 120.0, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``rollbook ARGS`` as its own process (``python -m rollbook.cli``)."""
    return subprocess.run(
        [sys.executable, "-m", "rollbook.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env if env is not None else clean_env(),
    )


def query_file(db: pathlib.Path, sql: str) -> list[dict]:
    """``rollbook query --db FILE --format json SQL`` (the server must be down); rows as dicts."""
    done = rollbook_cli("query", "--db", str(db), "--format", "json", sql)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def rpc_error(call) -> grpc.RpcError:
    try:
        call()
    except grpc.RpcError as exc:
        return exc
    raise AssertionError("the call succeeded; expected an RPC error")
