"""The training loop: pull a validated batch, update with decoupled PPO (+ MOPD), checkpoint, ack,
publish the next policy version.

    trainer = Trainer(config, StoreClient.from_env(config.server, trainer_key=...), publishers=[channel])
    trainer.run()

One step (``Trainer.step``):
1. ``PullBatch`` at the trainer's version ``v`` with staleness bound ``eta`` (whole groups, leased);
2. the proximal log-probs of the rows trained after the first optimizer update, recomputed with the
   weights before it (no grad; none with one minibatch, the default: the first minibatch's training
   forward runs those weights and gives its own, ``Trainer._step_inputs``), or AReaL's log-linear
   approximation between the behavior and each training forward's log-probs;
3. ``num_minibatches`` optimizer updates over the batch (packed micro-batches, token-weighted
   gradient accumulation) on ``rl_coef * decoupled_ppo + distill_coef * mopd + kl_coef * kl``; the
   frozen teacher and KL reference score each micro-batch on its own packing before the student's
   forward;
4. the step's statistics to ``train_steps`` (``ReportTrainStep``), then a checkpoint holding the
   lease, then ``AckBatch``, then a Hugging Face export when one is due (``trainer.export``), then
   version ``v + 1`` to every weight publisher and ``PublishVersion`` (the time this takes, publishers,
   checksum and RPC, is ``perf/publish_s`` in the returned statistics, not in ``train_steps``: the
   step was reported before it; the publishers' part is ``perf/weight_sync_s`` in the NEXT step's
   ``train_steps`` row, the handoff of the weights that step trains from).
A kill -9 anywhere in between neither loses nor repeats a batch (see ``trainer.checkpoint``).

A step is a pure function of the checkpoint before it and its lease's rows in their served order, so
``rollbook replay step`` (rollbook/cli/replay_step.py) reruns it bit for bit on CPU through this same
``update``: the minibatch order is drawn from (``seed``, step) alone (``minibatch_order``), never from
an RNG whose state moves between checkpoints, and the PyTorch intra-op threads that summed it, which
change CPU float reductions, are recorded with the step (``perf/torch_threads`` in ``train_steps``).

With ``trainer.offload_optimizer`` the AdamW state leaves the device after the step's last optimizer
update and comes back before the next step's first (trainer/offload.py; ``perf/offload_s`` and
``perf/onload_s`` in ``train_steps``). On CUDA ``perf/peak_device_mib`` in ``train_steps`` is the
most device memory this process had allocated during the step (``torch.cuda.max_memory_allocated``,
reset when the step's batch arrives; a colocated engine's weights and KV cache count while they are
resident); absent on other devices. A publisher in this process that reads the model itself
(``ModelPublisher``: the colocated engine's, rollbook/run/driving.py ``EngineHandoff``) gets no state dict.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import pathlib
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np
import pyarrow as pa
import torch

from rollbook import devices
from rollbook.config import TrainerConfig
from rollbook.trainer import losses
from rollbook.trainer.checkpoint import TrainerState, checkpoint_due, load_checkpoint, save_checkpoint
from rollbook.trainer.export import export_due, export_model
from rollbook.trainer.model_builders import build_reference
from rollbook.trainer.offload import Offloaded, offload_optimizer, onload_optimizer
from rollbook.trainer.packing import pack_sequences, packed_logprobs, packed_logprobs_and_kl
from rollbook.trainer.proximal import loglinear_alpha, loglinear_proximal_logprobs

if TYPE_CHECKING:  # pragma: no cover
    from rollbook.client import TrainerClient
    from rollbook.trainer.teachers import TeacherScorer

log = logging.getLogger("rollbook.trainer")

Publisher = Callable[[int, dict], None]  # (version, state_dict) -> None


@runtime_checkable
class ModelPublisher(Protocol):
    """A weight publisher in the trainer's own process that reads the new version from the trained model
    itself (rollbook/run/driving.py ``EngineHandoff``: copied into an engine's model on the device). The
    trainer builds no state dict for it, so weights that stay on a GPU never pass through host memory.
    ``model`` is the trainer's, whole (one rank, or replicated ranks); read it, never change it."""

    def publish_model(self, version: int, model: torch.nn.Module) -> None: ...


@dataclass
class _Rows:
    """The per-sequence and per-token tensors of one pulled batch (token tensors are [T_out])."""

    prompts: list[list[int]]
    outputs: list[list[int]]
    domains: list[str]
    behavior: torch.Tensor
    versions: torch.Tensor
    advantages: torch.Tensor
    temperatures: torch.Tensor
    seq_of_token: torch.Tensor
    offsets: np.ndarray  # token offsets per sequence, len = num_seqs + 1

    @classmethod
    def from_table(cls, table: pa.Table) -> "_Rows":
        outputs = table.column("output_token_ids").to_pylist()
        lengths = np.array([len(o) for o in outputs])
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        seq_of_token = torch.from_numpy(np.repeat(np.arange(len(outputs)), lengths))
        flat = lambda col, dtype: torch.tensor(
            np.concatenate([np.asarray(x) for x in table.column(col).to_pylist()]), dtype=dtype
        )
        per_seq = lambda col: torch.tensor(table.column(col).to_numpy(zero_copy_only=False), dtype=torch.float32)
        temps = torch.tensor([t if t and t > 0 else 1.0 for t in table.column("temperature").to_pylist()], dtype=torch.float32)
        return cls(
            prompts=table.column("prompt_token_ids").to_pylist(),
            outputs=outputs,
            domains=table.column("domain").to_pylist(),
            behavior=flat("output_logprobs", torch.float32),
            versions=flat("output_versions", torch.int64),
            advantages=per_seq("advantage")[seq_of_token],
            temperatures=temps[seq_of_token],
            seq_of_token=seq_of_token,
            offsets=offsets,
        )

    def to(self, device: torch.device) -> "_Rows":
        """The per-token tensors on ``device`` (where the model's log-probs are); the rest as is."""
        if self.behavior.device == device:
            return self
        move = {f: getattr(self, f).to(device) for f in ("behavior", "versions", "advantages", "temperatures", "seq_of_token")}
        return dataclasses.replace(self, **move)

    def token_slice(self, seqs: Sequence[int] | np.ndarray) -> torch.Tensor:
        """Token indices [T] of the given sequences, in order."""
        return torch.cat([torch.arange(self.offsets[s], self.offsets[s + 1]) for s in seqs])

    def sequence_weights(self) -> torch.Tensor:
        """[T]: 1 / the length of each token's sequence (``loss.aggregation = "sequence_mean"``); over a
        set of whole sequences they sum to the number of sequences."""
        return losses.sequence_mean_weights(self.seq_of_token)


@dataclass
class _StepInputs:
    """The per-token tensors a step's losses take besides the student's log-probs (``Trainer._step_inputs``);
    the NaN entries of ``proximal``, ``teacher`` and ``reference`` are filled micro-batch by micro-batch."""

    proximal_mode: str  # loss.proximal
    proximal: torch.Tensor
    alpha: torch.Tensor | None  # loglinear's per-token interpolation weight
    teacher: torch.Tensor | None  # distillation: the teacher's log-probs of the sampled tokens
    reference: torch.Tensor | None  # the KL penalty: the reference policy's
    weights: torch.Tensor | None  # sequence_mean's per-token weights

    def fused_proximal(self, minibatch: int) -> bool:
        """Does minibatch number ``minibatch`` take its proximal log-probs from its own training forward?"""
        return self.proximal_mode == "loglinear" or (self.proximal_mode == "recompute" and minibatch == 0)


class Trainer:
    def __init__(
        self,
        config: TrainerConfig,
        client: TrainerClient | None,
        *,
        model: torch.nn.Module,
        teacher: TeacherScorer | None = None,
        publishers: Sequence[Publisher | ModelPublisher] = (),
        reference: torch.nn.Module | None = None,
    ):
        if config.loss.distill_coef > 0 and teacher is None:
            from rollbook.errors import ConfigError

            raise ConfigError("loss.distill_coef > 0 needs a teacher (a [[teachers]] entry), or set loss.distill_coef = 0")
        if config.loss.distill_coef > 0 and config.loss.distill_estimator == "full":
            from rollbook.trainer.teachers import full_scorer

            full_scorer(teacher)  # type: ignore[arg-type]  # not None: refused above
        self.config = config
        self.client = client
        # the device and dtype are checked here too (a test, a library user): one line, before any work
        self.device = devices.resolve_device(config.device)
        devices.resolve_dtype(config.dtype, self.device)
        if config.teacher_dtype is not None:
            devices.resolve_dtype(config.teacher_dtype, self.device)
        self.model = devices.place_trained(model, self.device)  # float32 master weights; forwards under autocast
        self.teacher = teacher
        # the KL reference (None while loss.kl_coef is 0) is built here, before start() restores a
        # checkpoint into the model: reference = "initial" copies the starting student
        self.reference: torch.nn.Module | None = None
        if config.loss.kl_coef > 0:
            reference = build_reference(config, model) if reference is None else reference.eval().requires_grad_(False)
            self.reference = devices.place(reference, self.device, config.dtype)
        self.publishers = list(publishers)
        self.run_dir = pathlib.Path(config.run_dir)
        self.model = self._prepare_model(self.model)  # after the reference copied it, before the optimizer holds its parameters
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        self.state = TrainerState()
        self._unacked: list[str] = []  # leases trained since the last checkpoint
        self.offload = config.offload_optimizer  # DistributedTrainer turns it off for sharded state
        self._offloaded: Offloaded | None = None  # the AdamW state while it is off the device
        self._carried: dict[str, float] = {}  # measured between steps, reported with the next one

    # ---- lifecycle --------------------------------------------------------------------------------

    def start(self) -> TrainerState:
        """Resume from the latest checkpoint (re-ack its leases, republish its version) or publish v0."""
        restored = self._load_checkpoint()
        if restored is None:
            torch.manual_seed(self.config.seed)  # dropout, for a model with any (the minibatch order is minibatch_order's)
            self.state = TrainerState()
        else:
            self.state = restored
            for lease in restored.consumed_leases:
                self.client.ack_batch(lease, self.config.trainer_id)
            log.info("resumed at step %d, version %d", restored.step, restored.version)
        self._publish()
        return self.state

    def run(self) -> list[dict]:
        """Start, then train until ``num_steps`` steps are done (trainer/drive.py, with no placement);
        returns each step's statistics."""
        from rollbook.trainer.drive import drive

        self.start()
        cfg = self.config
        return drive(self, num_steps=cfg.num_steps, max_wait_s=cfg.max_wait_s, poll_interval_s=cfg.poll_interval_s).history

    def report_with_next_step(self, stats: dict[str, float]) -> None:
        """Statistics measured between steps (a colocated engine's freed KV cache) for the next step's
        ``train_steps`` row, where ``perf/weight_sync_s`` goes too."""
        self._carried.update(stats)

    # ---- one step ---------------------------------------------------------------------------------

    def step(self) -> dict | None:
        cfg = self.config
        started = time.time()
        batch = self.client.pull_batch(
            trainer_id=cfg.trainer_id,
            trainer_version=self.state.version,
            max_staleness=cfg.max_staleness,
            num_samples=cfg.num_samples,
            step=self.state.step,
            model_id=cfg.model_id,
            lease_seconds=cfg.lease_seconds,
        )
        if batch.num_rows == 0:
            return None
        on_cuda = self.device.type == "cuda"
        if on_cuda:  # perf/peak_device_mib: the step's own peak, from here to its report
            torch.cuda.reset_peak_memory_stats(self.device)
        rows = _Rows.from_table(batch.table)
        stats = self.update(rows)
        stats.update(_batch_stats(batch, rows, self.state.version))
        if on_cuda:
            stats["perf/peak_device_mib"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        stats.update(self._carried)  # e.g. perf/weight_sync_s: the handoff of the weights this step trained from
        self._carried = {}
        stats["perf/torch_threads"] = torch.get_num_threads()  # CPU reductions depend on it: replay sets the same
        stats["time/step_s"] = time.time() - started
        stats["perf/tokens_per_s"] = len(rows.behavior) / max(stats["time/step_s"], 1e-9)
        self.client.report_train_step(
            step=self.state.step,
            trainer_id=cfg.trainer_id,
            version=self.state.version + 1,
            lease_id=batch.lease_id,
            started_at=started,
            finished_at=time.time(),
            stats=stats,
        )
        self._unacked.append(batch.lease_id)
        self.state = TrainerState(step=self.state.step + 1, version=self.state.version + 1, consumed_leases=list(self._unacked))
        checkpointing = checkpoint_due(cfg, self.state.step)
        model, optimizer = self._full_state(optimizer=checkpointing)  # once, for the checkpoint, export and publish
        if checkpointing:
            save_checkpoint(self.run_dir, model, optimizer, self.state, keep_last=cfg.keep_last)
            for lease in self._unacked:  # only now are these batches safe: the weights holding them are on disk
                self.client.ack_batch(lease, cfg.trainer_id)
            self._unacked = []
        if export_due(cfg, self.state.step):
            export_model(
                self.run_dir,
                self.state.step,
                model,
                cfg.model,
                keep_last=cfg.export_keep_last,
                tokenizer_dir=cfg.tokenizer,
                dtype=cfg.dtype,
            )
        published = time.perf_counter()
        self._publish(model)
        # after ReportTrainStep, so in what step() returns (metrics.jsonl), not in train_steps.stats
        stats["perf/publish_s"] = time.perf_counter() - published
        stats["step"] = self.state.step - 1
        log.info(
            "step %d  reward %.3f  loss %.4f  clip %.3f  tokens/s %.0f",
            stats["step"],
            stats["reward/mean"],
            stats["loss/total"],
            stats.get("ppo/clip_frac", 0.0),
            stats["perf/tokens_per_s"],
        )
        return stats

    def _apply_lr(self) -> float:
        """Set the optimizer's learning rate for the step about to run (``lr_warmup_steps``, ``lr_decay``);
        returns it."""
        cfg = self.config
        lr = scheduled_lr(
            cfg.lr,
            self.state.step,
            warmup_steps=cfg.lr_warmup_steps,
            decay=cfg.lr_decay,
            num_steps=cfg.num_steps,
            min_ratio=cfg.lr_min_ratio,
        )
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def update(self, rows: _Rows) -> dict:
        """Proximal log-probs, then the minibatch updates; returns the step's statistics.

        The one update path of every trainer: ``DistributedTrainer`` overrides only the cross-rank
        hooks (``_local_rows``, ``_sum_over_ranks``, ``_reduce_gradients``, ``_gather_stats``, and for
        sharded ranks ``_paced`` and ``_clip_gradients``), which are identities here; a term added to
        the loss goes into ``_loss`` and reaches both. Its forward passes run on ``trainer.device``
        under autocast to ``trainer.dtype`` (rollbook/devices.py)."""
        with devices.autocast(self.device, self.config.dtype):
            return self._update(rows.to(self.device))

    def _update(self, rows: _Rows) -> dict:
        cfg = self.config
        lr = self._apply_lr()
        local = self._local_rows(rows)  # this rank's share (None: no group for it this step)
        order = minibatch_order(cfg.seed, self.state.step, len(local.outputs) if local is not None else 0)
        minibatches = np.array_split(order, cfg.num_minibatches)
        inputs = self._step_inputs(local, minibatches) if local is not None else None
        parts: list[dict[str, float]] = []  # one per micro-batch, reduced by reduce_stats
        grad_norms: list[float] = []
        moved: dict[str, float] = {}  # perf/onload_s, perf/offload_s with trainer.offload_optimizer
        for number, minibatch in enumerate(minibatches):
            # what the losses average over: sequences and tokens, summed over the ranks
            units = (len(minibatch), len(local.token_slice(minibatch))) if local is not None and len(minibatch) else (0, 0)
            totals = self._sum_over_ranks(units)
            if totals[0] == 0:
                continue  # the same on every rank
            self.optimizer.zero_grad(set_to_none=True)
            batches = self._micro_batches(local, minibatch) if local is not None and units[0] else iter(())
            for seqs, idx, packed in self._paced(batches):
                assert local is not None and inputs is not None
                fuse = inputs.fused_proximal(number)
                stats = self._micro_step(local, seqs, idx, packed, totals, inputs, fuse)
                parts.append({k: float(v) for k, v in stats.items()})
            self._reduce_gradients()
            grad_norms.append(self._clip_gradients())
            if self._offloaded is not None:  # the first update of the step: the AdamW state comes back first
                moved["perf/onload_s"] = self._move_optimizer_state(onload=True)
            self.optimizer.step()
        if self.offload and self._offloaded is None:  # not when it stayed off (a step without an update)
            moved["perf/offload_s"] = self._move_optimizer_state(onload=False)
        if local is not None and inputs is not None and len(local.behavior):
            parts.append(
                {
                    "proximal/behavior_gap": float((inputs.proximal - local.behavior).abs().mean()),
                    "proximal/num_valid_tokens": len(local.behavior),
                }
            )
            if inputs.teacher is not None:
                parts += _teacher_gap_by_domain(local, inputs.teacher, inputs.proximal)
        out = reduce_stats(self._gather_stats(parts))
        out["grad/norm"] = float(np.mean(grad_norms)) if grad_norms else 0.0  # identical on every rank
        out["optim/lr"] = lr
        out["dist/world_size"] = self.world_size
        if self.offload:
            out.update({"perf/onload_s": 0.0, "perf/offload_s": 0.0, **moved})  # 0.0: nothing was off the device
        return out

    def _step_inputs(self, rows: _Rows, minibatches: list[np.ndarray]) -> "_StepInputs":
        """What the step's losses take besides the student's own log-probs: the proximal log-probs as
        far as they must exist before the first update, and the buffers the micro-batches fill.

        The proximal policy is the weights before this step's first update, so the first minibatch's
        training forward IS its proximal forward: those log-probs are the forward's own, detached, and
        only the later minibatches' rows are recomputed first (none with one minibatch, the default).
        ``loglinear`` interpolates from every training forward and recomputes nothing. The teacher and
        the KL reference are frozen: they score each micro-batch as it is trained, on its packing."""
        cfg = self.config
        mode = cfg.loss.proximal
        alpha = None
        if mode == "behavior":  # not decoupled: clip pi_theta / pi_behavior, weight 1
            proximal = rows.behavior.clone()
        else:
            proximal = torch.full_like(rows.behavior, float("nan"))  # filled by _micro_step where fused
            if mode == "loglinear":
                alpha = loglinear_alpha(rows.versions, self.state.version, self.state.version + 1)
            else:
                later = [int(s) for m in minibatches[1:] for s in m]
                self._recompute_proximal(rows, later, proximal)
        teacher = None
        if cfg.loss.distill_coef > 0:
            assert self.teacher is not None  # __init__ refuses distillation without one
            teacher = torch.full_like(rows.behavior, float("nan"))
        reference = torch.full_like(rows.behavior, float("nan")) if self.reference is not None else None
        weights = rows.sequence_weights() if any(_aggregations(cfg.loss)) else None
        return _StepInputs(mode, proximal, alpha, teacher, reference, weights)

    def _move_optimizer_state(self, *, onload: bool) -> float:
        """Bring the AdamW state back to its device (``onload``) or move it to host memory
        (trainer/offload.py); returns the seconds it took, the copies complete."""
        started = time.perf_counter()
        if onload:
            assert self._offloaded is not None
            onload_optimizer(self._offloaded)
            self._offloaded = None
        else:
            self._offloaded = offload_optimizer(self.optimizer)
        return time.perf_counter() - started

    # ---- the cross-rank hooks of update(): identities on one rank (DistributedTrainer: collectives) ----

    world_size = 1

    def _local_rows(self, rows: _Rows) -> _Rows | None:
        """The rows this rank trains on: all of them."""
        return rows

    def _sum_over_ranks(self, counts: tuple[int, int]) -> tuple[int, int]:
        """A minibatch's (sequences, tokens) over every rank: the micro-batch losses' denominators."""
        return counts

    def _reduce_gradients(self) -> None:
        """Make every rank's accumulated gradients the whole minibatch's (before the clip)."""

    def _gather_stats(self, parts: list[dict[str, float]]) -> list[dict[str, float]]:
        """Every rank's micro-batch statistics, for ``reduce_stats``."""
        return parts

    def _paced(self, batches: Iterable) -> Iterator:
        """The student's forward (and, with grad, backward) passes over ``batches``, its packed
        micro-batches: as they are here. Sharded ranks run FSDP2's collectives inside every pass, so
        there each rank runs as many passes as the busiest one (trainer/distributed.py)."""
        return iter(batches)

    def _clip_gradients(self) -> float:
        """Clip the summed gradients to ``grad_clip``; returns their norm before the clip."""
        return float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip))

    # ---- where the whole state is: the model itself here (sharded ranks gather it, a collective) ----

    def _prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The trained model as this trainer holds it: as placed here (sharded ranks wrap it in FSDP2)."""
        if self.config.data_parallel == "shard":
            log.warning("trainer.data_parallel = 'shard' with one rank: nothing to shard, the model is trained whole")
        return model

    def _load_checkpoint(self) -> TrainerState | None:
        """Restore the latest checkpoint into the model and the optimizer (``load_checkpoint``)."""
        return load_checkpoint(self.run_dir, self.model, self.optimizer)

    def _full_state(self, *, optimizer: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """A model (and, with ``optimizer``, an optimizer) whose ``state_dict()`` is the whole state, for
        the checkpoint, the export and the published version: the trainer's own here."""
        return self.model, self.optimizer

    def _micro_step(self, rows: _Rows, seqs, idx, packed, totals, inputs: "_StepInputs", fuse_proximal: bool) -> dict:
        """One packed micro-batch of a minibatch (``totals``: its sequences and tokens over every rank):
        the frozen scorers' log-probs of it, the student's forward, the loss, scaled to the micro-batch's
        share, backward; returns the loss's statistics.

        ``fuse_proximal``: the weights have not moved yet this step (the first minibatch), so the
        proximal log-probs are this forward's own, detached (``_step_inputs``). With
        ``loss.distill_estimator = "full"`` the reverse KL to the teacher comes per output position from
        ``packed_logprobs_and_kl`` (whole distributions exist ``logprob_chunk_tokens`` rows at a time);
        ``inputs.teacher[idx]`` receives its log-probs of the sampled tokens either way, for the
        per-domain teacher gap."""
        loss_cfg = self.config.loss
        chunk = self.config.logprob_chunk_tokens
        per_sequence, distill_per_sequence = _aggregations(loss_cfg)
        teacher, reference, weights = inputs.teacher, inputs.reference, inputs.weights
        domains = [rows.domains[s] for s in seqs]
        distill_kl = None
        if reference is not None:
            with torch.no_grad():
                reference[idx] = packed_logprobs(self.reference, packed, rows.temperatures[idx], chunk_tokens=chunk)  # type: ignore[arg-type]  # set when reference is
        if teacher is not None and loss_cfg.distill_estimator == "full":
            from rollbook.trainer.teachers import full_scorer

            distributions = full_scorer(self.teacher).score_full(packed, domains)  # type: ignore[arg-type]  # set when teacher is
            logp, distill_kl, teacher_tokens = packed_logprobs_and_kl(
                self.model, packed, rows.temperatures[idx], distributions, chunk_tokens=chunk
            )
            teacher[idx] = teacher_tokens.to(teacher)
        else:
            if teacher is not None:
                with torch.no_grad():
                    teacher[idx] = self.teacher.score(packed, domains).to(teacher)  # type: ignore[union-attr]  # set when teacher is
            logp = packed_logprobs(self.model, packed, rows.temperatures[idx], chunk_tokens=chunk)
        if fuse_proximal:
            current = logp.detach().to(inputs.proximal)
            if inputs.alpha is not None:
                current = loglinear_proximal_logprobs(rows.behavior[idx], current, inputs.alpha[idx])
            inputs.proximal[idx] = current
        share = _micro_share(len(seqs), len(idx), totals, per_sequence)
        loss, stats = self._loss(
            logp,
            inputs.proximal[idx],
            rows.behavior[idx],
            rows.advantages[idx],
            teacher[idx] if teacher is not None else None,
            reference[idx] if reference is not None else None,
            weights[idx] if weights is not None and per_sequence else None,
            weights[idx] if weights is not None and distill_per_sequence else None,
            _micro_share(len(seqs), len(idx), totals, distill_per_sequence) / share,
            distill_kl=distill_kl,
        )
        (loss * share).backward()
        # the units the loss values average over, their weights in reduce_stats
        stats["loss/num_units"] = len(seqs) if per_sequence else len(idx)
        if teacher is not None:
            stats["mopd/num_units"] = len(seqs) if distill_per_sequence else len(idx)
        return stats

    def _loss(
        self,
        logp,
        prox,
        behav,
        adv,
        teacher_logp,
        reference_logp=None,
        weights=None,
        distill_weights=None,
        distill_scale=1.0,
        *,
        distill_kl=None,
    ):
        """The micro-batch's loss; ``weights`` [T]: per-token weights (``loss.aggregation``), None the token
        mean; ``distill_weights`` the same for the MOPD term (``loss.distill_aggregation``), and
        ``distill_scale`` that term's micro-batch share over the whole loss's (1.0 when both aggregate alike).
        ``distill_kl`` [T]: the reverse KL to the teacher at each position, for the full-vocabulary
        distillation (``teacher_logp`` is then only reported)."""
        cfg = self.config.loss
        mask = torch.ones_like(logp, dtype=torch.bool)
        out = self._policy_loss(logp, prox, behav, adv, teacher_logp, mask, weights, distill_weights, distill_scale, distill_kl)
        if reference_logp is None:
            return out
        kl = losses.kl_penalty(logp, reference_logp, mask, estimator=cfg.kl_estimator, token_weights=weights)
        return losses.add_kl_penalty(out, kl, kl_coef=cfg.kl_coef)

    def _policy_loss(
        self, logp, prox, behav, adv, teacher_logp, mask, weights=None, distill_weights=None, distill_scale=1.0, distill_kl=None
    ):
        cfg = self.config.loss
        rl = losses.decoupled_ppo_loss(
            logp,
            prox,
            behav,
            adv,
            mask,
            eps_clip=cfg.eps_clip,
            eps_clip_high=cfg.eps_clip_high,
            behavior_weight_cap=cfg.behavior_weight_cap,
            behavior_weight_action=cfg.behavior_weight_action,
            dual_clip=cfg.dual_clip,
            token_weights=weights,
        )
        if teacher_logp is None:
            loss, stats = rl
            return loss * cfg.rl_coef, {**stats, "loss/total": float(loss.detach()) * cfg.rl_coef}
        if distill_kl is not None:
            distill = losses.kl_distill_loss(distill_kl, mask, token_weights=distill_weights)
        else:
            distill = losses.mopd_loss(
                logp,
                prox,
                behav,
                teacher_logp,
                mask,
                adv_clip=cfg.adv_clip,
                behavior_weight_cap=cfg.behavior_weight_cap,
                behavior_weight_action=cfg.behavior_weight_action,
                token_weights=distill_weights,
            )
        if distill_scale != 1.0:  # the two terms average over different units (sequences, tokens)
            distill = (distill[0] * distill_scale, distill[1])
        return losses.combined_loss(rl, distill, rl_coef=cfg.rl_coef, distill_coef=cfg.distill_coef)

    def _micro_batches(self, rows: _Rows, seqs: Sequence[int] | np.ndarray):
        """(sequence ids, token indices [T], PackedMicroBatch) per packed micro-batch of ``seqs``.

        With a teacher that routes by domain (``DomainRouter.route``) and distillation on, each
        route's sequences are packed apart, so every micro-batch goes to one teacher as it is: the
        teacher scores the student's own packing (routing a mixed micro-batch re-packs each teacher's
        share and runs one smaller forward per teacher). It costs at most one part-filled micro-batch
        per route beyond the rest."""
        seqs = list(seqs)
        route = getattr(self.teacher, "route", None) if self.config.loss.distill_coef > 0 else None
        parts: dict[object, list[int]] = {}
        for s in seqs:
            parts.setdefault(route(rows.domains[s]) if route is not None else None, []).append(s)
        for part in parts.values():
            packs = pack_sequences(
                [rows.prompts[s] for s in part], [rows.outputs[s] for s in part], max_tokens=self.config.micro_batch_tokens
            )
            for packed in packs:
                members = [part[i] for i in packed.sequence_ids.tolist()]
                yield members, rows.token_slice(members), packed

    @torch.no_grad()
    def _recompute_proximal(self, rows: _Rows, seqs: Sequence[int], out: torch.Tensor) -> None:
        """The proximal log-probs of ``seqs`` (rows a later minibatch trains, after the weights moved)
        into ``out``: a no-grad forward with the weights before the step's first update. Every rank
        runs it (sharded ranks keep their passes in step, ``_paced``), with or without rows."""
        for _, idx, packed in self._paced(self._micro_batches(rows, seqs) if len(seqs) else iter(())):
            out[idx] = packed_logprobs(self.model, packed, rows.temperatures[idx], chunk_tokens=self.config.logprob_chunk_tokens)

    def _publish(self, model: torch.nn.Module | None = None) -> None:
        """Publish the current version; ``model``: ``_full_state``'s, when the step already has it.

        The time the publishers take (the state dict they read built included) is ``perf/weight_sync_s``
        of the next step's row. A ``ModelPublisher`` reads ``model`` itself; the state dict is built
        only for the others, or for the checksum when there is no publisher at all: weights handed
        over only in this process have no bytes in transit to identify, and the store records the
        version with an empty checksum."""
        model = self._full_state(optimizer=False)[0] if model is None else model
        version, state = self.state.version, None
        started = time.perf_counter()
        for publisher in self.publishers:
            if isinstance(publisher, ModelPublisher):
                publisher.publish_model(version, model)
                continue
            state = self._published_state(model) if state is None else state
            publisher(version, state)
        if self.publishers:
            devices.synchronize(self.device)  # the copies done, so the time is theirs
            self._carried["perf/weight_sync_s"] = time.perf_counter() - started
        else:
            state = self._published_state(model)
        # every version announces the staleness contract, so separately started workers gate by it
        self.client.publish_version(
            self.config.model_id,
            version,
            checksum="" if state is None else state_checksum(state),
            max_staleness=self.config.max_staleness,
            samples_per_version=self.config.num_samples,
        )

    def _published_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """``model``'s state dict in the run's dtype: a bfloat16 run publishes bfloat16 weights (half the
        bytes), which the engines hold."""
        return devices.cast_floating({k: v.detach() for k, v in model.state_dict().items()}, self.config.dtype)


