"""The one Arrow schema of stored trajectories, and the DuckDB DDL of every ledger table.

The ``.proto`` is the wire contract; ``store/tables.py`` turns it once into ``TRAJECTORY_SCHEMA``, and
everything downstream (the write-ahead log, DuckDB, ``PullBatch``) speaks that schema. Each column's
meaning and invariant is documented in ``docs/schema.md``; keep the two in step.
"""

from __future__ import annotations

import duckdb
import pyarrow as pa

from rollbook.store import reward_versions

# Trajectory.metadata (a string map) as stored
METADATA_TYPE = pa.map_(pa.string(), pa.string())
# the tenant of a row stored before tenants existed, and of every caller of a single-tenant store
DEFAULT_TENANT = "default"

# Invariants (enforced at ingest by rollbook.validator):
#   len(output_logprobs) == len(output_versions) == len(output_token_ids) == num_output_tokens > 0
#   min_version == min(output_versions), max_version == max(output_versions)
TRAJECTORY_SCHEMA = pa.schema(
    [
        ("trajectory_id", pa.string()),
        ("session_id", pa.string()),
        ("group_id", pa.string()),
        ("group_size", pa.uint32()),
        ("request_id", pa.string()),
        ("attempt", pa.uint32()),
        ("consumed", pa.bool_()),
        ("task_id", pa.string()),
        ("domain", pa.string()),
        ("model_id", pa.string()),
        ("prompt_token_ids", pa.list_(pa.int32())),
        ("output_token_ids", pa.list_(pa.int32())),
        ("output_logprobs", pa.list_(pa.float32())),
        ("output_versions", pa.list_(pa.int64())),
        ("num_prompt_tokens", pa.int32()),
        ("num_output_tokens", pa.int32()),
        ("min_version", pa.int64()),
        ("max_version", pa.int64()),
        ("temperature", pa.float32()),
        ("top_p", pa.float32()),
        ("top_k", pa.int32()),
        ("finish_reason", pa.string()),
        ("reward", pa.float64()),
        ("original_reward", pa.float64()),
        ("worker_id", pa.string()),
        ("created_at", pa.float64()),
        ("received_at", pa.float64()),
        # the call tree of a session, last (see ADDED_COLUMNS)
        ("parent_request_id", pa.string()),
        ("branched", pa.bool_()),
        # governance (docs/governance.md): the submitting key's tenant, the call's metadata, and the
        # training eligibility the ingest rules gave the row ('eligible' or 'held', with a reason)
        ("tenant", pa.string()),
        ("metadata", METADATA_TYPE),
        ("eligibility", pa.string()),
        ("eligibility_reason", pa.string()),
    ]
)

REJECTION_SCHEMA = pa.schema(
    [
        ("trajectory_id", pa.string()),
        ("reason", pa.string()),
        ("detail", pa.string()),
        ("stage", pa.string()),
        ("session_id", pa.string()),
        ("group_id", pa.string()),
        ("request_id", pa.string()),
        ("model_id", pa.string()),
        ("domain", pa.string()),
        ("worker_id", pa.string()),
        ("num_output_tokens", pa.int64()),
        ("rejected_at", pa.float64()),
        # last, so that files made before them (ALTER TABLE ... ADD COLUMN below) have the same order
        ("consumed", pa.bool_()),
        ("created_at", pa.float64()),
        ("parent_request_id", pa.string()),
        ("branched", pa.bool_()),
        ("tenant", pa.string()),
    ]
)

# Columns added to both schemas after files and log segments were made without them, with the
# value a row made before them reads: that of a trajectory that does not set the field (no parent
# call, not branched). Every file gets them through ALTER TABLE (DDL below), a new one too, so that
# old and new files have one column order (in `trajectories` they come after `status`); a log
# segment written before them replays with these values (store/wal.py).
ADDED_COLUMNS: dict[str, str | bool | None] = {
    "parent_request_id": "",
    "branched": False,
    # governance: a row stored before tenants is the default tenant's, eligible, with no metadata
    "tenant": DEFAULT_TENANT,
    "metadata": None,
    "eligibility": "eligible",
    "eligibility_reason": "",
}

_DUCK_TYPES = {
    pa.string(): "VARCHAR",
    pa.uint32(): "UINTEGER",
    pa.bool_(): "BOOLEAN",
    pa.int32(): "INTEGER",
    pa.int64(): "BIGINT",
    pa.float32(): "FLOAT",
    pa.float64(): "DOUBLE",
    pa.list_(pa.int32()): "INTEGER[]",
    pa.list_(pa.float32()): "FLOAT[]",
    pa.list_(pa.int64()): "BIGINT[]",
    METADATA_TYPE: "MAP(VARCHAR, VARCHAR)",
}


