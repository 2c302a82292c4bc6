"""The promotion gate's columns of ``policy_versions`` (status, gate; docs/gate.md) on a real ledger
file: ``SetVersionStatus`` through the servicer, a republished version keeping its verdict, the
rollback of ``rollbook admin rollback``, and a file made before the columns upgraded in place."""

from __future__ import annotations

import json

import duckdb
import grpc
import pytest

from rollbook.store import service as service_module
from rollbook.store.ledger import InvalidStatus, Ledger, UnknownVersion
from rollbook.store.schema import DDL
from rollbook.store.service import Abort, SyncContext, TrajectoryStoreService
from rollbook.store.sql import QueryLimits
from rollbook.v1 import rollbook_pb2 as pb


@pytest.fixture
def ledger(tmp_path, monkeypatch):
    monkeypatch.setattr(service_module, "_sandbox", lambda ledger, limits: None)  # no Query here
    ledger = Ledger(tmp_path / "rollbook.duckdb")
    ledger.register_model("m", 32)
    for version in range(4):
        ledger.publish_version("m", version, f"sum-{version}")
    yield ledger
    ledger.close()


def _rows(ledger: Ledger) -> list[tuple]:
    return ledger.con.execute("SELECT version, checksum, status, gate FROM policy_versions ORDER BY version").fetchall()


def _set(ledger: Ledger, **fields) -> pb.SetVersionStatusResponse:
    service = TrajectoryStoreService(ledger, query_limits=QueryLimits())
    return service.call("SetVersionStatus", pb.SetVersionStatusRequest(model_id="m", **fields), SyncContext())


def test_set_version_status_records_the_verdict_and_its_figures_and_a_republish_keeps_them(ledger):
    _set(ledger, version=2, status="refused", gate_json=json.dumps({"reward": 0.1, "reasons": ["drop"]}))
    _set(ledger, version=1, status="promoted")
    ledger.publish_version("m", 2, "sum-again")  # a resumed trainer publishes its version again
    rows = _rows(ledger)
    assert [(v, c, s) for v, c, s, _ in rows] == [
        (0, "sum-0", None),
        (1, "sum-1", "promoted"),
        (2, "sum-again", "refused"),
        (3, "sum-3", None),
    ]
    assert json.loads(rows[2][3]) == {"reward": 0.1, "reasons": ["drop"]} and rows[1][3] is None
    _set(ledger, version=2, status="promoted", gate_json='{"reward": 0.5}')  # recorded again: replaced
    assert ledger.version_record("m", 2) == ("promoted", '{"reward": 0.5}')


@pytest.mark.parametrize(
    "fields, code, message",
    [
        ({"version": 9, "status": "promoted"}, grpc.StatusCode.NOT_FOUND, "version 9 of model 'm' was never published"),
        (
            {"version": 1, "status": "great"},
            grpc.StatusCode.INVALID_ARGUMENT,
            "status must be one of promoted, refused, rolled_back",
        ),
        (
            {"version": 1, "status": "refused", "gate_json": "[1]"},
            grpc.StatusCode.INVALID_ARGUMENT,
            "gate_json must be a JSON object",
        ),
        (
            {"version": 1, "status": "refused", "gate_json": "{"},
            grpc.StatusCode.INVALID_ARGUMENT,
            "gate_json must be a JSON object",
        ),
    ],
)
def test_a_bad_verdict_answers_its_status_and_changes_nothing(ledger, fields, code, message):
    before = _rows(ledger)
    with pytest.raises(Abort) as aborted:
        _set(ledger, **fields)
    assert aborted.value.code == code and message in aborted.value.details
    assert _rows(ledger) == before


def test_roll_back_marks_the_later_versions_but_the_refused_ones_and_records_the_new_one_promoted(ledger):
    ledger.set_version_status("m", 2, "refused", '{"reward": 0.0}')
    with pytest.raises(InvalidStatus, match="was refused by the gate"):
        ledger.roll_back("m", 2, 4, "{}")
    with pytest.raises(UnknownVersion):
        ledger.roll_back("m", 7, 8, "{}")
    with pytest.raises(InvalidStatus, match="must be above the latest published, 3"):
        ledger.roll_back("m", 1, 3, "{}")
    assert ledger.roll_back("m", 1, 4, '{"rolled_back_to": 1}') == [3]
    assert [(v, s) for v, _, s, _ in _rows(ledger)] == [(0, None), (1, None), (2, "refused"), (3, "rolled_back"), (4, "promoted")]
    assert ledger.model_entry("m").latest_version == 4
    ledger.publish_version("m", 4, "sum-4")  # the resumed trainer: its checksum, the verdict kept
    assert _rows(ledger)[-1][1:3] == ("sum-4", "promoted")


def test_a_ledger_made_before_the_columns_gets_them_with_null_verdicts(tmp_path):
    db = tmp_path / "old.duckdb"
    con = duckdb.connect(str(db))
    for ddl in DDL:
        if "policy_versions ADD COLUMN" not in ddl:
            con.execute(ddl)
    con.execute("INSERT INTO models VALUES ('m', 32, 0.0)")
    con.execute("INSERT INTO policy_versions VALUES ('m', 0, 'sum-0', 0.0)")
    con.close()
    ledger = Ledger(db)
    try:
        assert _rows(ledger) == [(0, "sum-0", None, None)]
        ledger.set_version_status("m", 0, "promoted", '{"reward": 1.0}')
        assert ledger.version_record("m", 0) == ("promoted", '{"reward": 1.0}')
    finally:
        ledger.close()
