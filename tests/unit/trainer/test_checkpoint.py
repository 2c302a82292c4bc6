"""trainer/checkpoint.py keeps the newest ``keep_last`` checkpoints and LATEST names the newest;
the warm start (trainer/warmstart.py) reports progress and lets no transformers progress bar through.

Run: ``python -m pytest tests/unit/trainer/test_checkpoint.py -q``.
"""

from __future__ import annotations

import torch

from rollbook.models import TinyModelSpec, build_tiny_model
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


def test_the_student_mix_draws_each_domain_by_its_weight_not_by_its_number_of_problems():
    import random

    from rollbook.tasks import ArithmeticDomain, ReverseDomain, make_tasks
    from rollbook.trainer.warmstart import _weighted_draw

    many = make_tasks(ArithmeticDomain(num_digits=2), "train", 900, 0, allow_fewer=True)
    few = make_tasks(ReverseDomain(min_len=1, max_len=3, alphabet="abcde"), "train", 50, 0, allow_fewer=True)
    assert len(many) > 5 * len(few)  # pooled, arithmetic would be most of every batch
    draw = _weighted_draw(many + few, {"arithmetic": 1.0, "reverse": 3.0}, random.Random(0))
    drawn = [draw().domain for _ in range(4000)]
    assert 0.72 < drawn.count("reverse") / len(drawn) < 0.78
    only = _weighted_draw(many + few, {"arithmetic": 0.0, "reverse": 1.0}, random.Random(0))
    assert {only().domain for _ in range(200)} == {"reverse"}
