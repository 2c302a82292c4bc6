"""Unit tests of rollbook.trainer.teachers: the local teacher and domain / mixture routing.

Run: python -m pytest tests/unit/trainer/test_teachers.py -q
"""

from __future__ import annotations

import math

import pytest
import torch

from rollbook.language_models import TinyModelSpec, build_tiny_model
from rollbook.trainer.packing import PackedMicroBatch, pack_sequences, packed_logprobs
from rollbook.trainer.teachers import DomainRouter, FullScorer, LocalTeacher, MixtureRouter, TeacherScorer, full_scorer

PROMPTS = [[1, 5], [1, 9, 4], [1], [1, 7]]
OUTPUTS = [[6, 2], [3], [8, 8, 2], [5]]


class ConstantTeacher:
    """Gives every token the same log-prob and records the sequences it was asked about."""

    def __init__(self, logprob: float) -> None:
        self.logprob = logprob
        self.calls: list[list[int]] = []

    def score(self, packed: PackedMicroBatch, domains) -> torch.Tensor:
        self.calls.append(packed.sequence_ids.tolist())
        return torch.full((packed.num_output_tokens,), self.logprob)


ALL = torch.arange(7)  # the 7 output positions of the packed fixture


def unpacked_log_softmax(model, packed: PackedMicroBatch, temperature: float) -> torch.Tensor:
    """``[T_out, V]``: each sequence run alone, its distributions at the positions predicting its outputs."""
    rows = []
    starts = packed.cu_seqlens.tolist()
    for i, (start, end) in enumerate(zip(starts[:-1], starts[1:])):
        ids = packed.input_ids[:, start:end]
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].float() / temperature
        n = int((packed.seq_index == i).sum())
        rows.append(logits.log_softmax(-1)[ids.shape[1] - 1 - n : ids.shape[1] - 1])
    return torch.cat(rows)


def gather_tokens(log_probs: torch.Tensor, packed: PackedMicroBatch) -> torch.Tensor:
    return log_probs.gather(-1, packed.output_token_ids[:, None])[:, 0]


@pytest.fixture
def packed():
    [batch] = pack_sequences(PROMPTS, OUTPUTS)
    return batch  # output tokens per sequence: 2, 1, 3, 1


def test_domain_router_sends_each_sequence_to_its_domains_teacher_only():
    math_t, rev_t = ConstantTeacher(-1.0), ConstantTeacher(-2.0)
    router = DomainRouter({"math": math_t, "rev": rev_t})
    [batch] = pack_sequences(PROMPTS, OUTPUTS)
    got = router.score(batch, ["rev", "math", "rev", "math"])
    assert got.tolist() == [-2.0, -2.0, -1.0, -2.0, -2.0, -2.0, -1.0]
    assert math_t.calls == [[1, 3]] and rev_t.calls == [[0, 2]]


def test_domain_router_uses_the_default_for_unknown_domains(packed):
    router = DomainRouter({"math": ConstantTeacher(-1.0)}, default=ConstantTeacher(-3.0))
    got = router.score(packed, ["math", "poetry", "math", "math"])
    assert got.tolist() == [-1.0, -1.0, -3.0, -1.0, -1.0, -1.0, -1.0]


def test_domain_router_one_teacher_for_all_scores_the_batch_unrepacked(packed):
    teacher = ConstantTeacher(-1.0)
    DomainRouter({"math": teacher}).score(packed, ["math"] * 4)
    assert teacher.calls == [[0, 1, 2, 3]]


def test_domain_router_unknown_domain_without_default_is_a_value_error_naming_it(packed):
    teacher = ConstantTeacher(-1.0)
    with pytest.raises(ValueError, match="'poetry'"):
        DomainRouter({"math": teacher}).score(packed, ["math", "poetry", "math", "math"])
    assert teacher.calls == []  # checked before any teacher runs


def test_routers_need_one_domain_per_sequence(packed):
    with pytest.raises(ValueError, match="3 domains for 4 sequences"):
        DomainRouter({"math": ConstantTeacher(-1.0)}).score(packed, ["math"] * 3)


def test_mixture_router_is_the_log_of_the_weighted_mixture(packed):
    # w = [1, 3] -> [0.25, 0.75]; log(0.25 * e^-1 + 0.75 * e^-2) per token
    router = MixtureRouter([ConstantTeacher(-1.0), ConstantTeacher(-2.0)], [1.0, 3.0])
    want = math.log(0.25 * math.exp(-1.0) + 0.75 * math.exp(-2.0))
    torch.testing.assert_close(router.score(packed, ["x"] * 4), torch.full((7,), want), atol=1e-6, rtol=0)


