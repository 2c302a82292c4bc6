"""Models from local Hugging Face directories through a real `rollbook run` (store process, DuckDB
file, real training): a tiny Qwen2-style student, teacher and KL reference saved with
``save_pretrained``, the KL statistic 0 on the first step, Hugging Face exports that load with
``AutoModelForCausalLM`` / ``AutoTokenizer`` and generate, and ``rollbook export`` of a kept
checkpoint with the checkpoint's very weights. Nothing comes from a hub.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from rollbook.tasks import TOKENIZER
from rollbook.trainer.export import _save_tokenizer
from tests.integration.conftest import query_file, rollbook_cli

# The rollout worker decodes with the toy tasks' character tokenizer (rollbook/tasks.py), which knows
# only its own ids, so the student here has exactly that vocabulary.
VOCAB = TOKENIZER.vocab_size


def _save_tiny_qwen2(path: pathlib.Path, seed: int, *, tokenizer: bool = True) -> pathlib.Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(path)
    if tokenizer:
        _save_tokenizer(TOKENIZER, path)
    return path


def _config(tmp_path: pathlib.Path, student: pathlib.Path, teacher: pathlib.Path) -> pathlib.Path:
    run_dir = tmp_path / "run"
    text = f"""
run_dir = "{run_dir}"
placement = "colocated"
num_steps = 3
eval_every = 3

[trainer]
num_samples = 8
lr = 1e-2
reference = "{student}"
export_every = 1
export_keep_last = 2

[trainer.model]
path = "{student}"

[trainer.loss]
kl_coef = 0.1
kl_estimator = "k3"
distill_coef = 0.5

[[trainer.teachers]]
path = "{teacher}"

[rollout]
domains = ["arithmetic"]
num_digits = 1
num_train_tasks = 20
num_eval_tasks = 4
num_eval_samples = 0
group_size = 4
num_prompts = 2
max_new_tokens = 4
"""
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("hf")
    student = _save_tiny_qwen2(tmp_path / "student", seed=0)
    teacher = _save_tiny_qwen2(tmp_path / "teacher", seed=1, tokenizer=False)
    done = rollbook_cli("run", "--config", str(_config(tmp_path, student, teacher)), timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return tmp_path / "run", student


def test_the_store_registers_the_loaded_models_vocabulary(hf_run):
    run_dir, student = hf_run
    db = run_dir / "rollbook.duckdb"
    vocab = json.loads((student / "config.json").read_text())["vocab_size"]
    assert query_file(db, "SELECT vocab_size FROM models") == [{"vocab_size": vocab}]
    assert query_file(db, "SELECT count(*) AS n FROM trajectories")[0]["n"] > 0
    rejected = query_file(db, "SELECT reason, count(*) AS n FROM rejections GROUP BY reason")
    assert not [r for r in rejected if "VOCAB" in r["reason"]], rejected


def test_kl_to_a_reference_equal_to_the_starting_student_starts_at_0(hf_run):
    run_dir, _ = hf_run
    steps = query_file(run_dir / "rollbook.duckdb", "SELECT step, stats FROM train_steps ORDER BY step")
    stats = [json.loads(s["stats"]) if isinstance(s["stats"], str) else s["stats"] for s in steps]
    assert len(stats) == 3
    assert stats[0]["kl/mean"] == pytest.approx(0.0, abs=1e-6)
    assert stats[-1]["kl/mean"] > 0  # lr 1e-2 moved the student away from the frozen reference
    assert all("mopd/loss" in s for s in stats)  # the teacher directory was loaded and scored


def test_exports_load_with_from_pretrained_and_generate(hf_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir, student = hf_run
    exports = sorted(p.name for p in (run_dir / "hf").iterdir())
    assert exports == ["step-000002", "step-000003"]  # every step, the newest 2 kept
    out = run_dir / "hf" / "step-000003"
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the student's own tokenizer files, copied
        assert (out / name).read_bytes() == (student / name).read_bytes()
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    prompt = tokenizer("3+4=", return_tensors="pt")
    assert prompt.input_ids[0].tolist() == TOKENIZER.encode("3+4=", add_bos=True)
    generated = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] > prompt.input_ids.shape[1]
    checkpoint = torch.load(run_dir / "checkpoints" / "step-000003" / "state.pt", weights_only=False)["model"]
    exported = model.state_dict()
    assert checkpoint.keys() == exported.keys()
    assert all(torch.equal(checkpoint[k], exported[k]) for k in checkpoint)


def test_rollbook_export_converts_a_kept_checkpoint(hf_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir, _ = hf_run
    done = rollbook_cli("export", str(run_dir / "checkpoints" / "step-000002"), "--to", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out", local_files_only=True)
    checkpoint = torch.load(run_dir / "checkpoints" / "step-000002" / "state.pt", weights_only=False)["model"]
    assert all(torch.equal(checkpoint[k], v) for k, v in model.state_dict().items())
    assert model.generate(**tokenizer("1+1=", return_tensors="pt"), max_new_tokens=2, do_sample=False).shape[1] > 3
    # the run directory means its LATEST checkpoint
    done = rollbook_cli("export", str(run_dir), "--to", str(tmp_path / "latest"))
    assert done.returncode == 0, done.stderr
    latest = AutoModelForCausalLM.from_pretrained(tmp_path / "latest", local_files_only=True).state_dict()
    newest = torch.load(run_dir / "checkpoints" / "step-000003" / "state.pt", weights_only=False)["model"]
    assert all(torch.equal(newest[k], v) for k, v in latest.items())


def test_a_teacher_path_that_is_not_a_model_directory_is_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    config = _config(tmp_path, _save_tiny_qwen2(tmp_path / "student", seed=0), tmp_path / "empty")
    done = rollbook_cli("run", "--config", str(config), timeout=300)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"rollbook run: error: teacher {str(tmp_path / 'empty')!r}: not a Hugging Face model directory (no config.json)"
    )


def test_the_vocabulary_registered_for_a_model_directory_is_its_config_json(tmp_path):
    from transformers import Qwen2Config

    from rollbook.config import ModelConfig
    from rollbook.language_models import student_vocab_size

    Qwen2Config(vocab_size=151_936, hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(tmp_path)
    assert student_vocab_size(ModelConfig(path=str(tmp_path))) == 151_936
    assert student_vocab_size(ModelConfig(vocab_size=77)) == 77
    assert student_vocab_size(ModelConfig()) == TOKENIZER.vocab_size


def test_separated_placement_the_worker_process_loads_the_same_directory(tmp_path):
    student = _save_tiny_qwen2(tmp_path / "student", seed=0)
    config = _config(tmp_path, student, _save_tiny_qwen2(tmp_path / "teacher", seed=1, tokenizer=False))
    done = rollbook_cli(
        "run", "--config", str(config), "--placement", "separated", "--num_steps", "2", "--trainer.export_every", "1", timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = tmp_path / "run"
    assert json.loads((run_dir / "worker.json").read_text())["model"]["path"] == str(student)
    assert query_file(run_dir / "rollbook.duckdb", "SELECT count(*) AS n FROM train_steps")[0]["n"] == 2
    assert sorted(p.name for p in (run_dir / "hf").iterdir()) == ["step-000001", "step-000002"]
