"""Governance on the ledger alone (store/governance.py): key files, tenant stamping, the ingest rules
that hold rows (a tenant a model's policy does not allow, a missing consent), holds and releases
under the ``drop`` policy, and the tenant snapshot's contents."""

from __future__ import annotations

import hashlib

import duckdb
import pytest

from rollbook.config import ValidatorConfig
from rollbook.config.store import KeyFileError, read_key_file
from rollbook.store.access import Caller, Denied, KeyRing, load_key_file
from rollbook.store.governance import build_tenant_snapshot
from rollbook.store.ledger import Ledger
from rollbook.store.schema import TABLES
from tests.unit.store.test_ledger import MODEL, row

ADMIN = Caller("admin", name="admin")
TEAM_A = Caller("worker", "team-a", frozenset({MODEL}), True, "a-worker")
TEAM_B = Caller("worker", "team-b", None, True, "b-worker")


@pytest.fixture
def ledger(tmp_path):
    led = Ledger(tmp_path / "l.duckdb", fold_interval_s=3600, validator_config=ValidatorConfig(incomplete_group_policy="drop"))
    led.register_model(MODEL, 100)
    led.publish_version(MODEL, 0, "c0")
    yield led
    led.close()


def _rows(ledger: Ledger, sql: str) -> list[tuple]:
    ledger.flush()
    cur = ledger.cursor()
    try:
        return cur.execute(sql).fetchall()
    finally:
        cur.close()


def _write(path, text: str, mode: int = 0o600):
    path.write_text(text)
    path.chmod(mode)
    return path


def test_a_key_file_binds_keys_to_roles_tenants_and_models(tmp_path):
    digest = hashlib.sha256(b"b-reader-secret-0123456789").hexdigest()
    path = _write(
        tmp_path / "keys.toml",
        f"""
[[keys]]
name = "a-worker"
role = "worker"
tenant = "team-a"
models = ["m"]
key = "a-worker-secret-0123456789"

[[keys]]
name = "b-reader"
role = "reader"
tenant = "team-b"
key_sha256 = "{digest}"
""",
    )
    entries = read_key_file(path)
    assert [(e.name, e.role, e.tenant, e.models) for e in entries] == [
        ("a-worker", "worker", "team-a", frozenset({"m"})),
        ("b-reader", "reader", "team-b", None),
    ]
    ring = KeyRing({"admin": "admin-secret-0123456789"}, load_key_file(path))
    caller = ring.authorize("Submit", [("authorization", "Bearer a-worker-secret-0123456789")])
    assert (caller.tenant, caller.scoped, caller.may_use("m"), caller.may_use("other")) == ("team-a", True, True, False)
    with pytest.raises(Denied, match="not bound to model 'other'"):
        caller.check_model("Submit", "other")
    reader = ring.authorize("Query", [("authorization", "Bearer b-reader-secret-0123456789")])
    assert (reader.tenant, reader.sees_all) == ("team-b", False)
    assert ring.authorize("Query", [("authorization", "Bearer admin-secret-0123456789")]).sees_all


@pytest.mark.parametrize(
    "text,mode,message",
    [
        ('[[keys]]\nname="a"\nrole="worker"\ntenant="t"\nkey="0123456789abcdefgh"\n', 0o644, "chmod 600"),
        ('[[keys]]\nname="a"\nrole="boss"\ntenant="t"\nkey="0123456789abcdefgh"\n', 0o600, "role must be one of"),
        ('[[keys]]\nname="a"\nrole="worker"\ntenant="t/../x"\nkey="0123456789abcdefgh"\n', 0o600, "tenant must be"),
        ('[[keys]]\nname="a"\nrole="worker"\ntenant="t"\nkey="short"\n', 0o600, "shorter than"),
        ('[[keys]]\nname="a"\nrole="worker"\ntenant="t"\n', 0o600, "exactly one of key and key_sha256"),
        (
            '[[keys]]\nname="a"\nrole="worker"\ntenant="t"\nkey="0123456789abcdefgh"\n'
            '[[keys]]\nname="b"\nrole="reader"\ntenant="t"\nkey="0123456789abcdefgh"\n',
            0o600,
            "same key appears twice",
        ),
        ("keys = 3\n", 0o600, "one or more [[keys]]"),
        ("[[keys]\n", 0o600, "not TOML"),
    ],
)
def test_a_key_file_that_cannot_be_used_is_refused_with_the_reason(tmp_path, text, mode, message):
    with pytest.raises(KeyFileError, match=message.replace("[", r"\[")):
        read_key_file(_write(tmp_path / "keys.toml", text, mode))


def test_rows_are_stamped_with_the_key_tenant_and_a_policy_holds_what_it_does_not_allow(ledger):
    ledger.set_policy(MODEL, ["team-a"], True, caller=ADMIN)
    ledger.submit([row("a-consent", metadata={"consent": "true", "tenant": "team-b"}), row("a-none")], caller=TEAM_A)
    ledger.submit([row("b-consent", metadata={"consent": "true"})], caller=TEAM_B)
    with pytest.raises(Denied):
        ledger.submit([row("a-other", model_id="other")], caller=TEAM_A)
    got = _rows(
        ledger,
        "SELECT trajectory_id, tenant, eligibility, split_part(eligibility_reason, ':', 1), eligibility_set_by FROM trajectories ORDER BY 1",
    )
    assert got == [
        ("a-consent", "team-a", "eligible", "", "ingest"),
        ("a-none", "team-a", "held", "NO_CONSENT", "ingest"),
        ("b-consent", "team-b", "held", "TENANT_NOT_ALLOWED", "ingest"),
    ]
    # a release never overrides the policy: only a row it allows comes back
    n, _ = ledger.set_eligibility(["a-none", "b-consent"], "eligible", reason="x", caller=ADMIN, predicate="true")
    assert n == 0
    ledger.set_policy(MODEL, None, False, caller=ADMIN)
    n, _ = ledger.set_eligibility(["a-none", "b-consent"], "eligible", reason="policy lifted", caller=ADMIN, predicate="true")
    assert n == 2
    assert _rows(ledger, "SELECT action, num_rows FROM audit ORDER BY acted_at") == [
        ("policy", 0),
        ("release", 0),
        ("policy", 0),
        ("release", 2),
    ]


