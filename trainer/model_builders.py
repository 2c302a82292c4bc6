"""Build the models a run trains with: the student (warm-started, cached in the run dir) and the MOPD
teacher(s) a config asks for. (The bare student, without warm start, is ``rollbook.models.build_student``,
which the rollout worker uses too.)"""

from __future__ import annotations

import pathlib

from rollbook.models import build_student, load_model
from rollbook.tasks import build_domains, make_tasks
from rollbook.trainer.warmstart import cached_warm_start


def build_models(config):
    """``(student, teacher_scorer_or_None)`` for a ``RunConfig``."""
    from rollbook.trainer.teachers import LocalTeacher

    m = config.trainer.model
    run_dir = pathlib.Path(config.run_dir)
    ws = config.warm_start
    tasks = [t for d in build_domains(config.rollout).values()
             for t in make_tasks(d, "train", config.rollout.num_train_tasks, config.rollout.seed, allow_fewer=True)]

    def fresh(seed: int):
        return lambda: build_student(m, seed=seed)

    if m.path:
        student = load_model(m.path)
    else:
        student = cached_warm_start(run_dir / "base-student", fresh(m.seed), tasks, steps=ws.student_steps,
                                    batch_size=ws.batch_size, lr=ws.lr, seed=ws.seed)
    if config.trainer.loss.distill_coef == 0:
        return student, None
    extra = []
    if ws.teacher_steps and ws.specialist_teachers:
        return student, specialist_teachers(config, fresh(m.seed + 1))
    if ws.teacher_steps:
        teacher = cached_warm_start(run_dir / "teacher", fresh(m.seed + 1), tasks, steps=ws.teacher_steps,
                                    batch_size=ws.batch_size, lr=ws.lr, seed=ws.seed + 1)
        extra.append(LocalTeacher(teacher))
    return student, build_teachers(config.trainer, extra)


def specialist_teachers(config, build):
    """One teacher per domain of ``config.rollout``, each warm-started ``teacher_steps`` on its own
    domain's training problems only (cached in RUN_DIR/teacher-DOMAIN), behind a ``DomainRouter``;
    ``[[trainer.teachers]]`` with a domain take that domain instead."""
    from rollbook.trainer.teachers import DomainRouter, LocalTeacher

    ws, run_dir = config.warm_start, pathlib.Path(config.run_dir)
    if config.trainer.teacher_routing != "domain":
        raise ValueError("warm_start.specialist_teachers needs trainer.teacher_routing = 'domain'")
    routes = {t.domain: LocalTeacher(load_model(t.path)) for t in config.trainer.teachers if t.domain}
    for name, domain in build_domains(config.rollout).items():
        if name in routes:
            continue
        own = make_tasks(domain, "train", config.rollout.num_train_tasks, config.rollout.seed, allow_fewer=True)
        routes[name] = LocalTeacher(cached_warm_start(run_dir / f"teacher-{name}", build, own, steps=ws.teacher_steps,
                                                      batch_size=ws.batch_size, lr=ws.lr, seed=ws.seed + 1))
    return DomainRouter(routes)


def build_teachers(config, extra: list | None = None):
    """The teacher scorer of a ``TrainerConfig`` (``[[teachers]]`` plus ``extra`` scorers that serve
    every domain), routed by ``teacher_routing``; None without teachers."""
    from rollbook.trainer.teachers import DomainRouter, LocalTeacher, MixtureRouter

    scorers = [(LocalTeacher(load_model(t.path)), t) for t in config.teachers] + [(s, None) for s in extra or []]
    if not scorers or config.loss.distill_coef == 0:
        return None
    if len(scorers) == 1:
        return scorers[0][0]
    if config.teacher_routing == "mixture":
        return MixtureRouter([s for s, _ in scorers], [t.weight if t else 1.0 for s, t in scorers])
    return DomainRouter({t.domain: s for s, t in scorers if t and t.domain},
                        default=next((s for s, t in scorers if t is None or t.domain is None), None))
