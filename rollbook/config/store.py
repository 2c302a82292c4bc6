"""Configuration of the store (``rollbook serve``, and the ``[store]`` section of ``rollbook run``):
``StoreConfig`` and the policies it holds, the ingest rules' limits (``IngestConfig``, read by
validator/ingest.py), group readiness and leases (``ValidatorConfig``, validator/groups.py),
grouped reward normalization (``NormConfig``, validator/normalize.py), and the ageing of trained rows into
Parquet (``AgeingConfig``, store/archive.py).

The checks a store config must pass before anything binds are here too, as plain functions over
its values: the four roles' keys (``check_keys``: every key needed off loopback, none weak, none
shared; store/access.py holds the keys at run time) and whether an address is loopback.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import pathlib
import re
import stat
import tomllib
import warnings
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# ---- roles and keys ---------------------------------------------------------------------------------

ROLES = ("worker", "trainer", "reader", "admin")

MIN_KEY_CHARS = 16
MIN_DISTINCT_CHARS = 8


def weak_key_reason(key: str) -> str | None:
    """Why ``key`` is too weak to guard a store reachable from the network, or None."""
    if any(c.isspace() for c in key):
        return "contains whitespace"
    if not key.isprintable() or not key.isascii():
        return "contains non-printable or non-ASCII characters"
    if len(key) < MIN_KEY_CHARS:
        return f"is shorter than {MIN_KEY_CHARS} characters"
    if len(set(key)) < MIN_DISTINCT_CHARS:
        return f"has fewer than {MIN_DISTINCT_CHARS} distinct characters"
    return None


def check_keys(keys: dict[str, str | None], *, loopback: bool, covered: frozenset[str] = frozenset()) -> None:
    """Off loopback every role needs its own key of reasonable strength (``secrets.token_hex(16)``
    is one); raises ``ValueError`` with a one-line message naming the env variable to fix. On
    loopback a missing key leaves its role open, but a configured key still may not hold whitespace
    nor be shared by two roles."""
    missing = [r for r in ROLES if not keys.get(r) and r not in covered]
    if not loopback and missing:
        names = ", ".join(f"ROLLBOOK_{r.upper()}_KEY" for r in missing)
        raise ValueError(
            f"a non-loopback store needs all four role keys; missing {names} "
            f"(make them with: python -c 'import secrets; print(secrets.token_hex(16))')"
        )
    for role in ROLES:
        key = keys.get(role)
        if not key:
            continue
        reason = weak_key_reason(key) if not loopback else ("contains whitespace" if any(c.isspace() for c in key) else None)
        if reason:
            raise ValueError(
                f"ROLLBOOK_{role.upper()}_KEY {reason}; use e.g. python -c 'import secrets; print(secrets.token_hex(16))'"
            )
    given = [(r, key) for r in ROLES if (key := keys.get(r))]
    for i, (a, ka) in enumerate(given):
        for b, kb in given[i + 1 :]:
            if hmac.compare_digest(ka.encode(), kb.encode()):
                raise ValueError(
                    f"ROLLBOOK_{a.upper()}_KEY and ROLLBOOK_{b.upper()}_KEY are the same key; each role needs its own"
                )


# ---- key files: keys bound to a tenant ---------------------------------------------------------------

# tenant and key names: what may appear in a snapshot's file name and an audit row
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class KeyFileError(ValueError):
    """A key file that cannot be used, with the line to fix."""


@dataclass(frozen=True)
class KeyEntry:
    """One key of a key file: the SHA-256 of the secret, and what it is bound to."""

    name: str
    role: str
    tenant: str
    models: frozenset[str] | None  # None: every model
    digest: bytes


def read_key_file(path: str | os.PathLike) -> list[KeyEntry]:
    """The keys of a TOML key file. The file must be a regular file readable by its owner alone
    (mode 0600 or 0400): it holds secrets. Format (docs/governance.md)::

        [[keys]]
        name = "team-a-worker"      # shown in audit rows; unique
        role = "worker"             # worker | trainer | reader | admin
        tenant = "team-a"
        models = ["math-a"]         # optional: the models it may submit for or train (absent: every one)
        key = "..."                 # the secret itself, or instead:
        key_sha256 = "..."          # its SHA-256 in hex (the file then holds no secret)
    """
    path = pathlib.Path(path)
    try:
        info = path.stat()
    except OSError as exc:
        raise KeyFileError(f"key file {path}: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise KeyFileError(f"key file {path} is not a regular file")
    if info.st_mode & 0o077:
        raise KeyFileError(f"key file {path} has mode {stat.S_IMODE(info.st_mode):04o}; it holds keys: chmod 600 {path}")
    try:
        doc = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"key file {path} is not TOML: {exc}") from None
    if set(doc) - {"keys"} or not isinstance(doc.get("keys"), list) or not doc["keys"]:
        raise KeyFileError(f"key file {path}: expected one or more [[keys]] tables and nothing else")
    entries: list[KeyEntry] = []
    for i, entry in enumerate(doc["keys"], 1):
        where = f"key file {path}, [[keys]] #{i}"
        if not isinstance(entry, dict):
            raise KeyFileError(f"{where}: not a table")
        extra = set(entry) - {"name", "role", "tenant", "models", "key", "key_sha256"}
        if extra:
            raise KeyFileError(f"{where}: unknown field(s) {sorted(extra)}")
        name, role, tenant = entry.get("name"), entry.get("role"), entry.get("tenant")
        for field, value in (("name", name), ("tenant", tenant)):
            if not isinstance(value, str) or not _NAME.match(value):
                raise KeyFileError(f"{where}: {field} must be 1-64 characters of letters, digits, '.', '_' or '-'")
        assert isinstance(name, str) and isinstance(tenant, str)  # checked just above
        where = f"{where} ({name})"
        if any(e.name == name for e in entries):
            raise KeyFileError(f"{where}: the name is used twice")
        if role not in ROLES:
            raise KeyFileError(f"{where}: role must be one of {', '.join(ROLES)}, got {role!r}")
        models = entry.get("models")
        if models is not None and (not isinstance(models, list) or not all(isinstance(m, str) and m for m in models)):
            raise KeyFileError(f"{where}: models must be a list of model ids")
        key, hexdigest = entry.get("key"), entry.get("key_sha256")
        if (key is None) == (hexdigest is None):
            raise KeyFileError(f"{where}: give exactly one of key and key_sha256")
        if key is not None:
            reason = weak_key_reason(key) if isinstance(key, str) else "is not a string"
            if reason:
                raise KeyFileError(f"{where}: the key {reason}")
            digest = hashlib.sha256(key.encode()).digest()
        else:
            if not isinstance(hexdigest, str) or not re.fullmatch(r"[0-9a-fA-F]{64}", hexdigest):
                raise KeyFileError(f"{where}: key_sha256 must be 64 hex digits")
            digest = bytes.fromhex(hexdigest)
        if any(hmac.compare_digest(digest, e.digest) for e in entries):
            raise KeyFileError(f"{where}: the same key appears twice")
        entries.append(KeyEntry(name, role, tenant, None if models is None else frozenset(models), digest))
    return entries


def is_loopback(host: str) -> bool:
    """``localhost`` or a loopback IP address (``[::1]`` too): where a store may run without keys and TLS."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# ---- the validator's policies ------------------------------------------------------------------------

