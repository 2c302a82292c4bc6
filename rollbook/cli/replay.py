"""``rollbook replay reward``: score a stopped store's stored outputs again with another reward, into a
named reward version beside the rewards they were trained with (docs/replay.md). ``rollbook replay
step N --run RUN_DIR`` reruns trainer step N from the ledger and the checkpoint before it and
compares it bit for bit with what the run recorded (rollbook/cli/replay_step.py; docs/replay.md, "Step
replay").

    rollbook replay reward --db runs/exp1/rollbook.duckdb --reward math --name math-v2
    rollbook replay reward --db runs/exp1/rollbook.duckdb --reward mypkg.rewards:strict --name strict \\
        --where "domain = 'arithmetic' AND trajectory_id IN (SELECT trajectory_id FROM leases WHERE step < 100)"

**The file, not a running store.** Only the store writes its ledger. This command opens the file as
the store does (``Ledger``: its write-ahead log replayed, DuckDB's lock taken), so the store must be
stopped, as for ``rollbook store age``; a ledger a running store holds is refused in one line. It
writes only its own two tables (``rollbook.store.reward_versions``), never a row of the others:
``original_reward``, the served ``reward`` and every lease stay as they were.

**The selection** is ``SELECT trajectory_id FROM trajectories WHERE (<--where>)``, checked to be
exactly that (the predicate cannot close the WHERE and add a UNION, a LIMIT, ...) and run by the
store's SQL sandbox (``rollbook.store.sandbox``: a limited process over a snapshot copy of the file,
the statement fence, no file access), so a predicate reads only the ledger's tables, as a query
would, and writes nothing.

**Scoring** (``rollbook.rescore``): the run's tokenizer decodes each output up to its stop, the
run's toy task or dataset row gives the reference, and the reward runs in the rollout's
``RewardPool`` (processes, the code sandbox) in chunks. Scores are committed every ``--batch-rows``
rows in one transaction; a start skips what is scored already, so a command killed at any point and
run again goes on where it stopped and the table holds every selected row once. Progress goes to
stderr: rows done of the selection, rate, errors.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pathlib
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any

from rollbook.errors import CommandError, ConfigError

if TYPE_CHECKING:  # pragma: no cover
    import duckdb
    import pyarrow as pa

    from rollbook.rescore import RowSource, Scorer
    from rollbook.store.ledger import Ledger
    from rollbook.store.reward_versions import VersionSpec
    from rollbook.tokenizers import Tokenizer

SELECTION = "SELECT trajectory_id FROM trajectories WHERE (\n{predicate}\n)"
SELECTION_TIMEOUT_S = 600.0  # the sandbox's bound on the --where query
READ_COLUMNS = "t.trajectory_id, t.task_id, t.domain, t.prompt_token_ids, t.output_token_ids"


def add_parser(sub: argparse._SubParsersAction) -> None:
    """``rollbook replay reward`` and ``rollbook replay step`` (``rollbook/cli/main.py`` calls this)."""
    p = sub.add_parser(
        "replay",
        help="re-score stored outputs (a named reward version), or rerun a trainer step bit for bit",
        description="Replay from the ledger: re-score its stored outputs with another reward into a named reward "
        "version (reward_versions, reward_version_runs), leaving every existing row as it is (replay reward), or "
        "rerun one trainer step from its lease and the checkpoint before it and compare it bit for bit with what "
        "the run recorded (replay step). docs/replay.md.",
    )
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    a = actions.add_parser(
        "reward",
        help="re-score the selected trajectories with a reward into reward version NAME",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Decode each selected trajectory's stored output with the run's tokenizer, score it with REWARD\n"
        "against the run's task or dataset row, and write the scores as reward version NAME: one row per\n"
        "trajectory in reward_versions (name, trajectory_id, reward, status, error, info, scored_at) and\n"
        "the version's row in reward_version_runs (reward, settings, predicate, counts). original_reward\n"
        "and every other row stay as they were.\n\n"
        "The store must be stopped: only it writes its ledger, and a ledger it holds is refused.\n"
        "Resumable: after a kill, the same command scores only what is missing, each row once.\n"
        "A verifier that raises, times out or kills its process is recorded for its row as\n"
        "status 'error' with the reason, never as 0.0. Progress goes to stderr. docs/replay.md.",
        epilog="examples:\n"
        "  rollbook replay reward --db runs/exp1/rollbook.duckdb --reward math --name math-v2\n"
        "  rollbook replay reward --db runs/exp1/rollbook.duckdb --reward run --name same-again\n"
        "  rollbook replay reward --db runs/exp1/rollbook.duckdb --reward regex --reward-option 'pattern=answer: (\\d+)' \\\n"
        "      --name regex-answer --where \"domain = 'math' AND status = 'trained'\"\n"
        "  rollbook query --db runs/exp1/rollbook.duckdb \\\n"
        '      "SELECT t.domain, avg(t.original_reward), avg(v.reward) FROM trajectories t\n'
        "       JOIN reward_versions v USING (trajectory_id) WHERE v.name = 'math-v2' GROUP BY ALL\"",
    )
    a.add_argument("--db", required=True, metavar="PATH", help="the ledger, e.g. RUN_DIR/rollbook.duckdb (its store stopped)")
    a.add_argument(
        "--reward",
        required=True,
        metavar="REWARD",
        help="math | code | exact | regex | package.module:function (your f(completion, row) -> float) | run (the "
        "run's own rewards: the toy domains' verifiers, or a dataset run's [rollout.rewards.<domain>])",
    )
    a.add_argument(
        "--name", required=True, help="the reward version's name (letters, digits, _ . : + -); the same name resumes it"
    )
    a.add_argument(
        "--where",
        default="TRUE",
        metavar="PREDICATE",
        help="SQL condition on trajectories selecting the rows to score, run in the store's SQL sandbox: any "
        "read-only expression over its columns, subqueries on the ledger's tables included (default: every row)",
    )
    a.add_argument(
        "--reward-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a RewardConfig field of the reward: pattern, case_sensitive, code_reward, timeout_s, cpu_s, memory_mb, "
        "max_file_mb, max_files, network_namespace (repeat the flag for several)",
    )
    a.add_argument(
        "--run-config",
        default=None,
        metavar="PATH",
        help="the run's resolved config (tokenizer, toy domains or dataset files; default: config.json beside --db)",
    )
    a.add_argument(
        "--workers",
        type=int,
        default=2,
        help="processes that run the verifiers (0 = in this process; the toy verifiers always are) (default: %(default)s)",
    )
    a.add_argument(
        "--timeout-s",
        type=float,
        default=300.0,
        help="longest wait for one row's verifier; past it the row is an error (default: %(default)s)",
    )
    a.add_argument("--batch-rows", type=int, default=512, help="rows scored per committed batch (default: %(default)s)")
    a.set_defaults(func=run_replay_command)
    add_step_parser(actions)


def add_step_parser(actions: argparse._SubParsersAction) -> None:
    """``rollbook replay step N --run RUN_DIR``."""
    a = actions.add_parser(
        "step",
        help="rerun trainer step N from the ledger and the checkpoint before it; compare bit for bit",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Rerun trainer step N on the CPU and compare it with what the run recorded, bit for bit:\n"
        "the rows of the lease train_steps names for step N, read from the ledger (read-only, its store\n"
        "stopped) in the order they were served with the advantages served (leases.position,\n"
        "leases.advantage); the weights, AdamW state and RNG states of checkpoints/step-N (the state\n"
        "before step N); the model, teachers, KL reference, loss, learning rate and minibatches of the\n"
        "run's config.json; the torch threads the step recorded. The update is the trainer's own.\n\n"
        "Compared: loss/total, grad/norm and optim/lr with train_steps.stats; every parameter and the\n"
        "AdamW state with checkpoints/step-N+1, or without it the parameters with the checksum\n"
        "policy_versions holds for the step's version (when the trainer published one).\n\n"
        "Exit status: 0 every compared value has the same bits; 1 one differs (named, with the first\n"
        "differing parameter and its largest |difference|); 2 the step cannot be replayed as asked (not\n"
        "recorded, no checkpoint before it: the replayable steps are listed; a ledger a running store\n"
        "holds). `trainer.checkpoint_every = 1` with a large `trainer.keep_last` keeps every step\n"
        'replayable. docs/replay.md, "Step replay".',
        epilog="examples:\n"
        "  rollbook replay step 41 --run runs/exp1\n"
        "  rollbook replay step 41 --run runs/exp1 --db /tmp/ledger-copy.duckdb --json",
    )
    a.add_argument("step", type=int, metavar="N", help="the step, as train_steps.step numbers it (0 is the first)")
    a.add_argument(
        "--run", required=True, metavar="RUN_DIR", help="the run directory: its config.json and checkpoints/ (and ledger)"
    )
    a.add_argument("--db", default=None, metavar="PATH", help="the ledger (default: RUN_DIR/rollbook.duckdb)")
    a.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    a.set_defaults(func=run_replay_step_command)


def run_replay_step_command(args: argparse.Namespace) -> int:
    from rollbook.cli.replay_step import replay_step

    if args.step < 0:
        raise ConfigError(f"step {args.step}: steps are numbered from 0")
    result = replay_step(pathlib.Path(args.run), args.step, pathlib.Path(args.db) if args.db else None)
    print(json.dumps(result.as_json()) if args.json else result.table(), flush=True)
    return 0 if result.equal else 1


def run_replay_command(args: argparse.Namespace) -> int:
    result = rescore(
        pathlib.Path(args.db),
        reward=args.reward,
        name=args.name,
        where=args.where,
        options=parse_options(args.reward_option),
        run_config=pathlib.Path(args.run_config) if args.run_config else None,
        workers=args.workers,
        timeout_s=args.timeout_s,
        batch_rows=args.batch_rows,
        progress=sys.stderr,
    )
    print(result.summary())
    return 0


def parse_options(pairs: list[str]) -> dict[str, str]:
    options: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--reward-option {pair!r}: expected KEY=VALUE (e.g. pattern=answer: (\\d+))")
        if key.strip() == "kind":
            raise ConfigError("--reward-option kind: the kind is --reward")
        options[key.strip()] = value
    return options


@dataclass
class RescoreResult:
    """What one command did, and the version as it stands after it."""

    db: pathlib.Path
    name: str
    selected: int  # rows the predicate selected that are in the ledger's trajectories table
    archived: int  # selected ids no longer in that table (moved into the archive): not scored
    already: int  # of ``selected``, scored before this command
    scored: int  # by this command
    errors: int  # of those, status 'error'
    seconds: float
    version_scored: int
    version_errors: int
    mean: float | None = None
    original_mean: float | None = None
    retried_rows: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.scored / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        lines = [
            f"reward version {self.name!r}: {self.version_scored} of {self.selected} selected rows scored "
            f"({self.version_scored - self.version_errors} ok, {self.version_errors} errors); this run scored {self.scored} "
            f"in {self.seconds:.1f} s ({self.rate:.0f} rows/s), {self.already} were scored before"
        ]
        if self.archived:
            lines.append(f"{self.archived} selected rows are in the archive (moved out of the ledger) and were not scored")
        if self.mean is not None:
            original = "n/a" if self.original_mean is None else f"{self.original_mean:.4f}"
            lines.append(f"mean reward {self.mean:.4f} over its ok rows (original_reward of the same rows: {original})")
        lines.append(
            f'read it: rollbook query --db {self.db} "SELECT status, count(*), avg(reward) FROM reward_versions '
            f"WHERE name = '{self.name}' GROUP BY ALL\""
        )
        return "\n".join(lines)


class Progress:
    """Rows done of the selection, the rate of this run and the errors, on ``stream`` at most once per
    ``every_s`` (and at the end)."""

    def __init__(self, stream: IO[str] | None, name: str, total: int, already: int, every_s: float = 1.0) -> None:
        self.stream, self.name, self.total, self.already, self.every_s = stream, name, total, already, every_s
        self.started = self.last = time.monotonic()
        self.done = self.errors = 0
        self.shown = -1  # ``done`` at the last line printed

    def add(self, rows: int, errors: int, *, final: bool = False) -> None:
        self.done += rows
        self.errors += errors
        now = time.monotonic()
        if self.stream is None or (now - self.last < self.every_s if not final else self.shown == self.done):
            return
        self.last, self.shown = now, self.done
        done = self.already + self.done
        share = 100.0 * done / self.total if self.total else 100.0
        rate = self.done / (now - self.started) if now > self.started else 0.0
        print(
            f"rollbook replay: {self.name}: {done}/{self.total} rows ({share:.1f}%), {rate:.0f} rows/s, "
            f"{self.errors} errors this run",
            file=self.stream,
            flush=True,
        )


def check_predicate(predicate: str) -> str:
    """The selection statement for ``predicate``, refused (``ConfigError``) unless it parses as exactly
    ``SELECT trajectory_id FROM trajectories WHERE (predicate)``: one plain SELECT of that table with the
    predicate as its whole WHERE, so a predicate that closes the parenthesis and adds a UNION, an
    ORDER BY, a LIMIT or a GROUP BY is refused. Parsed only (``json_serialize_sql``), never run here;
    the store's SQL sandbox runs it, behind its own fence."""
    import duckdb

    if not predicate.strip():
        raise ConfigError("--where is empty: give a condition, or leave the flag out to select every row")
    sql = SELECTION.format(predicate=predicate)
    con = duckdb.connect(config={"enable_external_access": False})
    try:
        row = con.execute("SELECT json_serialize_sql(?)", [sql]).fetchone()
    finally:
        con.close()
    tree: dict[str, Any] = json.loads(row[0]) if row else {"error": True, "error_message": "no parse"}
    if tree.get("error"):
        raise ConfigError(f"--where does not parse: {tree.get('error_message', 'unknown error')}")
    statements = tree.get("statements", [])
    node = statements[0].get("node", {}) if len(statements) == 1 else {}
    table = node.get("from_table") or {}
    plain = (
        node.get("type") == "SELECT_NODE"
        and not node.get("modifiers")
        and not (node.get("cte_map") or {}).get("map")
        and len(node.get("select_list") or []) == 1
        and table.get("type") == "BASE_TABLE"
        and table.get("table_name") == "trajectories"
        and not table.get("schema_name")
        and not table.get("catalog_name")
        and not node.get("group_expressions")
        and not node.get("group_sets")
        and node.get("having") is None
        and node.get("qualify") is None
        and node.get("sample") is None
    )
    if not plain:
        raise ConfigError(
            "--where must be one condition on trajectories' columns (it becomes the whole WHERE of "
            "SELECT trajectory_id FROM trajectories WHERE (...)): no unbalanced parentheses, UNION, ORDER BY, "
            "LIMIT or GROUP BY"
        )
    return sql


