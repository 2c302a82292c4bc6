"""Streams that cannot starve the store, against real ``rollbook serve`` processes.

With 200 idle Submit streams open (and a few dozen slow ones sending a batch now and then), a normal
client's Submit, PullBatch, Query and GetStats still succeed; a stream idle past
``--stream-idle-timeout`` is closed with DEADLINE_EXCEEDED; one client host cannot open more Submit
streams than ``--max-submit-streams-per-host``.
"""

from __future__ import annotations

import asyncio
import threading
import time

import grpc

from rollbook.trajectories import trajectory_from_dict
from rollbook.v1 import rollbook_pb2 as pb
from rollbook.v1 import rollbook_pb2_grpc as pb_grpc
from tests.integration.conftest import count, register, start_store, traj


class StreamCrowd:
    """Submit streams held open from one asyncio loop on its own thread: ``idle`` of them never send;
    ``slow`` of them send one single-trajectory batch every ``period_s`` until closed."""

    def __init__(self, address: str, *, idle: int, slow: int = 0, period_s: float = 0.5, channels: int = 4, metadata=()):
        self.address, self.idle, self.slow, self.period_s = address, idle, slow, period_s
        self.channels, self.metadata = channels, list(metadata)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.stop = None
        self.slow_verdicts: list[int] = []  # ACCEPTED count per slow stream
        self.errors: list[str] = []
        self.calls = []
        self._run(self._open())

    def _run(self, coro, timeout=120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _open(self):
        self.stop = asyncio.Event()
        # a local subchannel pool each: separate connections (channels to one target share one by default)
        self.chans = [
            grpc.aio.insecure_channel(self.address, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(self.channels)
        ]
        stubs = [pb_grpc.TrajectoryStoreStub(c) for c in self.chans]
        for i in range(self.idle):
            call = stubs[i % self.channels].Submit(metadata=self.metadata)
            self.calls.append(call)
        for call in self.calls:
            await call.wait_for_connection()
        self.slow_tasks = [asyncio.ensure_future(self._slow(stubs[i % self.channels], i)) for i in range(self.slow)]
        await asyncio.sleep(0.5)

    async def _slow(self, stub, i: int):
        call = stub.Submit(metadata=self.metadata)
        accepted, n = 0, 0
        try:
            while not self.stop.is_set():
                t = trajectory_from_dict(traj(f"slow-{i}-{n}"))
                await call.write(pb.SubmitRequest(trajectories=[t]))
                response = await call.read()
                accepted += sum(v.status == pb.Verdict.ACCEPTED for v in response.verdicts)
                n += 1
                try:
                    await asyncio.wait_for(self.stop.wait(), self.period_s)
                except TimeoutError:
                    pass
            await call.done_writing()
            await call.read()
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.errors.append(f"slow stream {i}: {exc!r}")
        self.slow_verdicts.append(accepted)

    def idle_codes(self) -> list[grpc.StatusCode | None]:
        """The status of every idle stream that ended (None while it is still open)."""
        return self._run(self._codes())

    async def _codes(self):
        return [(await c.code()) if c.done() else None for c in self.calls]

    def close(self) -> None:
        async def close():
            self.stop.set()
            await asyncio.gather(*self.slow_tasks, return_exceptions=True)
            for c in self.calls:
                c.cancel()
            for ch in self.chans:
                await ch.close()

        self._run(close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def test_200_idle_streams_and_30_slow_ones_do_not_starve_a_normal_client(tmp_path, capsys):
    store = start_store(tmp_path / "rollbook.duckdb")
    try:
        with store.client(timeout_s=30) as client:
            register(client)
            client.submit([traj(f"warm-{i}") for i in range(64)])
            rss_start = _rss_mb(store.proc.pid)
            crowd = StreamCrowd(store.address, idle=200, slow=30)
            rss_open = _rss_mb(store.proc.pid)
            try:
                t0 = time.monotonic()
                result = client.submit([traj(f"normal-{i}", reward=1.0) for i in range(64)], batch_size=16, retry_deadline_s=30)
                assert result.accepted == 64
                batch = client.pull_batch(trainer_id="normal", trainer_version=0, max_staleness=1, num_samples=8, model_id="tiny")
                assert batch.num_rows == 8
                assert client.ack_batch(batch.lease_id, trainer_id="normal") == 8
                assert count(client, "trajectories", "trajectory_id LIKE 'normal-%'") == 64
                assert client.stats().accepted >= 64
                took = time.monotonic() - t0
                assert [c for c in crowd.idle_codes() if c is not None] == []  # none of them was dropped meanwhile
            finally:
                crowd.close()
            assert not crowd.errors, crowd.errors[:3]
            assert len(crowd.slow_verdicts) == 30 and min(crowd.slow_verdicts) >= 1
            slow_rows = count(client, "trajectories", "trajectory_id LIKE 'slow-%'")
            assert slow_rows == sum(crowd.slow_verdicts)
        assert store.alive
        time.sleep(1.0)
        rss_end = _rss_mb(store.proc.pid)
        with capsys.disabled():
            print(
                f"\nnormal client beside 200 idle + 30 slow Submit streams: submit, pull, ack, query, stats in "
                f"{took:.2f} s; server RSS {rss_start:.0f} MB before, {rss_open:.0f} MB with the streams open, "
                f"{rss_end:.0f} MB after"
            )
        assert rss_end < rss_start + 150
    finally:
        store.kill()


def test_an_idle_stream_is_closed_after_the_idle_timeout(tmp_path):
    store = start_store(tmp_path / "rollbook.duckdb", args=("--stream-idle-timeout", "1.5"))
    try:
        with grpc.insecure_channel(store.address) as channel:
            stub = pb_grpc.TrajectoryStoreStub(channel)
            gate = threading.Event()

            def idle_requests():
                gate.wait(60)
                return
                yield  # pragma: no cover

            err = None
            try:
                list(stub.Submit(idle_requests(), timeout=60))
            except grpc.RpcError as exc:
                err = exc
            gate.set()
            assert err is not None and err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "idle" in err.details()
        with store.client() as client:  # a client that sends keeps working
            register(client)
            assert client.submit([traj("after-idle")]).accepted == 1
    finally:
        store.kill()


def test_one_host_cannot_hold_more_submit_streams_than_its_limit(tmp_path):
    store = start_store(tmp_path / "rollbook.duckdb", args=("--max-submit-streams-per-host", "5"))
    try:
        crowd = StreamCrowd(store.address, idle=5, channels=1)
        try:
            with grpc.insecure_channel(store.address) as channel:
                stub = pb_grpc.TrajectoryStoreStub(channel)
                t = trajectory_from_dict(traj("over-limit"))
                try:
                    list(stub.Submit(iter([pb.SubmitRequest(trajectories=[t])]), timeout=30))
                    raise AssertionError("the sixth stream was served")
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert "limit of 5 open Submit streams" in exc.details()
            with store.client() as client:  # unary RPCs are not streams: still served
                assert client.stats().accepted == 0
        finally:
            crowd.close()
        with store.client() as client:  # the crowd gone, Submit is served again
            register(client)
            assert client.submit([traj("after-crowd")], retry_deadline_s=30).accepted == 1
    finally:
        store.kill()
