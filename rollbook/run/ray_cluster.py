"""The ``ray`` placement of ``rollbook run``: the same store, rollout loop and trainer as the local
placements, as Ray actors on any nodes of a cluster.

    rollbook run --config configs/quickstart.toml --placement ray --ray.num_workers 2 --trainer.num_ranks 2
    ray start --head --port 6379 --resources '{"trainer_node": 1}'        # a real cluster: the head ...
    ray start --address HEAD:6379 --resources '{"store_node": 1}'         # ... the ledger's machine ...
    ray start --address HEAD:6379 --resources '{"rollout_node": 1}'       # ... and each other machine
    rollbook run ... --placement ray --ray.address HEAD:6379 --ray.store_resources '{store_node = 1}' ...

- the store: the run's own ``rollbook serve`` process beside this driver (``rollbook/run/main.py``), or,
  with ``ray.store_resources``, under a ``StoreActor`` on the node they name (``RayStore``), bound
  to ``ray.store_host``; its ledger is RUN_DIR/rollbook.duckdb on that node's disk;
- the trainer: ``trainer.num_ranks`` actors (``TrainerRank``), one data-parallel group
  (trainer/distributed.py; gloo, nccl on GPUs; the model replicated or sharded by
  ``trainer.data_parallel``); rank 0 pulls, reports, checkpoints, acks, publishes every version
  (``ray.weight_channel``: Ray's object store, rollbook/weights/ray_objects.py, or the network
  channel's full copies and deltas, rollbook/weights/network.py) and evaluates held-out reward into
  RUN_DIR/metrics.jsonl;
- rollout workers: ``ray.num_workers`` actors (``RolloutActor``), each the loop of ``rollbook rollout``
  (rollout/main.py ``run_worker``: weights from that channel, staleness gate, spooling
  submitter) with its own worker_id, seed and spool directory RUN_DIR/spool-I; rank 0 waits for each to
  hold the first weights before its first pull, so every actor feeds the run from step 0.

The rollout actors and trainer ranks are gang-scheduled in one placement group
(rollbook/run/ray_placement.py): a bundle per actor and per rank, or, with ``ray.colocate``, one per
rollout actor / trainer rank pair sharing an accelerator; each reserves ``ray.accelerator`` (GPUs) when
its device is one. On several machines RUN_DIR must be one path they all share: rank 0 checkpoints
there, the actors spool there, the store keeps the ledger there. Once Ray is up, before the store or
any actor starts, ``check_placement`` refuses in one line a placement the live nodes cannot hold (Ray
would wait on it forever without a word), and a placement group the cluster does not grant within
``ray.placement_timeout_s`` stops the run with what it asked for.

Failures: a rollout actor that dies is restarted by Ray (``ray.max_restarts``) with the same
arguments, so it reopens the same spool and, first thing, resends what was spooled and not yet
answered (the store's idempotency makes a resend a DUPLICATE, never a second row). A trainer rank that dies fails
the step on every rank (the next collective errors); the driver starts the group again
(``ray.trainer_restarts``) and rank 0 resumes from the last checkpoint: the unacked lease expires and
its rows return, so no batch is lost or trained twice. Ray is imported only here and in
ray_placement.py, lazily.
"""

from __future__ import annotations

import contextlib
import logging
import math
import pathlib
import socket
import time
from typing import Any

from rollbook import environment as rollbook_env
from rollbook.config import RunConfig
from rollbook.run.ray_placement import Plan, actor_options, alive_nodes, check_placement, placement_plan, reserved
from rollbook.trainer.drive import Placement

log = logging.getLogger("rollbook.run")


