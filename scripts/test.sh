#!/usr/bin/env bash
# Quick start, command 2: install with the test extras, run ruff (lint and format check) and mypy, then pytest.
#
#   bash scripts/test.sh           the full run, what .ci/run runs: every test, slow and integration ones too
#   bash scripts/test.sh --fast    the fast lane: the unit tests (not the slow ones) and the end-to-end smoke
#                                  tests (a real store and one short run), -m "(not integration and not slow) or smoke"
#
# Both run ruff and mypy first (about a minute). pytest runs on three pytest-xdist workers (-n 3 --dist
# loadgroup: tests that start a Ray instance share one group, so they run one at a time; many tests
# wait on the processes they start, so on 2 cores a third worker fills those waits). Further
# arguments go to pytest after these, e.g. `bash scripts/test.sh -m "not slow"` or `-n 0` for one process.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh" test
# Byte-code caches for the project's own modules: the suite starts a few hundred Python processes,
# and with PYTHONDONTWRITEBYTECODE set (some images set it) each one compiles what it imports again.
unset PYTHONDONTWRITEBYTECODE
lane=()
if [ "${1:-}" = "--fast" ]; then
  shift
  lane=(-m "(not integration and not slow) or smoke")
fi
# Lint and type-check first (config in pyproject.toml); either failing fails the run (set -e).
.venv/bin/ruff check .
.venv/bin/ruff format --check .
bash scripts/typecheck.sh
set +e
.venv/bin/python -m pytest -n 3 --dist loadgroup "${lane[@]}" "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests (exit 5): treating as failure, the suite must not be empty" >&2
  exit 1
fi
exit "$rc"
