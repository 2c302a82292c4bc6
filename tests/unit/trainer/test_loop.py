"""The trainer loop against a hand-written fake store: acks follow checkpoints, restarts re-ack."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest
import torch

from rollbook.client import PulledBatch
from rollbook.config import TrainerConfig
from rollbook.language_models import TinyModelSpec, build_tiny_model
from rollbook.trainer.loop import Trainer


class FakeStore:
    """Serves one 4-sample group per pull and records what the trainer tells it."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.leases = 0

    def pull_batch(self, **kw) -> PulledBatch:
        self.leases += 1
        rng = np.random.default_rng(self.leases)
        outputs = [rng.integers(3, 20, 3).tolist() for _ in range(4)]
        table = pa.table(
            {
                "prompt_token_ids": [[1, 5]] * 4,
                "output_token_ids": outputs,
                "output_logprobs": [[-1.0] * 3] * 4,
                "output_versions": [[kw["trainer_version"]] * 3] * 4,
                "advantage": pa.array([1.0, -1.0, 0.5, -0.5], pa.float32()),
                "temperature": [1.0] * 4,
                "domain": ["d"] * 4,
                "original_reward": [1.0, 0.0, 1.0, 0.0],
                "reward": [1.0, -1.0, 0.5, -0.5],
                "min_version": [kw["trainer_version"]] * 4,
            }
        )
        self.calls.append(("pull", kw["step"]))
        return PulledBatch(f"lease-{self.leases}", table, {})

    def report_train_step(self, **kw):
        self.calls.append(("report", kw["step"]))

    def ack_batch(self, lease_id, trainer_id=""):
        self.calls.append(("ack", lease_id))
        return 4

    def publish_version(self, model_id, version, checksum="", *, max_staleness=None, samples_per_version=None):
        self.calls.append(("publish", version))
        self.announced = (max_staleness, samples_per_version)
        return version


def _trainer(tmp_path, store, **overrides) -> Trainer:
    config = TrainerConfig(
        **{"run_dir": str(tmp_path), "num_steps": 4, "num_samples": 4, "model": {"vocab_size": 32}, **overrides}
    )
    torch.manual_seed(0)
    return Trainer(config, store, model=build_tiny_model(TinyModelSpec(vocab_size=32)))


def test_leases_are_acked_only_at_checkpoints_and_all_of_them(tmp_path):
    store = FakeStore()
    _trainer(tmp_path, store, checkpoint_every=2).run()
    acks = [c for c in store.calls if c[0] == "ack"]
    assert acks == [("ack", "lease-1"), ("ack", "lease-2"), ("ack", "lease-3"), ("ack", "lease-4")]
    # lease-1 is acked after step 1's report, never before the step-2 checkpoint
    assert store.calls.index(("ack", "lease-1")) > store.calls.index(("report", 1))
    assert [c[1] for c in store.calls if c[0] == "publish"] == [0, 1, 2, 3, 4]


def test_a_restarted_trainer_reacks_its_checkpoint_and_republishes_its_version(tmp_path):
    _trainer(tmp_path, FakeStore()).run()
    store = FakeStore()
    trainer = _trainer(tmp_path, store)
    state = trainer.start()
    assert (state.step, state.version) == (4, 4)
    assert store.calls == [("ack", "lease-4"), ("publish", 4)]


def test_proximal_behavior_turns_the_decoupling_off(tmp_path):
    """``loss.proximal = "behavior"``: the proximal policy is the sampler's (standard PPO, ratio against
    pi_behavior, weight 1); by default it is recomputed with the trainer's weights."""
    stats = {}
    for mode in ("recompute", "behavior"):
        trainer = _trainer(tmp_path / mode, FakeStore(), loss={"proximal": mode})
        trainer.start()
        stats[mode] = trainer.step()
    # the fake sampler logged -1.0 per token; a fresh 32-token model gives about -log(32) = -3.5
    assert stats["recompute"]["proximal/behavior_gap"] > 1.0
    assert stats["behavior"]["proximal/behavior_gap"] == 0.0


def test_perf_publish_s_is_the_time_spent_publishing_the_new_version(tmp_path, monkeypatch):
    """A fake clock that only the publisher advances: ``perf/publish_s`` is exactly the 2.5 s the
    publisher took (so it is measured around the publishers, not around the whole step)."""
    import time

    clock = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])

    def slow_publisher(version, state_dict):
        clock[0] += 2.5

    config = TrainerConfig(run_dir=str(tmp_path), num_steps=2, num_samples=4, model={"vocab_size": 32})
    trainer = Trainer(config, FakeStore(), model=build_tiny_model(TinyModelSpec(vocab_size=32)), publishers=[slow_publisher])
    trainer.start()
    stats = trainer.step()
    assert stats is not None and stats["perf/publish_s"] == 2.5


