"""The colocated placement's weight handoff and phases (rollbook/run/driving.py ``EngineHandoff``,
rollbook/run/colocated.py ``Colocated``): each version copied from the trainer's model into a real
``NativeEngine`` tensor by tensor, with no state dict of the trainer's model; the engine's KV cache
freed after each round when offloading, and what it freed reported with the step."""

from __future__ import annotations

import copy

import pytest
import torch

from rollbook import devices
from rollbook.config import TrainerConfig
from rollbook.language_models import TinyModelSpec, build_tiny_model
from rollbook.rollout.engine import GenerationRequest, NativeEngine
from rollbook.run.colocated import Colocated
from rollbook.run.driving import EngineHandoff, copy_weights
from rollbook.trainer.loop import Trainer
from tests.unit.trainer.test_loop import FakeStore

VOCAB = 32


def _engine(model: torch.nn.Module, dtype: str = "bfloat16") -> NativeEngine:
    return NativeEngine(devices.place(copy.deepcopy(model), "cpu", dtype), version=0, seed=0, max_batch_size=4, max_seq_len=32)


def _assert_engine_holds(engine: NativeEngine, model: torch.nn.Module, dtype: str) -> None:
    """The engine's every tensor is ``model``'s cast to ``dtype``: what the state-dict path would install."""
    expected = devices.cast_floating(model.state_dict(), dtype)
    got = engine._model.state_dict()
    assert got.keys() == expected.keys()
    for name, tensor in got.items():
        assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name


def _trainer(tmp_path, *publishers, **overrides) -> Trainer:
    config = TrainerConfig(
        **{"run_dir": str(tmp_path), "num_steps": 3, "num_samples": 4, "model": {"vocab_size": VOCAB}, **overrides}
    )
    return Trainer(config, FakeStore(), model=build_tiny_model(TinyModelSpec(vocab_size=VOCAB)), publishers=publishers)


def test_the_handoff_copies_every_tensor_cast_to_the_engines_dtype_and_installs_the_version():
    trained = build_tiny_model(TinyModelSpec(vocab_size=VOCAB), seed=1)
    engine = _engine(build_tiny_model(TinyModelSpec(vocab_size=VOCAB), seed=2))
    handoff = EngineHandoff(engine)

    handoff.publish_model(3, trained)
    assert engine.version == 3
    _assert_engine_holds(engine, trained, "bfloat16")
    # tied embeddings stay one tensor
    assert engine._model.lm_head.weight.data_ptr() == engine._model.model.embed_tokens.weight.data_ptr()

    older = build_tiny_model(TinyModelSpec(vocab_size=VOCAB), seed=4)
    handoff.publish_model(3, older)  # not newer than what the engine holds: ignored
    assert engine.version == 3
    _assert_engine_holds(engine, trained, "bfloat16")


def test_copying_between_models_that_do_not_match_is_refused_before_anything_is_copied():
    source = build_tiny_model(TinyModelSpec(vocab_size=VOCAB + 1), seed=1)
    target = build_tiny_model(TinyModelSpec(vocab_size=VOCAB), seed=2)
    before = copy.deepcopy(target.state_dict())
    with pytest.raises(ValueError, match="embed_tokens.weight"):
        copy_weights(source, target)
    assert all(torch.equal(t, before[n]) for n, t in target.state_dict().items())


def test_a_colocated_trainer_hands_each_version_to_its_engine_without_a_state_dict(tmp_path):
    """Start and a step that writes no checkpoint: the engine holds the trainer's version and weights
    (cast), and the trainer's model never produced a state dict; the store records an empty checksum."""
    engine = _engine(build_tiny_model(TinyModelSpec(vocab_size=VOCAB)), dtype="float32")
    trainer = _trainer(tmp_path, EngineHandoff(engine), checkpoint_every=5, export_final=False)
    calls = []
    state_dict = trainer.model.state_dict
    trainer.model.state_dict = lambda *a, **k: calls.append(1) or state_dict(*a, **k)  # type: ignore[method-assign]
    checksums = []
    publish_version = trainer.client.publish_version
    trainer.client.publish_version = lambda *a, checksum="", **k: checksums.append(checksum) or publish_version(*a, **k)

    trainer.start()
    stats = trainer.step()
    assert calls == [] and checksums == ["", ""]
    assert stats is not None and engine.version == trainer.state.version == 1
    _assert_engine_holds(engine, trainer.model, "float32")
    assert stats["perf/weight_sync_s"] >= 0  # the start's handoff of version 0, reported with step 0


def test_the_handoffs_time_and_what_is_reported_between_steps_land_in_the_next_steps_row(tmp_path):
    engine = _engine(build_tiny_model(TinyModelSpec(vocab_size=VOCAB)))
    trainer = _trainer(tmp_path, EngineHandoff(engine))
    reported = []
    trainer.client.report_train_step = lambda **kw: reported.append(kw["stats"])
    trainer.start()
    trainer.report_with_next_step({"rollout/kv_released_bytes": 123})
    trainer.step()
    trainer.step()
    assert reported[0]["rollout/kv_released_bytes"] == 123 and "rollout/kv_released_bytes" not in reported[1]
    assert all("perf/weight_sync_s" in r for r in reported)
    assert engine.version == 2


class _Worker:
    """Produces a round on a real engine (which allocates its KV cache) and submits nothing."""

    exhausted = False

    def __init__(self, engine):
        self.engine = engine

    def produce(self) -> list:
        self.engine.generate([GenerationRequest(prompt_token_ids=[1, 2], max_new_tokens=3)], seed=0)
        return []


class _Client:
    def submit(self, trajectories):
        return None


class _Trainer:
    def __init__(self):
        self.reported: list[dict] = []

    def report_with_next_step(self, stats):
        self.reported.append(stats)


def test_offloading_colocated_rounds_free_the_engines_kv_cache_and_report_its_size():
    engine = _engine(build_tiny_model(TinyModelSpec(vocab_size=VOCAB)))
    trainer = _Trainer()
    placement = Colocated(_Worker(engine), _Client(), trainer=trainer, release_kv=True)
    assert placement.before_step() and placement.before_step()
    [first, second] = trainer.reported
    assert first["rollout/kv_released_bytes"] > 0 and second == first  # allocated again by the next round, freed again
    assert engine.release_memory() == 0  # nothing left to free

    kept = Colocated(_Worker(engine), _Client(), trainer=_Trainer(), release_kv=False)
    assert kept.before_step() and kept.trainer.reported == []
    assert engine.release_memory() == first["rollout/kv_released_bytes"]  # the round's cache stayed
