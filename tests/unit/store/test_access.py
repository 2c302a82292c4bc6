"""store/access.py on its own: the role table, key strength, shared keys, field ranges."""

from __future__ import annotations

import math

import grpc
import pytest

from rollbook.config.store import check_keys, weak_key_reason
from rollbook.store.access import OPEN, RPC_ROLE, Denied, KeyRing, field_error
from rollbook.v1 import rollbook_pb2 as pb

KEYS = {
    "worker": "w-0123456789abcdef",
    "trainer": "t-0123456789abcdef",
    "reader": "r-0123456789abcdef",
    "admin": "a-0123456789abcdef",
}


def _md(key):
    return [("authorization", f"Bearer {key}")]


@pytest.mark.parametrize("rpc", sorted(RPC_ROLE))
def test_each_rpc_takes_its_role_and_admin_and_denies_the_others(rpc):
    ring = KeyRing(KEYS)
    for role, key in KEYS.items():
        if role in (RPC_ROLE[rpc], "admin"):
            assert ring.authorize(rpc, _md(key)).role == role
        else:
            with pytest.raises(Denied) as err:
                ring.authorize(rpc, _md(key))
            assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
    for metadata in ([], _md("nobody-0123456789"), [("authorization", KEYS["admin"])], _md("")):
        with pytest.raises(Denied) as err:
            ring.authorize(rpc, metadata)
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED


def test_a_role_without_a_key_is_open_but_the_others_are_not():
    ring = KeyRing({"admin": KEYS["admin"]})
    assert ring.authorize("Submit", []) is OPEN
    with pytest.raises(Denied):
        ring.authorize("RegisterModel", [])


@pytest.mark.parametrize(
    "key,reason",
    [
        (" ", "whitespace"),
        ("a", "shorter"),
        ("abc def ghijklmnopq", "whitespace"),
        ("a" * 40, "distinct"),
        ("abcdefgh\x00ijklmnop", "non-printable"),
        ("0123456789abcdef", None),
    ],
)
def test_weak_keys(key, reason):
    got = weak_key_reason(key)
    assert (got is None) if reason is None else (reason in got)


def test_off_loopback_needs_four_distinct_strong_keys():
    check_keys(KEYS, loopback=False)
    check_keys({}, loopback=True)
    with pytest.raises(ValueError, match="ROLLBOOK_READER_KEY"):
        check_keys({**KEYS, "reader": None}, loopback=False)
    with pytest.raises(ValueError, match="same key"):
        check_keys({**KEYS, "trainer": KEYS["admin"]}, loopback=False)
    with pytest.raises(ValueError, match="same key"):
        check_keys({"trainer": "k-0123456789abcdef", "admin": "k-0123456789abcdef"}, loopback=True)
    with pytest.raises(ValueError, match="whitespace"):
        check_keys({"admin": " "}, loopback=True)
    check_keys({"admin": "a"}, loopback=True)  # loopback: short keys are the caller's business


@pytest.mark.parametrize("value", [math.nan, math.inf, -1.0, 1e300])
def test_lease_seconds_out_of_range(value):
    assert "lease_seconds" in field_error("PullBatch", pb.PullBatchRequest(num_samples=1, lease_seconds=value))


def test_in_range_fields_pass():
    assert field_error("PullBatch", pb.PullBatchRequest(num_samples=64, lease_seconds=600, max_staleness=2)) is None
    assert field_error("SetReward", pb.SetRewardRequest(reward=-3.5)) is None
    assert field_error("GetStats", pb.GetStatsRequest()) is None


def test_an_announced_batch_must_be_positive_and_sane_but_may_be_absent():
    ok = pb.PublishVersionRequest(model_id="m", version=1)
    assert field_error("PublishVersion", ok) is None  # nothing announced: an older trainer
    assert field_error("PublishVersion", pb.PublishVersionRequest(version=1, max_staleness=0, samples_per_version=64)) is None
    for bad in (0, 10**7):
        error = field_error("PublishVersion", pb.PublishVersionRequest(version=1, samples_per_version=bad))
        assert error is not None and "samples_per_version" in error