def select_ids(ledger: Ledger, sql: str, workdir: pathlib.Path) -> pa.Table:
    """Run the selection in the store's SQL sandbox over a snapshot of ``ledger``: a limited process,
    external access off, the statement fence; the ids come back as Arrow. A failing or refused
    predicate is a ``ConfigError`` with the sandbox's reason."""
    import pyarrow as pa

    from rollbook.store.sandbox import FixedSnapshot, SandboxPool
    from rollbook.store.sql import TIMEOUT, QueryError, QueryLimits

    snapshot = workdir / "snapshot.duckdb"
    ledger.snapshot(snapshot)
    limits = QueryLimits(workers=1, queue=0, max_rows=1 << 40, max_result_bytes=1 << 40, timeout_s=SELECTION_TIMEOUT_S)
    pool = SandboxPool(limits, workdir / "sandbox", FixedSnapshot(snapshot))
    tables = []
    try:
        for ipc, truncated in pool.run(sql):
            if truncated:
                raise CommandError("the --where selection was cut by the sandbox's caps: narrow it")
            if ipc:
                tables.append(pa.ipc.open_stream(io.BytesIO(ipc)).read_all())
    except QueryError as exc:
        if exc.code == TIMEOUT:
            raise CommandError(f"the --where selection ran past {SELECTION_TIMEOUT_S:g} s: narrow it") from None
        raise ConfigError(f"--where: {exc}") from None
    finally:
        pool.close()
        snapshot.unlink(missing_ok=True)
    ids = pa.concat_tables(tables) if tables else pa.table({"trajectory_id": pa.array([], pa.string())})
    return pa.table({"trajectory_id": ids.column(0).cast(pa.string())})


