"""Property tests of the ingest rules (``rollbook.validator.ingest.check``) on arbitrary protobuf
``Trajectory`` messages: random field values (NaN/inf floats, extreme ints within each field's
range, random lengths, random unicode ids) against a fake registry.

Properties: ``check`` never raises and returns ``None`` or exactly one ``(Reason, str)``; what it
accepts meets every invariant ``docs/schema.md`` states for ``trajectories``; the vectorised
``check_batch`` the store uses agrees with it row by row; and a valid trajectory with one field
broken gets exactly that field's code.

Run: python -m pytest tests/unit/validator/test_ingest_fuzz.py -q
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollbook.config import IngestConfig
from rollbook.trajectories import decode, decode_messages
from rollbook.v1 import rollbook_pb2 as pb
from rollbook.validator.ingest import STRING_FIELDS, VersionSet, check, check_batch
from rollbook.validator.reasons import Reason

INT32 = (-(2**31), 2**31 - 1)
UINT32 = (0, 2**32 - 1)
INT64 = (-(2**63), 2**63 - 1)
PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass
class FakeRegistry:
    """The two questions the rules ask, answered from plain dicts."""

    vocab: dict[str, int] = field(default_factory=dict)
    versions: dict[str, list[int]] = field(default_factory=dict)

    def vocab_size(self, model_id: str) -> int | None:
        return self.vocab.get(model_id)

    def published_versions(self, model_id: str) -> VersionSet:
        return VersionSet(np.array(sorted(set(self.versions.get(model_id, []))), dtype=np.int64))


# ---- strategies ------------------------------------------------------------------------------

ids = st.text(max_size=300) | st.sampled_from(["", "m", "tiny"])
float32s = st.floats(width=32)  # includes NaN, +-inf, subnormals, -0.0
small_versions = st.integers(-2, 6)
any_version = st.integers(*INT64)


@st.composite
def token_lists(draw, min_size: int = 0, max_size: int = 40) -> list[int]:
    """Half the time plausible ids (0..80), half the time anything an int32 holds."""
    ints = st.integers(0, 80) if draw(st.booleans()) else st.integers(-3, 80) | st.integers(*INT32)
    return draw(st.lists(ints, min_size=min_size, max_size=max_size))


@st.composite
def trajectories(draw) -> pb.Trajectory:
    """Anything the wire can carry. Each list is plausible or wild by a coin flip, and the three
    per-token lists share one length half the time, so every rule is reached, not only the first."""
    n = draw(st.integers(0, 40))
    same = draw(st.booleans())
    lengths = [n] * 3 if same else [draw(st.integers(0, 40)) for _ in range(3)]
    tokens = draw(token_lists(min_size=lengths[0], max_size=lengths[0]))
    lp = st.floats(-20, 0, width=32) if draw(st.booleans()) else float32s | st.sampled_from([-9999.0, 1e-5, 2e-4])
    logprobs = draw(st.lists(lp, min_size=lengths[1], max_size=lengths[1]))
    plausible_versions = draw(st.booleans())
    versions = draw(
        st.lists(small_versions if plausible_versions else small_versions | any_version, min_size=lengths[2], max_size=lengths[2])
    )
    if plausible_versions:
        versions.sort()
    msg = pb.Trajectory(
        trajectory_id=draw(st.text(min_size=1, max_size=40) | ids),
        session_id=draw(ids),
        group_id=draw(ids),
        request_id=draw(ids),
        group_size=draw(st.integers(*UINT32)),
        attempt=draw(st.integers(*UINT32)),
        consumed=draw(st.booleans()),
        task_id=draw(ids),
        domain=draw(ids),
        model_id=draw(st.sampled_from(["tiny", "big", "unknown", ""]) | ids),
        prompt_token_ids=draw(token_lists()),
        output_token_ids=tokens,
        output_logprobs=logprobs,
        output_versions=versions,
        finish_reason=draw(ids),
        worker_id=draw(ids),
        created_at=draw(st.floats(allow_nan=True, allow_infinity=True)),
        parent_request_id=draw(ids),
        branched=draw(st.booleans()),
    )
    for name, strategy in (
        ("temperature", float32s),
        ("top_p", float32s),
        ("top_k", st.integers(*INT32)),
        ("reward", st.floats()),
    ):
        if draw(st.integers(0, 3)):  # set three times in four
            setattr(msg, name, draw(strategy))
    return msg


@st.composite
def small_registries(draw) -> FakeRegistry:
    """Model "tiny" registered with a random vocabulary and 1-4 published versions (contiguous or not)."""
    published = sorted(set(draw(st.lists(st.integers(0, 6), min_size=1, max_size=4))))
    return FakeRegistry(vocab={"tiny": draw(st.integers(1, 100))}, versions={"tiny": published})


@st.composite
def near_valid_for(draw, registry: FakeRegistry) -> pb.Trajectory:
    """A valid trajectory for ``registry``, then zero to three fields overwritten with wild values
    (so acceptance is common and the boundaries are close)."""
    vocab, published = registry.vocab["tiny"], registry.versions["tiny"]
    n = draw(st.integers(1, 30))
    msg = pb.Trajectory(
        trajectory_id=draw(st.text(min_size=1, max_size=20)),
        model_id="tiny",
        prompt_token_ids=draw(st.lists(st.integers(0, vocab - 1), max_size=10)),
        output_token_ids=draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n)),
        output_logprobs=draw(st.lists(st.floats(-30, 0, width=32), min_size=n, max_size=n)),
        output_versions=sorted(draw(st.lists(st.sampled_from(published), min_size=n, max_size=n))),
        temperature=draw(st.floats(0, 2, width=32)),
        top_p=draw(st.floats(0, 1, width=32, exclude_min=True)),
        reward=draw(st.floats(-1e6, 1e6)),
        group_size=draw(st.integers(0, 8)),
    )
    wild = {
        "trajectory_id": ids,
        "group_id": ids,
        "model_id": st.sampled_from(["tiny", "other", ""]),
        "prompt_token_ids": token_lists(),
        "output_token_ids": token_lists(),
        "output_logprobs": st.lists(float32s | st.sampled_from([-9999.0, 1e-5, 2e-4]), max_size=30),
        "output_versions": st.lists(small_versions | any_version, max_size=30),
        "reward": st.floats(),
        "temperature": st.none() | float32s,
        "top_p": st.none() | float32s,
        "top_k": st.integers(*INT32),
        "created_at": st.floats(),
        "group_size": st.integers(*UINT32),
        "finish_reason": ids,
        "task_id": ids,
        "parent_request_id": ids,
        "branched": st.booleans(),
    }
    for name in draw(st.lists(st.sampled_from(sorted(wild)), max_size=3, unique=True)):
        value = draw(wild[name])
        if value is None:
            msg.ClearField(name)
        elif isinstance(value, list):
            getattr(msg, name)[:] = value
        else:
            setattr(msg, name, value)
    return msg


@st.composite
def near_valid(draw) -> tuple[pb.Trajectory, FakeRegistry]:
    registry = draw(small_registries())
    return draw(near_valid_for(registry)), registry


registries = st.builds(
    FakeRegistry,
    vocab=st.dictionaries(st.sampled_from(["tiny", "big", ""]), st.integers(1, 100), max_size=3),
    versions=st.dictionaries(
        st.sampled_from(["tiny", "big", ""]), st.lists(small_versions | any_version, max_size=6), max_size=3
    ),
)
configs = st.builds(
    IngestConfig,
    max_output_tokens=st.integers(1, 64),
    max_prompt_tokens=st.integers(0, 64),
    max_id_length=st.integers(8, 300),
    positive_logprob_tolerance=st.floats(0, 1e-2),
    sentinel_logprobs=st.lists(st.sampled_from([-9999.0, -1e4, -100.0]), max_size=2),
    require_sampling_params=st.booleans(),
    max_abs_reward=st.sampled_from([1.0, 1e6, 1e150]),
    max_group_size=st.sampled_from([1, 4, 65_536, 2**32 - 1]),
)


# ---- properties ------------------------------------------------------------------------------


@PROPERTY
@given(msg=trajectories(), registry=registries, config=configs | st.just(IngestConfig()))
def test_check_never_raises_and_returns_none_or_one_reason(msg, registry, config):
    verdict = check(decode(msg), registry, config)
    if verdict is not None:
        assert isinstance(verdict, tuple) and len(verdict) == 2
        reason, detail = verdict
        assert isinstance(reason, Reason)
        assert isinstance(detail, str) and detail


@PROPERTY
@given(case=near_valid(), config=configs | st.just(IngestConfig()))
def test_what_check_accepts_meets_every_stored_invariant(case, config):
    msg, registry = case
    row = decode(msg)
    verdict = check(row, registry, config)
    if verdict is not None:
        assert isinstance(verdict[0], Reason) and verdict[1]
        return
    n = len(row.tokens)
    assert msg.trajectory_id
    assert all(len(getattr(msg, f)) <= config.max_id_length for f in STRING_FIELDS)
    assert 0 < n <= config.max_output_tokens and len(row.prompt) <= config.max_prompt_tokens
    assert len(row.logprobs) == len(row.versions) == n
    vocab = registry.vocab_size(msg.model_id)
    assert vocab is not None
    assert (row.tokens >= 0).all() and (row.tokens < vocab).all()
    assert (row.prompt >= 0).all() and (row.prompt < vocab).all()
    assert np.isfinite(row.logprobs).all() and (row.logprobs <= config.positive_logprob_tolerance).all()
    assert not np.isin(row.logprobs, np.asarray(config.sentinel_logprobs, dtype=np.float32)).any()
    assert (np.diff(row.versions) >= 0).all()
    assert set(row.versions.tolist()) <= set(registry.versions.get(msg.model_id, []))
    if config.require_sampling_params:
        assert msg.HasField("temperature") and msg.HasField("top_p")
    assert not msg.HasField("reward") or abs(msg.reward) <= config.max_abs_reward  # finite too
    assert not msg.HasField("temperature") or (math.isfinite(msg.temperature) and msg.temperature >= 0)
    assert not msg.HasField("top_p") or 0 < msg.top_p <= 1
    assert not msg.HasField("top_k") or msg.top_k >= -1
    assert math.isfinite(msg.created_at) and msg.group_size <= config.max_group_size
    assert not msg.branched or msg.parent_request_id


@PROPERTY
@given(data=st.data(), config=configs | st.just(IngestConfig()))
def test_check_batch_gives_the_same_verdicts_as_check_row_by_row(data, config):
    """The store validates through the vectorised ``check_batch``; it must never accept what
    ``check`` rejects (nor the reverse), whatever mix of rows shares a batch."""
    registry = data.draw(small_registries(), label="registry")
    msgs = data.draw(st.lists(near_valid_for(registry) | trajectories(), min_size=1, max_size=6), label="batch")
    assert check_batch(decode_messages(msgs), registry, config) == [check(decode(m), registry, config) for m in msgs]


REGISTRY = FakeRegistry(vocab={"tiny": 64}, versions={"tiny": [0, 1, 3]})


def _valid(n: int) -> pb.Trajectory:
    return pb.Trajectory(
        trajectory_id="t",
        model_id="tiny",
        prompt_token_ids=[1, 2],
        output_token_ids=[5] * n,
        output_logprobs=[-0.5] * n,
        output_versions=[0] * n,
        temperature=1.0,
        top_p=1.0,
        reward=0.5,
    )


def _set(name: str, value):
    return lambda m, i: setattr(m, name, value)


def _clear(*names: str):
    return lambda m, i: [m.ClearField(f) for f in names]


def _put(name: str, value):
    def put(m, i):
        getattr(m, name)[i] = value

    return put


def _versions_from(value: int):
    """output_versions[i:] = value (stays non-decreasing for value >= 0)."""

    def put(m, i):
        v = list(m.output_versions)
        m.output_versions[:] = v[:i] + [value] * (len(v) - i)

    return put


def _decreasing(m, i):
    if len(m.output_token_ids) == 1:  # a decrease needs two tokens
        m.output_token_ids.append(5), m.output_logprobs.append(-0.5), m.output_versions.append(0)
    n = len(m.output_versions)
    j = min(i, n - 2)
    m.output_versions[:] = [1] * (j + 1) + [0] * (n - j - 1)


# one broken field -> the code it must get (each break applied to an otherwise valid trajectory at index i)
BREAKS = {
    Reason.MISSING_ID: _clear("trajectory_id"),
    Reason.OVERSIZED: _set("request_id", "r" * 257),
    Reason.EMPTY_OUTPUT: _clear("output_token_ids", "output_logprobs", "output_versions"),
    Reason.MISSING_LOGPROBS: _clear("output_logprobs"),
    Reason.LENGTH_MISMATCH: lambda m, i: m.output_versions.append(3),
    Reason.INVALID_TOKEN_ID: _put("output_token_ids", -1),
    Reason.NONFINITE_LOGPROB: _put("output_logprobs", math.nan),
    Reason.SENTINEL_LOGPROB: _put("output_logprobs", -9999.0),
    Reason.POSITIVE_LOGPROB: _put("output_logprobs", 0.01),
    Reason.UNPUBLISHED_VERSION: _versions_from(2),
    Reason.DECREASING_VERSIONS: _decreasing,
    Reason.MISSING_SAMPLING_PARAMS: _clear("top_p"),
    Reason.INVALID_SAMPLING_PARAMS: _set("temperature", -1.0),
    Reason.NONFINITE_REWARD: _set("reward", math.inf),
    Reason.REWARD_OUT_OF_RANGE: _set("reward", -1e200),
    Reason.NONFINITE_CREATED_AT: _set("created_at", math.nan),
    Reason.INVALID_GROUP_SIZE: _set("group_size", 2**32 - 1),
    Reason.BRANCH_WITHOUT_PARENT: _set("branched", True),
    Reason.UNREGISTERED_MODEL: _set("model_id", "unknown"),
    Reason.TOKEN_OUT_OF_VOCAB: _put("output_token_ids", 64),
    Reason.FUTURE_VERSION: _versions_from(7),
}


def test_every_ingest_code_has_a_break():
    assert set(BREAKS) == set(Reason) - {Reason.RETRY_ORPHAN, Reason.INCOMPLETE_GROUP, Reason.STALE, Reason.SINGLETON_DROPPED}


@pytest.mark.parametrize("code", sorted(BREAKS))
@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 30), data=st.data())
def test_one_broken_field_gets_exactly_its_code(code, n, data):
    msg = _valid(n)
    assert check(decode(msg), REGISTRY, IngestConfig()) is None
    BREAKS[code](msg, data.draw(st.integers(0, n - 1), label="index"))
    verdict = check(decode(msg), REGISTRY, IngestConfig())
    assert verdict is not None and verdict[0] == code, verdict
