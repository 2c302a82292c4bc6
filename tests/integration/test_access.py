"""Roles and keys on every RPC, against a real ``rollbook serve``.

The role table: every RPC x {no key, a key that is no role's, each role's key}. The RPC's own role
and admin get through (the call then answers as it would anyway: OK, NOT_FOUND for an unknown lease,
...); no key or a wrong key is UNAUTHENTICATED; another role's valid key is PERMISSION_DENIED. Also:
numeric request fields out of range are INVALID_ARGUMENT and change nothing; a store off loopback
refuses missing, trivial or shared keys at startup in one line; keys never reach a log or a dumped
config.
"""

from __future__ import annotations

import json
import math

import grpc
import pytest

from rollbook.trajectories import trajectory_from_dict
from rollbook.v1 import rollbook_pb2 as pb
from rollbook.v1 import rollbook_pb2_grpc as pb_grpc
from tests.integration.conftest import MODEL, VOCAB, count, rollbook_cli, rpc_error, start_store, traj

KEYS = {
    role: f"{role}-k3y-{'0123456789abcdef'[i * 3 : i * 3 + 5]}-Zq9x"
    for i, role in enumerate(("worker", "trainer", "reader", "admin"))
}
ROLE_OF_RPC = {
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
}
DENIED = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    s = start_store(tmp_path_factory.mktemp("access") / "rollbook.duckdb", **{f"{r}_key": k for r, k in KEYS.items()})
    with s.client() as client:
        client.register_model(MODEL, vocab_size=VOCAB)
        client.publish_version(MODEL, 0, checksum="c0")
    yield s
    s.kill()


def _bearer(key: str | None) -> list[tuple[str, str]]:
    return [] if key is None else [("authorization", f"Bearer {key}")]


_SUBMITTED = iter(range(10**6))


def _call(stub: pb_grpc.TrajectoryStoreStub, rpc: str, metadata) -> None:
    """One call of ``rpc`` with a well-formed request; raises grpc.RpcError on a non-OK status."""
    kw = {"metadata": metadata, "timeout": 30}
    if rpc == "Submit":
        t = trajectory_from_dict(traj(f"acc-{next(_SUBMITTED)}-{len(metadata)}"))
        list(stub.Submit(iter([pb.SubmitRequest(trajectories=[t])]), **kw))
    elif rpc == "Query":
        list(stub.Query(pb.QueryRequest(sql="SELECT 1 AS one"), **kw))
    elif rpc == "SetReward":
        stub.SetReward(pb.SetRewardRequest(trajectory_id="no-such-row", reward=0.5), **kw)
    elif rpc == "PullBatch":
        stub.PullBatch(
            pb.PullBatchRequest(trainer_id="t", trainer_version=0, max_staleness=1, num_samples=1, model_id="no-such-model"), **kw
        )
    elif rpc == "AckBatch":
        stub.AckBatch(pb.AckBatchRequest(lease_id="no-such-lease", trainer_id="t"), **kw)
    elif rpc == "PublishVersion":
        stub.PublishVersion(pb.PublishVersionRequest(model_id=MODEL, version=1, checksum="c1"), **kw)
    elif rpc == "ReportTrainStep":
        stub.ReportTrainStep(
            pb.ReportTrainStepRequest(step=1, trainer_id="t", version=1, started_at=1.0, finished_at=2.0, stats_json="{}"), **kw
        )
    elif rpc == "GetStats":
        stub.GetStats(pb.GetStatsRequest(), **kw)
    elif rpc == "RegisterModel":
        stub.RegisterModel(pb.RegisterModelRequest(model_id="acc-model", vocab_size=8), **kw)
    elif rpc == "GetModel":
        stub.GetModel(pb.GetModelRequest(model_id=MODEL), **kw)
    else:
        raise AssertionError(rpc)


def _code(stub, rpc, metadata) -> grpc.StatusCode:
    try:
        _call(stub, rpc, metadata)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_every_rpc_times_every_key_follows_the_role_table(store, capsys):
    callers = {"no key": None, "wrong key": "wrong-key-of-nobody-0123456789", **{f"{r} key": k for r, k in KEYS.items()}}
    table: dict[tuple[str, str], grpc.StatusCode] = {}
    with grpc.insecure_channel(store.address) as channel:
        stub = pb_grpc.TrajectoryStoreStub(channel)
        for rpc in ROLE_OF_RPC:
            for who, key in callers.items():
                table[rpc, who] = _code(stub, rpc, _bearer(key))
    with capsys.disabled():  # shown in .ci/run's output
        print("\nrole table (RPC x caller -> status):")
        for rpc in ROLE_OF_RPC:
            print(f"  {rpc:16s}" + "  ".join(f"{who}={table[rpc, who].name}" for who in callers))
    wrong = []
    for (rpc, who), code in table.items():
        need = ROLE_OF_RPC[rpc]
        if who in ("no key", "wrong key"):
            expected_ok, expected = False, grpc.StatusCode.UNAUTHENTICATED
        elif who in (f"{need} key", "admin key"):
            expected_ok, expected = True, None
        else:
            expected_ok, expected = False, grpc.StatusCode.PERMISSION_DENIED
        if expected_ok and code in DENIED or not expected_ok and code != expected:
            wrong.append(f"{rpc} with {who}: {code.name}")
    assert not wrong, wrong
    assert len(table) == len(ROLE_OF_RPC) * 6
    # the allowed calls that should simply succeed did
    for rpc in ("Submit", "Query", "GetStats", "PublishVersion", "ReportTrainStep", "RegisterModel", "PullBatch", "GetModel"):
        assert table[rpc, f"{ROLE_OF_RPC[rpc]} key"] == grpc.StatusCode.OK, rpc
    assert table["AckBatch", "trainer key"] == grpc.StatusCode.NOT_FOUND
    assert table["SetReward", "worker key"] == grpc.StatusCode.NOT_FOUND