def open_ledger(db: pathlib.Path) -> Ledger:
    """The ledger as the store opens it (its log replayed); a file a running store holds is refused."""
    import duckdb

    from rollbook.store.ledger import Ledger

    if not db.is_file():
        raise CommandError(f"no such ledger file {db}")
    try:
        return Ledger(db)
    except duckdb.IOException as exc:
        if "lock" not in str(exc).lower():
            raise
        raise CommandError(
            f"ledger {db} is held by another process (a running rollbook serve?); only the store writes its ledger, "
            "so stop it first and run this again"
        ) from None


def rescore(
    db: pathlib.Path,
    *,
    reward: str,
    name: str,
    where: str = "TRUE",
    options: dict[str, str] | None = None,
    run_config: pathlib.Path | None = None,
    workers: int = 2,
    timeout_s: float = 300.0,
    batch_rows: int = 512,
    progress: IO[str] | None = None,
) -> RescoreResult:
    """Score the trajectories ``where`` selects with ``reward`` into reward version ``name`` (the
    module's docstring); resumes a version started before. Everything the user can get wrong (the
    name, the reward, its options, the predicate's shape, the run config) is refused before the
    ledger is opened; a name reused for another reward and a predicate the sandbox refuses, before
    any row is scored."""
    from rollbook.rescore import RowSource, build_scorer, load_run_config, run_tokenizer
    from rollbook.store import reward_versions

    try:
        reward_versions.check_name(name)
    except ValueError as exc:
        raise ConfigError(f"--name: {exc}") from None
    if workers < 0 or batch_rows < 1 or not timeout_s > 0:
        raise ConfigError("--workers must be >= 0, --batch-rows >= 1 and --timeout-s > 0")
    sql = check_predicate(where)
    if not db.is_file():
        raise CommandError(f"no such ledger file {db}")
    config = load_run_config(run_config or db.parent / "config.json")
    tokenizer, tokenizer_described = run_tokenizer(config)
    rows = RowSource.for_run(config)
    started = time.monotonic()
    scorer, settings = build_scorer(reward, options or {}, config, rows, workers=workers, timeout_s=timeout_s)
    spec = reward_versions.VersionSpec(name, reward, settings, where, tokenizer_described, rows.described)
    with scorer:  # its pool's processes start now, beside the ledger's opening and the selection
        ledger = open_ledger(db)
        workdir = db.with_name(db.name + ".replay")  # the snapshot and the sandbox's folder; a killed run's is cleared
        shutil.rmtree(workdir, ignore_errors=True)
        workdir.mkdir()
        try:
            cur = ledger.cursor()
            try:
                known = reward_versions.state(cur, name)
            finally:
                cur.close()
            if known is not None:  # a name is one reward over one predicate: refused before any work
                try:
                    reward_versions.check_same(known.spec, spec)
                except reward_versions.VersionMismatch as exc:
                    raise ConfigError(str(exc)) from None
            selected = select_ids(ledger, sql, workdir)
            return _score_selection(
                ledger, spec, selected, scorer, tokenizer, rows, batch_rows=batch_rows, progress=progress, started=started
            )
        finally:
            ledger.close()
            shutil.rmtree(workdir, ignore_errors=True)


