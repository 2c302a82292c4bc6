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

Tests: ``python -m pytest tests/unit/trainer/test_teachers.py -q``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch

from rollbook.trainer.losses import mix_teacher_logprobs
from rollbook.trainer.packing import PackedMicroBatch, packed_logprobs


@runtime_checkable
class TeacherScorer(Protocol):
    """Scores the student's tokens under a teacher."""

    def score(self, packed: PackedMicroBatch, domains: Sequence[str]) -> torch.Tensor:
        """Teacher log-probs of ``packed.output_token_ids``, ``[T_out]`` float32, no grad, on the
        device of ``packed``. ``domains[i]`` is the domain of sequence i of ``packed``
        (``len(domains) == packed.num_sequences``)."""
        ...


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


class DomainRouter:
    """Each sequence to the teacher of its domain; ``default`` takes domains not in the map."""

    def __init__(self, teachers: Mapping[str, TeacherScorer], default: TeacherScorer | None = None) -> None:
        if not teachers and default is None:
            raise ValueError("DomainRouter needs at least one teacher or a default")
        self.teachers = dict(teachers)
        self.default = default

    def score(self, packed: PackedMicroBatch, domains: Sequence[str]) -> torch.Tensor:
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
        out = torch.empty(packed.num_output_tokens, dtype=torch.float32, device=packed.output_token_ids.device)
        for teacher, seqs in routes.values():
            if len(seqs) == packed.num_sequences:  # one teacher for all: no re-packing
                return teacher.score(packed, list(domains)).to(out)
            tokens = torch.isin(packed.seq_index, torch.tensor(seqs, device=out.device))
            out[tokens] = teacher.score(packed.select(seqs), [domains[i] for i in seqs]).to(out)
        return out


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


def _check_domains(packed: PackedMicroBatch, domains: Sequence[str]) -> None:
    if len(domains) != packed.num_sequences:
        raise ValueError(f"got {len(domains)} domains for {packed.num_sequences} sequences; need one per sequence")
