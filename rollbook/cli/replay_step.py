"""``rollbook replay step N``: rerun trainer step N from the ledger and the checkpoint before it, and
compare the result, bit for bit, with what the run recorded (docs/replay.md, "Step replay").

    result = replay_step(pathlib.Path("runs/exp1"), 42)
    print(result.table())           # recorded, replayed, |difference|, bitwise equal
    sys.exit(0 if result.equal else 1)

Why it can be exact: a trainer step (trainer/loop.py ``Trainer.step``) is a function of the weights
and AdamW state before it, the rows its lease served in the order served, the advantages served
with them, the run's config (model builder, teachers, KL reference, loss, learning-rate schedule,
minibatches, micro-batches, dtype) and, on CPU, the number of PyTorch intra-op threads that summed
its floats. The ledger keeps the rows with their behaviour log-probs, and per lease row the position
and advantage served (``leases.position``, ``leases.advantage``); ``train_steps`` names the step's
lease and records its statistics and threads (``perf/torch_threads``); ``checkpoints/step-N`` holds
the weights, the optimizer and the RNG states before step N (``trainer/checkpoint.py``); the minibatch
order is drawn from (seed, step) alone (``minibatch_order``). So the step runs again here through the
trainer's own ``Trainer.update`` (no second update path) and must give the same loss, gradient norm
and parameters, the float32 bits of each.

**Where each input comes from.** The lease is the one ``train_steps`` names for step N: a trainer
that crashed after reporting a step and before its checkpoint ran that step again on another lease
and rewrote the row, and the first lease's rows went to a later step once it expired; those rows'
``trajectories.reward`` is then the later lease's, which is why the advantage is read from the
lease row. The ledger is opened read-only (its store stopped; a file a running store holds is
refused), rows moved into the archive included. The model, its teachers and its reference are built
from the run's ``config.json`` as the run built them (``build_models``, or ``rollbook train``'s
builders for a trainer's own run directory), on the CPU.

**What is compared.** ``loss/total``, ``grad/norm`` and ``optim/lr`` with ``train_steps.stats``; every
parameter and the AdamW state with ``checkpoints/step-N+1`` when it exists, else the parameters (in
the run's dtype, ``state_checksum``) with the checksum ``policy_versions`` holds for the version the
step made, when the trainer published one (a colocated run hands its weights over in the process and
records none). Equal means the same bits (NaN included), never "close".
"""

from __future__ import annotations

import json
import math
import pathlib
import struct
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from rollbook.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    import duckdb
    import pyarrow as pa
    import torch

    from rollbook.config import RunConfig, TrainerConfig
    from rollbook.trainer.loop import Trainer
    from rollbook.trainer.teachers import TeacherScorer

KEEP_EVERY_STEP = "`trainer.checkpoint_every = 1` with a large `trainer.keep_last` keeps every step replayable"
SCALARS = ("loss/total", "grad/norm", "optim/lr")  # train_steps.stats values compared with the replayed step's


@dataclass
class Compared:
    """One compared quantity: what the run recorded, what the replay gave, ``|difference|`` (the largest
    over a tensor's elements; None where it has no number, a checksum) and whether the bits are equal."""

    name: str
    recorded: float | str | None
    replayed: float | str | None
    difference: float | None
    equal: bool


@dataclass
class StepReplay:
    """The outcome of one replayed step."""

    run_dir: str
    db: str
    step: int
    lease_id: str
    rows: int
    tokens: int
    torch_threads: int
    checkpoint_before: str
    checkpoint_after: str | None
    compared: list[Compared] = field(default_factory=list)
    first_difference: dict[str, Any] | None = None  # {"name", "max_abs_diff"} of the first parameter that differs
    notes: list[str] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        return all(c.equal for c in self.compared)

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "equal": self.equal}

    def table(self) -> str:
        """The human report: a header, one line per compared quantity, the verdict, the notes."""
        head = ("quantity", "recorded", "replayed", "|difference|", "bitwise equal")
        lines = [head] + [
            (c.name, _shown(c.recorded), _shown(c.replayed), _shown(c.difference), "yes" if c.equal else "NO")
            for c in self.compared
        ]
        widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
        out = [
            f"step {self.step} of {self.run_dir}: lease {self.lease_id}, {self.rows} rows, {self.tokens} output tokens, "
            f"from {self.checkpoint_before}, {self.torch_threads} torch threads"
        ]
        out += ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines]
        if self.equal:
            out.append(f"bitwise equal: the ledger and {self.checkpoint_before} reproduce step {self.step}")
        else:
            differs = ", ".join(c.name for c in self.compared if not c.equal)
            out.append(f"DIFFERS: {differs}")
            if self.first_difference is not None:
                out.append(
                    f"first differing parameter: {self.first_difference['name']} "
                    f"(max |difference| {self.first_difference['max_abs_diff']:.6g})"
                )
        out += [f"note: {n}" for n in self.notes]
        return "\n".join(out)


