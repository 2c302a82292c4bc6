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

from rollbook.models import quiet_transformers
from rollbook.tasks import TOKENIZER, Task

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
) -> list[float]:
    """Cross-entropy on the answer tokens (prompt tokens are context only); returns the losses.
    ``on_progress(step_done, loss)`` is called every ``progress_every`` steps and after the last.
    ``domain_weights`` (``warm_start.student_mix``): each problem of a batch picks its domain with
    these weights, then a problem of that domain; None or empty: problems drawn from ``tasks`` pooled."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    history = []
    model.train()
    draw = _weighted_draw(tasks, domain_weights, rng) if domain_weights else lambda: rng.choice(tasks)
    for _ in range(steps):
        batch = [draw() for _ in range(batch_size)]
        ids, labels = _padded(batch)
        logits = model(input_ids=ids, attention_mask=(ids != TOKENIZER.pad_token_id).long()).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        history.append(loss.item())
        if on_progress is not None and (len(history) % progress_every == 0 or len(history) == steps):
            on_progress(len(history), history[-1])
    return history


def _weighted_draw(tasks: list[Task], weights: Mapping[str, float], rng: random.Random):
    """A function drawing one problem: a domain by ``weights``, then one of its problems."""
    by_domain: dict[str, list[Task]] = {}
    for task in tasks:
        by_domain.setdefault(task.domain, []).append(task)
    names = [d for d, w in weights.items() if w > 0]
    missing = [d for d in names if d not in by_domain]
    if missing:
        raise ValueError(f"domain weights name {missing}, which have no training problems")
    cumulative = list(itertools.accumulate(weights[d] for d in names))
    return lambda: rng.choice(by_domain[rng.choices(names, cum_weights=cumulative)[0]])


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
):
    """Load the warm-started model from ``path`` or build it (``build()`` -> fresh model) and save it."""
    from transformers import AutoModelForCausalLM

    quiet_transformers()
    if (path / "config.json").exists():
        return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    model = build()
    if steps:
        print(f"warm start {path.name}: {steps} supervised steps (cached in {path})", flush=True)
        started = time.perf_counter()
        losses = supervised_steps(
            model,
            tasks,
            steps=steps,
            batch_size=batch_size,
            lr=lr,
            seed=seed,
            domain_weights=domain_weights,
            progress_every=max(PROGRESS_EVERY, steps // PROGRESS_LINES),
            on_progress=lambda done, loss: print(
                f"warm start {path.name}: step {done}/{steps}  loss {loss:.3f}  {time.perf_counter() - started:.0f} s", flush=True
            ),
        )
        log.info("warm start %s: %d steps, loss %.3f -> %.3f", path.name, steps, losses[0], losses[-1])
    model.save_pretrained(path)
    return model
