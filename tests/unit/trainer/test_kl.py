"""The KL penalty to a reference policy: k1 and k3 against hand arithmetic, and in the loop a
reference equal to the starting policy reports KL 0 on the first step (tiny model, real torch)."""

from __future__ import annotations

import math

import pytest
import torch

from rollbook.config import TrainerConfig
from rollbook.language_models import TinyModelSpec, build_tiny_model
from rollbook.trainer import losses
from rollbook.trainer.loop import Trainer
from tests.unit.trainer.test_loop import FakeStore

# r = log pi_theta - log pi_ref per token; the third token is masked out (its values must not count)
LOGP = [-1.0, -0.5, -3.0, -2.0]
REF = [-1.2, -0.5, 9.9, -1.0]
MASK = [True, True, False, True]


def _hand(estimator: str) -> float:
    values = []
    for logp, ref, keep in zip(LOGP, REF, MASK):
        if not keep:
            continue
        r = logp - ref
        values.append(r if estimator == "k1" else math.exp(-r) - 1 + r)
    return sum(values) / len(values)


def test_k1_and_k3_equal_a_hand_computation():
    # by hand: r = 0.2, 0.0, -1.0
    # k1 = (0.2 + 0 - 1) / 3 = -0.266667
    # k3 = ((e^-0.2 - 1 + 0.2) + 0 + (e^1 - 1 - 1)) / 3 = (0.018731 + 0.718282) / 3 = 0.245671
    assert _hand("k1") == pytest.approx(-0.8 / 3)
    assert _hand("k3") == pytest.approx((math.exp(-0.2) - 0.8 + math.exp(1.0) - 2.0) / 3)
    for estimator in ("k1", "k3"):
        logp = torch.tensor(LOGP, requires_grad=True)
        loss, stats = losses.kl_penalty(logp, torch.tensor(REF), torch.tensor(MASK), estimator=estimator)
        assert loss.item() == pytest.approx(_hand(estimator), abs=1e-6)
        assert stats["kl/mean"].item() == pytest.approx(_hand(estimator), abs=1e-6)
        assert stats["kl/k1_mean"].item() == pytest.approx(_hand("k1"), abs=1e-6)
        assert stats["kl/k3_mean"].item() == pytest.approx(_hand("k3"), abs=1e-6)
        assert stats["kl/num_valid_tokens"].item() == 3
        loss.backward()
        assert logp.grad is not None and logp.grad[2].item() == 0.0  # a masked token gets no gradient


def test_k3_gradient_is_that_of_its_formula():
    # d/d logp of mean(exp(ref - logp) - 1 + logp - ref) = (1 - exp(ref - logp)) / T
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0])
    loss, _ = losses.kl_penalty(logp, ref, torch.ones(2, dtype=torch.bool), estimator="k3")
    loss.backward()
    expected = [(1 - math.exp(-0.5)) / 2, (1 - math.exp(1.0)) / 2]
    assert logp.grad.tolist() == pytest.approx(expected, abs=1e-6)


def test_k3_is_never_negative_and_bounded():
    logp = torch.tensor([0.0, -60.0, -1e-7, -5.0])
    ref = torch.tensor([-60.0, 0.0, 0.0, -5.0])
    _, stats = losses.kl_penalty(logp, ref, torch.ones(4, dtype=torch.bool), estimator="k3")
    k3 = stats["kl/k3_mean"].item()
    assert 0.0 <= k3 <= losses.K3_CLAMP
    assert math.isfinite(stats["kl/k1_mean"].item())


def test_an_unknown_estimator_is_refused():
    with pytest.raises(ValueError, match="'k1' or 'k3'"):
        losses.kl_penalty(torch.zeros(2), torch.zeros(2), torch.ones(2), estimator="k2")  # type: ignore[arg-type]


def test_add_kl_penalty_weights_the_term_and_reports_the_total():
    policy = (torch.tensor(0.5), {"ppo/loss": torch.tensor(0.5), "loss/total": torch.tensor(0.5)})
    kl = losses.kl_penalty(torch.tensor([-1.0]), torch.tensor([-1.2]), torch.ones(1), estimator="k1")
    loss, stats = losses.add_kl_penalty(policy, kl, kl_coef=0.1)
    assert loss.item() == pytest.approx(0.5 + 0.1 * 0.2)
    assert stats["loss/total"].item() == pytest.approx(0.52)
    assert stats["kl/mean"].item() == pytest.approx(0.2)


