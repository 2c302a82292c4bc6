"""``rollbook run --placement ray`` on accelerators, on a CPU machine: a local Ray instance whose node
holds two ``fake_gpu`` (``ray.accelerator = "fake_gpu"`` stands for Ray's ``GPU``), ``ray.colocate``
pairing each rollout actor with a trainer rank in one bundle of the run's placement group, half an
accelerator each. Ray's own resource accounting must show both bundles' accelerator and CPUs taken
while the run trains, each actor in the run's placement group and seat, and the run must train every
step with rows from both actors. Before it, a placement group the busy cluster cannot grant stops
with what it asked for instead of waiting."""

from __future__ import annotations

import threading

import duckdb
import pytest

from rollbook.config import RunConfig
from rollbook.errors import CommandError

pytestmark = pytest.mark.slow

STEPS = 3


@pytest.fixture
def fake_gpus():
    ray = pytest.importorskip("ray")
    from rollbook.environment import prepare_local_ray

    prepare_local_ray()  # a loaded CI machine may need longer than Ray's 30 s for its GCS to start
    ray.init(address="local", num_cpus=2, resources={"fake_gpu": 2}, include_dashboard=False)
    yield ray
    ray.shutdown()


def _config(run_dir) -> RunConfig:
    return RunConfig.model_validate(
        {
            "run_dir": str(run_dir),
            "placement": "ray",
            "num_steps": STEPS,
            "eval_every": STEPS,
            "warm_start": {"student_steps": 10},
            "trainer": {"num_samples": 8, "num_ranks": 2, "model": {"hidden_size": 32, "intermediate_size": 64}},
            "rollout": {
                "domains": ["reverse"],
                "reverse_max_len": 3,
                "group_size": 4,
                "num_prompts": 1,
                "num_eval_tasks": 4,
                "num_eval_samples": 0,
                "max_new_tokens": 4,
            },
            "ray": {
                "num_workers": 2,
                "colocate": True,
                "accelerator": "fake_gpu",
                "worker_cpus": 0.5,
                "trainer_cpus": 0.5,
                "placement_timeout_s": 120,
            },
        }
    )


def test_colocated_pairs_share_one_fake_gpu_bundle_each_and_the_run_trains(fake_gpus, tmp_path):
    ray = fake_gpus
    from ray.util.placement_group import placement_group, remove_placement_group

    from rollbook.run.main import run
    from rollbook.run.ray_placement import alive_nodes, placement_plan, reserved

    config = _config(tmp_path / "run")
    plan = placement_plan(config, alive_nodes())  # device auto, and the cluster has the accelerator: reserved
    assert [b for _, b in plan.bundles] == [{"CPU": 1.0, "fake_gpu": 1.0}] * 2

    hog = placement_group([{"fake_gpu": 1}])  # other work holds one of the two
    ray.get(hog.ready(), timeout=60)
    busy = config.ray.model_copy(update={"placement_timeout_s": 2})
    with pytest.raises(CommandError) as caught, reserved(plan, busy):
        pass
    assert "2 rollout/trainer pairs x {CPU: 1, fake_gpu: 1}" in str(caught.value)
    assert "not reserved within 2 s (ray.placement_timeout_s)" in str(caught.value)
    assert "free {CPU: 2, fake_gpu: 1}" in str(caught.value), caught.value
    remove_placement_group(hog)

    seen: list[dict] = []
    done = threading.Event()

    def watch():  # Ray's accounting of each bundle's resources while the run goes on
        while not done.wait(0.5):
            seen.append(dict(ray.available_resources()))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        summary = run(config)
    finally:
        done.set()
        watcher.join()

    placed = summary["placement"]
    group = placed["placement_group_id"]
    assert placed["rollout_bundles"] == placed["trainer_bundles"] == [0, 1]
    assert [w["placement_group_id"] for w in summary["workers"]] == [group, group]
    assert summary["trainer_placement_group_ids"] == [group, group]

    def full(snapshot: dict, i: int) -> bool:  # bundle i exists and both its members hold all of it
        return (
            f"bundle_group_{i}_{group}" in snapshot
            and snapshot.get(f"fake_gpu_group_{i}_{group}", 0.0) == 0.0
            and snapshot.get(f"CPU_group_{i}_{group}", 0.0) == 0.0
        )

    assert any(full(s, 0) and full(s, 1) for s in seen), [s for s in seen if f"bundle_group_0_{group}" in s][-1:]
    assert not any(group in key for key in ray.available_resources())  # the group is removed with the run

    con = duckdb.connect(str(tmp_path / "run" / "rollbook.duckdb"), read_only=True)
    assert [s for (s,) in con.execute("SELECT step FROM train_steps ORDER BY step").fetchall()] == list(range(STEPS))
    workers = {w for (w,) in con.execute("SELECT DISTINCT worker_id FROM trajectories").fetchall()}
    assert workers == {"ray-worker-0", "ray-worker-1"}
