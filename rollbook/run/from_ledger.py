"""``rollbook run`` with ``[replay]``: train a new policy from a finished run's ledger, generating
nothing (docs/replay.md, "Train from the ledger").

    rollbook run --config configs/quickstart.toml --run_dir runs/offline --replay.ledger runs/quickstart/rollbook.duckdb

**A run like the others, fed from the ledger.** Before the run's store starts (``prepare_ledger``,
called by rollbook/run/main.py), its new ledger RUN_DIR/rollbook.duckdb is made and seeded with the
stored groups ``replay.where`` selects in the source, ``replay.epochs`` times (``rollbook.store.seed``).
Then the run goes on as every run does: the store child opens that ledger, the trainer pulls, leases,
normalizes (by the run's own ``[store.validator]``), trains and acks the rows, checkpoints, publishes
versions, reports train steps; so the new run has its own lineage (leases, train_steps,
policy_versions), its own metrics.jsonl and report, and resumes from its checkpoint when killed. The
model, loss, coefficients and learning rate are the run config's: the source run's need not be.

**The source is only read.** It is copied the way ``rollbook query --db`` copies a stopped store's
file (the log's acknowledged batches folded into the copy, the source's lock taken read-only while
copying, so a file a running store holds is refused); the selection runs in the store's SQL sandbox
over that copy, by the function ``rollbook replay reward`` selects with (``check_predicate``,
``select_ids``); the copy is deleted once the new ledger is made.

**What the pull does with stored rows.** Their behavior log-probs are those the source's engine
recorded, so decoupled PPO's importance weight ``pi_proximal / pi_behavior`` (capped) corrects for
the distance between the new student and the policy that sampled them. Their ``output_versions`` are
the source run's and are kept for the record; they say nothing about the new trainer's versions, so
the run has no staleness bound (``REPLAY_MAX_STALENESS``) and refuses ``loss.proximal =
'loglinear'``, which interpolates by versions. With ``replay.reward_version`` the version's scores
are copied with the rows and the store serves them (``validator.reward_version``).

**Held-out evaluation** is the colocated placement's: an engine of ``rollout.engine`` in this process
takes every version the trainer publishes (``EngineHandoff``), and ``RolloutWorker.evaluate`` scores
the run's held-out problems on it, so a replay run's ``eval/`` rows compare with those of a
colocated source run of the same ``[rollout]`` section.

**When the rows run out** (every seeded row trained before ``num_steps``), the run stops with one
line, as a run whose dataset epochs are done does, after one last held-out evaluation when the
stopping step was not an evaluation step.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import time
from typing import TYPE_CHECKING, Any

from rollbook.errors import CommandError, ConfigError
from rollbook.trainer.drive import Placement

if TYPE_CHECKING:  # pragma: no cover
    from rollbook.config import RunConfig
    from rollbook.store.seed import SeedResult

MANIFEST = "replay.json"  # beside the seeded ledger: where its rows came from, and how many
SEED_DIR = "replay-seed"  # the source's private copy and the ledger being made; gone once it is made
# what a restart must find unchanged in RUN_DIR/replay.json to train on the ledger seeded before
IDENTITY = ("ledger", "where", "reward_version", "epochs", "model_id")


def prepare_ledger(config: RunConfig, vocab_size: int) -> dict[str, Any]:
    """Seed RUN_DIR/rollbook.duckdb from ``config.replay`` before the run's store opens it, or, when the
    run directory already holds a ledger seeded from the same selection (a restart), keep it. Returns
    the manifest (RUN_DIR/replay.json). A seeded row holding a token id the student cannot read
    (``vocab_size`` and above) is refused before anything is written."""
    from rollbook.cli.replay import check_predicate

    replay = config.replay
    assert replay is not None
    run_dir = pathlib.Path(config.run_dir)
    db, manifest_path = run_dir / "rollbook.duckdb", run_dir / MANIFEST
    source = pathlib.Path(replay.ledger).absolute()
    wanted = identity(config)
    if db.exists():
        return _seeded_before(db, manifest_path, wanted)
    sql = check_predicate(replay.where)  # a predicate that is not one condition: refused before any work
    if not source.is_file():
        raise ConfigError(f"replay.ledger: no such ledger file {source}")
    if source.resolve() == db.resolve():
        raise ConfigError(f"replay.ledger is this run's own ledger {db}: give the new run another run_dir")
    workdir = run_dir / SEED_DIR  # a killed seeding's is cleared
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    try:
        result = _seed(config, source, sql, workdir)
        _check_seeded(result, vocab_size, source, replay.where)
        manifest = {**wanted, "seeded_at": time.time()}
        from rollbook.store.seed import manifest_text

        (workdir / MANIFEST).write_text(manifest_text(result, **manifest))
        os.replace(workdir / MANIFEST, manifest_path)  # first: a ledger found later always has its manifest
        os.replace(workdir / "rollbook.duckdb", db)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(describe(json.loads(manifest_path.read_text())), flush=True)
    return json.loads(manifest_path.read_text())


def identity(config: RunConfig) -> dict[str, Any]:
    """What the seeded ledger was made from: the source file (absolute), the predicate, the reward
    version, the epochs and the model id the rows were given."""
    replay = config.replay
    assert replay is not None
    return {
        "ledger": str(pathlib.Path(replay.ledger).absolute()),
        "where": replay.where,
        "reward_version": replay.reward_version,
        "epochs": replay.epochs,
        "model_id": config.trainer.model_id,
    }


def _seeded_before(db: pathlib.Path, manifest_path: pathlib.Path, wanted: dict[str, Any]) -> dict[str, Any]:
    """A restart: the run directory's ledger must have been seeded from this same selection."""
    if not manifest_path.exists():
        raise CommandError(
            f"{db} exists and was not seeded from a ledger (no {manifest_path.name} beside it): give the replay run a new run_dir"
        )
    manifest = json.loads(manifest_path.read_text())
    differs = [f"{key} {manifest.get(key)!r} (now {wanted[key]!r})" for key in IDENTITY if manifest.get(key) != wanted[key]]
    if differs:
        raise ConfigError(
            f"{db} was seeded from another selection: " + "; ".join(differs) + ": run it with the same [replay] "
            "settings to resume it, or give the new selection a new run_dir"
        )
    print(f"replay: resuming on {db}, seeded before ({manifest['seeded']['total_rows']} rows)", flush=True)
    return manifest


