"""``rollbook store age``: move a stopped store's trained rows out of its DuckDB file into Parquet.

    rollbook store age --db runs/exp1/rollbook.duckdb --older-than 7d          # trained a week ago or more
    rollbook store age --db runs/exp1/rollbook.duckdb --up-to-step 400 --to /shared/archive/exp1

Only the store writes its ledger. This command opens the file as the store does (replaying its
write-ahead log, rolling back a move a crash cut short) and so needs the store stopped: a ledger held
by a running store is refused in one line. A running store moves rows itself, on the schedule of its
``[store.ageing]`` config (rollbook/config/store.py ``AgeingConfig``). The move is crash-safe
(store/archive.py): a kill -9 at any point loses and doubles nothing, and the next open of the
ledger (a store, or this command) finishes the clean-up.
"""

from __future__ import annotations

import argparse
import pathlib
import re

from rollbook.errors import CommandError

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([smhdw]?)\s*$")


def parse_duration(text: str) -> float:
    """Seconds in ``text``: a number with an optional unit, ``s`` (the default), ``m``, ``h``, ``d`` or
    ``w`` (``7d``, ``36h``, ``90``)."""
    match = _DURATION.match(text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration: a number with an optional unit s, m, h, d or w (e.g. 7d)")
    return float(match.group(1)) * _UNITS[match.group(2) or "s"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """``rollbook store age`` (``rollbook/cli/main.py`` calls this)."""
    p = sub.add_parser(
        "store",
        help="maintain a stopped store's ledger file (age trained rows into Parquet)",
        description="Maintenance of a ledger file whose store is stopped (a running store does its own, "
        "configured in [store.ageing]).",
    )
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    a = actions.add_parser(
        "age",
        help="move trained rows older than an age or step into Parquet files (hive layout by model and date)",
        description="Move the trained rows (trajectories whose lease was acked) picked by --older-than or "
        "--up-to-step out of the DuckDB file into Parquet files under --to, "
        "TO/trajectories/model_id=M/date=YYYY-MM-DD/part-*.parquet. The SQL endpoint, rollbook query and "
        "rollbook report still see them under the same table names; polars, DuckDB or Spark read the "
        "files directly. Crash-safe: a kill -9 at any point loses and doubles nothing. The store must be "
        "stopped (a running store ages rows on the schedule of its [store.ageing] config); a ledger it "
        "holds is refused.",
    )
    a.add_argument("--db", required=True, metavar="PATH", help="the ledger, e.g. RUN_DIR/rollbook.duckdb")
    which = a.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--older-than",
        type=parse_duration,
        metavar="AGE",
        help="rows whose lease was acked at least AGE ago: seconds, or a number with s, m, h, d or w (7d)",
    )
    which.add_argument("--up-to-step", type=int, metavar="N", help="rows trained at trainer step N or before")
    a.add_argument(
        "--to",
        default=None,
        metavar="DIR",
        help="root of the Parquet files, any path (a shared file system too); default: archive/ beside the ledger",
    )
    a.add_argument("--max-rows", type=int, default=None, metavar="N", help="move at most N rows (the oldest-trained first)")
    a.set_defaults(func=run_age_command)


def run_age_command(args: argparse.Namespace) -> int:
    import duckdb

    from rollbook.store.archive import Criterion, default_root
    from rollbook.store.ledger import Ledger

    db = pathlib.Path(args.db)
    if not db.exists():
        raise CommandError(f"no such ledger file {db}")
    if args.max_rows is not None and args.max_rows < 0:
        raise CommandError(f"--max-rows must be >= 0, got {args.max_rows}")
    criterion = Criterion(older_than_s=args.older_than, up_to_step=args.up_to_step, max_rows=args.max_rows)
    root = pathlib.Path(args.to).absolute() if args.to else default_root(db)
    try:
        ledger = Ledger(db)
    except duckdb.IOException as exc:
        if "lock" not in str(exc).lower():
            raise
        raise CommandError(
            f"ledger {db} is held by another process (a running rollbook serve?); only the store writes its ledger, "
            "so stop it first, or let the running store move rows on the schedule of its [store.ageing] config"
        ) from None
    try:
        moved = ledger.age(criterion, root)
        stats = ledger.stats()
    finally:
        ledger.close()
    if not moved.rows:
        print(f"nothing to move: no trained row of {db} matches; {stats['archived']} row(s) already in the archive")
        return 0
    print(
        f"moved {moved.rows} trained row(s) ({moved.output_tokens} output tokens, {moved.bytes} bytes of Parquet) into "
        f"{len(moved.files)} file(s) under {root}; {stats['accepted'] - stats['archived']} trajectories stay in {db.name}, "
        f"{stats['archived']} are in the archive"
    )
    print(f"read them with polars: pl.scan_parquet('{root}/trajectories/**/*.parquet', hive_partitioning=True)")
    return 0
