"""Hugging Face exports: the loop's RUN_DIR/hf/step-N (every N steps, at the end, newest K kept),
``rollbook export`` of a kept checkpoint (weights equal, loads with from_pretrained, generates), the
character tokenizer as an AutoTokenizer, and one-line errors for a missing or corrupt checkpoint.
Training is real (tiny model, the fake store of test_loop)."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from rollbook.cli.main import main as rollbook
from rollbook.config import TrainerConfig
from rollbook.language_models import TinyModelSpec, build_tiny_model
from rollbook.tasks import TOKENIZER
from rollbook.trainer.export import _save_tokenizer, export_checkpoint
from rollbook.trainer.loop import Trainer
from tests.unit.trainer.test_loop import FakeStore

VOCAB = TOKENIZER.vocab_size


def _train(run_dir: pathlib.Path, **overrides) -> Trainer:
    config = TrainerConfig(
        run_dir=str(run_dir), num_samples=4, model={"vocab_size": VOCAB}, lr=0.05, **{"num_steps": 3, **overrides}
    )
    trainer = Trainer(config, FakeStore(), model=build_tiny_model(TinyModelSpec(vocab_size=VOCAB), seed=2))
    trainer.run()
    return trainer


def _load(directory: pathlib.Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (
        AutoModelForCausalLM.from_pretrained(directory, local_files_only=True),
        AutoTokenizer.from_pretrained(directory, local_files_only=True),
    )


def _checkpoint_weights(run_dir: pathlib.Path, step: int) -> dict:
    return torch.load(run_dir / "checkpoints" / f"step-{step:06d}" / "state.pt", weights_only=False)["model"]


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_character_tokenizer_exports_as_an_equivalent_autotokenizer(tmp_path):
    from transformers import AutoTokenizer

    _save_tokenizer(TOKENIZER, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    for text in ("12+34=", "rev:abcd=", "a b?!"):
        assert tokenizer(text).input_ids == TOKENIZER.encode(text, add_bos=True)
        ids = TOKENIZER.encode(text, add_bos=True, add_eos=True)
        assert tokenizer.decode(ids, skip_special_tokens=True) == TOKENIZER.decode(ids) == text
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id) == (2, 0, 1)
    assert len(tokenizer) == TOKENIZER.vocab_size


def test_a_tokenizer_that_saves_itself_is_asked_to(tmp_path):
    class Saves:
        def save_pretrained(self, directory):
            pathlib.Path(directory, "tokenizer.json").write_text("{}")

    _save_tokenizer(Saves(), tmp_path)
    assert (tmp_path / "tokenizer.json").read_text() == "{}"


def test_the_loop_exports_every_n_steps_and_at_the_end_keeping_the_newest(tmp_path):
    trainer = _train(tmp_path, num_steps=5, export_every=2, export_keep_last=2)
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["step-000004", "step-000005"]
    model, tokenizer = _load(tmp_path / "hf" / "step-000005")
    assert _same(model.state_dict(), trainer.model.state_dict())
    assert _same(model.state_dict(), _checkpoint_weights(tmp_path, 5))
    prompt = tokenizer("3+4=", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=3, do_sample=False)
    assert out.shape[1] > prompt.input_ids.shape[1]
    assert model.generation_config.eos_token_id == TOKENIZER.eos_token_id  # generate stops on <eos>


def test_exports_can_be_turned_off(tmp_path):
    _train(tmp_path, export_final=False)
    assert not (tmp_path / "hf").exists()


def test_rollbook_export_converts_a_kept_checkpoint(tmp_path, capsys):
    _train(tmp_path / "run", num_steps=3, keep_last=2, export_final=False)
    assert rollbook(["export", str(tmp_path / "run" / "checkpoints" / "step-000002"), "--to", str(tmp_path / "out")]) == 0
    model, tokenizer = _load(tmp_path / "out")
    assert _same(model.state_dict(), _checkpoint_weights(tmp_path / "run", 2))
    assert not _same(model.state_dict(), _checkpoint_weights(tmp_path / "run", 3))
    assert model.generate(**tokenizer("1+1=", return_tensors="pt"), max_new_tokens=2, do_sample=False).shape[1] > 5
    assert "exported" in capsys.readouterr().out
    # --tokenizer copies another directory's tokenizer files
    (tmp_path / "tok").mkdir()
    tokenizer.save_pretrained(tmp_path / "tok")
    (tmp_path / "tok" / "chat_template.jinja").write_text("{{ messages }}")
    assert rollbook(["export", str(tmp_path / "run"), "--to", str(tmp_path / "out2"), "--tokenizer", str(tmp_path / "tok")]) == 0
    assert (tmp_path / "out2" / "chat_template.jinja").read_text() == "{{ messages }}"


def test_a_checkpoint_without_its_hf_config_takes_the_architecture_from_the_run_config(tmp_path):
    trainer = _train(tmp_path / "run", export_final=False)
    (tmp_path / "run" / "config.json").write_text(trainer.config.model_dump_json())  # as `rollbook train` writes it
    (tmp_path / "run" / "checkpoints" / "step-000003" / "config.json").unlink()  # a checkpoint of an older rollbook
    export_checkpoint(tmp_path / "run", tmp_path / "out")  # the run directory: its LATEST
    model, _ = _load(tmp_path / "out")
    assert _same(model.state_dict(), _checkpoint_weights(tmp_path / "run", 3))


def _error(capsys, *argv: str) -> tuple[int, list[str]]:
    code = rollbook(["export", *argv])
    return code, capsys.readouterr().err.strip().splitlines()


def test_a_missing_or_corrupt_checkpoint_is_one_line(tmp_path, capsys):
    code, err = _error(capsys, str(tmp_path / "nope"), "--to", str(tmp_path / "out"))
    assert (code, err) == (1, [f"rollbook export: error: {tmp_path / 'nope'}: no such checkpoint"])

    (tmp_path / "plain").mkdir()
    code, err = _error(capsys, str(tmp_path / "plain"), "--to", str(tmp_path / "out"))
    assert code == 1 and len(err) == 1 and "not a rollbook checkpoint (no state.pt" in err[0]

    _train(tmp_path / "run", export_final=False)
    step = tmp_path / "run" / "checkpoints" / "step-000003"
    (step / "state.pt").write_bytes(b"not a torch file")
    code, err = _error(capsys, str(step), "--to", str(tmp_path / "out"))
    assert code == 1 and len(err) == 1 and err[0].startswith(f"rollbook export: error: {step}: corrupt checkpoint: state.pt")
    assert not (tmp_path / "out").exists()

    torch.save({"model": {"model.embed_tokens.weight": torch.zeros(3, 3)}}, step / "state.pt")
    code, err = _error(capsys, str(step), "--to", str(tmp_path / "out"))
    assert code == 1 and len(err) == 1 and "the weights do not fit the model's architecture" in err[0]

    code, err = _error(capsys, str(step), "--to", str(tmp_path / "out"), "--tokenizer", str(tmp_path / "plain"))
    assert (code, len(err)) == (1, 1) and f"--tokenizer {tmp_path / 'plain'}: no tokenizer files there" in err[0]

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    code, err = _error(capsys, str(step), "--to", str(tmp_path / "full"))
    assert (code, err) == (1, [f"rollbook export: error: --to {tmp_path / 'full'}: exists and is not an empty directory"])


def test_the_checkpoint_keeps_the_models_hf_config(tmp_path):
    _train(tmp_path, num_steps=1, export_final=False)
    config = json.loads((tmp_path / "checkpoints" / "step-000001" / "config.json").read_text())
    assert config["vocab_size"] == VOCAB and config["model_type"] == "llama"


@pytest.mark.parametrize(
    "step, every, final, due",
    [(2, 2, False, True), (3, 2, False, False), (3, None, True, True), (2, None, True, False), (3, None, False, False)],
)
def test_export_due(step, every, final, due):
    from rollbook.trainer.export import export_due

    config = TrainerConfig(num_steps=3, export_every=every, export_final=final)
    assert export_due(config, step) is due


def test_an_export_serves_as_a_teacher_and_as_a_reference(tmp_path):
    from rollbook.trainer.model_builders import build_reference, build_teachers
    from rollbook.trainer.packing import pack_sequences, packed_logprobs

    trainer = _train(tmp_path / "run", num_steps=2)
    export = str(tmp_path / "run" / "hf" / "step-000002")
    config = TrainerConfig(teachers=[{"path": export}], reference=export, loss={"distill_coef": 1.0, "kl_coef": 0.1})
    teacher = build_teachers(config)
    reference = build_reference(config, trainer.model)
    packed = pack_sequences([[1, 4, 5]], [[6, 7, 2]], max_tokens=64)[0]
    with torch.no_grad():
        expected = packed_logprobs(trainer.model.eval(), packed, 1.0)
        assert torch.allclose(teacher.score(packed, ["d"]), expected, atol=1e-6)
        assert torch.allclose(packed_logprobs(reference, packed, 1.0), expected, atol=1e-6)


def test_teacher_dtype_holds_the_teachers_in_bfloat16_under_a_float32_student(tmp_path):
    """``trainer.teacher_dtype = "bfloat16"``: the teacher's weights are bfloat16, it scores in float32
    log-probs close to the float32 teacher's, and the KL reference stays in the trainer's dtype."""
    from rollbook.trainer.model_builders import build_reference, build_teachers
    from rollbook.trainer.packing import pack_sequences

    trainer = _train(tmp_path / "run", num_steps=1)
    export = str(tmp_path / "run" / "hf" / "step-000001")
    loss = {"distill_coef": 1.0, "kl_coef": 0.1}
    half = TrainerConfig(teachers=[{"path": export}], reference=export, teacher_dtype="bfloat16", loss=loss)
    full = build_teachers(TrainerConfig(teachers=[{"path": export}], loss=loss))
    teacher = build_teachers(half)
    assert {p.dtype for p in teacher.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in build_reference(half, trainer.model).parameters()} == {torch.float32}
    packed = pack_sequences([[1, 4, 5]], [[6, 7, 2]], max_tokens=64)[0]
    scores = teacher.score(packed, ["d"])
    assert scores.dtype == torch.float32
    torch.testing.assert_close(scores, full.score(packed, ["d"]), rtol=0, atol=0.1)
    with pytest.raises(ValueError, match="teacher_dtype"):
        TrainerConfig(teacher_dtype="float16")


def test_teacher_temperature_divides_the_teachers_logits_when_they_score(tmp_path):
    from rollbook.trainer.model_builders import build_teachers
    from rollbook.trainer.packing import pack_sequences, packed_logprobs

    trainer = _train(tmp_path / "run", num_steps=1)
    export = str(tmp_path / "run" / "hf" / "step-000001")
    config = TrainerConfig(teachers=[{"path": export}], teacher_temperature=0.5, loss={"distill_coef": 1.0})
    teacher = build_teachers(config)
    packed = pack_sequences([[1, 4, 5]], [[6, 7, 2]], max_tokens=64)[0]
    with torch.no_grad():
        sharp = packed_logprobs(trainer.model.eval(), packed, 0.5)
        assert torch.allclose(teacher.score(packed, ["d"]), sharp, atol=1e-6)
        assert not torch.allclose(sharp, packed_logprobs(trainer.model, packed, 1.0), atol=1e-3)
    with pytest.raises(ValueError, match="teacher_temperature"):
        TrainerConfig(teacher_temperature=0)


def test_rollbook_export_writes_the_directory_the_run_wrote_for_the_same_step(tmp_path):
    """A model.path whose generation config names several end-of-sequence ids and sampling defaults:
    `rollbook export` of step 2 writes what the run's own hf/step-000002 holds, file for file."""
    from safetensors.torch import load_file

    from tests.hf_fixtures import save_tiny_model_dir

    base = save_tiny_model_dir(tmp_path / "base", vocab_size=64)
    generation = json.loads((base / "generation_config.json").read_text())
    generation.update(eos_token_id=[generation["eos_token_id"], 5], do_sample=True, temperature=0.7, top_p=0.9)
    (base / "generation_config.json").write_text(json.dumps(generation))
    run = tmp_path / "run"
    config = TrainerConfig(run_dir=str(run), num_samples=4, num_steps=2, model={"path": str(base)}, lr=0.05)
    from rollbook.language_models import build_student

    Trainer(config, FakeStore(), model=build_student(config.model)).run()
    (run / "config.json").write_text(config.model_dump_json())  # as `rollbook train` writes it
    assert rollbook(["export", str(run / "checkpoints" / "step-000002"), "--to", str(tmp_path / "out")]) == 0

    ours, theirs = run / "hf" / "step-000002", tmp_path / "out"
    assert sorted(p.name for p in theirs.iterdir()) == sorted(p.name for p in ours.iterdir())
    written = json.loads((ours / "generation_config.json").read_text())
    assert (written["eos_token_id"], written["temperature"], written["top_p"]) == (generation["eos_token_id"], 0.7, 0.9)
    for p in ours.iterdir():
        if p.suffix == ".safetensors":
            assert _same(load_file(theirs / p.name), load_file(p)), p.name
        else:
            assert (theirs / p.name).read_text() == p.read_text(), p.name
