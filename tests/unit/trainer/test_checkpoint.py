"""trainer/checkpoint.py keeps the newest ``keep_last`` checkpoints and LATEST names the newest;
the warm start (trainer/warmstart.py) reports progress and lets no transformers progress bar through.

Run: ``python -m pytest tests/unit/trainer/test_checkpoint.py -q``.
"""

from __future__ import annotations

import pytest
import torch

from rollbook.language_models import TinyModelSpec, build_tiny_model
from rollbook.trainer.checkpoint import TrainerState, load_checkpoint, save_checkpoint


def _model():
    return build_tiny_model(
        TinyModelSpec(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=16), seed=0
    )


def test_the_newest_keep_last_checkpoints_are_kept(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(1, 6):
        save_checkpoint(tmp_path, model, opt, TrainerState(step=step, version=step), keep_last=3)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.glob("step-*")) == ["step-000003", "step-000004", "step-000005"]
    assert (root / "LATEST").read_text() == "step-000005"
    assert load_checkpoint(tmp_path, model, opt).step == 5


def test_by_default_two_checkpoints_are_kept(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(1, 4):
        save_checkpoint(tmp_path, model, opt, TrainerState(step=step, version=step))
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*")) == ["step-000002", "step-000003"]


def test_keep_last_one_keeps_only_the_latest(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(1, 4):
        save_checkpoint(tmp_path, model, opt, TrainerState(step=step, version=step), keep_last=1)
    assert [p.name for p in (tmp_path / "checkpoints").glob("step-*")] == ["step-000003"]


def test_the_warm_start_prints_progress_and_no_progress_bars(tmp_path, capfd):
    from rollbook.tasks import ArithmeticDomain, make_tasks
    from rollbook.trainer.warmstart import PROGRESS_EVERY, cached_warm_start

    tasks = make_tasks(ArithmeticDomain(num_digits=1), "train", 20, 0, allow_fewer=True)
    spec = TinyModelSpec(vocab_size=64, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=16)
    steps = 2 * PROGRESS_EVERY
    cached_warm_start(
        tmp_path / "base-student", lambda: build_tiny_model(spec, seed=0), tasks, steps=steps, batch_size=4, lr=1e-3, seed=0
    )
    cached_warm_start(
        tmp_path / "base-student", lambda: build_tiny_model(spec, seed=0), tasks, steps=steps, batch_size=4, lr=1e-3, seed=0
    )  # the cached copy loads
    out, err = capfd.readouterr()
    assert f"warm start base-student: step {PROGRESS_EVERY}/{steps}" in out
    assert f"warm start base-student: step {steps}/{steps}" in out
    assert "Writing model shards" not in out + err and "%|" not in out + err, err


def test_a_warm_start_that_runs_out_of_steps_short_of_its_target_says_so(tmp_path, capfd, monkeypatch):
    """A teacher that never reached ``teacher_target`` within ``teacher_steps`` is a bad teacher (one
    at 0.10 held-out pulled a student's `addition` from 0.22 to 0.14 under MOPD, docs/RESULTS.md):
    the console and the log say the warm start stopped short, with the last check. One that reached
    it says nothing of the kind."""
    from rollbook.tasks import ArithmeticDomain, make_tasks
    from rollbook.trainer import warmstart

    tasks = make_tasks(ArithmeticDomain(num_digits=1), "train", 40, 0, allow_fewer=True)
    spec = TinyModelSpec(vocab_size=64, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=16)
    scripted = iter([0.1, 0.2, 0.3, 0.99])
    monkeypatch.setattr(warmstart, "greedy_accuracy", lambda model, probe, domains=None: next(scripted))
    kwargs = dict(steps=6, batch_size=4, lr=1e-3, seed=0, target=0.98, check_every=2)
    warmstart.cached_warm_start(tmp_path / "teacher-a", lambda: build_tiny_model(spec, seed=0), tasks, **kwargs)
    out = capfd.readouterr().out
    assert "warm start teacher-a: stopped at its step limit (6) short of the target 0.98 (last check: arithmetic 0.30)" in out
    warmstart.cached_warm_start(tmp_path / "teacher-b", lambda: build_tiny_model(spec, seed=0), tasks, **kwargs)
    out = capfd.readouterr().out
    assert "step 2" in out and "short of the target" not in out  # 0.99 at its first check: done


def test_the_student_mix_draws_each_domain_by_its_weight_not_by_its_number_of_problems(monkeypatch):
    from rollbook.tasks import ArithmeticDomain, ReverseDomain, make_tasks
    from rollbook.trainer import warmstart

    many = make_tasks(ArithmeticDomain(num_digits=2), "train", 900, 0, allow_fewer=True)
    few = make_tasks(ReverseDomain(min_len=1, max_len=3, alphabet="abcde"), "train", 50, 0, allow_fewer=True)
    assert len(many) > 5 * len(few)  # pooled, arithmetic would be most of every batch
    drawn = _domains_trained(monkeypatch, many + few, {"arithmetic": 1.0, "reverse": 3.0}, steps=50)
    assert 0.70 < drawn.count("reverse") / len(drawn) < 0.80
    assert set(_domains_trained(monkeypatch, many + few, {"arithmetic": 0.0, "reverse": 1.0}, steps=5)) == {"reverse"}
    pooled = _domains_trained(monkeypatch, many + few, None, steps=50)
    assert pooled.count("reverse") / len(pooled) < 0.15
    assert warmstart  # imported for _domains_trained's monkeypatch


def test_a_student_target_stops_the_warm_start_once_every_domain_has_reached_it(monkeypatch):
    """The check's greedy accuracy is faked: arithmetic reaches the target at the second check (step 4),
    reverse at the third (step 6). A domain at the target is no longer checked but keeps training
    (taken out, it would be forgotten), and the warm start ends at step 6, not after 50 steps."""
    from rollbook.tasks import ArithmeticDomain, ReverseDomain, make_tasks
    from rollbook.trainer import warmstart

    tasks = make_tasks(ArithmeticDomain(num_digits=1), "train", 40, 0, allow_fewer=True)
    tasks += make_tasks(ReverseDomain(min_len=1, max_len=3, alphabet="abcde"), "train", 40, 0, allow_fewer=True)
    checks = {"arithmetic": iter([0.1, 0.6]), "reverse": iter([0.0, 0.2, 0.9])}
    probed: set[str] = set()

    def check(model, probe, domains=None):
        probed.update(t.task_id for t in probe)
        return next(checks[probe[0].domain])

    monkeypatch.setattr(warmstart, "greedy_accuracy", check)
    seen: list[tuple[int, list[str], list[str]]] = []
    trained: list = []
    per_step = _domains_trained(
        monkeypatch,
        tasks,
        {"arithmetic": 1.0, "reverse": 1.0},
        steps=50,
        batch_size=8,
        target=0.5,
        check_every=2,
        on_check=lambda done, accuracy, reached: seen.append((done, sorted(accuracy), reached)),
        check_problems=5,
        trained=trained,
    )
    assert seen == [
        (2, ["arithmetic", "reverse"], []),
        (4, ["arithmetic", "reverse"], ["arithmetic"]),
        (6, ["reverse"], ["reverse"]),
    ]
    assert len(per_step) == 6 * 8
    assert "arithmetic" in per_step[4 * 8 :]  # still trained after reaching the target
    assert len(probed) == 10 and not probed & {t.task_id for t in trained}  # the checked problems are set apart


def test_a_domain_above_the_ceiling_sits_out_until_the_next_check_and_the_warm_start_stops_with_every_domain_between(
    monkeypatch,
):
    """With a ceiling the warm start ends at the first check where every domain is at or above the
    target and below the ceiling, not at the first where all have reached the target: a domain that
    climbs past the ceiling in a few steps and falls back as fast when it sits out would otherwise
    end wherever that check's draw left it (docs/RESULTS.md, "The MOPD demo")."""
    from rollbook.tasks import ArithmeticDomain, ReverseDomain, make_tasks
    from rollbook.trainer import warmstart

    tasks = make_tasks(ArithmeticDomain(num_digits=1), "train", 40, 0, allow_fewer=True)
    tasks += make_tasks(ReverseDomain(min_len=1, max_len=3, alphabet="abcde"), "train", 40, 0, allow_fewer=True)
    # checks at steps 2, 4, 6, 8, 10: arithmetic above the ceiling, below it, above, above, between;
    # reverse reaches the target at the fourth check, when arithmetic is above the ceiling
    script = {"arithmetic": iter([0.9, 0.3, 0.8, 0.6, 0.4]), "reverse": iter([0.0, 0.1, 0.1, 0.4, 0.45])}
    seen: list = []

    def check(model, probe, domains=None):
        return next(script[probe[0].domain])

    monkeypatch.setattr(warmstart, "greedy_accuracy", check)
    per_step = _domains_trained(
        monkeypatch,
        tasks,
        {"arithmetic": 1.0, "reverse": 1.0},
        steps=100,
        batch_size=8,
        target=0.2,
        ceiling=0.5,
        check_every=2,
        on_check=lambda done, accuracy, reached: seen.append((done, reached)),
    )
    assert len(per_step) == 10 * 8  # the fifth check, the first with both domains in [0.2, 0.5)
    assert [r for _, r in seen] == [["arithmetic"]] * 3 + [["arithmetic", "reverse"]] * 2
    steps = [per_step[i * 8 : (i + 1) * 8] for i in range(10)]
    assert all("arithmetic" not in s for s in steps[2:4] + steps[6:10])  # paused after the checks at 0.9, 0.8, 0.6
    assert "arithmetic" in steps[4] + steps[5]  # back after the check at 0.3
    with pytest.raises(ValueError, match="ceiling"):
        _domains_trained(monkeypatch, tasks, None, steps=2, batch_size=8, target=0.5, ceiling=0.5)


def test_when_every_domain_is_above_the_ceiling_the_least_accurate_one_trains_on(monkeypatch):
    """Nothing would be left to train if every domain sat out, and trained together they all stay up
    (seen: both domains at 1.00 for a thousand steps): the least accurate one trains on alone."""
    from rollbook.tasks import ArithmeticDomain, ReverseDomain, make_tasks
    from rollbook.trainer import warmstart

    tasks = make_tasks(ArithmeticDomain(num_digits=1), "train", 40, 0, allow_fewer=True)
    tasks += make_tasks(ReverseDomain(min_len=1, max_len=3, alphabet="abcde"), "train", 40, 0, allow_fewer=True)
    script = {"arithmetic": iter([0.9, 0.3]), "reverse": iter([0.7, 0.3])}
    monkeypatch.setattr(warmstart, "greedy_accuracy", lambda model, probe, domains=None: next(script[probe[0].domain]))
    per_step = _domains_trained(
        monkeypatch, tasks, {"arithmetic": 1.0, "reverse": 1.0}, steps=100, batch_size=8, target=0.2, ceiling=0.5, check_every=2
    )
    assert len(per_step) == 4 * 8  # stopped at the second check, both between target and ceiling
    assert set(per_step[2 * 8 :]) == {"reverse"}  # after the first, only reverse (0.7 against 0.9) trained
    # one domain has nothing else to train while it sits out: at the target it stops, as without a ceiling
    monkeypatch.setattr(warmstart, "greedy_accuracy", lambda model, probe, domains=None: 0.9)
    alone = [t for t in tasks if t.domain == "reverse"]
    assert (
        len(_domains_trained(monkeypatch, alone, None, steps=100, batch_size=8, target=0.2, ceiling=0.5, check_every=2)) == 2 * 8
    )


def _domains_trained(monkeypatch, tasks, weights, *, steps, batch_size=64, **kw) -> list[str]:
    """The domain of every problem ``supervised_steps`` trained on, in order."""
    from rollbook.trainer import warmstart

    seen: list[str] = []
    trained = kw.pop("trained", [])
    padded = warmstart._padded

    def spy(batch):
        seen.extend(t.domain for t in batch)
        trained.extend(batch)
        return padded(batch)

    monkeypatch.setattr(warmstart, "_padded", spy)
    spec = TinyModelSpec(vocab_size=64, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=16)
    warmstart.supervised_steps(
        build_tiny_model(spec, seed=0), tasks, steps=steps, batch_size=batch_size, lr=1e-3, seed=0, domain_weights=weights, **kw
    )
    return seen


class _SureButBlurry(torch.nn.Module):
    """A fake causal LM for one-digit sums: after "a+b=" it puts probability 0.3 on the right digit and
    0.7 spread over three wrong ones (0.233 each), then eos; greedy answers all right, sampling 30 %."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids):
        from rollbook.tasks import TOKENIZER

        logits = torch.full((*input_ids.shape, TOKENIZER.vocab_size), -1e9)
        for row, ids in enumerate(input_ids.tolist()):
            text = TOKENIZER.decode(ids)
            if text.endswith("="):
                a, b = (int(x) for x in text[:-1].split("+"))
                right = TOKENIZER.encode(str(a + b))[0]
                wrong = [TOKENIZER.encode(str((a + b + k) % 10))[0] for k in (1, 2, 3)]
                logits[row, -1, right] = torch.log(torch.tensor(0.3))
                logits[row, -1, wrong] = torch.log(torch.tensor(0.7 / 3))
            else:
                logits[row, -1, TOKENIZER.eos_token_id] = 0.0
        return type("Out", (), {"logits": logits})()


def test_sampled_accuracy_is_the_expected_reward_where_greedy_is_the_argmax():
    from rollbook.tasks import ArithmeticDomain, make_tasks
    from rollbook.trainer.warmstart import greedy_accuracy, sampled_accuracy

    tasks = [t for t in make_tasks(ArithmeticDomain(num_digits=1), "train", 90, 0, allow_fewer=True) if len(t.answer) == 1]
    tasks = tasks * 10  # the same problems drawn again: more samples
    model = _SureButBlurry()
    assert greedy_accuracy(model, tasks) == 1.0
    sampled = sampled_accuracy(model, tasks, seed=3)
    assert abs(sampled - 0.3) < 0.1, sampled
    assert sampled_accuracy(model, tasks, seed=3) == sampled  # seeded


def test_greedy_accuracy_scores_what_the_model_decodes():
    """Batched by prompt length, it agrees with decoding each problem alone, token by token."""
    import torch

    from rollbook.tasks import TOKENIZER, ReverseDomain, make_tasks, score
    from rollbook.trainer.warmstart import greedy_accuracy, supervised_steps

    tasks = make_tasks(ReverseDomain(min_len=1, max_len=2, alphabet="ab"), "train", 6, 0, allow_fewer=True)
    spec = TinyModelSpec(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=32)
    model = build_tiny_model(spec, seed=0)
    supervised_steps(model, tasks, steps=150, batch_size=16, lr=3e-3, seed=0)  # part-learned: some right, some not

    def alone(task) -> float:
        ids = torch.tensor([TOKENIZER.encode(task.prompt, add_bos=True)])
        out: list[int] = []
        with torch.no_grad():
            while len(out) < 4 and TOKENIZER.eos_token_id not in out:
                out.append(int(model(input_ids=ids).logits[0, -1].argmax()))
                ids = torch.cat([ids, torch.tensor([[out[-1]]])], dim=1)
        return score(task, TOKENIZER.decode([i for i in out if i != TOKENIZER.eos_token_id])).reward or 0.0

    expected = sum(alone(t) for t in tasks) / len(tasks)
    assert 0.0 < expected < 1.0
    assert greedy_accuracy(model, tasks) == expected
    assert model.training  # left as it was


def test_the_check_printer_waits_for_the_band_with_a_ceiling_and_prints_the_stopping_check(capsys):
    """The console line of a warm-start check: one every ``every`` steps, plus the check that ends the
    warm start. With a ceiling that is the first with every domain in [target, ceiling), not every
    check once all have reached the target (those came every few steps while one waited above)."""
    from rollbook.trainer.warmstart import _CheckPrinter

    show = _CheckPrinter("base-student", "greedy", 0.3, every=100, ceiling=0.6)
    show(10, {"addition": 0.1, "program": 0.9}, ["program"])  # within `every`: quiet
    show(20, {"addition": 0.4, "program": 0.9}, ["addition", "program"])  # all reached, one above: quiet
    show(30, {"addition": 0.4, "program": 0.7}, ["addition", "program"])
    show(40, {"addition": 0.45, "program": 0.5}, ["addition", "program"])  # the stop: printed
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "warm start base-student: step 40  greedy training accuracy addition 0.45, program 0.50  (addition, program at the target 0.3)"
    ]
    assert show.ended
    single = _CheckPrinter("teacher-program", "sampled", 0.98, every=100, ceiling=0.99)
    single(10, {"program": 0.995}, ["program"])  # one domain stops at the target, ceiling or not
    assert "step 10" in capsys.readouterr().out
    plain = _CheckPrinter("base-student", "greedy", 0.3, every=100)
    plain(20, {"addition": 0.4, "program": 0.9}, ["addition", "program"])  # no ceiling: all reached ends it
    assert "step 20" in capsys.readouterr().out
