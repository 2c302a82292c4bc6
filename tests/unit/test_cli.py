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
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True, timeout=120, env=_clean_env()
    )


def _loaded_after(argv: list[str]) -> dict:
    """Run ``rollbook.cli.main(argv)`` in a fresh interpreter; report its exit code and which heavy
    modules it imported (``build_parser`` alone, then the command)."""
    done = _python(
        """
        import json, sys
        from rollbook.cli.main import build_parser, main
        build_parser()
        after_parser = [m for m in HEAVY if m in sys.modules]
        try:
            code = main(json.loads(sys.argv[1]))
        except SystemExit as exc:
            code = exc.code
        sys.stdout.flush()
        print("\\n" + json.dumps({"code": code or 0, "after_parser": after_parser,
                                  "after_command": [m for m in HEAVY if m in sys.modules]}))
    """.replace("HEAVY", repr(HEAVY)),  # a code template full of braces: no f-string or %-format
        json.dumps(argv),
    )
    assert done.returncode in (0, 1, 2), done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["query", "--help"], ["serve", "--help"], ["stats", "--help"]],
    ids=["rollbook", "query", "serve", "stats"],
)
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
    done = subprocess.run(
        [sys.executable, "-m", "rollbook.cli", "query", "--no-such-flag", "SELECT 1"],
        capture_output=True,
        text=True,
        timeout=60,
        env=_clean_env(),
    )
    assert done.returncode == 2 and "unrecognized arguments: --no-such-flag" in done.stderr


# ---- one configuration surface, one-line errors ----------------------------------------------------
# Each runs the real command (``python -m rollbook.cli``) as a subprocess; stores are real ``rollbook
# serve`` processes on a DuckDB file in tmp_path.

REPO = pathlib.Path(__file__).resolve().parents[2]


def _rollbook(*args: str, env: dict | None = None, timeout: float = 120, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rollbook.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or _clean_env(),
        cwd=cwd,
    )


def _one_line_error(done: subprocess.CompletedProcess, code: int, command: str) -> str:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == code, done.stdout + done.stderr
    assert len(lines) == 1 and lines[0].startswith(f"rollbook {command}: error: "), done.stderr
    assert "Traceback" not in done.stderr and "pydantic" not in done.stderr and "validation error" not in done.stderr
    return lines[0]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def store(tmp_path):
    from rollbook.run.store_process import StoreProcess

    proc = StoreProcess(tmp_path / "rollbook.duckdb", env=_clean_env())
    yield proc
    proc.stop()


@pytest.mark.parametrize("command", ["run", "train", "rollout", "serve"])
def test_help_config_lists_every_field_with_type_default_and_description(command):
    done = _rollbook(command, "--help-config")
    assert done.returncode == 0, done.stderr
    expected = {
        "run": ["--trainer.lr  float  (default: 0.001)", "--store.validator.norm.mode", "--max_staleness"],
        "train": ["--loss.eps_clip  float  (default: 0.2)", "--keep_last  int  (default: 2)"],
        "rollout": ["--rollout.group_size  int  (default: 8)", "--weights  str  (default: required)", "--max_idle_s"],
        "serve": ["--validator.norm.mode", "--query_max_rows  int  (default: 100000)", "--ingest.sentinel_logprobs"],
    }
    for text in expected[command]:
        assert text in done.stdout, text
    assert "--help-config" in _rollbook(command, "--help").stdout


def test_serve_help_config_does_not_import_torch():
    got = _loaded_after(["serve", "--help-config"])
    assert got == {"code": 0, "after_parser": [], "after_command": []}


def test_serve_takes_a_config_file_and_dotted_overrides_and_its_flags_still_win(tmp_path):
    from rollbook.run.store_process import StoreProcess

    config = tmp_path / "store.toml"
    config.write_text("query_max_rows = 5\nport = 1\n\n[validator.norm]\nmode = 'group_mean'\n")
    # the file says port 1, the --port 0 flag wins; --query_max_rows 3 (override) beats the file's 5
    proc = StoreProcess(tmp_path / "rollbook.duckdb", env=_clean_env(), config_file=config, extra_args=("--query_max_rows", "3"))
    try:
        with proc.client() as client:
            assert client.query("SELECT * FROM range(10)").num_rows == 3
    finally:
        proc.stop()


