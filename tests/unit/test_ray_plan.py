"""What the ray placement asks of the cluster (rollbook/run/ray_placement.py), without starting Ray:
accelerators reserved where a device is on one, a bundle per actor and per rank or one per
rollout/trainer pair (``ray.colocate``), a placement the cluster cannot hold refused in one line, and
the options that put an actor in its bundle. The real placement group: tests/integration/test_ray_accelerators.py."""

from __future__ import annotations

import pytest

from rollbook.config import RunConfig
from rollbook.errors import ConfigError
from rollbook.run.ray_placement import Seat, accelerators, actor_options, check_placement, placement_plan

CPU_NODE = [{"name": "10.0.0.1", "resources": {"CPU": 16.0}}]
GPU_NODE = [{"name": "10.0.0.2", "resources": {"CPU": 16.0, "GPU": 4.0}}]


def _config(ranks: int = 2, workers: int = 2, **sections) -> RunConfig:
    ray = {"num_workers": workers, **sections.pop("ray", {})}
    trainer = {"num_ranks": ranks, **sections.pop("trainer", {})}
    return RunConfig.model_validate({"placement": "ray", "trainer": trainer, "ray": ray, **sections})


def test_on_cpus_a_bundle_per_actor_and_per_rank_and_no_accelerator():
    plan = placement_plan(_config(), CPU_NODE)
    assert plan.bundles == [
        ("rollout actor 0", {"CPU": 1.0}),
        ("rollout actor 1", {"CPU": 1.0}),
        ("trainer rank 0", {"CPU": 1.0}),
        ("trainer rank 1", {"CPU": 1.0}),
    ]
    assert [s.bundle for s in plan.rollout] == [0, 1] and [s.bundle for s in plan.trainer] == [2, 3]


def test_a_device_on_cuda_or_vllm_reserves_a_gpu_and_auto_follows_the_cluster():
    assert accelerators(_config(device="cuda"), CPU_NODE) == (1.0, 1.0)
    assert accelerators(_config(trainer={"device": "cuda:1"}), CPU_NODE) == (0.0, 1.0)
    assert accelerators(_config(rollout={"engine": "vllm"}), CPU_NODE) == (1.0, 0.0)
    assert accelerators(_config(), CPU_NODE) == (0.0, 0.0)  # auto on a cluster without GPUs: none
    assert accelerators(_config(), GPU_NODE) == (1.0, 1.0)  # auto resolves to CUDA on the actors' nodes
    assert accelerators(_config(device="cpu"), GPU_NODE) == (0.0, 0.0)
    assert accelerators(_config(ray={"worker_gpus": 0.25, "trainer_gpus": 2}), CPU_NODE) == (0.25, 2.0)  # as set
    npu = [{"name": "n", "resources": {"CPU": 8.0, "NPU": 8.0}}]  # a custom resource stands for the accelerator
    assert accelerators(_config(ray={"accelerator": "NPU"}), npu) == (1.0, 1.0)
    plan = placement_plan(_config(device="cuda"), GPU_NODE)
    assert plan.bundles[0] == ("rollout actor 0", {"CPU": 1.0, "GPU": 1.0})
    assert plan.bundles[2] == ("trainer rank 0", {"CPU": 1.0, "GPU": 1.0})


def test_colocate_puts_each_rollout_actor_and_trainer_rank_in_one_bundle_sharing_its_gpu():
    config = _config(ray={"colocate": True, "worker_cpus": 0.5, "worker_resources": [{"a": 1}, {"b": 1}]})
    plan = placement_plan(config, GPU_NODE)
    assert plan.bundles == [
        ("rollout/trainer pair 0", {"CPU": 1.5, "GPU": 1.0, "a": 1.0}),
        ("rollout/trainer pair 1", {"CPU": 1.5, "GPU": 1.0, "b": 1.0}),
    ]
    assert plan.rollout == [Seat(0, {"CPU": 0.5, "GPU": 0.5, "a": 1}), Seat(1, {"CPU": 0.5, "GPU": 0.5, "b": 1})]
    assert plan.trainer == [Seat(0, {"CPU": 1.0, "GPU": 0.5}), Seat(1, {"CPU": 1.0, "GPU": 0.5})]
    with pytest.raises(ValueError, match=r"ray.num_workers \(3\) must equal trainer.num_ranks \(2\)"):
        _config(workers=3, ray={"colocate": True})


def test_gpus_the_cluster_does_not_have_are_refused_in_one_line():
    with pytest.raises(ConfigError) as caught:
        check_placement(_config(device="cuda"), CPU_NODE, where="the local Ray instance")
    assert str(caught.value) == (
        "ray placement: rollout actor 0 asks for {CPU: 1, GPU: 1}: no node of the local Ray instance has it "
        "(nodes: 10.0.0.1 {CPU: 16})"
    )
    with pytest.raises(ConfigError, match=r"2 rollout/trainer pairs x \{CPU: 2, GPU: 1\} ask for GPU 2 in all; .* has GPU 1"):
        check_placement(_config(ray={"colocate": True}), [{"name": "n", "resources": {"CPU": 16.0, "GPU": 1.0}}])
    check_placement(_config(ray={"colocate": True}), GPU_NODE)


def test_an_actor_asks_its_bundle_for_what_its_seat_holds():
    pytest.importorskip("ray")
    gpu = actor_options(Seat(3, {"CPU": 0.5, "GPU": 0.5, "node_a": 1.0}), group=None)
    assert (gpu["num_cpus"], gpu["num_gpus"], gpu["resources"]) == (0.5, 0.5, {"node_a": 1.0})
    assert gpu["scheduling_strategy"].placement_group_bundle_index == 3
    custom = actor_options(Seat(0, {"CPU": 1.0, "fake_gpu": 0.5}), group=None)
    assert (custom["num_gpus"], custom["resources"]) == (0.0, {"fake_gpu": 0.5})  # a custom accelerator: a resource
