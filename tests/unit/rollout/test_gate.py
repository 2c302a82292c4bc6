"""The staleness gate's admission capacity (rollbook.rollout.gate), checked against hand arithmetic.

capacity(version) = (eta + version + 1) * batch_size - (accepted + running)

Run: python -m pytest tests/unit/rollout/test_gate.py -q
"""

from __future__ import annotations

import threading
import time

import pytest

from rollbook.rollout.gate import StalenessGate


def test_synchronous_gate_admits_one_batch_per_version():
    gate = StalenessGate(max_staleness=0, batch_size=4)
    assert gate.capacity(0) == 4  # (0 + 0 + 1) * 4 - (0 + 0)
    assert gate.try_admit(10, version=0) == 4
    assert gate.try_admit(1, version=0) == 0  # (0 + 0 + 1) * 4 - (0 + 4) = 0
    gate.on_finished(4, accepted=True)
    assert (gate.running, gate.accepted) == (0, 4)
    assert gate.capacity(0) == 0  # finishing frees no slot until the version advances: 4 - (4 + 0)
    assert gate.try_admit(1, version=0) == 0
    assert gate.capacity(1) == 4  # (0 + 1 + 1) * 4 - (4 + 0)
    assert gate.try_admit(3, version=1) == 3
    assert gate.capacity(1) == 1  # 8 - (4 + 3)


def test_staleness_two_admits_three_batches_ahead():
    gate = StalenessGate(max_staleness=2, batch_size=4)
    assert gate.capacity(0) == 12  # (2 + 0 + 1) * 4
    assert gate.try_admit(20, version=0) == 12
    assert gate.capacity(0) == 0
    gate.on_finished(5, accepted=True)
    assert gate.capacity(0) == 0  # 12 - (5 + 7)
    assert gate.capacity(1) == 4  # (2 + 1 + 1) * 4 - (5 + 7) = 16 - 12
    assert gate.capacity(3) == 12  # (2 + 3 + 1) * 4 - 12 = 24 - 12


def test_dropped_samples_give_their_slots_back():
    gate = StalenessGate(max_staleness=1, batch_size=3)
    assert gate.try_admit(6, version=0) == 6  # (1 + 0 + 1) * 3 = 6
    gate.on_finished(2, accepted=False)  # two failed generations: not accepted, no longer running
    gate.on_finished(1, accepted=True)
    assert (gate.running, gate.accepted, gate.dropped) == (3, 1, 2)
    assert gate.capacity(0) == 2  # 6 - (1 + 3)
    assert gate.try_admit(5, version=0) == 2


def test_capacity_is_negative_when_the_version_is_behind_the_admitted_work():
    gate = StalenessGate(max_staleness=0, batch_size=4)
    gate.try_admit(8, version=1)  # (0 + 1 + 1) * 4 = 8
    assert gate.capacity(0) == -4  # (0 + 0 + 1) * 4 - 8
    assert gate.try_admit(1, version=0) == 0


def test_finishing_more_than_running_is_an_error():
    gate = StalenessGate(max_staleness=0, batch_size=4)
    gate.try_admit(2, version=0)
    with pytest.raises(ValueError, match="only 2 running"):
        gate.on_finished(3, accepted=True)


@pytest.mark.parametrize(("eta", "batch"), [(-1, 4), (0, 0)])
def test_invalid_configuration_is_rejected(eta, batch):
    with pytest.raises(ValueError):
        StalenessGate(max_staleness=eta, batch_size=batch)


def test_concurrent_admission_never_exceeds_capacity():
    gate = StalenessGate(max_staleness=1, batch_size=50)  # capacity(0) = 100
    admitted = []

    def worker():
        admitted.append(sum(gate.try_admit(1, version=0) for _ in range(100)))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(admitted) == 100 and gate.running == 100


def test_wait_for_capacity_wakes_when_the_version_advances():
    gate = StalenessGate(max_staleness=0, batch_size=4)
    gate.try_admit(4, version=0)
    gate.on_finished(4, accepted=True)
    version = [0]
    threading.Timer(0.1, lambda: version.__setitem__(0, 1)).start()
    t0 = time.monotonic()
    assert gate.wait_for_capacity(lambda: version[0], timeout=5) == 4  # (0 + 1 + 1) * 4 - 4
    assert 0.05 < time.monotonic() - t0 < 2


def test_wait_for_capacity_wakes_when_a_sample_is_dropped():
    gate = StalenessGate(max_staleness=0, batch_size=2)
    gate.try_admit(2, version=0)
    threading.Timer(0.1, gate.on_finished, args=(1,), kwargs={"accepted": False}).start()
    assert gate.wait_for_capacity(lambda: 0, timeout=5, poll_s=10) == 1  # woken by on_finished, not the poll


def test_wait_for_capacity_times_out_with_zero():
    gate = StalenessGate(max_staleness=0, batch_size=1)
    gate.try_admit(1, version=0)
    t0 = time.monotonic()
    assert gate.wait_for_capacity(lambda: 0, timeout=0.2) == 0
    assert time.monotonic() - t0 < 1


def test_set_bound_changes_capacity_at_once_and_wakes_a_waiter():
    gate = StalenessGate(max_staleness=3, batch_size=4)  # a worker's own setting
    assert gate.try_admit(8, version=0) == 8
    gate.set_bound(0, 4)  # the trainer announces eta = 0
    assert gate.capacity(0) == -4  # (0 + 0 + 1) * 4 - 8: over-admitted, nothing more until version 1
    assert gate.try_admit(1, version=0) == 0
    assert gate.capacity(1) == 0 and gate.capacity(2) == 4
    gate.set_bound(1, 8)
    assert gate.capacity(0) == 8  # (1 + 0 + 1) * 8 - 8
    waiter: list[int] = []
    gate.set_bound(0, 8)
    t = threading.Thread(target=lambda: waiter.append(gate.wait_for_capacity(lambda: 0, timeout=30, poll_s=10)))
    t.start()
    time.sleep(0.1)
    gate.set_bound(2, 8)  # notify: the waiter sees the new capacity without waiting for its poll
    t.join(timeout=5)
    assert waiter == [16]  # (2 + 0 + 1) * 8 - 8
    with pytest.raises(ValueError, match="max_staleness"):
        gate.set_bound(-1, 8)
    with pytest.raises(ValueError, match="batch_size"):
        gate.set_bound(0, 0)
