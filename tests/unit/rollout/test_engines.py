"""``rollout.engine`` (rollout/engines.py): a command refuses ``vllm`` it cannot build in one line,
exit 2, before it builds anything; ``build_engine`` makes the native engine from a model config or a
live model, and ``VllmEngine`` from the model directory with the run's settings, installing weights
by version. vLLM itself is not installed here: the vLLM cases run the adapter against a stand-in
``vllm`` module that records what it is asked (the ``gpu``-marked tests in test_vllm_engine.py run
the real one)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import pathlib
import subprocess
import sys
import types

import pytest
import torch

from rollbook.config import ModelConfig, RolloutConfig
from rollbook.errors import ConfigError
from rollbook.rollout.engine import GenerationEngine, GenerationRequest, NativeEngine
from rollbook.rollout.engines import build_engine, check_engine, install_snapshot
from rollbook.weights.base import WeightSnapshot

ROOT = pathlib.Path(__file__).resolve().parents[3]
VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None

TINY = ModelConfig(hidden_size=16, intermediate_size=32, num_layers=1)


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--config", "configs/smoke.toml", "--rollout.engine", "vllm"],
        ["rollout", "--weights", "shm:none", "--rollout.engine", "vllm"],
        ["proxy", "--engine", "vllm"],
    ],
    ids=["run", "rollout", "proxy"],
)
def test_a_vllm_engine_this_machine_cannot_build_is_refused_in_one_line_before_anything_starts(argv, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "rollbook.cli", *argv, *(["--run_dir", str(tmp_path / "run")] if argv[0] == "run" else [])],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    [line] = done.stderr.strip().splitlines()
    field = "engine" if argv[0] == "proxy" else "rollout.engine"
    if VLLM_INSTALLED:  # then what is missing is the directory vLLM would load
        assert line.startswith(f"rollbook {argv[0]}: error: {field} = 'vllm' needs model.path"), line
    else:
        assert line.startswith(f"rollbook {argv[0]}: error: {field} = 'vllm': the vllm package is not installed here"), line
    assert not (tmp_path / "run").exists()  # no run directory, no store, no model


def test_native_engine_from_a_model_config_or_a_copy_of_a_live_model():
    from rollbook.language_models import build_student

    engine = build_engine(TINY, RolloutConfig(), version=-1)
    assert isinstance(engine, NativeEngine) and engine.version == -1

    student = build_student(TINY)
    engine = build_engine(TINY, RolloutConfig(dtype="bfloat16"), version=0, weights=student)
    assert isinstance(engine, GenerationEngine) and engine.version == 0
    assert next(student.parameters()).dtype == torch.float32  # a bfloat16 copy: the trained student is untouched
    [result] = engine.generate([GenerationRequest(prompt_token_ids=[1, 5], max_new_tokens=3)])
    assert result.output_versions == [0] * len(result.output_token_ids)


class FakeLLM:
    """Stands in for ``vllm.LLM``: records its arguments, samples token 7 twice, runs ``apply_model``
    functions on a model that records ``load_weights``."""

    made: list[dict] = []
    refuse_logprobs_mode = False

    def __init__(self, model: str, **kwargs):
        if self.refuse_logprobs_mode and "logprobs_mode" in kwargs:
            raise TypeError("EngineArgs.__init__() got an unexpected keyword argument 'logprobs_mode'")
        FakeLLM.made.append({"model": model, **kwargs})
        self.loaded: list[dict] = []
        self.params: list = []

    def generate(self, prompts, params, use_tqdm=False):
        self.params += params
        step = {7: types.SimpleNamespace(logprob=-0.5)}
        out = types.SimpleNamespace(token_ids=[7, 7], logprobs=[step, step], finish_reason="stop")
        return [types.SimpleNamespace(outputs=[out]) for _ in prompts]

    def apply_model(self, func):
        model = types.SimpleNamespace(load_weights=lambda items: self.loaded.append(dict(items)))
        return [func(model)]


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    module.LLM = FakeLLM  # type: ignore[attr-defined]
    module.SamplingParams = lambda **kw: kw  # type: ignore[attr-defined]
    module.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    FakeLLM.made, FakeLLM.refuse_logprobs_mode = [], False
    return module


def test_vllm_needs_a_model_directory(fake_vllm):
    check_engine("native", None)  # nothing to check
    with pytest.raises(ConfigError, match=r"rollout.engine = 'vllm' needs model.path"):
        check_engine("vllm", None)
    check_engine("vllm", "models/x")


def test_vllm_engine_gets_the_run_settings_records_evidence_and_takes_weights_by_version(fake_vllm, tmp_path):
    import os

    rollout = RolloutConfig(engine="vllm", dtype="bfloat16", seed=5, vllm_gpu_memory_utilization=0.3)
    student = torch.nn.Linear(2, 2)
    engine = build_engine(ModelConfig(path=str(tmp_path)), rollout, version=0, weights=student)
    [made] = FakeLLM.made
    assert made == {
        "model": str(tmp_path),
        "logprobs_mode": "processed_logprobs",  # the distribution sampled from, as the native engine records
        "dtype": "bfloat16",
        "seed": 5,
        "gpu_memory_utilization": 0.3,
        "skip_tokenizer_init": True,
    }
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # apply_model runs in this process
    llm = engine._llm  # type: ignore[attr-defined]
    assert engine.version == 0 and list(llm.loaded[0]) == ["weight", "bias"]  # the student's weights, installed as version 0

    [result] = engine.generate([GenerationRequest(prompt_token_ids=[1, 2], max_new_tokens=4, stop_token_ids=[2, 9, 11])])
    assert result.output_token_ids == [7, 7] and result.output_logprobs == [-0.5, -0.5]
    assert result.output_versions == [0, 0] and result.finish_reason == "stop"
    assert llm.params[0]["stop_token_ids"] == [2, 9, 11] and llm.params[0]["detokenize"] is False

    state = {"weight": torch.ones(2, 2), "bias": torch.zeros(2)}
    snapshot = WeightSnapshot(version=3, state_dict=state, checksum=b"")
    install_snapshot(engine, snapshot)
    assert engine.version == 3 and torch.equal(llm.loaded[-1]["weight"], state["weight"])
    assert llm.loaded[-1]["weight"] is not state["weight"]  # a copy: the channel reuses its buffer later
    [result] = engine.generate([GenerationRequest(prompt_token_ids=[1], max_new_tokens=2)])
    assert result.output_versions == [3, 3]

    torn = WeightSnapshot(version=4, state_dict=state, checksum=b"", still_valid=lambda: False)
    with pytest.raises(RuntimeError, match="overwritten"):
        install_snapshot(engine, torn)
    assert engine.version == 3 and len(llm.loaded) == 2  # nothing installed
    with pytest.raises(ValueError, match="version must increase"):
        engine.update_weights(state, 3)
    with pytest.raises(TypeError, match="state dict"):
        engine.update_weights(lambda model: None, 5)


def test_a_vllm_without_logprobs_mode_still_builds(fake_vllm, tmp_path):
    FakeLLM.refuse_logprobs_mode = True
    engine = build_engine(ModelConfig(path=str(tmp_path)), RolloutConfig(engine="vllm"), version=2)
    assert engine.version == 2 and "logprobs_mode" not in FakeLLM.made[0]


def test_vllm_without_a_model_directory_is_refused_when_built(fake_vllm):
    with pytest.raises(ConfigError, match="needs model.path"):
        build_engine(TINY, RolloutConfig(engine="vllm"), version=0)


def test_the_online_mode_refuses_a_rollout_engine_it_would_not_use():
    from rollbook.config import RunConfig

    with pytest.raises(ValueError, match=r"rollout.engine = 'vllm' applies to the rollout worker; the online mode"):
        RunConfig.model_validate({"online": {}, "rollout": {"engine": "vllm"}})