def test_lr_warmup_is_linear_then_flat_and_a_resumed_run_continues_it(tmp_path):
    """lr_warmup_steps 4 at lr 1e-3: steps 0..3 update at 1/4, 2/4, 3/4, 4/4 of it, later steps at the
    full lr; a trainer resumed from the step-2 checkpoint takes up the schedule at step 2, not at 0."""
    trainer, stats = _run(tmp_path / "a", num_steps=6)
    assert [round(s["optim/lr"], 9) for s in stats] == [0.00025, 0.0005, 0.00075, 0.001, 0.001, 0.001]
    assert trainer.optimizer.param_groups[0]["lr"] == 1e-3  # what AdamW itself held at the last update
    _run(tmp_path / "b", num_steps=2)
    _, resumed = _run(tmp_path / "b", num_steps=5)
    assert [round(s["optim/lr"], 9) for s in resumed] == [0.00075, 0.001, 0.001]


def test_without_warmup_every_step_takes_the_full_lr(tmp_path):
    _, stats = _run(tmp_path, num_steps=3, lr_warmup_steps=0)
    assert [s["optim/lr"] for s in stats] == [1e-3] * 3


def test_a_cosine_decay_follows_the_warm_up_down_to_the_floor_at_the_last_step_and_resumes_where_it_was(tmp_path):
    """lr 1e-3, warm-up 2, cosine to 0.1 over 7 steps: 0.5e-3, 1e-3, then the half cosine from 1e-3
    (step 2) to 1e-4 (step 6, the last) through 0.55e-3 halfway (step 4); a run resumed at step 3 goes on
    along the same curve."""
    expected = [0.0005, 0.001] + [1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(5)]
    assert round(expected[4], 9) == 0.00055 and round(expected[-1], 9) == 0.0001
    _, stats = _run(tmp_path / "a", num_steps=7, lr_warmup_steps=2, lr_decay="cosine", lr_min_ratio=0.1)
    assert [round(s["optim/lr"], 9) for s in stats] == [round(e, 9) for e in expected]
    _run(tmp_path / "b", num_steps=3, lr_warmup_steps=2, lr_decay="cosine", lr_min_ratio=0.1, schedule_steps=7)
    _, resumed = _run(tmp_path / "b", num_steps=7, lr_warmup_steps=2, lr_decay="cosine", lr_min_ratio=0.1)
    assert [round(s["optim/lr"], 9) for s in resumed] == [round(e, 9) for e in expected[3:]]
    from rollbook.trainer.loop import scheduled_lr

    assert scheduled_lr(1e-3, 9, warmup_steps=2, decay="cosine", num_steps=7, min_ratio=0.1) == pytest.approx(1e-4)
    assert scheduled_lr(1e-3, 0, decay="cosine", num_steps=1, min_ratio=0.2) == pytest.approx(2e-4)
    with pytest.raises(ValueError, match="cosine"):
        scheduled_lr(1e-3, 5, decay="linear")


def _run(
    run_dir, num_steps: int, lr_warmup_steps: int = 4, schedule_steps: int | None = None, **kw
) -> tuple[Trainer, list[dict]]:
    """A trainer's ``num_steps`` steps; ``schedule_steps``: the run length its lr schedule plans for
    (a run stopped early, to resume), default ``num_steps``."""
    trainer = _trainer(
        run_dir, FakeStore(), lr=1e-3, lr_warmup_steps=lr_warmup_steps, num_steps=schedule_steps or num_steps, **kw
    )
    if schedule_steps is None:
        return trainer, trainer.run()
    trainer.start()
    history = []
    while trainer.state.step < num_steps:  # stopped early, as by a crash: every step is checkpointed
        stats = trainer.step()
        assert stats is not None
        history.append(stats)
    return trainer, history


