"""Configuration of the trainer (``rollbook train``, and the trainer inside ``rollbook run``): its
loss, its teachers, and how its end of the network weight channel cuts what it serves."""

from __future__ import annotations

import warnings
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollbook.config.language_model import Dtype, ModelConfig, device_field, dtype_field


class LossConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    eps_clip: float = Field(0.2, gt=0, lt=1, description="PPO ratio clip (lower side; upper too unless eps_clip_high).")
    eps_clip_high: float | None = Field(
        None, gt=0, description="Upper ratio clip (decoupled clip, 'clip-higher'); None = eps_clip."
    )
    behavior_weight_cap: float | None = Field(5.0, gt=0, description="Cap on pi_prox/pi_behav; None = uncapped.")
    behavior_weight_action: Literal["mask", "clamp"] = Field(
        "mask", description="Above the cap: drop the token (mask) or clamp the weight."
    )
    dual_clip: float | None = Field(None, gt=1, description="Dual-clip constant c for negative advantages; None = off.")
    aggregation: Literal["token_mean", "sequence_mean"] = Field(
        "token_mean",
        description="How the per-token losses of a batch are averaged: token_mean (AReaL's and the "
        "default: every token counts the same, so long answers weigh more) or sequence_mean (each "
        "sequence's token mean, then the mean over sequences: verl's seq-mean-token-mean; a domain of "
        "short answers is not outweighed by one of long ones, e.g. 3-digit sums beside 13-character "
        "programs in configs/demo.toml).",
    )
    proximal: Literal["recompute", "loglinear", "behavior"] = Field(
        "recompute",
        description="Proximal log-probs: the trainer's weights before the step's first update (the first minibatch's "
        "are its training forward's own; later minibatches' rows get a no-grad forward first), or AReaL's "
        "log-linear approximation from each training forward; 'behavior' turns the decoupling off: the standard PPO ratio against the behavior "
        "policy (the sampler's log-probs), AReaL's baseline in its staleness ablation.",
    )
    rl_coef: float = Field(1.0, ge=0, description="Weight of the decoupled-PPO loss.")
    distill_coef: float = Field(0.0, ge=0, description="Weight of the MOPD loss (needs teachers).")
    adv_clip: float = Field(5.0, gt=0, description="MOPD: clip of the teacher advantage log pi_T - log pi_theta.")
    distill_estimator: Literal["sampled", "full"] = Field(
        "sampled",
        description="How the distillation term sees the teacher: 'sampled' (AReaL's MOPD: the teacher's log-prob of "
        "each sampled token as a clipped per-token advantage, under the decoupled importance ratio) or 'full' (the "
        "exact reverse KL to the teacher over the whole vocabulary at every output position, GKD's on-policy "
        "setting: every position moves every token's probability toward the teacher, where 'sampled' learns only "
        "from the tokens drawn; it needs local teachers and holds tokens x vocabulary floats per micro-batch for "
        "the student and the teacher alike; adv_clip and the importance ratio do not apply).",
    )
    distill_aggregation: Literal["token_mean", "sequence_mean"] | None = Field(
        None,
        description="How the MOPD loss averages its tokens; None: as `aggregation`. A sequence's reverse KL to "
        "its teacher is the sum of its per-token terms, so token_mean weighs every token's teacher advantage "
        "the same, where sequence_mean gives a wrong digit of a 14-token program a quarter of the weight of "
        "one in a 4-token sum (docs/RESULTS.md, 'The MOPD demo': in the demo it moved weight from the sums "
        "to the programs).",
    )
    kl_coef: float = Field(
        0.0,
        ge=0,
        description="Weight of the KL penalty to the reference policy (TrainerConfig.reference), "
        "added to the loss on the same packed tokens (verl's kl_loss_coef, TRL's beta); 0 = off "
        "(no reference is loaded). Reported per step as kl/mean.",
    )
    kl_estimator: Literal["k1", "k3"] = Field(
        "k3",
        description="Per-token KL estimate with r = log pi_theta - log pi_ref: 'k1' = r, 'k3' = exp(-r) - 1 + r "
        "(never negative; verl's low_var_kl, TRL's GRPO); see docs/design.md, 'The trainer'.",
    )


class TeacherConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(
        description="Local Hugging Face directory of the teacher (a causal LM with config.json and weights: a "
        "model's own, or a run's export RUN_DIR/hf/step-NNNNNN/ or `rollbook export`); same vocabulary as the student."
    )
    domain: str | None = Field(None, description="Domain this teacher serves (routing 'domain').")
    weight: float = Field(1.0, gt=0, description="Mixture weight (routing 'mixture').")