def test_run_passes_its_store_section_to_the_store_it_starts(tmp_path):
    from rollbook.config import RunConfig, load_config
    from rollbook.run.main import write_store_config
    from rollbook.run.store_process import StoreProcess

    config = load_config(RunConfig, None, ["--run_dir", str(tmp_path), "--store.query_max_rows", "4"])
    proc = StoreProcess(tmp_path / "rollbook.duckdb", env=_clean_env(), config_file=write_store_config(config, tmp_path))
    try:
        with proc.client() as client:
            assert client.query("SELECT * FROM range(10)").num_rows == 4
    finally:
        proc.stop()


@pytest.mark.parametrize(
    "args",
    [["--no_such_policy", "1"], ["--validator.norm.mode", "median"], ["--config", "configs/nope.toml"]],
    ids=["unknown", "bad-value", "missing-file"],
)
def test_serve_config_errors_are_one_line(tmp_path, args):
    line = _one_line_error(_rollbook("serve", "--db", str(tmp_path / "x.duckdb"), "--port", "0", *args, cwd=REPO), 2, "serve")
    assert {"unknown": "no_such_policy", "bad-value": "validator.norm.mode", "missing-file": "nope.toml"}[
        "unknown" if "--no_such_policy" in args else "bad-value" if "median" in args else "missing-file"
    ] in line


def test_serve_refuses_a_key_in_a_config_file(tmp_path):
    config = tmp_path / "store.toml"
    config.write_text("admin_key = '0123456789abcdef0123456789abcdef'\n")
    line = _one_line_error(
        _rollbook("serve", "--db", str(tmp_path / "x.duckdb"), "--port", "0", "--config", str(config)), 2, "serve"
    )
    assert "environment" in line and "0123456789abcdef" not in line


def test_serve_off_loopback_without_keys_is_one_line_without_pydantic_internals(tmp_path):
    line = _one_line_error(_rollbook("serve", "--db", str(tmp_path / "x.duckdb"), "--host", "0.0.0.0", "--port", "0"), 2, "serve")
    assert "ROLLBOOK_" in line and "type=value_error" not in line and "errors.pydantic.dev" not in line


