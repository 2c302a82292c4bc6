"""The ray placement's weight channel (rollbook/weights/ray_objects.py) on a real local Ray instance:
versions through the board and the object store arrive whole and in order, an up-to-date receiver
gets nothing, a missing board is FileNotFoundError (the worker waits for it), a board that is gone
reads as unreachable (None), never as an error, and a restarted trainer's version (the older one it
resumed from) replaces what the dead one published."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    from rollbook.environment import prepare_local_ray

    prepare_local_ray()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _model(seed: int):
    """About 1 MiB of weights: above Ray's inline limit (100 KiB), so in the object store."""
    from rollbook.config import ModelConfig
    from rollbook.language_models import build_student

    return build_student(ModelConfig(hidden_size=128, intermediate_size=256), seed=seed)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_versions_arrive_whole_and_in_order(ray_local):
    from rollbook.weights.ray_objects import RayObjectPublisher, RayObjectReceiver, create_board

    with pytest.raises(FileNotFoundError):
        RayObjectReceiver("no-such-board")
    board = create_board("board-order")
    publisher, receiver = RayObjectPublisher("board-order"), RayObjectReceiver("board-order")
    assert receiver.fetch() is None and receiver.version == -1  # nothing published yet
    first, second = _model(0).state_dict(), _model(1).state_dict()
    publisher.publish(0, first)
    snap = receiver.fetch()
    assert snap is not None and snap.version == 0 and _same(snap.state_dict, first)
    assert receiver.fetch() is None  # up to date
    publisher.publish(1, second)
    publisher.publish(2, first)  # a receiver that missed one gets the newest
    snap = receiver.fetch()
    assert snap is not None and snap.version == 2 and _same(snap.state_dict, first)
    target = _model(3)
    from rollbook.weights.base import load_into

    load_into(target, snap)
    assert _same(target.state_dict(), first)
    ray_local.kill(board)
    assert receiver.fetch() is None  # the board is gone: unreachable, the worker keeps its weights


def test_a_restarted_trainer_s_older_version_replaces_what_the_dead_one_published(ray_local):
    from rollbook.weights.ray_objects import RayObjectPublisher, RayObjectReceiver, create_board

    board = create_board("board-owner")  # noqa: F841  (a handle keeps the actor alive)

    @ray_local.remote(num_cpus=0)
    class Trainer:  # owns what it puts, as trainer rank 0 does
        def publish(self, version: int, seed: int) -> None:
            self.publisher = RayObjectPublisher("board-owner")
            self.publisher.publish(version, _model(seed).state_dict())

    trainer = Trainer.remote()
    ray_local.get(trainer.publish.remote(5, 0))
    ray_local.kill(trainer)  # the board still names its version 5, owned by a dead process
    receiver = RayObjectReceiver("board-owner", timeout_s=20)
    snap = receiver.fetch()  # lost with its owner (None: unreachable) or, if Ray still has a copy, whole
    assert (snap is None and receiver.version == -1) or (snap.version == 5 and _same(snap.state_dict, _model(0).state_dict()))
    restarted = Trainer.remote()
    ray_local.get(restarted.publish.remote(4, 1))  # resumed from an older checkpoint
    snap = receiver.fetch()
    assert snap is not None and snap.version == 4 and _same(snap.state_dict, _model(1).state_dict())
