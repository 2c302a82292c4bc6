"""Governed evidence: each model's tenant policy, the ingest rules that hold rows from training, the
administrator's holds and releases, the append-only ``audit`` table, and the per-tenant snapshots a
tenant's reader queries (docs/governance.md).

A row's training eligibility lives in ``trajectories.eligibility`` (``eligible`` or ``held``), with
``eligibility_reason``, ``eligibility_set_by`` and ``eligibility_set_at``. A held row is not a
rejection: it stays in ``trajectories``, the validator counts it as absent from its group (so the
incomplete-group policy decides what happens to the others: validator/groups.py) and never serves
it; a release returns it to the validator's flow.
"""

from __future__ import annotations

import json
import pathlib
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import duckdb

from rollbook.store import archive
from rollbook.store.detect import DETECTOR_HIT, DetectorError, Scanner
from rollbook.store.detect import describe as describe_hits

if TYPE_CHECKING:  # pragma: no cover
    from rollbook.store.access import Caller
    from rollbook.trajectories import TrajectoryColumns

# the reason codes the ingest rules hold rows with (each reason starts with its code)
TENANT_NOT_ALLOWED = "TENANT_NOT_ALLOWED"
NO_CONSENT = "NO_CONSENT"
DETECTOR_UNAVAILABLE = "DETECTOR_UNAVAILABLE"  # a policy names detectors the store cannot run for the model
HOLD_CODES = (TENANT_NOT_ALLOWED, NO_CONSENT, DETECTOR_HIT, DETECTOR_UNAVAILABLE)

ACTIONS = ("hold", "release", "policy", "export", "forget")


class GovernError(ValueError):
    """A governance request that cannot run (-> INVALID_ARGUMENT)."""


@dataclass(frozen=True)
class Policy:
    """Which tenants' rows may train a model (None: every tenant's), whether a row needs
    ``metadata['consent'] = 'true'``, and the ``rollbook.redact`` rules whose hit in a row's decoded
    text holds it (store/detect.py)."""

    tenants: frozenset[str] | None = None
    require_consent: bool = False
    detectors: tuple[str, ...] = ()

    def describe(self) -> str:
        who = "every tenant" if self.tenants is None else ", ".join(sorted(self.tenants)) or "no tenant"
        return (
            who
            + (" with consent" if self.require_consent else "")
            + (f", rows where {', '.join(self.detectors)} find nothing" if self.detectors else "")
        )


def load_policies(con: duckdb.DuckDBPyConnection) -> dict[str, Policy]:
    return {
        model_id: Policy(None if tenants is None else frozenset(tenants), bool(consent), tuple(detectors or ()))
        for model_id, tenants, consent, detectors in con.execute(
            "SELECT model_id, tenants, require_consent, detectors FROM model_policies"
        ).fetchall()
    }


def hold_reasons(
    batch: TrajectoryColumns,
    tenant: str,
    policies: dict[str, Policy],
    scanner: Scanner | None = None,
    valid: Sequence[bool] | None = None,
) -> list[str | None] | None:
    """Why the ingest rules hold each row of ``batch`` submitted by ``tenant`` (None: eligible), or
    None when no row is held (the usual case, decided without a per-row loop when no model of the
    batch has a policy). Detector rules decode only the ``valid`` rows (the others are rejected)."""
    models = batch.column("model_id")
    present = set(models)
    if not policies or not any(m in policies for m in present):
        return None
    reasons: list[str | None] = []
    metadata = None
    for i, model_id in enumerate(models):
        policy = policies.get(model_id)
        reason = None
        if policy is not None:
            if policy.tenants is not None and tenant not in policy.tenants:
                reason = f"{TENANT_NOT_ALLOWED}: tenant {tenant!r} may not train model {model_id!r} (policy: {policy.describe()})"
            elif policy.require_consent:
                if metadata is None:
                    metadata = batch.column("metadata")
                if metadata[i].get("consent") != "true":
                    reason = f"{NO_CONSENT}: model {model_id!r} needs metadata consent = 'true'; the call has none"
        reasons.append(reason)
    for model_id in sorted(present):
        policy = policies.get(model_id)
        if policy is None or not policy.detectors:
            continue
        rows = [i for i, m in enumerate(models) if m == model_id and reasons[i] is None and (valid is None or valid[i])]
        if not rows:
            continue
        if scanner is None:
            scanner = Scanner()
        try:
            prompts = scanner.hits(model_id, policy.detectors, [batch.prompt.row(i) for i in rows])
            outputs = scanner.hits(model_id, policy.detectors, [batch.tokens.row(i) for i in rows])
        except DetectorError as exc:  # fail closed: a row nobody could scan does not train
            for i in rows:
                reasons[i] = f"{DETECTOR_UNAVAILABLE}: {exc}"
            continue
        for i, prompt, output in zip(rows, prompts, outputs):
            if prompt or output:
                reasons[i] = describe_hits(prompt, output)
    return reasons if any(reasons) else None