@pytest.mark.parametrize("weights", [[1.0], [1.0, 0.0], [1.0, float("inf")]])
def test_mixture_router_rejects_bad_weights(weights):
    with pytest.raises(ValueError, match="weight"):
        MixtureRouter([ConstantTeacher(-1.0), ConstantTeacher(-2.0)], weights)


def test_local_teacher_scores_without_grad_like_packed_logprobs(packed):
    model = build_tiny_model(TinyModelSpec(vocab_size=16), seed=1)
    teacher = LocalTeacher(model, temperature=2.0)
    assert isinstance(teacher, TeacherScorer)
    got = teacher.score(packed, ["x"] * 4)
    assert not got.requires_grad and got.shape == (7,)
    with torch.no_grad():
        want = packed_logprobs(model, packed, 2.0)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_domain_routing_of_local_teachers_matches_each_teacher_on_the_whole_batch(packed):
    a = LocalTeacher(build_tiny_model(TinyModelSpec(vocab_size=16), seed=1))
    b = LocalTeacher(build_tiny_model(TinyModelSpec(vocab_size=16), seed=2))
    got = DomainRouter({"a": a, "b": b}).score(packed, ["a", "b", "b", "a"])
    from_a, from_b = a.score(packed, ["a"] * 4), b.score(packed, ["b"] * 4)
    is_b = torch.tensor([False, False, True, True, True, True, False])
    torch.testing.assert_close(got, torch.where(is_b, from_b, from_a), atol=1e-5, rtol=0)


# --- whole distributions (loss.distill_estimator = "full") ------------------------------------------


def test_local_teacher_full_distribution_is_each_sequences_own_and_holds_its_sampled_scores(packed):
    model = build_tiny_model(TinyModelSpec(vocab_size=16), seed=1)
    teacher = LocalTeacher(model, temperature=2.0)
    assert isinstance(teacher, FullScorer)
    got = teacher.score_full(packed, ["x"] * 4).rows(ALL)
    assert not got.requires_grad and got.shape == (7, 16)
    torch.testing.assert_close(got, unpacked_log_softmax(model, packed, 2.0), atol=1e-5, rtol=0)
    torch.testing.assert_close(teacher.score_full(packed, ["x"] * 4).rows(torch.tensor([5, 1])), got[[5, 1]], atol=1e-6, rtol=0)
    torch.testing.assert_close(gather_tokens(got, packed), teacher.score(packed, ["x"] * 4), atol=0, rtol=0)
    torch.testing.assert_close(got.exp().sum(-1), torch.ones(7), atol=1e-5, rtol=0)


def test_domain_routing_of_whole_distributions_matches_each_teacher_on_the_whole_batch(packed):
    a = LocalTeacher(build_tiny_model(TinyModelSpec(vocab_size=16), seed=1))
    b = LocalTeacher(build_tiny_model(TinyModelSpec(vocab_size=16), seed=2))
    router = DomainRouter({"a": a, "b": b})
    got = router.score_full(packed, ["a", "b", "b", "a"]).rows(ALL)
    from_a, from_b = a.score_full(packed, ["a"] * 4).rows(ALL), b.score_full(packed, ["b"] * 4).rows(ALL)
    torch.testing.assert_close(router.score_full(packed, ["a", "b", "b", "a"]).rows(torch.tensor([6, 2])), got[[6, 2]])
    is_b = torch.tensor([False, False, True, True, True, True, False])[:, None]
    torch.testing.assert_close(got, torch.where(is_b, from_b, from_a), atol=1e-5, rtol=0)
    torch.testing.assert_close(gather_tokens(got, packed), router.score(packed, ["a", "b", "b", "a"]), atol=1e-6, rtol=0)


def test_mixture_of_whole_distributions_is_the_weighted_mixture_at_every_token(packed):
    a = LocalTeacher(build_tiny_model(TinyModelSpec(vocab_size=16), seed=1))
    b = LocalTeacher(build_tiny_model(TinyModelSpec(vocab_size=16), seed=2))
    router = MixtureRouter([a, b], [1.0, 3.0])
    got = router.score_full(packed, ["x"] * 4).rows(ALL)
    want = (0.25 * a.score_full(packed, ["x"] * 4).rows(ALL).exp() + 0.75 * b.score_full(packed, ["x"] * 4).rows(ALL).exp()).log()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(gather_tokens(got, packed), router.score(packed, ["x"] * 4), atol=1e-6, rtol=0)


def test_a_teacher_that_scores_sampled_tokens_only_is_refused_for_whole_distributions_by_name(packed):
    assert not isinstance(ConstantTeacher(-1.0), FullScorer)
    with pytest.raises(TypeError, match="ConstantTeacher scores sampled tokens only"):
        full_scorer(ConstantTeacher(-1.0))
    with pytest.raises(TypeError, match="ConstantTeacher"):
        DomainRouter({"a": ConstantTeacher(-1.0)}).score_full(packed, ["a"] * 4)
