"""The durable spool (rollbook.rollout.spool) and the Submitter that drains it (rollbook.rollout.submitter).

The Submitter runs against ``FakeStore``: an in-memory store with the idempotency rule of the real
one, which can fail calls or lose the verdicts of a call it committed. Its ``channel`` is a real
gRPC channel to an empty in-process server, so the Submitter's readiness check is the real one.
The real store, killed and restarted, is in tests/integration/test_store_outage.py.

Run: python -m pytest tests/unit/rollout/test_spool.py -q
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from rollbook.client import SubmitResult
from rollbook.rollout.spool import Spool, SpoolFull
from rollbook.rollout.submitter import Submitter, SubmitterFailed
from rollbook.v1 import rollbook_pb2 as pb


def traj(tid: str, num_tokens: int = 4) -> pb.Trajectory:
    return pb.Trajectory(trajectory_id=tid, model_id="m", output_token_ids=list(range(num_tokens)))


def batch(prefix: str, n: int = 3, num_tokens: int = 4) -> list[pb.Trajectory]:
    return [traj(f"{prefix}-{i}", num_tokens) for i in range(n)]


def ids(request: pb.SubmitRequest) -> list[str]:
    return [t.trajectory_id for t in request.trajectories]


def batch_files(spool: Spool) -> list:
    return sorted(spool.directory.glob("*.batch"))


# ---- Spool ----------------------------------------------------------------------------------------


def test_batches_come_out_in_order_with_their_contents(tmp_path):
    with Spool(tmp_path, max_bytes=1 << 20) as spool:
        seqs = [spool.put(batch(name)) for name in ("a", "b", "c")]
        assert seqs == sorted(seqs) and len(spool) == 3
        assert spool.nbytes == sum(p.stat().st_size for p in batch_files(spool))
        seen = []
        while (item := spool.peek()) is not None:
            seq, request = item
            assert spool.peek() == item  # peek does not consume
            seen.append((seq, ids(request)))
            spool.remove(seq)
        assert seen == [(s, [f"{n}-0", f"{n}-1", f"{n}-2"]) for s, n in zip(seqs, "abc")]
        assert (len(spool), spool.nbytes, batch_files(spool)) == (0, 0, [])


def test_a_file_holds_one_serialized_submit_request(tmp_path):
    with Spool(tmp_path, max_bytes=1 << 20) as spool:
        spool.put(batch("a"))
        [path] = batch_files(spool)
        assert pb.SubmitRequest.FromString(path.read_bytes()) == pb.SubmitRequest(trajectories=batch("a"))


def test_reopening_keeps_pending_batches_in_order_and_deletes_temp_files(tmp_path):
    spool = Spool(tmp_path, max_bytes=1 << 20)
    first = [spool.put(batch(name)) for name in ("a", "b", "c")]
    spool.remove(first[0])
    spool.close()
    (tmp_path / "000000000099.tmp").write_bytes(b"half a batch from a crash")

    with Spool(tmp_path, max_bytes=1 << 20) as spool:
        assert not list(tmp_path.glob("*.tmp"))
        assert len(spool) == 2 and spool.nbytes == sum(p.stat().st_size for p in batch_files(spool))
        newer = spool.put(batch("d"))
        assert newer > first[-1]
        order = []
        while (item := spool.peek()) is not None:
            order.append(ids(item[1])[0])
            spool.remove(item[0])
        assert order == ["b-0", "c-0", "d-0"]


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_corrupt_batch_is_moved_aside_and_skipped(tmp_path, caplog, damage):
    with Spool(tmp_path, max_bytes=1 << 20) as spool:
        spool.put(batch("a"))
        spool.put(batch("b"))
        bad = batch_files(spool)[0]
        data = bad.read_bytes()
        bad.write_bytes(
            {"flip": data[:-1] + bytes([data[-1] ^ 1]), "truncate": data[: len(data) // 2], "garbage": b"\xff" * len(data)}[
                damage
            ]
        )
        with caplog.at_level(logging.ERROR, logger="rollbook.rollout"):
            seq, request = spool.peek()
        assert ids(request)[0] == "b-0" and len(spool) == 1
        assert [p.name for p in (tmp_path / "corrupt").iterdir()] == [bad.name]
        assert bad.name in caplog.text and "corrupt" in caplog.text
        assert spool.nbytes == batch_files(spool)[0].stat().st_size


def test_put_blocks_while_full_and_raises_spool_full_on_timeout(tmp_path):
    with Spool(tmp_path, max_bytes=100) as spool:
        seq = spool.put(batch("a", num_tokens=50))  # > 100 bytes: an oversized batch still gets in alone
        assert spool.nbytes > 100
        t0 = time.monotonic()
        with pytest.raises(SpoolFull):
            spool.put(batch("b"), timeout=0.2)
        assert time.monotonic() - t0 >= 0.2 and len(spool) == 1

        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(spool.put, batch("c"))
            time.sleep(0.2)
            assert not waiting.done()  # admission stopped, nothing dropped
            spool.remove(seq)
            assert waiting.result(timeout=5) > seq
        assert ids(spool.peek()[1])[0] == "c-0"


def test_peek_waits_for_a_put(tmp_path):
    with Spool(tmp_path, max_bytes=1 << 20) as spool:
        assert spool.peek(timeout=0.05) is None
        threading.Timer(0.1, spool.put, args=(batch("a"),)).start()
        seq, request = spool.peek(timeout=5)
        assert ids(request)[0] == "a-0"


def test_empty_batch_is_refused(tmp_path):
    with Spool(tmp_path, max_bytes=1 << 20) as spool, pytest.raises(ValueError, match="at least one"):
        spool.put([])


def test_a_directory_has_one_spool_at_a_time(tmp_path):
    spool = Spool(tmp_path, max_bytes=1 << 20)
    with pytest.raises(RuntimeError, match="in use"):
        Spool(tmp_path, max_bytes=1 << 20)
    spool.close()
    Spool(tmp_path, max_bytes=1 << 20).close()


# ---- Submitter over a fake store ------------------------------------------------------------------


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode):
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code


class FakeStore:
    """Stands in for ``StoreClient``: stores ids once (DUPLICATE after), rejects model "bad".
    ``failures`` are raised by the next calls before anything is stored; ``lose_verdicts`` calls
    store their batch and then raise UNAVAILABLE, as a store killed between commit and answer."""

    def __init__(self, channel: grpc.Channel):
        self.channel = channel
        self.address = "fake"
        self.stored: list[str] = []
        self.calls = 0
        self.failures: list[grpc.StatusCode] = []
        self.lose_verdicts = 0
        self.down = threading.Event()  # while set, every call fails UNAVAILABLE

    def submit(self, trajectories, *, batch_size: int, max_in_flight: int, retry_deadline_s: float) -> SubmitResult:
        self.calls += 1
        if self.down.is_set():
            raise FakeRpcError(grpc.StatusCode.UNAVAILABLE)
        if self.failures:
            raise FakeRpcError(self.failures.pop(0))
        result = SubmitResult()
        for t in trajectories:
            if t.model_id == "bad":
                status, reason = pb.Verdict.REJECTED, "MODEL_NOT_REGISTERED"
            elif t.trajectory_id in self.stored:
                status, reason = pb.Verdict.DUPLICATE, ""
            else:
                status, reason = pb.Verdict.ACCEPTED, ""
                self.stored.append(t.trajectory_id)
            result.add(pb.Verdict(trajectory_id=t.trajectory_id, status=status, reason=reason))
        if self.lose_verdicts:
            self.lose_verdicts -= 1
            raise FakeRpcError(grpc.StatusCode.UNAVAILABLE)
        return result


@pytest.fixture
def store():
    server = grpc.server(ThreadPoolExecutor(1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield FakeStore(channel)
    channel.close()
    server.stop(None)


def make_submitter(store, spool, **kw) -> Submitter:
    return Submitter(store, spool, retry_backoff_s=(0.01, 0.05), **kw)


def test_submitter_delivers_batches_in_order_and_empties_the_spool(tmp_path, store):
    with Spool(tmp_path, max_bytes=1 << 20) as spool, make_submitter(store, spool, batch_size=2) as sub:
        sub.submit(batch("a", n=5))  # 3 batches: 2 + 2 + 1
        sub.submit([{"trajectory_id": "dict-0", "model_id": "m", "output_token_ids": [1]}])
        assert sub.flush(timeout=10)
        stats = sub.stats()
    assert store.stored == [f"a-{i}" for i in range(5)] + ["dict-0"]
    assert (stats.accepted, stats.duplicates, stats.rejected, stats.delivered) == (6, 0, 0, 6)
    assert (stats.batches_spooled, stats.batches_delivered, stats.replays, stats.spool_batches) == (4, 4, 0, 0)
    assert stats.metrics()["submit/accepted"] == 6.0


def test_replay_after_lost_verdicts_counts_duplicates_as_delivered(tmp_path, store):
    store.lose_verdicts = 1  # the store commits the batch, then dies before answering
    with Spool(tmp_path, max_bytes=1 << 20) as spool, make_submitter(store, spool) as sub:
        sub.submit(batch("a", n=4))
        assert sub.flush(timeout=10)
        stats = sub.stats()
    assert store.stored == ["a-0", "a-1", "a-2", "a-3"]  # nothing stored twice
    assert (stats.accepted, stats.duplicates, stats.delivered, stats.replays) == (0, 4, 4, 1)
    assert stats.outage_s > 0


def test_retryable_errors_keep_the_batch_until_the_store_answers(tmp_path, store):
    store.failures = [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED]
    with Spool(tmp_path, max_bytes=1 << 20) as spool, make_submitter(store, spool) as sub:
        sub.submit(batch("a"))
        sub.submit(batch("b"))
        assert sub.flush(timeout=10)
        stats = sub.stats()
    assert store.stored == ["a-0", "a-1", "a-2", "b-0", "b-1", "b-2"] and store.calls == 5
    assert (stats.accepted, stats.replays, stats.batches_delivered) == (6, 3, 2)


def test_rejections_are_counted_by_reason(tmp_path, store):
    bad = pb.Trajectory(trajectory_id="x", model_id="bad", output_token_ids=[1])
    with Spool(tmp_path, max_bytes=1 << 20) as spool, make_submitter(store, spool) as sub:
        sub.submit([*batch("a", n=2), bad])
        assert sub.flush(timeout=10)
        stats = sub.stats()
    assert (stats.accepted, stats.rejected, dict(stats.rejected_by_reason)) == (2, 1, {"MODEL_NOT_REGISTERED": 1})
    assert stats.metrics()["submit/rejected/MODEL_NOT_REGISTERED"] == 1.0


def test_full_spool_blocks_the_producer_until_the_store_returns(tmp_path, store):
    store.down.set()
    size = pb.SubmitRequest(trajectories=batch("a", num_tokens=20)).ByteSize()
    with Spool(tmp_path, max_bytes=2 * size) as spool, make_submitter(store, spool, batch_size=3) as sub:
        produced = threading.Event()

        def producer():
            for name in "abcdef":
                sub.submit(batch(name, num_tokens=20))  # the spool holds two of these
            produced.set()

        threading.Thread(target=producer, daemon=True).start()
        time.sleep(0.5)
        assert not produced.is_set() and len(spool) == 2  # admission stopped; nothing dropped
        store.down.clear()
        assert produced.wait(10) and sub.flush(timeout=10)
        stats = sub.stats()
    assert store.stored == [f"{name}-{i}" for name in "abcdef" for i in range(3)]
    assert stats.admission_wait_s > 0.3 and stats.outage_s > 0.3


def test_submit_timeout_on_a_full_spool_raises_spool_full(tmp_path, store):
    store.down.set()
    with Spool(tmp_path, max_bytes=10) as spool, make_submitter(store, spool) as sub:
        sub.submit(batch("a"))
        with pytest.raises(SpoolFull):
            sub.submit(batch("b"), timeout=0.2)
        store.down.clear()


def test_batches_left_by_a_closed_submitter_are_delivered_by_the_next(tmp_path, store):
    store.down.set()
    spool = Spool(tmp_path, max_bytes=1 << 20)
    sub = make_submitter(store, spool)
    sub.submit(batch("a"))
    sub.submit(batch("b"))
    assert not sub.flush(timeout=0.2)
    sub.close()
    spool.close()  # the worker process ends here; its spool stays on disk

    store.down.clear()
    with Spool(tmp_path, max_bytes=1 << 20) as spool:
        assert len(spool) == 2  # before a submitter starts delivering them
        with make_submitter(store, spool) as sub:
            assert sub.flush(timeout=10)
    assert store.stored == ["a-0", "a-1", "a-2", "b-0", "b-1", "b-2"]


def test_non_retryable_error_stops_delivery_and_keeps_the_batch(tmp_path, store):
    store.failures = [grpc.StatusCode.UNAUTHENTICATED]
    with Spool(tmp_path, max_bytes=1 << 20) as spool, make_submitter(store, spool) as sub:
        sub.submit(batch("a"))
        with pytest.raises(SubmitterFailed, match="UNAUTHENTICATED"):
            sub.flush(timeout=10)
        with pytest.raises(SubmitterFailed):
            sub.submit(batch("b"))
        assert len(spool) == 1 and store.stored == []


def test_trajectory_without_id_is_refused(tmp_path, store):
    with Spool(tmp_path, max_bytes=1 << 20) as spool, make_submitter(store, spool) as sub:
        with pytest.raises(ValueError, match="trajectory_id"):
            sub.submit([traj("a"), traj("")])
        assert len(spool) == 0


def test_unreachable_store_is_not_called_and_counts_as_outage(tmp_path):
    channel = grpc.insecure_channel("127.0.0.1:1")  # nothing listens on port 1
    store = FakeStore(channel)
    with Spool(tmp_path, max_bytes=1 << 20) as spool, make_submitter(store, spool) as sub:
        sub.submit(batch("a"))  # returns at once: the batch is on disk
        assert len(spool) == 1
        assert not sub.flush(timeout=1.0)
        assert store.calls == 0 and sub.stats().outage_s > 0.3
    channel.close()