NormMode = Literal["none", "group_mean_std", "group_mean", "leave_one_out", "batch_mean_std"]
SingletonPolicy = Literal["keep_raw", "batch_baseline", "drop"]

_GROUP_MODES = ("group_mean_std", "group_mean", "leave_one_out")
_STD_MODES = ("group_mean_std", "batch_mean_std")


class NormConfig(BaseModel):
    """Grouped reward normalization, applied when rows are served (validator/normalize.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: NormMode = Field(
        "group_mean_std",
        description="none: raw rewards. group_mean_std: (r - mean_g) / (std_g + eps). group_mean: "
        "r - mean_g. leave_one_out: r_i minus the mean of the other members of its group. "
        "batch_mean_std: (r - mean_batch) / (std_batch + eps), groups ignored.",
    )
    eps: float = Field(1e-5, ge=0.0, description="Added to the std before dividing (std modes only).")
    std_unbiased: bool = Field(
        False,
        description="Divide the sum of squares by n - 1 instead of n (std modes only). The std of a "
        "group of one is then defined as 0, never NaN; in the group modes it is unused because the "
        "singleton policy sets that row, and a one-row batch in batch_mean_std normalizes to 0.",
    )
    singleton_policy: SingletonPolicy = Field(
        "keep_raw",
        description="Group modes only (in batch_mean_std a singleton is an ordinary batch member). "
        "keep_raw: the row keeps its raw reward. batch_baseline: r minus the mean raw reward of the "
        "rows in groups of two or more (of all rows when there are none; not scaled by a std). "
        "drop: the row is flagged in NormResult.dropped, for rejection as SINGLETON_DROPPED.",
    )

    @model_validator(mode="after")
    def _warn_ignored(self) -> NormConfig:
        ignored: list[str] = []
        if self.mode not in _STD_MODES:
            ignored += [f for f in ("eps", "std_unbiased") if f in self.model_fields_set]
        if self.mode not in _GROUP_MODES and "singleton_policy" in self.model_fields_set:
            ignored.append("singleton_policy")
        if ignored:
            message = f"NormConfig: {', '.join(ignored)} has no effect with mode={self.mode!r}"
            warnings.warn(message, stacklevel=2)
        return self


class ValidatorConfig(BaseModel):
    """Group readiness, normalization and lease settings of the store."""

    model_config = ConfigDict(extra="forbid")

    norm: NormConfig = Field(default_factory=NormConfig, description="Grouped reward normalization applied when rows are served.")
    incomplete_group_policy: Literal["wait", "drop", "keep"] = Field(
        "wait",
        description="wait: wait for missing members up to group_timeout_s, then reject the group as INCOMPLETE_GROUP. "
        "drop: reject a group as soon as all its present members are rewarded but it is short of group_size. "
        "keep: after group_timeout_s serve the group with its true size (members still unrewarded then are INCOMPLETE_GROUP).",
    )
    group_timeout_s: float = Field(
        600.0, gt=0, description="How long a group may wait for members (wait / keep), from its first member's arrival."
    )
    lease_seconds: float = Field(300.0, gt=0, description="Default lease time; unacked leases expire and their rows return.")
    reward_version: str | None = Field(
        None,
        description="Serve the rewards of this named reward version (reward_versions, written by `rollbook replay "
        "reward`) instead of original_reward: normalized in the same groups, written back to trajectories.reward "
        "(original_reward stays). A group is served only when every member has an ok score in the version; the "
        "others wait. None: original_reward (docs/replay.md).",
    )


class IngestConfig(BaseModel):
    """Limits and tolerances of the ingest rules."""

    model_config = ConfigDict(extra="forbid")

    max_output_tokens: int = Field(262_144, ge=1, description="Longest accepted output (tokens); longer is OVERSIZED.")
    max_prompt_tokens: int = Field(262_144, ge=0, description="Longest accepted prompt (tokens); longer is OVERSIZED.")
    max_id_length: int = Field(
        256,
        ge=8,
        description="Longest accepted string field, in characters: every id (trajectory, session, group, "
        "request, task, model, worker), domain and finish_reason; longer is OVERSIZED.",
    )
    max_abs_reward: float = Field(
        1e6,
        gt=0,
        le=1e150,
        description="Largest accepted |reward| (at ingest: REWARD_OUT_OF_RANGE; SetReward: INVALID_ARGUMENT, "
        "message starting REWARD_OUT_OF_RANGE). Group normalization squares reward differences, so the bound keeps it "
        "finite and exact.",
    )
    max_group_size: int = Field(
        65_536,
        ge=1,
        le=2**32 - 1,
        description="Largest accepted group_size; larger is INVALID_GROUP_SIZE (a group "
        "that size never completes, and a uint64 sent for the uint32 field arrives wrapped to its low 32 bits).",
    )
    positive_logprob_tolerance: float = Field(
        1e-4, ge=0, description="A log-prob above this is POSITIVE_LOGPROB (log-softmax rounding can give tiny positives)."
    )
    sentinel_logprobs: list[float] = Field(
        default_factory=lambda: [-9999.0],
        description="Values engines write instead of a real log-prob (vLLM: -9999.0); any one of them is SENTINEL_LOGPROB.",
    )
    require_sampling_params: bool = Field(
        True, description="Reject trajectories without `temperature` and `top_p` (MISSING_SAMPLING_PARAMS)."
    )


# ---- the archive ---------------------------------------------------------------------------------------


class AgeingConfig(BaseModel):
    """Moving trained rows out of the ledger's DuckDB file into Parquet files, on a schedule inside the
    running store (``[store.ageing]``; store/archive.py, docs/schema.md "The archive"). Off by default;
    ``rollbook store age`` moves rows of a stopped store's ledger once."""

    model_config = ConfigDict(extra="forbid")

    interval_s: float = Field(
        0.0,
        ge=0,
        description="Seconds between two ageing passes of the running store; 0 (the default): the store never "
        "moves rows itself. Needs exactly one of older_than_s and keep_steps.",
    )
    older_than_s: float | None = Field(
        None,
        gt=0,
        description="Move the trained rows whose lease was acked at least this many seconds ago (7 days: 604800).",
    )
    keep_steps: int | None = Field(
        None,
        ge=0,
        description="Move the trained rows of every trainer step but the newest keep_steps: those acked at or before "
        "step (newest acked step - keep_steps); 0 moves every trained row.",
    )
    archive_dir: pathlib.Path | None = Field(
        None,
        description="Root of the Parquet files (any path, a shared file system too); None: archive/ beside the ledger "
        "(RUN_DIR/archive in a run).",
    )

    @model_validator(mode="after")
    def _one_criterion(self) -> "AgeingConfig":
        if self.older_than_s is not None and self.keep_steps is not None:
            raise ValueError("ageing: give one of older_than_s and keep_steps, not both")
        if self.interval_s > 0 and self.older_than_s is None and self.keep_steps is None:
            raise ValueError("ageing.interval_s needs older_than_s or keep_steps: which trained rows to move")
        return self


