"""The committed stubs under ``proto/rollbook/v1`` are exactly what ``proto/regen.py`` generates
from the ``.proto`` files today (fails when someone edits a contract and forgets to regenerate).

Run: ``python -m pytest tests/unit/test_proto_stubs.py -q``; fix with ``python proto/regen.py``.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "proto" / "rollbook" / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def _stubs(folder: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name.endswith(GENERATED_SUFFIXES)}


def test_committed_stubs_match_a_fresh_regeneration(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools is a test extra")
    done = subprocess.run(
        [sys.executable, str(ROOT / "proto" / "regen.py"), "--out", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    fresh, committed = _stubs(tmp_path / "rollbook" / "v1"), _stubs(COMMITTED)
    protos = sorted(p.stem for p in COMMITTED.glob("*.proto"))
    assert protos, "no .proto files found"
    assert sorted(fresh) == sorted(f"{stem}{suffix}" for stem in protos for suffix in GENERATED_SUFFIXES)
    assert sorted(committed) == sorted(fresh), "a stub is missing or left over: run python proto/regen.py"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale stubs {stale}: run python proto/regen.py and commit the result"


def test_the_installed_package_serves_the_committed_stubs():
    from rollbook.v1 import rollbook_pb2

    assert pathlib.Path(rollbook_pb2.__file__).resolve().parent == COMMITTED
    assert set(rollbook_pb2.DESCRIPTOR.services_by_name["TrajectoryStore"].methods_by_name) >= {
        "Submit",
        "SetReward",
        "PullBatch",
        "AckBatch",
        "Query",
        "PublishVersion",
        "RegisterModel",
        "GetStats",
    }


def test_the_call_tree_fields_keep_their_numbers_and_types():
    """Fields 22 and 23 of ``Trajectory`` are on the wire: renumbering them would misread every
    stored client's messages."""
    from rollbook.v1 import rollbook_pb2

    fields = rollbook_pb2.Trajectory.DESCRIPTOR.fields_by_name
    got = {
        name: (fields[name].number, fields[name].type, fields[name].has_presence) for name in ("parent_request_id", "branched")
    }
    string, boolean = fields["request_id"].type, fields["consumed"].type
    assert got == {"parent_request_id": (22, string, False), "branched": (23, boolean, False)}
