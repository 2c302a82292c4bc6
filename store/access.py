"""Who may call what: the four roles, their keys, the tenants keys are bound to, and the range checks
on every numeric request field.

Each RPC belongs to one role (``RPC_ROLE``); the admin key may call every RPC. A caller sends its key
as gRPC metadata ``authorization: Bearer <key>``. With the RPC's role key configured:
- no key, or a key that is no role's key: ``UNAUTHENTICATED``;
- a valid key of a role that may not call the RPC: ``PERMISSION_DENIED``.
A role with no configured key is open (allowed only on loopback: ``check_keys`` in
rollbook/config/store.py refuses a store config that breaks the key rules). Keys are
compared in constant time against every configured key (no early exit that would tell which one
nearly matched), and never logged. docs/security.md has the table.

Two kinds of keys: the four role keys (``ROLLBOOK_*_KEY``; store-wide: tenant ``default``, every
model, every row) and the keys of a key file (``load_key_file``: each bound to a role, a tenant and
optionally the models it may submit for or train; a reader key of a tenant sees only that tenant's
rows). ``authorize`` answers with the ``Caller``: what the handlers need to stamp, filter and refuse
(docs/governance.md).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from rollbook.config.store import ROLES, KeyFileError, read_key_file
from rollbook.store.schema import DEFAULT_TENANT

if TYPE_CHECKING:  # pragma: no cover
    from rollbook.v1 import rollbook_pb2 as pb

# gRPC invocation metadata: (key, value) pairs, values bytes for -bin keys
Metadata = Iterable[tuple[str, str | bytes]]

RPC_ROLE = {
    "Submit": "worker",
    "SetReward": "worker",
    "PullBatch": "trainer",
    "AckBatch": "trainer",
    "PublishVersion": "trainer",
    "ReportTrainStep": "trainer",
    "Query": "reader",
    "GetStats": "reader",
    "RegisterModel": "admin",
    "GetModel": "worker",
    "SetVersionStatus": "trainer",
    "Govern": "admin",
}


class Denied(Exception):
    """A request refused before its handler runs: ``code`` and a message for the caller."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def bearer(metadata: Metadata | None) -> bytes | None:
    """The key of an ``authorization: Bearer <key>`` header, or None."""
    for k, v in metadata or ():
        if k == "authorization":
            if isinstance(v, bytes):
                v = v.decode("latin-1")
            return v[len("Bearer ") :].encode() if v.startswith("Bearer ") else None
    return None


@dataclass(frozen=True)
class Caller:
    """Who is calling, as the handlers need it. ``role`` is None when the RPC's role is open (no key
    configured: loopback only). ``scoped`` is True for a key-file key: its ``tenant`` bounds what it
    reads, and ``models`` (None: every model) what it may submit for or train. A role key
    (``ROLLBOOK_*_KEY``) and an open role are store-wide: tenant ``default``, every model, every row."""

    role: str | None
    tenant: str = DEFAULT_TENANT
    models: frozenset[str] | None = None
    scoped: bool = False
    name: str = ""  # the key's name in the key file (audit rows), or the role

    @property
    def sees_all(self) -> bool:
        """Whether this caller reads every tenant's rows (the admin role, a role key, an open role)."""
        return not self.scoped or self.role == "admin"

    def may_use(self, model_id: str) -> bool:
        return self.models is None or model_id in self.models

    def check_model(self, rpc: str, model_id: str) -> None:
        """Raise ``Denied`` (PERMISSION_DENIED) unless this key is bound to ``model_id``."""
        if not self.may_use(model_id):
            raise Denied(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{rpc}: the key {self.name!r} (tenant {self.tenant!r}) is not bound to model {model_id!r}; "
                f"it may use {', '.join(sorted(self.models or ())) or 'no model'}",
            )


OPEN = Caller(None)


def load_key_file(path: str | os.PathLike) -> list[tuple[bytes, Caller]]:
    """The keys of a key file (``rollbook.config.store.read_key_file``: format, checks), as (SHA-256
    of the key, the caller it names)."""
    return [(e.digest, Caller(e.role, e.tenant, e.models, True, e.name)) for e in read_key_file(path)]