def test_a_refused_submit_stores_nothing(store):
    with grpc.insecure_channel(store.address) as channel:
        stub = pb_grpc.TrajectoryStoreStub(channel)
        for metadata in ([], _bearer("nope-nope-nope-nope"), _bearer(KEYS["reader"]), _bearer(KEYS["trainer"])):
            t = trajectory_from_dict(traj("refused-submit"))
            err = rpc_error(lambda: list(stub.Submit(iter([pb.SubmitRequest(trajectories=[t])]), metadata=metadata, timeout=30)))
            assert err.code() in DENIED
    with store.client() as client:
        assert count(client, "trajectories", "trajectory_id = 'refused-submit'") == 0
        assert count(client, "rejections", "trajectory_id = 'refused-submit'") == 0


def test_a_reader_cannot_ack_a_lease_it_read_from_the_leases_table(store):
    """Reading lease ids (the reader role) does not let a caller ack another trainer's lease."""
    with store.client() as client:
        assert client.submit([traj("lease-victim", reward=1.0)]).accepted == 1
        batch = client.pull_batch(trainer_id="victim", trainer_version=0, max_staleness=1, num_samples=1, model_id=MODEL)
        assert batch.num_rows == 1
    from rollbook.client import StoreClient

    with StoreClient(store.address, reader_key=KEYS["reader"]) as reader:
        lease = reader.query(f"SELECT DISTINCT lease_id FROM leases WHERE lease_id = '{batch.lease_id}'").to_pylist()
        assert lease == [{"lease_id": batch.lease_id}]
        assert rpc_error(lambda: reader.ack_batch(batch.lease_id, "victim")).code() == grpc.StatusCode.UNAUTHENTICATED
    for role in ("reader", "worker"):  # the key the caller holds, sent where the trainer key belongs
        with StoreClient(store.address, trainer_key=KEYS[role]) as caller:
            err = rpc_error(lambda: caller.ack_batch(batch.lease_id, "victim"))  # even naming the lease's trainer
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "may not call AckBatch" in err.details()
    with store.client() as client:
        assert count(client, "trajectories", "trajectory_id = 'lease-victim' AND status = 'trained'") == 0
        assert client.ack_batch(batch.lease_id, trainer_id="victim") == 1


BAD_FIELDS = [
    ("PullBatch", "lease_seconds", math.nan),
    ("PullBatch", "lease_seconds", math.inf),
    ("PullBatch", "lease_seconds", -1.0),
    ("PullBatch", "lease_seconds", 1e300),
    ("PullBatch", "num_samples", 4_000_000_000),
    ("PullBatch", "num_groups", 4_000_000_000),
    ("PullBatch", "max_staleness", -1),
    ("PullBatch", "trainer_version", -5),
    ("PullBatch", "step", -1),
    ("SetReward", "reward", math.nan),
    ("SetReward", "reward", 1e300),
    ("SetReward", "reward", -math.inf),
    ("Query", "timeout_seconds", -1.0),
    ("Query", "timeout_seconds", math.nan),
    ("Query", "timeout_seconds", 1e300),
    ("PublishVersion", "version", -1),
    ("PublishVersion", "version", 1 << 62),
    ("ReportTrainStep", "started_at", math.nan),
    ("ReportTrainStep", "finished_at", math.inf),
    ("ReportTrainStep", "step", -3),
    ("RegisterModel", "vocab_size", 4_000_000_000),
]


