"""Acceptance 1 (issue 15): ``rollbook run --placement ray`` on a Ray cluster of two nodes on this
machine (``ray.cluster_utils.Cluster``; custom resources force one rollout actor onto each node), a
two-rank data-parallel trainer on the head node, weights over the network channel. The ledger must
attribute rows to both workers, every step must have one acked lease, no row may train twice.

Small settings so it fits .ci/run (two raylets and four actors on 2 cores: about two minutes)."""

from __future__ import annotations

import json
import pathlib

import duckdb
import pytest

pytestmark = pytest.mark.slow

STEPS = 4


@pytest.fixture
def cluster():
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "resources": {"node_a": 10}})
    c.add_node(num_cpus=2, resources={"node_b": 10})
    c.wait_for_nodes()
    ray.init(address=c.address)
    yield c
    ray.shutdown()
    c.shutdown()


def small_config(run_dir: pathlib.Path, **ray_fields):
    from rollbook.config import RunConfig

    return RunConfig.model_validate({
        "run_dir": str(run_dir), "placement": "ray", "num_steps": STEPS, "eval_every": STEPS,
        "warm_start": {"student_steps": 20},
        "trainer": {"num_samples": 16, "num_ranks": 2, "lr": 1e-3, "model": {"hidden_size": 64, "intermediate_size": 128}},
        "rollout": {"domains": ["reverse"], "reverse_max_len": 3, "group_size": 4, "num_prompts": 2,
                    "num_eval_tasks": 8, "num_eval_samples": 2, "max_new_tokens": 5},
        "ray": {"num_workers": 2, "worker_cpus": 0.5, "trainer_cpus": 0.5,
                "worker_resources": [{"node_a": 1}, {"node_b": 1}], "trainer_resources": {"node_a": 1}, **ray_fields},
    })


def test_ray_placement_spreads_rollout_over_two_nodes_and_trains_with_two_ranks(cluster, tmp_path):
    import ray

    from rollbook.run import run

    summary = run(small_config(tmp_path / "run"))
    assert {w["version"] for w in summary["workers"]} and all(w["rounds"] > 0 for w in summary["workers"])
    node_of = {n["NodeID"]: ("a" if "node_a" in n["Resources"] else "b") for n in ray.nodes()}
    assert sorted(node_of[w["node_id"]] for w in summary["workers"]) == ["a", "b"]  # a rollout actor on each node
    assert {node_of[n] for n in summary["trainer_node_ids"]} == {"a"}  # both ranks on the head node
    con = duckdb.connect(str(tmp_path / "run" / "rollbook.duckdb"), read_only=True)
    per_worker = dict(con.execute("SELECT worker_id, count(*) FROM trajectories GROUP BY ALL").fetchall())
    assert set(per_worker) == {"ray-worker-0", "ray-worker-1"}, per_worker
    steps = con.execute("SELECT step, stats FROM train_steps ORDER BY step").fetchall()
    assert [s for s, _ in steps] == list(range(STEPS))
    assert all(json.loads(stats)["dist/world_size"] == 2 for _, stats in steps)
    (bad,) = con.execute("SELECT count(*) FROM (SELECT step FROM leases WHERE acked_at IS NOT NULL GROUP BY step "
                         "HAVING count(DISTINCT lease_id) <> 1)").fetchone()
    assert bad == 0
    (twice,) = con.execute("SELECT count(*) FROM (SELECT trajectory_id FROM leases WHERE acked_at IS NOT NULL "
                           "GROUP BY trajectory_id HAVING count(*) > 1)").fetchone()
    assert twice == 0
    (newest,) = con.execute("SELECT max(max_version) FROM trajectories").fetchone()
    assert newest >= 1  # the actors generated with weights they received over the network channel
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [m for m in metrics if "eval/reward" in m]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == STEPS - 1
