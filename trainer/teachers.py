"""Teachers for MOPD: models that score the student's sampled tokens, forward only.

    teacher = DomainRouter({"arithmetic": LocalTeacher(math_model), "reverse": LocalTeacher(rev_model)})
    teacher_logprobs = teacher.score(packed, [domains[i] for i in packed.sequence_ids.tolist()])
    loss = mopd_loss(logp, prox, packed.behavior_logprobs, teacher_logprobs, packed.loss_mask, adv_clip=5.0)

A ``TeacherScorer`` turns a ``PackedMicroBatch`` into ``[T_out]`` log-probs, one per output token, under
the teacher: the ``teacher_logprobs`` of ``losses.mopd_loss``. Teachers share the student's
tokenizer (the same token ids mean the same text). Routing follows docs/design.md, "The trainer":

- ``DomainRouter``: each sequence goes to the teacher of its domain; a teacher only runs on its own
  sequences (the batch is re-packed per teacher).
- ``MixtureRouter``: every teacher scores every token; the log-probs of the weighted mixture
  ``sum_j w_j * pi_Tj`` come from ``losses.mix_teacher_logprobs``.

Routers are scorers themselves, so they nest (a domain whose teacher is a mixture).

``score_full`` returns the teacher's whole distribution at each output position, ``[T_out, V]``, for
the full-vocabulary distillation (``loss.distill_estimator = "full"``, ``losses.full_kl_distill_loss``).
``LocalTeacher`` and both routers have it; a scorer without it serves the sampled estimator only
(``full_scorer`` says so with the scorer's name).

Tests: ``python -m pytest tests/unit/trainer/test_teachers.py -q``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch

from rollbook.trainer.losses import mix_teacher_logprobs
from rollbook.trainer.packing import PackedMicroBatch, packed_log_softmax, packed_logprobs


@runtime_checkable
class TeacherScorer(Protocol):
    """Scores the student's tokens under a teacher."""

    def score(self, packed: PackedMicroBatch, domains: Sequence[str]) -> torch.Tensor:
        """Teacher log-probs of ``packed.output_token_ids``, ``[T_out]`` float32, no grad, on the
        device of ``packed``. ``domains[i]`` is the domain of sequence i of ``packed``
        (``len(domains) == packed.num_sequences``)."""
        ...


@runtime_checkable
class FullScorer(TeacherScorer, Protocol):
    """A teacher that also gives its whole distribution at each output position."""

    def score_full(self, packed: PackedMicroBatch, domains: Sequence[str]) -> torch.Tensor:
        """Teacher log-softmax at each output position of ``packed``, ``[T_out, V]`` float32, no
        grad, on the device of ``packed``; ``domains`` as in ``score``."""
        ...


def full_scorer(teacher: TeacherScorer) -> FullScorer:
    """``teacher`` if it gives whole distributions (``score_full``), else a precise error."""
    if not isinstance(teacher, FullScorer):
        raise TypeError(
            f"loss.distill_estimator = 'full' needs teachers that give their whole distribution (score_full); "
            f"{type(teacher).__name__} scores sampled tokens only: use distill_estimator = 'sampled'"
        )
    return teacher


class LocalTeacher:
    """A ``transformers`` causal LM in this process (eager or sdpa attention), put in eval mode.

    ``temperature`` divides the teacher's logits (1.0: its own distribution). It ignores domains.
    """

    def __init__(self, model: torch.nn.Module, temperature: float = 1.0) -> None:
        if not temperature > 0:
            raise ValueError(f"teacher temperature must be > 0, got {temperature}")
        self.model = model.eval()
        self.temperature = temperature

    def score(self, packed: PackedMicroBatch, domains: Sequence[str]) -> torch.Tensor:
        _check_domains(packed, domains)
        with torch.no_grad():
            logp = packed_logprobs(self.model, packed, self.temperature)
        return logp.to(packed.output_token_ids.device)

    def score_full(self, packed: PackedMicroBatch, domains: Sequence[str]) -> torch.Tensor:
        _check_domains(packed, domains)
        with torch.no_grad():
            logp = packed_log_softmax(self.model, packed, self.temperature)
        return logp.to(packed.output_token_ids.device)