def _free_port(host: str = "") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class TrainerRank:
    """One data-parallel rank (a Ray actor). Rank 0 also serves weights and evaluates."""

    def __init__(self, config: RunConfig, rank: int, world_size: int):
        self.config, self.rank, self.world_size = config, rank, world_size

    def where(self) -> dict:
        """This actor's node address and two free ports (rendezvous, weights)."""
        import os

        import ray

        return {
            "ip": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "placement_group_id": ray.get_runtime_context().get_placement_group_id(),
            "rendezvous_port": _free_port(),
            "pid": os.getpid(),
        }

    def run(self, init_method: str, weights: str, rollout_names: tuple[str, ...] = ()) -> dict:
        """``weights``: where rank 0 publishes, the rollout actors' channel spec ('ray:BOARD' or
        'grpc:HOST:PORT', rank 0 serving it)."""
        import torch.distributed as dist

        from rollbook.trainer.distributed import init_group
        from rollbook.trainer.main import follow, train_rank
        from rollbook.trainer.model_builders import build_models

        cfg = self.config
        kind, _, where = weights.partition(":")
        trainer_cfg = cfg.trainer.model_copy(update={"weight_server": where if self.rank == 0 and kind == "grpc" else None})
        init_group(
            self.rank,
            self.world_size,
            init_method,
            backend=trainer_cfg.dist_backend,
            device=trainer_cfg.device,
            timeout_s=trainer_cfg.dist_timeout_s,
        )
        try:
            if self.rank != 0:
                follow(trainer_cfg, build=lambda: build_models(cfg))
                return {}
            from rollbook.run.driving import MetricsLog, say

            judge = _Judge(cfg)
            publishers = [judge.install]
            if kind == "ray":  # the rollout actors first: the judge evaluates the first version at length
                from rollbook.weights.ray_objects import RayObjectPublisher

                publishers.insert(0, RayObjectPublisher(where).publish)
            metrics = MetricsLog.for_run(cfg)
            try:
                outcome = train_rank(
                    trainer_cfg,
                    build=lambda: build_models(cfg),
                    publishers=publishers,
                    on_start=lambda: _wait_for_first_weights(rollout_names),
                    drive_with={"placement": judge, "eval_every": cfg.eval_every, "metrics": metrics, "say": say},
                )
            finally:
                metrics.close()
            return outcome.summary()
        finally:
            dist.destroy_process_group()


FIRST_WEIGHTS_WAIT_S = 300.0  # rank 0's wait for every rollout actor to hold the first weights


def _wait_for_first_weights(names: tuple[str, ...], timeout_s: float = FIRST_WEIGHTS_WAIT_S) -> None:
    """Before the first pull: wait until every rollout actor holds the weights just published, so that
    all of them feed the run from its first step (on a loaded machine an actor still importing torch
    could otherwise find a short run already over). An actor that is gone or still without weights
    after ``timeout_s`` is reported and not waited for: the others feed the run."""
    import ray

    if not names:
        return
    log.info("waiting for %d rollout actor(s) to take the first weights", len(names))
    refs: dict[str, Any] = {}
    missing: list[str] = []
    for name in names:
        try:
            refs[name] = ray.get_actor(name).wait_for_weights.remote(timeout_s)
        except ValueError:  # no actor of that name (dead for good)
            missing.append(name)
    for name, ref in refs.items():
        try:
            if not ray.get(ref, timeout=timeout_s + 30):
                missing.append(name)
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError, ray.exceptions.GetTimeoutError):
            missing.append(name)
    if missing:
        log.warning("rollout actor(s) %s hold no weights after %.0f s; training without waiting for them", missing, timeout_s)


class _Judge(Placement):
    """Rank 0's placement: held-out evaluation on an engine that takes every published version (the
    rollout actors feed the store; the drive loop waits for their batches)."""

    def __init__(self, config: RunConfig):
        from rollbook.devices import place
        from rollbook.rollout.engines import native_engine
        from rollbook.rollout.worker import RolloutWorker
        from rollbook.trainer.model_builders import build_models

        student, _ = build_models(config)
        self.engine = native_engine(place(student, config.rollout.device, config.rollout.dtype), config.rollout, version=0)
        self.worker = RolloutWorker(self.engine, config.rollout, model_id=config.trainer.model_id)

    def install(self, version: int, state_dict) -> None:
        from rollbook.run.driving import install_weights

        install_weights(self.engine, version, state_dict)

    def evaluate(self) -> dict:
        return self.worker.evaluate()

    def console_extra(self, stats: dict) -> str:
        return f"ranks {stats.get('dist/world_size', 1)}  "


class RolloutActor:
    """``rollbook rollout``'s loop in a thread of a Ray actor, until ``stop``. Restarted by Ray with
    the same arguments, it reopens the same spool directory."""

    def __init__(self, worker_config, worker_key: str | None = None) -> None:
        import os
        import threading

        if worker_key:  # the worker role key, read from the environment as `rollbook rollout` reads it
            os.environ["ROLLBOOK_WORKER_KEY"] = worker_key

        import torch  # noqa: F401  (the heavy imports before the constructor returns: see run_ray)

        import rollbook.rollout.engine  # noqa: F401
        from rollbook.rollout.main import run_worker

        self._stop = threading.Event()
        self._weights = threading.Event()
        self._result: dict = {}
        self._error: BaseException | None = None

        def loop():
            from rollbook.errors import CommandError

            try:
                _replay_spool(worker_config)
                self._result = run_worker(worker_config, self._stop, on_weights=lambda _: self._weights.set())
            except CommandError as exc:  # no first weights: an error unless the run ended first
                if not self._stop.is_set():
                    self._error = exc
                self._result = {"rounds": 0, "version": -1}
            except BaseException as exc:  # reported by stop()
                self._error = exc

        self._thread = threading.Thread(target=loop, name="rollout", daemon=True)
        self._thread.start()

    def where(self) -> dict:
        import os

        import ray

        context = ray.get_runtime_context()
        return {"node_id": context.get_node_id(), "placement_group_id": context.get_placement_group_id(), "pid": os.getpid()}

    def wait_for_weights(self, timeout_s: float) -> bool:
        """True once the loop holds its first weights (at once for a restarted actor that has them);
        False after ``timeout_s`` or if the loop ended without them."""
        deadline = time.monotonic() + timeout_s
        while not self._weights.wait(0.2):
            if not self._thread.is_alive() or time.monotonic() > deadline:
                return False
        return True

    def stop(self, timeout_s: float = 120.0) -> dict:
        self._stop.set()
        self._thread.join(timeout_s)
        if self._error is not None:
            raise self._error
        return self._result


