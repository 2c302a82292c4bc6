"""What the ``ray`` placement asks of the cluster (rollbook/run/ray_cluster.py runs the actors): the
resources of every rollout actor and trainer rank, the bundles of the run's placement group, the
refusal of a placement the live nodes cannot hold, and the placement group itself.

    plan = placement_plan(config, alive_nodes())        # bundles, and which bundle each actor takes
    check_placement(config, alive_nodes())              # one line (exit 2) where Ray would wait forever
    with reserved(plan, config.ray) as group:           # every bundle at once, or a one-line error
        actor_cls.options(**actor_options(plan.rollout[0], group)).remote(...)

Accelerators: a rollout actor reserves ``ray.worker_gpus`` of ``ray.accelerator`` (Ray's ``GPU``, or a
custom resource standing for one), by default 1 when it generates on one (``rollout.engine`` vllm,
``rollout.device`` cuda or npu, or auto on a cluster that has the accelerator), else none; a trainer
rank ``ray.trainer_gpus``, by default 1 when ``trainer.device`` is on one. The actors are
gang-scheduled in one placement group: a bundle per rollout actor and per trainer rank, or, with
``ray.colocate``, one bundle per rollout actor / trainer rank pair that both share (0.5 of an
accelerator each by default, so the pair sits on one GPU). The store's actor (``ray.store_resources``)
and the weight board stay outside it. Ray is imported only inside the functions.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from rollbook.config import RayConfig, RunConfig


@dataclass(frozen=True)
class Seat:
    """One actor's place: the bundle it takes and the resources it asks for there."""

    bundle: int
    resources: dict[str, float]


@dataclass(frozen=True)
class Plan:
    """The placement group's bundles (who, resources) and each rollout actor's and trainer rank's seat."""

    bundles: list[tuple[str, dict[str, float]]]
    rollout: list[Seat]
    trainer: list[Seat]


def alive_nodes() -> list[dict]:
    """Each live node of the joined cluster: ``{"name": its address, "resources": {name: amount}}``."""
    import ray

    return [
        {"name": n.get("NodeManagerAddress", n.get("NodeID", "?")), "resources": dict(n.get("Resources", {}))}
        for n in ray.nodes()
        if n.get("Alive")
    ]


def accelerators(config: RunConfig, nodes: list[dict]) -> tuple[float, float]:
    """How much of ``ray.accelerator`` each rollout actor and each trainer rank reserves (see the module
    docstring); ``nodes`` decide for a device left ``auto``."""
    rc = config.ray
    share = 0.5 if rc.colocate else 1.0
    rollout_on = config.rollout.engine == "vllm" or _on_accelerator(config.rollout.device, nodes, rc.accelerator)
    worker = rc.worker_gpus if rc.worker_gpus is not None else share * rollout_on
    trainer = (
        rc.trainer_gpus if rc.trainer_gpus is not None else share * _on_accelerator(config.trainer.device, nodes, rc.accelerator)
    )
    return worker, trainer


def placement_plan(config: RunConfig, nodes: list[dict]) -> Plan:
    """The bundles of the run's placement group and every actor's seat in them."""
    rc = config.ray
    worker_acc, trainer_acc = accelerators(config, nodes)
    trainer = _without_zeros({"CPU": rc.trainer_cpus, rc.accelerator: trainer_acc, **rc.trainer_resources})
    rollout = [
        _without_zeros(
            {
                "CPU": rc.worker_cpus,
                rc.accelerator: worker_acc,
                **(rc.worker_resources[i % len(rc.worker_resources)] if rc.worker_resources else {}),
            }
        )
        for i in range(rc.num_workers)
    ]
    ranks = config.trainer.num_ranks
    if rc.colocate:  # num_workers == num_ranks (RunConfig checks it): pair I shares bundle I
        bundles = [(f"rollout/trainer pair {i}", _summed(rollout[i], trainer)) for i in range(ranks)]
        return Plan(bundles, [Seat(i, r) for i, r in enumerate(rollout)], [Seat(i, trainer) for i in range(ranks)])
    bundles = [(f"rollout actor {i}", r) for i, r in enumerate(rollout)] + [(f"trainer rank {i}", trainer) for i in range(ranks)]
    return Plan(bundles, [Seat(i, r) for i, r in enumerate(rollout)], [Seat(len(rollout) + i, trainer) for i in range(ranks)])


def placement_demands(config: RunConfig, nodes: list[dict]) -> list[tuple[str, dict[str, float]]]:
    """(who, the Ray resources it needs on one node) for everything the run places: the store's actor
    (with ``ray.store_resources``) and every bundle of the placement group (the weight board declares none)."""
    rc = config.ray
    store = [("the store", {"CPU": rc.store_cpus, **rc.store_resources})] if rc.store_resources and config.online is None else []
    return store + placement_plan(config, nodes).bundles


