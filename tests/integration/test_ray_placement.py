"""``rollbook run --placement ray`` on a Ray cluster of two nodes on this
machine (``ray.cluster_utils.Cluster``; custom resources force one rollout actor onto each node), a
two-rank data-parallel trainer on the head node, the store on the other node (``ray.store_resources``),
weights over the network channel, with a rollout actor and a trainer rank killed mid-run. The ledger
must attribute rows to both workers, every step must have one acked lease, no row may train twice.
And ``configs/smoke.toml`` under ``--placement ray`` on a local instance (one actor, one rank) must learn.

Small settings so it fits .ci/run (two raylets and four actors on 2 cores: under a minute)."""

from __future__ import annotations

import json
import pathlib

import duckdb
import pytest

pytestmark = pytest.mark.slow


@pytest.fixture
def cluster():
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    from rollbook.environment import prepare_local_ray

    prepare_local_ray()  # a loaded CI machine may need longer than Ray's 30 s for its GCS to start
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "resources": {"node_a": 10}})
    c.add_node(num_cpus=2, resources={"node_b": 10})
    c.wait_for_nodes()
    ray.init(address=c.address)
    yield c
    ray.shutdown()
    c.shutdown()


def small_config(run_dir: pathlib.Path, steps: int, **ray_fields):
    from rollbook.config import RunConfig

    return RunConfig.model_validate(
        {
            "run_dir": str(run_dir),
            "placement": "ray",
            "num_steps": steps,
            "eval_every": steps,
            "max_staleness": 2,
            "warm_start": {"student_steps": 20},
            "trainer": {"num_samples": 16, "num_ranks": 2, "lr": 1e-3, "model": {"hidden_size": 64, "intermediate_size": 128}},
            "rollout": {
                "domains": ["reverse"],
                "reverse_max_len": 3,
                "group_size": 4,
                "num_prompts": 2,
                "num_eval_tasks": 4,
                "num_eval_samples": 2,
                "max_new_tokens": 5,
            },
            "ray": {
                "num_workers": 2,
                "worker_cpus": 0.5,
                "trainer_cpus": 0.5,
                "worker_resources": [{"node_a": 1}, {"node_b": 1}],
                "trainer_resources": {"node_a": 1},
                **ray_fields,
            },
        }
    )


# One row: ACCEPTED rows stored more than once, rows acked in more than one lease, rows marked trained
# without an acked lease, and steps without exactly one acked lease.
EXACTLY_ONCE = """
    SELECT (SELECT count(*) - count(DISTINCT trajectory_id) FROM trajectories) AS stored_twice,
           (SELECT count(*) FROM (SELECT trajectory_id FROM leases WHERE acked_at IS NOT NULL
                                  GROUP BY trajectory_id HAVING count(*) > 1)) AS acked_twice,
           (SELECT count(*) FROM trajectories WHERE status = 'trained' AND trajectory_id NOT IN
                (SELECT trajectory_id FROM leases WHERE acked_at IS NOT NULL)) AS trained_unacked,
           (SELECT count(*) FROM (SELECT step FROM leases WHERE acked_at IS NOT NULL GROUP BY step
                                  HAVING count(DISTINCT lease_id) <> 1)) AS steps_not_one_lease
"""


def _wait_for_steps(run_dir: pathlib.Path, n: int, thread, timeout_s: float = 300) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and thread.is_alive():
        path = run_dir / "metrics.jsonl"
        if path.exists() and sum('"loss/total"' in line for line in path.read_text().splitlines()) >= n:
            return
        time.sleep(0.5)
    raise AssertionError(f"the run did not reach step {n}")