def _replay_spool(worker_config) -> None:
    """Send what a previous life of this actor spooled and did not deliver, before waiting for
    weights: ``run_worker`` opens its submitter only once the first weights arrive, and a restarted
    actor may never get them before the run ends (found by test_ray_placement's kill test). A store
    that is down leaves the batches spooled for ``run_worker``'s submitter."""
    from rollbook.client import StoreClient
    from rollbook.rollout.spool import Spool
    from rollbook.rollout.submitter import Submitter

    if not any(pathlib.Path(worker_config.spool_dir).glob("*.batch")):
        return
    with (
        StoreClient.from_env(worker_config.server) as client,
        Submitter(client, Spool(worker_config.spool_dir, max_bytes=worker_config.spool_max_bytes)) as sub,
    ):
        if not sub.flush(timeout=60):
            log.warning("spool %s not replayed within 60 s (store unreachable?); the worker resends it", worker_config.spool_dir)


def run_ray(config: RunConfig, address: str, keys: dict) -> dict:
    """Start the actors, train to ``num_steps`` (starting the trainer group again after a rank
    dies, up to ``ray.trainer_restarts`` times), stop the workers; returns the first and last
    held-out evaluations."""
    from rollbook.trainer.model_builders import build_models

    run_dir = pathlib.Path(config.run_dir).resolve()
    config = config.model_copy(update={"run_dir": str(run_dir)})
    config.trainer = config.trainer.model_copy(
        update={"run_dir": str(run_dir), "server": address, "trainer_key": keys.get("trainer_key")}
    )
    with ray_session(config):
        build_models(config)  # the warm start, once, cached in the run directory before the ranks read it
        return _run_actors(config, run_dir, address, keys)


class StoreActor:
    """The run's ``rollbook serve`` process (``rollbook/run/store_process.py``) on the node Ray places this
    actor on (``ray.store_resources``): the ledger RUN_DIR/rollbook.duckdb is on that node's disk. The
    store process dies with the actor (rollbook/lifetime.py)."""

    def __init__(self, db: str, keys: dict, config_file: str, host: str) -> None:
        from rollbook.run.store_process import StoreProcess

        self._store = StoreProcess(pathlib.Path(db), **keys, config_file=config_file, extra_args=("--host", host))
        self._address = self._store.address

    def where(self) -> dict:
        import ray

        return {"address": self._address, "node_id": ray.get_runtime_context().get_node_id()}

    def stop(self) -> None:
        self._store.stop()


class RayStore:
    """``StoreProcess``'s interface (``address``, ``stop``) for a store in a ``StoreActor``; the
    driver's Ray session must be up (``ray_session``)."""

    def __init__(self, config: RunConfig, db: pathlib.Path, keys: dict, config_file: pathlib.Path) -> None:
        import ray

        rc = config.ray
        options: dict[str, Any] = {"num_cpus": rc.store_cpus, "resources": rc.store_resources, "max_restarts": 0}
        actor_cls: Any = ray.remote(StoreActor)
        self._actor = actor_cls.options(**options).remote(str(db), keys, str(config_file), rc.store_host)
        where: dict = ray.get(self._actor.where.remote())
        self.address, self.node_id = where["address"], where["node_id"]

    def stop(self) -> None:
        import ray

        try:
            ray.get(self._actor.stop.remote(), timeout=90)
        finally:
            ray.kill(self._actor)


# How a local Ray instance that did not start says so on a loaded machine (Ray waits a fixed 30 s for
# its raylet; seen in about one start in four here under load): ``ray_session`` starts it again
RAY_START_FAILURES = ("The current node timed out during startup", "Timed out waiting for file")
MAX_RAY_STARTS = 3


