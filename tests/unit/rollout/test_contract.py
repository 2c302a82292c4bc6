"""``TrainerContract`` (rollout/main.py): the worker's staleness gate follows what the trainer
announced to the store, against a fake client. The real processes: tests/integration/test_staleness_contract.py.

Run: ``python -m pytest tests/unit/rollout/test_contract.py -q``.
"""

from __future__ import annotations

import logging
import threading

import grpc

from rollbook.client import ModelInfo
from rollbook.config import WorkerConfig
from rollbook.rollout import main as worker_main
from rollbook.rollout.gate import StalenessGate
from rollbook.rollout.main import TrainerContract


class _RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode):
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return f"{self._code.name.lower()} for the test"


class FakeStore:
    """Answers ``get_model`` from ``self.answer`` (a ModelInfo, or a status code to raise)."""

    def __init__(self, answer):
        self.answer, self.calls = answer, 0

    def get_model(self, model_id: str) -> ModelInfo:
        self.calls += 1
        if isinstance(self.answer, grpc.StatusCode):
            raise _RpcError(self.answer)
        return self.answer


def _info(eta, batch, latest=0):
    return ModelInfo("tiny", 64, latest, eta, batch)


def _contract(answer, eta=3, batch=64):
    config = WorkerConfig(weights="shm:x", batch_size=batch, rollout={"max_staleness": eta})
    gate = StalenessGate(eta, batch)
    store = FakeStore(answer)
    return TrainerContract(store, config, gate), gate, store


def test_the_trainers_bound_replaces_the_workers_and_is_said_once(caplog):
    contract, gate, store = _contract(_info(0, 8))
    with caplog.at_level(logging.INFO, logger="rollbook.rollout"):
        assert contract.refresh(0) and contract.refresh(0) and contract.refresh(0)
    assert (gate.max_staleness, gate.batch_size) == (0, 8)
    assert store.calls == 1  # asked once per version once known
    said = [r.getMessage() for r in caplog.records if "announces" in r.getMessage()]
    assert said == [
        "staleness gate: the trainer announces max_staleness=0, samples_per_version=8; using them "
        "(this worker's config: rollout.max_staleness=3, batch_size=64)"
    ]
    # a restarted trainer with another bound: taken at the next version, said again
    store.answer = _info(2, 16, latest=1)
    assert contract.refresh(1)
    assert (gate.max_staleness, gate.batch_size) == (2, 16) and store.calls == 2


def test_equal_values_are_adopted_silently(caplog):
    contract, gate, _ = _contract(_info(3, 64))
    with caplog.at_level(logging.INFO, logger="rollbook.rollout"):
        assert contract.refresh(0)
    assert contract.announced == (3, 64) and not [r for r in caplog.records if "announces" in r.getMessage()]


def test_without_an_answer_the_worker_keeps_its_own_bound_and_asks_again_later(caplog, monkeypatch):
    for code in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION):
        contract, gate, store = _contract(code)
        with caplog.at_level(logging.INFO, logger="rollbook.rollout"):
            assert not contract.refresh(0) and not contract.refresh(0)
        assert (gate.max_staleness, gate.batch_size) == (3, 64) and store.calls == 1  # not again within the recheck
        monkeypatch.setattr(worker_main, "CONTRACT_RECHECK_S", 0.0)
        assert not contract.refresh(0) and store.calls == 2
        monkeypatch.setattr(worker_main, "CONTRACT_RECHECK_S", 1.0)
        store.answer = _info(1, 32)
        assert contract.refresh(1) and (gate.max_staleness, gate.batch_size) == (1, 32)
    assert sum(f"({code.name}:" in r.getMessage() for r in caplog.records for code in grpc.StatusCode) == 3  # once each


def test_nothing_announced_yet_keeps_the_workers_bound_and_the_start_waits_for_it():
    contract, gate, store = _contract(_info(None, None))
    assert not contract.refresh(0)
    assert (gate.max_staleness, gate.batch_size) == (3, 64)
    # at start: the announcement arrives while the worker waits for it
    contract, gate, store = _contract(_info(None, None))
    timer = threading.Timer(0.3, lambda: setattr(store, "answer", _info(1, 8)))
    timer.start()
    contract.wait_for_announcement(threading.Event(), timeout_s=30)
    timer.join()
    assert (gate.max_staleness, gate.batch_size) == (1, 8) and contract.announced == (1, 8)


def test_a_worker_sharing_the_trainer_admits_its_share_of_each_version():
    """Two workers feeding one trainer of 16 samples per version (the ray placement): each gates on 8,
    so neither can fill a batch alone and leave the other idle; never below one group."""
    config = WorkerConfig(weights="shm:x", batch_size=8, version_share=0.5, rollout={"max_staleness": 0, "group_size": 4})
    gate = StalenessGate(0, 8)
    assert TrainerContract(FakeStore(_info(0, 16)), config, gate).refresh(0)
    assert (gate.max_staleness, gate.batch_size) == (0, 8)
    small = WorkerConfig(weights="shm:x", batch_size=4, version_share=0.25, rollout={"max_staleness": 0, "group_size": 4})
    gate = StalenessGate(0, 4)
    assert TrainerContract(FakeStore(_info(0, 8)), small, gate).refresh(0)
    assert gate.batch_size == 4  # ceil(8 / 4) = 2 is below a group of 4