@pytest.mark.timeout(1200)  # two raylets, four actors and a store on 2 cores: past 600 s on a loaded machine
def test_a_two_node_run_with_a_killed_actor_and_a_killed_rank_stores_and_trains_each_row_once(cluster, tmp_path):
    """A rollout actor on each node, both trainer ranks on the head node, the store on the other node
    (``ray.store_resources``), weights over the network channel. One rollout actor is killed (Ray
    restarts it on its spool) and, later, trainer rank 1 (the step fails, the group starts again from
    the last checkpoint); the run finishes and one SQL query shows every accepted row stored once and
    every trained row acked once."""
    import threading

    import ray

    from rollbook.run.main import run

    steps = 8  # the rank is killed after step 3: five steps left, so the kill lands mid-run
    config = small_config(tmp_path / "run", steps, weight_channel="network", store_resources={"node_b": 1}, store_cpus=0.5)
    config.trainer.lease_seconds = 5.0  # the failed step's lease comes back soon
    config.trainer.dist_timeout_s = 60.0  # a rank's death ends the step at once; on a loaded machine a live one may be slow
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(summary=run(config)), daemon=True)
    thread.start()
    _wait_for_steps(tmp_path / "run", 1, thread, timeout_s=600)  # the actors' imports, the first weights, an evaluation
    victim = ray.get_actor(f"rollbook-rollout-1-{tmp_path.joinpath('run').name}")
    pid_before = ray.get(victim.where.remote())["pid"]
    ray.kill(victim, no_restart=False)  # Ray restarts it (max_restarts)
    _wait_for_steps(tmp_path / "run", 3, thread)
    ray.kill(ray.get_actor(f"rollbook-trainer-1-{tmp_path.joinpath('run').name}-0"), no_restart=True)
    thread.join(timeout=600)
    assert "summary" in result, "the run did not finish"
    summary = result["summary"]
    workers = summary["workers"]
    assert workers[1]["pid"] != pid_before  # the restarted actor
    # it reopened its own spool and delivered everything in it (a batch left there was never answered)
    assert [p.name for p in (tmp_path / "run" / "spool-1").glob("*.batch")] == []

    # where things ran: the placement the config asked for
    node_of = {n["NodeID"]: ("a" if "node_a" in n["Resources"] else "b") for n in ray.nodes()}
    assert sorted(node_of[w["node_id"]] for w in workers) == ["a", "b"]  # a rollout actor on each node
    assert {node_of[n] for n in summary["trainer_node_ids"]} == {"a"}  # both ranks on the head node
    assert node_of[summary["store_node_id"]] == "b"  # the store where ray.store_resources put it

    con = duckdb.connect(str(tmp_path / "run" / "rollbook.duckdb"), read_only=True)
    audit = dict(
        zip(
            ["stored_twice", "acked_twice", "trained_unacked", "steps_not_one_lease"],
            con.execute(EXACTLY_ONCE).fetchone(),
            strict=True,
        )
    )
    assert audit == {"stored_twice": 0, "acked_twice": 0, "trained_unacked": 0, "steps_not_one_lease": 0}
    per_worker = dict(con.execute("SELECT worker_id, count(*) FROM trajectories GROUP BY ALL").fetchall())
    assert set(per_worker) == {"ray-worker-0", "ray-worker-1"}, per_worker
    trained = con.execute("SELECT step, stats FROM train_steps ORDER BY step").fetchall()
    assert [s for s, _ in trained] == list(range(steps))
    assert all(json.loads(stats)["dist/world_size"] == 2 for _, stats in trained)
    (acked_steps,) = con.execute("SELECT count(DISTINCT step) FROM leases WHERE acked_at IS NOT NULL").fetchone()
    assert acked_steps == steps
    (newest,) = con.execute("SELECT max(max_version) FROM trajectories").fetchone()
    assert newest >= 1  # the actors generated with weights they received over the network channel
    # the trainer group really failed and came back: the first attempt's metrics stop, a second start
    # evaluated again before resuming from its checkpoint
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sum("loss/total" not in m for m in metrics) >= 2
    evals = [m for m in metrics if "eval/reward" in m]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == steps - 1


@pytest.mark.timeout(1800)  # a local Ray instance, an actor and a rank: past 600 s on a loaded machine
def test_ray_placement_raises_the_sampled_heldout_reward(tmp_path):
    """``configs/smoke.toml`` under ``--placement ray`` (a local Ray instance, one rollout actor and one
    trainer rank; bench/learning.py's ``check-ray``): one short run raises the sampled held-out
    reward by more than the checks' margin. Two of each, and their kills, are the test above's; two
    ranks learning over seeds is bench/learning.py's ``ray`` case."""
    from tests.integration.learning_check import check_heldout_rises

    check_heldout_rises("check-ray", tmp_path / "run")
