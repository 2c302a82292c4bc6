"""The import rules of ``docs/design.md`` ("What each folder may import"), checked on the source.

Every ``.py`` of the package (the folders of ``[tool.setuptools] package-dir`` in pyproject.toml)
is parsed, and every ``import`` in it counts, those inside functions included (a lazy import is
still a dependency); only imports under ``if TYPE_CHECKING:`` are left out (never run). The tests
fail on an import cycle between files or between packages, and on a forbidden dependency, direct
or through other modules (the message shows the path).

Run: ``python -m pytest tests/unit/test_imports.py -q``.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]

# The commands: rollbook/cli/ (entry points) and rollbook/run/ (orchestration of a run) may import
# anything (lazily), nothing outside them may import them.
COMMAND_PACKAGES = ("rollbook.cli", "rollbook.run")


def is_command(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in COMMAND_PACKAGES)


# Known file cycles, each allowed by naming the one edge that closes it: none today. An entry here
# must say why the cycle cannot be broken yet.
ALLOWED_BACK_EDGES: set[tuple[str, str]] = set()

HEAVY = ("torch", "transformers", "vllm")


def module_files(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
    """Module name -> file, for every module of every package in pyproject.toml's mapping."""
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir = setuptools["package-dir"]
    modules: dict[str, pathlib.Path] = {}
    for package, folder in package_dir.items():
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root / folder).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


def _type_checking_only(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def imports_of(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The modules ``name`` imports: a known module where the import names one (``from pkg import
    mod`` is ``pkg.mod``), else the dotted name as written (``torch``, ``rollbook.store._varint``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or _type_checking_only(node, parents):
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:  # relative: from the importing module's package
            package = name.split(".") if is_package else name.split(".")[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join(package + ([base] if base else []))
        for alias in node.names:
            full = f"{base}.{alias.name}"
            found.add(full if full in known else base)
    found.discard(name)
    return found


@functools.cache
def graph(root: pathlib.Path = ROOT) -> dict[str, frozenset[str]]:
    files = module_files(root)
    known = set(files)
    return {name: frozenset(imports_of(name, path, known)) for name, path in files.items()}


def package_of(module: str) -> str:
    """The architectural package: a top-level folder, or the shared half / the command half of rollbook/."""
    parts = module.split(".")
    if parts[0] != "rollbook":
        return parts[0]  # a third-party or standard module
    if len(parts) > 1 and parts[1] in ("store", "validator", "trainer", "rollout", "v1"):
        return f"rollbook.{parts[1]}"
    return "rollbook (commands)" if is_command(module) else "rollbook (shared)"


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (or a self-loop), each as a list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan; graphs here are small, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges.get(v, ()):
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def path_to(start: str, reaches, edges) -> list[str] | None:
    """The shortest import path from ``start`` to a module for which ``reaches(module)`` holds."""
    seen, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges.get(v, ())):
                if w in seen:
                    continue
                seen[w] = v
                if reaches(w):
                    path = [w]
                    while seen[path[-1]] is not None:
                        path.append(seen[path[-1]])
                    return path[::-1]
                nxt.append(w)
        frontier = nxt
    return None


def _internal_edges(allow: set[tuple[str, str]] = frozenset()) -> dict[str, set[str]]:
    g = graph()
    return {v: {w for w in ws if w in g and (v, w) not in allow} for v, ws in g.items()}


def _under(*prefixes: str):
    return lambda m: any(m == p or m.startswith(p + ".") for p in prefixes)


# ---------------------------------------------------------------------------------------------------


def test_the_walk_sees_every_folder_and_lazy_imports():
    g = graph()
    for package in (
        "rollbook.store",
        "rollbook.validator",
        "rollbook.trainer",
        "rollbook.rollout",
        "rollbook.v1",
        "rollbook.weights",
        "rollbook.cli",
    ):
        assert package in g, package
    assert "rollbook.trainer.loop" in g["rollbook.trainer.main"]  # imported inside train()
    assert "rollbook.v1.rollbook_pb2" in g["rollbook.store.service"]  # from rollbook.v1 import rollbook_pb2 as pb
    assert "torch" in g["rollbook.language_models"]  # inside build_tiny_model


def test_no_import_cycle_between_files():
    found = cycles(_internal_edges(ALLOWED_BACK_EDGES))
    assert not found, f"import cycles between files: {found}"


def test_the_allow_list_names_only_edges_that_exist():
    g = graph()
    stale = [(a, b) for a, b in ALLOWED_BACK_EDGES if b not in g.get(a, ())]
    assert not stale, f"allowed back edges that no longer exist, remove them from ALLOWED_BACK_EDGES: {stale}"


def test_no_import_cycle_between_packages():
    edges: dict[str, set[str]] = {}
    for v, ws in _internal_edges().items():
        for w in ws:
            if package_of(v) != package_of(w):
                edges.setdefault(package_of(v), set()).add(package_of(w))
    found = cycles(edges)
    assert not found, f"import cycles between packages: {found}; edges: {sorted((a, b) for a in edges for b in edges[a])}"


def _violations(sources, forbidden) -> list[list[str]]:
    g, edges = graph(), {v: set(ws) for v, ws in graph().items()}
    out = []
    for module in sorted(filter(sources, g)):
        path = path_to(module, forbidden, edges)
        if path:
            out.append(path)
    return out


def test_the_store_never_loads_a_model_nor_reaches_trainer_rollout_or_the_client():
    bad = _violations(
        _under("rollbook.store"),
        lambda m: _under(*HEAVY, "rollbook.trainer", "rollbook.rollout", "rollbook.client")(m) or is_command(m),
    )
    assert not bad, f"store imports (path shown): {bad}"


def test_the_validator_and_the_client_do_not_import_the_store():
    bad = _violations(
        lambda m: _under("rollbook.validator", "rollbook.client")(m),
        lambda m: _under("rollbook.store", "rollbook.trainer", "rollbook.rollout", *HEAVY)(m) or is_command(m),
    )
    assert not bad, f"validator/client imports (path shown): {bad}"
    bad = _violations(_under("rollbook.client"), _under("rollbook.validator"))
    assert not bad, f"the client imports the validator: {bad}"


def test_trainer_and_rollout_reach_the_store_only_through_the_client():
    reaches_store = lambda m: _under("rollbook.store", "rollbook.validator")(m) or is_command(m)  # noqa: E731
    bad = _violations(_under("rollbook.trainer", "rollbook.rollout"), reaches_store)
    assert not bad, f"trainer/rollout reach the store other than through the client (path shown): {bad}"


def test_trainer_and_rollout_do_not_import_each_other():
    bad = _violations(_under("rollbook.trainer"), _under("rollbook.rollout")) + _violations(
        _under("rollbook.rollout"), _under("rollbook.trainer")
    )
    assert not bad, f"trainer <-> rollout (path shown): {bad}"


def test_shared_modules_sit_below_every_component():
    shared = lambda m: package_of(m) == "rollbook (shared)"  # noqa: E731
    bad = _violations(
        shared,
        lambda m: _under("rollbook.store", "rollbook.validator", "rollbook.trainer", "rollbook.rollout")(m) or is_command(m),
    )
    assert not bad, f"shared rollbook modules import a component or a command (path shown): {bad}"


def test_the_wire_stubs_import_only_themselves():
    bad = _violations(_under("rollbook.v1"), lambda m: m.startswith("rollbook") and not _under("rollbook.v1")(m))
    assert not bad, f"proto imports (path shown): {bad}"
