"""rollbook/run/ray_cluster.py refuses, in one line and before starting anything, a local Ray instance too
small for the actors the config declares (they would wait for CPUs forever)."""

from __future__ import annotations

import pytest

from rollbook.config import RunConfig
from rollbook.errors import CommandError


def test_a_local_ray_instance_smaller_than_the_declared_actors_is_refused_in_one_line(tmp_path):
    pytest.importorskip("ray")
    from rollbook.run.ray_cluster import run_ray

    config = RunConfig.model_validate(
        {
            "run_dir": str(tmp_path),
            "placement": "ray",
            "trainer": {"num_ranks": 2},
            "ray": {"num_cpus": 2, "num_workers": 2, "worker_cpus": 1, "trainer_cpus": 1},
        }
    )
    with pytest.raises(CommandError, match=r"ray.num_cpus 2 is fewer than the actors declare \(4: 2 x ray.worker_cpus 1"):
        run_ray(config, "127.0.0.1:1", {"worker_key": "w", "trainer_key": "t"})
    assert not (tmp_path / "base-student").exists()  # refused before the warm start


def test_without_ray_address_a_new_local_instance_is_started_even_when_another_cluster_runs(tmp_path, monkeypatch):
    """``address=None`` would make Ray join the cluster /tmp/ray/ray_current_cluster names (another
    user's, on a shared machine: seen as "When connecting to an existing cluster, num_cpus and num_gpus
    must not be provided"); "local" always starts one of its own."""
    ray = pytest.importorskip("ray")
    from rollbook.run.ray_cluster import run_ray

    asked: dict = {}

    class Stop(Exception):
        pass

    def init(**kwargs):
        asked.update(kwargs)
        raise Stop

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    config = RunConfig.model_validate(
        {
            "run_dir": str(tmp_path),
            "placement": "ray",
            "warm_start": {"student_steps": 0},
            "trainer": {"model": {"hidden_size": 32, "intermediate_size": 64}},
            "ray": {"num_cpus": 3},
        }
    )
    with pytest.raises(Stop):
        run_ray(config, "127.0.0.1:1", {"worker_key": "w", "trainer_key": "t"})
    assert asked["address"] == "local" and asked["num_cpus"] == 3
