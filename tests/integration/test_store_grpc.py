"""The store over gRPC: verdicts, persistence across a restart, keys, counters and ``rollbook stats``.

Each test talks to a real ``rollbook serve`` process on a real DuckDB file, through the generated
stubs (``TrajectoryStoreStub``) and through ``StoreClient``.
Run: ``python -m pytest tests/integration/test_store_grpc.py -q``.
"""

from __future__ import annotations

import json

import grpc
import pytest

from rollbook.v1 import rollbook_pb2 as pb
from rollbook.v1 import rollbook_pb2_grpc as pb_grpc
from tests.integration.conftest import (
    MODEL,
    VOCAB,
    clean_env,
    count,
    register,
    rollbook_cli,
    rows,
    rpc_error,
    start_store,
    submit_raw,
    traj,
)

ADMIN, TRAINER = "admin-secret", "trainer-secret"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    s = start_store(tmp_path_factory.mktemp("grpc") / "rollbook.duckdb")
    with s.client() as client:
        register(client)
    yield s
    s.kill()


@pytest.fixture(scope="module")
def keyed_store(tmp_path_factory):
    s = start_store(
        tmp_path_factory.mktemp("keys") / "rollbook.duckdb",
        env=clean_env(ROLLBOOK_ADMIN_KEY=ADMIN, ROLLBOOK_TRAINER_KEY=TRAINER),
        admin_key=ADMIN,
        trainer_key=TRAINER,
    )
    yield s
    s.kill()


# ---- verdicts ------------------------------------------------------------------------------------


@pytest.mark.smoke
def test_generated_stub_gets_accepted_duplicate_and_rejected_verdicts(store):
    with grpc.insecure_channel(store.address) as channel:
        stub = pb_grpc.TrajectoryStoreStub(channel)
        first, second = submit_raw(
            stub,
            [traj("stub-a"), traj("stub-b"), traj("stub-a"), traj("stub-bad", output_logprobs=[float("nan")] * 16)],
            [traj("stub-b")],
        )
    assert [(v.trajectory_id, v.status) for v in first] == [
        ("stub-a", pb.Verdict.ACCEPTED),
        ("stub-b", pb.Verdict.ACCEPTED),
        ("stub-a", pb.Verdict.DUPLICATE),
        ("stub-bad", pb.Verdict.REJECTED),
    ]
    assert first[3].reason == "NONFINITE_LOGPROB" and first[3].detail
    assert [(v.trajectory_id, v.status) for v in second] == [("stub-b", pb.Verdict.DUPLICATE)]
    with store.client() as client:
        stored = rows(
            client,
            "SELECT trajectory_id, count(*) AS n FROM trajectories WHERE trajectory_id LIKE 'stub-%' GROUP BY ALL ORDER BY 1",
        )
        assert stored == [{"trajectory_id": "stub-a", "n": 1}, {"trajectory_id": "stub-b", "n": 1}]
        assert rows(client, "SELECT reason FROM rejections WHERE trajectory_id = 'stub-bad'") == [{"reason": "NONFINITE_LOGPROB"}]


@pytest.mark.smoke
def test_store_client_submit_returns_every_verdict_and_stores_the_evidence(store):
    batch = [traj(f"client-{i}", n=8 + i, version=i % 2) for i in range(10)]
    batch.append(traj("client-unregistered", model_id="nobody"))
    with store.client() as client:
        result = client.submit(batch, batch_size=3)
        again = client.submit(batch[:4], batch_size=3)
        stored = rows(
            client,
            "SELECT trajectory_id, num_output_tokens, output_versions, output_logprobs, reward, "
            "original_reward FROM trajectories WHERE trajectory_id LIKE 'client-%' ORDER BY num_output_tokens",
        )
    assert (result.accepted, result.duplicates, result.rejected) == (10, 0, 1)
    assert result.verdicts["client-unregistered"].reason == "UNREGISTERED_MODEL"
    assert (again.accepted, again.duplicates, again.rejected) == (0, 4, 0)
    assert [r["trajectory_id"] for r in stored] == [f"client-{i}" for i in range(10)]
    for i, r in enumerate(stored):
        assert r["num_output_tokens"] == 8 + i
        assert r["output_versions"] == [i % 2] * (8 + i)
        assert r["output_logprobs"] == [-0.25] * (8 + i)
        assert r["reward"] == r["original_reward"] == 1.0


