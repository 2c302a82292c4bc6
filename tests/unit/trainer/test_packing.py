"""Unit tests of rollbook.trainer.packing: packed layout, micro-batching, packed log-probs.

Run: python -m pytest tests/unit/trainer/test_packing.py -q
"""

from __future__ import annotations

import pytest
import torch

from rollbook.language_models import TinyModelSpec, build_tiny_model
from rollbook.trainer.packing import block_causal_mask, pack_sequences, packed_logprobs

VOCAB = 32
PROMPTS = [[1, 5, 7], [1, 9], [1, 4, 4, 8, 3]]
OUTPUTS = [[6, 2], [3, 3, 11, 2], [12]]


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(TinyModelSpec(vocab_size=VOCAB), seed=0)


def unpacked_logprobs(model, prompt, output, temperature=1.0):
    """Reference: one sequence alone, no mask, no position ids; logits at prompt_len-1 .. end-1."""
    ids = torch.tensor([prompt + output])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    return (logits / temperature).log_softmax(-1).gather(-1, torch.tensor(output)[:, None])[:, 0]


def test_layout_concatenates_sequences_and_indexes_the_predicting_positions():
    [packed] = pack_sequences(PROMPTS, OUTPUTS)
    # row: [1 5 7 6 2 | 1 9 3 3 11 2 | 1 4 4 8 3 12]; T = 5 + 6 + 6 = 17
    assert packed.input_ids.tolist() == [[1, 5, 7, 6, 2, 1, 9, 3, 3, 11, 2, 1, 4, 4, 8, 3, 12]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]]
    assert packed.cu_seqlens.tolist() == [0, 5, 11, 17]
    # output tokens sit at 3,4 | 7,8,9,10 | 16; their logits one position earlier
    assert packed.output_index.tolist() == [2, 3, 6, 7, 8, 9, 15]
    assert packed.output_token_ids.tolist() == [6, 2, 3, 3, 11, 2, 12]
    assert packed.seq_index.tolist() == [0, 0, 1, 1, 1, 1, 2]
    assert packed.sequence_ids.tolist() == [0, 1, 2]
    assert (packed.num_sequences, packed.num_tokens, packed.num_output_tokens) == (3, 17, 7)
    assert packed.behavior_logprobs is None and packed.loss_mask.all()


def test_per_sequence_fields_broadcast_and_per_token_fields_concatenate():
    [packed] = pack_sequences(
        PROMPTS,
        OUTPUTS,
        behavior_logprobs=[[-1.0, -2.0], [-3.0, -4.0, -5.0, -6.0], [-7.0]],
        versions=[[0, 1], [1, 1, 1, 2], [3]],
        advantages=[0.5, -1.0, 2.0],
        temperatures=[1.0, 0.7, 0.0],
    )
    assert packed.behavior_logprobs.tolist() == [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0]
    assert packed.versions.tolist() == [0, 1, 1, 1, 1, 2, 3]
    assert packed.advantages.tolist() == [0.5, 0.5, -1.0, -1.0, -1.0, -1.0, 2.0]
    torch.testing.assert_close(packed.temperature, torch.tensor([1.0, 1.0, 0.7, 0.7, 0.7, 0.7, 0.0]))


def test_max_tokens_splits_between_sequences_first_fit_decreasing():
    # lengths 5, 6, 6; max 11: 6 opens batch A, the next 6 opens B, 5 fits in A
    batches = pack_sequences(PROMPTS, OUTPUTS, max_tokens=11, advantages=[0.0, 1.0, 2.0])
    assert [b.sequence_ids.tolist() for b in batches] == [[0, 1], [2]]
    assert [b.num_tokens for b in batches] == [11, 6]
    assert batches[1].output_index.tolist() == [4] and batches[1].advantages.tolist() == [2.0]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_tokens": 5}, "sequence 1 has 6 tokens"),
        ({"advantages": [1.0]}, "advantages has 1 entries"),
        ({"versions": [[0, 0], [0], [0]]}, r"versions\[1\] has 1 values for 4"),
    ],
)
def test_invalid_packing_is_a_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        pack_sequences(PROMPTS, OUTPUTS, **kwargs)


def test_empty_prompt_is_a_value_error():
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        pack_sequences([[]], [[1]])


def test_block_causal_mask_allows_only_earlier_tokens_of_the_same_sequence():
    mask = block_causal_mask(torch.tensor([0, 2, 3], dtype=torch.int32))
    allowed = (mask[0, 0] == 0).int().tolist()
    assert allowed == [[1, 0, 0], [1, 1, 0], [0, 0, 1]]
    assert mask.min() == torch.finfo(torch.float32).min


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logprobs_equal_unpacked_forwards_and_carry_grad(model, attn):
    model.config._attn_implementation = attn
    try:
        [packed] = pack_sequences(PROMPTS, OUTPUTS)
        got = packed_logprobs(model, packed)
        want = torch.cat([unpacked_logprobs(model, p, o) for p, o in zip(PROMPTS, OUTPUTS)])
        torch.testing.assert_close(got, want.detach(), atol=1e-5, rtol=0)
        model.zero_grad()
        got.sum().backward()
        grad = model.get_input_embeddings().weight.grad
        assert grad is not None and grad.abs().sum() > 0
    finally:
        model.config._attn_implementation = "sdpa"
        model.zero_grad()


def test_packed_logprobs_divide_by_per_token_temperature_and_treat_zero_as_one(model):
    [packed] = pack_sequences(PROMPTS, OUTPUTS, temperatures=[0.7, 1.3, 0.0])
    with torch.no_grad():
        got = packed_logprobs(model, packed, packed.temperature)
        want = torch.cat([unpacked_logprobs(model, p, o, t) for p, o, t in zip(PROMPTS, OUTPUTS, [0.7, 1.3, 1.0])])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_select_repacks_a_subset_that_scores_like_the_whole(model):
    [packed] = pack_sequences(PROMPTS, OUTPUTS, advantages=[0.0, 1.0, 2.0])
    sub = packed.select([2, 0])
    assert sub.input_ids.tolist() == [[1, 4, 4, 8, 3, 12, 1, 5, 7, 6, 2]]
    assert sub.output_index.tolist() == [4, 8, 9] and sub.seq_index.tolist() == [0, 1, 1]
    assert sub.sequence_ids.tolist() == [2, 0] and sub.advantages.tolist() == [2.0, 0.0, 0.0]
    with torch.no_grad():
        whole = packed_logprobs(model, packed)
        part = packed_logprobs(model, sub)
    torch.testing.assert_close(part, whole[[6, 0, 1]], atol=1e-5, rtol=0)


def test_packed_logprobs_reject_attention_without_4d_masks(model):
    model.config._attn_implementation = "flash_attention_2"
    try:
        with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
            packed_logprobs(model, pack_sequences(PROMPTS, OUTPUTS)[0])
    finally:
        model.config._attn_implementation = "sdpa"
