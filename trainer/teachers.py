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

``score_full`` gives the teacher's whole distribution at each output position for the
full-vocabulary distillation (``loss.distill_estimator = "full"``, ``losses.reverse_kl``): a
``packing.Distributions`` whose ``rows(index)`` are ``[len(index), V]`` log-probs, computed when
asked, so the trainer holds ``chunk_tokens`` rows of them at a time, never ``[T_out, V]``
(``LocalTeacher`` runs its decoder once per micro-batch and its LM head per chunk). ``LocalTeacher``
and both routers have it; a scorer without it serves the sampled estimator only (``full_scorer``
says so with the scorer's name).

Tests: ``python -m pytest tests/unit/trainer/test_teachers.py -q``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import torch

from rollbook.trainer.losses import mix_teacher_logprobs
from rollbook.trainer.packing import Distributions, PackedMicroBatch, head_log_softmax, packed_hidden, packed_logprobs


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

    def score_full(self, packed: PackedMicroBatch, domains: Sequence[str]) -> Distributions:
        """The teacher's log-softmax at the output positions of ``packed``, ``rows(index)`` ``[N, V]``
        float32, no grad, on the device of ``index``; ``domains`` as in ``score``."""
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

    def score_full(self, packed: PackedMicroBatch, domains: Sequence[str]) -> Distributions:
        _check_domains(packed, domains)
        with torch.no_grad():
            hidden = packed_hidden(self.model, packed)
        return _HeadRows(self.model, hidden, self.temperature)


class DomainRouter:
    """Each sequence to the teacher of its domain; ``default`` takes domains not in the map."""

    def __init__(self, teachers: Mapping[str, TeacherScorer], default: TeacherScorer | None = None) -> None:
        if not teachers and default is None:
            raise ValueError("DomainRouter needs at least one teacher or a default")
        self.teachers = dict(teachers)
        self.default = default

    def score(self, packed: PackedMicroBatch, domains: Sequence[str]) -> torch.Tensor:
        device = packed.output_token_ids.device
        routes = self._routes(packed, domains)
        if not routes:  # no sequence
            return torch.empty((0,), dtype=torch.float32, device=device)
        out = torch.empty(packed.num_output_tokens, dtype=torch.float32, device=device)
        for teacher, seqs in routes:
            if len(seqs) == packed.num_sequences:  # one teacher for all: no re-packing
                return teacher.score(packed, list(domains)).float().to(device)
            out[_tokens_of(packed, seqs)] = teacher.score(packed.select(seqs), [domains[i] for i in seqs]).float().to(device)
        return out

    def score_full(self, packed: PackedMicroBatch, domains: Sequence[str]) -> Distributions:
        routes = self._routes(packed, domains)
        if len(routes) == 1:
            return full_scorer(routes[0][0]).score_full(packed, list(domains))
        parts: list[Distributions] = []
        route_of = torch.zeros(packed.num_output_tokens, dtype=torch.long)
        local = torch.zeros(packed.num_output_tokens, dtype=torch.long)
        for r, (teacher, seqs) in enumerate(routes):
            tokens = _tokens_of(packed, seqs).cpu()
            parts.append(full_scorer(teacher).score_full(packed.select(seqs), [domains[i] for i in seqs]))
            route_of[tokens], local[tokens] = r, torch.arange(len(tokens))
        return _RoutedRows(parts, route_of, local)

    def route(self, domain: str) -> int:
        """Which teacher scores ``domain`` (an id, equal for domains one teacher scores). The trainer
        packs each route's sequences into micro-batches of their own, so that a micro-batch goes to
        one teacher whole, with no re-packing."""
        return id(self._teacher_of(domain))

    def _teacher_of(self, domain: str) -> TeacherScorer:
        teacher = self.teachers.get(domain, self.default)
        if teacher is None:
            raise ValueError(
                f"no teacher for domain {domain!r} (teachers: {sorted(self.teachers)}) and no default; "
                "add the domain or pass default="
            )
        return teacher

    def _routes(self, packed: PackedMicroBatch, domains: Sequence[str]) -> list[tuple[TeacherScorer, list[int]]]:
        """(teacher, its sequences in order) for each teacher that has any."""
        _check_domains(packed, domains)
        routes: dict[int, tuple[TeacherScorer, list[int]]] = {}  # keyed by id: scorers need not hash
        for i, domain in enumerate(domains):
            teacher = self._teacher_of(domain)
            routes.setdefault(id(teacher), (teacher, []))[1].append(i)
        return list(routes.values())


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

    def score_full(self, packed: PackedMicroBatch, domains: Sequence[str]) -> Distributions:
        """The mixture's whole distribution, ``log sum_j w_j pi_Tj(v)`` for every ``v``."""
        _check_domains(packed, domains)
        return _MixedRows([full_scorer(t).score_full(packed, domains) for t in self.teachers], self.weights)


class _HeadRows:
    """``LocalTeacher.score_full``: its decoder's hidden states at the output positions, through its LM
    head on the rows asked for."""

    def __init__(self, model: torch.nn.Module, hidden: torch.Tensor, temperature: float) -> None:
        self.model, self.hidden, self.temperature = model, hidden, temperature

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return head_log_softmax(self.model, self.hidden[index.to(self.hidden.device)], self.temperature).to(index.device)


class _RoutedRows:
    """``DomainRouter.score_full``: each row from the teacher of its sequence's domain."""

    def __init__(self, parts: list[Distributions], route_of: torch.Tensor, local: torch.Tensor) -> None:
        self.parts, self.route_of, self.local = parts, route_of, local  # per output token: its route, its row there

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        at = index.cpu()
        out: torch.Tensor | None = None
        for r, part in enumerate(self.parts):
            mine = self.route_of[at] == r
            if bool(mine.any()):
                values = part.rows(self.local[at[mine]].to(index.device)).float()
                if out is None:
                    out = values.new_empty((len(index), values.shape[-1]))
                out[mine.to(out.device)] = values
        assert out is not None, "rows of no route"
        return out


class _MixedRows:
    """``MixtureRouter.score_full``: the weighted mixture of every teacher's rows."""

    def __init__(self, parts: list[Distributions], weights: list[float]) -> None:
        self.parts, self.weights = parts, weights

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        return mix_teacher_logprobs(torch.stack([p.rows(index).float() for p in self.parts]), self.weights)


def _tokens_of(packed: PackedMicroBatch, seqs: list[int]) -> torch.Tensor:
    """Positions in ``[T_out]`` of the output tokens of sequences ``seqs`` (in order)."""
    index = packed.seq_index
    return torch.isin(index, torch.tensor(seqs, device=index.device)).nonzero()[:, 0]


def _check_domains(packed: PackedMicroBatch, domains: Sequence[str]) -> None:
    if len(domains) != packed.num_sequences:
        raise ValueError(f"got {len(domains)} domains for {packed.num_sequences} sequences; need one per sequence")
