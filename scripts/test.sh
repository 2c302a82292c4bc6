#!/usr/bin/env bash
# Quick start, command 2: install with the test extras, then run the whole suite (slow cases too).
# Pass pytest arguments to narrow it, e.g. `bash scripts/test.sh -m "not slow"`.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh" test
set +e
.venv/bin/python -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests (exit 5): treating as failure, the suite must not be empty" >&2
  exit 1
fi
exit "$rc"
