"""The typed seams between the parts (docs/design.md, "Typed seams"): the trainer takes any
``TrainerClient`` and any ``TeacherScorer``, the rollout worker any ``GenerationEngine``.

This file is type-checked too (scripts/typecheck.sh names it): ``_seams_hold`` below is where mypy
proves that ``StoreClient``, the fake here, ``LocalTeacher`` and ``NativeEngine`` satisfy the
protocols, and that ``Trainer`` accepts them. A method renamed or a parameter changed on either side
makes ``scripts/typecheck.sh`` fail. The tests run the same fakes for real.

Run: ``python -m pytest tests/unit/test_seams.py -q`` and ``bash scripts/typecheck.sh``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch

from rollbook.client import PulledBatch, StoreClient, TrainerClient
from rollbook.config import TrainerConfig
from rollbook.language_models import TinyModelSpec, build_tiny_model
from rollbook.rollout.engine import GenerationEngine, NativeEngine
from rollbook.trainer.loop import Trainer
from rollbook.trainer.teachers import LocalTeacher, TeacherScorer


class FakeTrainerClient:
    """The least a trainer needs from a store: one group of 4 per pull, everything else recorded."""

    def __init__(self) -> None:
        self.published: list[tuple[int, int | None, int | None]] = []
        self.acked: list[str] = []
        self.reported: list[int] = []
        self.pulls = 0

    def pull_batch(self, **fields: Any) -> PulledBatch:
        self.pulls += 1
        v = fields["trainer_version"]
        outputs = np.random.default_rng(self.pulls).integers(3, 20, (4, 3)).tolist()
        table = pa.table(
            {
                "prompt_token_ids": [[1, 5]] * 4,
                "output_token_ids": outputs,
                "output_logprobs": [[-1.0] * 3] * 4,
                "output_versions": [[v] * 3] * 4,
                "advantage": pa.array([1.0, -1.0, 0.5, -0.5], pa.float32()),
                "temperature": [1.0] * 4,
                "domain": ["d"] * 4,
                "original_reward": [1.0, 0.0, 1.0, 0.0],
                "reward": [1.0, -1.0, 0.5, -0.5],
                "min_version": [v] * 4,
            }
        )
        return PulledBatch(f"lease-{self.pulls}", table, {})

    def ack_batch(self, lease_id: str, trainer_id: str) -> int:
        self.acked.append(lease_id)
        return 4

    def report_train_step(
        self,
        *,
        step: int,
        trainer_id: str,
        version: int,
        lease_id: str,
        started_at: float,
        finished_at: float,
        stats: Mapping[str, Any],
    ) -> None:
        self.reported.append(step)

    def publish_version(
        self,
        model_id: str,
        version: int,
        checksum: str = "",
        *,
        max_staleness: int | None = None,
        samples_per_version: int | None = None,
    ) -> int:
        self.published.append((version, max_staleness, samples_per_version))
        return version


def _seams_hold(
    store: StoreClient,
    fake: FakeTrainerClient,
    teacher: LocalTeacher,
    engine: NativeEngine,
    config: TrainerConfig,
    model: torch.nn.Module,
) -> None:
    """Never called: mypy checks these assignments (a protocol not satisfied is an error there)."""
    clients: list[TrainerClient] = [store, fake]
    scorer: TeacherScorer = teacher
    generator: GenerationEngine = engine
    Trainer(config, store, model=model, teacher=teacher)
    Trainer(config, fake, model=model, teacher=scorer)
    del clients, generator


def test_the_trainer_runs_against_the_fake_client_and_announces_its_staleness_contract(tmp_path):
    config = TrainerConfig(run_dir=str(tmp_path), num_steps=2, num_samples=4, max_staleness=3, model={"vocab_size": 32})
    torch.manual_seed(0)
    model = build_tiny_model(TinyModelSpec(vocab_size=32))
    client = FakeTrainerClient()
    Trainer(config, client, model=model, teacher=LocalTeacher(build_tiny_model(TinyModelSpec(vocab_size=32)))).run()
    # every version the trainer publishes carries its max_staleness and its num_samples
    assert client.published == [(0, 3, 4), (1, 3, 4), (2, 3, 4)]
    assert client.reported == [0, 1] and client.acked == ["lease-1", "lease-2"]


def test_the_real_implementations_have_every_method_of_their_protocol():
    """The runtime side of ``_seams_hold``: each protocol method exists on the class that implements it."""
    for protocol, impls in (
        (TrainerClient, (StoreClient, FakeTrainerClient)),
        (TeacherScorer, (LocalTeacher,)),
        (GenerationEngine, (NativeEngine,)),
    ):
        methods = [n for n in vars(protocol) if not n.startswith("_") and callable(getattr(protocol, n, None))]
        assert methods, protocol
        for impl in impls:
            missing = [n for n in methods if not hasattr(impl, n)]
            assert not missing, f"{impl.__name__} lacks {missing} of {protocol.__name__}"


def test_distillation_without_a_teacher_is_refused_when_the_trainer_is_built(tmp_path):
    """``teacher: TeacherScorer | None`` made the checker ask what a distilling step does with None:
    it crashed mid-step (AttributeError); now the trainer refuses at construction."""
    from rollbook.errors import ConfigError

    config = TrainerConfig(run_dir=str(tmp_path), num_samples=4, model={"vocab_size": 32}, loss={"distill_coef": 0.5})
    model = build_tiny_model(TinyModelSpec(vocab_size=32))
    with pytest.raises(ConfigError, match="distill_coef"):
        Trainer(config, FakeTrainerClient(), model=model)
    Trainer(config, FakeTrainerClient(), model=model, teacher=LocalTeacher(model))  # with one: fine