def replay_step(run_dir: pathlib.Path, step: int, db: pathlib.Path | None = None) -> StepReplay:
    """Rerun ``step`` of the run in ``run_dir`` (ledger ``db``, default ``run_dir/rollbook.duckdb``) and
    compare it with what the run recorded. Everything that makes the step not replayable as asked (no
    such step, no checkpoint before it, a ledger a store holds, a lease without recorded positions, a
    step of several ranks) is a ``ConfigError`` naming what is replayable; the step is then not run."""
    db = db or run_dir / "rollbook.duckdb"
    config, trainer_config = load_run(run_dir)
    starts = sorted({0, *kept_checkpoints(run_dir)})  # step 0 starts from the run's initial model
    recorded, table = read_step(db, trainer_config.trainer_id, step, starts)  # refusals come before torch loads
    import torch

    from rollbook.trainer.loop import _Rows

    stats = json.loads(recorded["stats"]) if recorded["stats"] else {}
    notes = _match_process(step, stats)
    trainer, before = trainer_before(config, trainer_config, run_dir, step)
    replayed = trainer.update(_Rows.from_table(table))
    result = StepReplay(
        run_dir=str(run_dir),
        db=str(db),
        step=step,
        lease_id=recorded["lease_id"],
        rows=table.num_rows,
        tokens=sum(len(o) for o in table.column("output_token_ids").to_pylist()),
        torch_threads=torch.get_num_threads(),
        checkpoint_before=before,
        checkpoint_after=None,
        compared=[compare_scalar(name, stats.get(name), replayed.get(name)) for name in SCALARS],
        notes=notes,
    )
    _compare_weights(result, trainer, run_dir, db, trainer_config.model_id, int(recorded["version"]))
    return result


def _match_process(step: int, stats: dict[str, Any]) -> list[str]:
    """Make this process sum floats as the step's did (its torch threads); refuse a step of several
    ranks. Returns what the report should note."""
    import torch

    if int(stats.get("dist/world_size", 1)) > 1:
        raise ConfigError(
            f"step {step} was trained on {stats['dist/world_size']} ranks; a replay runs one rank, whose float sums "
            "differ from the ranks' all-reduce"
        )
    notes = []
    threads = stats.get("perf/torch_threads")
    if threads is None:
        notes.append(f"step {step} did not record its torch threads; replayed with {torch.get_num_threads()}")
    else:
        torch.set_num_threads(int(threads))
    if "perf/peak_device_mib" in stats:  # recorded on CUDA only
        notes.append("the step ran on a CUDA device; the replay runs on the CPU, so only a CPU step is bitwise equal")
    return notes


def trainer_before(
    config: RunConfig | None, trainer_config: TrainerConfig, run_dir: pathlib.Path, step: int
) -> tuple[Trainer, str]:
    """The run's trainer as it stood before ``step``: ``checkpoints/step-<step>`` restored into it
    (weights, AdamW state, RNG states, training mode, step and version), or for step 0 without such a
    checkpoint the run's first state, as ``Trainer.start`` makes it (the built model, a fresh AdamW,
    torch seeded with the trainer's seed). Returns it with where that state came from."""
    import torch

    from rollbook.trainer.checkpoint import TrainerState, load_checkpoint

    trainer = build_trainer(config, trainer_config)
    state = load_checkpoint(run_dir, trainer.model, trainer.optimizer, step=step)
    if state is None:
        assert step == 0  # read_step refused any other step without its checkpoint
        torch.manual_seed(trainer_config.seed)
        trainer.state = TrainerState()
        return trainer, "the initial model (built as the run built it, a fresh AdamW)"
    trainer.state = state  # the step (learning rate, minibatch order) and the version (loglinear proximal)
    return trainer, f"checkpoint step-{step:06d}"


