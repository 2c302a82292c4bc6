"""The data-parallel trainer: N ranks of ``torch.distributed`` (gloo for the CPU models of today,
nccl for a model on CUDA) training one policy on one lease per step.

    rollbook train --num_ranks 2 ...                        # spawns the ranks itself (torch.multiprocessing)
    torchrun --nproc_per_node 2 -m rollbook.cli train ...   # env:// rendezvous, one process per rank
    rollbook run --placement ray --trainer.num_ranks 2 ...  # the ranks as Ray actors (rollbook/run/ray_cluster.py)

One step:
1. rank 0 pulls one lease (``PullBatch``) and broadcasts the Arrow table to every rank (an empty
   pull too, so every rank returns None together);
2. every rank takes its share by whole groups (``shard_groups``: greedy by tokens, the same answer on
   every rank), recomputes proximal (and teacher, and KL reference) log-probs for its share only;
3. each optimizer update: the global token count of the minibatch is all-reduced first, each rank
   scales its micro-batch losses by ``tokens / global_tokens`` and the gradients are summed
   (one flat all-reduce), so N ranks with a share each take the same step as one rank with the whole
   batch (tested in tests/unit/trainer/test_distributed.py); clipping and AdamW then run on the same
   gradients on every rank, and the replicas stay identical;
4. rank 0 alone reports the step, writes the checkpoint, acks the lease, writes a due Hugging Face
   export and publishes version v + 1 (to its weight publishers and the store); the other ranks only
   advance their step and version.

The update is ``Trainer.update`` itself (loop.py): this class overrides only its cross-rank hooks
(this rank's share, the summed token counts, the gradient all-reduce, the gathered statistics). The
step's statistics are reduced over every rank's micro-batches by ``reduce_stats`` (loop.py: counts
summed, maxima maxed, means weighted by what they average over), so ``train_steps.stats`` read the
same for N ranks as for one (tested in tests/unit/trainer/test_distributed.py).

There is one lease, one checkpoint and one ack per step, whatever N. A rank that dies makes the
others' next collective fail (or time out after ``dist_timeout_s``): the step fails, nothing was
acked, the lease expires and its rows return. Where the other ranks wait for what rank 0 does
alone (its start, and between two pulls its evaluations, checkpoints and waits for rollout) they
wait in a gloo group of their own with a long limit (``RANK0_WAIT_S``), since that can outlast
``dist_timeout_s``. Restarted, rank 0 loads the last checkpoint and broadcasts it (model, optimizer,
step, version) to the others, so no batch is lost or repeated.

``trainer.data_parallel`` chooses how the ranks hold the model:

- ``replicate`` (the default): every rank holds the whole model and AdamW state. Gradients are reduced
  by hand rather than through ``DistributedDataParallel`` because a step accumulates over a variable
  number of packed micro-batches per rank (DDP would all-reduce at every backward unless every rank
  ran the same count under ``no_sync``).
- ``shard``: FSDP2 (``fully_shard``, each decoder layer a unit, then the root: embeddings, final
  norm, LM head) splits parameters, gradients and AdamW state over the ranks; parameters stay
  float32 and the forward passes run under the trainer's autocast, as on one rank (its cast cache
  off: rollbook/devices.py ``autocast`` says why). FSDP2 gathers a
  unit's parameters inside every forward and backward and reduce-scatters its gradients after every
  backward, so every rank must run as many passes: ``_paced`` agrees on the busiest rank's count and
  a rank with fewer micro-batches (or none: more ranks than groups) runs the rest on a one-token
  micro-batch at loss weight 0. The losses are already scaled by each rank's share of the global
  count, so the reduction must be a sum: every unit is set to ``set_gradient_divide_factor(1.0)``
  with ``set_force_sum_reduction_for_comms(True)``, a plain SUM with no division on gloo and nccl
  alike (by default FSDP2 averages over the ranks, torch 2.13 on gloo as well; the factor alone asks
  for a PREMUL_SUM, which gloo refuses). The clip's norm is a replicated DTensor, read whole.
  Rank 0 checkpoints, exports and publishes the whole state, gathered once per step into CPU
  memory on rank 0 (``get_model_state_dict``/``get_optimizer_state_dict`` with ``full_state_dict``:
  collectives, so every rank gathers at the same points), in the checkpoint format of one rank; a
  resume reads it on rank 0 and scatters it (``set_*_state_dict``, ``broadcast_from_rank0``); a
  fresh start cuts the shards from rank 0's weights. The frozen teachers and KL reference are not
  sharded (each rank holds its own copy). With one rank (a group of one, or no group) there is
  nothing to shard: the model is trained whole, with a warning in the log.

``trainer.offload_optimizer`` (trainer/offload.py) moves each replicated rank's AdamW state off its
device between steps, as on one rank; sharded ranks keep their share where it is (the log says so):
the checkpoint's gather of it is a collective on the device.

Both are tested against one rank in tests/unit/trainer/test_distributed.py and test_sharded.py.
"""