class KeyRing:
    """The configured keys: the role keys and a key file's; ``authorize`` is called for every RPC
    (and once per Submit stream)."""

    def __init__(self, keys: dict[str, str | None], key_file: list[tuple[bytes, Caller]] | None = None):
        unknown = set(keys) - set(ROLES)
        if unknown:
            raise ValueError(f"unknown roles {sorted(unknown)}")
        self._entries = [
            (hashlib.sha256(key.encode()).digest(), Caller(role, name=role)) for role in ROLES if (key := keys.get(role))
        ]
        for hashed, caller in key_file or ():
            if any(hmac.compare_digest(hashed, h) for h, _ in self._entries):
                raise KeyFileError(f"key {caller.name!r} of the key file is also a role key (ROLLBOOK_*_KEY)")
            self._entries.append((hashed, caller))
        self._roles = {caller.role for _, caller in self._entries}
        self.multi_tenant = bool(key_file)

    def is_open(self, role: str) -> bool:
        return role not in self._roles

    def caller_of(self, given: bytes | None) -> Caller | None:
        if given is None:
            return None
        hashed = hashlib.sha256(given).digest()
        found = None
        for h, caller in self._entries:  # every key, no early exit
            if hmac.compare_digest(hashed, h):
                found = caller
        return found

    def role_of(self, given: bytes | None) -> str | None:
        caller = self.caller_of(given)
        return caller.role if caller else None

    def authorize(self, rpc: str, metadata: Metadata | None) -> Caller:
        """The caller (``OPEN`` when the RPC's role is open); raises ``Denied``."""
        need = RPC_ROLE[rpc]
        if self.is_open(need):
            return OPEN
        given = bearer(metadata)
        caller = self.caller_of(given)
        role = caller.role if caller else None
        if caller is not None and (role == need or role == "admin"):
            return caller
        if caller is None:
            what = "no key" if given is None else "a key that is no role's key"
            raise Denied(
                grpc.StatusCode.UNAUTHENTICATED,
                f"{rpc} needs the {need} key (metadata 'authorization: Bearer <key>'); got {what}",
            )
        raise Denied(grpc.StatusCode.PERMISSION_DENIED, f"the {role} key may not call {rpc}; it needs the {need} key")


# ---- numeric request fields ------------------------------------------------------------------------

MAX_LEASE_SECONDS = 7 * 86400.0
MAX_BATCH = 1_000_000  # num_samples / num_groups
MAX_VERSION = 1 << 53
MAX_STEP = 1 << 53
MAX_VOCAB = 1 << 24
MAX_QUERY_TIMEOUT_S = 3600.0
MIN_TIME, MAX_TIME = 0.0, 1e11  # unix seconds


def _finite_in(name: str, value: float, lo: float, hi: float) -> str | None:
    if not math.isfinite(value):
        return f"{name} must be a finite number, got {value}"
    if not lo <= value <= hi:
        return f"{name} must be in [{lo:g}, {hi:g}], got {value:g}"
    return None


def _int_in(name: str, value: int, lo: int, hi: int) -> str | None:
    return None if lo <= value <= hi else f"{name} must be in [{lo}, {hi}], got {value}"


def _pull(r: pb.PullBatchRequest) -> list[str | None]:
    return [
        _finite_in("lease_seconds", r.lease_seconds, 0.0, MAX_LEASE_SECONDS),
        _int_in("num_samples", r.num_samples, 0, MAX_BATCH),
        _int_in("num_groups", r.num_groups, 0, MAX_BATCH),
        _int_in("max_staleness", r.max_staleness, 0, MAX_VERSION),
        _int_in("trainer_version", r.trainer_version, 0, MAX_VERSION),
        _int_in("step", r.step, 0, MAX_STEP),
    ]


def _report(r: pb.ReportTrainStepRequest) -> list[str | None]:
    return [
        _int_in("step", r.step, 0, MAX_STEP),
        _int_in("version", r.version, 0, MAX_VERSION),
        _finite_in("started_at", r.started_at, MIN_TIME, MAX_TIME),
        _finite_in("finished_at", r.finished_at, MIN_TIME, MAX_TIME),
    ]


# SetReward's reward has no range here: the ledger checks it by the ingest rule itself (finite,
# |reward| <= IngestConfig.max_abs_reward; NONFINITE_REWARD / REWARD_OUT_OF_RANGE), one bound for both.
_FIELD_CHECKS = {
    "PullBatch": _pull,
    "Query": lambda r: [_finite_in("timeout_seconds", r.timeout_seconds, 0.0, MAX_QUERY_TIMEOUT_S)],
    "PublishVersion": lambda r: [
        _int_in("version", r.version, 0, MAX_VERSION),
        _int_in("samples_per_version", r.samples_per_version, 1, MAX_BATCH) if r.HasField("samples_per_version") else None,
    ],
    "RegisterModel": lambda r: [_int_in("vocab_size", r.vocab_size, 0, MAX_VOCAB)],
    "ReportTrainStep": _report,
    "SetVersionStatus": lambda r: [_int_in("version", r.version, 0, MAX_VERSION)],
}


def field_error(rpc: str, request: Any) -> str | None:
    """The first numeric field of ``request`` out of range (NaN, inf, negative or absurd), or None."""
    check = _FIELD_CHECKS.get(rpc)
    if check is None:
        return None
    return next((e for e in check(request) if e), None)