def _compare_weights(
    result: StepReplay, trainer: Trainer, run_dir: pathlib.Path, db: pathlib.Path, model_id: str, version: int
) -> None:
    """Every parameter and the AdamW state against ``checkpoints/step-<step + 1>``; without it the
    parameters' checksum against the one published for ``version``; without that a note."""
    from rollbook.trainer.checkpoint import read_checkpoint
    from rollbook.trainer.loop import state_checksum

    step = result.step
    after = read_checkpoint(run_dir, step + 1)
    if after is not None:
        result.checkpoint_after = f"checkpoint step-{step + 1:06d}"
        tensors, result.first_difference = compare_tensors(after[0]["model"], trainer.model.state_dict())
        result.compared.append(_tensors_row(f"parameters vs {result.checkpoint_after}", tensors))
        optimizer, _ = compare_tensors(
            _optimizer_tensors(after[0]["optimizer"]), _optimizer_tensors(trainer.optimizer.state_dict())
        )
        result.compared.append(_tensors_row(f"AdamW state vs {result.checkpoint_after}", optimizer))
        return
    checksum = published_checksum(db, model_id, version)
    if checksum:
        mine = state_checksum(trainer._published_state(trainer.model))
        result.compared.append(Compared(f"published checksum of version {version}", checksum, mine, None, mine == checksum))
        return
    result.notes.append(
        f"no checkpoint after step {step} (step-{step + 1:06d}) and no published checksum of version {version}: "
        f"the parameters were not compared ({KEEP_EVERY_STEP})"
    )


def kept_checkpoints(run_dir: pathlib.Path) -> list[int]:
    """The steps of the checkpoints ``run_dir`` keeps (``checkpoints/step-NNNNNN/``, trainer/checkpoint.py:
    its ``trainer.json`` ``step`` is the steps done, and ``state.pt`` is there), ascending; read without
    torch, so a refusal is quick."""
    steps = []
    for path in (run_dir / "checkpoints").glob("step-*"):
        meta = path / "trainer.json"
        if meta.is_file() and (path / "state.pt").is_file():
            steps.append(int(json.loads(meta.read_text())["step"]))
    return sorted(steps)


# ---- the run's config and its trainer -------------------------------------------------------------------


def load_run(run_dir: pathlib.Path) -> tuple[RunConfig | None, TrainerConfig]:
    """The config the run wrote into ``run_dir/config.json``: a ``rollbook run``'s (``RunConfig``, and its
    trainer's) or a ``rollbook train``'s (``TrainerConfig`` alone), pointed at ``run_dir`` (the run may
    have been moved since) and at the CPU."""
    from rollbook.config import RunConfig, TrainerConfig

    path = run_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"no run config {path}: --run names the run directory `rollbook run` or `rollbook train` wrote")
    try:
        raw = json.loads(path.read_text())
        if "trainer" in raw:
            config: RunConfig | None = RunConfig.model_validate(raw)
            assert config is not None
            trainer_config = config.trainer
            config.run_dir = str(run_dir)
        else:
            config, trainer_config = None, TrainerConfig.model_validate(raw)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{path} is not a run config: {' '.join(str(exc).split())}") from None
    trainer_config.run_dir = str(run_dir)
    trainer_config.device = "cpu"
    return config, trainer_config


def build_trainer(config: RunConfig | None, trainer_config: TrainerConfig) -> Trainer:
    """The run's trainer without a store: the student, teachers and KL reference built as the run built
    them (its warm-start caches in the run directory are read, as a resumed run reads them)."""
    from rollbook.trainer.loop import Trainer

    student, teacher = _models(config, trainer_config)
    return Trainer(trainer_config, None, model=student, teacher=teacher)


def _models(config: RunConfig | None, trainer_config: TrainerConfig) -> tuple[torch.nn.Module, TeacherScorer | None]:
    if config is not None:
        from rollbook.rollout.worker import registered_vocab_size, use_model_tokenizer
        from rollbook.trainer.model_builders import build_models

        model = config.trainer.model  # sized as `rollbook run` sized it after writing config.json
        use_model_tokenizer(config.rollout, model)
        if config.rollout.dataset is not None and model.path is None and model.vocab_size is None:
            model.vocab_size = registered_vocab_size(config.rollout, model)  # a tiny model takes its tokenizer's size
        return build_models(config)
    from rollbook.language_models import build_student
    from rollbook.trainer.main import size_for_tokenizer
    from rollbook.trainer.model_builders import build_teachers

    size_for_tokenizer(trainer_config)
    return build_student(trainer_config.model), build_teachers(trainer_config)


