"""Every configuration lives in ``rollbook/config/``, and that package loads no runtime: importing it,
building the configs and loading a run config pulls in no store, validator, trainer, rollout worker,
client or command module, and none of DuckDB, gRPC, Arrow, numpy, torch or transformers
(``rollbook/config/__init__.py``; docs/design.md, "Configuration").

Run: ``python -m pytest tests/unit/test_config_home.py -q``.
"""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

from tests.unit.test_imports import module_files

ROOT = pathlib.Path(__file__).resolve().parents[2]

HEAVY = ("duckdb", "grpc", "torch", "transformers", "pyarrow", "numpy")
RUNTIME = tuple(f"rollbook.{p}" for p in ("store", "validator", "trainer", "rollout", "client", "cli", "run"))

# In a fresh interpreter: what `import rollbook.config`, the default configs and a real run config load.
PROBE = """
import json, sys
import rollbook.config
from rollbook.config import RunConfig, StoreConfig, load_config
RunConfig()
StoreConfig()
config = load_config(RunConfig, "configs/quickstart.toml", [])
assert config.num_steps == config.trainer.num_steps
print(json.dumps(sorted(sys.modules)))
"""


def _under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_importing_the_config_and_loading_a_run_config_loads_no_runtime():
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout)
    heavy = [m for m in loaded if _under(m, HEAVY)]
    runtime = [m for m in loaded if _under(m, RUNTIME)]
    assert not heavy, f"import rollbook.config loads {heavy}"
    assert not runtime, f"import rollbook.config loads runtime modules {runtime}"
    ours = sorted(m for m in loaded if m.startswith("rollbook"))
    assert set(ours) <= {"rollbook", "rollbook.errors"} | {m for m in ours if _under(m, ("rollbook.config",))}, ours


def test_the_config_package_imports_only_pydantic_the_standard_library_and_errors():
    """Statically, imports inside functions included: a lazy import of a runtime module fails here
    even where the probe above never runs it."""
    allowed_rollbook = ("rollbook.config", "rollbook.errors")
    bad = []
    for name, path in module_files().items():
        if not _under(name, ("rollbook.config",)):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module]
            else:
                continue
            for target in targets:
                top = target.split(".")[0]
                if top == "rollbook":
                    if target != "rollbook" and not _under(target, allowed_rollbook):
                        bad.append((name, target))
                elif top not in sys.stdlib_module_names and top not in ("pydantic", "__future__"):
                    bad.append((name, target))
    assert not bad, f"rollbook/config/ imports outside pydantic, the standard library and rollbook.errors: {bad}"


def test_no_config_model_lives_outside_the_config_package():
    """Component settings are pydantic models in rollbook/config/; the proxy's HTTP request bodies
    (rollout/proxy/schemas.py) are wire schemas, not configuration."""
    wire_schemas = {"rollbook.rollout.proxy.schemas"}
    found = []
    for name, path in module_files().items():
        if _under(name, ("rollbook.config",)) or name in wire_schemas:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef) and any(ast.unparse(b).endswith("BaseModel") for b in node.bases):
                found.append(f"{name}.{node.name}")
    assert not found, f"pydantic models outside rollbook/config/: {found}"


def test_the_store_configs_sql_defaults_are_the_sandboxs_defaults():
    """StoreConfig's query_* defaults and store/sql.py QueryLimits' state the same values (the sandbox
    process imports sql.py and must not pay for pydantic), so they must agree."""
    from rollbook.config import StoreConfig
    from rollbook.store.server import query_limits
    from rollbook.store.sql import QueryLimits

    config = StoreConfig()
    assert query_limits(config) == QueryLimits(max_chunk_bytes=config.max_message_bytes - (1 << 20))


def test_runtime_values_come_from_functions_of_the_owning_modules(tmp_path):
    from rollbook.config import RewardConfig, StoreConfig
    from rollbook.rewards import sandbox_limits
    from rollbook.store.server import store_tls

    assert store_tls(StoreConfig()) is None
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    tls = store_tls(StoreConfig(tls_cert=cert, tls_key=key))
    assert tls is not None and (tls.cert, tls.key, tls.client_ca) == (str(cert), str(key), None)
    limits = sandbox_limits(RewardConfig(kind="code", timeout_s=3, cpu_s=2, memory_mb=256))
    assert (limits.wall_s, limits.cpu_s, limits.memory_mb) == (3, 2, 256)