def actor(caller: Caller) -> str:
    """How a caller is named in ``eligibility_set_by``: role/tenant/key."""
    return f"{caller.role or 'open'}/{caller.tenant}/{caller.name or caller.role or 'open'}"


def audit(
    con: duckdb.DuckDBPyConnection,
    caller: Caller,
    action: str,
    *,
    predicate: str = "",
    reason: str = "",
    model_id: str = "",
    rows: int = 0,
    detail: dict[str, Any] | None = None,
    at: float | None = None,
) -> str:
    """Append one row to ``audit`` (inside the caller's transaction) and return its id."""
    audit_id = uuid.uuid4().hex
    con.execute(
        "INSERT INTO audit VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        [
            audit_id,
            time.time() if at is None else at,
            caller.role or "open",
            caller.tenant,
            action,
            predicate,
            reason,
            model_id,
            rows,
            json.dumps(detail or {}, sort_keys=True),
        ],
    )
    return audit_id


# a row of `trajectories` its model's policy does not allow (another tenant's, or without consent)
POLICY_FORBIDS = """EXISTS (SELECT 1 FROM model_policies p WHERE p.model_id = trajectories.model_id AND (
    (p.tenants IS NOT NULL AND NOT list_contains(p.tenants, trajectories.tenant))
    OR (p.require_consent AND coalesce(trajectories.metadata['consent'], '') <> 'true')))"""


def set_eligibility(
    con: duckdb.DuckDBPyConnection, ids: Sequence[str], state: str, reason: str, by: str, now: float, group_key: str
) -> int:
    """Hold (``state`` 'held') or release ('eligible') the rows of ``trajectories`` among ``ids`` whose
    state differs; returns how many changed. A group that was ready and lost a member to a hold waits
    again (its ready members go back to pending), like a group that lost one to a retry."""
    if not ids:
        return 0
    other = "eligible" if state == "held" else "held"
    # a release never overrides a model's policy: rows it does not allow stay held
    allowed = "" if state == "held" else f"AND NOT ({POLICY_FORBIDS})"
    con.register("_govern_ids", ids_table(ids))
    try:
        changed = con.execute(
            f"""UPDATE trajectories SET eligibility = ?, eligibility_reason = ?, eligibility_set_by = ?, eligibility_set_at = ?
                WHERE eligibility = ? AND trajectory_id IN (SELECT trajectory_id FROM _govern_ids) {allowed}
                RETURNING {group_key} AS gkey""",
            [state, reason, by, now, other],
        ).fetchall()
    finally:
        con.unregister("_govern_ids")
    if state == "held" and changed:
        con.register("_govern_groups", ids_table([g for (g,) in changed], "gkey"))
        try:
            con.execute(
                f"UPDATE trajectories SET status = 'pending' WHERE status = 'ready' AND {group_key} IN (SELECT gkey FROM _govern_groups)"
            )
        finally:
            con.unregister("_govern_groups")
    return len(changed)


def ids_table(values: Iterable[str], name: str = "trajectory_id") -> Any:
    import pyarrow as pa

    return pa.table({name: pa.array(list(values), pa.string())})


# ---- lineage and forgetting ---------------------------------------------------------------------

# What trained each selected row: its leases, and for an acked one the step that reported it (the
# version that step produced). `{ids}` is a relation with a `trajectory_id` column: a registered
# table on the ledger's own connection, a subquery through the SQL sandbox.
LINEAGE_SQL = """
SELECT l.trajectory_id, l.lease_id, l.trainer_id, l.step AS lease_step, l.acked_at IS NOT NULL AS acked,
       s.step AS trained_step, s.version AS produced_version, t.model_id
FROM leases l
LEFT JOIN train_steps s ON s.lease_id = l.lease_id
LEFT JOIN (SELECT trajectory_id, any_value(model_id) AS model_id FROM (
             SELECT trajectory_id, model_id FROM trajectories UNION ALL SELECT trajectory_id, model_id FROM tombstones)
           GROUP BY trajectory_id) t ON t.trajectory_id = l.trajectory_id
WHERE l.trajectory_id IN (SELECT trajectory_id FROM {ids})
ORDER BY l.trajectory_id, l.issued_at"""


