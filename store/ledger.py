"""The ledger: one DuckDB file plus its write-ahead log, with group commit and the idempotency index.

Write path: ``Ledger.submit(trajectories)`` validates the batch (``rollbook.validator.ingest``) and
builds its Arrow tables in the caller's thread (the gRPC handler does that from the request bytes,
``rollbook.store.prepare``, and calls ``commit``), reserves the ``trajectory_id``s in the idempotency
index, and joins a group commit: the first caller to take the commit lock writes every batch waiting
from all streams in one fsync'd log append, and the others find theirs done (no hand-off to a
committer thread). Only then are verdicts returned. A folder thread moves committed batches into the
DuckDB tables in large inserts, off the acknowledgement path; ``flush()`` folds everything now
(queries call it first so they see every acknowledged row). On open, whatever the log holds that
DuckDB does not is replayed.

Run directory layout: ``rollbook.duckdb`` and ``rollbook.duckdb.log/`` (the log segments; DuckDB keeps its own ``.wal`` file) side by
side, and ``archive/`` once trained rows were moved into Parquet (``age``, ``rollbook.store.archive``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import pathlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import duckdb
import numpy as np
import pyarrow as pa

from rollbook.config import IngestConfig, ValidatorConfig
from rollbook.fsync import fsync_dir
from rollbook.store import archive, governance, schema, wal
from rollbook.store.access import OPEN, Caller
from rollbook.store.detect import DetectorError, Scanner
from rollbook.store.prepare import Prepared, prepare
from rollbook.store.schema import DDL
from rollbook.store.sql import SANDBOX_CONFIG
from rollbook.trajectories import decode_messages
from rollbook.v1 import rollbook_pb2 as pb
from rollbook.validator import groups, pull
from rollbook.validator.groups import one_row
from rollbook.validator.ingest import VersionSet, reward_out_of_range
from rollbook.validator.reasons import Reason

log = logging.getLogger("rollbook.store")

ACCEPTED, DUPLICATE, REJECTED = "ACCEPTED", "DUPLICATE", "REJECTED"


class UnknownTrajectory(LookupError):
    """No stored trajectory has that id (or the session has no accepted one): SetReward's NOT_FOUND."""


class ModelNotRegistered(LookupError):
    """The model id is not in the registry (``RegisterModel`` first)."""


class ModelConflict(ValueError):
    """The model is registered with another vocabulary; its stored rows were checked against that one."""


class InvalidReward(ValueError):
    """The reward or its target is malformed (not finite, out of range, not exactly one of trajectory
    and session)."""


class NotRewardable(ValueError):
    """The trajectory exists but its reward can no longer be set (rejected, or leased or served to a trainer)."""


class UnknownVersion(LookupError):
    """No published version of the model has that number: ``SetVersionStatus``'s NOT_FOUND."""


class InvalidStatus(ValueError):
    """A version status other than ``VERSION_STATUSES``, gate figures that are not a JSON object, or a
    rollback the ledger's versions do not allow."""


# policy_versions.status: the promotion gate's verdict (docs/gate.md); NULL: a version no gate decided
VERSION_STATUSES = ("promoted", "refused", "rolled_back")


@dataclass(frozen=True)
class Outcome:
    trajectory_id: str
    status: str
    reason: str = ""
    detail: str = ""


@dataclass
class _Pending:
    """One submitted batch waiting for its group commit (its Arrow tables already built)."""

    accepted: list[str]  # trajectory ids
    rejected: list[str]
    trajectories: pa.Table | None = None
    rejections: pa.Table | None = None
    future: Future = field(default_factory=Future)


def _gate_object(status: str, gate_json: str) -> str | None:
    """``gate_json`` checked: a JSON object (None for ""), under a known ``status``."""
    if status not in VERSION_STATUSES:
        raise InvalidStatus(f"status must be one of {', '.join(VERSION_STATUSES)}, got {status!r}")
    if not gate_json:
        return None
    try:
        parsed = json.loads(gate_json)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise InvalidStatus("gate_json must be a JSON object")
    return gate_json


def _keep(table: pa.Table | None, mask: list[bool]) -> pa.Table | None:
    """The rows of ``table`` not dropped as duplicates (no copy when all stay)."""
    if table is None or all(mask):
        return table
    kept = table.filter(pa.array(mask))
    return kept if kept.num_rows else None


_CATALOG = "rollbook"
ROW_GROUP_ROWS = 2048  # DuckDB's smallest row group


def _quote(path: pathlib.Path) -> str:
    return str(path).replace("'", "''")


def _connect(db_path: pathlib.Path) -> duckdb.DuckDBPyConnection:
    """The ledger's DuckDB connection, locked down like every query connection (``SANDBOX_CONFIG``).

    The file is attached with row groups of ``ROW_GROUP_ROWS`` rows rather than DuckDB's 122,880:
    DuckDB writes the full row groups of a large insert straight into the database file instead of
    copying them through its own WAL first, and a fold of a few thousand wide rows then counts as
    large (measured here: about 40% less CPU per folded trajectory). Our log already made those rows
    durable. Attaching needs file access, so the sandbox settings are applied after it.

    One DuckDB thread: with two, an insert that keeps insertion order (a fold) is written by both
    threads and merged, which took twice the CPU per folded trajectory and left a file twice the
    size (measured here: 112 against 259 µs, 36 against 72 MiB for 6,144 trajectories of 1,000
    tokens). The ledger's own reads are a batch's rows at a time; the SQL endpoint's queries run in
    the sandbox's processes with threads of their own."""
    early: dict[str, bool | int] = {
        k: v for k, v in SANDBOX_CONFIG.items() if k not in ("enable_external_access", "lock_configuration")
    }
    early["threads"] = 1
    con = duckdb.connect(config=early)  # type: ignore[arg-type]  # dict is invariant; the values are config values
    path = str(db_path).replace("'", "''")
    con.execute(f"ATTACH '{path}' AS {_CATALOG} (ROW_GROUP_SIZE {ROW_GROUP_ROWS})")
    con.execute(f"USE {_CATALOG}")
    for key in ("enable_external_access", "lock_configuration"):
        con.execute(f"SET {key} = {str(SANDBOX_CONFIG[key]).lower()}")
    return con


@dataclass(frozen=True)
class ModelEntry:
    """A registered model as ``GetModel`` answers it. ``max_staleness`` and ``samples_per_version``
    are its trainer's last announcement (``PublishVersion``), None until one arrives: kept in memory
    only, since a trainer renews it with every version it publishes (a restarted store knows it again
    at the trainer's next step or restart)."""

    model_id: str
    vocab_size: int
    latest_version: int  # -1: none published
    max_staleness: int | None = None
    samples_per_version: int | None = None


