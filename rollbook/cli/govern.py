"""``rollbook govern``: training eligibility and tenant policies of a running store (admin key).

    rollbook govern hold    --where "task_id LIKE 'leak-%'" --reason "suspected contamination"
    rollbook govern release --where "task_id LIKE 'leak-%'" --reason "cleared by review"
    rollbook govern policy  math-a --tenants team-a,team-b --require-consent
    rollbook govern policy  math-a --tenants all

The predicate of ``hold``/``release`` is SQL over ``trajectories`` and runs in the store's SQL sandbox
(docs/sql.md), never on the ledger itself. A held row stays in ``trajectories`` and is never served
until released; every action appends one row to the ``audit`` table. Each command prints one JSON
line: the action, the rows it changed and the audit row's id. docs/governance.md has the whole story.
"""

from __future__ import annotations

import argparse
import json
import pathlib
from collections.abc import Callable
from typing import Any

from rollbook.errors import CommandError, ConfigError, unreachable


def add_parser(sub: argparse._SubParsersAction) -> None:
    """``rollbook govern`` (``rollbook/cli/main.py`` calls this)."""
    from rollbook.environment import DEFAULT_SERVER

    p = sub.add_parser(
        "govern",
        help="hold or release rows from training, set a model's tenant policy (admin key)",
        description="Training eligibility and tenant policies of a running store. Needs the admin key "
        "(env ROLLBOOK_ADMIN_KEY). Every action is recorded in the store's audit table.",
    )
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    for name, verb in (("hold", "hold from training"), ("release", "return to training")):
        a = actions.add_parser(
            name,
            help=f"{verb} the trajectories a SQL predicate matches",
            description=f"{verb.capitalize()} the rows of `trajectories` where --where holds. The predicate runs "
            "in the SQL sandbox over a snapshot of every acknowledged row; rows acknowledged afterwards are not "
            "affected."
            + (
                " A held row stays in trajectories, is never served, and its group follows the incomplete-group policy."
                if name == "hold"
                else " A released row re-enters the validator's flow; a row its model's policy does not allow stays held."
            ),
        )
        a.add_argument("--where", required=True, metavar="SQL", help="predicate over trajectories, e.g. \"tenant = 'b'\"")
        a.add_argument("--reason", required=True, help="why (recorded with each row and in the audit table)")
    a = actions.add_parser(
        "policy",
        help="set which tenants' rows may train a model",
        description="Set MODEL_ID's tenant policy. Rows of other tenants (and, with --require-consent, rows "
        "whose metadata lacks consent = 'true') are held at ingest; rows already stored and not yet trained "
        "that the policy does not allow are held now.",
    )
    a.add_argument("model_id")
    a.add_argument("--tenants", required=True, help="comma list of tenants, or 'all' for every tenant")
    a.add_argument("--require-consent", action="store_true", help="hold rows without metadata consent = 'true'")
    a.add_argument(
        "--detect",
        default="",
        metavar="RULES",
        help="redaction rules (email,phone,api_key,ip,... as export-data's --redact) whose hit in a row's decoded text "
        "holds it; the store decodes with its detector_tokenizers",
    )
    for a in actions.choices.values():
        a.add_argument(
            "--server", default=None, help=f"store address HOST:PORT (default: env ROLLBOOK_SERVER, else {DEFAULT_SERVER})"
        )
        a.add_argument("--admin-key", default=None, help="admin key (default: env ROLLBOOK_ADMIN_KEY; prefer the env)")
        a.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rollbook.client import StoreClient

    with StoreClient.from_env(args.server, admin_key=args.admin_key or None) as client:
        if client.admin_key is None:
            raise CommandError("govern needs the admin key: set ROLLBOOK_ADMIN_KEY (rollbook run keeps it in RUN_DIR/keys.json)")
        try:
            if args.action == "policy":
                tenants = [] if args.tenants.strip() == "all" else [t.strip() for t in args.tenants.split(",") if t.strip()]
                if args.tenants.strip() != "all" and not tenants:
                    raise CommandError("--tenants needs at least one tenant, or 'all'")
                detectors = [r.strip() for r in args.detect.split(",") if r.strip()]
                done = client.govern(
                    "policy", model_id=args.model_id, tenants=tenants, require_consent=args.require_consent, detectors=detectors
                )
            else:
                done = client.govern(args.action, where=args.where, reason=args.reason)
        except CommandError:
            raise
        except Exception as exc:
            raise CommandError(unreachable(exc, args.server) or _status(exc)) from None
    print(json.dumps({"action": args.action, "rows": done.rows, "audit_id": done.audit_id}))
    return 0


def _status(exc: Exception) -> str:
    import grpc

    if isinstance(exc, grpc.RpcError):
        return f"{exc.code().name}: {exc.details()}"
    raise exc


# ---- lineage and forget ------------------------------------------------------------------------------