def test_a_rejected_id_resubmitted_is_a_duplicate_naming_the_first_verdict(store):
    with store.client() as client:
        first = client.submit([traj("rej-then-ok", output_logprobs=[-0.25] * 15)])
        second = client.submit([traj("rej-then-ok")])
        assert count(client, "trajectories", "trajectory_id = 'rej-then-ok'") == 0
    assert first.verdicts["rej-then-ok"].reason == "LENGTH_MISMATCH"
    assert second.verdicts["rej-then-ok"].status == pb.Verdict.DUPLICATE
    assert "REJECTED" in second.verdicts["rej-then-ok"].detail


# ---- counters ------------------------------------------------------------------------------------


def test_get_stats_counts_accepted_duplicates_rejections_and_tokens(store):
    with store.client() as client:
        before = client.stats()
        client.submit([traj(f"stats-{i}", n=10) for i in range(5)])
        client.submit(
            [
                traj("stats-0"),
                traj("stats-1", n=10),
                traj("stats-nan", n=6, output_logprobs=[float("nan")] * 6),
                traj("stats-inf", n=6, output_logprobs=[float("-inf")] * 6),
                traj("stats-len", n=4, output_versions=[0] * 3),
            ]
        )
        after = client.stats()
    assert after.accepted - before.accepted == 5
    assert after.accepted_tokens - before.accepted_tokens == 50
    assert after.duplicates - before.duplicates == 2
    assert after.rejected - before.rejected == 3
    assert after.rejected_tokens - before.rejected_tokens == 16
    delta = {k: v - before.rejected_by_reason.get(k, 0) for k, v in after.rejected_by_reason.items()}
    assert {k: v for k, v in delta.items() if v} == {"NONFINITE_LOGPROB": 2, "LENGTH_MISMATCH": 1}
    doc = json.loads(after.stats_json)
    assert (doc["accepted"], doc["duplicates"], doc["rejected"]) == (after.accepted, after.duplicates, after.rejected)
    assert doc["rejected_by_reason"] == dict(after.rejected_by_reason)


def test_rollbook_stats_prints_the_servers_counters_as_json(store):
    with store.client() as client:
        client.submit([traj("cli-stats-0"), traj("cli-stats-0")])
        expected = client.stats()
    done = rollbook_cli("stats", "--server", store.address)
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    # counters are JSON numbers, not the strings protobuf's JSON mapping writes for uint64
    assert printed["accepted"] == expected.accepted and isinstance(printed["accepted"], int)
    assert printed["duplicates"] == expected.duplicates >= 1
    assert printed["rejected"] == expected.rejected
    assert printed["accepted_tokens"] == expected.accepted_tokens > 0
    assert "stats_json" not in printed  # every counter once, at the top level
    assert printed["rejected_by_reason"] == dict(expected.rejected_by_reason)


# ---- persistence ---------------------------------------------------------------------------------


def test_restart_on_the_same_file_keeps_rows_registry_and_idempotency_index(tmp_path, stores):
    db = tmp_path / "rollbook.duckdb"
    stores.append(first := start_store(db))
    batch = [traj(f"keep-{i}", n=12) for i in range(20)] + [traj("keep-bad", output_versions=[3, 2] + [3] * 14)]
    with first.client() as client:
        register(client, versions=(0, 1, 2, 3))
        result = client.submit(batch, batch_size=7)
    assert (result.accepted, result.rejected) == (20, 1)
    assert first.terminate() == 0

    stores.append(second := start_store(db))
    with second.client() as client:
        again = client.submit(batch, batch_size=7)
        assert again.duplicates == len(batch)
        assert "REJECTED" in again.verdicts["keep-bad"].detail
        assert count(client, "trajectories", "trajectory_id LIKE 'keep-%'") == 20
        assert rows(client, "SELECT count(DISTINCT trajectory_id) AS n FROM trajectories WHERE trajectory_id LIKE 'keep-%'") == [
            {"n": 20}
        ]
        assert rows(client, "SELECT reason FROM rejections WHERE trajectory_id = 'keep-bad'") == [
            {"reason": "DECREASING_VERSIONS"}
        ]
        # the registry came back from the file: a version-3 trajectory needs no new RegisterModel/PublishVersion
        assert client.submit([traj("keep-new", version=3)]).accepted == 1
        assert rows(client, f"SELECT vocab_size FROM models WHERE model_id = '{MODEL}'") == [{"vocab_size": VOCAB}]
    assert second.terminate() == 0