def _mixed_lengths(seed: int, lengths: tuple[int, ...]) -> pa.Table:
    """One batch of ``len(lengths)`` sequences of those output lengths, advantages of both signs."""
    rng = np.random.default_rng(seed)
    outputs = [rng.integers(3, 20, n).tolist() for n in lengths]
    n = len(lengths)
    return pa.table(
        {
            "prompt_token_ids": [[1, 5]] * n,
            "output_token_ids": outputs,
            "output_logprobs": [(-rng.uniform(0.5, 3.0, len(o))).tolist() for o in outputs],
            "output_versions": [[0] * len(o) for o in outputs],
            "advantage": pa.array([1.0, -1.0, 0.5, -0.5][:n], pa.float32()),
            "temperature": [1.0] * n,
            "domain": ["d"] * n,
        }
    )


def _one_step(tmp_path, **overrides) -> TrainerConfig:
    """A one-step config on the 32-token tiny model, gradients unclipped (so they can be compared)."""
    return TrainerConfig(
        **{"run_dir": str(tmp_path), "num_steps": 1, "num_samples": 4, "model": {"vocab_size": 32}, "grad_clip": 1e6, **overrides}
    )


def test_sequence_mean_weighs_every_sequence_alike_and_micro_batches_do_not_change_the_step(tmp_path):
    """loss.aggregation = "sequence_mean": the step's gradient is the mean over sequences of each one's
    token-mean loss gradient, whether the batch is one micro-batch or one per sequence; token_mean's differs."""
    from rollbook.trainer.loop import _Rows

    table = _mixed_lengths(seed=3, lengths=(1, 40, 20, 60))

    def grads(**kw):
        trainer = _trainer(tmp_path, FakeStore(), grad_clip=1e6, **kw)
        trainer.update(_Rows.from_table(table))
        return torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])

    whole = grads(loss={"aggregation": "sequence_mean"})
    split = grads(loss={"aggregation": "sequence_mean"}, micro_batch_tokens=64)  # 129 tokens: several micro-batches
    torch.testing.assert_close(split, whole, rtol=1e-4, atol=1e-7)
    one_by_one = []
    for i in range(4):  # each sequence alone is its own token mean: the same under either aggregation
        single = table.slice(i, 1)
        trainer = _trainer(tmp_path, FakeStore(), grad_clip=1e6)
        trainer.update(_Rows.from_table(single))
        one_by_one.append(torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None]))
    torch.testing.assert_close(whole, sum(one_by_one) / 4, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(grads(), whole, rtol=1e-2, atol=1e-6)


def test_domain_routed_teachers_score_micro_batches_of_one_route_and_the_step_is_unchanged(tmp_path):
    """With a DomainRouter, each route's sequences are packed apart: every micro-batch the teacher
    scores is one teacher's (none is re-packed), and the step's gradient is the one mixed packing gives."""
    from rollbook.trainer.loop import _Rows
    from rollbook.trainer.teachers import DomainRouter, LocalTeacher

    table = _mixed_lengths(seed=11, lengths=(30, 12, 25, 18))
    table = table.set_column(table.schema.get_field_index("domain"), "domain", pa.array(["x", "y", "x", "y"]))
    scored: list[list[str]] = []

    class Recording(DomainRouter):
        def score(self, packed, domains):
            scored.append(list(domains))
            return super().score(packed, domains)

    def grads(routed: bool):
        config = _one_step(tmp_path, micro_batch_tokens=80, loss={"distill_coef": 1.0, "distill_estimator": "sampled"})
        teachers = {
            d: LocalTeacher(build_tiny_model(TinyModelSpec(vocab_size=32), seed=seed)) for d, seed in (("x", 7), ("y", 8))
        }
        router = Recording(teachers)
        if not routed:
            router.route = None  # type: ignore[method-assign]  # as a teacher that does not route
        torch.manual_seed(0)
        trainer = Trainer(config, FakeStore(), model=build_tiny_model(TinyModelSpec(vocab_size=32)), teacher=router)
        scored.clear()
        trainer.update(_Rows.from_table(table))
        return torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None]), list(scored)

    grouped, grouped_scored = grads(routed=True)
    assert grouped_scored and all(len(set(d)) == 1 for d in grouped_scored)
    assert sorted(d for ds in grouped_scored for d in ds) == ["x", "x", "y", "y"]
    mixed, mixed_scored = grads(routed=False)
    assert any(len(set(d)) > 1 for d in mixed_scored)  # the packing the grouping replaces mixes them
    torch.testing.assert_close(grouped, mixed, rtol=1e-4, atol=1e-7)


