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
acked, the lease expires and its rows return; restarted, rank 0 loads the last checkpoint and
broadcasts it (model, optimizer, step, version) to the others, so no batch is lost or repeated.
Gradients are reduced by hand rather than through ``DistributedDataParallel`` because a step
accumulates over a variable number of packed micro-batches per rank (DDP would all-reduce at every
backward unless every rank ran the same count under ``no_sync``); the model is replicated, not
sharded (the models here are small; FSDP2's ``fully_shard`` is the path for ones that do not fit).
"""

from __future__ import annotations

import datetime
import logging
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import torch
import torch.distributed as dist

from rollbook.config import TrainerConfig
from rollbook.trainer.checkpoint import TrainerState
from rollbook.trainer.loop import Publisher, Trainer, _Rows

log = logging.getLogger("rollbook.trainer")


def backend_for(choice: str) -> str:
    """``auto``: gloo, as the trainer keeps its model on the CPU today (trainer/loop.py never moves it);
    nccl is for a model on CUDA, where gradients and the token counts then live."""
    return "gloo" if choice == "auto" else choice


def init_group(
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str = "env://",
    *,
    backend: str = "auto",
    timeout_s: float = 120.0,
) -> tuple[int, int]:
    """Join the process group (a no-op when already joined); returns (rank, world size). With
    ``init_method='env://'`` (torchrun) rank and world size come from torch's own rendezvous."""
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {} if rank is None else {"rank": rank, "world_size": world_size}
        dist.init_process_group(
            backend_for(backend), init_method=init_method, timeout=datetime.timedelta(seconds=timeout_s), **kwargs
        )
    return dist.get_rank(), dist.get_world_size()


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
    the store client and the publishers; the other ranks are given ``client=None`` and no publishers."""

    def __init__(
        self,
        config: TrainerConfig,
        client,
        *,
        model: torch.nn.Module,
        teacher=None,
        publishers: Sequence[Publisher] = (),
    ):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
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

    def start(self) -> TrainerState:
        """Rank 0 resumes (re-acks, republishes) as ``Trainer.start``; then every rank takes rank 0's
        model, optimizer and state, so the replicas start identical."""
        if self.rank == 0:
            super().start()
            payload: list[Any] = [self.model.state_dict(), self.optimizer.state_dict(), self.state]
        else:
            payload = [None, None, None]
        dist.broadcast_object_list(payload, src=0)
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
        stats["step"] = self.state.step - 1
        return stats

    # ---- the cross-rank hooks of Trainer.update ---------------------------------------------------

    def _local_rows(self, rows: _Rows) -> _Rows | None:
        """This rank's share of the batch (whole groups, ``shard_groups``); None when it has none."""
        assert self._table is not None
        mine = shard_groups(self._table, self.rank, self.world_size)
        return _subset(rows, mine) if mine else None

    def _sum_over_ranks(self, counts: tuple[int, int]) -> tuple[int, int]:
        t = torch.tensor(counts, dtype=torch.int64, device=_collective_device())
        dist.all_reduce(t)
        return int(t[0]), int(t[1])

    def _reduce_gradients(self) -> None:
        _all_reduce_gradients(self.model)

    def _gather_stats(self, parts: list[dict[str, float]]) -> list[dict[str, float]]:
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, parts)
        return [part for rank_parts in gathered for part in rank_parts]


def _subset(rows: _Rows, seqs: list[int]) -> _Rows:
    tokens = rows.token_slice(seqs)
    lengths = np.array([len(rows.outputs[s]) for s in seqs])
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


def _broadcast_table(table: pa.Table | None) -> pa.Table | None:
    """Rank 0's table (or None) on every rank, as Arrow IPC bytes."""
    payload: list = [None]
    if dist.get_rank() == 0 and table is not None:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        payload = [sink.getvalue().to_pybytes()]
    dist.broadcast_object_list(payload, src=0)
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