@contextlib.contextmanager
def ray_session(config: RunConfig):
    """Ray for this run: the cluster at ``ray.address``, or a local instance with room for every
    actor (started up to ``MAX_RAY_STARTS`` times when it times out starting), shut down at the end.
    Inside a Ray job already (a test's cluster): that one, left running."""
    from rollbook.errors import CommandError

    try:
        import ray
    except ImportError:
        raise CommandError("placement 'ray' needs the ray package: pip install -c constraints.txt -e '.[bench]'") from None
    if ray.is_initialized():
        check_placement(config, alive_nodes(), where="the Ray cluster")
        yield
        return
    rc = config.ray
    num_cpus = None
    if rc.address is None:  # a local instance: room for every actor asked for, or they would wait forever
        import os

        declared = {
            f"{rc.num_workers} x ray.worker_cpus {rc.worker_cpus:g}": rc.num_workers * rc.worker_cpus,
            f"{config.trainer.num_ranks} x ray.trainer_cpus {rc.trainer_cpus:g}": config.trainer.num_ranks * rc.trainer_cpus,
        }
        if rc.store_resources:
            declared[f"ray.store_cpus {rc.store_cpus:g}"] = rc.store_cpus
        needed = math.ceil(sum(declared.values()))
        num_cpus = rc.num_cpus or max(os.cpu_count() or 1, needed)
        if num_cpus < needed:
            raise CommandError(
                f"ray.num_cpus {num_cpus} is fewer than the actors declare ({needed}: {' + '.join(declared)}); "
                "the actors would never be scheduled"
            )
    rollbook_env.prepare_local_ray()
    for attempt in range(1, MAX_RAY_STARTS + 1):
        try:
            # "local", not None: None joins whatever cluster /tmp/ray/ray_current_cluster names (anyone's
            # on a shared machine), and then refuses num_cpus
            ray.init(address=rc.address or "local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)
            break
        except Exception as exc:
            if rc.address is not None or attempt == MAX_RAY_STARTS or not any(s in str(exc) for s in RAY_START_FAILURES):
                raise
            log.warning(
                "Ray did not start (%s); starting it again (%d of %d)", str(exc).splitlines()[0], attempt + 1, MAX_RAY_STARTS
            )
            ray.shutdown()
    try:
        check_placement(
            config, alive_nodes(), where=f"the Ray cluster at {rc.address}" if rc.address else "the local Ray instance"
        )
        yield
    finally:
        ray.shutdown()


def _run_actors(config: RunConfig, run_dir: pathlib.Path, address: str, keys: dict) -> dict:
    """Reserve the placement group (rollbook/run/ray_placement.py), then run the actors in it."""
    plan = placement_plan(config, alive_nodes())
    with reserved(plan, config.ray) as group:
        summary = _run_in_group(config, run_dir, address, keys, plan, group)
        summary["placement"] = {
            "placement_group_id": group.id.hex(),
            "bundles": [resources for _, resources in plan.bundles],
            "rollout_bundles": [seat.bundle for seat in plan.rollout],
            "trainer_bundles": [seat.bundle for seat in plan.trainer],
        }
        return summary


def _run_in_group(config: RunConfig, run_dir: pathlib.Path, address: str, keys: dict, plan: Plan, group) -> dict:
    import ray

    from rollbook.config import WorkerConfig
    from rollbook.errors import CommandError

    rc = config.ray
    trainer_cls = ray.remote(TrainerRank)
    rollout_cls = ray.remote(RolloutActor)
    workers: list = []
    ranks: list = []
    board = None
    try:
        # the rollout actors first, polling the weight address rank 0 will serve; rank 0 then waits
        # until each holds version 0 before its first pull (_wait_for_first_weights), so that no actor
        # still starting up on a loaded machine finds a short run already over
        if rc.weight_channel == "object_store":
            from rollbook.weights.ray_objects import create_board

            board_name = f"rollbook-weights-{run_dir.name}"
            board = create_board(board_name)  # here, so it outlives a trainer group that fails
            weights = f"ray:{board_name}"
        else:
            weights = f"grpc:{rc.weight_host}:{_free_port(rc.weight_host)}"  # kept across trainer restarts
        per_worker = math.ceil(config.trainer.num_samples / rc.num_workers)
        for i in range(rc.num_workers):
            rollout = config.rollout.model_copy(update={"worker_id": f"ray-worker-{i}", "seed": config.rollout.seed + i})
            wcfg = WorkerConfig(
                server=address,
                weights=weights,
                model_id=config.trainer.model_id,
                model=config.trainer.model,
                rollout=rollout,
                batch_size=max(per_worker, rollout.group_size),
                version_share=1 / rc.num_workers,  # the trainer's announced num_samples, split over the actors
                spool_dir=str(run_dir / f"spool-{i}"),
                max_idle_s=0,
            )
            options: dict = {
                **actor_options(plan.rollout[i], group),  # its CPUs, accelerators and pins, in its bundle
                "max_restarts": rc.max_restarts,  # a restarted actor takes the same bundle
                "max_task_retries": -1,
                "name": _rollout_name(i, run_dir.name),
            }
            # the key as an argument, as the trainer ranks get theirs in their config: a runtime_env
            # would start each actor in a fresh worker process of its own (Ray's setup_worker, then
            # its imports again) instead of one of the idle workers Ray keeps started
            workers.append(rollout_cls.options(**options).remote(wcfg, keys["worker_key"]))
        ray.get([w.where.remote() for w in workers])  # constructed: imports done, polling for weights
        ranks, trainer_infos = _start_ranks(trainer_cls, config, weights, (plan, group), attempt=0)
        attempts = 0
        while True:
            try:
                summary = ray.get(ranks[0][1])
                ray.get([ref for _, ref in ranks[1:]])
                break
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
                cause = getattr(exc, "cause", None)
                if isinstance(cause, CommandError):  # e.g. no batch for max_wait_s: for the user, not a restart
                    raise CommandError(str(cause)) from None
                _kill(ranks)
                attempts += 1
                if attempts > rc.trainer_restarts:
                    raise CommandError(
                        f"the trainer group failed {attempts} times (ray.trainer_restarts "
                        f"{rc.trainer_restarts}); last: {str(exc).splitlines()[0]}"
                    ) from None
                log.warning(
                    "a trainer rank failed (%s); starting the group again from the last checkpoint", str(exc).splitlines()[0]
                )
                ranks, trainer_infos = _start_ranks(trainer_cls, config, weights, (plan, group), attempt=attempts)
        summary["workers"] = [_stop_worker(w) for w in workers]
        summary["trainer_node_ids"] = [info["node_id"] for info in trainer_infos]
        summary["trainer_placement_group_ids"] = [info["placement_group_id"] for info in trainer_infos]
        return summary
    finally:
        for w in workers:
            ray.kill(w, no_restart=True)
        _kill(ranks, pause_s=0)
        if board is not None:
            ray.kill(board)


def _stop_worker(worker) -> dict:
    """Where the actor ran and its final statistics; an actor that failed for good (past
    ``ray.max_restarts``) is reported, not raised: the training it fed is done and acked."""
    import ray

    try:
        where = ray.get(worker.where.remote())
        return {**ray.get(worker.stop.remote()), **where}
    except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
        log.warning("rollout actor failed: %s", str(exc).splitlines()[0])
        return {"error": str(exc).splitlines()[0]}


def _start_ranks(trainer_cls, config: RunConfig, weights: str, placed: tuple[Plan, Any], attempt: int):
    """The trainer group's actors (named ``rollbook-trainer-RANK-RUNDIR-ATTEMPT``), each in its bundle of
    the placement group (``placed``: the plan and the group; a restarted group takes the bundles the
    failed one left), with their ``run`` refs, and where each rank is (``TrainerRank.where``, asked before ``run``
    starts: a rank may die after the last step, and an actor answers nothing else while ``run`` holds
    it). ``weights`` is the same for every start (the board, or rank 0's weight server address), so the
    rollout actors keep fetching from it."""
    import ray

    rc = config.ray
    plan, group = placed
    world = config.trainer.num_ranks
    name = pathlib.Path(config.run_dir).name
    actors = [
        trainer_cls.options(
            **actor_options(plan.trainer[rank], group), max_restarts=0, name=f"rollbook-trainer-{rank}-{name}-{attempt}"
        ).remote(config, rank, world)
        for rank in range(world)
    ]
    infos = ray.get([a.where.remote() for a in actors])
    head = infos[0]
    init_method = f"tcp://{head['ip']}:{head['rendezvous_port']}"
    rollout_names = tuple(_rollout_name(i, name) for i in range(rc.num_workers))
    refs = [a.run.remote(init_method, weights, rollout_names) for a in actors]
    return list(zip(actors, refs, strict=True)), infos


def _rollout_name(index: int, run_name: str) -> str:
    return f"rollbook-rollout-{index}-{run_name}"


def _kill(ranks, pause_s: float = 1.0) -> None:
    import ray

    for actor, _ in ranks:
        ray.kill(actor, no_restart=True)
    time.sleep(pause_s)  # let the killed ranks release their ports
