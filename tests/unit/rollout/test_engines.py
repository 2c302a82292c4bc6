"""``rollout.engine`` (rollout/engines.py): a command refuses ``vllm`` it cannot build in one line,
exit 2, before it builds anything; ``build_engine`` makes the native engine from a model config or a
live model, and ``VllmEngine`` from the model directory with the run's settings, installing weights
by version. Engines are sized by the workload (the longest prompt plus ``max_new_tokens``, one round's
requests; the proxy's ``max_context_tokens``), and a workload longer than the model's positions is
refused in one line. vLLM itself is not installed here: the vLLM cases run the adapter against a
stand-in ``vllm`` module that records what it is asked, sleep and wake-up included (the ``gpu``-marked
tests in test_vllm_engine.py run the real one)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
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


def _cli(argv: list[str], tmp_path) -> subprocess.CompletedProcess:
    """``python -m rollbook.cli ARGV`` (a run gets its run directory under ``tmp_path``)."""
    run_dir = ["--run_dir", str(tmp_path / "run")] if argv[0] == "run" else []
    return subprocess.run(
        [sys.executable, "-m", "rollbook.cli", *argv, *run_dir], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


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
    done = _cli(argv, tmp_path)
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
    functions on a model that records ``load_weights``; ``events`` records generate, load, sleep and
    wake_up calls in order (generating or loading while asleep is an error, as in vLLM)."""

    made: list[dict] = []
    refuse_logprobs_mode = False

    def __init__(self, model: str, **kwargs):
        if self.refuse_logprobs_mode and "logprobs_mode" in kwargs:
            raise TypeError("EngineArgs.__init__() got an unexpected keyword argument 'logprobs_mode'")
        FakeLLM.made.append({"model": model, **kwargs})
        self.loaded: list[dict] = []
        self.params: list = []
        self.events: list[str] = []
        self.asleep = False

    def generate(self, prompts, params, use_tqdm=False):
        assert not self.asleep, "generate while asleep"
        self.events.append("generate")
        self.params += params
        step = {7: types.SimpleNamespace(logprob=-0.5)}
        out = types.SimpleNamespace(token_ids=[7, 7], logprobs=[step, step], finish_reason="stop")
        return [types.SimpleNamespace(outputs=[out]) for _ in prompts]

    def apply_model(self, func):
        assert not self.asleep, "load while asleep"
        self.events.append("load")
        model = types.SimpleNamespace(load_weights=lambda items: self.loaded.append(dict(items)))
        return [func(model)]

    def sleep(self, level: int = 1):
        assert FakeLLM.made[-1].get("enable_sleep_mode"), "sleep without enable_sleep_mode"
        self.events.append(f"sleep{level}")
        self.asleep = True

    def wake_up(self, tags=None):
        self.events.append("wake_up")
        self.asleep = False


