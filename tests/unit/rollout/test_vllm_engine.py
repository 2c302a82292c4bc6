"""The vLLM engine honours the GenerationEngine contract (CUDA + vllm only; skipped elsewhere)."""

import pytest

from rollbook.rollout.engine import GenerationEngine, GenerationRequest

pytestmark = pytest.mark.gpu


def test_vllm_engine_records_one_logprob_and_version_per_token(tmp_path):
    pytest.importorskip("vllm")
    from rollbook.language_models import TinyModelSpec, build_tiny_model
    from rollbook.rollout.vllm_engine import VllmEngine

    build_tiny_model(TinyModelSpec(vocab_size=64)).save_pretrained(tmp_path)
    engine = VllmEngine(str(tmp_path), version=3, skip_tokenizer_init=True, enforce_eager=True)
    assert isinstance(engine, GenerationEngine)
    [result] = engine.generate([GenerationRequest(prompt_token_ids=[1, 5, 7], max_new_tokens=8, temperature=0.7)])
    assert len(result.output_logprobs) == len(result.output_token_ids) == len(result.output_versions) > 0
    assert all(lp <= 0 for lp in result.output_logprobs)
    assert set(result.output_versions) == {3}


def test_build_engine_vllm_takes_weights_by_version_and_records_the_sampled_distribution(tmp_path):
    """rollout/engines.py's vLLM engine: the trainer's weights installed at a version, every token
    tagged with it, stops on the given ids; new weights (embeddings zeroed, so every next token is
    equally likely) change the recorded log-probs to log(1/V), the distribution sampled from."""
    pytest.importorskip("vllm")
    import math

    import torch

    from rollbook.config import ModelConfig, RolloutConfig
    from rollbook.rollout.engines import build_engine, install_snapshot
    from rollbook.weights.base import WeightSnapshot
    from tests.hf_fixtures import save_head64_model_dir

    student = save_head64_model_dir(tmp_path, vocab_size=64)
    rollout = RolloutConfig(engine="vllm", vllm_gpu_memory_utilization=0.3)
    engine = build_engine(ModelConfig(path=str(tmp_path)), rollout, version=0, weights=student)
    request = GenerationRequest(prompt_token_ids=[1, 5, 7], max_new_tokens=16, temperature=1.0, stop_token_ids=[3, 4])
    [result] = engine.generate([request], seed=0)
    assert set(result.output_versions) == {0}
    assert all(t not in (3, 4) for t in result.output_token_ids[:-1])
    assert result.finish_reason == "length" or result.output_token_ids[-1] in (3, 4)

    flat = {k: torch.zeros_like(v) if "embed_tokens" in k or "lm_head" in k else v for k, v in student.state_dict().items()}
    install_snapshot(engine, WeightSnapshot(version=1, state_dict=flat, checksum=b""))
    [result] = engine.generate([GenerationRequest(prompt_token_ids=[1, 5, 7], max_new_tokens=4, temperature=1.0)], seed=0)
    assert set(result.output_versions) == {1}
    assert result.output_logprobs == pytest.approx([-math.log(64)] * len(result.output_logprobs), abs=1e-3)


def test_vllm_engine_releases_its_memory_and_wakes_to_generate_and_take_weights(tmp_path):
    """Sleep mode (colocated with trainer.offload_optimizer): ``release_memory`` puts vLLM to sleep and
    reports the GPU memory it gave back; the next generate wakes it with the same weights (the same
    greedy tokens), and weights installed after a release are the ones the next generate samples from."""
    pytest.importorskip("vllm")
    from rollbook.language_models import TinyModelSpec, build_tiny_model
    from rollbook.rollout.vllm_engine import VllmEngine

    model = build_tiny_model(TinyModelSpec(vocab_size=64))
    model.save_pretrained(tmp_path)
    engine = VllmEngine(
        str(tmp_path),
        version=0,
        sleep_mode=True,
        skip_tokenizer_init=True,
        enforce_eager=True,
        gpu_memory_utilization=0.3,
        max_model_len=64,
    )
    request = GenerationRequest(prompt_token_ids=[1, 5, 7], max_new_tokens=8, temperature=0.0)
    [before] = engine.generate([request])
    assert engine.release_memory() > 0  # the KV cache (and the weights, to host memory) left the GPU
    assert engine.release_memory() == 0  # asleep already
    [after] = engine.generate([request])  # woken first
    assert after.output_token_ids == before.output_token_ids and set(after.output_versions) == {0}

    assert engine.release_memory() > 0
    engine.update_weights(dict(model.state_dict()), 1)  # woken before the load
    [loaded] = engine.generate([request])
    assert loaded.output_token_ids == before.output_token_ids and set(loaded.output_versions) == {1}