def _columns_ddl(schema: pa.Schema) -> str:
    return ",\n  ".join(f"{f.name} {_DUCK_TYPES[f.type]}" for f in schema if f.name not in ADDED_COLUMNS)


def _sql_literal(value: str | bool | None) -> str:
    if value is None:
        return "NULL"
    return ("true" if value else "false") if isinstance(value, bool) else "'" + value.replace("'", "''") + "'"


def _add_columns_ddl(table: str, schema: pa.Schema) -> list[str]:
    return [
        f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {name} {_DUCK_TYPES[schema.field(name).type]} "
        f"DEFAULT {_sql_literal(value)}"
        for name, value in ADDED_COLUMNS.items()
        if name in schema.names
    ]


# A group is the samples of one prompt from one policy: one per (model_id, group_id).
_GROUPS_DDL = """CREATE TABLE IF NOT EXISTS groups (
  model_id VARCHAR, group_id VARCHAR, expected_size UINTEGER, num_members UINTEGER,
  num_rewarded UINTEGER, status VARCHAR, ready_at DOUBLE, closed_at DOUBLE, PRIMARY KEY (model_id, group_id))"""

# Tables written by the store. `trajectories` and `rejections` follow the Arrow schemas above;
# the small control tables are written directly. `_log_state` is internal (the fold watermark of
# the write-ahead log) and not part of the documented surface, as are `_archive_moves` and `_archive_index`.
DDL = [
    # `status` is the validator's lifecycle column (pending -> ready -> leased -> trained); it is
    # not in the log schema: folds insert BY NAME and new rows start 'pending'.
    f"CREATE TABLE IF NOT EXISTS trajectories (\n  {_columns_ddl(TRAJECTORY_SCHEMA)},\n  status VARCHAR DEFAULT 'pending'\n)",
    f"CREATE TABLE IF NOT EXISTS rejections (\n  {_columns_ddl(REJECTION_SCHEMA)}\n)",
    # files made before `rejections.consumed` existed (retry orphans need it: docs/evidence.md)
    "ALTER TABLE rejections ADD COLUMN IF NOT EXISTS consumed BOOLEAN",
    # and before `rejections.created_at` (a session's last interaction may be a rejected one)
    "ALTER TABLE rejections ADD COLUMN IF NOT EXISTS created_at DOUBLE",
    # the call tree (parent_request_id, branched): every file, old or new (ADDED_COLUMNS)
    *_add_columns_ddl("trajectories", TRAJECTORY_SCHEMA),
    *_add_columns_ddl("rejections", REJECTION_SCHEMA),
    """CREATE TABLE IF NOT EXISTS rewards (
  trajectory_id VARCHAR, session_id VARCHAR, reward DOUBLE, source VARCHAR, set_at DOUBLE)""",
    # the tenant of the key that set the reward (every file; a reward set before tenants: the default's)
    f"ALTER TABLE rewards ADD COLUMN IF NOT EXISTS tenant VARCHAR DEFAULT '{DEFAULT_TENANT}'",
    # who last changed a row's eligibility, and when (NULL: the ingest rules, at received_at)
    "ALTER TABLE trajectories ADD COLUMN IF NOT EXISTS eligibility_set_by VARCHAR",
    "ALTER TABLE trajectories ADD COLUMN IF NOT EXISTS eligibility_set_at DOUBLE",
    # each model's tenant policy (docs/governance.md): the tenants whose rows may train it (NULL:
    # every tenant), whether a row needs metadata consent = 'true', and the detector rules whose hit holds a row
    """CREATE TABLE IF NOT EXISTS model_policies (
  model_id VARCHAR PRIMARY KEY, tenants VARCHAR[], require_consent BOOLEAN, set_by VARCHAR, set_at DOUBLE,
  detectors VARCHAR[])""",
    # every governance action, appended and never updated: who (the key's role and tenant), when,
    # what, over which predicate, why, and how many rows it changed
    # what is left of a forgotten trajectory (`rollbook forget`): its id (still an idempotency key),
    # a hash of its content, whose it was, when and why it went
    """CREATE TABLE IF NOT EXISTS tombstones (
  trajectory_id VARCHAR, content_sha256 VARCHAR, tenant VARCHAR, model_id VARCHAR, forgotten_at DOUBLE,
  reason VARCHAR, audit_id VARCHAR)""",
    """CREATE TABLE IF NOT EXISTS audit (
  audit_id VARCHAR, acted_at DOUBLE, actor_role VARCHAR, actor_tenant VARCHAR, action VARCHAR, predicate VARCHAR,
  reason VARCHAR, model_id VARCHAR, num_rows BIGINT, detail JSON)""",
    _GROUPS_DDL,
    """CREATE TABLE IF NOT EXISTS models (
  model_id VARCHAR PRIMARY KEY, vocab_size UINTEGER, registered_at DOUBLE)""",
    """CREATE TABLE IF NOT EXISTS policy_versions (
  model_id VARCHAR, version BIGINT, checksum VARCHAR, published_at DOUBLE,
  PRIMARY KEY (model_id, version))""",
    # the promotion gate's verdict per version ('promoted', 'refused', 'rolled_back'; NULL: no gate
    # decided it) and its figures (docs/gate.md); added to every file, so old and new ones have one
    # column order (a version published before them reads NULL)
    "ALTER TABLE policy_versions ADD COLUMN IF NOT EXISTS status VARCHAR",
    "ALTER TABLE policy_versions ADD COLUMN IF NOT EXISTS gate JSON",
    """CREATE TABLE IF NOT EXISTS leases (
  lease_id VARCHAR, trajectory_id VARCHAR, trainer_id VARCHAR, step BIGINT,
  trainer_version BIGINT, issued_at DOUBLE, expires_at DOUBLE, acked_at DOUBLE, expired_at DOUBLE)""",
    # each row's index in its served batch and the advantage it was served with (`rollbook replay
    # step` reruns a step from them); added to every file, so old and new ones have one column order
    # (a lease made before them reads NULL)
    "ALTER TABLE leases ADD COLUMN IF NOT EXISTS position INTEGER",
    "ALTER TABLE leases ADD COLUMN IF NOT EXISTS advantage FLOAT",
    # an ack finds its lease's rows by lease_id among every lease ever issued: without an index that is
    # a scan of the whole table per AckBatch (10 ms at ten million rows, 1 ms with it; built once, about
    # a second per ten million rows, when a file from before it opens)
    "CREATE INDEX IF NOT EXISTS leases_lease_id ON leases (lease_id)",
    """CREATE TABLE IF NOT EXISTS train_steps (
  step BIGINT, trainer_id VARCHAR, version BIGINT, lease_id VARCHAR, started_at DOUBLE,
  finished_at DOUBLE, stats JSON)""",
    """CREATE TABLE IF NOT EXISTS _log_state (
  segment BIGINT PRIMARY KEY, folded_batches BIGINT)""",
    # The archive (store/archive.py): every Parquet file holding rows moved out of a table, recorded
    # in the transaction that deleted those rows; and the moves under way (their planned files), so a
    # start after a crash removes what a move wrote but never recorded.
    """CREATE TABLE IF NOT EXISTS archive_files (
  path VARCHAR PRIMARY KEY, table_name VARCHAR, model_id VARCHAR, date DATE, num_rows BIGINT,
  num_output_tokens BIGINT, num_bytes BIGINT, move_id VARCHAR, moved_at DOUBLE)""",
    """CREATE TABLE IF NOT EXISTS _archive_moves (
  move_id VARCHAR PRIMARY KEY, paths VARCHAR[], started_at DOUBLE)""",
    # what the ledger still needs to know of a moved trajectory: its id (an idempotency key forever)
    # and its session's last interaction (SetReward by session); internal
    """CREATE TABLE IF NOT EXISTS _archive_index (
  trajectory_id VARCHAR, session_id VARCHAR, created_at DOUBLE)""",
]