def lineage_report(rows: list[dict[str, Any]], ids: Sequence[str], run_dir: pathlib.Path | None = None) -> dict[str, Any]:
    """What ``LINEAGE_SQL``'s rows say about the trajectories ``ids``: the steps that trained them
    (an acked lease reported by a step), the versions those steps produced, and, given the trainer's
    ``run_dir``, the checkpoints and Hugging Face exports made after the first such step
    (``checkpoints/step-N`` and ``hf/step-N`` hold N steps: step s is in every N > s). Every version
    and checkpoint after a step descends from it, so these are what to retrain or roll back."""
    trained = [r for r in rows if r["acked"] and r["trained_step"] is not None]
    steps = sorted({int(r["trained_step"]) for r in trained})
    report: dict[str, Any] = {
        "rows": len(ids),
        "leased": len({r["trajectory_id"] for r in rows}),
        "trained": len({r["trajectory_id"] for r in trained}),
        "steps": steps,
        "versions": sorted({int(r["produced_version"]) for r in trained}),
        "models": sorted({r["model_id"] for r in trained if r["model_id"]}),
        "leases": sorted({r["lease_id"] for r in rows}),
        "per_row": {
            tid: sorted({int(r["trained_step"]) for r in trained if r["trajectory_id"] == tid}) for tid in sorted(set(ids))
        },
    }
    if run_dir is not None:
        report.update(trainer_files(steps, run_dir))
    return report


def trainer_files(steps: Sequence[int], run_dir: pathlib.Path) -> dict[str, list[str]]:
    """The checkpoints (``checkpoints/step-N``) and Hugging Face exports (``hf/step-N``) of the trainer's
    ``run_dir`` made after the first of ``steps``: ``step-N`` holds N steps, so step s is in every N > s."""
    files: dict[str, list[str]] = {"checkpoints": [], "hf_exports": []}
    if not steps:
        return files
    first = min(steps)
    for key, folder in (("checkpoints", run_dir / "checkpoints"), ("hf_exports", run_dir / "hf")):
        for d in sorted(folder.glob("step-*")) if folder.is_dir() else []:
            n = d.name.removeprefix("step-")
            if n.isdigit() and int(n) > first:
                files[key].append(str(d))
    return files


def forget_rows(
    con: duckdb.DuckDBPyConnection, ids: Sequence[str], reason: str, audit_id: str, now: float, source: str = "trajectories"
) -> int:
    """Write a tombstone (id, a SHA-256 of the content, tenant, model, when, why) for each row of
    ``source`` (``trajectories``, or a registered table of archived rows) among ``ids``, and delete
    those of ``trajectories``; returns how many tombstones. Inside the caller's transaction; the bytes
    leave the file only when the file is rewritten (``Ledger.forget``)."""
    con.register("_forget_ids", ids_table(ids))
    try:
        (n,) = con.execute(
            f"""INSERT INTO tombstones
               SELECT trajectory_id,
                      sha256(prompt_token_ids::VARCHAR || '|' || output_token_ids::VARCHAR || '|' || output_logprobs::VARCHAR),
                      coalesce(tenant, 'default'), model_id, ?, ?, ?
               FROM {source} WHERE trajectory_id IN (SELECT trajectory_id FROM _forget_ids)""",
            [now, reason, audit_id],
        ).fetchone() or (0,)
        if source == "trajectories":
            con.execute("DELETE FROM trajectories WHERE trajectory_id IN (SELECT trajectory_id FROM _forget_ids)")
    finally:
        con.unregister("_forget_ids")
    return int(n)


# ---- a tenant's view of the ledger --------------------------------------------------------------

