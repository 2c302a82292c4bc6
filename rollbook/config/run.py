"""Configuration of ``rollbook run``: the store, the rollout worker(s) and the trainer of one run.

One source of truth in ``RunConfig``: ``run_dir``, ``num_steps`` and ``max_staleness`` are set once at
the top and the trainer's and the worker's copies follow them; a copy set explicitly to another
value is an error, never silently overwritten.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollbook.config.language_model import DEVICE_PATTERN, Dtype
from rollbook.config.rollout import RolloutConfig
from rollbook.config.store import StoreConfig
from rollbook.config.trainer import TrainerConfig


class WarmStartConfig(BaseModel):
    """Supervised warm start of the tiny student (and teacher) before RL, as RL on LLMs always
    starts from a pretrained model. Cached in the run directory."""

    model_config = ConfigDict(extra="forbid")

    student_steps: int = Field(
        60,
        ge=0,
        description="Supervised steps for the student's starting point on the toy tasks "
        "(0 = random init). With [rollout.dataset] it is 0 and setting it above 0 is an error.",
    )
    teacher_steps: int = Field(
        0,
        ge=0,
        description="Supervised steps for the MOPD teacher on the toy tasks (0 = no "
        "teacher is built). Not with [rollout.dataset]: list [[trainer.teachers]] instead.",
    )
    specialist_teachers: bool = Field(
        False,
        description="MOPD teachers: one specialist per domain, each trained "
        "teacher_steps on its own domain only and routed to by domain (needs "
        "trainer.teacher_routing 'domain'); False: one teacher trained on every domain.",
    )
    student_mix: dict[str, float] = Field(
        default_factory=dict,
        description="Share of each domain in the student's warm start: each problem of a supervised batch "
        "picks its domain with these weights (normalized; a domain not named gets none), then a training "
        "problem of that domain. Empty = all domains' training problems pooled, so a domain weighs as "
        "many problems as it has. Domains reach their plateau's end at different steps; the mix lets one "
        "student step count leave every domain part-learned (configs/demo.toml).",
    )
    student_target: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Warm-start the student until every domain has reached this greedy accuracy on its own "
        "training problems (checked every student_check_every steps on student_check_problems of them, "
        "set apart from the warm start's batches; never on held-out problems), or for student_steps at most. A domain's plateau ends at a step that "
        "varies with the seed, so a fixed step count leaves some seeds' student at zero on a domain; with "
        "a target none is. Every domain keeps training until the last one is there (one taken out is "
        "forgotten), so the first may be past it: student_mix evens their pace. None: exactly student_steps steps.",
    )
    student_ceiling: float | None = Field(
        None,
        gt=0,
        le=1,
        description="With student_target: a domain whose greedy accuracy at a check is at or above this "
        "ceiling sits out of the batches until the next check (it does not learn on, and falls back; "
        "when every domain is above it, the least accurate one trains on), and the warm start stops at "
        "the first check where every domain is at or above the target and below the ceiling (one "
        "domain: at the target). Domains leave their plateau at "
        "seed-dependent steps and then rise within a hundred steps, so without it the first one ends "
        "near its best; and one that swings past the ceiling and back within ten steps would otherwise "
        "end where one check's draw left it (docs/RESULTS.md, 'The MOPD demo'). Must be above "
        "student_target; None: no ceiling.",
    )
    teacher_target: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Train each teacher until its SAMPLED accuracy (one answer per problem at temperature 1) "
        "on student_check_problems of its own training problems (set apart from its batches) reaches this, "
        "checked every student_check_every steps, or for teacher_steps at most. Sampled, not greedy: "
        "distillation pulls the student toward the teacher's whole distribution, and a teacher stopped "
        "at 98 % greedy answered 0.4 % of held-out programs right when sampled. None: exactly "
        "teacher_steps. Specialist teachers print their held-out accuracy (greedy and sampled) either way.",
    )
    teacher_lr: float | None = Field(None, gt=0, description="The teachers' supervised learning rate; None: lr (the student's).")
    student_check_every: int = Field(20, ge=1, description="Steps between the student_target checks.")
    student_check_problems: int = Field(
        64,
        ge=1,
        description="Training problems per domain the student_target check decodes greedily (set apart: "
        "the student's warm start does not train on them; at most half a domain's).",
    )
    batch_size: int = Field(64, ge=1, description="Problems per supervised step.")
    lr: float = Field(3e-3, gt=0, description="Supervised learning rate.")
    seed: int = Field(1, description="Seed of the supervised data order (distinct from the RL task seed).")

    @model_validator(mode="after")
    def _ceiling_above_target(self) -> "WarmStartConfig":
        if self.student_ceiling is not None and (self.student_target is None or self.student_ceiling <= self.student_target):
            raise ValueError(
                f"warm_start.student_ceiling ({self.student_ceiling}) needs a student_target below it "
                f"(student_target: {self.student_target})"
            )
        return self


class OnlineConfig(BaseModel):
    """Online mode of ``rollbook run`` (docs/online.md): the trainer learns from an agent's calls through
    ``rollbook proxy`` instead of from the rollout worker. Present (an ``[online]`` section, or any
    ``--online.*`` flag): the run starts the proxy following the trainer's weights over shared memory
    and the agent process as its load; ``placement`` is then not used."""

    model_config = ConfigDict(extra="forbid")

    agent: str = Field(
        "examples/arithmetic_agent.py",
        description="The agent script (plain Python, openai client), "
        "run as `python AGENT --proxy URL --problems FILE ...` (examples/arithmetic_agent.py's flags).",
    )
    game: Literal["feedback", "calculator"] = Field(
        "feedback",
        description="The game the agent plays, which sets its problems and the held-out evaluation played here: "
        "'feedback' (examples/arithmetic_agent.py: arithmetic or reverse problems, a retry after right./wrong.) or "
        "'calculator' (examples/calculator_agent.py: 'multiply' problems, a `mul` tool the model calls, then the "
        "answer; needs trainer.model.path, a model whose chat template renders tools, e.g. "
        "examples/make_calculator_model.py's).",
    )
    group_size: int = Field(4, ge=1, description="Agent sessions per problem: a normalization group (turn k of them).")
    concurrency: int = Field(4, ge=1, description="Groups the agent plays at once (concurrency * group_size sessions).")
    turns: int = Field(
        2, ge=1, description="Calls per session: the answer, then a retry after the agent's right./wrong. feedback."
    )
    num_problems: int = Field(
        256,
        ge=1,
        description="Training problems per domain of rollout.domains (arithmetic and reverse; multiply for "
        "the calculator game) the agent plays, round after round (train split; fewer when a domain has fewer).",
    )
    num_eval_problems: int = Field(
        40, ge=1, description="Held-out problems per domain of the evaluation (held-out split; fewer when a domain has fewer)."
    )
    eval_samples: int = Field(
        4,
        ge=0,
        description="Sampled episodes per held-out problem at the agent's temperature "
        "(eval/sampled_reward), drawn with eval_seed every time; 0 = greedy only.",
    )
    eval_seed: int = Field(1234, description="Seed of the sampled evaluation (the same at every evaluation).")
    temperature: float = Field(1.0, gt=0, le=2, description="The agent's sampling temperature.")
    max_tokens: int = Field(6, ge=1, description="The agent's max_tokens per call.")
    agent_seed: int | None = Field(None, description="The agent's problem order seed; None = rollout.seed.")


class TrackerConfig(BaseModel):
    """Experiment trackers (rollbook/tracking.py): every row of RUN_DIR/metrics.jsonl also goes to each
    tracker turned on here, each number under its flat metric name (``reward/mean``,
    ``eval/sampled/addition``) at the row's trainer step. Off by default; the libraries are the
    optional extra ``pip install 'rollbook[tracking]'``, and one turned on but not installed stops the
    run at start in one line."""

    model_config = ConfigDict(extra="forbid")

    tensorboard: bool = Field(
        False,
        description="Write TensorBoard event files to RUN_DIR/tensorboard/ (`tensorboard --logdir RUN_DIR/tensorboard`); "
        "needs the tensorboard package.",
    )
    wandb: bool = Field(
        False,
        description="Log to Weights & Biases, its files under RUN_DIR/wandb/, the resolved config as the "
        "wandb run's config; a resumed run continues the same wandb run (its id in RUN_DIR/wandb-id). Needs the wandb package.",
    )
    wandb_project: str = Field("rollbook", description="The wandb project.")
    wandb_entity: str | None = Field(None, description="The wandb entity (user or team); None: the logged-in user's default.")
    wandb_name: str | None = Field(None, description="The wandb run's display name; None: the run directory's name.")
    wandb_mode: Literal["offline", "online", "disabled"] = Field(
        "offline",
        description="offline: written under RUN_DIR/wandb/ only, no network, no login (`wandb sync RUN_DIR/wandb/offline-run-*` "
        "uploads it later); online: streamed to the wandb server (needs `wandb login` or WANDB_API_KEY); disabled: wandb does nothing.",
    )


class ReplayConfig(BaseModel):
    """Train from a finished run's ledger (rollbook/run/from_ledger.py, docs/replay.md "Train from the
    ledger"): present (a ``[replay]`` section, or any ``--replay.*`` flag), the run generates nothing.
    Before its store starts, its new ledger (RUN_DIR/rollbook.duckdb) is seeded with the whole stored
    groups ``where`` selects in ``ledger``, ``epochs`` times; its trainer then pulls, leases and acks
    them as it would fresh rollouts, and held-out reward is evaluated as the colocated placement does.
    The source file is only read."""

    model_config = ConfigDict(extra="forbid")

    ledger: str = Field(
        ...,
        min_length=1,
        description="The source ledger: a finished run's RUN_DIR/rollbook.duckdb (its store stopped). Only "
        "read: a private copy of it is what the selection runs on.",
    )
    where: str = Field(
        "TRUE",
        description="SQL condition on the source's trajectories selecting the rows to train on, run in the "
        "store's SQL sandbox as `rollbook replay reward --where` runs (subqueries on the ledger's tables "
        "included). Only whole stored groups are seeded: a group the condition cuts is left out.",
    )
    reward_version: str | None = Field(
        None,
        description="Train on this named reward version of the source (`rollbook replay reward`) instead "
        "of original_reward: its scores are copied into the new ledger and store.validator.reward_version "
        "follows this field. Groups it does not score whole (ok) are left out. None: original_reward.",
    )
    epochs: int = Field(
        1,
        ge=1,
        description="Passes over the selection: every seeded group once per epoch, epoch after epoch. "
        "Epoch 1 keeps the source's trajectory ids; epoch k > 1 seeds a copy whose trajectory, group and "
        "session ids end in '@k'. The run stops early, with a final evaluation, once every seeded row is trained.",
    )


class GateConfig(BaseModel):
    """The promotion gate (rollbook/run/gate.py, docs/gate.md): a version the trainer publishes reaches
    rollout only once it passes. Every ``every``-th version after the last promoted one is evaluated
    (greedy held-out reward on ``eval_size`` held-out problems, and the ``regression`` set) and
    promoted or refused; the versions in between never reach rollout, which generates with the last
    promoted version meanwhile. Each verdict and its figures go to the ledger (policy_versions.status
    and gate). Off by default; colocated and separated placements only."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="Gate the versions the trainer publishes before rollout gets them.")
    every: int = Field(
        1,
        ge=1,
        description="Gate every N-th version after the last promoted one; the versions in between are never "
        "promoted (rollout keeps the last promoted version, so the trainer runs up to N - 1 versions ahead of "
        "it: max_staleness must be at least every - 1).",
    )
    max_drop: float = Field(
        0.05,
        ge=0,
        description="Refuse a version whose greedy held-out reward is below the last promoted version's by more than this.",
    )
    eval_size: int | None = Field(
        None,
        ge=1,
        description="Held-out problems the gate decodes greedily, counted as rollout.num_eval_tasks counts them "
        "(per domain for the toy tasks): the first ones of the placement's held-out set; None: rollout.num_eval_tasks.",
    )
    regression: str | None = Field(
        None,
        description="A JSONL file of problems every promoted version must still solve at greedy: the toy "
        'tasks\' {"domain", "prompt", "answer"} lines, or with [rollout.dataset] rows in the dataset\'s own '
        "format and fields, scored by its rewards. None: no regression set.",
    )
    regression_min_reward: float = Field(
        1.0,
        description="The regression set's mean greedy reward a version needs (1.0: every problem solved, with 0/1 rewards).",
    )
    on_refuse: Literal["continue", "rollback"] = Field(
        "rollback",
        description="After a refusal: 'rollback' restores the last promoted version's weights and optimizer "
        "state into the trainer and publishes them as the next version (promoted: rollout gets the same "
        "weights under a new number, so colocated stays on-policy); 'continue' trains on from the refused "
        "weights while rollout keeps the last promoted version (needs max_staleness >= 2 * every - 1).",
    )


