"""Unit tests of rollbook.trainer.packing: packed layout, micro-batching, packed log-probs (document
masking without a [T, T] mask, log-probs a chunk of positions at a time).

Run: python -m pytest tests/unit/trainer/test_packing.py -q
"""

from __future__ import annotations

import pytest
import torch

from rollbook import attention
from rollbook.language_models import TinyModelSpec, build_tiny_model
from rollbook.trainer import packing
from rollbook.trainer.packing import pack_sequences, packed_logprobs, packed_logprobs_and_kl

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


def test_attention_sees_each_sequence_alone_and_no_row_wide_mask(model, monkeypatch):
    """Every SDPA call of a packed forward is causal over sequences of one length, without a mask:
    scores exist per sequence (sum of L**2), never for the whole row (T**2)."""
    prompts, outputs = [[1, 2], [3, 4], [5, 6, 7], [8]], [[9, 9], [10, 10], [11], [12, 12, 12]]  # lengths 4, 4, 4, 4
    prompts.append([1, 2, 3, 4, 5])
    outputs.append([6, 7, 8])  # and one of 8
    calls = []
    real = attention.F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        calls.append((tuple(q.shape), kwargs.get("is_causal"), args[0] if args else kwargs.get("attn_mask")))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    [packed] = pack_sequences(prompts, outputs)
    with torch.no_grad():
        got = packed_logprobs(model, packed)
    heads, layers = model.config.num_attention_heads, model.config.num_hidden_layers
    assert sorted(shape[:3] for shape, _, _ in calls) == sorted([(4, heads, 4), (1, heads, 8)] * layers)
    assert all(causal is True and mask is None for _, causal, mask in calls)
    want = torch.cat([unpacked_logprobs(model, prompts[i], outputs[i]) for i in packed.sequence_ids.tolist()])
    torch.testing.assert_close(got, want.detach(), atol=1e-5, rtol=0)
    assert model.config._attn_implementation == "sdpa"  # restored: the engine's forwards keep their attention


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_log_probs_in_chunks_equal_the_whole_and_so_do_their_gradients(model, chunk):
    [packed] = pack_sequences(PROMPTS, OUTPUTS, temperatures=[0.7, 1.0, 1.3])

    def run(chunk_tokens):
        model.zero_grad()
        logp = packed_logprobs(model, packed, packed.temperature, chunk_tokens=chunk_tokens)
        (logp * torch.arange(1.0, 8.0)).sum().backward()
        return logp.detach(), [p.grad.clone() for p in model.parameters()]

    logp, grads = run(chunk)
    whole, whole_grads = run(10_000)
    model.zero_grad()
    torch.testing.assert_close(logp, whole, atol=1e-6, rtol=0)
    # a chunk's gradient reaches a weight as its own sum, added to the others': float32 rounding of
    # that order (1-thread kernels give ~2e-6 on entries near 0.05), nothing larger
    for g, w in zip(grads, whole_grads):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


def test_the_reverse_kl_in_chunks_is_the_whole_distributions_kl(model):
    from rollbook.trainer.losses import reverse_kl
    from rollbook.trainer.teachers import LocalTeacher

    teacher = LocalTeacher(build_tiny_model(TinyModelSpec(vocab_size=VOCAB), seed=4), temperature=0.5)
    [packed] = pack_sequences(PROMPTS, OUTPUTS)
    logp, kl, teacher_logp = packed_logprobs_and_kl(model, packed, 1.0, teacher.score_full(packed, ["d"] * 3), chunk_tokens=2)
    student = packing.head_log_softmax(model, packing.packed_hidden(model, packed), 1.0)  # [T_out, V] at once
    whole = teacher.score_full(packed, ["d"] * 3).rows(torch.arange(7))
    torch.testing.assert_close(kl, reverse_kl(student, whole), atol=1e-6, rtol=0)
    torch.testing.assert_close(logp, packed_logprobs(model, packed), atol=1e-6, rtol=0)
    torch.testing.assert_close(teacher_logp, teacher.score(packed, ["d"] * 3), atol=1e-6, rtol=0)
    assert kl.requires_grad and logp.requires_grad and not teacher_logp.requires_grad
    kl.sum().backward()
    assert model.get_input_embeddings().weight.grad.abs().sum() > 0
    model.zero_grad()