from __future__ import annotations

import datetime
import logging
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, cast

import numpy as np
import pyarrow as pa
import torch
import torch.distributed as dist

from rollbook.config import TrainerConfig
from rollbook.trainer.checkpoint import TrainerState, checkpoint_due, read_checkpoint, restore_rng
from rollbook.trainer.loop import ModelPublisher, Publisher, Trainer, _Rows
from rollbook.trainer.packing import pack_sequences, packed_logprobs

log = logging.getLogger("rollbook.trainer")


def backend_for(choice: str, device: str = "cpu") -> str:
    """The backend of ``dist_backend = choice`` for a trainer on ``device`` (its ``trainer.device``):
    ``auto`` is nccl when that device is CUDA (``cuda``, ``cuda:N``, or ``auto`` where torch sees a
    GPU), where the gradients and the token counts then live, and gloo otherwise (the CPU)."""
    if choice != "auto":
        return choice
    return "nccl" if _on_cuda(device) else "gloo"


def init_group(
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str = "env://",
    *,
    backend: str = "auto",
    device: str = "cpu",
    timeout_s: float = 120.0,
) -> tuple[int, int]:
    """Join the process group (a no-op when already joined); returns (rank, world size). With
    ``init_method='env://'`` (torchrun) rank and world size come from torch's own rendezvous.

    ``device``: the trainer's (``trainer.device``). Where it is a bare ``cuda`` (or ``auto`` on a
    machine with a GPU), each rank first takes its own GPU as the current device, ``LOCAL_RANK``
    (torchrun) or else its rank modulo the GPUs it sees (one under Ray, which gives each actor its
    own), so that the trainer's ``cuda`` resolves to it (rollbook/devices.py). ``cuda:N`` is taken as
    it is written."""
    if not dist.is_initialized():
        if device.partition(":")[2] == "" and _on_cuda(device):
            import os

            own = os.environ.get("LOCAL_RANK", rank if rank is not None else os.environ.get("RANK", 0))
            torch.cuda.set_device(int(own) % torch.cuda.device_count())
        kwargs: dict[str, Any] = {} if rank is None else {"rank": rank, "world_size": world_size}
        dist.init_process_group(
            backend_for(backend, device), init_method=init_method, timeout=datetime.timedelta(seconds=timeout_s), **kwargs
        )
    return dist.get_rank(), dist.get_world_size()


def _on_cuda(device: str) -> bool:
    kind = device.partition(":")[0]
    return kind == "cuda" or (kind == "auto" and torch.cuda.is_available())


def shard_groups(table: pa.Table, rank: int, world_size: int) -> list[int]:
    """Row indices of ``rank``'s share of a pulled batch: whole groups, each given to the rank with
    the fewest output tokens so far (largest groups first, ties by group id), identical on every rank."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(table.column("group_id").to_pylist() if "group_id" in table.column_names else range(table.num_rows)):
        groups[str(g)].append(i)
    lengths = [len(o) for o in table.column("output_token_ids").to_pylist()]
    order = sorted(groups, key=lambda g: (-sum(lengths[i] for i in groups[g]), g))
    load = [0] * world_size
    mine: list[int] = []
    for g in order:
        target = min(range(world_size), key=lambda r: (load[r], r))
        load[target] += sum(lengths[i] for i in groups[g])
        if target == rank:
            mine += groups[g]
    return sorted(mine)


class _BroadcastingClient:
    """Rank 0's store client, with ``pull_batch`` handing each pulled table to the other ranks."""

    def __init__(self, client, trainer: "DistributedTrainer"):
        self._client, self._trainer = client, trainer

    def __getattr__(self, name):
        return getattr(self._client, name)

    def pull_batch(self, **kwargs):
        batch = self._client.pull_batch(**kwargs)
        self._trainer._table = _broadcast_table(batch.table if batch.num_rows else None)
        return batch