def scheduled_lr(
    lr: float, step: int, *, warmup_steps: int = 0, decay: str = "constant", num_steps: int = 1, min_ratio: float = 0.0
) -> float:
    """The learning rate of 0-based ``step``: a linear warm-up of ``warmup_steps`` (0 = none), ``lr *
    min(1, (step + 1) / warmup_steps)``; then ``decay`` "constant" keeps ``lr``, "cosine" goes along a
    half cosine from ``lr`` (the first step after the warm-up) to ``lr * min_ratio`` (step ``num_steps
    - 1``, and any later one)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if decay == "constant":
        return lr
    if decay != "cosine":
        raise ValueError(f"lr decay must be 'constant' or 'cosine', got {decay!r}")
    span = num_steps - 1 - warmup_steps
    progress = min(1.0, (step - warmup_steps) / span) if span > 0 else 1.0
    return lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def minibatch_order(seed: int, step: int, num_sequences: int) -> np.ndarray:
    """The order of a step's sequences before ``num_minibatches`` splits it: a permutation drawn from
    (``seed``, ``step``) alone, so a step replays from its checkpoint and lease whatever drew random
    numbers between checkpoints (a colocated rollout, an evaluation) or how many steps ago the last
    checkpoint was. A negative seed is taken modulo 2**64 (NumPy seeds are non-negative)."""
    return np.random.default_rng([seed % 2**64, step]).permutation(num_sequences)


def state_checksum(state: dict) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())  # any dtype: its bytes
    return h.hexdigest()


def _batch_stats(batch, rows: _Rows, version: int) -> dict:
    table = batch.table
    rewards = np.asarray(table.column("original_reward").to_pylist(), dtype=np.float64)
    stats = {
        "reward/mean": float(rewards.mean()),
        "reward/normalized_mean": float(np.mean(table.column("reward").to_pylist())),
        "batch/num_samples": table.num_rows,
        "batch/valid_tokens": int(len(rows.behavior)),
        "batch/staleness_max": int(version - min(table.column("min_version").to_pylist())),
    }
    ledger = batch.stats.get("ledger", {})
    stats["ledger/total_tokens"] = ledger.get("total_tokens", 0)
    stats["ledger/rejected_tokens"] = ledger.get("rejected_tokens", 0)
    stats["ledger/masked_token_ratio"] = ledger.get("masked_token_ratio", 0.0)
    for domain in sorted(set(rows.domains)):
        mask = np.array([d == domain for d in rows.domains])
        stats[f"reward/{domain}"] = float(rewards[mask].mean())
    return stats


def _aggregations(loss) -> tuple[bool, bool]:
    """(RL loss per sequence, MOPD loss per sequence): ``loss.aggregation`` and ``loss.distill_aggregation``."""
    per_sequence = loss.aggregation == "sequence_mean"
    return per_sequence, (loss.distill_aggregation or loss.aggregation) == "sequence_mean"


def _micro_share(seqs: int, tokens: int, totals: tuple[int, int], per_sequence: bool) -> float:
    """A micro-batch's share of a minibatch's loss: its sequences over the minibatch's (sequence mean)
    or its tokens over the minibatch's (token mean); ``totals`` = (sequences, tokens), summed over ranks."""
    return seqs / totals[0] if per_sequence else tokens / totals[1]