class _Registry:
    """In-memory view of `models` and `policy_versions` (the tables are the source of truth), and
    of each model's announced staleness contract (``ModelEntry``; not in a table)."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.versions: dict[str, VersionSet] = {}
        self.contract: dict[str, tuple[int | None, int | None]] = {}  # (max_staleness, samples_per_version)
        self.generation = 0  # bumped on every change, so ingest workers know when to refresh

    def vocab_size(self, model_id: str) -> int | None:
        return self.vocab.get(model_id)

    def published_versions(self, model_id: str) -> VersionSet:
        return self.versions.get(model_id) or VersionSet()

    def add_version(self, model_id: str, version: int) -> None:
        current = self.published_versions(model_id).versions
        self.versions[model_id] = VersionSet(np.union1d(current, np.array([version], dtype=np.int64)))
        self.generation += 1

    def set_vocab(self, model_id: str, vocab_size: int) -> None:
        self.vocab[model_id] = vocab_size
        self.generation += 1


# How long an empty pull's answer is given again to the same request while nothing changes
# (``Ledger._unchanged_empty_pull``); a bound on what a missed change could delay, not a wait.
EMPTY_PULL_REUSE_S = 2.0


@dataclass(frozen=True)
class _EmptyPull:
    key: bytes  # the request, serialized
    generation: int  # the ledger's generation after it
    until: float  # time.time() from which it must be asked again
    answer: pull.LeasedBatch


class Ledger:
    """Owns the DuckDB connection, the write-ahead log and the idempotency index."""

    def __init__(
        self,
        db_path: str | pathlib.Path,
        *,
        ingest_config: IngestConfig | None = None,
        validator_config: ValidatorConfig | None = None,
        fold_interval_s: float = 0.5,
        fold_bytes: int = 256 << 20,
        fold_max_delay_s: float = 10.0,
        validate: bool = True,
        detector_tokenizers: dict[str, pathlib.Path] | None = None,
    ):
        self.db_path = pathlib.Path(db_path).absolute()  # the SQL sandbox's workers run elsewhere
        self.db_path.parent.mkdir(parents=True, exist_ok=True)
        self.ingest_config = ingest_config or IngestConfig()
        self.validator_config = validator_config or ValidatorConfig()
        self.validate = validate  # False only for benchmarks measuring what validation costs
        self.fold_interval_s = fold_interval_s
        self.fold_bytes = fold_bytes
        self.fold_max_delay_s = fold_max_delay_s
        self.con = _connect(self.db_path)
        # Snapshots copy the file through this descriptor, open as long as the ledger: closing any
        # descriptor of the file would drop DuckDB's lock on it, and another process could then open
        # the ledger for writing (a second store, `rollbook store age`).
        self._own_file = open(self.db_path, "rb")  # closed in close(), after DuckDB
        for ddl in DDL:
            self.con.execute(ddl)
        schema.upgrade(self.con)
        archive.recover(self.con)  # a move a crash cut short: its files go, its rows never left
        self.registry = _Registry()
        self._load_registry()
        self.policies = governance.load_policies(self.con)  # model_id -> Policy (copied on change: read without a lock)
        self.scanner = Scanner(detector_tokenizers)  # decodes rows for the policies' detector rules
        self._seen: dict[str, str] = {}  # trajectory_id -> first status (ACCEPTED / REJECTED)
        self._inflight: dict[str, Future] = {}
        self._index_lock = threading.Lock()
        self._db_lock = threading.RLock()  # serialises writes on self.con
        self.counters = {"duplicates": 0}
        self._generation = 0  # bumped by every committed write to DuckDB (snapshots compare it)
        # a reward was set since the last settle: the folder (or the next pull, query or stats) settles
        self._settle_due = False
        self._empty_pull: _EmptyPull | None = None  # the last pull, when it was empty (pull_batch)
        self._close_hooks: list = []
        self._forget_hooks: list = []
        self._archive_lock = threading.Lock()  # one move at a time (Ledger.age)
        self.wal_root = wal.log_root(self.db_path)
        self._unfolded: list[wal.LoggedCommit] = []
        self._unfolded_bytes = 0
        self._last_commit = time.monotonic()
        self._unfolded_lock = threading.Lock()
        self._recover()
        self._closed_segments: dict[int, int] = {}  # rotated segment -> its number of batches
        self.wal = wal.WriteAheadLog(self.wal_root, first_segment=self._next_segment, on_rotate=self._on_rotate)
        self._waiting: list[_Pending] = []  # submitted, not yet written (guarded by _waiting_lock)
        self._waiting_lock = threading.Lock()
        self._commit_lock = threading.Lock()  # held by the thread writing the current group
        self._stop = threading.Event()
        self._folder = threading.Thread(target=self._fold_loop, name="rollbook-folder", daemon=True)
        self._folder.start()

    # ---- public API -----------------------------------------------------------------------------

    def submit(self, trajectories: Sequence[pb.Trajectory], caller: Caller = OPEN) -> list[Outcome]:
        """Validate, deduplicate and durably commit one batch submitted by ``caller`` (its tenant
        stamps the rows); blocks until the group is fsync'd."""
        return self.commit(
            prepare(
                decode_messages(trajectories),
                self.registry,
                self.ingest_config,
                validate=self.validate,
                now=time.time(),
                caller=caller,
                policies=self.policies,
                scanner=self.scanner,
            )
        )

    def commit(self, prepared: Prepared) -> list[Outcome]:
        """Deduplicate a prepared batch and commit it (group commit); blocks until fsync'd.

        Only the id reservation holds the index lock; validation and conversion happened before
        (in this thread or an ingest worker), overlapping other streams' fsyncs."""
        outcomes: list[Outcome | None] = [None] * len(prepared.ids)
        keep_valid, keep_bad, waits = [], [], []  # type: ignore[var-annotated]  # filled below
        pending = _Pending([], [])
        with self._index_lock:
            for i, (tid, verdict) in enumerate(zip(prepared.ids, prepared.verdicts)):
                duplicate = bool(tid) and (tid in self._seen or tid in self._inflight)
                (keep_valid if verdict is None else keep_bad).append(not duplicate)
                if duplicate:
                    waits.append((i, tid, self._inflight.get(tid)))
                    continue
                if verdict is None:
                    pending.accepted.append(tid)
                    outcomes[i] = Outcome(tid, ACCEPTED)
                else:
                    pending.rejected.append(tid)
                    outcomes[i] = Outcome(tid, REJECTED, verdict[0], verdict[1])
                if tid:
                    self._inflight[tid] = pending.future
        if pending.accepted or pending.rejected:
            pending.trajectories = _keep(prepared.trajectories, keep_valid)
            pending.rejections = _keep(prepared.rejections, keep_bad)
            self._group_commit(pending)
            pending.future.result()  # raises if the commit failed: the client sees an error, retries
        for i, tid, fut in waits:
            outcomes[i] = self._duplicate(tid, fut)
        return outcomes  # type: ignore[return-value]

    def register_model(self, model_id: str, vocab_size: int) -> None:
        """Register ``model_id`` with its vocabulary. Registering it again with the same size changes
        nothing; another size raises ``ModelConflict``: the rows stored under the model were checked
        against the first one, so a new vocabulary needs a new model_id."""
        with self._db_lock:
            stored = self.registry.vocab_size(model_id)
            if stored == vocab_size:
                return
            if stored is not None:
                raise ModelConflict(
                    f"model {model_id!r} is registered with vocab_size {stored}, not {vocab_size}: its stored rows "
                    f"were checked against {stored}; register the other vocabulary under a new model_id"
                )
            self.con.execute("INSERT INTO models VALUES (?, ?, ?)", [model_id, vocab_size, time.time()])
            self._generation += 1
            self.registry.set_vocab(model_id, vocab_size)

    def publish_version(
        self,
        model_id: str,
        version: int,
        checksum: str,
        *,
        max_staleness: int | None = None,
        samples_per_version: int | None = None,
    ) -> int:
        """Record version ``version`` of ``model_id``; returns the latest published version. An
        announced staleness contract (either value not None) replaces the model's previous one."""
        if self.registry.vocab_size(model_id) is None:
            raise ModelNotRegistered(f"model {model_id!r} is not registered")
        with self._db_lock:  # published again (a resumed trainer): new checksum and time, the gate's verdict kept
            self.con.execute(
                "INSERT INTO policy_versions (model_id, version, checksum, published_at) VALUES (?, ?, ?, ?) "
                "ON CONFLICT (model_id, version) DO UPDATE SET checksum = excluded.checksum, published_at = excluded.published_at",
                [model_id, version, checksum, time.time()],
            )
            self._generation += 1
        self.registry.add_version(model_id, version)
        if max_staleness is not None or samples_per_version is not None:
            self.registry.contract[model_id] = (max_staleness, samples_per_version)
        latest = self.registry.published_versions(model_id).latest
        assert latest is not None  # version was just added
        return int(latest)

    def set_version_status(self, model_id: str, version: int, status: str, gate_json: str = "") -> None:
        """Record the promotion gate's verdict on a published version (``policy_versions.status`` and
        ``gate``; docs/gate.md), replacing an earlier one. Raises ``InvalidStatus`` for a status not in
        ``VERSION_STATUSES`` or figures that are not a JSON object, ``UnknownVersion`` for a version
        never published."""
        gate = _gate_object(status, gate_json)
        with self._db_lock:
            found = self.con.execute(
                "UPDATE policy_versions SET status = ?, gate = ? WHERE model_id = ? AND version = ? RETURNING version",
                [status, gate, model_id, version],
            ).fetchall()
            self._generation += 1
        if not found:
            raise UnknownVersion(f"version {version} of model {model_id!r} was never published")

    def version_record(self, model_id: str, version: int) -> tuple[str | None, str | None]:
        """A published version's status and gate figures (JSON text), each None where no gate decided
        it; ``UnknownVersion`` if it was never published."""
        with self._db_lock:
            row = self.con.execute(
                "SELECT status, gate FROM policy_versions WHERE model_id = ? AND version = ?", [model_id, version]
            ).fetchone()
        if row is None:
            raise UnknownVersion(f"version {version} of model {model_id!r} was never published")
        return row[0], None if row[1] is None else str(row[1])

    def roll_back(self, model_id: str, version: int, new_version: int, gate_json: str) -> list[int]:
        """``rollbook admin rollback`` in the ledger (docs/gate.md): every version of ``model_id`` after
        ``version`` that no gate refused becomes 'rolled_back' with ``gate_json``'s figures, and
        ``new_version`` (above every published one: ``version``'s weights again, under a new number)
        is recorded 'promoted', its checksum left for the trainer's publish. Returns the versions
        rolled back. Raises ``UnknownVersion`` when ``version`` was never published, ``InvalidStatus``
        when a gate refused it or ``new_version`` is not above the latest."""
        gate = _gate_object("rolled_back", gate_json)
        with self._db_lock:
            if self.version_record(model_id, version)[0] == "refused":
                raise InvalidStatus(
                    f"version {version} of model {model_id!r} was refused by the gate: roll back to a promoted one"
                )
            (latest,) = one_row(self.con.execute("SELECT max(version) FROM policy_versions WHERE model_id = ?", [model_id]))
            if new_version <= latest:
                raise InvalidStatus(f"the restored version {new_version} must be above the latest published, {latest}")
            self.con.execute("BEGIN TRANSACTION")
            try:
                marked = self.con.execute(
                    "UPDATE policy_versions SET status = 'rolled_back', gate = ? WHERE model_id = ? AND version > ? "
                    "AND coalesce(status, '') <> 'refused' RETURNING version",
                    [gate, model_id, version],
                ).fetchall()
                self.con.execute(
                    "INSERT INTO policy_versions (model_id, version, checksum, published_at, status, gate) "
                    "VALUES (?, ?, '', ?, 'promoted', ?)",
                    [model_id, new_version, time.time(), gate],
                )
                self.con.execute("COMMIT")
            except Exception:
                self.con.execute("ROLLBACK")
                raise
            self._generation += 1
        self.registry.add_version(model_id, new_version)
        return sorted(int(v) for (v,) in marked)

    def model_entry(self, model_id: str) -> ModelEntry:
        """The registry's entry for ``model_id`` (``GetModel``); raises ``ModelNotRegistered``."""
        vocab = self.registry.vocab_size(model_id)
        if vocab is None:
            raise ModelNotRegistered(f"model {model_id!r} is not registered")
        latest = self.registry.published_versions(model_id).latest
        max_staleness, samples = self.registry.contract.get(model_id, (None, None))
        return ModelEntry(model_id, vocab, -1 if latest is None else int(latest), max_staleness, samples)

    # ---- validator: rewards, batches, leases --------------------------------------------------

    def set_reward(self, reward: float, *, trajectory_id: str = "", session_id: str = "", tenant: str | None = None) -> str:
        """Record a (delayed) reward; with ``session_id``, for the session's last interaction.
        ``tenant``: the caller's, when its key is bound to one: another tenant's rows are unknown to
        it (the same answer as an id never seen). Raises ``InvalidReward``, ``UnknownTrajectory`` or
        ``NotRewardable`` with the reason."""
        if not math.isfinite(reward):
            raise InvalidReward(f"{Reason.NONFINITE_REWARD}: reward = {reward}")
        if abs(reward) > self.ingest_config.max_abs_reward:  # the ingest rule's bound and detail
            raise InvalidReward(f"{Reason.REWARD_OUT_OF_RANGE}: {reward_out_of_range(reward, self.ingest_config)}")
        if bool(trajectory_id) == bool(session_id):
            raise InvalidReward("give exactly one of trajectory_id and session_id")
        folded = self._fold(settle=False)  # settled in the reward's own transaction instead
        try:
            return self._set_reward(reward, trajectory_id, session_id, tenant, settle_first=folded or bool(session_id))
        except Exception:
            if folded:  # what was folded still settles
                self._settle()
            raise

    def _set_reward(self, reward: float, trajectory_id: str, session_id: str, tenant: str | None, *, settle_first: bool) -> str:
        now = time.time()
        with self._transaction() as con:
            if settle_first:  # rows just folded, and for a session its retry orphans: reward a kept attempt
                groups.settle(con, self.validator_config, now)
            if session_id:
                # the session's last interaction: of each call its consumed attempt (else its only or
                # latest one), then the latest of those by created_at (rollbook.proto, SetRewardRequest).
                # Rejected attempts count too: when the last interaction was rejected, the reward is
                # for it and goes nowhere, never to an earlier call.
                found = con.execute(
                    """WITH attempts AS (
                          SELECT trajectory_id, model_id, request_id, consumed, created_at, status, NULL AS reason
                          FROM trajectories WHERE session_id = $1 AND ($2 IS NULL OR tenant = $2)
                          UNION ALL
                          SELECT trajectory_id, model_id, request_id, consumed, created_at, NULL AS status, reason
                          FROM rejections WHERE session_id = $1 AND trajectory_id <> '' AND ($2 IS NULL OR tenant = $2)),
                        calls AS (
                          SELECT *, row_number() OVER (
                            PARTITION BY model_id, CASE WHEN request_id = '' THEN 'traj:' || trajectory_id ELSE request_id END
                            ORDER BY consumed DESC NULLS LAST, created_at DESC NULLS LAST, trajectory_id DESC) AS rk
                          FROM attempts)
                        SELECT trajectory_id, status, reason, created_at FROM calls WHERE rk = 1
                        ORDER BY created_at DESC NULLS LAST, trajectory_id DESC LIMIT 1""",
                    [session_id, tenant],
                ).fetchone()
                # a call moved into the archive was trained: when it is the session's last, the reward
                # is for it and goes nowhere, never to an earlier call still in the ledger
                (moved_at,) = one_row(
                    con.execute("SELECT max(created_at) FROM _archive_index WHERE session_id = ?", [session_id])
                )
                if moved_at is not None and (found is None or found[3] is None or found[3] <= moved_at):
                    raise NotRewardable(
                        f"the last interaction of session {session_id!r} was trained and moved to the archive; "
                        "its reward can no longer change"
                    )
                if found is None:
                    raise UnknownTrajectory(f"no trajectory in session {session_id!r}")
                if found[2] is not None:
                    raise NotRewardable(
                        f"the last interaction of session {session_id!r} (trajectory {found[0]!r}) was rejected ({found[2]})"
                    )
                found = found[:2]
            else:
                found = con.execute(
                    "SELECT trajectory_id, status FROM trajectories WHERE trajectory_id = $1 AND ($2 IS NULL OR tenant = $2)",
                    [trajectory_id, tenant],
                ).fetchone()
                if found is None:
                    rejected = con.execute(
                        "SELECT reason FROM rejections WHERE trajectory_id = $1 AND ($2 IS NULL OR tenant = $2) LIMIT 1",
                        [trajectory_id, tenant],
                    ).fetchone()
                    if rejected:
                        raise NotRewardable(f"trajectory {trajectory_id!r} was rejected ({rejected[0]}); it will never train")
                    if (
                        tenant is None
                        and con.execute(
                            "SELECT 1 FROM _archive_index WHERE trajectory_id = ? LIMIT 1", [trajectory_id]
                        ).fetchone()
                    ):
                        raise NotRewardable(
                            f"trajectory {trajectory_id!r} was trained and moved to the archive; its reward can no longer change"
                        )
                    raise UnknownTrajectory(f"unknown trajectory {trajectory_id!r}")
            tid, status = found
            # until a trainer leases it, a later reward replaces the earlier one (the rewards table
            # keeps every one); a row in a group that is ready stays ready with the new reward
            if status not in ("pending", "ready"):
                raise NotRewardable(f"trajectory {tid!r} is already {status} to a trainer; its reward can no longer change")
            con.execute("UPDATE trajectories SET reward = ?, original_reward = ? WHERE trajectory_id = ?", [reward, reward, tid])
            con.execute(
                "INSERT INTO rewards (trajectory_id, session_id, reward, source, set_at, tenant) VALUES (?, ?, ?, ?, ?, ?)",
                [tid, session_id, reward, "session" if session_id else "trajectory", now, tenant or schema.DEFAULT_TENANT],
            )
            # The group this reward completes becomes ready at the next settle, not in this call: a
            # settle reads every waiting group of the ledger, and an agent's rewards arrive one call
            # at a time. A pull settles first; the folder settles within fold_interval_s / 2 of the
            # reward; a query, snapshot or stats call settles before it reads.
            self._settle_due = True
        return tid

    def pull_batch(self, request: pb.PullBatchRequest) -> pull.LeasedBatch:
        """Lease a batch (``validator.pull.lease_batch``); raises ``InvalidPull`` for a pull that
        cannot be served. ``lease_seconds`` 0 means the configured default."""
        pull.check_request(request)
        key = request.SerializeToString(deterministic=True)
        unchanged = self._unchanged_empty_pull(key)
        if unchanged is not None:
            return unchanged
        if request.lease_seconds == 0:
            request, asked = pb.PullBatchRequest(), request  # the caller's message stays as it was
            request.CopyFrom(asked)
            request.lease_seconds = self.validator_config.lease_seconds
        self._fold(settle=False)  # lease_batch settles first
        with self._db_lock:
            with self._transaction() as con:
                now = time.time()
                leased = pull.lease_batch(con, request, self.validator_config, now)
                until = self._empty_until(con, now) if leased.table.num_rows == 0 else now
            self._settle_due = False
            # read under the lock that every write holds: no change can slip in between
            self._empty_pull = _EmptyPull(key, self._generation, until, leased) if until > now else None
        return leased

    def _unchanged_empty_pull(self, key: bytes) -> pull.LeasedBatch | None:
        """The answer of the last pull, when it was empty, asked the same, and nothing it read has
        changed since: no write to DuckDB, no batch waiting to be folded, no reward waiting to settle,
        and no lease expiry or group timeout due (``_empty_until``). A trainer waiting for rollout
        polls several times a second; each full empty pull runs a dozen statements."""
        with self._db_lock:
            empty = self._empty_pull
            if (
                empty is None
                or empty.key != key
                or empty.generation != self._generation
                or self._settle_due
                or time.time() >= empty.until
            ):
                return None
        with self._unfolded_lock:
            if self._unfolded:
                return None
        events = {name: 0 for name in empty.answer.stats.get("events", {})}
        return pull.LeasedBatch("", empty.answer.table, {**empty.answer.stats, "events": events})

    def _empty_until(self, con: duckdb.DuckDBPyConnection, now: float) -> float:
        """Until when an empty pull stays empty with no write in between: the first open lease's
        expiry (its rows return), never past ``EMPTY_PULL_REUSE_S``; ``now`` (not at all) while rows
        wait in an unsettled group, whose timeout may make it ready or drop it."""
        if (
            self.validator_config.incomplete_group_policy != "drop"
            and con.execute("SELECT 1 FROM trajectories WHERE status = 'pending' AND eligibility = 'eligible' LIMIT 1").fetchone()
        ):
            return now
        (first_expiry,) = one_row(con.execute("SELECT min(expires_at) FROM leases WHERE acked_at IS NULL AND expired_at IS NULL"))
        return min(now + EMPTY_PULL_REUSE_S, first_expiry if first_expiry is not None else now + EMPTY_PULL_REUSE_S)

    def ack_batch(self, lease_id: str, trainer_id: str) -> int:
        """Ack a lease for ``trainer_id``, which must be the trainer it was issued to."""
        with self._transaction() as con:
            return pull.ack_lease(con, lease_id, time.time(), trainer_id)

    def record_train_step(
        self, step: int, trainer_id: str, version: int, lease_id: str, started_at: float, finished_at: float, stats_json: str
    ) -> None:
        """Write (or rewrite, after a trainer restart) one row of ``train_steps``."""
        with self._transaction() as con:
            con.execute("DELETE FROM train_steps WHERE step = ? AND trainer_id = ?", [step, trainer_id])
            con.execute(
                "INSERT INTO train_steps VALUES (?, ?, ?, ?, ?, ?, ?)",
                [step, trainer_id, version, lease_id, started_at, finished_at, stats_json],
            )

    # ---- governance (store/governance.py, docs/governance.md) ----------------------------------

    def set_eligibility(self, ids: Sequence[str], state: str, *, reason: str, caller: Caller, predicate: str) -> tuple[int, str]:
        """Hold (``state`` 'held') or release ('eligible') the rows among ``ids`` (those a predicate
        matched in the SQL sandbox) and append the audit row, in one transaction; a release settles
        the groups at once (the released rows re-enter the validator's flow). Returns (rows changed,
        audit id)."""
        if state not in ("held", "eligible"):
            raise governance.GovernError(f"state must be 'held' or 'eligible', got {state!r}")
        if not reason.strip():
            raise governance.GovernError("a reason is required")
        self.flush()
        now = time.time()
        with self._transaction() as con:
            n = governance.set_eligibility(con, ids, state, reason, governance.actor(caller), now, groups.GROUP_KEY)
            audit_id = governance.audit(
                con, caller, "hold" if state == "held" else "release", predicate=predicate, reason=reason, rows=n, at=now
            )
            if state == "eligible" and n:
                groups.settle(con, self.validator_config, now)
        return n, audit_id

    def set_policy(
        self,
        model_id: str,
        tenants: Sequence[str] | None,
        require_consent: bool,
        *,
        caller: Caller,
        detectors: Sequence[str] = (),
    ) -> tuple[int, str]:
        """Set ``model_id``'s policy (``tenants`` None: every tenant; ``detectors``: ``rollbook.redact``
        rules whose hit in a row's decoded text holds it) and hold the rows not yet trained that it
        does not allow (the ingest rules hold new ones). Returns (rows held, audit id)."""
        if self.registry.vocab_size(model_id) is None:
            raise ModelNotRegistered(f"model {model_id!r} is not registered")
        detectors = tuple(detectors)
        if detectors:
            try:
                self.scanner.rules(detectors)
                self.scanner.decoder(model_id)
            except DetectorError as exc:
                raise governance.GovernError(str(exc)) from None
        policy = governance.Policy(None if tenants is None else frozenset(tenants), require_consent, detectors)
        self.flush()
        now = time.time()
        with self._transaction() as con:
            con.execute(
                "INSERT OR REPLACE INTO model_policies VALUES (?, ?, ?, ?, ?, ?)",
                [
                    model_id,
                    None if tenants is None else sorted(policy.tenants or ()),
                    require_consent,
                    governance.actor(caller),
                    now,
                    list(detectors) or None,
                ],
            )
            clauses = []
            if policy.tenants is not None:
                clauses.append("NOT list_contains($tenants::VARCHAR[], tenant)")
            if require_consent:
                clauses.append("coalesce(metadata['consent'], '') <> 'true'")
            waiting = """FROM trajectories WHERE model_id = $model AND status IN ('pending', 'ready', 'leased')
                          AND eligibility = 'eligible'"""
            params = {"model": model_id, **({"tenants": sorted(policy.tenants or ())} if policy.tenants is not None else {})}
            ids = [
                tid
                for (tid,) in con.execute(
                    f"SELECT trajectory_id {waiting} AND ({' OR '.join(clauses) or 'false'})", params
                ).fetchall()
            ]
            if detectors:  # the stored rows' texts, scanned as the ingest rule scans new ones
                rows = con.execute(
                    f"SELECT trajectory_id, prompt_token_ids, output_token_ids {waiting}", {"model": model_id}
                ).fetchall()
                prompts = self.scanner.hits(model_id, detectors, [r[1] for r in rows])
                outputs = self.scanner.hits(model_id, detectors, [r[2] for r in rows])
                ids += [r[0] for r, p, o in zip(rows, prompts, outputs) if (p or o) and r[0] not in ids]
            reason = f"policy of model {model_id!r}: {policy.describe()}"
            n = governance.set_eligibility(con, ids, "held", reason, governance.actor(caller), now, groups.GROUP_KEY)
            audit_id = governance.audit(
                con,
                caller,
                "policy",
                reason=reason,
                model_id=model_id,
                rows=n,
                detail={"tenants": tenants, "require_consent": require_consent, "detectors": list(detectors)},
                at=now,
            )
            policies = dict(self.policies)
            policies[model_id] = policy
            self.policies = policies
        return n, audit_id

    def forget(self, ids: Sequence[str], *, reason: str, caller: Caller, predicate: str) -> tuple[int, str, dict]:
        """Remove the content of the trajectories among ``ids`` everywhere the store keeps it: their
        rows (a tombstone each instead: id, content hash, tenant, when, why), the write-ahead log
        segments that logged them, archived Parquet files that hold them, the database file's free
        blocks (the file is rewritten) and the SQL snapshots (dropped; the next query takes a new
        one). Appends the audit row. Returns (rows forgotten, audit id, lineage: what trained them,
        ``governance.lineage_report`` without the trainer's files).

        Ingest pauses meanwhile (the commit lock is held: acknowledgements wait), as do pulls,
        rewards and queries' snapshots; the cost is one copy of the database file."""
        if not reason.strip():
            raise governance.GovernError("a reason is required")
        now = time.time()
        with self._archive_lock, self._commit_lock, self._db_lock:
            self._fold()  # every acknowledged batch is in DuckDB now: the log holds nothing unfolded
            con = self.con
            con.register("_lineage_ids", governance.ids_table(ids))
            try:
                lineage_rows = con.sql(governance.LINEAGE_SQL.format(ids="_lineage_ids")).to_arrow_table().to_pylist()
            finally:
                con.unregister("_lineage_ids")
            with self._transaction() as con:
                audit_id = governance.audit(con, caller, "forget", predicate=predicate, reason=reason, at=now)
                n = governance.forget_rows(con, ids, reason, audit_id, now)
                n += self._forget_archived(con, ids, reason, audit_id, now)
                # the audit row is this action's own, written first so the tombstones can name it
                con.execute("UPDATE audit SET num_rows = ? WHERE audit_id = ?", [n, audit_id])
            self.wal.rotate()  # the segments that logged the rows: all folded, so all removable
            self._drop_folded_segments(include_current=False)
            self._rewrite_file()
            self._generation += 1
        for hook in self._forget_hooks:
            hook()
        return n, audit_id, governance.lineage_report(lineage_rows, ids)

    def _forget_archived(self, con: duckdb.DuckDBPyConnection, ids: Sequence[str], reason: str, audit_id: str, now: float) -> int:
        """Tombstones for the archived rows among ``ids``, and their archive files rewritten without them."""
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        wanted = pa.array(list(ids), pa.string())
        n = 0
        for (path,) in con.execute("SELECT path FROM archive_files WHERE table_name = 'trajectories'").fetchall():
            table = pq.read_table(path)
            gone = pc.is_in(table.column("trajectory_id"), value_set=wanted)
            if not pc.any(gone).as_py():
                continue
            con.register("_archived_rows", table.filter(gone))
            try:
                n += governance.forget_rows(con, ids, reason, audit_id, now, source="_archived_rows")
            finally:
                con.unregister("_archived_rows")
            kept = table.filter(pc.invert(gone))
            target = pathlib.Path(path)
            size = archive._write_file(kept, archive.temporary_name(target))
            os.replace(archive.temporary_name(target), target)
            tokens = int(pc.sum(kept.column("num_output_tokens")).as_py() or 0)
            con.execute(
                "UPDATE archive_files SET num_rows = ?, num_output_tokens = ?, num_bytes = ? WHERE path = ?",
                [kept.num_rows, tokens, size, path],
            )
        return n

    def _rewrite_file(self) -> None:
        """Copy the database into a fresh file and put it in the ledger's place: deleted rows leave
        their bytes in DuckDB's free blocks, and a forgotten row must leave none. Under the ledger's
        lock; the ledger's connection is closed and reopened around the swap."""
        fresh = self.db_path.with_name(self.db_path.name + ".rewrite")
        for leftover in (fresh, fresh.with_name(fresh.name + ".wal")):
            leftover.unlink(missing_ok=True)
        self.con.execute("CHECKPOINT")
        self.con.close()
        try:
            copier = duckdb.connect()
            try:
                copier.execute(f"ATTACH '{_quote(self.db_path)}' AS old (READ_ONLY)")
                copier.execute(f"ATTACH '{_quote(fresh)}' AS new")
                copier.execute("COPY FROM DATABASE old TO new")
                copier.execute("DETACH old")
                copier.execute("CHECKPOINT new")
                copier.execute("DETACH new")
            finally:
                copier.close()
            with open(fresh, "rb+") as f:
                os.fsync(f.fileno())
            self._own_file.close()
            os.replace(fresh, self.db_path)
            fsync_dir(self.db_path.parent)
        finally:
            self.con = _connect(self.db_path)
            self._own_file = open(self.db_path, "rb")

    def on_forget(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` after each ``forget`` (the SQL sandbox drops its snapshots)."""
        self._forget_hooks.append(hook)

    def record_audit(
        self,
        caller: Caller,
        action: str,
        *,
        predicate: str = "",
        reason: str = "",
        model_id: str = "",
        rows: int = 0,
        detail: dict | None = None,
    ) -> str:
        """Append an audit row for an action done outside the ledger (an export); returns its id."""
        if action not in governance.ACTIONS:
            raise governance.GovernError(f"action must be one of {', '.join(governance.ACTIONS)}, got {action!r}")
        with self._transaction() as con:
            return governance.audit(
                con, caller, action, predicate=predicate, reason=reason, model_id=model_id, rows=rows, detail=detail
            )

    def transaction(self) -> contextlib.AbstractContextManager[duckdb.DuckDBPyConnection]:
        """One write transaction on the ledger under its lock, for a command that holds a stopped
        store's file and writes its own tables (``rollbook replay reward``: rollbook.store.reward_versions);
        committed on exit, rolled back on an exception, counted as a change for snapshots."""
        return self._transaction()

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[duckdb.DuckDBPyConnection]:
        with self._db_lock:
            self.con.execute("BEGIN TRANSACTION")
            try:
                yield self.con
            except BaseException:
                self.con.execute("ROLLBACK")
                raise
            self.con.execute("COMMIT")
            self._generation += 1

    def age(
        self,
        criterion: archive.Criterion,
        root: str | pathlib.Path | None = None,
        *,
        should_stop: Callable[[], bool] | None = None,
    ) -> archive.MoveResult:
        """Move the trained rows ``criterion`` picks out of DuckDB into Parquet files under ``root``
        (default ``archive/`` beside the ledger): the two-phase, crash-safe move of
        ``rollbook.store.archive``. One move at a time; ingest, pulls and queries go on meanwhile (the
        ledger's lock is held only for each move's two short transactions)."""
        target = pathlib.Path(root) if root is not None else archive.default_root(self.db_path)
        with self._archive_lock:
            return archive.move(self.cursor, self._transaction, criterion, target, should_stop=should_stop)

    def stats(self) -> dict:
        """Counters over the whole ledger (folds first, so every acknowledged row counts), rows moved
        into the archive included (``archived`` says how many of them)."""
        self.flush()
        with self._db_lock:  # a forget swaps the connection; the cursor must not outlive it
            return self._stats()

    def _stats(self) -> dict:
        cur = self.cursor()
        try:
            accepted, tokens, held = one_row(
                cur.execute(
                    "SELECT count(*), coalesce(sum(num_output_tokens), 0), count(*) FILTER (WHERE eligibility = 'held') "
                    "FROM trajectories"
                )
            )
            by_reason = cur.execute(
                "SELECT reason, count(*), coalesce(sum(num_output_tokens), 0) FROM rejections GROUP BY reason"
            ).fetchall()
            archived, archived_tokens, archive_files = archive.archived_totals(cur)
        finally:
            cur.close()
        return {
            "accepted": int(accepted) + archived,  # moved rows were accepted all the same
            "accepted_tokens": int(tokens) + archived_tokens,
            "archived": archived,
            "archive_files": archive_files,
            "duplicates": self.counters["duplicates"],
            "held": int(held),
            "rejected": sum(int(n) for _, n, _ in by_reason),
            "rejected_tokens": sum(int(t) for _, _, t in by_reason),
            "rejected_by_reason": {r: int(n) for r, n, _ in by_reason},
            "rejected_tokens_by_reason": {r: int(t) for r, _, t in by_reason},
        }

    def flush(self) -> None:
        """Fold every committed batch into DuckDB now, and settle."""
        self._fold()

    def cursor(self) -> duckdb.DuckDBPyConnection:
        with self._db_lock:
            cur = self.con.cursor()
        cur.execute(f"USE {_CATALOG}")  # a cursor starts in the in-memory catalog
        return cur

    # ---- snapshots for the SQL sandbox -----------------------------------------------------------

    def changed_since(self, generation: int) -> bool:
        """Whether a snapshot taken at ``generation`` misses anything: a later write to DuckDB, or
        acknowledged batches not yet folded."""
        with self._unfolded_lock:
            unfolded = bool(self._unfolded)
        return unfolded or generation != self._generation

    def snapshot(self, dest: str | pathlib.Path) -> int:
        """Write a consistent copy of the database file to ``dest`` and return its generation.

        Under the ledger's lock: fold every acknowledged batch, CHECKPOINT (so the file alone holds
        every committed row; DuckDB's own ``.wal`` is then empty), then clone the file (a reflink
        where the file system has one, else a kernel-side copy: about the file's size in disk
        writes, see docs/sql.md). The copy is the only thing the SQL sandbox ever opens."""
        from rollbook.store.sandbox import clone_file

        dest = pathlib.Path(dest)
        with self._db_lock:
            self._fold()
            self.con.execute("CHECKPOINT")
            generation = self._generation
            clone_file(self._own_file.fileno(), dest)
            own_wal = self.db_path.with_name(self.db_path.name + ".wal")
            if own_wal.exists() and own_wal.stat().st_size > 0:  # a checkpoint deferred by a reader
                clone_file(own_wal, dest.with_name(dest.name + ".wal"))
        return generation

    def on_close(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` first thing in ``close()`` (the SQL sandbox stops its processes)."""
        self._close_hooks.append(hook)

    def close(self) -> None:
        for hook in self._close_hooks:
            try:
                hook()
            except Exception:
                log.exception("close hook failed")
        self._stop.set()
        self._folder.join()
        self._fold()
        self.wal.close()
        self._drop_folded_segments(include_current=True)
        self.con.close()
        self._own_file.close()

    # ---- commit and fold ------------------------------------------------------------------------

    def _duplicate(self, tid: str, fut: Future | None) -> Outcome:
        if fut is not None:
            fut.result()  # if the first attempt failed this raises too, and the caller retries
        with self._index_lock:
            self.counters["duplicates"] += 1
            first = self._seen.get(tid, ACCEPTED)
        if first == REJECTED:
            return Outcome(
                tid,
                DUPLICATE,
                "",
                "trajectory_id already seen (first verdict: REJECTED); ids are unique "
                "forever, so a corrected trajectory must be sent under a new trajectory_id; nothing stored twice",
            )
        return Outcome(tid, DUPLICATE, "", f"trajectory_id already stored (first verdict: {first}); nothing stored twice")

    def _group_commit(self, pending: _Pending) -> None:
        """Leader/follower group commit: whoever takes the commit lock writes every batch waiting
        (its own and other streams') in one fsync'd append; the others find theirs done."""
        with self._waiting_lock:
            self._waiting.append(pending)
        with self._commit_lock:
            if pending.future.done():
                return  # a previous leader committed it
            with self._waiting_lock:
                group, self._waiting = self._waiting, []
            self._commit_group(group)

    def _commit_group(self, group: list[_Pending]) -> None:
        accepted = [tid for p in group for tid in p.accepted]
        rejected = [tid for p in group for tid in p.rejected]
        try:
            batch = self.wal.append(
                [p.trajectories for p in group if p.trajectories is not None],
                [p.rejections for p in group if p.rejections is not None],
            )
        except Exception as exc:  # nothing was acknowledged: release the ids so retries can land
            log.exception("commit failed")
            self._release(group)
            for p in group:
                p.future.set_exception(exc)
            return
        with self._unfolded_lock:
            self._unfolded.append(batch)
            self._unfolded_bytes += batch.nbytes
            self._last_commit = time.monotonic()
        with self._index_lock:
            for tid in accepted:
                self._seen[tid] = ACCEPTED
                self._inflight.pop(tid, None)
            for tid in rejected:
                if tid:
                    self._seen.setdefault(tid, REJECTED)
                    self._inflight.pop(tid, None)
        for p in group:
            p.future.set_result(None)

    def _release(self, group: list[_Pending]) -> None:
        with self._index_lock:
            for p in group:
                for tid in p.accepted + p.rejected:
                    self._inflight.pop(tid, None)

    def _fold_loop(self) -> None:
        """Fold in large batches: when ingest pauses for ``fold_interval_s``, when the unfolded
        log exceeds ``fold_bytes``, or at the latest ``fold_max_delay_s`` after the oldest batch;
        otherwise settle, every ``fold_interval_s / 2``, when rewards were set since the last settle.
        Queries and pulls fold on demand (``flush``), so nothing waits for this loop."""
        while not self._stop.wait(self.fold_interval_s / 2):
            with self._unfolded_lock:
                idle = time.monotonic() - self._last_commit >= self.fold_interval_s
                fold = bool(self._unfolded) and (
                    idle
                    or self._unfolded_bytes >= self.fold_bytes
                    or time.monotonic() - self._unfolded[0].committed_at >= self.fold_max_delay_s
                )
            try:
                if fold:
                    self._fold()
                elif self._settle_due:
                    self._settle()
            except Exception:
                log.exception("fold or settle failed; will retry")

    def _settle(self) -> None:
        """Settle the ledger (``validator.groups.settle``) in a transaction of its own."""
        with self._db_lock:
            with self._transaction() as con:
                groups.settle(con, self.validator_config, time.time())
            self._settle_due = False

    def _fold(self, *, settle: bool = True) -> bool:
        """Fold every committed batch into DuckDB, then settle (``settle``: off for a caller that settles
        in its own transaction next, so the rows wait one statement longer, not two settles); returns
        whether there was anything to fold."""
        with self._db_lock:
            with self._unfolded_lock:
                batches, self._unfolded, self._unfolded_bytes = self._unfolded, [], 0
            if not batches:
                if settle and self._settle_due:
                    self._settle()
                return False
            try:
                self._fold_batches(batches)
            except Exception:
                with self._unfolded_lock:
                    self._unfolded = batches + self._unfolded
                    self._unfolded_bytes += sum(b.nbytes for b in batches)
                raise
            if settle:
                self._settle()
        self._drop_folded_segments(include_current=False)
        return True

    def _fold_batches(self, batches: list[wal.LoggedCommit]) -> None:
        trajs = [b.trajectories for b in batches if b.trajectories is not None]
        rejs = [b.rejections for b in batches if b.rejections is not None]
        marks: dict[int, int] = {}
        for b in batches:
            marks[b.segment] = max(marks.get(b.segment, 0), b.index + 1)
        cur = self.con
        cur.execute("BEGIN TRANSACTION")
        try:
            if trajs:
                cur.register("_fold_traj", pa.concat_tables(trajs))
                cur.execute(
                    "INSERT INTO trajectories BY NAME SELECT *, 'ingest' AS eligibility_set_by, "
                    "received_at AS eligibility_set_at FROM _fold_traj"
                )
                cur.unregister("_fold_traj")
            if rejs:
                cur.register("_fold_rej", pa.concat_tables(rejs))
                cur.execute("INSERT INTO rejections BY NAME SELECT * FROM _fold_rej")
                cur.unregister("_fold_rej")
            for seg, n in marks.items():
                cur.execute("INSERT OR REPLACE INTO _log_state VALUES (?, ?)", [seg, n])
            cur.execute("COMMIT")
            self._generation += 1
        except Exception:
            cur.execute("ROLLBACK")
            raise

    def _on_rotate(self, segment: int, num_batches: int) -> None:
        with self._unfolded_lock:
            self._closed_segments[segment] = num_batches

    def _drop_folded_segments(self, *, include_current: bool) -> None:
        """Delete log segments whose every batch is in DuckDB (their watermark rows stay, so segment
        numbers are never reused)."""
        with self._db_lock:
            folded = dict(self.con.execute("SELECT segment, folded_batches FROM _log_state").fetchall())
        with self._unfolded_lock:
            closed = dict(self._closed_segments)
        if include_current:
            closed[self.wal.segment] = self.wal.index
        for seg, total in closed.items():
            if folded.get(seg, 0) >= total:
                wal.remove_segment(self.wal_root, seg)
                with self._unfolded_lock:
                    self._closed_segments.pop(seg, None)

    # ---- startup ----------------------------------------------------------------------------------

    def _load_registry(self) -> None:
        for model_id, vocab in self.con.execute("SELECT model_id, vocab_size FROM models").fetchall():
            self.registry.set_vocab(model_id, int(vocab))
        for model_id, version in self.con.execute("SELECT model_id, version FROM policy_versions").fetchall():
            self.registry.add_version(model_id, int(version))

    def _recover(self) -> None:
        """Replay log batches DuckDB has not folded, then load the idempotency index."""
        replay = wal.unfolded(self.con, self.wal_root)
        if replay:
            log.info("replaying %d committed batch(es) from the write-ahead log", len(replay))
            self._fold_batches(replay)
        segments = wal.list_segments(self.wal_root)
        marks = [s for (s,) in self.con.execute("SELECT segment FROM _log_state").fetchall()]
        self._next_segment = max(segments + marks, default=0) + 1
        for seg in segments:  # all folded now
            wal.remove_segment(self.wal_root, seg)
        for (tid,) in self.con.execute("SELECT trajectory_id FROM rejections").fetchall():
            self._seen[tid] = REJECTED
        for (tid,) in self.con.execute("SELECT trajectory_id FROM trajectories").fetchall():
            self._seen[tid] = ACCEPTED
        for (tid,) in self.con.execute("SELECT trajectory_id FROM _archive_index").fetchall():
            self._seen[tid] = ACCEPTED  # moved into the archive: still an id seen
        for (tid,) in self.con.execute("SELECT trajectory_id FROM tombstones").fetchall():
            self._seen[tid] = ACCEPTED  # forgotten: its id stays taken, so a retry cannot bring the content back
        self.con.execute("CHECKPOINT")