def _score_selection(
    ledger: Ledger,
    spec: VersionSpec,
    selected: pa.Table,
    scorer: Scorer,
    tokenizer: Tokenizer,
    rows: RowSource,
    *,
    batch_rows: int,
    progress: IO[str] | None,
    started: float,
) -> RescoreResult:
    import pyarrow.compute as pc

    from rollbook import environment as env
    from rollbook.store import reward_versions
    from rollbook.store.reward_versions import one_row

    crash_after = env.replay_crash_after()
    cur = ledger.cursor()
    try:
        cur.register("_selected", selected)
        (in_ledger,) = one_row(
            cur.execute(
                "SELECT count(*) FROM trajectories t SEMI JOIN (SELECT DISTINCT trajectory_id FROM _selected) s USING (trajectory_id)"
            )
        )
        in_ledger = int(in_ledger)
        distinct = int(pc.count_distinct(selected.column("trajectory_id")).as_py())
        with ledger.transaction() as con:
            state = reward_versions.begin(con, spec, in_ledger, time.time())
        todo = cur.sql(
            reward_versions.unscored_sql("_selected", "t.rowid AS row_id") + " ORDER BY row_id", params={"name": spec.name}
        ).to_arrow_table()
        already = in_ledger - todo.num_rows
        if progress is not None and already:
            print(
                f"rollbook replay: {spec.name}: resuming, {already} of {in_ledger} selected rows already scored "
                f"(start {state.starts})",
                file=progress,
                flush=True,
            )
        shown = Progress(progress, spec.name, in_ledger, already)
        scored = errors = 0
        waiting: list[tuple[list[str], Any]] = []  # submitted batches not yet written: scoring overlaps reading
        for batch in _batches(cur, todo.column("row_id"), batch_rows):
            ids, items = _items(batch, scorer, tokenizer, rows)
            waiting.append((ids, scorer.submit(items)))
            if len(waiting) > 1:
                n, e = _write(ledger, spec.name, scorer, *waiting.pop(0), crash_after=crash_after, before=scored)
                scored, errors = scored + n, errors + e
                shown.add(n, e)
        while waiting:
            n, e = _write(ledger, spec.name, scorer, *waiting.pop(0), crash_after=crash_after, before=scored)
            scored, errors = scored + n, errors + e
            shown.add(n, e)
        shown.add(0, 0, final=True)
        with ledger.transaction() as con:
            reward_versions.finish(con, spec.name, time.time())
        final = reward_versions.state(cur, spec.name)
        assert final is not None
        mean, original = one_row(
            cur.execute(
                "SELECT avg(v.reward), avg(t.original_reward) FROM reward_versions v JOIN trajectories t USING (trajectory_id) "
                "WHERE v.name = ? AND v.status = 'ok'",
                [spec.name],
            )
        )
        cur.unregister("_selected")
    finally:
        cur.close()
    return RescoreResult(
        db=ledger.db_path,
        name=spec.name,
        selected=in_ledger,
        archived=distinct - in_ledger,
        already=already,
        scored=scored,
        errors=errors,
        seconds=time.monotonic() - started,
        version_scored=final.scored,
        version_errors=final.errors,
        mean=None if mean is None else float(mean),
        original_mean=None if original is None else float(original),
        retried_rows=scorer.retried_rows,
    )