def test_the_mopd_term_aggregates_on_its_own_and_micro_batches_do_not_change_the_step(tmp_path):
    """loss.distill_aggregation = "token_mean" beside aggregation = "sequence_mean": the step's gradient
    is the sequence-mean RL gradient plus the token-mean MOPD gradient (each measured alone), in one
    micro-batch or several; with the MOPD term per sequence too, it differs."""
    from rollbook.trainer.loop import _Rows
    from rollbook.trainer.teachers import LocalTeacher

    table = _mixed_lengths(seed=5, lengths=(2, 40, 20, 60))

    def grads(micro_batch_tokens=None, **loss):
        config = _one_step(
            tmp_path, loss={"adv_clip": 5.0, **loss}, **({"micro_batch_tokens": micro_batch_tokens} if micro_batch_tokens else {})
        )
        teacher = LocalTeacher(build_tiny_model(TinyModelSpec(vocab_size=32), seed=7))
        torch.manual_seed(0)
        trainer = Trainer(config, FakeStore(), model=build_tiny_model(TinyModelSpec(vocab_size=32)), teacher=teacher)
        trainer.update(_Rows.from_table(table))
        return torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])

    mixed = {"aggregation": "sequence_mean", "distill_aggregation": "token_mean", "distill_coef": 1.0}
    whole = grads(**mixed)
    torch.testing.assert_close(grads(micro_batch_tokens=64, **mixed), whole, rtol=1e-4, atol=1e-7)
    rl = grads(aggregation="sequence_mean", distill_coef=0.0)
    distill = grads(aggregation="token_mean", distill_coef=1.0, rl_coef=0.0)
    torch.testing.assert_close(whole, rl + distill, rtol=1e-4, atol=1e-6)
    assert not torch.allclose(grads(aggregation="sequence_mean", distill_coef=1.0), whole, rtol=1e-2, atol=1e-6)


