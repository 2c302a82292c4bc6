"""TLS on the store and the weight channel, with a CA and certificates made in the test: submit, pull, SQL (client and ``rollbook query``/``stats``) and the weight
stream over TLS against a real ``rollbook serve``; a plaintext client cannot talk to a TLS store; with
``--tls-client-ca`` a client without a certificate is refused at the handshake.
"""

from __future__ import annotations

import json
import shutil

import grpc
import pytest

from rollbook.client import StoreClient
from rollbook.tls import ClientTLS, make_test_certificates
from tests.integration.conftest import MODEL, clean_env, count, register, rollbook_cli, start_store, traj

KEYS = {
    "worker_key": "w0rker-5f3a9c1e7b2d4086",
    "trainer_key": "tra1ner-8e6d4c2a0b9f7135",
    "reader_key": "r3ader-1a2b3c4d5e6f7081",
    "admin_key": "adm1n-9f8e7d6c5b4a3021",
}


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command makes the test CA; it is not installed")
    return make_test_certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def tls_store(tmp_path_factory, certs):
    s = start_store(
        tmp_path_factory.mktemp("tls") / "rollbook.duckdb",
        **KEYS,
        args=("--tls-cert", certs.server_cert, "--tls-key", certs.server_key),
        client_tls=certs.client(),
    )
    with s.client() as client:
        register(client)
    yield s
    s.kill()


def test_submit_pull_ack_and_sql_over_tls(tls_store):
    with tls_store.client() as client:
        result = client.submit([traj(f"tls-{i}", reward=float(i % 2)) for i in range(32)], batch_size=8)
        assert result.accepted == 32
        batch = client.pull_batch(trainer_id="tls", trainer_version=0, max_staleness=1, num_samples=32, model_id=MODEL)
        assert batch.num_rows == 32
        assert client.ack_batch(batch.lease_id, trainer_id="tls") == 32
        assert count(client, "trajectories", "trajectory_id LIKE 'tls-%' AND status = 'trained'") == 32
        assert client.stats().accepted >= 32


def test_a_plaintext_client_cannot_talk_to_a_tls_store(tls_store):
    with StoreClient(tls_store.address, timeout_s=5, **KEYS) as plain:
        with pytest.raises(grpc.RpcError) as err:
            plain.stats()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_client_that_does_not_trust_the_ca_is_refused(tls_store, tmp_path):
    other = make_test_certificates(tmp_path / "other")
    with StoreClient(tls_store.address, timeout_s=5, tls=ClientTLS(other.ca), **KEYS) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.stats()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_rollbook_query_and_stats_over_tls(tls_store, certs):
    env = clean_env(ROLLBOOK_READER_KEY=KEYS["reader_key"])
    done = rollbook_cli(
        "query",
        "--server",
        tls_store.address,
        "--tls-ca",
        certs.ca,
        "--format",
        "json",
        "SELECT count(*) AS n FROM trajectories",
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[0])["n"] >= 0
    done = rollbook_cli(
        "stats", "--server", tls_store.address, env=clean_env(ROLLBOOK_TLS_CA=certs.ca, ROLLBOOK_READER_KEY=KEYS["reader_key"])
    )
    assert done.returncode == 0, done.stderr
    assert "accepted" in json.loads(done.stdout)


def test_mutual_tls_refuses_a_client_without_a_certificate(tmp_path, certs):
    store = start_store(
        tmp_path / "rollbook.duckdb",
        args=("--tls-cert", certs.server_cert, "--tls-key", certs.server_key, "--tls-client-ca", certs.ca),
    )
    try:
        with StoreClient(store.address, timeout_s=5, tls=certs.client(with_cert=False)) as anonymous:
            with pytest.raises(grpc.RpcError) as err:
                anonymous.stats()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with StoreClient(store.address, tls=certs.client(with_cert=True)) as client:
            register(client)
            assert client.submit([traj("mtls-0")]).accepted == 1
            assert count(client, "trajectories", "trajectory_id = 'mtls-0'") == 1
    finally:
        store.kill()


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
def test_the_weight_stream_over_tls(certs, mutual):
    from rollbook.language_models import build_tiny_model
    from rollbook.weights import NetworkPublisher, NetworkReceiver, create_weight_server
    from tests.weight_helpers import SPEC, assert_bit_equal

    model = build_tiny_model(SPEC)
    publisher = NetworkPublisher()
    server, port = create_weight_server(publisher, "127.0.0.1", 0, tls=certs.server(mutual=mutual))
    server.start()
    try:
        publisher.publish(3, model.state_dict())
        receiver = NetworkReceiver(f"127.0.0.1:{port}", tls=certs.client(with_cert=mutual))
        snap = receiver.fetch()
        assert snap.version == 3
        assert_bit_equal(snap.state_dict, model.state_dict())
        receiver.close()
        plain = NetworkReceiver(f"127.0.0.1:{port}", timeout_s=5)
        with pytest.raises(grpc.RpcError):
            plain.fetch()
        plain.close()
        if mutual:
            anonymous = NetworkReceiver(f"127.0.0.1:{port}", timeout_s=5, tls=certs.client(with_cert=False))
            with pytest.raises(grpc.RpcError):
                anonymous.fetch()
            anonymous.close()
    finally:
        server.stop(None)


def test_serve_off_loopback_starts_with_tls_and_strong_keys(certs):
    from rollbook.config import StoreConfig
    from rollbook.store.server import store_tls

    config = StoreConfig(host="0.0.0.0", tls_cert=certs.server_cert, tls_key=certs.server_key, **KEYS)
    assert store_tls(config) is not None and not config.insecure