class DistributedTrainer(Trainer):
    """``Trainer`` as one rank of a data-parallel group (the group must be initialized). Rank 0 holds
    the store client and the publishers; the other ranks are given ``client=None`` and no publishers.
    ``config.data_parallel``: replicated or sharded (FSDP2) model, the module docstring."""

    def __init__(
        self,
        config: TrainerConfig,
        client,
        *,
        model: torch.nn.Module,
        teacher=None,
        publishers: Sequence[Publisher | ModelPublisher] = (),
    ):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # read by _prepare_model, within Trainer.__init__; one rank has nothing to shard (Trainer's says so)
        self.sharded = config.data_parallel == "shard" and self.world_size > 1
        if self.rank == 0 and client is None:
            raise ValueError("rank 0 needs the store client")
        if self.rank != 0 and publishers:
            raise ValueError("only rank 0 publishes versions")
        super().__init__(
            config,
            _BroadcastingClient(client, self) if self.rank == 0 else None,
            model=model,
            teacher=teacher,
            publishers=publishers,
        )
        self._table: pa.Table | None = None
        if self.sharded and self.offload:  # its DTensor state is gathered on the device for checkpoints
            log.warning(
                "trainer.offload_optimizer has no effect on sharded ranks: each keeps its share of the AdamW state on its device"
            )
            self.offload = False

    def start(self) -> TrainerState:
        """Rank 0 resumes (re-acks, republishes) as ``Trainer.start``; then every rank takes rank 0's
        model, optimizer and state, so the replicas start identical. Sharded, the other ranks join rank
        0's restore (``_load_checkpoint``) and its first publish (``_full_state``), and take its state."""
        if self.sharded:
            if self.rank == 0:
                super().start()
            else:
                self._load_checkpoint()
                self._full_state(optimizer=False)
            state: list[Any] = [self.state]
            _from_rank0(state)
            self.state = state[0]
            return self.state
        if self.rank == 0:
            super().start()
            payload: list[Any] = [self.model.state_dict(), self.optimizer.state_dict(), self.state]
        else:
            payload = [None, None, None]
        _from_rank0(payload)  # the others wait for rank 0's start: checkpoint, re-acks, first publish
        if self.rank != 0:
            self.model.load_state_dict(payload[0])
            self.optimizer.load_state_dict(payload[1])
            self.state = payload[2]
        return self.state

    def step(self) -> dict | None:
        if self.rank == 0:
            return super().step()  # its pull broadcasts; update() runs the collectives
        table = _broadcast_table(None)
        if table is None:
            return None
        self._table = table
        stats = self.update(_Rows.from_table(table))
        self.state = TrainerState(step=self.state.step + 1, version=self.state.version + 1)
        if self.sharded:  # rank 0 gathers the whole state for its checkpoint, export and publish
            self._full_state(optimizer=checkpoint_due(self.config, self.state.step))
        stats["step"] = self.state.step - 1
        return stats

    # ---- the cross-rank hooks of Trainer.update ---------------------------------------------------

    def _local_rows(self, rows: _Rows) -> _Rows | None:
        """This rank's share of the batch (whole groups, ``shard_groups``); None when it has none, or
        sharded no rows (the rank still runs the proximal passes the others run, ``_paced``)."""
        assert self._table is not None
        mine = shard_groups(self._table, self.rank, self.world_size)
        return _subset(rows, mine) if mine or self.sharded else None

    def _sum_over_ranks(self, counts: tuple[int, int]) -> tuple[int, int]:
        t = torch.tensor(counts, dtype=torch.int64, device=_collective_device())
        dist.all_reduce(t)
        return int(t[0]), int(t[1])

    def _reduce_gradients(self) -> None:
        if not self.sharded:  # sharded: FSDP2 reduce-scattered (summed) them after each backward
            _all_reduce_gradients(self.model)

    def _gather_stats(self, parts: list[dict[str, float]]) -> list[dict[str, float]]:
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, parts)
        return [part for rank_parts in gathered for part in rank_parts]

    def _paced(self, batches: Iterable) -> Iterator:
        return self._paced_passes(list(batches)) if self.sharded else super()._paced(batches)

    def _paced_passes(self, batches: list) -> Iterator:
        """``batches``, then as many zero-weight passes as the busiest rank has micro-batches more."""
        count = torch.tensor([len(batches)], dtype=torch.int64, device=_collective_device())
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        yield from batches
        for _ in range(int(count) - len(batches)):
            self._idle_pass()

    def _idle_pass(self) -> None:
        """One pass of a one-token micro-batch whose loss counts 0: FSDP2's all-gathers (and, with grad,
        reduce-scatters of zeros) as in any other pass, under the caller's grad mode and autocast."""
        packed = pack_sequences([[0]], [[0]], max_tokens=None)[0]
        logp = packed_logprobs(self.model, packed, 1.0, chunk_tokens=self.config.logprob_chunk_tokens)
        if torch.is_grad_enabled():
            (logp.sum() * 0.0).backward()

    def _clip_gradients(self) -> float:
        if not self.sharded:
            return super()._clip_gradients()
        from torch.distributed.tensor import DTensor

        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)  # replicated: every rank's is the whole

    # ---- the sharded model: wrapped once, its whole state gathered on rank 0 --------------------------

    def _prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return shard_model(model, self.device) if self.sharded else super()._prepare_model(model)

    def _full_state(self, *, optimizer: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """Sharded: the whole model (and optimizer) state in CPU memory on rank 0, empty on the others,
        behind the two ``state_dict()`` views ``save_checkpoint``, ``export_model`` and ``_publish`` read.
        A collective: every rank calls it at the same points (``start``, ``step``)."""
        if not self.sharded:
            return super()._full_state(optimizer=optimizer)
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        options = _whole_state_options(cpu_offload=True)
        model_state = get_model_state_dict(self.model, options=options)
        optimizer_state: dict = {}
        if optimizer:
            optimizer_state = get_optimizer_state_dict(self.model, self.optimizer, options=options)
            optimizer_state = _numbered(optimizer_state) if self.rank == 0 else {}
        return cast(torch.nn.Module, _WholeModel(self.model, model_state)), cast(
            torch.optim.Optimizer, _WholeOptimizer(optimizer_state)
        )

    def _load_checkpoint(self) -> TrainerState | None:
        """Sharded: rank 0 reads the latest checkpoint (the format of one rank) and scatters it to the
        shards of every rank; returns its state on rank 0 (the others take it from ``start``)."""
        if not self.sharded:
            return super()._load_checkpoint()
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        found = read_checkpoint(self.run_dir) if self.rank == 0 else None
        exists: list[Any] = [found is not None]
        _from_rank0(exists)
        if not exists[0]:
            return None
        blob: dict = found[0] if found is not None else {"model": {}, "optimizer": {}}
        options = _whole_state_options(broadcast_from_rank0=True)
        set_model_state_dict(self.model, blob["model"], options=options)
        named = _named(blob["optimizer"], self.model, self.optimizer) if found is not None else {}
        set_optimizer_state_dict(self.model, self.optimizer, named, options=options)
        if found is None:
            return None
        restore_rng(found[0])
        return found[1]


def shard_model(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``model`` sharded over the whole group in place (FSDP2): each decoder layer
    (``model.get_decoder().layers``, a transformers causal LM) its own unit, then the root, with the
    gradient reduction a plain sum over the ranks (the module docstring says why)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    with torch.no_grad():  # the shards are cut from rank 0's weights, as replicated ranks start from rank 0's
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor, src=0)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    get_decoder = getattr(model, "get_decoder", None)  # a transformers PreTrainedModel's
    decoder = get_decoder() if callable(get_decoder) else None
    layers = list(getattr(decoder, "layers", ()))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    log.info("model sharded over %d ranks (FSDP2: %d decoder layers, then the root)", dist.get_world_size(), len(layers))
    for module in model.modules():
        if isinstance(module, FSDPModule):  # set per unit: the root's setting is not its layers'
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


class _WholeModel:
    """The sharded model as the checkpoint, the export and the publishers read it: ``state_dict()`` the
    gathered whole state; anything else (its Hugging Face config, ``save_pretrained``) the model's."""

    def __init__(self, model: torch.nn.Module, state: dict):
        self._model, self._state = model, state

    def state_dict(self) -> dict:
        return self._state

    def __getattr__(self, name: str):
        return getattr(self._model, name)


class _WholeOptimizer:
    """The sharded optimizer's gathered whole state, numbered as ``Optimizer.state_dict()`` numbers it."""

    def __init__(self, state: dict):
        self._state = state

    def state_dict(self) -> dict:
        return self._state


def _whole_state_options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def _numbered(state: dict) -> dict:
    """An optimizer state dict keyed by parameter names (``get_optimizer_state_dict``) as
    ``Optimizer.state_dict()`` writes it: parameters numbered in the order of the groups' lists."""
    ids: dict[str, int] = {}
    groups = [
        {**group, "params": [ids.setdefault(name, len(ids)) for name in group["params"]]} for group in state["param_groups"]
    ]
    return {"state": {ids[name]: value for name, value in state["state"].items()}, "param_groups": groups}


def _named(state: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """``_numbered``'s inverse for ``optimizer`` over ``model``'s parameters (the number of a parameter:
    its place in the optimizer's groups, as ``Optimizer.state_dict()`` gives it)."""
    names = {param: name for name, param in model.named_parameters()}
    order = [names[param] for group in optimizer.param_groups for param in group["params"]]
    return {
        "state": {order[i]: value for i, value in state["state"].items()},
        "param_groups": [{**group, "params": [order[i] for i in group["params"]]} for group in state["param_groups"]],
    }


def _subset(rows: _Rows, seqs: list[int]) -> _Rows:
    tokens = rows.token_slice(seqs) if seqs else torch.zeros(0, dtype=torch.int64)
    lengths = np.array([len(rows.outputs[s]) for s in seqs], dtype=np.int64)
    return _Rows(
        prompts=[rows.prompts[s] for s in seqs],
        outputs=[rows.outputs[s] for s in seqs],
        domains=[rows.domains[s] for s in seqs],
        behavior=rows.behavior[tokens],
        versions=rows.versions[tokens],
        advantages=rows.advantages[tokens],
        temperatures=rows.temperatures[tokens],
        seq_of_token=torch.from_numpy(np.repeat(np.arange(len(seqs)), lengths)),
        offsets=np.concatenate([[0], np.cumsum(lengths)]),
    )


# How long the other ranks wait for what rank 0 does alone: read the checkpoint, re-ack, publish,
# and between two pulls wait for the rollout actors' first weights, evaluate, checkpoint or export.
# Nothing the other ranks can bound, and on a loaded machine longer than ``dist_timeout_s`` (which
# then failed a healthy group before its first step). A rank 0 that dies closes its connections,
# which ends the wait at once, so this limit only guards against a rank 0 that is alive and stuck.
RANK0_WAIT_S = 6 * 3600.0


def _rank0_group() -> Any:
    """A gloo group of every rank whose collectives wait ``RANK0_WAIT_S`` (made once per process
    group: a collective call, so every rank makes it at the same point, its first wait for rank 0)."""
    world = dist.group.WORLD
    if _RANK0_GROUP.get("world") is not world:
        _RANK0_GROUP.update(world=world, group=dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=RANK0_WAIT_S)))
    return _RANK0_GROUP["group"]


_RANK0_GROUP: dict[str, Any] = {}


def _from_rank0(objects: list) -> None:
    """``broadcast_object_list`` from rank 0 over ``_rank0_group``: for the points where the other
    ranks wait while rank 0 works alone."""
    dist.broadcast_object_list(objects, src=0, group=_rank0_group())


def _broadcast_table(table: pa.Table | None) -> pa.Table | None:
    """Rank 0's table (or None) on every rank, as Arrow IPC bytes (``_from_rank0``: the other ranks
    wait here for whatever rank 0 does between two pulls)."""
    payload: list = [None]
    if dist.get_rank() == 0 and table is not None:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        payload = [sink.getvalue().to_pybytes()]
    _from_rank0(payload)
    if payload[0] is None:
        return None
    return table if dist.get_rank() == 0 else pa.ipc.open_stream(payload[0]).read_all()


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _collective_device() -> str:
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


def _all_reduce_gradients(model: torch.nn.Module) -> None:
    """Sum every parameter's gradient over the ranks in one flat all-reduce (a rank without a
    contribution sends zeros)."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
    dist.all_reduce(flat)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p))  # type: ignore[union-attr]
        offset += n