def _seed(config: RunConfig, source: pathlib.Path, sql: str, workdir: pathlib.Path) -> SeedResult:
    """Copy the source privately, select in the sandbox, seed ``workdir``/rollbook.duckdb."""
    import duckdb

    from rollbook.cli.query import private_copy
    from rollbook.cli.replay import select_ids
    from rollbook.store import seed
    from rollbook.store.ledger import Ledger

    replay = config.replay
    assert replay is not None
    copy = workdir / "source.duckdb"
    try:
        private_copy(source, copy)
    except duckdb.IOException as exc:
        raise CommandError(
            f"replay.ledger {source} cannot be read ({str(exc).splitlines()[0]}); if a store holds it, stop it first"
        ) from None
    ledger = Ledger(copy)  # the copy's, as a store opens it: the sandbox's snapshots come from it
    try:
        selected = select_ids(ledger, sql, workdir)
        dest = seed.create_ledger(workdir / "rollbook.duckdb")
        cur = ledger.cursor()
        try:
            return seed.seed(
                cur,
                dest,
                selected,
                model_id=config.trainer.model_id,
                epochs=replay.epochs,
                reward_version=replay.reward_version,
                now=time.time(),
            )
        except seed.SeedError as exc:
            raise ConfigError(f"replay: {exc}") from None
        finally:
            cur.close()
            dest.execute("CHECKPOINT")
            dest.close()
    finally:
        ledger.close()


