"""The stop set (``rollbook.language_models.stop_token_ids``): the tokenizer's eos, the model's own
generation-config eos ids (Qwen and Llama-3 instruct models list several) and configured ids. A
rollout worker on a local model directory whose generation_config.json lists two eos ids stops at
either, for rollouts and for evaluation, and scores the text before it."""

from __future__ import annotations

import json
import pathlib

import torch

from rollbook.config import DatasetConfig, ModelConfig, RewardConfig, RolloutConfig
from rollbook.language_models import TinyModelSpec, build_tiny_model, generation_eos_ids, load_model, stop_token_ids
from rollbook.rollout.engine import NativeEngine
from rollbook.rollout.worker import RolloutWorker, tokenizer_for, use_model_stops
from rollbook.tasks import TOKENIZER

QUESTION, BANG = TOKENIZER.encode("?")[0], TOKENIZER.encode("!")[0]  # the two eos ids the model's config lists


def uniform_model_dir(path: pathlib.Path, eos: object) -> pathlib.Path:
    """A tiny Llama of the task tokenizer's vocabulary whose every next token is equally likely (its
    untied LM head is zero), saved with ``eos`` as its generation config's ``eos_token_id``."""
    model = build_tiny_model(TinyModelSpec(vocab_size=TOKENIZER.vocab_size, tie_word_embeddings=False))
    with torch.no_grad():
        model.lm_head.weight.zero_()
    model.generation_config.eos_token_id = eos
    model.save_pretrained(path)
    return path


def test_the_generation_config_eos_ids_an_int_a_list_a_config_fallback_or_none(tmp_path):
    assert generation_eos_ids(ModelConfig(path=str(uniform_model_dir(tmp_path / "list", [QUESTION, BANG])))) == [
        QUESTION,
        BANG,
    ]
    assert generation_eos_ids(ModelConfig(path=str(uniform_model_dir(tmp_path / "int", BANG)))) == [BANG]
    (tmp_path / "int" / "generation_config.json").unlink()
    config = json.loads((tmp_path / "int" / "config.json").read_text())
    (tmp_path / "int" / "config.json").write_text(json.dumps({**config, "eos_token_id": 7}))
    assert generation_eos_ids(ModelConfig(path=str(tmp_path / "int"))) == [7]  # as transformers falls back
    assert generation_eos_ids(ModelConfig()) == [] and generation_eos_ids(None) == []  # the tiny model names none
    # the tokenizer's eos first, each id once
    assert stop_token_ids(2, ModelConfig(path=str(tmp_path / "list")), [BANG, 5]) == [2, QUESTION, BANG, 5]


def test_a_worker_on_a_model_listing_two_eos_ids_stops_at_either_and_evaluates_with_them(tmp_path):
    path = uniform_model_dir(tmp_path / "model", [QUESTION, BANG])
    rollout = RolloutConfig(domains=["arithmetic"], num_digits=1, group_size=8, num_prompts=8, max_new_tokens=64)
    use_model_stops(rollout, ModelConfig(path=str(path)))
    assert rollout.stop_token_ids == [QUESTION, BANG]
    use_model_stops(rollout, ModelConfig(path=str(path)))  # where both configs meet again: nothing changes
    assert rollout.stop_token_ids == [QUESTION, BANG]

    engine = RecordingEngine(NativeEngine(load_model(path), version=0, seed=3))
    worker = RolloutWorker(engine, rollout, model_id="tiny")
    trajectories = worker.produce()
    stops = {TOKENIZER.eos_token_id, QUESTION, BANG}
    enders = set()
    for t in trajectories:
        ids = list(t.output_token_ids)
        assert not stops & set(ids[:-1])  # nothing after the first stop id
        if t.finish_reason == "stop":
            assert ids[-1] in stops
            enders.add(ids[-1])
        else:
            assert len(ids) == rollout.max_new_tokens
    assert {QUESTION, BANG} <= enders  # generation stopped at either of the model's eos ids
    assert worker.tokenizer.completion_text([TOKENIZER.encode("4")[0], BANG, TOKENIZER.encode("2")[0]]) == "4"

    worker.evaluate(worker.eval_tasks[:2])
    assert {tuple(r.stop_token_ids) for r in engine.requests} == {(TOKENIZER.eos_token_id, QUESTION, BANG)}


def test_a_dataset_tokenizer_stops_on_the_model_eos_ids_too(tmp_path):
    from tests.hf_fixtures import save_tiny_model_dir

    path = save_tiny_model_dir(tmp_path / "model")
    generation = json.loads((path / "generation_config.json").read_text())
    eos = generation["eos_token_id"]
    (path / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [eos, 3]}))
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "2+2=", "answer": "4"}) + "\n")
    rollout = RolloutConfig(
        dataset=DatasetConfig(train_files=[str(rows)], default_domain="math"),
        rewards={"math": RewardConfig(kind="exact")},
        tokenizer=str(path),
        stop_token_ids=[4],
    )
    use_model_stops(rollout, ModelConfig(path=str(path)))
    tokenizer = tokenizer_for(rollout)
    assert tokenizer.stop_token_ids == [eos, 3, 4]
    four = tokenizer.encode("4")
    assert tokenizer.completion_text([*four, 3, *four]) == "4"


class RecordingEngine:
    """The engine, with every request it was given kept."""

    def __init__(self, engine):
        self.engine, self.requests = engine, []

    @property
    def version(self):
        return self.engine.version

    def generate(self, requests, *, seed=None):
        self.requests += requests
        return self.engine.generate(requests, seed=seed)