# ---- the store ---------------------------------------------------------------------------------------

MAX_MESSAGE_BYTES = 64 << 20  # the default largest gRPC message (max_message_bytes)


def _key_field(role: str, rpcs: str) -> Any:  # a pydantic FieldInfo, typed Any like Field()
    # repr=False and exclude=True: a key never shows in a log line or a dumped config
    return Field(
        None,
        repr=False,
        exclude=True,
        description=f"The {role} role's key, for {rpcs} "
        f"(env ROLLBOOK_{role.upper()}_KEY). Unset on loopback leaves those RPCs open; required off loopback.",
    )


class StoreConfig(BaseModel):
    """Configuration of ``rollbook serve`` (``--config FILE``, dotted overrides such as
    ``--validator.norm.mode group_mean``, ``rollbook serve --help-config``) and of the ``[store]``
    section of ``rollbook run``."""

    model_config = ConfigDict(extra="forbid")

    db: pathlib.Path = Field(
        pathlib.Path("runs/default/rollbook.duckdb"),
        description="DuckDB ledger file (created if missing); the write-ahead log lives beside it.",
    )
    host: str = Field(
        "127.0.0.1", description="Address to bind. A non-loopback address requires all four role keys, and TLS unless `insecure`."
    )
    port: int = Field(50551, ge=0, le=65535, description="Port to bind; 0 picks a free one.")
    worker_key: str | None = _key_field("worker", "Submit, SetReward and GetModel")
    trainer_key: str | None = _key_field("trainer", "PullBatch, AckBatch, PublishVersion and ReportTrainStep")
    reader_key: str | None = _key_field("reader", "Query and GetStats")
    admin_key: str | None = _key_field("admin", "RegisterModel and every other RPC")
    detector_tokenizers: dict[str, pathlib.Path] = Field(
        default_factory=dict,
        description="model_id -> a directory holding tokenizer.json (or the file): how the store decodes that model's "
        "rows when its policy names detector rules (`rollbook govern policy --detect`; docs/governance.md).",
    )
    keys_file: pathlib.Path | None = Field(
        None,
        description="TOML file (mode 0600) of keys bound to a role, a tenant and optionally the models they may use "
        "(env ROLLBOOK_KEYS_FILE; docs/governance.md). Its keys count for their roles; the role keys stay store-wide.",
    )
    tls_cert: pathlib.Path | None = Field(
        None, description="PEM certificate (chain) of the server; with tls_key turns TLS on (env ROLLBOOK_TLS_CERT)."
    )
    tls_key: pathlib.Path | None = Field(None, description="PEM private key of tls_cert (env ROLLBOOK_TLS_KEY).")
    tls_client_ca: pathlib.Path | None = Field(
        None, description="PEM CA that must have signed every client's certificate: mutual TLS (env ROLLBOOK_TLS_CLIENT_CA)."
    )
    insecure: bool = Field(
        False, description="Allow a non-loopback address without TLS (keys then cross the network in clear text)."
    )
    max_message_bytes: int = Field(
        MAX_MESSAGE_BYTES, ge=1 << 20, description="Largest gRPC message accepted; a bigger one is RESOURCE_EXHAUSTED."
    )
    num_workers: int = Field(
        8, ge=1, description="Threads that prepare and commit Submit batches (an open stream holds none while it waits)."
    )
    control_workers: int = Field(
        8, ge=1, description="Threads for PullBatch, AckBatch, SetReward, GetStats and the other unary RPCs."
    )
    query_threads: int = Field(
        4, ge=1, description="Threads that run Query calls (so slow queries cannot hold up the control RPCs)."
    )
    max_submit_streams: int = Field(1024, ge=1, description="Open Submit streams in all; one more is RESOURCE_EXHAUSTED.")
    max_submit_streams_per_host: int = Field(
        256, ge=1, description="Open Submit streams from one client address (host); one more is RESOURCE_EXHAUSTED."
    )
    max_streams_per_connection: int = Field(
        128,
        ge=1,
        description="Concurrent RPCs on one connection (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS); more wait in the client.",
    )
    max_concurrent_rpcs: int = Field(8192, ge=16, description="Open RPCs in all; one more is RESOURCE_EXHAUSTED.")
    stream_idle_timeout_s: float = Field(
        120.0,
        gt=0,
        le=86400,
        description="A Submit stream that sends no batch, or reads no answer, for this long is closed (DEADLINE_EXCEEDED; StoreClient reconnects).",
    )
    # The SQL sandbox (docs/sql.md). Its runtime form, QueryLimits (store/sql.py), has the same
    # defaults (tests/unit/test_config_home.py checks that they agree). Every query_* field can also
    # be set as env ROLLBOOK_<FIELD>.
    query_max_rows: int = Field(100_000, ge=1, description="Row cap of one Query; the last chunk says when it cut.")
    query_timeout_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="Per-query timeout in seconds: the default, and the most a caller may ask for (0, negative, NaN or inf mean this). A query still running query_kill_grace_s later has its sandbox process killed.",
    )
    query_kill_grace_s: float = Field(
        2.0,
        ge=0.1,
        le=60,
        description="Seconds past the timeout before the server SIGKILLs the query's sandbox process (DuckDB's own interrupt comes first).",
    )
    query_max_result_bytes: int = Field(
        256 << 20,
        ge=1 << 20,
        description="Byte cap of one Query's result (Arrow bytes); the result is cut there and the last chunk says so.",
    )
    query_memory_limit_mb: int = Field(1024, ge=64, description="DuckDB memory_limit of each sandbox process, in MiB.")
    query_process_headroom_mb: int = Field(
        768,
        ge=128,
        description="Each sandbox process's data-segment limit (RLIMIT_DATA) is query_memory_limit_mb plus this; allocations past it fail inside the sandbox.",
    )
    query_duckdb_threads: int = Field(2, ge=1, le=64, description="DuckDB threads per sandbox process.")
    query_temp_limit_mb: int = Field(
        1024,
        ge=0,
        description="Spill space per sandbox process in its private temp folder, in MiB (0: no spilling).",
    )
    query_workers: int = Field(
        2,
        ge=1,
        le=64,
        description="Sandbox processes: at most this many queries run at once. Query-engine memory is bounded by query_workers x (query_memory_limit_mb + query_process_headroom_mb).",
    )
    query_queue: int = Field(
        8,
        ge=0,
        description="Queries that may wait for a free sandbox process; more are refused with RESOURCE_EXHAUSTED.",
    )
    query_snapshot_max_age_s: float = Field(
        0.0,
        ge=0,
        description="Queries read a snapshot of the ledger; a new one is taken (checkpoint + file copy, under the ledger's lock) when the ledger changed and the current one is at least this old. 0: every query sees every acknowledged row; raise it when the ledger is large and queries frequent (see docs/sql.md for the cost).",
    )
    ingest: IngestConfig = Field(default_factory=IngestConfig, description="Limits and tolerances of the ingest rules.")
    validator: ValidatorConfig = Field(
        default_factory=ValidatorConfig, description="Group readiness, normalization and lease settings."
    )
    validate_evidence: bool = Field(
        True, description="Run the evidence rules at ingest. Off only to measure their cost (env ROLLBOOK_BENCH_NOVALIDATE=1)."
    )
    ageing: AgeingConfig = Field(
        default_factory=AgeingConfig,
        description='Trained rows moved out of DuckDB into Parquet on a schedule (off by default; docs/schema.md, "The archive").',
    )

    @model_validator(mode="after")
    def _access(self) -> "StoreConfig":
        loopback = is_loopback(self.host)
        covered: frozenset[str] = frozenset()
        if self.keys_file is not None:
            covered = frozenset(entry.role for entry in read_key_file(self.keys_file))
        check_keys(self.keys(), loopback=loopback, covered=covered)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together (--tls-cert/--tls-key, env ROLLBOOK_TLS_CERT/ROLLBOOK_TLS_KEY)")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca (mutual TLS) needs tls_cert and tls_key")
        if not loopback and self.tls_cert is None and not self.insecure:
            raise ValueError(
                f"refusing to bind non-loopback address {self.host!r} without TLS: give --tls-cert and "
                "--tls-key (env ROLLBOOK_TLS_CERT/ROLLBOOK_TLS_KEY), or --insecure to send keys in clear text"
            )
        return self

    def keys(self) -> dict[str, str | None]:
        """The role keys by role name (what store/access.py ``KeyRing`` holds)."""
        return {role: getattr(self, f"{role}_key") for role in ROLES}