def _model_dir(path: pathlib.Path, positions: int = 1024) -> pathlib.Path:
    """A model directory as far as the sizing reads it: a config.json with max_position_embeddings."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": positions}))
    return path


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

    rollout = RolloutConfig(engine="vllm", dtype="bfloat16", seed=5, vllm_gpu_memory_utilization=0.3, max_new_tokens=20)
    student = torch.nn.Linear(2, 2)
    engine = build_engine(ModelConfig(path=str(_model_dir(tmp_path))), rollout, version=0, weights=student)
    [made] = FakeLLM.made
    assert made == {
        "model": str(tmp_path),
        "logprobs_mode": "processed_logprobs",  # the distribution sampled from, as the native engine records
        "dtype": "bfloat16",
        "seed": 5,
        "gpu_memory_utilization": 0.3,
        "max_model_len": 64 + 20,  # the longest request: the toy tasks' prompt budget + max_new_tokens
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
    engine = build_engine(ModelConfig(path=str(_model_dir(tmp_path))), RolloutConfig(engine="vllm"), version=2)
    assert engine.version == 2 and "logprobs_mode" not in FakeLLM.made[0]


def test_vllm_without_a_model_directory_is_refused_when_built(fake_vllm):
    with pytest.raises(ConfigError, match="needs model.path"):
        build_engine(TINY, RolloutConfig(engine="vllm"), version=0)


def test_the_online_mode_refuses_a_rollout_engine_it_would_not_use():
    from rollbook.config import RunConfig

    with pytest.raises(ValueError, match=r"rollout.engine = 'vllm' applies to the rollout worker; the online mode"):
        RunConfig.model_validate({"online": {}, "rollout": {"engine": "vllm"}})


# ---- vLLM's sleep mode: release_memory between rounds ----------------------------------------------


def test_vllm_release_memory_sleeps_and_the_next_generate_or_weights_wake_it(fake_vllm, tmp_path):
    model = ModelConfig(path=str(_model_dir(tmp_path)))
    engine = build_engine(model, RolloutConfig(engine="vllm"), version=0, releases_memory=True)
    llm = engine._llm  # type: ignore[attr-defined]
    assert FakeLLM.made[0]["enable_sleep_mode"] is True
    request = GenerationRequest(prompt_token_ids=[1, 2], max_new_tokens=2)

    engine.generate([request])
    assert engine.release_memory() == 0  # no CUDA here: the bytes freed are not knowable
    assert engine.release_memory() == 0 and llm.events == ["generate", "sleep1"]  # asleep already: nothing more
    [result] = engine.generate([request])  # woken first
    assert result.output_token_ids == [7, 7] and llm.events[-2:] == ["wake_up", "generate"]

    engine.release_memory()
    engine.update_weights({"w": torch.ones(1)}, 1)  # the weights are back on the GPU before new ones load
    assert llm.events[-3:] == ["sleep1", "wake_up", "load"] and engine.version == 1
    [result] = engine.generate([request])
    assert result.output_versions == [1, 1] and llm.events[-1] == "generate"


def test_vllm_without_sleep_mode_frees_nothing_and_release_is_refused_mid_generation(fake_vllm, tmp_path):
    engine = build_engine(ModelConfig(path=str(_model_dir(tmp_path))), RolloutConfig(engine="vllm"), version=0)
    assert "enable_sleep_mode" not in FakeLLM.made[0]
    assert engine.release_memory() == 0 and engine._llm.events == []  # type: ignore[attr-defined]

    inside: list = []
    llm = engine._llm  # type: ignore[attr-defined]
    generate = llm.generate

    def generate_and_release(prompts, params, use_tqdm=False):
        with pytest.raises(RuntimeError, match="in flight"):
            engine.release_memory()
        inside.append(True)
        return generate(prompts, params, use_tqdm=use_tqdm)

    llm.generate = generate_and_release
    engine.generate([GenerationRequest(prompt_token_ids=[1], max_new_tokens=2)])
    assert inside == [True]


def test_the_colocated_placement_releases_a_vllm_engine_between_rounds(fake_vllm, tmp_path):
    from rollbook.run.colocated import Colocated

    engine = build_engine(
        ModelConfig(path=str(_model_dir(tmp_path))), RolloutConfig(engine="vllm"), version=0, releases_memory=True
    )

    class Worker:
        exhausted = False

        def __init__(self):
            self.engine = engine

        def produce(self):
            engine.generate([GenerationRequest(prompt_token_ids=[1], max_new_tokens=2)])
            return []

    reported: list[dict] = []
    trainer = types.SimpleNamespace(report_with_next_step=reported.append)
    client = types.SimpleNamespace(submit=lambda trajectories: None)
    placement = Colocated(Worker(), client, trainer=trainer, release_kv=True)
    assert placement.before_step() and placement.before_step()
    assert engine._llm.events == ["generate", "sleep1", "wake_up", "generate", "sleep1"]  # type: ignore[attr-defined]
    assert reported == [{"rollout/kv_released_bytes": 0}] * 2


# ---- sizing by the workload, and what a model cannot hold ------------------------------------------


def test_the_native_engine_is_sized_by_the_rollouts_workload_not_the_models_positions():
    from rollbook.config import DatasetConfig, RewardConfig
    from rollbook.rollout.engines import rollout_batch_size, rollout_seq_len

    rollout = RolloutConfig(group_size=2, num_prompts=3, max_prompt_tokens=10, max_new_tokens=5)
    engine = build_engine(TINY, rollout, version=0)
    assert isinstance(engine, NativeEngine)
    assert (engine._max_batch_size, engine._max_seq_len) == (6, 15)  # one round's requests, prompt + completion
    assert rollout_seq_len(RolloutConfig()) == 64 + 6  # the toy tasks' prompt budget by default

    chunked = RolloutConfig(
        dataset=DatasetConfig(train_files=["rows.jsonl"]),
        rewards={"math": RewardConfig(kind="math")},
        group_size=4,
        num_prompts=8,
        chunk_prompts=2,
    )
    assert rollout_batch_size(chunked) == 8  # one chunk's requests generate at once
    assert rollout_seq_len(chunked) == 256 + 6  # a dataset's prompt budget by default
    assert rollout_batch_size(chunked.model_copy(update={"max_batch_size": 3})) == 3


def test_a_rollout_longer_than_the_models_positions_is_refused_naming_the_fields(tmp_path):
    from rollbook.language_models import build_student
    from rollbook.rollout.engines import check_fits, model_positions

    too_long = RolloutConfig(max_prompt_tokens=500, max_new_tokens=20)
    message = (
        r"rollout.max_prompt_tokens \(500\) \+ rollout.max_new_tokens \(20\) = 520 is longer than the model's "
        r"max_position_embeddings \(512, "
    )
    with pytest.raises(ConfigError, match=message + "the tiny model built when model.path is unset"):
        check_fits(TINY, too_long)
    with pytest.raises(ConfigError, match=message):
        build_engine(TINY, too_long, version=0)
    with pytest.raises(ConfigError, match=message):
        build_engine(TINY, too_long, version=0, weights=build_student(TINY))
    check_fits(TINY, RolloutConfig(max_prompt_tokens=500, max_new_tokens=12))  # exactly 512: fits

    directory = _model_dir(tmp_path / "m", positions=64)
    assert model_positions(ModelConfig(path=str(directory))) == 64
    with pytest.raises(ConfigError, match=r"= 70 is longer than the model's max_position_embeddings \(64, trainer.model.path '"):
        check_fits(ModelConfig(path=str(directory)), RolloutConfig(), field="trainer.model.path")
    (directory / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 32}}))
    assert model_positions(ModelConfig(path=str(directory))) == 32
    (directory / "config.json").write_text("{}")
    assert model_positions(ModelConfig(path=str(directory))) is None
    check_fits(ModelConfig(path=str(directory)), RolloutConfig())  # nothing to check against


def test_the_native_engine_refuses_a_max_seq_len_past_the_models_positions():
    from rollbook.language_models import build_student

    model = build_student(TINY)
    with pytest.raises(ValueError, match=r"max_seq_len 513 is longer than the model's max_position_embeddings 512"):
        NativeEngine(model, max_seq_len=513)
    assert NativeEngine(model, max_seq_len=512)._max_seq_len == 512
    assert NativeEngine(model)._max_seq_len == 512  # not given: the model's positions


def test_the_proxy_engine_is_sized_by_its_context_and_concurrency_and_refuses_what_the_model_cannot_hold():
    from rollbook.config import ProxyConfig
    from rollbook.rollout.engines import check_proxy_fits
    from rollbook.rollout.proxy.server import build_engine as build_proxy_engine

    # in this process (engine_process = False) to read its sizes; tests/unit/rollout/test_engine_process.py
    # covers the engine in a process of its own, which the proxy builds by default
    config = ProxyConfig(model=TINY, max_context_tokens=100, max_concurrent=2, max_n=3, max_batch_size=64, engine_process=False)
    engine = build_proxy_engine(config)
    assert isinstance(engine, NativeEngine) and (engine._max_batch_size, engine._max_seq_len) == (6, 100)
    engine = build_proxy_engine(config.model_copy(update={"max_batch_size": 4}))
    assert engine._max_batch_size == 4  # type: ignore[attr-defined]

    too_long = config.model_copy(update={"max_context_tokens": 1000})
    message = r"max_context_tokens \(1000\) is longer than the model's max_position_embeddings \(512, the tiny model"
    with pytest.raises(ConfigError, match=message):
        check_proxy_fits(too_long)
    with pytest.raises(ConfigError, match=message):
        build_proxy_engine(too_long)


def test_a_dataset_prompt_longer_than_max_prompt_tokens_is_a_bad_row_and_a_toy_one_is_refused(tmp_path):
    from rollbook.config import DatasetConfig, RewardConfig
    from rollbook.rollout.worker import RolloutWorker

    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        json.dumps({"prompt": "1+1=", "answer": "2", "domain": "math"})
        + "\n"
        + json.dumps({"prompt": "1+1=" * 20, "answer": "2", "domain": "math"})
        + "\n"
    )
    dataset = DatasetConfig(train_files=[str(rows)], heldout_fraction=0.0)
    rollout = RolloutConfig(dataset=dataset, rewards={"math": RewardConfig(kind="math")}, max_prompt_tokens=10, reward_workers=0)
    worker = RolloutWorker(build_engine(TINY, rollout, version=0), rollout, model_id="tiny")
    [bad] = worker.bad_rows
    assert bad.line == 2 and "prompt of 81 tokens is longer than rollout.max_prompt_tokens (10)" in bad.reason
    assert len(worker.train_rows) == 1

    with pytest.raises(ConfigError, match=r"rollout.max_prompt_tokens \(3\) is shorter than the longest toy task prompt"):
        RolloutWorker(
            build_engine(TINY, RolloutConfig(max_prompt_tokens=3), version=0), RolloutConfig(max_prompt_tokens=3), model_id="tiny"
        )


@pytest.mark.parametrize(
    "argv,line",
    [
        (
            ["run", "--config", "configs/smoke.toml", "--rollout.max_new_tokens", "500"],
            "rollbook run: error: rollout.max_prompt_tokens (64) + rollout.max_new_tokens (500) = 564 is longer than "
            "the model's max_position_embeddings (512, the tiny model built when trainer.model.path is unset): lower them to fit",
        ),
        (
            ["rollout", "--weights", "shm:none", "--rollout.max_prompt_tokens", "600"],
            "rollbook rollout: error: rollout.max_prompt_tokens (600) + rollout.max_new_tokens (6) = 606 is longer than "
            "the model's max_position_embeddings (512, the tiny model built when model.path is unset): lower them to fit",
        ),
        (
            ["proxy", "--max_context_tokens", "2048"],
            "rollbook proxy: error: max_context_tokens (2048) is longer than the model's max_position_embeddings "
            "(512, the tiny model built when model.path is unset): lower it to fit",
        ),
    ],
    ids=["run", "rollout", "proxy"],
)
def test_a_workload_the_model_cannot_hold_is_refused_in_one_line_before_anything_starts(argv, line, tmp_path):
    done = _cli(argv, tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [line]
    assert not (tmp_path / "run" / "rollbook.duckdb").exists()  # no store was started


def test_a_worker_whose_first_weight_install_is_torn_fetches_again(tmp_path, monkeypatch):
    """The trainer may publish twice while a starting worker copies its first version out of shared
    memory (``TornSnapshot``): the worker fetches the newest version again instead of exiting."""
    import threading
    import uuid

    from rollbook.config import ModelConfig, WorkerConfig
    from rollbook.language_models import build_student
    from rollbook.rollout import engines, main
    from rollbook.weights.base import TornSnapshot
    from rollbook.weights.shm import SharedMemoryPublisher

    name = f"rb-test-{uuid.uuid4().hex[:8]}"
    state = build_student(ModelConfig()).state_dict()
    publisher = SharedMemoryPublisher(name, state)
    publisher.publish(3, state)
    real, calls = engines.install_snapshot, []

    def torn_once(engine, snapshot):
        calls.append(snapshot.version)
        if len(calls) == 1:  # as load_into raises it, wrapped by the engine's update_weights
            raise RuntimeError(f"weight update to version {snapshot.version} failed") from TornSnapshot("overwritten")
        real(engine, snapshot)

    monkeypatch.setattr(engines, "install_snapshot", torn_once)
    publisher.publish(4, state)

    class Installed(Exception):
        pass

    def stop_here(version):
        raise Installed(version)

    config = WorkerConfig(weights=f"shm:{name}", spool_dir=str(tmp_path / "spool"), first_weights_timeout_s=10)
    try:
        with pytest.raises(Installed) as installed:
            main.run_worker(config, threading.Event(), on_weights=stop_here)
    finally:
        publisher.close()
    assert calls == [4, 4] and installed.value.args == (4,)
