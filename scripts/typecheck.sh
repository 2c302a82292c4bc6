#!/usr/bin/env bash
# Type-check the installed `rollbook` package with mypy (config: [tool.mypy] in pyproject.toml).
# The top-level folders install as rollbook.* subpackages ([tool.setuptools] package-dir), a mapping
# mypy cannot follow through setuptools' editable finder. So this lays the package out as installed,
# in a throwaway directory of symlinks built from that same package-dir table (rollbook/store -> store/,
# rollbook/v1 -> proto/rollbook/v1/, ...), and runs mypy on it. Error paths read rollbook/store/x.py
# for store/x.py. Also checks the test files in SEAM_TESTS. Extra arguments go to mypy.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
PY=${PY:-$ROOT/.venv/bin/python}
LAYOUT=$(mktemp -d)
trap 'rm -rf "$LAYOUT"' EXIT
"$PY" - "$ROOT" "$LAYOUT" <<'PYEOF'
import pathlib, sys, tomllib
root, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
dirs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
top = out / "rollbook"
top.mkdir()
for child in (root / dirs["rollbook"]).iterdir():          # rollbook/*.py, rollbook/weights, ...
    if child.name != "__pycache__":
        (top / child.name).symlink_to(child)
for package, folder in dirs.items():                        # rollbook.store -> store/, ...
    if package != "rollbook":
        (out / package.replace(".", "/")).symlink_to(root / folder)
PYEOF
# Test files that exist to be type-checked: they hold the typed seams' proofs (docs/design.md, "Typed
# seams"), checked as top-level modules beside the layout.
SEAM_TESTS=(tests/unit/test_seams.py)
MODULES=(-p rollbook)
for test in "${SEAM_TESTS[@]}"; do
    ln -s "$ROOT/$test" "$LAYOUT/$(basename "$test")"
    MODULES+=(-m "$(basename "$test" .py)")
done
cd "$LAYOUT"
exec "$PY" -m mypy --config-file "$ROOT/pyproject.toml" --cache-dir "$ROOT/.mypy_cache" "${MODULES[@]}" "$@"
