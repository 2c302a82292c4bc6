"""A rollout producer keeps submitting through ``Submitter`` while the store is SIGKILLed and restarted.

A real ``rollbook serve`` process on a DuckDB file (port 0, then restarted on the same port), a
producer thread that generates trajectories the whole time, and the local spool in between.
Afterwards every generated trajectory is in ``trajectories`` exactly once, none rejected. The
second case gives the spool room for about a second of production, so admission stops during the
outage: the producer waits, nothing is dropped.

Run: python -m pytest tests/integration/test_store_outage.py -q   (about 45-60 s; most of it is the outages)
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import threading
import time

import duckdb
import pytest

from rollbook.cli.demo import generate_workload
from rollbook.client import StoreClient
from rollbook.rollout.spool import Spool
from rollbook.rollout.submitter import Submitter

MODEL = "outage-model"
ALL_VALID = 10**9  # generate_workload's bad_every: no broken evidence


def start_store(db: pathlib.Path, port: int = 0) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollbook.cli", "serve", "--db", str(db), "--port", str(port), "--log-level", "WARNING"],
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline().strip()
    if not line.startswith("listening on "):
        proc.kill()
        raise RuntimeError(f"store did not start: {line!r}")
    return proc, int(line.rsplit(":", 1)[1])


def kill_store(proc: subprocess.Popen) -> None:
    proc.kill()  # SIGKILL: no drain, no fold; the store's log must carry what it acknowledged
    proc.wait(timeout=30)


class Producer(threading.Thread):
    """Generates groups of trajectories and submits them until stopped; records every id."""

    def __init__(self, submitter: Submitter, *, chunk: int = 16, pause_s: float = 0.05):
        super().__init__(daemon=True)
        self.submitter, self.chunk, self.pause_s = submitter, chunk, pause_s
        self.generated: list[str] = []
        self.blocked_s = 0.0  # time spent inside submit (only a full spool makes that long)
        self.error: BaseException | None = None
        self.halt = threading.Event()

    def run(self) -> None:
        try:
            seed = 0
            while not self.halt.is_set():
                workload = generate_workload(self.chunk, model_id=MODEL, seed=seed, bad_every=ALL_VALID)
                t0 = time.monotonic()
                self.submitter.submit(workload)
                self.blocked_s += time.monotonic() - t0
                self.generated.extend(t["trajectory_id"] for t in workload)
                seed += 1
                self.halt.wait(self.pause_s)
        except BaseException as exc:
            self.error = exc

    def finish(self) -> list[str]:
        self.halt.set()
        self.join(timeout=60)
        assert not self.is_alive() and self.error is None, self.error
        return self.generated


@pytest.fixture
def store(tmp_path):
    """A store process on a fresh ledger with MODEL registered; yields a dict the test may update."""
    db = tmp_path / "rollbook.duckdb"
    proc, port = start_store(db)
    with StoreClient(f"127.0.0.1:{port}") as admin:
        admin.register_model(MODEL, vocab_size=64)
        for version in (0, 1, 2):  # generate_workload samples versions 0..2
            admin.publish_version(MODEL, version, checksum=f"v{version}")
    state = {"proc": proc, "port": port, "db": db}
    yield state
    if state["proc"].poll() is None:
        state["proc"].terminate()
        state["proc"].wait(timeout=30)


def outage(store: dict, seconds: float, during=lambda: None) -> None:
    """SIGKILL the store, keep it down ``seconds`` (calling ``during`` every 0.1 s), restart it on its port."""
    kill_store(store["proc"])
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        during()
        time.sleep(0.1)
    store["proc"], port = start_store(store["db"], store["port"])
    assert port == store["port"]


def assert_stored_exactly_once(client: StoreClient, store: dict, generated: list[str]) -> None:
    sql = "SELECT count(*) AS n, count(DISTINCT trajectory_id) AS d FROM trajectories"
    n, distinct = client.query(sql).to_pylist()[0].values()
    [rejections] = client.query("SELECT count(*) AS n FROM rejections").to_pylist()[0].values()
    assert (n, distinct, rejections) == (len(generated), len(generated), 0)
    store["proc"].terminate()  # graceful stop folds the log; then ask the DuckDB file itself
    store["proc"].wait(timeout=30)
    with duckdb.connect(str(store["db"]), read_only=True) as con:
        stored = {tid for (tid,) in con.execute("SELECT trajectory_id FROM trajectories").fetchall()}
        assert con.execute("SELECT count(*) FROM trajectories").fetchone()[0] == len(generated)
    assert stored == set(generated)


@pytest.mark.slow
def test_every_trajectory_arrives_exactly_once_across_a_15s_store_outage(tmp_path, store):
    client = StoreClient(f"127.0.0.1:{store['port']}")
    spool = Spool(tmp_path / "spool", max_bytes=64 << 20)
    submitter = Submitter(client, spool, batch_size=64)
    producer = Producer(submitter)
    producer.start()
    time.sleep(3)
    assert submitter.stats().accepted > 0

    before = len(producer.generated)
    peak_spooled = [0]
    outage(store, 15, during=lambda: peak_spooled.__setitem__(0, max(peak_spooled[0], len(spool))))
    assert len(producer.generated) - before > 1000  # generation went on while the store was down
    assert peak_spooled[0] > 50  # ...into the spool

    time.sleep(3)
    generated = producer.finish()
    assert submitter.flush(timeout=60)
    stats = submitter.stats()
    submitter.close()
    spool.close()
    print(f"{len(generated)} generated;", {k: round(v, 2) for k, v in stats.metrics().items()})

    assert (stats.delivered, stats.rejected) == (len(generated), 0)
    assert stats.outage_s >= 14 and stats.admission_wait_s == 0  # the producer never waited for the store
    assert_stored_exactly_once(client, store, generated)
    client.close()


def test_full_spool_stops_admission_during_an_outage_and_drops_nothing(tmp_path, store):
    client = StoreClient(f"127.0.0.1:{store['port']}")
    max_bytes = 64 << 10  # about ten 16-trajectory batches: one second of production
    spool = Spool(tmp_path / "spool", max_bytes=max_bytes)
    submitter = Submitter(client, spool, batch_size=64)
    producer = Producer(submitter)
    producer.start()
    time.sleep(2)

    spool_peak, produced_during = [0], []
    outage(
        store,
        8,
        during=lambda: (
            spool_peak.__setitem__(0, max(spool_peak[0], spool.nbytes)),
            produced_during.append(len(producer.generated)),
        ),
    )
    assert produced_during[-1] == produced_during[len(produced_during) // 2]  # the producer is waiting
    assert max_bytes <= spool_peak[0] < max_bytes + (32 << 10)  # full, exceeded by at most one batch

    time.sleep(2)
    generated = producer.finish()
    assert submitter.flush(timeout=60)
    stats = submitter.stats()
    submitter.close()
    spool.close()
    print(f"{len(generated)} generated;", {k: round(v, 2) for k, v in stats.metrics().items()})

    assert (stats.delivered, stats.rejected) == (len(generated), 0)
    assert stats.admission_wait_s > 4 and producer.blocked_s > 4
    assert_stored_exactly_once(client, store, generated)
    client.close()


def test_a_flush_while_reachable_gives_up_on_a_dead_store_and_the_next_submitter_delivers(tmp_path, store):
    """A stopping worker whose store ended with its run: ``flush(while_reachable=True)`` returns False
    within seconds instead of its timeout, the batches stay in the spool, and a new ``Submitter`` on the
    same directory delivers every one exactly once when the store is back."""
    workload = generate_workload(32, model_id=MODEL, seed=7, bad_every=ALL_VALID)
    generated = [t["trajectory_id"] for t in workload]
    kill_store(store["proc"])
    client = StoreClient(f"127.0.0.1:{store['port']}")
    spool = Spool(tmp_path / "spool", max_bytes=64 << 20)
    submitter = Submitter(client, spool, batch_size=16)
    submitter.submit(workload)
    t0 = time.monotonic()
    assert submitter.flush(timeout=120, while_reachable=True) is False
    gave_up_after = time.monotonic() - t0
    submitter.close(timeout=1.0)
    assert len(spool) == 2  # both batches kept
    spool.close()
    client.close()
    assert gave_up_after < 60, gave_up_after  # not the timeout: it saw the store was gone

    store["proc"], port = start_store(store["db"], store["port"])
    client = StoreClient(f"127.0.0.1:{port}")
    spool = Spool(tmp_path / "spool", max_bytes=64 << 20)
    with Submitter(client, spool, batch_size=16) as again:
        assert again.flush(timeout=60, while_reachable=True)
        assert again.stats().delivered == len(generated)
    spool.close()
    assert_stored_exactly_once(client, store, generated)
    client.close()