def _batches(cur: duckdb.DuckDBPyConnection, row_ids: Any, rows: int) -> Iterator[pa.Table]:
    """The rows to score, ``rows`` at a time, in the ledger's order: the ids were picked on the light
    columns, the lists are read per batch by ``rowid`` (as a pull does, validator/pull.py), so memory
    holds one batch whatever the selection's size, and a group's members, stored together, are
    scored together (verifiers' caches, math-verify's parses of one reference, then hit)."""
    import pyarrow as pa

    for start in range(0, len(row_ids), rows):
        cur.register("_batch", pa.table({"row_id": row_ids[start : start + rows]}))
        batch = cur.sql(
            f"SELECT rowid AS row_id, {READ_COLUMNS} FROM trajectories t WHERE rowid IN (SELECT row_id FROM _batch)"
        ).to_arrow_table()
        cur.unregister("_batch")
        yield batch.sort_by("row_id")


def _items(batch: pa.Table, scorer: Scorer, tokenizer: Tokenizer, rows: RowSource) -> tuple[list[str], list[Any]]:
    ids = batch.column("trajectory_id").to_pylist()
    items = []
    for task_id, domain, prompt, output in zip(
        batch.column("task_id").to_pylist(),
        batch.column("domain").to_pylist(),
        batch.column("prompt_token_ids").to_pylist(),
        batch.column("output_token_ids").to_pylist(),
    ):
        row, found = rows.row(task_id, domain, prompt, tokenizer)
        items.append(scorer.item(domain, tokenizer.completion_text(output), row, found))
    return ids, items


def _write(
    ledger: Ledger, name: str, scorer: Scorer, ids: list[str], pending: Any, *, crash_after: int | None, before: int
) -> tuple[int, int]:
    """Collect one batch's scores and commit them in one transaction. With ``crash_after`` (the tests'
    hook, ``ROLLBOOK_REPLAY_CRASH_AFTER``) the process SIGKILLs itself instead of committing the batch
    that would bring this run's rows to that many or more: a kill with scores made and not committed."""
    import pyarrow as pa

    from rollbook.store import reward_versions

    scores = scorer.collect(pending)
    if crash_after is not None and before + len(ids) >= crash_after:
        os.kill(os.getpid(), signal.SIGKILL)
    table = pa.table(
        {
            "trajectory_id": pa.array(ids, pa.string()),
            "reward": pa.array([s.outcome.reward if s.outcome.status == "ok" else None for s in scores], pa.float64()),
            "status": pa.array([s.outcome.status for s in scores], pa.string()),
            "error": pa.array([s.outcome.error or None for s in scores], pa.string()),
            "info": pa.array([json.dumps(s.info, default=str) if s.info else None for s in scores], pa.string()),
        }
    )
    with ledger.transaction() as con:
        return reward_versions.write(con, name, table, time.time())