# ---- keys ----------------------------------------------------------------------------------------


def _register(stub, metadata):
    return stub.RegisterModel(pb.RegisterModelRequest(model_id="keyed", vocab_size=64), metadata=metadata, timeout=30)


def _publish(stub, metadata, version=0):
    return stub.PublishVersion(
        pb.PublishVersionRequest(model_id="keyed", version=version, checksum="c"), metadata=metadata, timeout=30
    )


def _bearer(key):
    return [("authorization", f"Bearer {key}")]


WRONG_KEYS = {
    "missing": [],
    "wrong": _bearer("guess"),
    "no-bearer-prefix": [("authorization", ADMIN)],
    "empty": _bearer(""),
}


@pytest.mark.parametrize("metadata", list(WRONG_KEYS.values()), ids=list(WRONG_KEYS))
def test_register_model_without_the_admin_key_is_unauthenticated(keyed_store, metadata):
    with grpc.insecure_channel(keyed_store.address) as channel:
        err = rpc_error(lambda: _register(pb_grpc.TrajectoryStoreStub(channel), metadata))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "admin key" in err.details()


def test_register_model_with_the_trainer_key_is_permission_denied(keyed_store):
    with grpc.insecure_channel(keyed_store.address) as channel:
        err = rpc_error(lambda: _register(pb_grpc.TrajectoryStoreStub(channel), _bearer(TRAINER)))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "trainer key may not call RegisterModel" in err.details()


@pytest.mark.parametrize(
    "metadata",
    [m for k, m in WRONG_KEYS.items() if k != "no-bearer-prefix"],
    ids=[k for k in WRONG_KEYS if k != "no-bearer-prefix"],
)
def test_publish_version_without_the_trainer_key_is_unauthenticated(keyed_store, metadata):
    with grpc.insecure_channel(keyed_store.address) as channel:
        stub = pb_grpc.TrajectoryStoreStub(channel)
        _register(stub, _bearer(ADMIN))
        err = rpc_error(lambda: _publish(stub, metadata))
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "trainer key" in err.details()


def test_the_right_keys_register_and_publish_and_nothing_unauthenticated_was_written(keyed_store):
    with grpc.insecure_channel(keyed_store.address) as channel:
        stub = pb_grpc.TrajectoryStoreStub(channel)
        rpc_error(lambda: _publish(stub, _bearer("guess"), version=7))
        _register(stub, _bearer(ADMIN))
        assert _publish(stub, _bearer(TRAINER), version=2).latest_version == 2
    with keyed_store.client() as client:  # StoreClient carries both keys
        assert client.publish_version("keyed", 5, checksum="c5") == 5
        assert rows(client, "SELECT version FROM policy_versions WHERE model_id = 'keyed' ORDER BY 1") == [
            {"version": 2},
            {"version": 5},
        ]
    with keyed_store.client(timeout_s=30) as client:
        client.admin_key = None
        assert rpc_error(lambda: client.register_model("keyed-2", 8)).code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("env", [{}, {"ROLLBOOK_ADMIN_KEY": ADMIN}], ids=["no-keys", "admin-key-only"])
def test_serve_refuses_a_non_loopback_address_without_all_keys(tmp_path, env):
    done = rollbook_cli(
        "serve", "--db", str(tmp_path / "rollbook.duckdb"), "--host", "0.0.0.0", "--port", "0", timeout=60, env=clean_env(**env)
    )
    assert done.returncode != 0
    assert "listening" not in done.stdout
    assert "a non-loopback store needs all four role keys" in done.stderr
    assert "ROLLBOOK_WORKER_KEY" in done.stderr and "ROLLBOOK_TRAINER_KEY" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