class TrainerConfig(BaseModel):
    """Configuration of ``rollbook train`` (and the trainer inside ``rollbook run``)."""

    model_config = ConfigDict(extra="forbid")

    server: str = Field("127.0.0.1:50551", description="Store address HOST:PORT.")
    trainer_key: str | None = Field(
        None,
        repr=False,
        exclude=True,  # never in config.json nor a log line
        description="Trainer role key: PullBatch, AckBatch, PublishVersion, ReportTrainStep (env ROLLBOOK_TRAINER_KEY).",
    )
    trainer_id: str = Field("trainer-0", description="Name recorded in leases and train_steps.")
    model_id: str = Field("tiny", description="Model id in the store's registry.")
    run_dir: str = Field("runs/default", description="Run directory: checkpoints/ and the resolved config go here.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    tokenizer: str | None = Field(
        None,
        description="Local Hugging Face tokenizer directory the run's rollout encodes "
        "with: exported beside the model (RUN_DIR/hf/, `rollbook export`), and for a tiny model "
        "of unset model.vocab_size its vocabulary. None: model.path's tokenizer files, else the "
        "toy tasks' character tokenizer. `rollbook run` sets it from rollout.tokenizer.",
    )
    loss: LossConfig = Field(default_factory=LossConfig)
    teachers: list[TeacherConfig] = Field(default_factory=list, description="Teachers for MOPD.")
    teacher_routing: Literal["domain", "mixture"] = Field("domain", description="How tokens are routed to teachers.")
    teacher_temperature: float = Field(
        1.0,
        gt=0,
        description="Divides every teacher's logits when it scores the student's tokens (the distillation "
        "temperature): 1 = the teacher's own distribution; below 1 a sharper one, nearer its greedy answer (a "
        "teacher right at greedy but not always when sampled then teaches the greedy answer).",
    )
    reference: str = Field(
        "initial",
        description="Reference policy of the KL penalty (loss.kl_coef > 0): 'initial' = a frozen copy of the "
        "student as built before any checkpoint is restored (model.path or the warm-started base, so a resumed run keeps "
        "the same reference), or a local Hugging Face directory with the student's vocabulary.",
    )
    weight_server: str | None = Field(
        None,
        description="HOST:PORT to serve each published version over gRPC (full copies and deltas) for rollout "
        "workers on other hosts (`rollbook rollout --weights grpc:HOST:PORT`); port 0 picks one (logged). The weight "
        "stream is read-only and unauthenticated: bind loopback or a private interface. None = off.",
    )
    num_steps: int = Field(50, ge=1, description="Optimizer steps (each on one pulled batch) before stopping.")
    num_samples: int = Field(
        64,
        ge=1,
        description="Samples per pulled batch, at most: whole ready groups, oldest first, while they fit (a first "
        "group larger than this is served whole). A step trains on what is ready when it pulls: with fewer rows "
        "ready it takes fewer (at least one group; train_steps.stats batch/num_samples says how many), it does "
        "not wait for a full batch.",
    )
    num_minibatches: int = Field(1, ge=1, description="Optimizer updates per batch (the batch split by sequences).")
    micro_batch_tokens: int = Field(
        8192, ge=64, description="Largest packed micro-batch (tokens); gradients accumulate across them."
    )
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate.")
    lr_warmup_steps: int = Field(
        0,
        ge=0,
        description="Linear learning-rate warm-up: step k (0-based) updates at lr * min(1, (k + 1) / N), so the "
        "first step takes lr / N and step N - 1 the full lr; 0 = the full lr from the first step. Follows the "
        "checkpointed step, so a resumed run continues the schedule. A warm-started tiny model collapses under "
        "a fresh AdamW at full lr (docs/RESULTS.md, 'The MOPD demo').",
    )
    lr_decay: Literal["constant", "cosine"] = Field(
        "constant",
        description="After the warm-up: constant keeps lr; cosine lowers it along a half cosine to "
        "lr * lr_min_ratio at the last of num_steps (it follows the step, so a resumed run continues the "
        "curve; one resumed with a larger num_steps follows the longer curve from its step on). A run "
        "ends on its last policy, and at a constant lr that is wherever the last few updates left it.",
    )
    lr_min_ratio: float = Field(0.1, ge=0, le=1, description="lr_decay cosine: the floor, as a share of lr.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Gradient-norm clip.")
    max_staleness: int = Field(
        1, ge=0, description="eta: serve only samples with version - min(output_versions) <= eta (0 = on-policy)."
    )
    lease_seconds: float = Field(120.0, gt=0, description="Lease time; an unacked batch returns to the pool after it.")
    poll_interval_s: float = Field(0.2, gt=0, description="Wait between pulls when no batch is ready.")
    max_wait_s: float = Field(600.0, gt=0, description="Give up when no batch arrives for this long.")
    checkpoint_every: int = Field(
        1,
        ge=1,
        description="Checkpoint every N steps. A batch is acked only once checkpointed, so the "
        "lease time must cover N steps; versions published between checkpoints are redone after a crash.",
    )
    keep_last: int = Field(
        2, ge=1, description="Checkpoints kept in RUN_DIR/checkpoints/ (the newest N; LATEST names the newest)."
    )
    export_every: int | None = Field(
        None,
        ge=1,
        description="Also write a Hugging Face directory (model + tokenizer, loadable with from_pretrained) "
        "every N steps, to RUN_DIR/hf/step-NNNNNN/; None = only after the last step (export_final).",
    )
    export_final: bool = Field(True, description="Write a Hugging Face export after the last step (num_steps).")
    export_keep_last: int = Field(2, ge=1, description="Hugging Face exports kept in RUN_DIR/hf/ (the newest N).")
    seed: int = Field(
        0,
        description="Trainer RNG seed: torch's at the start, and with the step number the order of that step's minibatches (trainer/loop.py minibatch_order).",
    )
    num_ranks: int = Field(
        1,
        ge=1,
        description="Data-parallel ranks (trainer/distributed.py): one lease per step split "
        "across them by whole groups, gradients summed, one checkpoint and one ack (rank 0). "
        "`rollbook train` starts ranks 1..N-1 itself; under torchrun the launcher's world size wins.",
    )
    dist_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto",
        description="torch.distributed backend of the ranks (auto: nccl when the trainer's device is CUDA, each "
        "rank on its own GPU, LOCAL_RANK or its rank modulo the GPUs it sees; gloo otherwise).",
    )
    device: str = device_field("the trainer's models (student, teachers, KL reference)")
    dtype: Dtype = dtype_field(
        "the trainer's forward passes",
        "bfloat16: the student's master weights, gradients and AdamW state stay float32 and its forward "
        "runs under autocast; teachers and the KL reference are held in bfloat16; log-probs and losses are "
        "computed in float32 from the logits. Hugging Face exports and published weights are in this dtype.",
    )
    teacher_dtype: Dtype | None = Field(
        None,
        description="Precision the MOPD teachers are held and run in; None: `dtype`. They only run forward and "
        "nothing trains them, so bfloat16 under a float32 student is the usual saving: their forward is the one "
        "pass a distillation step adds to a bare step (on the reference CPU with AVX-512 bf16 it took 0.33 s where "
        "float32 took 0.49; docs/RESULTS.md 'Trainer step'); their log-probs carry bfloat16's rounding.",
    )
    data_parallel: Literal["replicate", "shard"] = Field(
        "replicate",
        description="With num_ranks > 1 (or under torchrun): 'replicate' keeps the whole model and optimizer on "
        "every rank; 'shard' splits parameters, gradients and optimizer state over the ranks (FSDP2 fully_shard, "
        "per decoder layer), for a model that does not fit one device; the step, checkpoints and exports are "
        "the same. One rank holds everything either way: there 'shard' has no effect (the log warns).",
    )
    logprob_chunk_tokens: int = Field(
        1024,
        ge=1,
        description="Output positions whose logits are held at once when log-probs (and the full-vocabulary "
        "distillation term) are computed: peak memory grows with this times the vocabulary, not with a "
        "micro-batch's output tokens.",
    )
    offload_optimizer: bool = Field(
        False,
        description="Keep the AdamW state (exp_avg, exp_avg_sq, step) off the trainer's device between steps: "
        "copied into host memory (pinned on CUDA) after each step's last optimizer update and back before the "
        "next step's first (trainer/offload.py), so what runs between steps has that device memory. In the "
        "colocated placement it also has the rollout engine free its KV cache for the training phase: "
        "rollout and training then take turns with the GPU's memory. Costs one copy of the state each way per "
        "step, in train_steps as perf/offload_s and perf/onload_s (the engine's freed bytes as "
        "rollout/kv_released_bytes); the values and so the run are unchanged. On the CPU it saves nothing (host "
        "memory copied into host memory), hence off by default. Sharded ranks (data_parallel 'shard' with "
        "several ranks) keep their share of the state where it is (the log says so).",
    )
    dist_timeout_s: float = Field(
        120.0,
        gt=0,
        description="How long a rank waits in a step's collectives for the others; a dead rank fails the step after at "
        "most this long. The wait of ranks 1..N-1 for what rank 0 does alone (its start, and between pulls its waits "
        "for rollout, evaluations and checkpoints) is not bounded by it: a rank 0 that dies ends that wait at once.",
    )

    @model_validator(mode="after")
    def _check(self) -> "TrainerConfig":
        if self.teachers and self.loss.distill_coef == 0:
            warnings.warn("teachers are configured but loss.distill_coef = 0: they will not be used", stacklevel=2)
        if self.reference != "initial" and self.loss.kl_coef == 0:
            warnings.warn("a reference model is configured but loss.kl_coef = 0: it will not be used", stacklevel=2)
        if self.teacher_routing == "domain" and len(self.teachers) > 1 and any(t.domain is None for t in self.teachers):
            raise ValueError("teacher_routing 'domain' with several teachers needs a domain on each")
        return self


class WeightStreamConfig(BaseModel):
    """How the trainer's network weight channel (rollbook/weights/network.py, ``NetworkPublisher``)
    cuts and schedules updates."""

    chunk_bytes: int = Field(
        1 << 20, ge=4096, le=3 << 20, description="payload bytes per streamed message (gRPC's default limit is 4 MiB)"
    )
    anchor_every: int = Field(
        20, ge=1, description="every this-many-th publish is a full anchor (no delta is offered for it); 1 disables deltas"
    )