def check_placement(config: RunConfig, nodes: list[dict], *, where: str = "the Ray cluster") -> None:
    """Refuse, in one line (``ConfigError``), a placement the cluster's live nodes cannot hold, which Ray
    would otherwise wait on forever without a word: a bundle that no single node has room for (a custom
    resource no node has, more CPUs or GPUs than any node), or more of a resource than all the nodes hold
    together (two trainer ranks pinned to ``{trainer_node = 1}`` on a cluster with one such node).
    ``nodes``: ``{"name", "resources"}`` per live node (``alive_nodes``). The check is against the
    nodes up at the start: an autoscaling cluster needs its nodes started first. A placement that fits
    but finds the cluster busy with other work waits for it up to ``ray.placement_timeout_s`` (``reserved``)."""
    from rollbook.errors import ConfigError

    demands = placement_demands(config, nodes)
    have = " ".join(f"{n['name']} {resources_text(n['resources'])}" for n in nodes) or "no live node"
    for who, asked in demands:
        if not any(all(n["resources"].get(k, 0.0) >= v for k, v in asked.items()) for n in nodes):
            raise ConfigError(f"ray placement: {who} asks for {resources_text(asked)}: no node of {where} has it (nodes: {have})")
    for key in sorted({k for _, asked in demands for k in asked}):
        total = sum(asked.get(key, 0.0) for _, asked in demands)
        held = sum(n["resources"].get(key, 0.0) for n in nodes)
        if total > held + 1e-9:
            raise ConfigError(
                f"ray placement: {_grouped([d for d in demands if d[1].get(key)])} ask for {key} {total:g} in all; "
                f"{where} has {key} {held:g} (nodes: {have})"
            )


@contextlib.contextmanager
def reserved(plan: Plan, rc: RayConfig):
    """The run's placement group, every bundle reserved at once (``rc.placement_strategy``), removed on
    exit. Not ready within ``rc.placement_timeout_s``: a ``CommandError`` naming what was asked and
    what the cluster has free, instead of a wait without end."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from rollbook.errors import CommandError

    group = placement_group([resources for _, resources in plan.bundles], strategy=rc.placement_strategy)
    try:
        try:
            ray.get(group.ready(), timeout=rc.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise CommandError(
                f"ray placement: the placement group ({_grouped(plan.bundles)}, strategy {rc.placement_strategy}) "
                f"was not reserved within {rc.placement_timeout_s:g} s (ray.placement_timeout_s); the cluster has "
                f"{resources_text(ray.cluster_resources())}, free {resources_text(ray.available_resources())}: "
                "other work holds what it needs, or no set of nodes fits the strategy"
            ) from None
        yield group
    finally:
        remove_placement_group(group)


def actor_options(seat: Seat, group: Any) -> dict[str, Any]:
    """``.options(...)`` of an actor taking ``seat`` in the placement group: its CPUs, GPUs (Ray's
    ``num_gpus``, so Ray sets its CUDA_VISIBLE_DEVICES) and custom resources, in its bundle."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    asked = dict(seat.resources)
    options: dict[str, Any] = {
        "num_cpus": asked.pop("CPU", 0.0),
        "num_gpus": asked.pop("GPU", 0.0),
        "scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=seat.bundle),
    }
    if asked:
        options["resources"] = asked
    return options


def resources_text(resources: dict[str, float]) -> str:
    """``{CPU: 1, trainer_node: 1}``: the resources an actor declares or a node holds (Ray's own
    bookkeeping entries, memory, ``node:`` addresses and placement-group bundles, left out)."""
    shown = {
        k: v
        for k, v in resources.items()
        if k not in ("memory", "object_store_memory") and not k.startswith("node:") and "_group_" not in k
    }
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(shown.items())) + "}"


def _on_accelerator(device: str, nodes: list[dict], accelerator: str) -> bool:
    kind = device.partition(":")[0]
    if kind == "auto":  # resolved on the actor's node: an accelerator when the cluster has them
        return any(n["resources"].get(accelerator, 0.0) > 0 for n in nodes)
    return kind in ("cuda", "npu")


def _grouped(demands: list[tuple[str, dict[str, float]]]) -> str:
    """``2 rollout actors x {CPU: 1, GPU: 1} + trainer rank {CPU: 1}``: alike demands counted together."""
    groups: dict[tuple[str, str], int] = {}
    for who, asked in demands:
        kind = who.rsplit(" ", 1)[0] if who[-1].isdigit() else who
        groups[(kind, resources_text(asked))] = groups.get((kind, resources_text(asked)), 0) + 1
    return " + ".join(f"{n} {kind}s x {text}" if n > 1 else f"{kind} {text}" for (kind, text), n in groups.items())


def _summed(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: a.get(k, 0.0) + b.get(k, 0.0) for k in {**a, **b}}


def _without_zeros(resources: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in resources.items() if v}
