#!/usr/bin/env bash
# Quick start, command 1: install, then run the main job on the embedded default
# (a DuckDB ledger in runs/quickstart/). Extra arguments go to `rollbook demo`.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh" train
exec .venv/bin/rollbook demo --run-dir runs/quickstart "$@"
