"""Build the models a run trains with: the student (warm-started, cached in the run dir, or loaded from
``model.path``), the MOPD teacher(s) and the KL reference a config asks for. (The bare student, without
warm start, is ``rollbook.language_models.build_student``, which the rollout worker uses too.) Every model from
a path is a local Hugging Face directory; a wrong path is a one-line ``ConfigError``."""

from __future__ import annotations

import copy
import logging
import pathlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from rollbook.language_models import build_student, load_model, model_vocab_size
from rollbook.tasks import build_domains, make_tasks
from rollbook.trainer.warmstart import cached_warm_start, greedy_accuracy, sampled_accuracy

log = logging.getLogger("rollbook.trainer")

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from transformers import PreTrainedModel

    from rollbook.config import RunConfig, TeacherConfig, TrainerConfig
    from rollbook.trainer.teachers import TeacherScorer


def build_models(config: RunConfig) -> tuple[PreTrainedModel, TeacherScorer | None]:
    """``(student, teacher_scorer_or_None)`` for a ``RunConfig``."""
    from rollbook.trainer.teachers import LocalTeacher

    m = config.trainer.model
    run_dir = pathlib.Path(config.run_dir)
    ws = config.warm_start
    tasks = [
        t
        for d in build_domains(config.rollout).values()
        for t in make_tasks(d, "train", config.rollout.num_train_tasks, config.rollout.seed, allow_fewer=True)
    ]

    def fresh(seed: int) -> Callable[[], PreTrainedModel]:
        return lambda: build_student(m, seed=seed)

    if m.path:
        student = load_model(m.path)
    else:
        student = cached_warm_start(
            run_dir / "base-student",
            fresh(m.seed),
            tasks,
            steps=ws.student_steps,
            batch_size=ws.batch_size,
            lr=ws.lr,
            seed=ws.seed,
            domain_weights=ws.student_mix or None,
            target=ws.student_target,
            check_every=ws.student_check_every,
            check_problems=ws.student_check_problems,
            domains=build_domains(config.rollout),
            ceiling=ws.student_ceiling,
        )
    if config.trainer.loss.distill_coef == 0:
        return student, None
    extra = []
    if ws.teacher_steps and ws.specialist_teachers:
        return student, specialist_teachers(config, fresh(m.seed + 1))
    if ws.teacher_steps:
        teacher = cached_warm_start(
            run_dir / "teacher",
            fresh(m.seed + 1),
            tasks,
            steps=ws.teacher_steps,
            batch_size=ws.batch_size,
            lr=ws.teacher_lr or ws.lr,
            seed=ws.seed + 1,
        )
        extra.append(LocalTeacher(_placed(teacher, config.trainer), config.trainer.teacher_temperature))
    return student, build_teachers(config.trainer, extra)


def specialist_teachers(config, build):
    """One teacher per domain of ``config.rollout``, each warm-started ``teacher_steps`` on its own
    domain's training problems only (cached in RUN_DIR/teacher-DOMAIN), behind a ``DomainRouter``;
    ``[[trainer.teachers]]`` with a domain take that domain instead."""
    from rollbook.trainer.teachers import DomainRouter, LocalTeacher

    ws, run_dir = config.warm_start, pathlib.Path(config.run_dir)
    if config.trainer.teacher_routing != "domain":
        raise ValueError("warm_start.specialist_teachers needs trainer.teacher_routing = 'domain'")
    temperature = config.trainer.teacher_temperature
    routes = {
        t.domain: LocalTeacher(_placed(load_model(t.path, what="teacher"), config.trainer), temperature)
        for t in config.trainer.teachers
        if t.domain
    }
    for name, domain in build_domains(config.rollout).items():
        if name in routes:
            continue
        own = make_tasks(domain, "train", config.rollout.num_train_tasks, config.rollout.seed, allow_fewer=True)
        teacher = cached_warm_start(
            run_dir / f"teacher-{name}",
            build,
            own,
            steps=ws.teacher_steps,
            batch_size=ws.batch_size,
            lr=ws.teacher_lr or ws.lr,
            seed=ws.seed + 1,
            target=ws.teacher_target,
            check_every=ws.student_check_every,
            check_problems=ws.student_check_problems,
            domains={name: domain},
            check_sampled=True,
        )
        heldout = make_tasks(domain, "heldout", config.rollout.num_eval_tasks, config.rollout.seed, allow_fewer=True)
        greedy = greedy_accuracy(teacher, heldout, {name: domain})
        sampled = sampled_accuracy(teacher, heldout, {name: domain}, seed=config.rollout.eval_seed)
        print(
            f"teacher {name}: held-out accuracy {greedy:.3f} greedy, {sampled:.3f} sampled, on {len(heldout)} problems of its domain",
            flush=True,
        )
        log.info("teacher %s: held-out accuracy %.3f greedy, %.3f sampled (%d problems)", name, greedy, sampled, len(heldout))
        routes[name] = LocalTeacher(_placed(teacher, config.trainer), temperature)
    return DomainRouter(routes)


def build_teachers(config: TrainerConfig, extra: Sequence[TeacherScorer] = ()) -> TeacherScorer | None:
    """The teacher scorer of a ``TrainerConfig`` (``[[teachers]]`` plus ``extra`` scorers that serve
    every domain), routed by ``teacher_routing``; None without teachers."""
    from rollbook.trainer.teachers import DomainRouter, LocalTeacher, MixtureRouter

    if config.loss.distill_coef == 0:
        return None
    scorers: list[tuple[TeacherScorer, TeacherConfig | None]] = [
        (LocalTeacher(_placed(load_model(t.path, what="teacher"), config), config.teacher_temperature), t)
        for t in config.teachers
    ]
    scorers += [(s, None) for s in extra]
    if not scorers:
        return None
    if len(scorers) == 1:
        return scorers[0][0]
    if config.teacher_routing == "mixture":
        return MixtureRouter([s for s, _ in scorers], [t.weight if t else 1.0 for s, t in scorers])
    return DomainRouter(
        {t.domain: s for s, t in scorers if t and t.domain},
        default=next((s for s, t in scorers if t is None or t.domain is None), None),
    )


def build_reference(config: TrainerConfig, student: torch.nn.Module) -> torch.nn.Module | None:
    """The frozen reference policy of the KL penalty for a ``TrainerConfig``, or None when
    ``loss.kl_coef`` is 0: a deep copy of ``student`` (``reference = "initial"``; call this before a
    checkpoint is restored into the student) or the model in the ``reference`` directory, whose
    vocabulary must be the student's. In eval mode, no parameter requires grad."""
    from rollbook.errors import ConfigError

    if config.loss.kl_coef == 0:
        return None
    if config.reference == "initial":
        reference = copy.deepcopy(student)
    else:
        reference = load_model(config.reference, what="reference")
        if model_vocab_size(reference) != model_vocab_size(student):
            raise ConfigError(
                f"reference {config.reference!r} has a vocabulary of {model_vocab_size(reference)} ids, the "
                f"student {model_vocab_size(student)}: the KL penalty compares log-probs of the same token ids"
            )
    return reference.eval().requires_grad_(False)


def _placed(model: PreTrainedModel, config: TrainerConfig) -> PreTrainedModel:
    """A teacher on the trainer's device, held in ``teacher_dtype`` (default: the trainer's dtype; it only runs forward)."""
    from rollbook.devices import place

    return place(model, config.device, config.teacher_dtype or config.dtype)  # type: ignore[return-value]  # .to() returns the model itself
