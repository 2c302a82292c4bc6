"""Two tenants and two models on one real ``rollbook serve`` (a key file): a tenant's worker submits
for its models only and cannot claim another tenant, a tenant's reader sees its own rows alone
through every SQL path (plain selects, joins, the catalog, ``rollbook query``, the hostile SQL list),
and a model whose policy allows one tenant trains none of the other's rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import grpc
import pytest

from rollbook.client import StoreClient
from rollbook.run.store_process import StoreProcess
from tests.integration.procs import ADMIN_KEY, child_env, rpc_code, trajectory
from tests.integration.test_sql_hostile import hostile

KEYS = {
    "a-worker": ("worker", "team-a", ["math-a"]),
    "a-trainer": ("trainer", "team-a", ["math-a"]),
    "a-reader": ("reader", "team-a", None),
    "b-worker": ("worker", "team-b", ["math-b", "math-a"]),
    "b-reader": ("reader", "team-b", None),
}
SECRET = {name: f"{name}-{os.urandom(8).hex()}" for name in KEYS}
B_MARKER = "b-private-task-5e1f"
# the tests share one store and build on each other, in file order, on one xdist worker
pytestmark = pytest.mark.xdist_group("tenants")  # in every row of tenant b; tenant a's reader must never see it


def _key_file(path):
    lines = []
    for name, (role, tenant, models) in KEYS.items():
        lines += ["[[keys]]", f'name = "{name}"', f'role = "{role}"', f'tenant = "{tenant}"', f'key = "{SECRET[name]}"']
        if models is not None:
            lines.append(f"models = {json.dumps(models)}")
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tenants")
    keys = _key_file(tmp / "keys.toml")
    s = StoreProcess(tmp / "rollbook.duckdb", admin_key=ADMIN_KEY, env=child_env(ROLLBOOK_KEYS_FILE=str(keys)))
    with StoreClient(s.address, admin_key=ADMIN_KEY) as admin:
        for model in ("math-a", "math-b"):
            admin.register_model(model, vocab_size=128)
            admin.publish_version(model, 0)
        admin.govern("policy", model_id="math-a", tenants=["team-a"])
    yield s
    s.stop()


def client(store, name: str) -> StoreClient:
    role = KEYS[name][0]
    return StoreClient(store.address, **{f"{role}_key": SECRET[name]})


def test_workers_submit_for_their_models_only_and_are_stamped_with_their_tenant(store):
    with client(store, "a-worker") as a:
        claimed = trajectory("a-1", model_id="math-a", metadata={"tenant": "team-b", "consent": "true"})
        assert a.submit([claimed, trajectory("a-2", model_id="math-a"), trajectory("a-3", model_id="math-a")]).accepted == 3
        assert rpc_code(lambda: a.submit([trajectory("a-to-b", model_id="math-b")])) == grpc.StatusCode.PERMISSION_DENIED
        # another tenant's row is unknown to it, the same answer as an id never seen
    with client(store, "b-worker") as b:
        rows = [trajectory(f"b-{i}", model_id="math-b", task_id=B_MARKER, output_token_ids=[91, 92, 93, 94]) for i in range(3)]
        rows.append(trajectory("b-on-a", model_id="math-a", task_id=B_MARKER))  # allowed by the key, not by math-a's policy
        assert b.submit(rows).accepted == 4
        b.submit([trajectory("b-bad", model_id="math-b", task_id=B_MARKER, output_logprobs=[0.5] * 4)])  # a rejection of b's
    with client(store, "a-worker") as a:
        assert rpc_code(lambda: a.set_reward(1.0, trajectory_id="b-0")) == grpc.StatusCode.NOT_FOUND
    with store.client() as admin:
        got = admin.query(
            "SELECT trajectory_id, tenant, metadata['tenant'] AS claimed, eligibility, eligibility_reason "
            "FROM trajectories ORDER BY 1"
        ).to_pylist()
    by_id = {r["trajectory_id"]: r for r in got}
    assert "a-to-b" not in by_id  # refused: nothing stored
    assert by_id["a-1"]["tenant"] == "team-a" and by_id["a-1"]["claimed"] == "team-b"
    assert {by_id[f"b-{i}"]["tenant"] for i in range(3)} == {"team-b"}
    assert by_id["b-on-a"]["eligibility"] == "held" and by_id["b-on-a"]["eligibility_reason"].startswith("TENANT_NOT_ALLOWED")
    assert all(r["eligibility"] == "eligible" for r in got if r["trajectory_id"] != "b-on-a")


def _sees_b(table) -> bool:
    import io

    import pyarrow as pa

    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    data = sink.getvalue()
    # tenant a's own row a-1 claims "team-b" in its metadata: that string is a's data, not a leak
    return any(secret in data for secret in (B_MARKER.encode(), b"b-on-a", b"b-bad", SECRET["b-worker"].encode()))


def test_a_tenant_reader_sees_its_own_rows_alone_through_every_sql_path(store, tmp_path):
    with client(store, "a-reader") as reader:
        plain = reader.query("SELECT trajectory_id, tenant FROM trajectories ORDER BY 1").to_pylist()
        assert plain == [{"trajectory_id": f"a-{i}", "tenant": "team-a"} for i in (1, 2, 3)]
        assert reader.query("SELECT count(*) AS n FROM rejections").to_pylist() == [{"n": 0}]
        joined = reader.query(
            "SELECT count(*) AS n FROM trajectories t FULL JOIN rejections r USING (trajectory_id) "
            "FULL JOIN leases l USING (trajectory_id) FULL JOIN rewards w USING (trajectory_id)"
        ).to_pylist()
        assert joined == [{"n": 3}]
        assert {r["model_id"] for r in reader.query("SELECT model_id FROM models").to_pylist()} == {"math-a"}
        catalog = [
            "SELECT * FROM information_schema.tables",
            "SELECT * FROM information_schema.columns",
            "SELECT table_name, estimated_size FROM duckdb_tables()",
            "SELECT * FROM duckdb_databases()",
            "SELECT * FROM duckdb_indexes()",
            "SELECT * FROM duckdb_views()",
            "SUMMARIZE trajectories",
            "SELECT * FROM groups",
            "SELECT * FROM model_policies",
            "SELECT * FROM audit",
            "SELECT * FROM policy_versions",
        ]
        for sql in catalog:
            assert not _sees_b(reader.query(sql)), sql
        sizes = {r["table_name"]: r["estimated_size"] for r in reader.query("SELECT * FROM duckdb_tables()").to_pylist()}
        assert sizes["trajectories"] == 3 and sizes["rejections"] == 0
        leaked, refused = [], 0
        paths = {k: str(tmp_path / k) for k in ("ledger", "wal", "log", "secret", "dir", "out")}
        paths["ledger"] = str(store.db)
        for sql in hostile(paths) + [
            "SELECT * FROM trajectories WHERE tenant = 'team-b'",
            f"SELECT * FROM trajectories WHERE task_id = '{B_MARKER}'",
        ]:
            try:
                answer = reader.query(sql, timeout_s=5)
            except grpc.RpcError:
                refused += 1
                continue
            if _sees_b(answer):
                leaked.append(sql)
        assert not leaked and refused > 100
    with client(store, "b-reader") as reader:  # the other tenant does see its own
        assert reader.query("SELECT count(*) AS n FROM trajectories").to_pylist() == [{"n": 4}]
        assert reader.query("SELECT count(*) AS n FROM rejections").to_pylist() == [{"n": 1}]
    with client(store, "a-reader") as reader:
        assert rpc_code(reader.stats) == grpc.StatusCode.PERMISSION_DENIED  # store-wide counters
    done = subprocess.run(
        [sys.executable, "-m", "rollbook.cli", "query", "--server", store.address, "--format", "json",
         "SELECT trajectory_id, task_id FROM trajectories"],
        capture_output=True, text=True, timeout=60, env=child_env(ROLLBOOK_READER_KEY=SECRET["a-reader"], ROLLBOOK_ADMIN_KEY=""),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "a-1" in done.stdout and B_MARKER not in done.stdout and "b-" not in done.stdout


def test_a_model_whose_policy_allows_one_tenant_trains_none_of_the_others_rows(store):
    with client(store, "a-trainer") as trainer:
        served = []
        while batch := trainer.pull_batch(trainer_id="t-a", trainer_version=0, max_staleness=4, model_id="math-a", num_samples=8):
            if batch.num_rows == 0:
                break
            served += batch.table.column("trajectory_id").to_pylist()
            trainer.ack_batch(batch.lease_id, "t-a")
        assert sorted(served) == ["a-1", "a-2", "a-3"]
        code = rpc_code(lambda: trainer.pull_batch(trainer_id="t-a", trainer_version=0, max_staleness=4, model_id="math-b"))
        assert code == grpc.StatusCode.PERMISSION_DENIED
    with store.client() as admin:
        audit = admin.query(
            "SELECT count(*) AS foreign_rows FROM leases l JOIN trajectories t USING (trajectory_id) "
            "WHERE t.model_id = 'math-a' AND t.tenant <> 'team-a'"
        ).to_pylist()
        assert audit == [{"foreign_rows": 0}]
        assert admin.query("SELECT count(*) AS n FROM leases").to_pylist() == [{"n": 3}]
