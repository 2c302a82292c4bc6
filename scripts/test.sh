#!/usr/bin/env bash
# Quick start, command 2: install with the test extras, run ruff (lint and format check) and mypy, then the whole suite (slow cases too).
# Pass pytest arguments to narrow it, e.g. `bash scripts/test.sh -m "not slow"`.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh" test
# Lint and type-check first (config in pyproject.toml); either failing fails the run (set -e).
.venv/bin/ruff check .
.venv/bin/ruff format --check .
bash scripts/typecheck.sh
set +e
.venv/bin/python -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests (exit 5): treating as failure, the suite must not be empty" >&2
  exit 1
fi
exit "$rc"