def _trainer(tmp_path, *, kl_coef: float, estimator: str = "k3", num_steps: int = 3) -> Trainer:
    config = TrainerConfig(
        run_dir=str(tmp_path),
        num_steps=num_steps,
        num_samples=4,
        model={"vocab_size": 32},
        lr=0.05,
        export_final=False,
        loss={"kl_coef": kl_coef, "kl_estimator": estimator},
    )
    return Trainer(config, FakeStore(), model=build_tiny_model(TinyModelSpec(vocab_size=32), seed=3))


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_with_the_initial_policy_as_reference_the_first_step_reports_kl_0_then_it_grows(tmp_path, estimator):
    trainer = _trainer(tmp_path, kl_coef=0.1, estimator=estimator)
    assert trainer.reference is not None and trainer.reference is not trainer.model
    assert not any(p.requires_grad for p in trainer.reference.parameters())
    history = trainer.run()
    assert history[0]["kl/mean"] == pytest.approx(0.0, abs=1e-6)
    assert history[0]["kl/k3_mean"] == pytest.approx(0.0, abs=1e-6)
    # the student moved (lr 0.05) and the reference did not: later steps see a positive KL (k3)
    assert history[-1]["kl/k3_mean"] > 1e-4
    assert history[0]["loss/total"] == pytest.approx(history[0]["ppo/loss"])  # kl term is 0 at step 0


def test_the_kl_term_is_in_the_loss_a_reference_elsewhere_shows_it(tmp_path):
    far = build_tiny_model(TinyModelSpec(vocab_size=32), seed=7)  # another initialisation: KL > 0 from step 0
    config = TrainerConfig(
        run_dir=str(tmp_path),
        num_steps=1,
        num_samples=4,
        model={"vocab_size": 32},
        export_final=False,
        loss={"kl_coef": 0.5, "kl_estimator": "k3"},
    )
    history = Trainer(config, FakeStore(), model=build_tiny_model(TinyModelSpec(vocab_size=32), seed=3), reference=far).run()
    step = history[0]
    assert step["kl/mean"] > 0.01
    assert step["loss/total"] == pytest.approx(step["ppo/loss"] + 0.5 * step["kl/mean"], rel=1e-4, abs=1e-6)


def test_a_resumed_run_keeps_the_initial_reference(tmp_path):
    _trainer(tmp_path, kl_coef=0.1).run()  # 3 steps, checkpointed
    resumed = _trainer(tmp_path, kl_coef=0.1, num_steps=4)
    fresh = build_tiny_model(TinyModelSpec(vocab_size=32), seed=3)
    resumed.start()
    ref = resumed.reference.state_dict()
    assert all(torch.equal(ref[k], v) for k, v in fresh.state_dict().items())
    assert not all(torch.equal(resumed.model.state_dict()[k], v) for k, v in fresh.state_dict().items())


def test_without_kl_coef_no_reference_is_built_and_no_kl_is_reported(tmp_path):
    trainer = _trainer(tmp_path, kl_coef=0.0)
    assert trainer.reference is None
    assert not any(k.startswith("kl/") for k in trainer.run()[0])


def test_a_reference_directory_is_loaded_checked_and_frozen(tmp_path):
    from rollbook.errors import ConfigError
    from rollbook.trainer.model_builders import build_reference

    student = build_tiny_model(TinyModelSpec(vocab_size=32), seed=3)
    build_tiny_model(TinyModelSpec(vocab_size=32), seed=5).save_pretrained(tmp_path / "ref")
    build_tiny_model(TinyModelSpec(vocab_size=40), seed=5).save_pretrained(tmp_path / "wide")
    config = lambda ref: TrainerConfig(reference=str(ref), loss={"kl_coef": 0.1})  # noqa: E731
    reference = build_reference(config(tmp_path / "ref"), student)
    assert not reference.training and not any(p.requires_grad for p in reference.parameters())
    saved = build_tiny_model(TinyModelSpec(vocab_size=32), seed=5).state_dict()
    assert all(torch.equal(reference.state_dict()[k], v) for k, v in saved.items())
    with pytest.raises(ConfigError, match="vocabulary of 40 ids, the student 32"):
        build_reference(config(tmp_path / "wide"), student)
    with pytest.raises(ConfigError, match=r"^reference '.*nowhere': no such directory"):
        build_reference(config(tmp_path / "nowhere"), student)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"not a Hugging Face model directory \(no config.json\)"):
        build_reference(config(tmp_path / "empty"), student)
    with pytest.warns(UserWarning, match="kl_coef = 0"):
        TrainerConfig(reference=str(tmp_path / "ref"))
