"""The trainer's recomputed log-probs match the rollout engine's recorded ones.

Tokens sampled by ``NativeEngine`` (batched, left-padded, KV cache) and scored again by
``packed_logprobs`` (all sequences packed in one row, block-diagonal mask) with the same weights must
agree at the sampling temperature (see ``trainer/packing.py``, "Temperature convention"):

- float32: max abs difference <= 1e-4 and mean <= 1e-5;
- bfloat16, on the CPU and on CUDA (the engine's copy held in bfloat16, the trainer's float32 master weights run under
  autocast, rollbook/devices.py): max <= 0.05 and mean <= 0.01. The two round differently (the
  engine's whole forward is bfloat16, the trainer's matmuls only), so they agree to bfloat16's
  precision, not to the last bit; on these models the gap measures up to about 0.007 / 0.0015.

With top-p truncation they must NOT agree: the engine records the truncated distribution, whose
log-probs are never below the full one's.

Run: python -m pytest tests/integration/test_logprob_consistency.py -q
"""

from __future__ import annotations

import copy

import pytest
import torch

from rollbook import devices
from rollbook.language_models import TinyModelSpec, build_tiny_model
from rollbook.rollout.engine import GenerationRequest, NativeEngine
from rollbook.trainer.packing import pack_sequences, packed_logprobs

VOCAB = 48
PROMPTS = [[1, 7], [1, 20, 5, 33, 9, 12, 40], [1, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 17], [1, 44, 2, 8]]
MAX_NEW = [12, 7, 16, 10]


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(TinyModelSpec(vocab_size=VOCAB), seed=3)


TOLERANCE = {"float32": (1e-4, 1e-5), "bfloat16": (0.05, 0.01)}  # (max, mean) abs difference


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def sample_and_recompute(
    model, temperature: float, top_p: float = 1.0, max_tokens: int | None = None, dtype: str = "float32", device: str = "cpu"
):
    model = devices.place_trained(copy.deepcopy(model), device)  # the trainer's: float32 master weights
    engine = NativeEngine(devices.place(copy.deepcopy(model), device, dtype), seed=0)
    requests = [
        GenerationRequest(prompt_token_ids=p, max_new_tokens=n, temperature=temperature, top_p=top_p, top_k=0)
        for p, n in zip(PROMPTS, MAX_NEW)
    ]
    results = engine.generate(requests)
    batches = pack_sequences(
        [r.prompt_token_ids for r in results],
        [r.output_token_ids for r in results],
        max_tokens=max_tokens,
        behavior_logprobs=[r.output_logprobs for r in results],
        temperatures=[r.temperature for r in results],
    )
    with torch.no_grad(), devices.autocast(torch.device(device), dtype):
        recomputed = torch.cat([packed_logprobs(model, b, b.temperature) for b in batches])
    recorded = torch.cat([b.behavior_logprobs for b in batches])
    return recomputed.cpu(), recorded


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_trainer_logprobs_match_the_engines_at_the_sampling_temperature(model, temperature, dtype, device):
    recomputed, recorded = sample_and_recompute(model, temperature, dtype=dtype, device=device)
    assert recorded.numel() == sum(MAX_NEW)  # no stop tokens: every sequence runs to max_new_tokens
    assert recomputed.dtype == torch.float32  # log-probs are float32 whatever the forward's dtype
    diff = (recomputed - recorded).abs()
    max_limit, mean_limit = TOLERANCE[dtype]
    assert diff.max() <= max_limit, f"max abs diff {diff.max():.3g}"
    assert diff.mean() <= mean_limit, f"mean abs diff {diff.mean():.3g}"


def test_match_holds_across_micro_batches(model):
    recomputed, recorded = sample_and_recompute(model, 0.7, max_tokens=30)
    diff = (recomputed - recorded).abs()
    assert diff.max() <= 1e-4 and diff.mean() <= 1e-5


def test_with_top_p_the_engine_records_the_truncated_distribution(model):
    # Renormalizing over the kept tokens raises each kept token's log-prob: recorded >= full.
    recomputed, recorded = sample_and_recompute(model, 1.0, top_p=0.5)
    assert bool((recorded >= recomputed - 1e-4).all())
    assert (recorded - recomputed).max() > 1e-2