# ---- the ledger ---------------------------------------------------------------------------------------------


def read_step(db: pathlib.Path, trainer_id: str, step: int, starts: list[int]) -> tuple[dict[str, Any], pa.Table]:
    """Step ``step``'s ``train_steps`` row and its lease's rows in the order served, as the trainer
    received them (the columns ``_Rows.from_table`` reads, ``advantage`` the float32 served), from the
    ledger opened read-only. Refused (``ConfigError``) when the step is not recorded or has no
    state to start from (``starts``: the steps a kept checkpoint, or the initial model, precedes)."""
    con = _open_read_only(db)
    try:
        found = con.execute(
            "SELECT step, version, lease_id, stats FROM train_steps WHERE step = ? AND trainer_id = ?", [step, trainer_id]
        ).fetchone()
        recorded_steps = [
            int(s)
            for (s,) in con.execute("SELECT step FROM train_steps WHERE trainer_id = ? ORDER BY step", [trainer_id]).fetchall()
        ]
        replayable = [s for s in recorded_steps if s in set(starts)]
        if found is None:
            raise ConfigError(
                f"no step {step} in train_steps of trainer {trainer_id!r} in {db} ({_steps(recorded_steps)} recorded; "
                f"replayable: {_steps(replayable)})"
            )
        if step not in starts:
            raise ConfigError(
                f"no checkpoint holds the state before step {step} (checkpoints/step-{step:06d}): replayable steps are "
                f"{_steps(replayable)}; {KEEP_EVERY_STEP}"
            )
        recorded = dict(zip(("step", "version", "lease_id", "stats"), found))
        return recorded, _lease_rows(con, db, recorded["lease_id"], step)
    finally:
        con.close()


def _open_read_only(db: pathlib.Path) -> duckdb.DuckDBPyConnection:
    """The ledger read-only, rows moved into the archive read through the same table names; a file a
    running store holds is refused."""
    import duckdb

    from rollbook.store.archive import connect_snapshot

    if not db.is_file():
        raise ConfigError(f"no such ledger file {db} (--db names it; default RUN_DIR/rollbook.duckdb)")
    try:
        return connect_snapshot(db)
    except duckdb.IOException as exc:
        if "lock" not in str(exc).lower():
            raise
        raise ConfigError(f"ledger {db} is held by a running store; stop it and replay again (the file is only read)") from None


def _lease_rows(con: duckdb.DuckDBPyConnection, db: pathlib.Path, lease_id: str, step: int) -> pa.Table:
    import numpy as np
    import pyarrow as pa

    columns = {c for (c,) in con.execute("SELECT column_name FROM (DESCRIBE leases)").fetchall()}
    if not {"position", "advantage"} <= columns:
        raise ConfigError(f"{db} records no row positions in leases (a ledger made before them): step {step} cannot be replayed")
    table = con.sql(
        """SELECT l.trajectory_id AS leased, l.position, l.advantage, t.trajectory_id, t.domain, t.prompt_token_ids,
                  t.output_token_ids, t.output_logprobs, t.output_versions, t.temperature
           FROM leases l LEFT JOIN trajectories t USING (trajectory_id)
           WHERE l.lease_id = $lease ORDER BY l.position, l.trajectory_id""",
        params={"lease": lease_id},
    ).to_arrow_table()
    if table.num_rows == 0:
        raise ConfigError(f"lease {lease_id} of step {step} has no rows in {db}")
    positions = table.column("position").to_pylist()
    if None in positions or table.column("advantage").null_count:
        raise ConfigError(f"lease {lease_id} of step {step} was made before leases recorded row positions: its order is unknown")
    if positions != list(range(table.num_rows)):
        raise ConfigError(f"lease {lease_id} of step {step} has positions {positions[:8]}..., not 0..{table.num_rows - 1}")
    missing = [
        lid for lid, tid in zip(table.column("leased").to_pylist(), table.column("trajectory_id").to_pylist()) if tid is None
    ]
    if missing:
        raise ConfigError(f"{len(missing)} rows of lease {lease_id} (step {step}) are no longer in {db}, e.g. {missing[0]}")
    advantage = np.asarray(table.column("advantage").to_numpy(zero_copy_only=False), dtype=np.float32)
    return table.drop_columns(["leased", "position", "advantage"]).append_column("advantage", pa.array(advantage, pa.float32()))