def test_serve_on_a_port_in_use_is_one_line(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = _one_line_error(_rollbook("serve", "--db", str(tmp_path / "x.duckdb"), "--port", str(port)), 1, "serve")
    assert str(port) in line


def test_serve_on_a_ledger_another_server_holds_is_one_line(store):
    line = _one_line_error(_rollbook("serve", "--db", str(store.db), "--port", "0"), 1, "serve")
    assert str(store.db) in line and "another" in line
    assert store.proc.poll() is None  # the first server is untouched


def test_stats_with_the_store_down_is_one_line():
    port = _free_port()
    line = _one_line_error(_rollbook("stats", "--server", f"127.0.0.1:{port}"), 1, "stats")
    assert f"127.0.0.1:{port}" in line and "not reachable" in line


def test_stats_prints_each_counter_once(store):
    done = _rollbook("stats", "--server", store.address)
    assert done.returncode == 0, done.stderr
    stats = json.loads(done.stdout)
    assert "stats_json" not in stats
    nested = [k for k, v in stats.items() if isinstance(v, dict) and set(v) & set(stats)]
    assert not nested, nested
    assert done.stdout.count('"accepted_tokens"') == 1


@pytest.mark.parametrize("command", ["run", "train", "rollout"])
def test_a_missing_config_file_is_one_line(command):
    line = _one_line_error(_rollbook(command, "--config", "configs/nope.toml", cwd=REPO), 2, command)
    assert "configs/nope.toml" in line and "not found" in line


def test_rollout_without_a_config_says_which_to_give():
    line = _one_line_error(_rollbook("rollout"), 2, "rollout")
    assert "configs/worker.toml" in line


def test_the_shipped_worker_config_validates():
    from rollbook.config import WorkerConfig, load_config

    config = load_config(WorkerConfig, str(REPO / "configs" / "worker.toml"), [])
    assert config.weights.startswith(("shm:", "grpc:"))


def test_a_value_error_raised_mid_command_keeps_its_traceback(monkeypatch):
    import rollbook.cli.main as cli

    def broken(args):
        raise ValueError("a bug deep inside, not a configuration error")

    monkeypatch.setattr(cli, "_stats", broken)
    with pytest.raises(ValueError, match="a bug deep inside"):
        cli.main(["stats", "--server", "127.0.0.1:1"])


def test_a_run_already_past_the_requested_step_says_so_and_keeps_its_config(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "step-000040").mkdir(parents=True)
    (checkpoints / "step-000040" / "trainer.json").write_text(json.dumps({"step": 40, "version": 40, "consumed_leases": []}))
    (checkpoints / "LATEST").write_text("step-000040")
    (tmp_path / "config.json").write_text('{"num_steps": 40}\n')
    line = _one_line_error(
        _rollbook("run", "--config", str(REPO / "configs" / "quickstart.toml"), "--run_dir", str(tmp_path), "--num_steps", "3"),
        1,
        "run",
    )
    assert "already past step 3" in line and "40" in line
    assert (tmp_path / "config.json").read_text() == '{"num_steps": 40}\n'


def test_admin_register_model_then_publish_version(tmp_path):
    import secrets

    from rollbook.run.store_process import StoreProcess

    keys = {f"{r}_key": secrets.token_hex(16) for r in ("worker", "trainer", "reader", "admin")}
    proc = StoreProcess(tmp_path / "rollbook.duckdb", env=_clean_env(), **keys)
    env = {**_clean_env(), "ROLLBOOK_SERVER": proc.address, "ROLLBOOK_ADMIN_KEY": keys["admin_key"]}
    try:
        line = _one_line_error(
            _rollbook("admin", "register-model", "tiny", env=_clean_env() | {"ROLLBOOK_SERVER": proc.address}), 1, "admin"
        )
        assert "ROLLBOOK_ADMIN_KEY" in line
        done = _rollbook("admin", "register-model", "tiny", "--vocab-size", "64", env=env)
        assert done.returncode == 0 and "registered model 'tiny'" in done.stdout, done.stderr
        done = _rollbook("admin", "publish-version", "tiny", "0", env=env)
        assert done.returncode == 0 and "latest is 0" in done.stdout, done.stderr
        with proc.client() as client:
            assert client.query("SELECT vocab_size FROM models WHERE model_id = 'tiny'").column(0).to_pylist() == [64]
    finally:
        proc.stop()


def test_train_against_a_fresh_store_says_how_to_register_the_model(store):
    done = _rollbook(
        "train",
        "--server",
        store.address,
        "--run_dir",
        str(store.db.parent / "t"),
        "--max_wait_s",
        "3",
        env=_clean_env(),
        timeout=240,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1, done.stderr
    assert lines[-1].startswith("rollbook train: error: ") and "rollbook admin register-model tiny" in lines[-1]
    assert "Traceback" not in done.stderr


def test_train_registers_its_model_with_the_admin_key_and_reports_progress_while_it_waits(store):
    # a fresh store; the admin key in the environment lets train register "tiny" itself (this store
    # has no keys configured, so any key is accepted on loopback)
    done = _rollbook(
        "train",
        "--server",
        store.address,
        "--run_dir",
        str(store.db.parent / "t"),
        "--max_wait_s",
        "3",
        "--poll_interval_s",
        "0.1",
        env=_clean_env() | {"ROLLBOOK_ADMIN_KEY": "a" * 32},
        timeout=240,
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr.count("waiting for a batch: step 0") >= 2, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("rollbook train: error: no batch from the store for 3 s")
    assert "Traceback" not in done.stderr
    with store.client() as client:
        assert client.query("SELECT model_id FROM models").column(0).to_pylist() == ["tiny"]


def test_rollout_says_weight_channel_unreachable_once_not_per_poll():
    port = _free_port()
    done = _rollbook(
        "rollout",
        "--weights",
        f"grpc:127.0.0.1:{port}",
        "--first_weights_timeout_s",
        "3",
        "--server",
        f"127.0.0.1:{_free_port()}",
        env=_clean_env(),
        timeout=240,
    )
    assert done.stderr.count("weight channel unreachable") == 1, done.stderr  # ~30 polls in 3 s
    assert done.returncode == 1 and done.stderr.strip().splitlines()[-1].startswith("rollbook rollout: error: no weights on")
    assert "Traceback" not in done.stderr


@pytest.mark.slow  # a worker process waiting out max_idle_s
def test_rollout_stops_after_max_rounds_and_when_the_gate_stays_closed(store, tmp_path):
    """A real worker process on a shared-memory channel that publishes version 0 and nothing more
    (a trainer that has gone): --max_rounds 1 stops after one round; with eta 0 the gate closes after
    one batch and max_idle_s stops the worker (it used to wait forever)."""
    import uuid

    from rollbook.config import ModelConfig
    from rollbook.language_models import build_student
    from rollbook.weights.shm import SharedMemoryPublisher

    with store.client() as client:
        client.register_model("tiny", vocab_size=64)
        client.publish_version("tiny", 0)
    state = build_student(
        ModelConfig(hidden_size=16, intermediate_size=16, num_layers=1, num_heads=2, num_kv_heads=1)
    ).state_dict()
    channel = f"rollbook-test-{uuid.uuid4().hex[:10]}"
    publisher = SharedMemoryPublisher(channel, state)
    publisher.publish(0, state)
    common = [
        "rollout",
        "--server",
        store.address,
        "--weights",
        f"shm:{channel}",
        "--model.hidden_size",
        "16",
        "--model.intermediate_size",
        "16",
        "--model.num_layers",
        "1",
        "--model.num_heads",
        "2",
        "--model.num_kv_heads",
        "1",
        "--batch_size",
        "8",
        "--rollout.group_size",
        "4",
        "--rollout.num_prompts",
        "2",
        "--rollout.num_eval_tasks",
        "4",
        "--log_every",
        "1",
        "--announcement_wait_s",
        "0",  # no trainer announces here: do not wait for one
    ]
    try:
        done = _rollbook(
            *common, "--spool_dir", str(tmp_path / "s1"), "--rollout.max_staleness", "5", "--max_rounds", "1", timeout=240
        )
        assert done.returncode == 0, done.stderr
        assert "round 1: 8 trajectories so far, version 0" in done.stderr
        assert "'rounds': 1" in done.stderr
        done = _rollbook(
            *common, "--spool_dir", str(tmp_path / "s2"), "--rollout.max_staleness", "0", "--max_idle_s", "2", timeout=240
        )
        assert done.returncode == 0, done.stderr
        assert "no round for 2 s" in done.stderr and "'rounds': 1" in done.stderr
    finally:
        publisher.close()


def test_the_readme_commands_work_after_the_quick_start():
    """The README says how to get ``rollbook`` on PATH after the quick start, names only config files
    that ship, and only subcommands (and admin actions) that exist."""
    import re

    from rollbook.cli.main import build_parser

    readme = (REPO / "README.md").read_text()
    assert "source .venv/bin/activate" in readme and ".venv/bin/rollbook" in readme
    for path in set(re.findall(r"configs/[\w.-]+\.toml", readme)):
        assert (REPO / path).exists(), path
    commands = build_parser()._subparsers._group_actions[0].choices
    for line in re.findall(r"^(?:\.venv/bin/)?rollbook +(\S+)(?: +(\S+))?", readme, flags=re.M):
        assert line[0] in commands, line
        if line[0] == "admin":
            assert line[1] in ("register-model", "publish-version"), line
    assert "rollbook rollout --config configs/worker.toml" in readme