def test_metadata_past_its_limits_is_rejected_as_oversized(ledger):
    outcomes = ledger.submit(
        [
            row("many", metadata={f"k{i}": "v" for i in range(33)}),
            row("long", metadata={"k": "v" * 300}),
            row("ok", metadata={"k": "v"}),
        ]
    )
    assert [(o.trajectory_id, o.reason) for o in outcomes] == [("many", "OVERSIZED"), ("long", "OVERSIZED"), ("ok", "")]


def test_a_group_with_a_held_member_follows_the_drop_policy(ledger):
    ledger.submit([row(f"g-{i}", group_id="g", group_size=2) for i in range(2)])
    ledger.set_eligibility(["g-0"], "held", reason="review", caller=ADMIN, predicate="trajectory_id = 'g-0'")
    ledger.set_reward(1.0, trajectory_id="g-0")
    ledger.set_reward(0.0, trajectory_id="g-1")  # settles: the group is one member short of its size, all rewarded
    assert _rows(ledger, "SELECT trajectory_id, reason FROM rejections") == [("g-1", "INCOMPLETE_GROUP")]
    assert _rows(ledger, "SELECT trajectory_id, eligibility, status FROM trajectories") == [("g-0", "held", "pending")]
    ledger.set_eligibility(["g-0"], "eligible", reason="ok", caller=ADMIN, predicate="trajectory_id = 'g-0'")
    assert _rows(ledger, "SELECT trajectory_id, reason FROM rejections ORDER BY 1") == [
        ("g-0", "INCOMPLETE_GROUP"),
        ("g-1", "INCOMPLETE_GROUP"),
    ]


def test_a_tenant_snapshot_holds_its_rows_alone(ledger, tmp_path):
    ledger.submit([row("a-1", task_id="alpha")], caller=TEAM_A)
    ledger.submit([row("b-1", task_id="bravo-secret"), row("b-bad", output_logprobs=[1.0] * 4)], caller=TEAM_B)
    base = tmp_path / "base.duckdb"
    ledger.snapshot(base)
    view = tmp_path / "a.duckdb"
    build_tenant_snapshot(base, view, "team-a", frozenset({MODEL}))
    con = duckdb.connect(str(view), read_only=True)
    try:
        assert con.execute("SELECT trajectory_id FROM trajectories").fetchall() == [("a-1",)]
        assert con.execute("SELECT count(*) FROM rejections").fetchall() == [(0,)]
        assert con.execute("SELECT model_id FROM models").fetchall() == [(MODEL,)]
        tables = {name for (name,) in con.execute("SELECT table_name FROM duckdb_tables()").fetchall()}
        assert tables == set(TABLES)  # the documented tables; the internal ones are not there at all
    finally:
        con.close()
    assert b"bravo-secret" not in view.read_bytes() and b"b-bad" not in view.read_bytes()


def test_a_policy_with_detectors_holds_rows_whose_decoded_text_a_rule_finds(tmp_path):
    import string

    from rollbook.tokenizers import CharTokenizer

    tok = CharTokenizer(string.ascii_letters + string.digits + "@.-_ +:=")
    tok.save_pretrained(tmp_path / "tok")
    led = Ledger(tmp_path / "d.duckdb", fold_interval_s=3600, detector_tokenizers={MODEL: tmp_path / "tok"})
    try:
        led.register_model(MODEL, tok.vocab_size)
        led.register_model("other", tok.vocab_size)
        led.publish_version(MODEL, 0, "c0")
        led.publish_version("other", 0, "c0")

        def said(tid: str, text: str, model: str = MODEL, prompt: str = "what is 6 x 7"):
            ids = tok.encode(text)
            return row(tid, model_id=model, prompt_token_ids=tok.encode(prompt), output_token_ids=ids,
                       output_logprobs=[-1.0] * len(ids), output_versions=[0] * len(ids))  # fmt: skip

        led.submit([said("before", "mail me at bob@example.com")])  # stored before the policy: held by it
        n, _ = led.set_policy(MODEL, None, False, caller=ADMIN, detectors=["email", "api_key"])
        assert n == 1
        led.submit(
            [
                said("clean", "the answer is 42"),
                said("mail", "write to alice@example.org"),
                said("key", "use sk-proj-abcdefghijklmnopqrstuvwx123"),
                said("asked", "sure", prompt="my mail is eve@example.net"),
                said("elsewhere", "mail bob@example.com", model="other"),  # no policy on that model
            ]
        )
        got = dict(_rows(led, "SELECT trajectory_id, eligibility_reason FROM trajectories WHERE eligibility = 'held'"))
        assert set(got) == {"before", "mail", "key", "asked"}
        assert got["mail"] == "DETECTOR_HIT: output: email x1" and got["asked"] == "DETECTOR_HIT: prompt: email x1"
        assert got["key"] == "DETECTOR_HIT: output: api_key x1"
        assert "example" not in "".join(got.values())  # the reason names rules, never the text
        with pytest.raises(Exception, match="no tokenizer for model 'other'"):
            led.set_policy("other", None, False, caller=ADMIN, detectors=["email"])
        with pytest.raises(Exception, match="unknown"):
            led.set_policy(MODEL, None, False, caller=ADMIN, detectors=["emails"])
    finally:
        led.close()