def add_lineage_parsers(sub: argparse._SubParsersAction) -> None:
    """``rollbook lineage`` and ``rollbook forget`` (``rollbook/cli/main.py`` calls this)."""
    from rollbook.environment import DEFAULT_SERVER

    server_help = f"store address HOST:PORT (default: env ROLLBOOK_SERVER, else {DEFAULT_SERVER})"
    p = sub.add_parser(
        "lineage",
        help="what trained given trajectories: leases, steps, versions, checkpoints, Hugging Face exports",
        description="For trajectory ids (or every row a --where predicate selects), list the leases that served "
        "them, the training steps that reported those leases, the policy versions the steps produced and, from "
        "the trainer's run directory, the checkpoints (checkpoints/step-N) and Hugging Face exports (hf/step-N) "
        "made after the first such step: everything that descends from those rows. Prints one JSON object. "
        "Reads through SQL: the reader key of the environment with --server, or a stopped store's file (--db).",
    )
    p.add_argument("ids", nargs="*", metavar="TRAJECTORY_ID", help="trajectory ids (forgotten ones too: leases keep them)")
    p.add_argument("--where", default=None, metavar="SQL", help="a predicate over trajectories selecting the rows")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--server", default=None, help=server_help)
    source.add_argument("--db", default=None, metavar="PATH", help="a stopped store's ledger file (read through a private copy)")
    p.add_argument(
        "--run-dir",
        default=None,
        help="the trainer's run directory, for its checkpoints and exports (default with --db: the ledger's folder)",
    )
    p.set_defaults(func=run_lineage)

    p = sub.add_parser(
        "forget",
        help="remove trajectories' content from the store everywhere it lives (admin key)",
        description="Remove the content (tokens, log-probs, metadata: the whole row) of the trajectories a --where "
        "predicate selects from the store's tables, its write-ahead log segments, its archive files, the "
        "database file's free space (the file is rewritten) and the SQL snapshots. Each row leaves a tombstone "
        "(id, content hash, tenant, when, why) and the action an audit row. Prints one JSON object with the "
        "lineage of the forgotten rows: the steps, versions, checkpoints and exports trained on them, to "
        "retrain or roll back. Ingest pauses while the file is rewritten.",
    )
    p.add_argument("--where", required=True, metavar="SQL", help="predicate over trajectories, e.g. \"task_id = 'x'\"")
    p.add_argument("--reason", required=True, help="why (recorded in each tombstone and in the audit table)")
    p.add_argument("--server", default=None, help=server_help)
    p.add_argument("--admin-key", default=None, help="admin key (default: env ROLLBOOK_ADMIN_KEY; prefer the env)")
    p.add_argument("--run-dir", default=None, help="the trainer's run directory, for the lineage's checkpoints and exports")
    p.set_defaults(func=run_forget)


def run_forget(args: argparse.Namespace) -> int:
    from rollbook.client import StoreClient
    from rollbook.store.governance import trainer_files

    with StoreClient.from_env(args.server, admin_key=args.admin_key or None) as client:
        if client.admin_key is None:
            raise CommandError("forget needs the admin key: set ROLLBOOK_ADMIN_KEY (rollbook run keeps it in RUN_DIR/keys.json)")
        try:
            done = client.govern("forget", where=args.where, reason=args.reason)
        except Exception as exc:
            raise CommandError(unreachable(exc, args.server) or _status(exc)) from None
    lineage = json.loads(done.lineage_json or "{}")
    if args.run_dir is not None:  # the trainer's files: the store does not know where they are
        lineage.update(trainer_files(lineage.get("steps", []), pathlib.Path(args.run_dir)))
    print(json.dumps({"action": "forget", "rows": done.rows, "audit_id": done.audit_id, "lineage": lineage}))
    return 0


def run_lineage(args: argparse.Namespace) -> int:
    import pyarrow as pa

    from rollbook.cli.replay import check_predicate
    from rollbook.store.governance import LINEAGE_SQL, lineage_report

    if not args.ids and not args.where:
        raise ConfigError("give trajectory ids, or --where with a predicate over trajectories")
    parts = []
    if args.ids:
        parts.append("SELECT unnest([" + ", ".join("'" + t.replace("'", "''") + "'" for t in args.ids) + "]) AS trajectory_id")
    if args.where:
        check_predicate(args.where)
        parts.append(f"SELECT trajectory_id FROM trajectories WHERE ({args.where}\n)")
    selected = "(" + " UNION ".join(parts) + ")"
    sql = f"WITH selected AS {selected} SELECT * FROM ({LINEAGE_SQL.format(ids='selected')})"
    ids_sql = f"WITH selected AS {selected} SELECT DISTINCT trajectory_id FROM selected"
    run_dir = pathlib.Path(args.run_dir) if args.run_dir else (pathlib.Path(args.db).parent if args.db else None)

    def table_of(run: Callable[[str], pa.Table]) -> tuple[pa.Table, pa.Table]:
        return run(sql), run(ids_sql)

    if args.db:
        rows, ids = _on_file(pathlib.Path(args.db), table_of)
    else:
        from rollbook import environment as env
        from rollbook.client import StoreClient

        server = args.server or env.server()
        with StoreClient.from_env(server) as client:  # the reader key and TLS files of the environment

            def run(statement: str) -> pa.Table:
                try:
                    table = client.query(statement)
                except Exception as exc:
                    raise CommandError(unreachable(exc, server) or _status(exc)) from None
                if (table.schema.metadata or {}).get(b"rollbook.truncated") == b"true":
                    raise CommandError("the lineage is longer than the server's row cap; narrow the selection")
                return table

            rows, ids = table_of(run)
    report = lineage_report(rows.to_pylist(), ids.column("trajectory_id").to_pylist(), run_dir)
    print(json.dumps(report))
    return 0


def _on_file(db: pathlib.Path, table_of: Callable[[Callable[[str], Any]], Any]) -> Any:
    """``table_of(run)`` over a private copy of a stopped store's ledger, in one SQL sandbox process."""
    import io

    import pyarrow as pa

    from rollbook.cli.query import sandbox_over_copy
    from rollbook.store.sql import QueryError

    with sandbox_over_copy(db) as pool:

        def run(sql: str) -> pa.Table:
            try:
                chunks = list(pool.run(sql))
            except QueryError as exc:
                raise CommandError(str(exc)) from None
            if any(cut for _, cut in chunks):
                raise CommandError("the lineage is longer than the sandbox's row cap; narrow the selection")
            return pa.concat_tables([pa.ipc.open_stream(io.BytesIO(ipc)).read_all() for ipc, _ in chunks if ipc])

        return table_of(run)