@pytest.mark.parametrize("rpc,field,value", BAD_FIELDS, ids=[f"{r}-{f}={v}" for r, f, v in BAD_FIELDS])
def test_an_out_of_range_numeric_field_is_invalid_argument_and_changes_nothing(store, rpc, field, value):
    with store.client() as client:
        assert client.submit([traj(f"fields-{rpc}-{field}-{value}", reward=1.0)]).accepted == 1
        before = client.query("SELECT status, count(*) AS n FROM trajectories GROUP BY ALL ORDER BY ALL").to_pylist()
    base = {
        "PullBatch": pb.PullBatchRequest(
            trainer_id="fields", trainer_version=0, max_staleness=1, num_samples=1000, model_id=MODEL
        ),
        "SetReward": pb.SetRewardRequest(trajectory_id=f"fields-{rpc}-{field}-{value}", reward=0.0),
        "Query": pb.QueryRequest(sql="SELECT 1"),
        "PublishVersion": pb.PublishVersionRequest(model_id=MODEL, version=0, checksum="c0"),
        "ReportTrainStep": pb.ReportTrainStepRequest(step=1, trainer_id="t", version=0, started_at=1.0, finished_at=2.0),
        "RegisterModel": pb.RegisterModelRequest(model_id="fields-model", vocab_size=8),
    }[rpc]
    setattr(base, field, value)
    with grpc.insecure_channel(store.address) as channel:
        method = getattr(pb_grpc.TrajectoryStoreStub(channel), rpc)
        call = (
            (lambda: list(method(base, metadata=_bearer(KEYS["admin"]), timeout=30)))
            if rpc == "Query"
            else (lambda: method(base, metadata=_bearer(KEYS["admin"]), timeout=30))
        )
        err = rpc_error(call)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert field in err.details()
    with store.client() as client:
        after = client.query("SELECT status, count(*) AS n FROM trajectories GROUP BY ALL ORDER BY ALL").to_pylist()
    assert after == before


def test_keys_never_reach_the_store_log(store):
    with grpc.insecure_channel(store.address) as channel:
        stub = pb_grpc.TrajectoryStoreStub(channel)
        _code(stub, "RegisterModel", _bearer(KEYS["worker"]))
        _code(stub, "Submit", _bearer(KEYS["reader"]))
    log = store.log()
    assert not [role for role, key in KEYS.items() if key in log]


# ---- startup refusals ------------------------------------------------------------------------------

GOOD = {f"ROLLBOOK_{r.upper()}_KEY": k for r, k in KEYS.items()}
TRIVIAL = {
    "space": {**GOOD, "ROLLBOOK_ADMIN_KEY": " "},
    "one-char": {**GOOD, "ROLLBOOK_ADMIN_KEY": "a"},
    "short": {**GOOD, "ROLLBOOK_READER_KEY": "abc123XY"},
    "low-entropy": {**GOOD, "ROLLBOOK_WORKER_KEY": "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaab"},
    "inner-whitespace": {**GOOD, "ROLLBOOK_TRAINER_KEY": "0123456789abcdef 0123456789"},
    "same-admin-and-trainer": {**GOOD, "ROLLBOOK_TRAINER_KEY": GOOD["ROLLBOOK_ADMIN_KEY"]},
    "missing-reader": {k: v for k, v in GOOD.items() if k != "ROLLBOOK_READER_KEY"},
}


@pytest.mark.parametrize("name", list(TRIVIAL))
def test_serve_off_loopback_refuses_trivial_or_missing_keys_in_one_line(tmp_path, name):
    from tests.integration.conftest import clean_env

    done = rollbook_cli(
        "serve",
        "--db",
        str(tmp_path / "rollbook.duckdb"),
        "--host",
        "0.0.0.0",
        "--port",
        "0",
        "--insecure",
        timeout=60,
        env=clean_env(**TRIVIAL[name]),
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "listening" not in done.stdout
    lines = done.stderr.strip().splitlines()
    assert (
        len(lines) == 1
        and lines[0].startswith("rollbook serve: error: ROLLBOOK_")
        or lines[0].startswith("rollbook serve: error: a non-loopback store needs")
    ), lines
    assert not any(k in done.stderr for k in KEYS.values() if len(k) > 1)


def test_serve_off_loopback_refuses_plaintext_without_insecure(tmp_path):
    from tests.integration.conftest import clean_env

    done = rollbook_cli(
        "serve", "--db", str(tmp_path / "rollbook.duckdb"), "--host", "0.0.0.0", "--port", "0", timeout=60, env=clean_env(**GOOD)
    )
    assert done.returncode == 2
    assert "without TLS" in done.stderr and "--insecure" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_store_config_off_loopback_accepts_strong_keys_with_insecure_and_never_dumps_them():
    from rollbook.config import StoreConfig

    config = StoreConfig(host="0.0.0.0", insecure=True, **{f"{r}_key": k for r, k in KEYS.items()})
    dumped = json.dumps(config.model_dump(mode="json")) + repr(config) + str(config)
    assert not [k for k in KEYS.values() if k in dumped]


def test_trainer_config_json_and_run_keys(tmp_path, monkeypatch):
    from rollbook.config import TrainerConfig, write_resolved
    from rollbook.run.main import _run_keys

    path = write_resolved(TrainerConfig(trainer_key="trainer-secret-0123456789"), tmp_path)
    assert "trainer-secret" not in path.read_text()
    for role in KEYS:
        monkeypatch.delenv(f"ROLLBOOK_{role.upper()}_KEY", raising=False)
    keys = _run_keys(tmp_path)
    assert set(keys) == {"worker_key", "trainer_key", "reader_key", "admin_key"}
    assert len(set(keys.values())) == 4 and all(len(k) >= 32 for k in keys.values())
    assert (tmp_path / "keys.json").stat().st_mode & 0o077 == 0
    assert _run_keys(tmp_path) == keys  # a restart reuses them
