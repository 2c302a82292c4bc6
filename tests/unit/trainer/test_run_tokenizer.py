"""The tokenizer a run encodes with is the one its exports carry, and the vocabulary the store is told
is the student's: ``export_tokenizer``'s order (the run's tokenizer directory, else the model
directory's files, else the toy character tokenizer), the loop exporting ``trainer.tokenizer``,
``rollbook run``'s input check resolving ``trainer.tokenizer`` from the rollout's, and ``rollbook
train``'s registered vocabulary (``size_for_tokenizer``, ``registered_vocab``). Real tokenizers and tiny models."""

from __future__ import annotations

import pathlib

import pytest

from rollbook.config import ModelConfig, RunConfig, TrainerConfig
from rollbook.errors import ConfigError
from rollbook.language_models import build_student, model_vocab_size
from rollbook.run.inputs import check_inputs
from rollbook.tasks import TOKENIZER
from rollbook.trainer.export import export_tokenizer
from rollbook.trainer.loop import Trainer
from rollbook.trainer.main import registered_vocab, size_for_tokenizer
from tests.hf_fixtures import save_bpe_tokenizer, save_tiny_model_dir
from tests.unit.trainer.test_loop import FakeStore


def _auto(directory: pathlib.Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def _run_config(tmp_path: pathlib.Path, **rollout) -> RunConfig:
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "What is 2 times 3?", "answer": "6"}\n')
    return RunConfig(
        run_dir=str(tmp_path / "run"),
        rollout={
            "dataset": {"train_files": [str(data)], "default_domain": "math"},
            "rewards": {"math": {"kind": "math"}},
            **rollout,
        },
    )


def test_export_tokenizer_prefers_the_runs_tokenizer_then_the_models_then_the_characters(tmp_path):
    model = save_tiny_model_dir(tmp_path / "model", vocab_size=300)
    other = save_bpe_tokenizer(tmp_path / "other", vocab_size=350)
    for name, kwargs, expected in (("run", {"tokenizer_dir": other}, other), ("model", {}, model)):
        out = tmp_path / f"out-{name}"
        out.mkdir()
        export_tokenizer(ModelConfig(path=str(model)), out, **kwargs)
        assert (out / "tokenizer.json").read_bytes() == (expected / "tokenizer.json").read_bytes()
        assert len(_auto(out)) == len(_auto(expected))
    out = tmp_path / "chars"
    out.mkdir()
    export_tokenizer(ModelConfig(), out)
    assert _auto(out)("12+3=").input_ids == TOKENIZER.encode("12+3=", add_bos=True)
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        export_tokenizer(ModelConfig(), out, tokenizer_dir=tmp_path / "run" / "nothing-here")


def test_the_loop_exports_the_configured_tokenizer_not_the_character_one(tmp_path):
    tok = save_bpe_tokenizer(tmp_path / "tok")
    vocab = len(_auto(tok))
    config = TrainerConfig(
        run_dir=str(tmp_path / "run"), num_samples=4, num_steps=1, model={"vocab_size": vocab}, tokenizer=str(tok)
    )
    size_for_tokenizer(config)
    student = build_student(config.model)
    Trainer(config, FakeStore(), model=student).run()
    out = tmp_path / "run" / "hf" / "step-000001"
    assert (out / "tokenizer.json").read_bytes() == (tok / "tokenizer.json").read_bytes()
    assert _auto(out).chat_template == _auto(tok).chat_template


def test_rollbook_run_resolves_the_trainers_tokenizer_from_the_rollouts(tmp_path):
    tok = save_bpe_tokenizer(tmp_path / "tok")
    config = _run_config(tmp_path, tokenizer=str(tok))
    vocab = check_inputs(config)
    assert vocab == len(_auto(tok)) == config.trainer.model.vocab_size  # a tiny model of the tokenizer's size
    assert config.trainer.tokenizer == str(tok)
    model = save_tiny_model_dir(tmp_path / "model", vocab_size=300)
    config = _run_config(tmp_path)  # no rollout.tokenizer: the model directory's
    config.trainer.model.path = str(model)
    assert check_inputs(config) == len(_auto(model))
    assert config.trainer.tokenizer == config.rollout.tokenizer == str(model)


def test_a_tokenizer_larger_than_the_model_or_apart_from_a_dataset_is_refused(tmp_path):
    small = save_tiny_model_dir(tmp_path / "small", vocab_size=300)
    config = _run_config(tmp_path, tokenizer=str(save_bpe_tokenizer(tmp_path / "big", vocab_size=400)))
    config.trainer.model.path = str(small)
    with pytest.raises(ConfigError, match="the model cannot read or emit all of its ids"):
        check_inputs(config)
    with pytest.raises(ConfigError, match="trainer.tokenizer applies with"):
        check_inputs(RunConfig(run_dir=str(tmp_path / "r"), trainer={"tokenizer": str(small)}))


def _train_student(config: TrainerConfig):
    """What ``rollbook train`` does: size for the tokenizer, build the student, the vocabulary to register."""
    tokenizer_vocab = size_for_tokenizer(config)
    student = build_student(config.model)
    return student, registered_vocab(student, config, tokenizer_vocab)


def test_rollbook_train_registers_its_students_embedding_rows(tmp_path):
    tok = save_bpe_tokenizer(tmp_path / "tok")
    student, vocab = _train_student(TrainerConfig(tokenizer=str(tok)))
    assert vocab == model_vocab_size(student) == len(_auto(tok)) > TOKENIZER.vocab_size
    student, vocab = _train_student(TrainerConfig())  # the toy tasks: the character vocabulary
    assert vocab == model_vocab_size(student) == TOKENIZER.vocab_size
    model = save_tiny_model_dir(tmp_path / "model", vocab_size=300)
    student, vocab = _train_student(TrainerConfig(model={"path": str(model)}, tokenizer=str(model)))
    assert vocab == model_vocab_size(student) == len(_auto(model))
    with pytest.raises(ConfigError, match="cannot read or emit"):
        _train_student(TrainerConfig(model={"vocab_size": 60}, tokenizer=str(tok)))
    with pytest.raises(ConfigError, match="tokenizer: tokenizer directory .* does not exist"):
        size_for_tokenizer(TrainerConfig(tokenizer=str(tmp_path / "nope")))