SEPARATED_MAX_STALENESS = 2  # eta of the separated and ray placements when none is configured
ONLINE_MAX_STALENESS = 4  # eta of the online mode: the agent is not gated, it plays ahead of the trainer
# eta of a [replay] run: no bound. Its rows carry the source run's policy versions, which say nothing
# about how far the new student is from the policy that sampled them (docs/replay.md)
REPLAY_MAX_STALENESS = (1 << 32) - 1  # the largest bound PublishVersion announces (a uint32)


class RayConfig(BaseModel):
    """The ``ray`` placement of ``rollbook run`` (rollbook/run/ray_cluster.py): rollout workers and the
    trainer's data-parallel ranks as Ray actors, gang-scheduled in one placement group (a bundle per
    actor and per rank, or one per rollout/trainer pair with ``colocate``), the store as its server
    process beside the driver. On one host it starts a local Ray instance; ``address`` joins a cluster
    started with ``ray start --head`` / ``ray start --address HEAD:6379``."""

    model_config = ConfigDict(extra="forbid")

    address: str | None = Field(
        None,
        description="Ray cluster to join (HOST:PORT of `ray start --head`, or 'auto'); "
        "None starts a local Ray instance for this run.",
    )
    num_cpus: int | None = Field(
        None,
        ge=1,
        description="CPUs of the local Ray instance (address None); None = this "
        "machine's count, raised to what the actors declare. Fewer than the actors declare is refused.",
    )
    num_workers: int = Field(
        2,
        ge=1,
        description="Rollout worker actors; each runs `rollbook rollout`'s loop with its own "
        "spool (RUN_DIR/spool-I), worker_id 'ray-worker-I' and task seed rollout.seed + I.",
    )
    worker_cpus: float = Field(1.0, gt=0, description="CPUs each rollout actor declares.")
    worker_resources: list[dict[str, float]] = Field(
        default_factory=list,
        description="Custom Ray resources per rollout actor, cycled over the actors (e.g. "
        "[{node_a = 1}, {node_b = 1}] puts them on nodes started with those resources); empty = any node.",
    )
    trainer_cpus: float = Field(1.0, gt=0, description="CPUs each trainer rank actor declares.")
    trainer_resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources of every trainer rank (e.g. {gpu_node = 1}); empty = any node."
    )
    accelerator: str = Field(
        "GPU",
        min_length=1,
        description="The Ray resource that stands for one accelerator: 'GPU' (Ray's own; each actor then sees "
        "only the GPUs it reserved, CUDA_VISIBLE_DEVICES), or a custom resource the nodes were started with "
        "(`ray start --resources '{\"NPU\": 8}'` on Ascend machines).",
    )
    worker_gpus: float | None = Field(
        None,
        ge=0,
        description="Accelerators each rollout actor reserves (fractions share one). None: 1 when it generates on "
        "one (rollout.engine 'vllm'; rollout.device cuda or npu; auto on a cluster that has the accelerator), "
        "0.5 with colocate, else 0.",
    )
    trainer_gpus: float | None = Field(
        None,
        ge=0,
        description="Accelerators each trainer rank reserves. None: 1 when it trains on one (trainer.device cuda "
        "or npu; auto on a cluster that has the accelerator), 0.5 with colocate, else 0.",
    )
    colocate: bool = Field(
        False,
        description="Rollout actor I and trainer rank I share one placement-group bundle (one accelerator: "
        "worker_gpus and trainer_gpus 0.5 each unless set); needs num_workers = trainer.num_ranks. False: a "
        "bundle of its own for every rollout actor and every trainer rank.",
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK",
        description="How Ray spreads the placement group's bundles over the nodes (Ray's placement-group strategies).",
    )
    placement_timeout_s: float = Field(
        300.0,
        gt=0,
        description="How long the run waits for Ray to reserve every bundle of its placement group at once "
        "before it stops with an error naming what it asked for (the cluster busy with other work, or a "
        "strategy no set of nodes satisfies).",
    )
    max_restarts: int = Field(
        3,
        ge=0,
        description="Restarts of a rollout actor that dies; the restarted actor reuses its "
        "spool, so its in-flight trajectories arrive exactly once.",
    )
    trainer_restarts: int = Field(
        2,
        ge=0,
        description="Times the trainer group is started again after a rank dies; it "
        "resumes from the last checkpoint (unacked leases expire and their rows return).",
    )
    store_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources of the node the store runs on (e.g. {store_node = 1}): the "
        "store process then runs under a Ray actor there, its ledger RUN_DIR/rollbook.duckdb on that "
        "node's disk; empty = beside `rollbook run` (the driver).",
    )
    store_cpus: float = Field(1.0, gt=0, description="CPUs the store's actor declares (with store_resources).")
    store_host: str = Field(
        "127.0.0.1",
        description="With store_resources: the interface the store binds on its node. On a multi-node "
        "cluster the node's private address; off loopback the store needs TLS: ROLLBOOK_TLS_CERT/"
        "ROLLBOOK_TLS_KEY in that node's `ray start` environment, ROLLBOOK_TLS_CA in the others' (docs/security.md).",
    )
    weight_channel: Literal["object_store", "network"] = Field(
        "object_store",
        description="How rank 0's weights reach the rollout actors: 'object_store' (ray.put, a "
        "board actor names the newest version; bench/weights.py --ray measured it 2.5-6x faster "
        "into an actor) or 'network' (rank 0 serves the gRPC weight channel, full copies and "
        "deltas, on weight_host).",
    )
    weight_host: str = Field(
        "127.0.0.1",
        description="With weight_channel 'network': the interface trainer rank 0 serves weights on; the rollout actors "
        "fetch from it. On a multi-node cluster: the node's private address (the weight stream "
        "is unauthenticated without mutual TLS).",
    )


