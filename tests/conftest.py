"""Suite-wide pytest setup: the markers that say what a test needs, and how the suite runs on several workers.

- ``integration``: starts real services or processes (a ``rollbook serve``, a run, a Ray instance).
  Every test under ``tests/integration/`` gets it here, so no module has to remember it;
- ``slow``: a long case; the full run (``bash scripts/test.sh``) runs it, the fast lane does not;
- ``smoke``: an end-to-end case short enough for the fast lane (``bash scripts/test.sh --fast``,
  which selects ``(not integration and not slow) or smoke``);
- ``gpu``: needs CUDA; skipped unless a CUDA device is available.

Under pytest-xdist (``scripts/test.sh`` runs ``-n 3 --dist loadgroup``):

- every test that starts a Ray instance is put in one ``xdist_group``, so two local Ray clusters
  never run at once on the machine;
- the tests of a module with a module-scoped fixture are put in a group of their own, so that
  fixture (a finished run, a store, a batch of sandboxed programs) is built once, on one worker,
  and not once per worker, or again each time the worker comes back to the module;
- the tests run longest first (the Ray group, then ``slow``, then the other integration tests,
  then the unit tests), so the long ones do not start last and leave one worker running alone;
- each worker's own torch gets its share of the cores (``torch.set_num_threads``), and OpenMP
  threads sleep rather than spin while they wait (``OMP_WAIT_POLICY=PASSIVE``, inherited by every
  child process): two workers, each with as many spinning threads as the machine has cores, took a
  one-second unit test to thirty.
"""

import os
import pathlib

import pytest

# Before anything imports torch: OpenMP reads it once, when the runtime starts.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

INTEGRATION = pathlib.Path(__file__).parent / "integration"
# modules whose tests start a local Ray instance (ray.init, a ray.cluster_utils.Cluster or --placement ray);
# a single such test elsewhere carries the mark itself: @pytest.mark.xdist_group(name="ray")
RAY_MODULES = {"test_ray_placement.py", "test_ray_weights.py", "test_ray_infeasible.py", "test_ray_accelerators.py"}


@pytest.hookimpl(tryfirst=True)  # before xdist's worker sends the collected ids to the controller
def pytest_collection_finish(session):
    """Make xdist's group suffix part of the ids the scheduler sees. pytest-xdist (3.8) marks a test's
    group by setting ``item._nodeid`` to ``nodeid@group``; since pytest 9 ``item.nodeid`` is read from
    ``item._id`` instead, so the suffix never reached the scheduler and ``--dist loadgroup`` ran every
    test as a group of its own (two Ray tests at once on two workers). Nothing to do where it works."""
    for item in session.items:
        suffixed = item.__dict__.get("_nodeid")
        if suffixed and suffixed != item.nodeid and hasattr(item, "_id"):
            from _pytest.nodeid import NodeId

            item._id = NodeId.parse(suffixed)


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_configure(config):
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers and os.environ.get("PYTEST_XDIST_WORKER"):
        try:
            import torch
        except ImportError:
            pass
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False  # xdist would order groups by test count, undoing the order below


def _group(item) -> str | None:
    marks = list(item.iter_markers("xdist_group"))
    return (marks[0].args[0] if marks[0].args else marks[0].kwargs.get("name", "default")) if marks else None


def _unit(item) -> str:
    return _group(item) or item.nodeid


def _uses_a_module_fixture(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(
        defs[-1].scope in ("module", "class")
        for name, defs in info.name2fixturedefs.items()
        if defs and name in item.fixturenames
    )


def _order(item) -> int:
    if _group(item) == "ray":
        return 0
    if "slow" in item.keywords:
        return 1
    return 2 if "integration" in item.keywords else 3


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the xdist_group marks added here
def pytest_collection_modifyitems(config, items):
    for item in items:
        path = pathlib.Path(str(item.path))
        if INTEGRATION in path.parents:
            item.add_marker(pytest.mark.integration)
        if path.name in RAY_MODULES:
            item.add_marker(pytest.mark.xdist_group(name="ray"))
        elif _group(item) is None and _uses_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(name=str(path.relative_to(config.rootpath))))
    # longest first; xdist runs a group as one unit from where its first test stands
    order: dict[str, int] = {}
    for item in items:
        order[_unit(item)] = min(order.get(_unit(item), 3), _order(item))
    items.sort(key=lambda item: order[_unit(item)])
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items or _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in gpu_items:
        item.add_marker(skip)