class DomainRouter:
    """Each sequence to the teacher of its domain; ``default`` takes domains not in the map."""

    def __init__(self, teachers: Mapping[str, TeacherScorer], default: TeacherScorer | None = None) -> None:
        if not teachers and default is None:
            raise ValueError("DomainRouter needs at least one teacher or a default")
        self.teachers = dict(teachers)
        self.default = default

    def score(self, packed: PackedMicroBatch, domains: Sequence[str]) -> torch.Tensor:
        return self._route(packed, domains, full=False)

    def score_full(self, packed: PackedMicroBatch, domains: Sequence[str]) -> torch.Tensor:
        return self._route(packed, domains, full=True)

    def _route(self, packed: PackedMicroBatch, domains: Sequence[str], *, full: bool) -> torch.Tensor:
        _check_domains(packed, domains)
        routes: dict[int, tuple[TeacherScorer, list[int]]] = {}  # keyed by id: scorers need not hash
        for i, domain in enumerate(domains):
            teacher = self.teachers.get(domain, self.default)
            if teacher is None:
                raise ValueError(
                    f"no teacher for domain {domain!r} (teachers: {sorted(self.teachers)}) and no default; "
                    "add the domain or pass default="
                )
            routes.setdefault(id(teacher), (teacher, []))[1].append(i)

        def run(teacher: TeacherScorer, part: PackedMicroBatch, part_domains: list[str]) -> torch.Tensor:
            return full_scorer(teacher).score_full(part, part_domains) if full else teacher.score(part, part_domains)

        device = packed.output_token_ids.device
        if not routes:  # no sequence
            return torch.empty((0, 0) if full else (0,), dtype=torch.float32, device=device)
        out: torch.Tensor | None = None
        for teacher, seqs in routes.values():
            if len(seqs) == packed.num_sequences:  # one teacher for all: no re-packing
                return run(teacher, packed, list(domains)).float().to(device)
            scores = run(teacher, packed.select(seqs), [domains[i] for i in seqs]).float()
            if out is None:
                out = scores.new_empty((packed.num_output_tokens, *scores.shape[1:]))
            tokens = torch.isin(packed.seq_index, torch.tensor(seqs, device=packed.seq_index.device))
            out[tokens.to(out.device)] = scores.to(out.device)
        assert out is not None  # routes is not empty
        return out.to(device)


class MixtureRouter:
    """Every teacher scores every token; the result is the weighted mixture's log-probs."""

    def __init__(self, teachers: Sequence[TeacherScorer], weights: Sequence[float]) -> None:
        if len(teachers) != len(weights) or not teachers:
            raise ValueError(f"need one weight per teacher and at least one: {len(teachers)} teachers, {len(weights)} weights")
        if not all(w > 0 and w < float("inf") for w in weights):
            raise ValueError(f"mixture weights must be positive and finite, got {list(weights)}")
        self.teachers = list(teachers)
        self.weights = list(weights)

    def score(self, packed: PackedMicroBatch, domains: Sequence[str]) -> torch.Tensor:
        _check_domains(packed, domains)
        scores = torch.stack([t.score(packed, domains).float() for t in self.teachers])  # [K, T_out]
        return mix_teacher_logprobs(scores, self.weights)

    def score_full(self, packed: PackedMicroBatch, domains: Sequence[str]) -> torch.Tensor:
        """The mixture's whole distribution, ``log sum_j w_j pi_Tj(v)`` for every ``v``."""
        _check_domains(packed, domains)
        scores = torch.stack([full_scorer(t).score_full(packed, domains).float() for t in self.teachers])  # [K, T_out, V]
        return mix_teacher_logprobs(scores, self.weights)


def _check_domains(packed: PackedMicroBatch, domains: Sequence[str]) -> None:
    if len(domains) != packed.num_sequences:
        raise ValueError(f"got {len(domains)} domains for {packed.num_sequences} sequences; need one per sequence")
