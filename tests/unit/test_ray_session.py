"""``rollbook.run.ray_cluster.ray_session``: a local Ray instance that times out starting (its raylet's fixed
30 s on a loaded machine) is started again, up to ``MAX_RAY_STARTS`` times; any other failure, or a
failure joining a cluster at ``ray.address``, is raised at once. ``ray.init`` is replaced by a fake
here (the real start is in tests/integration/test_ray_placement.py)."""

from __future__ import annotations

import pytest

from rollbook.config import RunConfig

ray = pytest.importorskip("ray")


def _config(**ray_fields) -> RunConfig:
    return RunConfig.model_validate({"placement": "ray", "ray": {"num_workers": 1, **ray_fields}})


class FakeInit:
    def __init__(self, failures: list[Exception]):
        self.failures, self.calls, self.shutdowns = list(failures), 0, 0

    def init(self, **kwargs):
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)

    def shutdown(self):
        self.shutdowns += 1


@pytest.fixture
def fake(monkeypatch):
    def install(failures):
        f = FakeInit(failures)
        monkeypatch.setattr(ray, "is_initialized", lambda: False)
        monkeypatch.setattr(ray, "init", f.init)
        monkeypatch.setattr(ray, "shutdown", f.shutdown)
        # one live node with room for every actor (run_ray.check_placement asks once Ray is up)
        monkeypatch.setattr(
            ray, "nodes", lambda: [{"Alive": True, "NodeManagerAddress": "127.0.0.1", "Resources": {"CPU": 64.0}}]
        )
        return f

    return install


def test_a_local_start_that_timed_out_is_made_again(fake):
    from rollbook.run.ray_cluster import ray_session

    f = fake(
        [
            Exception("The current node timed out during startup. This could happen because ..."),
            Exception("Timed out waiting for file /tmp/ray/session/x"),
        ]
    )
    with ray_session(_config()):
        assert f.calls == 3
    assert f.shutdowns == 3  # one after each failed start, one at the end


def test_it_gives_up_after_max_starts_and_raises_other_failures_at_once(fake):
    from rollbook.run.ray_cluster import MAX_RAY_STARTS, ray_session

    f = fake([Exception("The current node timed out during startup")] * MAX_RAY_STARTS)
    with pytest.raises(Exception, match="timed out during startup"), ray_session(_config()):
        pass
    assert f.calls == MAX_RAY_STARTS
    f = fake([ValueError("num_cpus must be positive")])
    with pytest.raises(ValueError), ray_session(_config()):
        pass
    assert f.calls == 1
    f = fake([Exception("The current node timed out during startup")])  # joining a cluster: not ours to restart
    with pytest.raises(Exception, match="timed out"), ray_session(_config(address="10.0.0.1:6379")):
        pass
    assert f.calls == 1