def test_the_full_vocabulary_distillation_steps_pull_the_student_onto_its_teacher(tmp_path):
    """loss.distill_estimator = "full" (MOPD alone): every update lowers the student's exact reverse KL
    to the teacher on the batch's positions, in one micro-batch or several alike, and the step reports
    the teacher gap of the sampled tokens per domain; a teacher without whole distributions is refused."""
    from rollbook.trainer.loop import _Rows
    from rollbook.trainer.losses import full_kl_distill_loss
    from rollbook.trainer.packing import head_log_softmax, pack_sequences, packed_hidden
    from rollbook.trainer.teachers import LocalTeacher

    table = _mixed_lengths(seed=5, lengths=(2, 40, 20, 60))
    rows = _Rows.from_table(table)
    [packed] = pack_sequences(rows.prompts, rows.outputs)
    teacher = LocalTeacher(build_tiny_model(TinyModelSpec(vocab_size=32), seed=7), temperature=0.05)  # a sharp one

    def make(**kw):
        config = TrainerConfig(
            run_dir=str(tmp_path),
            num_steps=1,
            num_samples=4,
            model={"vocab_size": 32},
            lr=3e-3,
            loss={"distill_coef": 1.0, "rl_coef": 0.0, "distill_estimator": "full"},
            **kw,
        )
        torch.manual_seed(0)
        return Trainer(config, FakeStore(), model=build_tiny_model(TinyModelSpec(vocab_size=32)), teacher=teacher)

    def kl(model) -> float:  # the whole [T, V] at once: the reference the trainer's chunks add up to
        with torch.no_grad():
            student = head_log_softmax(model, packed_hidden(model, packed), 1.0)
            whole = teacher.score_full(packed, ["d"] * 4).rows(torch.arange(len(student)))
            loss, _ = full_kl_distill_loss(student, whole, torch.ones(len(student), dtype=torch.bool))
        return float(loss)

    trainer = make()
    start = kl(trainer.model)
    history = []
    for _ in range(10):
        stats = trainer.update(rows)
        history.append(kl(trainer.model))
    assert history[-1] < 0.75 * start and all(b < a for a, b in zip([start, *history], history))
    assert "teacher_gap/d" in stats and math.isfinite(stats["teacher_gap/d"]) and "mopd/kl_mean" in stats

    def first_grads(**kw):
        t = make(grad_clip=1e6, **kw)
        t.update(rows)
        return torch.cat([p.grad.flatten() for p in t.model.parameters() if p.grad is not None])

    torch.testing.assert_close(first_grads(micro_batch_tokens=64), first_grads(), rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(first_grads(logprob_chunk_tokens=7), first_grads(), rtol=1e-4, atol=1e-7)

    class SampledOnly:
        def score(self, packed, domains):
            return torch.zeros(packed.num_output_tokens)

    config = TrainerConfig(
        run_dir=str(tmp_path), model={"vocab_size": 32}, loss={"distill_coef": 1.0, "distill_estimator": "full"}
    )
    with pytest.raises(TypeError, match="SampledOnly scores sampled tokens only"):
        Trainer(config, FakeStore(), model=build_tiny_model(TinyModelSpec(vocab_size=32)), teacher=SampledOnly())


@pytest.mark.parametrize("num_minibatches", [1, 2])
def test_the_proximal_log_probs_are_the_weights_before_the_first_update_and_frozen_scorers_score_each_micro_batch(
    tmp_path, num_minibatches
):
    """The proximal log-probs a step trains on are the pre-update weights' for every row: the first
    minibatch's from its own training forward (no forward of their own: one minibatch runs one student
    forward per micro-batch), the second's from a no-grad forward before the first update. The teacher
    and the KL reference, scored micro-batch by micro-batch, give what they give for the whole batch."""
    import copy

    from rollbook.trainer.loop import _Rows, minibatch_order
    from rollbook.trainer.packing import pack_sequences, packed_logprobs
    from rollbook.trainer.teachers import LocalTeacher

    table = _mixed_lengths(seed=7, lengths=(5, 60, 30, 50))
    rows = _Rows.from_table(table)
    config = TrainerConfig(
        run_dir=str(tmp_path),
        num_samples=4,
        model={"vocab_size": 32},
        lr=1e-2,  # the second minibatch trains weights that moved
        num_minibatches=num_minibatches,
        micro_batch_tokens=64,  # several micro-batches
        loss={"distill_coef": 1.0, "kl_coef": 0.1},
    )
    teacher = LocalTeacher(build_tiny_model(TinyModelSpec(vocab_size=32), seed=7))
    torch.manual_seed(0)
    trainer = Trainer(config, FakeStore(), model=build_tiny_model(TinyModelSpec(vocab_size=32)), teacher=teacher)
    before = copy.deepcopy(trainer.model)
    [whole] = pack_sequences(rows.prompts, rows.outputs)
    with torch.no_grad():
        expected = packed_logprobs(before, whole, 1.0)
        expected_teacher = teacher.score(whole, rows.domains)
        expected_reference = packed_logprobs(trainer.reference, whole, 1.0)
    captured, forwards = [], []
    step_inputs = trainer._step_inputs
    trainer._step_inputs = lambda *a: captured.append(step_inputs(*a)) or captured[-1]
    trainer.model.register_forward_hook(lambda *_: forwards.append(1))
    trainer.update(rows)
    student_forwards = len(forwards)
    [inputs] = captured
    torch.testing.assert_close(inputs.proximal, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(inputs.teacher, expected_teacher, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(inputs.reference, expected_reference, rtol=1e-5, atol=1e-5)
    assert not torch.equal(packed_logprobs(trainer.model, whole, 1.0).detach(), expected)  # the weights moved
    order = np.array_split(minibatch_order(config.seed, 0, 4), num_minibatches)
    micro_batches = sum(len(list(trainer._micro_batches(rows, m))) for m in order)
    if num_minibatches == 1:
        assert student_forwards == micro_batches  # the training forwards and nothing else
    else:
        assert student_forwards > micro_batches  # the second minibatch's rows, recomputed before the first update


def test_the_loglinear_proximal_runs_no_forward_of_its_own(tmp_path):
    """``loss.proximal = "loglinear"`` interpolates from each training forward: tokens the trainer's
    current version sampled (alpha 0) keep their behavior log-probs, and the step runs one student
    forward per micro-batch, over two minibatches too."""
    from rollbook.trainer.loop import _Rows, minibatch_order

    rows = _Rows.from_table(_mixed_lengths(seed=7, lengths=(5, 60, 30, 50)))
    trainer = _trainer(tmp_path, FakeStore(), num_minibatches=2, micro_batch_tokens=64, loss={"proximal": "loglinear"})
    captured, forwards = [], []
    step_inputs = trainer._step_inputs
    trainer._step_inputs = lambda *a: captured.append(step_inputs(*a)) or captured[-1]
    trainer.model.register_forward_hook(lambda *_: forwards.append(1))
    trainer.update(rows)
    torch.testing.assert_close(captured[0].proximal, rows.behavior, rtol=0, atol=0)
    order = np.array_split(minibatch_order(trainer.config.seed, 0, 4), 2)
    assert len(forwards) == sum(len(list(trainer._micro_batches(rows, m))) for m in order)