def _teacher_gap_by_domain(rows: _Rows, teacher: torch.Tensor, student: torch.Tensor) -> list[dict[str, float]]:
    """``teacher_gap/DOMAIN``, the mean of log pi_T - log pi_student over the domain's tokens, one
    ``reduce_stats`` part per domain (weighted by ``num_tokens/DOMAIN``)."""
    gap = (teacher - student).float().cpu().numpy()
    seq = rows.seq_of_token.cpu().numpy()
    out = []
    for domain in sorted(set(rows.domains)):
        seqs = [i for i, d in enumerate(rows.domains) if d == domain]
        mine = np.isin(seq, seqs)
        if mine.any():
            out.append({f"teacher_gap/{domain}": float(gap[mine].mean()), f"num_tokens/{domain}": int(mine.sum())})
    return out


_MEAN_WEIGHTS = {
    # loss values: each averages over its loss's units (tokens, or sequences under sequence_mean)
    "loss/total": "loss/num_units",
    "ppo/loss": "loss/num_units",
    "kl/mean": "loss/num_units",
    "mopd/loss": "mopd/num_units",
    # fractions of the tokens kept in the loss (behavior_weight_action = "mask" drops some)
    "ppo/clip_frac": "ppo/num_loss_tokens",
    "ppo/dual_clip_frac": "ppo/num_loss_tokens",
    "mopd/adv_clip_frac": "mopd/num_loss_tokens",
}


