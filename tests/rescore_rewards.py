"""``module:function`` rewards for the re-scoring tests (unit and integration): imported by name in the
reward pool's processes (``tests.rescore_rewards:NAME``), as a user's own reward module would be."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any


def answer_length(completion: str, row: Mapping[str, Any]) -> float:
    """A reward no run used: the completion's length, 1000 more when it is the task's answer. Every
    score is distinct from the toy verifiers' 0/1, so a test can tell which reward a row got."""
    return len(completion) + (1000.0 if row.get("answer") is not None and completion.strip() == row["answer"] else 0.0)


def refuses_reverse(completion: str, row: Mapping[str, Any]) -> float:
    """Raises on every row of the ``reverse`` domain: those must be recorded as errors, not 0.0."""
    if row["domain"] == "reverse":
        raise ValueError("this verifier cannot judge reversals")
    return 1.0


def misbehaves(completion: str, row: Mapping[str, Any]) -> float:
    """By the completion: ``crash`` kills the verifier's process, ``hang`` never answers in time, ``nan``
    is not a reward; anything else scores its length."""
    if completion == "crash":
        os._exit(3)
    if completion == "hang":
        time.sleep(60)
    if completion == "nan":
        return float("nan")
    return float(len(completion))


def digits(completion: str, row: Mapping[str, Any]) -> float:
    """The number of digits in the completion: not a function of right or wrong, so advantages
    normalized from it differ from the run's own."""
    return float(sum(c.isdigit() for c in completion))
