"""The ``rollbook`` command stays thin: ``--help`` works and imports no torch, and neither does
``rollbook query`` (help or a real query on a file).

Run: ``python -m pytest tests/unit/test_cli.py -q``.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

HEAVY = ("torch", "transformers")


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("ROLLBOOK_")}


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=120, env=_clean_env())


def _loaded_after(argv: list[str]) -> dict:
    """Run ``rollbook.cli.main(argv)`` in a fresh interpreter; report its exit code and which heavy
    modules it imported (``build_parser`` alone, then the command)."""
    done = _python("""
        import json, sys
        from rollbook.cli import build_parser, main
        build_parser()
        after_parser = [m for m in %r if m in sys.modules]
        try:
            code = main(json.loads(sys.argv[1]))
        except SystemExit as exc:
            code = exc.code
        sys.stdout.flush()
        print("\\n" + json.dumps({"code": code or 0, "after_parser": after_parser,
                                  "after_command": [m for m in %r if m in sys.modules]}))
    """ % (HEAVY, HEAVY), json.dumps(argv))
    assert done.returncode in (0, 1, 2), done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("argv", [["--help"], ["query", "--help"], ["serve", "--help"], ["stats", "--help"]],
                         ids=["rollbook", "query", "serve", "stats"])
def test_help_exits_zero_without_importing_torch(argv):
    got = _loaded_after(argv)
    assert got == {"code": 0, "after_parser": [], "after_command": []}


def test_query_on_a_file_does_not_import_torch(tmp_path):
    import duckdb

    db = tmp_path / "rollbook.duckdb"
    duckdb.connect(str(db)).close()
    got = _loaded_after(["query", "--db", str(db), "--format", "json", "SELECT 42 AS answer"])
    assert got == {"code": 0, "after_parser": [], "after_command": []}


def test_the_console_script_prints_help_and_returns_zero():
    script = pathlib.Path(sys.executable).with_name("rollbook")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "rollbook.cli"]
    done = subprocess.run([*cmd, "--help"], capture_output=True, text=True, timeout=60, env=_clean_env())
    assert done.returncode == 0, done.stderr
    for command in ("serve", "query", "stats"):
        assert command in done.stdout


def test_unknown_arguments_are_a_usage_error():
    done = subprocess.run([sys.executable, "-m", "rollbook.cli", "query", "--no-such-flag", "SELECT 1"],
                          capture_output=True, text=True, timeout=60, env=_clean_env())
    assert done.returncode == 2 and "unrecognized arguments: --no-such-flag" in done.stderr