def published_checksum(db: pathlib.Path, model_id: str, version: int) -> str:
    """The checksum ``policy_versions`` records for ``version`` of ``model_id`` ('' when none)."""
    con = _open_read_only(db)
    try:
        row = con.execute(
            "SELECT checksum FROM policy_versions WHERE model_id = ? AND version = ?", [model_id, version]
        ).fetchone()
    finally:
        con.close()
    return str(row[0] or "") if row else ""


# ---- comparing -------------------------------------------------------------------------------------------


def same_bits(a: float, b: float) -> bool:
    """Whether two floats are the same float64 bits (a NaN equals the same NaN; 0.0 is not -0.0)."""
    return struct.pack("<d", a) == struct.pack("<d", b)


def compare_scalar(name: str, recorded: Any, replayed: Any) -> Compared:
    if recorded is None or replayed is None:
        return Compared(name, recorded, replayed, None, recorded is None and replayed is None)
    a, b = float(recorded), float(replayed)
    difference = abs(a - b) if math.isfinite(a) and math.isfinite(b) else None
    return Compared(name, a, b, difference, same_bits(a, b))


@dataclass
class TensorsCompared:
    """Named tensors against recorded ones: how many, how many differ (a name on one side only, another
    shape or dtype, or other bits), the largest ``|difference|``, and the first name that differs."""

    total: int
    differing: int
    max_abs_diff: float
    first: str | None


def compare_tensors(
    recorded: dict[str, torch.Tensor], replayed: dict[str, torch.Tensor]
) -> tuple[TensorsCompared, dict[str, Any] | None]:
    """Compare bit for bit, in ``recorded``'s order; the second value is ``{"name", "max_abs_diff"}`` of the
    first tensor that differs (None when none does)."""
    differing, worst = 0, 0.0
    first: dict[str, Any] | None = None
    names = list(recorded) + [n for n in replayed if n not in recorded]
    for name in names:
        a, b = recorded.get(name), replayed.get(name)
        diff = _tensor_difference(a, b)
        if diff is None:
            continue
        differing += 1
        worst = max(worst, diff)
        if first is None:
            first = {"name": name, "max_abs_diff": diff}
    return TensorsCompared(len(names), differing, worst, first["name"] if first else None), first


def _tensor_difference(a: torch.Tensor | None, b: torch.Tensor | None) -> float | None:
    """None when ``a`` and ``b`` hold the same bits; else their largest ``|difference|`` (inf for a
    tensor on one side only or of another shape or dtype)."""
    import torch

    if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
        return math.inf
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    if torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
        return None
    if not (a.is_floating_point() or a.is_complex()):
        return float((a.to(torch.float64) - b.to(torch.float64)).abs().max())
    return float((a.to(torch.float64) - b.to(torch.float64)).abs().nan_to_num(nan=math.inf).max())


def _optimizer_tensors(state_dict: dict[str, Any]) -> dict[str, torch.Tensor]:
    """An optimizer's per-parameter state as named tensors (``3.exp_avg``), its hyperparameters as
    0-d tensors (``group0.lr``) so they are compared too."""
    import torch

    out: dict[str, torch.Tensor] = {}
    for index, values in state_dict.get("state", {}).items():
        for key, value in values.items():
            out[f"{index}.{key}"] = value if isinstance(value, torch.Tensor) else torch.tensor(value)
    for g, group in enumerate(state_dict.get("param_groups", [])):
        for key, value in group.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                out[f"group{g}.{key}"] = torch.tensor(float(value), dtype=torch.float64)
    return out


def _tensors_row(name: str, compared: TensorsCompared) -> Compared:
    return Compared(
        f"{name} ({compared.total} tensors)",
        "recorded",
        "replayed" if not compared.differing else f"{compared.differing} differ",
        compared.max_abs_diff,
        compared.differing == 0,
    )


def _shown(value: float | str | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return repr(value) if value != 0 else "0"


def _steps(steps: list[int]) -> str:
    """``0-3, 5, 7-9``, or "none"."""
    if not steps:
        return "none"
    runs: list[list[int]] = []
    for s in steps:
        if runs and s == runs[-1][-1] + 1:
            runs[-1].append(s)
        else:
            runs.append([s])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)
