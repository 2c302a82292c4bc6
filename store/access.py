"""Who may call what: the four roles, their keys, and the range checks on every numeric request field.

Each RPC belongs to one role (``RPC_ROLE``); the admin key may call every RPC. A caller sends its key
as gRPC metadata ``authorization: Bearer <key>``. With the RPC's role key configured:
- no key, or a key that is no role's key: ``UNAUTHENTICATED``;
- a valid key of a role that may not call the RPC: ``PERMISSION_DENIED``.
A role with no configured key is open (allowed only on loopback: ``check_keys`` in
rollbook/config/store.py refuses a store config that breaks the key rules). Keys are
compared in constant time against every configured key (no early exit that would tell which one
nearly matched), and never logged. docs/security.md has the table.
"""

from __future__ import annotations

import hmac
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import grpc

from rollbook.config.store import ROLES

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


class KeyRing:
    """The configured role keys; ``authorize`` is called for every RPC (and once per Submit stream)."""

    def __init__(self, keys: dict[str, str | None]):
        unknown = set(keys) - set(ROLES)
        if unknown:
            raise ValueError(f"unknown roles {sorted(unknown)}")
        self._keys = {role: key.encode() for role in ROLES if (key := keys.get(role))}

    def is_open(self, role: str) -> bool:
        return role not in self._keys

    def role_of(self, given: bytes | None) -> str | None:
        if given is None:
            return None
        found = None
        for role, key in self._keys.items():  # every key, no early exit
            if hmac.compare_digest(given, key):
                found = role
        return found

    def authorize(self, rpc: str, metadata: Metadata | None) -> str | None:
        """The caller's role (None when the RPC's role is open); raises ``Denied``."""
        need = RPC_ROLE[rpc]
        if self.is_open(need):
            return None
        given = bearer(metadata)
        role = self.role_of(given)
        if role == need or role == "admin":
            return role
        if role is None:
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