TABLES = [
    "trajectories",
    "rejections",
    "rewards",
    "groups",
    "models",
    "policy_versions",
    "leases",
    "train_steps",
    "archive_files",
    "model_policies",
    "audit",
    "tombstones",
]

# Named reward versions (store/reward_versions.py, ``rollbook replay reward``): documented, readable tables.
DDL += reward_versions.DDL
TABLES += reward_versions.TABLES


def upgrade(con: duckdb.DuckDBPyConnection) -> None:
    """Bring a file made by an older store to ``DDL``'s shape, after ``DDL`` ran: a ``groups`` table
    keyed by ``group_id`` alone gets ``model_id`` (its members' model) and the key (model_id, group_id)."""
    (has_model,) = con.execute(
        "SELECT count(*) FROM duckdb_columns() WHERE database_name = current_database() "
        "AND table_name = 'groups' AND column_name = 'model_id'"
    ).fetchone() or (0,)
    if has_model:
        return
    con.execute(_GROUPS_DDL.replace("groups (", "groups_by_model (", 1))
    con.execute(
        """INSERT INTO groups_by_model
           SELECT coalesce(m.model_id, ''), g.group_id, g.expected_size, g.num_members, g.num_rewarded, g.status,
                  g.ready_at, g.closed_at
           FROM groups g LEFT JOIN (
             SELECT CASE WHEN group_id = '' THEN 'traj:' || trajectory_id ELSE group_id END AS group_id,
                    min(model_id) AS model_id
             FROM trajectories GROUP BY ALL) m USING (group_id)"""
    )
    con.execute("DROP TABLE groups")
    con.execute("ALTER TABLE groups_by_model RENAME TO groups")
