"""Supervised warm start: teach a tiny model the answer format (and a little of the task) before RL.

RL on language models always starts from a pretrained model; on CPU the stand-in is a few dozen
cross-entropy steps on training problems (``prompt -> answer <eos>``), so that the policy's first
samples earn some reward and the RL signal is not all zeros. A longer warm start makes a better
model: that is the MOPD teacher (with ``warm_start.specialist_teachers``, one per domain, trained on
that domain only: ``trainer/model_builders.py`` ``specialist_teachers``). Models are cached as transformers directories in the run dir.
A warm start prints a progress line every ``PROGRESS_EVERY`` steps, or every tenth of a long one
(``rollbook run``'s console);
transformers' own progress bars ("Writing model shards", "Loading weights") are switched off.
"""

from __future__ import annotations

import itertools
import logging
import pathlib
import random
import time
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from rollbook.language_models import quiet_transformers
from rollbook.tasks import DOMAINS, TOKENIZER, Task, TaskDomain, score

log = logging.getLogger("rollbook.trainer")

PROGRESS_EVERY = 20  # warm-start steps between progress lines (at least)
PROGRESS_LINES = 10  # a long warm start (a teacher) prints about this many lines


def supervised_steps(
    model: torch.nn.Module,
    tasks: list[Task],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    on_progress=None,
    progress_every: int = PROGRESS_EVERY,
    domain_weights: Mapping[str, float] | None = None,
    target: float | None = None,
    check_every: int = 25,
    check_problems: int = 64,
    domains: Mapping[str, TaskDomain] | None = None,
    on_check=None,
    ceiling: float | None = None,
    check_sampled: bool = False,
) -> list[float]:
    """Cross-entropy on the answer tokens (prompt tokens are context only); returns the losses.
    ``on_progress(step_done, loss)`` is called every ``progress_every`` steps and after the last.
    ``domain_weights`` (``warm_start.student_mix``): each problem of a batch picks its domain with
    these weights, then a problem of that domain; None or empty: problems drawn from ``tasks`` pooled.

    ``target`` (``warm_start.student_target``): every ``check_every`` steps, the greedy accuracy of
    each domain not yet at the target on ``check_problems`` of its own training problems, set apart
    from the ones it trains on (on those it trains on, a tiny model's accuracy runs ahead of the
    held-out one: it memorizes; ``greedy_accuracy``, verified by ``domains``); training stops at the first check where every
    domain has reached ``target`` (at this check or an earlier one), or after ``steps``. A domain
    that reached it keeps training (one taken out of the batches was forgotten within about a
    hundred steps in a probe, docs/RESULTS.md, "The MOPD demo").

    ``ceiling`` (``warm_start.student_ceiling``, above ``target``): every check then measures every
    domain; a domain at or above ``ceiling`` sits out of the batches until the next check (when every
    domain is, the least accurate one trains on: trained together, all would stay up), and training
    stops at the first check where every domain is at or above ``target`` and below ``ceiling`` (a
    single domain: at or above ``target``, as without a ceiling). Domains leave their plateau at
    seed-dependent steps and then rise within a hundred, so without it the first one ends near its
    best while the last one catches up; and a domain that climbs past the ceiling within a few steps and falls back as fast
    while it sits out would, if the stop only asked for the target, end wherever that one check's
    draw left it (docs/RESULTS.md, "The MOPD demo"). ``on_check(step, accuracies, reached)`` sees each
    check. None: exactly ``steps`` steps. ``check_sampled``: the checks sample one answer per problem
    at temperature 1 (``sampled_accuracy``, the teachers' ``warm_start.teacher_target``) instead of
    decoding greedily."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    history: list[float] = []
    model.train()
    by_domain: dict[str, list[Task]] = {}
    for task in tasks:
        by_domain.setdefault(task.domain, []).append(task)
    weights = dict(domain_weights) if domain_weights else {d: float(len(ts)) for d, ts in by_domain.items()}
    active = [d for d, w in weights.items() if w > 0]
    active_all, base_weights = list(active), dict(weights)
    pending = list(active)  # domains not yet at the target
    if ceiling is not None and (target is None or ceiling <= target):
        raise ValueError(f"ceiling {ceiling} needs a target below it (target {target})")
    missing = [d for d in active if d not in by_domain]
    if missing:
        raise ValueError(f"domain weights name {missing}, which have no training problems")
    probes: dict[str, list[Task]] = {}
    if target is not None:  # set apart: the check measures what generalizes, not what was memorized
        for d, ts in by_domain.items():
            probes[d] = random.Random(seed + 1).sample(ts, min(check_problems, len(ts) // 2))
            kept = set(map(id, probes[d]))
            by_domain[d] = [t for t in ts if id(t) not in kept]
    draw = (
        (lambda: rng.choice(tasks)) if not domain_weights and target is None else _weighted_draw(by_domain, weights, active, rng)
    )

    def check(d: str) -> float:  # looked up at call time: tests replace greedy_accuracy
        return (
            sampled_accuracy(model, probes[d], domains, seed=seed)
            if check_sampled
            else greedy_accuracy(model, probes[d], domains)
        )

    for _ in range(steps):
        batch = [draw() for _ in range(batch_size)]
        ids, labels = _padded(batch)
        logits = model(input_ids=ids, attention_mask=(ids != TOKENIZER.pad_token_id).long()).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        history.append(loss.item())
        done = len(history)
        if on_progress is not None and (done % progress_every == 0 or done == steps):
            on_progress(done, history[-1])
        if target is not None and done % check_every == 0:
            if ceiling is not None:  # every domain, every check: a paused one may fall back
                accuracy = {d: check(d) for d in active_all}
                pending = [d for d in active_all if accuracy[d] < target]
                paused = [d for d in active_all if accuracy[d] >= ceiling]
                if on_check is not None:
                    on_check(done, accuracy, [d for d in accuracy if d not in pending])
                if not pending and (not paused or len(active_all) == 1):  # one domain: none to fall back on
                    break
                if len(paused) == len(active_all):  # none left to train: the least accurate goes on
                    paused.remove(min(paused, key=lambda d: accuracy[d]))
                weights = {d: (0.0 if d in paused else w) for d, w in base_weights.items()}
                draw = _weighted_draw(by_domain, weights, [d for d in active_all if d not in paused], rng)
                continue
            accuracy = {d: check(d) for d in pending}
            pending = [d for d in pending if accuracy[d] < target]
            reached = [d for d in accuracy if d not in pending]
            if on_check is not None:
                on_check(done, accuracy, reached)
            if not pending:
                break
    return history


def _weighted_draw(by_domain: Mapping[str, list[Task]], weights: Mapping[str, float], active: list[str], rng: random.Random):
    """A function drawing one problem: a domain of ``active`` by ``weights``, then one of its problems."""
    cumulative = list(itertools.accumulate(weights[d] for d in active))
    return lambda: rng.choice(by_domain[rng.choices(active, cum_weights=cumulative)[0]])


def greedy_accuracy(model: torch.nn.Module, tasks: list[Task], domains: Mapping[str, TaskDomain] | None = None) -> float:
    """The share of ``tasks`` the model answers right with greedy decoding (``rollbook.tasks.score``;
    a verifier error counts as wrong). Problems of one prompt length decode as one batch, so no padding;
    at most the longest answer plus two tokens."""
    return _decoded_accuracy(model, tasks, domains, temperature=0.0, seed=0)


def sampled_accuracy(
    model: torch.nn.Module, tasks: list[Task], domains: Mapping[str, TaskDomain] | None = None, *, seed: int = 0
) -> float:
    """As ``greedy_accuracy``, one answer per problem sampled at temperature 1 (seeded): the model's
    expected reward. A model can be right greedily and nearly never when sampled (a teacher stopped
    early in its rise: 0.983 greedy, 0.004 sampled), and on-policy distillation pulls the student
    toward the whole distribution, not its argmax."""
    return _decoded_accuracy(model, tasks, domains, temperature=1.0, seed=seed)


@torch.no_grad()
def _decoded_accuracy(
    model: torch.nn.Module, tasks: list[Task], domains: Mapping[str, TaskDomain] | None, *, temperature: float, seed: int
) -> float:
    if not tasks:
        return 0.0
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    max_new = max(len(TOKENIZER.encode(t.answer)) for t in tasks) + 2
    by_length: dict[int, list[tuple[Task, list[int]]]] = {}
    for task in tasks:
        prompt = TOKENIZER.encode(task.prompt, add_bos=True)
        by_length.setdefault(len(prompt), []).append((task, prompt))
    right = 0.0
    for group in by_length.values():
        ids = torch.tensor([p for _, p in group])
        for _ in range(max_new):
            logits = model(input_ids=ids).logits[:, -1].float()
            if temperature > 0:
                probs = torch.softmax(logits / temperature, dim=-1)
                next_ids = torch.multinomial(probs, 1, generator=generator)
            else:
                next_ids = logits.argmax(-1, keepdim=True)
            ids = torch.cat([ids, next_ids], dim=1)
        width = len(group[0][1])
        for (task, _), row in zip(group, ids[:, width:].tolist()):
            answer = row[: row.index(TOKENIZER.eos_token_id)] if TOKENIZER.eos_token_id in row else row
            right += score(task, TOKENIZER.decode(answer), domains or DOMAINS).reward or 0.0
    model.train(was_training)
    return right / len(tasks)


def _padded(batch: list[Task]) -> tuple[torch.Tensor, torch.Tensor]:
    rows, labels = [], []
    for task in batch:
        prompt = TOKENIZER.encode(task.prompt, add_bos=True)
        answer = TOKENIZER.encode(task.answer, add_eos=True)
        rows.append(prompt + answer)
        labels.append([-100] * len(prompt) + answer)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), TOKENIZER.pad_token_id, dtype=torch.long)
    lab = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (r, lb) in enumerate(zip(rows, labels)):
        ids[i, : len(r)] = torch.tensor(r)
        lab[i, : len(lb)] = torch.tensor(lb)
    return ids, lab


class _CheckPrinter:
    """``on_check`` for a console: at most a line every ``every`` steps, and the check that ends the
    warm start (every domain at the target, and below ``ceiling`` when there is one and more than one
    domain: ``supervised_steps``' stop). Checks come every few steps; a line each would flood the
    terminal. ``ended``: whether a check ended the warm start (False: it ran out of steps first);
    ``last``: the last check's accuracies."""

    def __init__(self, name: str, kind: str, target: float | None, every: int, ceiling: float | None = None):
        self.name, self.kind, self.target, self.every, self.ceiling = name, kind, target, every, ceiling
        self.printed_at, self.ended = 0, False
        self.last: dict[str, float] = {}

    def __call__(self, done: int, accuracy: Mapping[str, float], reached: list[str]) -> None:
        self.last = {**self.last, **accuracy}
        self.ended = set(reached) == set(accuracy) and (
            self.ceiling is None or len(accuracy) == 1 or all(a < self.ceiling for a in accuracy.values())
        )
        if done - self.printed_at < self.every and not self.ended:
            return
        self.printed_at = done
        print(
            f"warm start {self.name}: step {done}  {self.kind} training accuracy "
            + ", ".join(f"{d} {a:.2f}" for d, a in accuracy.items())
            + (f"  ({', '.join(reached)} at the target {self.target:g})" if reached and self.target is not None else ""),
            flush=True,
        )


def cached_warm_start(
    path: pathlib.Path,
    build,
    tasks: list[Task],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    domain_weights: Mapping[str, float] | None = None,
    target: float | None = None,
    check_every: int = 25,
    check_problems: int = 64,
    domains: Mapping[str, TaskDomain] | None = None,
    ceiling: float | None = None,
    check_sampled: bool = False,
):
    """Load the warm-started model from ``path`` or build it (``build()`` -> fresh model) and save it.
    ``domain_weights`` .. ``domains``: as in ``supervised_steps`` (the student's mix and target)."""
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    if (path / "config.json").exists():
        return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    model = build()
    if steps:
        up_to = (
            f"up to {steps} supervised steps, to {'sampled' if check_sampled else 'greedy'} training accuracy {target:g} per domain"
            if target
            else f"{steps} supervised steps"
        )
        print(f"warm start {path.name}: {up_to} (cached in {path})", flush=True)
        started = time.perf_counter()
        every = max(PROGRESS_EVERY, steps // PROGRESS_LINES)
        checks = _CheckPrinter(path.name, "sampled" if check_sampled else "greedy", target, every, ceiling)
        losses = supervised_steps(
            model,
            tasks,
            steps=steps,
            batch_size=batch_size,
            lr=lr,
            seed=seed,
            domain_weights=domain_weights,
            target=target,
            check_every=check_every,
            check_problems=check_problems,
            domains=domains,
            ceiling=ceiling,
            check_sampled=check_sampled,
            on_check=checks,
            progress_every=every,
            on_progress=lambda done, loss: print(
                f"warm start {path.name}: step {done}/{steps}  loss {loss:.3f}  {time.perf_counter() - started:.0f} s", flush=True
            ),
        )
        log.info("warm start %s: %d steps, loss %.3f -> %.3f", path.name, len(losses), losses[0], losses[-1])
        if target and not checks.ended:  # a teacher short of its target pulls MOPD toward its mistakes
            short = (
                f"warm start {path.name}: stopped at its step limit ({steps}) short of the target {target:g}"
                + (f" (last check: {', '.join(f'{d} {a:.2f}' for d, a in checks.last.items())})" if checks.last else "")
                + "; raise the step limit or the lr, or check the task"
            )
            print(short, flush=True)
            log.warning(short)
    model.save_pretrained(path)
    return model