def stat_reduction(key: str) -> tuple[str, str | None]:
    """How the statistic ``key`` of a micro-batch combines with the others of the step, on this rank
    and across ranks: ``(op, weight)``, the rule by name for every statistic the losses
    (trainer/losses.py) and ``update`` produce:

    - a count, a key with a ``num_*`` part (``ppo/num_loss_tokens``, ``loss/num_units``, ``num_tokens/DOMAIN``): the sum;
    - an extreme, ``..._max`` or ``..._min``: the max or the min;
    - anything else is a mean, weighted by the count it averages over: a loss value
      (``loss/total``, ``ppo/loss``, ``kl/mean``, ``mopd/loss``) by its loss's units (tokens, or
      sequences under ``loss.aggregation = "sequence_mean"``); a fraction of the kept tokens by
      ``PREFIX/num_loss_tokens``; ``teacher_gap/DOMAIN`` by ``num_tokens/DOMAIN``; any other
      ``PREFIX/NAME`` by ``PREFIX/num_valid_tokens``.

    So the step's statistics are those of one micro-batch holding the whole batch, whatever the
    micro-batch size and the number of ranks. A new statistic follows the rule or gets an entry here."""
    last = key.rsplit("/", 1)[-1]
    if any(part.startswith("num_") for part in key.split("/")):
        return "sum", None
    if last.endswith("_max"):
        return "max", None
    if last.endswith("_min"):
        return "min", None
    if key in _MEAN_WEIGHTS:
        return "mean", _MEAN_WEIGHTS[key]
    prefix, _, name = key.partition("/")
    if prefix == "teacher_gap":
        return "mean", f"num_tokens/{name}"
    return "mean", f"{prefix}/num_valid_tokens"


def reduce_stats(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    """One step's statistics from its micro-batches' (every rank's), by ``stat_reduction``; a mean
    over no weight is 0."""
    out: dict[str, float] = {}
    weights: dict[str, float] = {}
    for part in parts:
        for key, value in part.items():
            op, weight_key = stat_reduction(key)
            if op == "sum":
                out[key] = out.get(key, 0) + value
            elif op == "max":
                out[key] = max(out.get(key, value), value)
            elif op == "min":
                out[key] = min(out.get(key, value), value)
            else:
                weight = part[weight_key]  # type: ignore[index]  # a mean always has one
                out[key] = out.get(key, 0.0) + weight * value
                weights[key] = weights.get(key, 0.0) + weight
    for key, total in weights.items():
        out[key] = out[key] / total if total else 0.0
    return out
