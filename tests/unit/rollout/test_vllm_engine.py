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
