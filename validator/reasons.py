"""Stable rejection reason codes.

Each code is documented in ``docs/evidence.md`` (what it catches, why it matters for the gradient).
Codes are part of the public contract: they appear in ``Verdict.reason`` and ``rejections.reason``.
"""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    # structural (checked at ingest, before anything is stored)
    MISSING_ID = "MISSING_ID"
    OVERSIZED = "OVERSIZED"
    INVALID_TOKEN_ID = "INVALID_TOKEN_ID"
    MISSING_LOGPROBS = "MISSING_LOGPROBS"
    LENGTH_MISMATCH = "LENGTH_MISMATCH"
    NONFINITE_LOGPROB = "NONFINITE_LOGPROB"
    POSITIVE_LOGPROB = "POSITIVE_LOGPROB"
    SENTINEL_LOGPROB = "SENTINEL_LOGPROB"
    EMPTY_OUTPUT = "EMPTY_OUTPUT"
    MISSING_SAMPLING_PARAMS = "MISSING_SAMPLING_PARAMS"
    INVALID_SAMPLING_PARAMS = "INVALID_SAMPLING_PARAMS"
    NONFINITE_REWARD = "NONFINITE_REWARD"
    REWARD_OUT_OF_RANGE = "REWARD_OUT_OF_RANGE"
    NONFINITE_CREATED_AT = "NONFINITE_CREATED_AT"
    INVALID_GROUP_SIZE = "INVALID_GROUP_SIZE"
    BRANCH_WITHOUT_PARENT = "BRANCH_WITHOUT_PARENT"
    DECREASING_VERSIONS = "DECREASING_VERSIONS"
    # against the registry (models, published versions)
    UNREGISTERED_MODEL = "UNREGISTERED_MODEL"
    TOKEN_OUT_OF_VOCAB = "TOKEN_OUT_OF_VOCAB"
    UNPUBLISHED_VERSION = "UNPUBLISHED_VERSION"
    FUTURE_VERSION = "FUTURE_VERSION"
    # at group / session close and at pull time
    RETRY_ORPHAN = "RETRY_ORPHAN"
    INCOMPLETE_GROUP = "INCOMPLETE_GROUP"
    SINGLETON_DROPPED = "SINGLETON_DROPPED"
    STALE = "STALE"
