"""The ingest rules of ``rollbook.validator.ingest``: a minimal valid trajectory, then one case per
rule that breaks only that rule and must get exactly its reason code; plus the vectorised
``check_batch`` agreeing with ``check`` row by row.

Run: ``python -m pytest tests/unit/validator/test_ingest_rules.py -q``.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollbook.config import IngestConfig
from rollbook.trajectories import decode, decode_messages, trajectory_from_dict
from rollbook.validator import ingest
from rollbook.validator.ingest import VersionSet
from rollbook.validator.reasons import Reason

VOCAB = 100
CONFIG = IngestConfig(max_output_tokens=8, max_prompt_tokens=6, max_id_length=16)
NAN, INF = float("nan"), float("inf")


class FakeRegistry:
    """Model ``m``: versions 0-3 (contiguous); model ``gappy``: versions 0 and 2 (1 never published)."""

    def __init__(self) -> None:
        self._vocab = {"m": VOCAB, "gappy": VOCAB}
        self._versions = {"m": [0, 1, 2, 3], "gappy": [0, 2]}

    def vocab_size(self, model_id: str) -> int | None:
        return self._vocab.get(model_id)

    def published_versions(self, model_id: str) -> VersionSet:
        return VersionSet(np.array(self._versions.get(model_id, []), dtype=np.int64))


REGISTRY = FakeRegistry()


def minimal(**fields) -> dict:
    t = dict(
        trajectory_id="t",
        model_id="m",
        prompt_token_ids=[1, 2],
        output_token_ids=[3, 4, 5],
        output_logprobs=[-0.1, -0.2, -0.3],
        output_versions=[0, 1, 1],
        temperature=1.0,
        top_p=1.0,
        reward=1.0,
    )
    t.update(fields)
    return t


def verdict(t: dict):
    return ingest.check(decode(trajectory_from_dict(t)), REGISTRY, CONFIG)


# one case per rule: (expected code, overrides that break only that rule)
CASES = {
    "missing-id": (Reason.MISSING_ID, dict(trajectory_id="")),
    "oversized-trajectory-id": (Reason.OVERSIZED, dict(trajectory_id="t" * 17)),
    "oversized-session-id": (Reason.OVERSIZED, dict(session_id="s" * 17)),
    "oversized-group-id": (Reason.OVERSIZED, dict(group_id="g" * 17)),
    "oversized-request-id": (Reason.OVERSIZED, dict(request_id="r" * 17)),
    "oversized-output": (Reason.OVERSIZED, dict(output_token_ids=[3] * 9, output_logprobs=[-0.1] * 9, output_versions=[0] * 9)),
    "oversized-prompt": (Reason.OVERSIZED, dict(prompt_token_ids=[1] * 7)),
    "empty-output": (Reason.EMPTY_OUTPUT, dict(output_token_ids=[], output_logprobs=[], output_versions=[])),
    "missing-logprobs": (Reason.MISSING_LOGPROBS, dict(output_logprobs=[])),
    "fewer-logprobs": (Reason.LENGTH_MISMATCH, dict(output_logprobs=[-0.1, -0.2])),
    "more-logprobs": (Reason.LENGTH_MISMATCH, dict(output_logprobs=[-0.1, -0.2, -0.3, -0.4])),
    "fewer-versions": (Reason.LENGTH_MISMATCH, dict(output_versions=[0, 1])),
    "no-versions": (Reason.LENGTH_MISMATCH, dict(output_versions=[])),
    "negative-output-token": (Reason.INVALID_TOKEN_ID, dict(output_token_ids=[3, -1, 5])),
    "negative-prompt-token": (Reason.INVALID_TOKEN_ID, dict(prompt_token_ids=[-4, 2])),
    "nan-logprob": (Reason.NONFINITE_LOGPROB, dict(output_logprobs=[-0.1, NAN, -0.3])),
    "neg-inf-logprob": (Reason.NONFINITE_LOGPROB, dict(output_logprobs=[-INF, -0.2, -0.3])),
    "pos-inf-logprob": (Reason.NONFINITE_LOGPROB, dict(output_logprobs=[-0.1, -0.2, INF])),
    "vllm-sentinel": (Reason.SENTINEL_LOGPROB, dict(output_logprobs=[-0.1, -9999.0, -0.3])),
    "positive-logprob": (Reason.POSITIVE_LOGPROB, dict(output_logprobs=[-0.1, 0.01, -0.3])),
    "negative-version": (Reason.UNPUBLISHED_VERSION, dict(output_versions=[-1, 0, 0])),
    "never-published-version": (Reason.UNPUBLISHED_VERSION, dict(model_id="gappy", output_versions=[0, 1, 2])),
    "decreasing-versions": (Reason.DECREASING_VERSIONS, dict(output_versions=[1, 0, 1])),
    "missing-temperature": (Reason.MISSING_SAMPLING_PARAMS, dict(temperature=None)),
    "missing-top-p": (Reason.MISSING_SAMPLING_PARAMS, dict(top_p=None)),
    "oversized-task-id": (Reason.OVERSIZED, dict(task_id="t" * 17)),
    "oversized-domain": (Reason.OVERSIZED, dict(domain="d" * 17)),
    "oversized-worker-id": (Reason.OVERSIZED, dict(worker_id="w" * 17)),
    "oversized-finish-reason": (Reason.OVERSIZED, dict(finish_reason="f" * 17)),
    "nan-temperature": (Reason.INVALID_SAMPLING_PARAMS, dict(temperature=NAN)),
    "inf-temperature": (Reason.INVALID_SAMPLING_PARAMS, dict(temperature=INF)),
    "negative-temperature": (Reason.INVALID_SAMPLING_PARAMS, dict(temperature=-0.1)),
    "nan-top-p": (Reason.INVALID_SAMPLING_PARAMS, dict(top_p=NAN)),
    "top-p-above-1": (Reason.INVALID_SAMPLING_PARAMS, dict(top_p=1.01)),
    "top-p-zero": (Reason.INVALID_SAMPLING_PARAMS, dict(top_p=0.0)),
    "top-k-below-minus-1": (Reason.INVALID_SAMPLING_PARAMS, dict(top_k=-2)),
    "nan-reward": (Reason.NONFINITE_REWARD, dict(reward=NAN)),
    "huge-reward": (Reason.REWARD_OUT_OF_RANGE, dict(reward=1e200)),
    "huge-negative-reward": (Reason.REWARD_OUT_OF_RANGE, dict(reward=-1e6 - 1)),
    "nan-created-at": (Reason.NONFINITE_CREATED_AT, dict(created_at=NAN)),
    "inf-created-at": (Reason.NONFINITE_CREATED_AT, dict(created_at=INF)),
    "huge-group-size": (Reason.INVALID_GROUP_SIZE, dict(group_size=2**32 - 1)),
    "oversized-parent-request-id": (Reason.OVERSIZED, dict(parent_request_id="p" * 17)),
    "branch-without-parent": (Reason.BRANCH_WITHOUT_PARENT, dict(branched=True)),
    "inf-reward": (Reason.NONFINITE_REWARD, dict(reward=-INF)),
    "unregistered-model": (Reason.UNREGISTERED_MODEL, dict(model_id="nobody")),
    "output-token-out-of-vocab": (Reason.TOKEN_OUT_OF_VOCAB, dict(output_token_ids=[3, VOCAB, 5])),
    "prompt-token-out-of-vocab": (Reason.TOKEN_OUT_OF_VOCAB, dict(prompt_token_ids=[1, VOCAB + 7])),
    "future-version": (Reason.FUTURE_VERSION, dict(output_versions=[3, 3, 4])),
}
INGEST_CODES = set(Reason) - {Reason.RETRY_ORPHAN, Reason.INCOMPLETE_GROUP, Reason.SINGLETON_DROPPED, Reason.STALE}


def test_the_minimal_trajectory_breaks_no_rule():
    assert verdict(minimal()) is None


def test_every_ingest_code_has_a_case():
    assert {code for code, _ in CASES.values()} == INGEST_CODES


@pytest.mark.parametrize("code,overrides", list(CASES.values()), ids=list(CASES))
def test_breaking_one_rule_gets_exactly_its_code(code, overrides):
    got = verdict(minimal(**overrides))
    assert got is not None, "accepted"
    assert got[0] == code, got
    assert got[1], "the detail explains the code"


@pytest.mark.parametrize(
    "overrides",
    [
        dict(output_logprobs=[-0.1, 5e-5, 0.0]),  # within the rounding tolerance
        dict(output_versions=[0, 0, 0]),
        dict(output_versions=[3, 3, 3]),  # the latest published version
        dict(model_id="gappy", output_versions=[0, 2, 2]),  # mixed versions, all published
        dict(prompt_token_ids=[]),
        dict(reward=None),  # reward may arrive later
        dict(output_token_ids=[0, VOCAB - 1, 5], prompt_token_ids=[VOCAB - 1]),
        dict(trajectory_id="t" * 16, session_id="s" * 16),  # at the id length limit
        dict(task_id="t" * 16, worker_id="w" * 16, domain="d" * 16, finish_reason="f" * 16),
        dict(temperature=0.0, top_p=1.0, top_k=-1),  # greedy
        dict(top_k=0, reward=1e6, created_at=1.7e9, group_size=65_536),
        dict(output_token_ids=[3] * 8, output_logprobs=[-0.1] * 8, output_versions=[0] * 8),  # at the token limit
        dict(request_id="turn-1.0", parent_request_id="turn-0.0"),  # extends its parent
        dict(request_id="turn-2.0", parent_request_id="p" * 16, branched=True),  # branched from its parent
    ],
    ids=[
        "tiny-positive",
        "one-version",
        "latest-version",
        "mixed-published",
        "no-prompt",
        "no-reward",
        "vocab-edges",
        "id-at-limit",
        "strings-at-limit",
        "greedy",
        "scalars-at-limit",
        "output-at-limit",
        "child-call",
        "branched-call",
    ],
)
def test_edges_that_stay_legal(overrides):
    assert verdict(minimal(**overrides)) is None


def test_a_branch_without_a_parent_is_rejected_after_the_evidence_rules():
    """Its detail names both fields; a trajectory that also breaks an evidence rule gets that code."""
    code, detail = verdict(minimal(request_id="turn-3.0", branched=True))
    assert code == Reason.BRANCH_WITHOUT_PARENT and "branched" in detail and "parent_request_id" in detail
    assert verdict(minimal(branched=True, created_at=NAN))[0] == Reason.NONFINITE_CREATED_AT


def test_sampling_params_are_optional_when_configured_so():
    lenient = IngestConfig(require_sampling_params=False)
    assert ingest.check(decode(trajectory_from_dict(minimal(temperature=None, top_p=None))), REGISTRY, lenient) is None


def test_a_configured_sentinel_is_caught():
    config = IngestConfig(sentinel_logprobs=[-9999.0, -1e30])
    got = ingest.check(decode(trajectory_from_dict(minimal(output_logprobs=[-0.1, -1e30, -0.3]))), REGISTRY, config)
    assert got[0] == Reason.SENTINEL_LOGPROB


# ---- the vectorised batch check ------------------------------------------------------------------


def test_check_batch_matches_check_on_every_case_mixed_with_valid_rows():
    dicts = []
    for i, (_, overrides) in enumerate(CASES.values()):
        dicts += [minimal(trajectory_id=f"ok{i}"), minimal(**overrides)]
    msgs = [trajectory_from_dict(d) for d in dicts]
    assert ingest.check_batch(decode_messages(msgs), REGISTRY, CONFIG) == [
        ingest.check(decode(m), REGISTRY, CONFIG) for m in msgs
    ]


_mutation = st.sampled_from([{}] * 3 + [o for _, o in CASES.values()])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(_mutation, st.integers(1, 8), st.integers(0, 3)), min_size=1, max_size=12))
def test_check_batch_matches_check_on_random_batches(specs):
    msgs = []
    for mutation, n, v in specs:
        t = minimal(output_token_ids=list(range(n)), output_logprobs=[-0.5] * n, output_versions=[v] * n)
        t.update(mutation)
        msgs.append(trajectory_from_dict(t))
    assert ingest.check_batch(decode_messages(msgs), REGISTRY, CONFIG) == [
        ingest.check(decode(m), REGISTRY, CONFIG) for m in msgs
    ]


def test_check_batch_flags_negative_and_out_of_vocab_prompt_tokens_like_check():
    """Prompts (some empty) are checked over the batch's flat prompt array; each row keeps its own verdict."""
    import numpy as np

    from rollbook.config import IngestConfig
    from rollbook.trajectories import decode, decode_messages, trajectory_from_dict
    from rollbook.validator.ingest import VersionSet, check, check_batch

    class Registry:
        def vocab_size(self, model_id):
            return 100

        def published_versions(self, model_id):
            return VersionSet(np.array([0], dtype=np.int64))

    prompts = [[], [-1], [5, -1], [1, 2], [150], [], [99]]
    msgs = [
        trajectory_from_dict(
            dict(
                trajectory_id=f"p{i}",
                model_id="m",
                prompt_token_ids=p,
                output_token_ids=[1],
                output_logprobs=[-1.0],
                output_versions=[0],
                temperature=1.0,
                top_p=1.0,
            )
        )
        for i, p in enumerate(prompts)
    ]
    expected = [check(decode(m), Registry(), IngestConfig()) for m in msgs]
    assert check_batch(decode_messages(msgs), Registry(), IngestConfig()) == expected
    assert [v[0] if v else None for v in expected] == [
        None,
        "INVALID_TOKEN_ID",
        "INVALID_TOKEN_ID",
        None,
        "TOKEN_OUT_OF_VOCAB",
        None,
        None,
    ]