def test_bfloat16_packed_log_probs_are_float32_and_near_the_float32_ones(model):
    from rollbook import devices

    [packed] = pack_sequences(PROMPTS, OUTPUTS)
    with torch.no_grad():
        full = packed_logprobs(model, packed)
        with devices.autocast(torch.device("cpu"), "bfloat16"):
            mixed = packed_logprobs(model, packed)
        bf16 = packed_logprobs(
            devices.place(build_tiny_model(TinyModelSpec(vocab_size=VOCAB), seed=0), "cpu", "bfloat16"), packed
        )
    assert mixed.dtype == bf16.dtype == torch.float32
    assert (mixed - full).abs().max() < 0.05 and (bf16 - full).abs().max() < 0.05


def test_bfloat16_packed_log_probs_equal_each_sequence_run_alone_in_bfloat16():
    """Within 2e-2 (about one bfloat16 rounding of a logit of magnitude 4; 0 measured on the CPU, where
    each sequence meets the same kernel as when run alone)."""
    from rollbook import devices

    bf16 = devices.place(build_tiny_model(TinyModelSpec(vocab_size=VOCAB), seed=0), "cpu", "bfloat16")
    [packed] = pack_sequences(PROMPTS, OUTPUTS)
    with torch.no_grad():
        got = packed_logprobs(bf16, packed)
        want = torch.cat([unpacked_logprobs(bf16, p, o).float() for p, o in zip(PROMPTS, OUTPUTS)])
    torch.testing.assert_close(got, want, atol=2e-2, rtol=0)


def _qwen2(**sliding):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        tie_word_embeddings=False,
        **sliding,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).eval()


@pytest.mark.parametrize(
    "sliding", [{}, {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 0}], ids=["full", "window3"]
)
def test_qwen2_packed_logprobs_equal_each_sequence_alone_sliding_window_layers_included(sliding):
    """Qwen2's shape (biased q/k/v, grouped-query heads, an untied LM head) and its sliding-window
    layers: a window of 3 is shorter than every sequence here, so it changes every log-prob after the
    third token, in the packed forward as in each sequence's own."""
    qwen = _qwen2(**sliding)
    [packed] = pack_sequences(PROMPTS, OUTPUTS)
    with torch.no_grad():
        got = packed_logprobs(qwen, packed)
        want = torch.cat([unpacked_logprobs(qwen, p, o) for p, o in zip(PROMPTS, OUTPUTS)])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    if sliding:
        with torch.no_grad():
            plain = _qwen2()(input_ids=torch.tensor([PROMPTS[2] + OUTPUTS[2]])).logits
        assert not torch.allclose(plain, qwen(input_ids=torch.tensor([PROMPTS[2] + OUTPUTS[2]])).logits.detach())


def test_attention_score_modifiers_it_does_not_apply_are_refused():
    segments = packing._Segments.of(torch.tensor([0, 2, 3], dtype=torch.int32))
    q = torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match=r"modifies its attention scores \(softcap\)"):
        packing._packed_attention(torch.nn.Identity(), q, q, q, None, rollbook_segments=segments, softcap=30.0)


def test_gradient_checkpointing_is_refused_while_training_and_harmless_without_grad():
    model = build_tiny_model(TinyModelSpec(vocab_size=VOCAB), seed=0)
    # transformers 5.2x renamed gradient_checkpointing_enable (which now warns)
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    [packed] = pack_sequences(PROMPTS, OUTPUTS)
    with pytest.raises(ValueError, match="gradient checkpointing on"):
        packed_logprobs(model.train(), packed)
    with torch.no_grad():  # nothing is recomputed: the proximal, teacher and reference passes still run
        packed_logprobs(model, packed)
    assert model.config._attn_implementation == "sdpa"


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


def test_packed_logprobs_refuse_an_attention_they_would_replace_silently(model):
    model.config._attn_implementation = "flash_attention_2"
    try:
        with pytest.raises(ValueError, match="in place of 'flash_attention_2'; load the model with attn_implementation='sdpa'"):
            packed_logprobs(model, pack_sequences(PROMPTS, OUTPUTS)[0])
    finally:
        model.config._attn_implementation = "sdpa"
