#!/usr/bin/env bash
# Quick start, command 1: install, then run the main job on the embedded default: store, rollout
# and trainer on one machine, ledger in runs/quickstart/rollbook.duckdb. Extra arguments go to
# `rollbook run` (e.g. --num_steps 10, or --placement separated).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh" train
echo "rollbook is installed in .venv: 'source .venv/bin/activate' puts it on PATH (or call .venv/bin/rollbook)" >&2
exec .venv/bin/rollbook run --config configs/quickstart.toml "$@"