def _check_seeded(result: SeedResult, vocab_size: int, source: pathlib.Path, where: str) -> None:
    if result.rows == 0:
        left = result.left_out()
        raise ConfigError(
            f"replay: the condition {where!r} selects {result.selected} rows of {source} and no whole rewarded group"
            + (f" ({left})" if left else "")
        )
    if result.max_token_id >= vocab_size:
        raise ConfigError(
            f"replay: the selected rows hold token id {result.max_token_id} and the student reads {vocab_size} ids: "
            "train a student of the source run's vocabulary (trainer.model)"
        )


def describe(manifest: dict[str, Any]) -> str:
    """The seeding in a few lines, for the console."""
    seeded = manifest["seeded"]
    lines = [
        f"replay: seeded {seeded['groups']} groups, {seeded['rows']} rows x {seeded['epochs']} epoch(s) = "
        f"{seeded['total_rows']} rows from {manifest['ledger']} (where {manifest['where']}"
        + (f", reward version {manifest['reward_version']!r}" if manifest["reward_version"] else "")
        + ")"
    ]
    domains = ", ".join(f"{d} {n}" for d, n in seeded["domains"].items())
    if domains:
        lines.append(f"replay: rows per epoch by domain: {domains}")
    from rollbook.store.seed import SeedResult

    left = SeedResult(**{k: v for k, v in seeded.items() if k != "total_rows"}).left_out()
    if left:
        lines.append(f"replay: left out: {left}")
    return "\n".join(lines)


def run_from_ledger(config: RunConfig, client) -> dict:
    """Train on the seeded ledger (the module's docstring) to ``num_steps`` or until its rows are all
    trained; returns the held-out evaluations before the first and after the last step."""
    from rollbook.rollout.engines import build_engine, close_engine
    from rollbook.rollout.worker import RolloutWorker
    from rollbook.run.driving import EngineHandoff
    from rollbook.trainer.loop import Trainer
    from rollbook.trainer.model_builders import build_models

    manifest = json.loads((pathlib.Path(config.run_dir) / MANIFEST).read_text())
    student, teacher = build_models(config)
    engine = build_engine(config.trainer.model, config.rollout, version=0, weights=student)
    try:
        with RolloutWorker(engine, config.rollout, model_id=config.trainer.model_id) as judge:
            trainer = Trainer(config.trainer, client, model=student, teacher=teacher, publishers=[EngineHandoff(engine)])
            trainer.start()
            return drive_replay(config, trainer, FromLedger(judge, client, manifest["seeded"]["total_rows"]))
    finally:
        close_engine(engine)  # its scheduler thread ends with the run, not at interpreter exit


class FromLedger(Placement):
    """A run with no producer: the rows were seeded before the store started. Held-out reward on the
    in-process engine that takes every published version; the run stops once no seeded row is left
    to serve."""

    def __init__(self, judge, client, total_rows: int):
        self.judge, self.client, self.total_rows = judge, client, total_rows

    def evaluate(self) -> dict:
        return self.judge.evaluate()

    def waiting(self) -> str | None:
        left = self.client.query("SELECT count(*) AS n FROM trajectories WHERE status IN ('pending', 'ready')")
        if int(left.column("n")[0].as_py()) == 0:
            return f"the ledger's {self.total_rows} seeded rows are trained"
        return None


def drive_replay(config: RunConfig, trainer, placement: FromLedger) -> dict:
    """``drive_run``'s loop (metrics.jsonl, the console lines), then, when the rows ran out before
    ``num_steps`` between evaluations, one more held-out evaluation of the last version (its row in
    metrics.jsonl carries the last step's ``step``, as an evaluation of that step would)."""
    from rollbook.run.driving import drive_run, say
    from rollbook.trainer.drive import heldout_text

    def finish(outcome, metrics) -> None:
        done = trainer.state.step
        if outcome.stopped is not None and done > 0 and outcome.last.get("step") != done - 1:
            evaluation = placement.evaluate()
            if evaluation:
                outcome.last = {"step": done - 1, **evaluation}
                metrics.write(outcome.last)
                say(f"held-out reward after step {done - 1}: {heldout_text(outcome.last)}")

    return drive_run(config, trainer, placement, finish)
