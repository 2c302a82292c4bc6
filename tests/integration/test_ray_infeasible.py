"""``rollbook run --placement ray --ray.address ...`` on a cluster that cannot hold the actors the
config pins (a custom resource no node has, fewer such nodes than trainer ranks, more CPUs than the
cluster holds) is refused in one line, naming what was asked and what the cluster has, instead of
waiting forever for Ray to schedule them. A one-node local cluster (``ray.cluster_utils.Cluster``),
its head holding one ``trainer_node``."""

from __future__ import annotations

import pytest

from rollbook.config import RunConfig
from rollbook.errors import ConfigError
from tests.integration.conftest import rollbook_cli


@pytest.fixture(scope="module")
def cluster():
    pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    from rollbook.environment import prepare_local_ray

    prepare_local_ray()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "resources": {"trainer_node": 1}})
    yield c
    c.shutdown()


def _config(address: str, num_ranks: int = 1, **ray_fields) -> RunConfig:
    return RunConfig.model_validate(
        {"placement": "ray", "trainer": {"num_ranks": num_ranks}, "ray": {"address": address, "num_workers": 1, **ray_fields}}
    )


def _refusal(config: RunConfig) -> str:
    from rollbook.run.ray_cluster import ray_session

    with pytest.raises(ConfigError) as caught, ray_session(config):
        pass
    return str(caught.value)


def test_a_pin_the_cluster_cannot_hold_is_refused_naming_the_ask_and_the_cluster(cluster):
    import ray

    two = _refusal(_config(cluster.address, num_ranks=2, trainer_resources={"trainer_node": 1}))
    assert "2 trainer ranks x {CPU: 1, trainer_node: 1} ask for trainer_node 2 in all" in two, two
    assert f"the Ray cluster at {cluster.address} has trainer_node 1" in two, two

    none = _refusal(_config(cluster.address, trainer_resources={"gpu_node": 1}))
    assert (
        "trainer rank 0 asks for {CPU: 1, gpu_node: 1}" in none
        and f"no node of the Ray cluster at {cluster.address} has it" in none
    ), none
    assert "{CPU: 4, trainer_node: 1}" in none, none  # what the one node has

    cpus = _refusal(_config(cluster.address, num_workers=4, worker_cpus=1))
    assert "4 rollout actors x {CPU: 1} + trainer rank {CPU: 1} ask for CPU 5 in all" in cpus, cpus
    assert "has CPU 4" in cpus, cpus
    assert not ray.is_initialized()  # the refused session is shut down

    from rollbook.run.ray_cluster import ray_session

    with ray_session(_config(cluster.address, trainer_resources={"trainer_node": 1})):  # one rank fits
        assert ray.is_initialized()


def test_rollbook_run_refuses_an_unsatisfiable_ray_placement_in_one_line(cluster, tmp_path):
    done = rollbook_cli(
        "run",
        "--placement",
        "ray",
        "--run_dir",
        str(tmp_path / "run"),
        "--ray.address",
        cluster.address,
        "--ray.num_workers",
        "1",
        "--trainer.num_ranks",
        "2",
        "--ray.trainer_resources",
        "{trainer_node = 1}",
        timeout=300,
    )
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "store:" not in done.stdout  # refused before the store started
    ours = [
        line
        for line in done.stderr.strip().splitlines()
        if "Ray cluster at address" not in line and "Connected to Ray" not in line
    ]
    assert len(ours) == 1 and ours[0].startswith("rollbook run: error: ray placement: 2 trainer ranks"), done.stderr[-3000:]
    assert "has trainer_node 1" in ours[0]
    assert not (tmp_path / "run" / "rollbook.duckdb").exists()
