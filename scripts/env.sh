# Sourced by quickstart.sh and test.sh: create .venv (once) and install rollbook with the given extras.
# torch is pinned to 2.13.0 first: that is the CPU build; any other torch request pulls a CUDA build.
# Every other package is pinned by constraints.txt, so a fresh clone gets the versions the tests and
# the figures in docs/RESULTS.md were measured with.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
VENV_PY=.venv/bin/python
"$VENV_PY" -m pip install -q --upgrade pip >/dev/null
"$VENV_PY" -c "import torch" 2>/dev/null || "$VENV_PY" -m pip install -q torch==2.13.0
"$VENV_PY" -m pip install -q -c constraints.txt -e ".[$1]"
