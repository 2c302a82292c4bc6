"""The native engine in a process of its own (rollout/engine_process.py), as ``rollbook proxy`` runs it:
it samples what the same engine in this process samples, streams tokens in order, takes weights as a
state dict or a loading callable, carries errors with their causes, and fails clearly when the
child dies or cannot be built."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

from rollbook.config import ModelConfig, ProxyConfig
from rollbook.rollout.engine import GenerationRequest
from rollbook.rollout.engine_process import EngineProcess
from rollbook.rollout.proxy.server import build_engine, native_engine
from rollbook.weights.base import WeightSnapshot, load_into

CONFIG = ProxyConfig(model=ModelConfig(hidden_size=16, intermediate_size=32, num_layers=1), max_context_tokens=64)
REQUESTS = [GenerationRequest(prompt_token_ids=[1, 5, 6, 7], max_new_tokens=12, temperature=1.0) for _ in range(3)]


@pytest.fixture(scope="module")
def engine():
    built = build_engine(CONFIG)
    assert isinstance(built, EngineProcess) and built.pid != os.getpid()
    yield built
    built.close()


def _same(a, b) -> None:
    assert [r.output_token_ids for r in a] == [r.output_token_ids for r in b]
    for x, y in zip(a, b):
        assert x.output_versions == y.output_versions
        assert max(abs(p - q) for p, q in zip(x.output_logprobs, y.output_logprobs)) < 1e-6


def test_it_samples_what_the_engine_samples_in_this_process_and_streams_every_token_in_order(engine):
    local = native_engine(CONFIG.model_copy(update={"engine_process": False}))
    try:
        _same(engine.generate(REQUESTS, seed=7), local.generate(REQUESTS, seed=7))
        streamed: list[tuple[int, float, int]] = []
        done = engine.submit(REQUESTS[0], seed=7, index=0, on_token=lambda *args: streamed.append(args[:3])).result(60)
        assert [t for t, _, _ in streamed] == done.output_token_ids
        assert [lp for _, lp, _ in streamed] == done.output_logprobs
        assert engine.num_parameters == local.num_parameters and engine.max_top_logprobs == local.max_top_logprobs
    finally:
        local.close()


def test_weights_arrive_as_a_state_dict_or_a_loading_callable_and_a_bad_one_fails_with_its_cause(engine):
    from rollbook.language_models import build_student

    other = build_student(CONFIG.model, seed=123)
    local = native_engine(CONFIG.model_copy(update={"engine_process": False}))
    try:
        state = {k: v.clone() for k, v in other.state_dict().items()}
        engine.update_weights(state, 1)
        local.update_weights(state, 1)
        assert engine.version == 1
        _same(engine.generate(REQUESTS, seed=3), local.generate(REQUESTS, seed=3))

        snapshot = WeightSnapshot(version=2, state_dict={k: v * 0.5 for k, v in state.items()}, checksum=b"")
        engine.update_weights(lambda model: load_into(model, snapshot), 2)  # as the proxy follows a weight channel
        local.update_weights(lambda model: load_into(model, snapshot), 2)
        assert engine.version == 2
        _same(engine.generate(REQUESTS, seed=3), local.generate(REQUESTS, seed=3))

        with pytest.raises(RuntimeError, match="weight update to version 3 failed") as failed:
            engine.update_weights({"not.a.parameter": torch.zeros(1)}, 3)
        assert failed.value.__cause__ is not None and "not.a.parameter" in str(failed.value.__cause__)
        engine.update_weights(state, 4)  # a later update that succeeds serves again
        assert engine.generate(REQUESTS[:1])[0].output_versions[0] == 4
    finally:
        local.close()


def test_a_request_the_engine_refuses_fails_its_own_future_with_the_engine_s_error(engine):
    bad = GenerationRequest(prompt_token_ids=[1, 10_000], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"a prompt token id is outside"):
        engine.submit(bad).result(60)
    assert len(engine.generate(REQUESTS[:1])[0].output_token_ids) >= 1  # and the engine goes on


def test_a_killed_engine_process_fails_what_is_in_flight_and_every_later_call():
    engine = build_engine(CONFIG)
    try:
        started = threading.Event()
        long = GenerationRequest(prompt_token_ids=[1, 5], max_new_tokens=60)
        future = engine.submit(long, on_token=lambda *args: started.set())
        assert started.wait(60)
        os.kill(engine.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match=r"the engine process exited \(exit code -9\)"):
            future.result(60)
        with pytest.raises(RuntimeError, match="the engine process exited"):
            engine.submit(long)
    finally:
        engine.close()


def test_an_engine_that_cannot_be_built_raises_its_error_in_the_parent(tmp_path):
    corrupt = tmp_path / "weights.pt"
    corrupt.write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="weights.pt"):
        build_engine(CONFIG.model_copy(update={"checkpoint": str(corrupt)}))