# [store] fields rollbook run sets itself: the ledger is RUN_DIR/rollbook.duckdb on a loopback port,
# the keys are the run's own (RUN_DIR/keys.json)
_RUN_OWNS = (
    "db",
    "host",
    "port",
    "worker_key",
    "trainer_key",
    "reader_key",
    "admin_key",
    "tls_cert",
    "tls_key",
    "tls_client_ca",
    "insecure",
)


class RunConfig(BaseModel):
    """Configuration of ``rollbook run``: the store, a rollout worker and the trainer on one machine."""

    model_config = ConfigDict(extra="forbid")

    run_dir: str = Field(
        "runs/quickstart",
        description="Run directory: rollbook.duckdb, checkpoints/, metrics.jsonl, "
        "config.json, keys.json (see the README). trainer.run_dir follows it.",
    )
    placement: Literal["colocated", "separated", "ray"] = Field(
        "colocated",
        description="colocated: rollout and training alternate in one process (eta = 0 is strictly on-policy). "
        "separated: a rollout worker process runs asynchronously, weights over shared memory, bounded staleness. "
        "ray: rollout workers and trainer ranks as Ray actors on any nodes, weights through Ray's object store "
        "(or the network channel: ray.weight_channel; [ray]).",
    )
    num_steps: int = Field(
        40, ge=1, description="Trainer steps in all (a resumed run trains up to this count). trainer.num_steps follows it."
    )
    max_staleness: int | None = Field(
        None,
        ge=0,
        description="eta, the staleness bound of both the trainer's pulls and the worker's gate "
        f"(trainer.max_staleness and rollout.max_staleness follow it). None: 0 colocated (on-policy), "
        f"{SEPARATED_MAX_STALENESS} separated and ray (asynchronous), {ONLINE_MAX_STALENESS} online; no bound with [replay] "
        "(its rows carry the source run's versions; setting it is refused).",
    )
    eval_every: int = Field(
        5, ge=1, description="Evaluate held-out reward every N steps (and before the first and after the last)."
    )
    device: str = Field(
        "auto",
        pattern=DEVICE_PATTERN,
        description="Device of every model the run holds (trainer.device and rollout.device follow it): auto "
        "(CUDA, then an Ascend NPU, then the CPU), cpu, cuda, cuda:N, npu, npu:N. Set trainer.device and "
        "rollout.device apart instead to put them on different devices.",
    )
    dtype: Dtype = Field(
        "float32",
        description="Precision of every model the run holds (trainer.dtype and rollout.dtype follow it): "
        "float32 or bfloat16 (the trained student keeps float32 master weights and optimizer state; exports "
        "and published weights are bfloat16).",
    )
    warm_start: WarmStartConfig = Field(default_factory=WarmStartConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    ray: RayConfig = Field(default_factory=RayConfig, description="The ray placement: cluster, actors, resources.")
    store: StoreConfig = Field(
        default_factory=StoreConfig,
        description="Store policies (validator, ingest, SQL and "
        "stream limits) of the store process the run starts; db, host, port, keys and TLS are the run's.",
    )
    tracker: TrackerConfig = Field(
        default_factory=TrackerConfig,
        description="Experiment trackers: TensorBoard and wandb, each off unless turned on (rollbook/tracking.py).",
    )
    gate: GateConfig = Field(
        default_factory=GateConfig,
        description="The promotion gate: versions reach rollout only once they pass (docs/gate.md); off by default.",
    )
    online: OnlineConfig | None = Field(
        None,
        description="Online mode: learn from an agent through rollbook proxy "
        "(docs/online.md); None = learn from the rollout worker.",
    )
    replay: ReplayConfig | None = Field(
        None,
        description="Train from a finished run's ledger instead of new rollouts (docs/replay.md, 'Train from "
        "the ledger'); None = learn from the rollout worker.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> "RunConfig":
        owned = sorted(
            f
            for f in set(_RUN_OWNS) & self.store.model_fields_set  # config.json repeats the defaults
            if getattr(self.store, f) != StoreConfig.model_fields[f].default
        )
        if owned:
            raise ValueError(
                f"store.{owned[0]} is set by rollbook run itself (ledger RUN_DIR/rollbook.duckdb on a "
                "loopback port, keys in RUN_DIR/keys.json); remove it from [store]"
            )
        self.run_dir = _one_value("run_dir", self, ("trainer", self.trainer, "run_dir"))
        self.num_steps = _one_value("num_steps", self, ("trainer", self.trainer, "num_steps"))
        eta = _one_value(
            "max_staleness", self, ("trainer", self.trainer, "max_staleness"), ("rollout", self.rollout, "max_staleness")
        )
        default_eta = (
            ONLINE_MAX_STALENESS if self.online is not None else 0 if self.placement == "colocated" else SEPARATED_MAX_STALENESS
        )
        if self.replay is not None:
            default_eta = _check_replay(self, eta)
        self.max_staleness = eta if eta is not None else default_eta
        self.trainer.run_dir, self.trainer.num_steps = self.run_dir, self.num_steps
        self.trainer.max_staleness = self.rollout.max_staleness = self.max_staleness
        _check_gate(self)
        for name in ("device", "dtype"):  # set at the top, both sides follow; else each side keeps its own
            if name in self.model_fields_set:
                value = _one_value(name, self, ("trainer", self.trainer, name), ("rollout", self.rollout, name))
                for model in (self, self.trainer, self.rollout):
                    setattr(model, name, value)
        if self.placement == "ray" and self.ray.colocate and self.ray.num_workers != self.trainer.num_ranks:
            raise ValueError(
                f"ray.colocate pairs each rollout actor with a trainer rank: ray.num_workers ({self.ray.num_workers}) "
                f"must equal trainer.num_ranks ({self.trainer.num_ranks})"
            )
        if self.online is not None and self.rollout.engine != "native":
            raise ValueError(
                f"rollout.engine = {self.rollout.engine!r} applies to the rollout worker; the online mode generates "
                "in rollbook proxy on the native engine: remove rollout.engine"
            )
        if self.online is not None and self.online.game == "calculator":
            if not self.trainer.model.path:
                raise ValueError(
                    "online.game = 'calculator' offers the model a tool through its chat template: set trainer.model.path "
                    "to a Hugging Face model directory whose template renders tools (python examples/make_calculator_model.py)"
                )
            if self.rollout.domains != ["multiply"]:
                raise ValueError(
                    f"online.game = 'calculator' plays multiply problems: set rollout.domains = ['multiply'], not {self.rollout.domains}"
                )
        if self.trainer.num_ranks > 1 and self.placement != "ray":
            raise ValueError(
                f"trainer.num_ranks = {self.trainer.num_ranks} needs placement 'ray' (colocated and separated "
                "train in one process; `rollbook train --num_ranks N` runs ranks against any store)"
            )
        if self.trainer.loss.distill_coef > 0 and self.warm_start.teacher_steps == 0 and not self.trainer.teachers:
            raise ValueError(
                "MOPD (trainer.loss.distill_coef > 0) needs a teacher: set warm_start.teacher_steps > 0 "
                "or list [[trainer.teachers]]"
            )
        mix = self.warm_start.student_mix
        if mix:
            unknown = sorted(set(mix) - set(self.rollout.domains))
            if unknown:
                raise ValueError(f"warm_start.student_mix names {unknown}, not in rollout.domains {self.rollout.domains}")
            if any(w < 0 for w in mix.values()) or sum(mix.values()) <= 0:
                raise ValueError(f"warm_start.student_mix {mix}: weights must be >= 0 with a positive sum")
        if self.rollout.dataset is not None:  # the warm start knows only the toy tasks and their tokenizer
            ws = self.warm_start
            asked = [f for f in ("student_steps", "teacher_steps") if f in ws.model_fields_set and getattr(ws, f) > 0]
            if asked:
                raise ValueError(
                    f"warm_start.{asked[0]} = {getattr(ws, asked[0])}: the warm start trains on the toy tasks, "
                    "not on [rollout.dataset] rows; set it to 0 (start from trainer.model.path, or list "
                    "[[trainer.teachers]] for MOPD)"
                )
            ws.student_steps = 0  # its default is the toy tasks'
        return self


def _check_replay(config: RunConfig, eta: int | None) -> int:
    """The settings a ``[replay]`` run cannot take, refused; its reward version set once (the store's
    ``validator.reward_version`` follows ``replay.reward_version``). Returns its staleness bound: none
    (``REPLAY_MAX_STALENESS``), since the rows' versions are the source run's, not this trainer's."""
    replay = config.replay
    assert replay is not None
    if config.online is not None:
        raise ValueError("[replay] trains on stored rows and [online] on an agent's calls: a run takes one of them")
    if config.placement != "colocated":
        raise ValueError(
            f"placement = {config.placement!r}: a [replay] run trains in this process with an engine beside it for "
            "held-out evaluation, as colocated does; remove placement"
        )
    if eta is not None and eta != REPLAY_MAX_STALENESS:
        raise ValueError(
            f"max_staleness = {eta}: a [replay] run has no staleness bound (its rows carry the source run's policy "
            "versions, not this trainer's); remove it"
        )
    if config.trainer.loss.proximal == "loglinear":
        raise ValueError(
            "trainer.loss.proximal = 'loglinear' interpolates by policy versions, and a [replay] run's rows carry "
            "the source run's: use 'recompute' (the default) or 'behavior'"
        )
    validator = config.store.validator
    if "reward_version" in validator.model_fields_set and validator.reward_version != replay.reward_version:
        raise ValueError(
            f"store.validator.reward_version = {validator.reward_version!r} and replay.reward_version = "
            f"{replay.reward_version!r} disagree: set replay.reward_version (the store follows it)"
        )
    validator.reward_version = replay.reward_version
    return REPLAY_MAX_STALENESS


def _check_gate(config: RunConfig) -> None:
    """A promotion gate the run cannot keep: another placement, or a staleness bound the trainer would
    run past while rollout keeps the last promoted version (docs/gate.md)."""
    gate, eta = config.gate, config.max_staleness
    if not gate.enabled:
        return
    if config.online is not None or config.replay is not None or config.placement == "ray":
        mode = "[online]" if config.online is not None else "[replay]" if config.replay is not None else "placement 'ray'"
        raise ValueError(f"gate.enabled: the promotion gate runs in the colocated and separated placements, not with {mode}")
    assert eta is not None  # resolved above
    if gate.every - 1 > eta:
        raise ValueError(
            f"gate.every = {gate.every}: the trainer trains up to {gate.every - 1} versions past the last promoted one, "
            f"on rows that old, and max_staleness is {eta}: set max_staleness >= {gate.every - 1} or a smaller gate.every"
        )
    if gate.on_refuse == "continue" and 2 * gate.every - 1 > eta:
        raise ValueError(
            f"gate.on_refuse = 'continue': after a refusal the trainer trains up to {2 * gate.every - 1} versions past "
            f"the version rollout keeps, and max_staleness is {eta}: set max_staleness >= {2 * gate.every - 1}, "
            "or gate.on_refuse = 'rollback'"
        )


def _one_value(name: str, top: BaseModel, *copies: tuple[str, BaseModel, str]) -> Any:
    """The value of the top-level field ``name`` or of the explicitly set copies of it; two
    explicitly set values that differ are an error. None when none is set and the top has no default."""
    given = {name: getattr(top, name)} if name in top.model_fields_set else {}
    given.update(
        {f"{prefix}.{field}": getattr(model, field) for prefix, model, field in copies if field in model.model_fields_set}
    )
    if len(set(given.values())) > 1:
        spelled = ", ".join(f"{k} = {v!r}" for k, v in given.items())
        raise ValueError(f"{spelled} disagree: set {name} once (the others follow it)")
    return next(iter(given.values())) if given else getattr(top, name)