# What a tenant's reader sees of each table: a filter over the base snapshot (catalog `base`), with
# `_t` the tenant's trajectories (archived ones included) and `$tenant` its name. A table not named
# here (a table added later, the internal ones) is copied empty: a new table is invisible to tenants
# until someone decides what of it they may see.
_ROWS = {
    "trajectories": None,  # built first, from the ledger's rows and the archive's
    "rejections": "SELECT * FROM base.rejections WHERE coalesce(tenant, 'default') = $tenant",
    "rewards": "SELECT * FROM base.rewards WHERE coalesce(tenant, 'default') = $tenant",
    "groups": """SELECT * FROM base.groups g WHERE EXISTS (
                   SELECT 1 FROM _t WHERE _t.model_id = g.model_id
                     AND CASE WHEN _t.group_id = '' THEN 'traj:' || _t.trajectory_id ELSE _t.group_id END = g.group_id)
                 OR EXISTS (SELECT 1 FROM base.rejections r WHERE coalesce(r.tenant, 'default') = $tenant
                              AND r.model_id = g.model_id AND r.group_id = g.group_id)""",
    "models": "SELECT * FROM base.models WHERE model_id IN (SELECT model_id FROM _models)",
    "policy_versions": "SELECT * FROM base.policy_versions WHERE model_id IN (SELECT model_id FROM _models)",
    "model_policies": "SELECT * FROM base.model_policies WHERE model_id IN (SELECT model_id FROM _models)",
    "leases": "SELECT * FROM base.leases WHERE trajectory_id IN (SELECT trajectory_id FROM _t)",
    "train_steps": "SELECT * FROM base.train_steps WHERE lease_id IN (SELECT lease_id FROM leases)",
    "audit": "SELECT * FROM base.audit WHERE actor_tenant = $tenant",
    "tombstones": "SELECT * FROM base.tombstones WHERE tenant = $tenant",
    "reward_versions": "SELECT * FROM base.reward_versions WHERE trajectory_id IN (SELECT trajectory_id FROM _t)",
}


def build_tenant_snapshot(base: pathlib.Path, dest: pathlib.Path, tenant: str, models: frozenset[str] | None) -> None:
    """Write to ``dest`` a DuckDB file holding only what ``tenant`` may read of the snapshot ``base``
    (``_ROWS``): its own trajectories (the archive's too, copied in: the file names no archive),
    rejections and rewards, and what hangs off them; the models it is bound to or has rows of.
    Rows are copied into fresh tables, never deleted from a copy, so no other tenant's bytes are in
    the file at all: no SQL over it can find them."""
    dest.unlink(missing_ok=True)
    con = duckdb.connect(str(dest))
    try:
        con.execute(f"ATTACH '{_literal(str(base))}' AS base (READ_ONLY)")
        tables = [
            name
            for (name,) in con.execute(
                "SELECT table_name FROM duckdb_tables() WHERE database_name = 'base' AND schema_name = 'main' "
                "AND NOT starts_with(table_name, '_') ORDER BY table_name"
            ).fetchall()
        ]
        files = archive.recorded_files(con, "base.main.archive_files")
        params = {"tenant": tenant}
        con.execute(
            "CREATE TABLE trajectories AS SELECT * FROM base.trajectories WHERE coalesce(tenant, 'default') = $tenant", params
        )
        if files.get("trajectories"):
            import pyarrow.dataset as ds

            schema = con.sql("SELECT * FROM trajectories LIMIT 0").to_arrow_table().schema
            archived = ds.dataset(files["trajectories"], schema=schema, format="parquet")
            con.register("_archived", archived)
            con.execute("INSERT INTO trajectories SELECT * FROM _archived WHERE coalesce(tenant, 'default') = $tenant", params)
            con.unregister("_archived")
        con.execute("CREATE TEMP VIEW _t AS SELECT trajectory_id, model_id, group_id FROM main.trajectories")
        bound = sorted(models or ())
        con.execute(
            "CREATE TEMP TABLE _models AS SELECT DISTINCT model_id FROM main.trajectories UNION "
            "SELECT DISTINCT model_id FROM base.rejections WHERE coalesce(tenant, 'default') = $tenant UNION "
            "SELECT unnest($bound::VARCHAR[]) AS model_id",
            {**params, "bound": bound},
        )
        ordered = [n for n in _ROWS if n in tables] + [n for n in tables if n not in _ROWS]  # leases before train_steps
        for name in ordered:
            if name == "trajectories":
                continue
            select = _ROWS.get(name)
            if name == "archive_files" or select is None:
                con.execute(f"CREATE TABLE main.{_quoted(name)} AS SELECT * FROM base.main.{_quoted(name)} LIMIT 0")
            else:
                sql = select.replace("base.", "base.main.")
                con.execute(f"CREATE TABLE main.{_quoted(name)} AS {sql}", params if "$tenant" in sql else None)
        con.execute("DETACH base")
        con.execute("CHECKPOINT")
    finally:
        con.close()


def _literal(text: str) -> str:
    return text.replace("'", "''")


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'
