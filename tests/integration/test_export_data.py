"""``rollbook export-data`` end to end: trajectories whose token ids decode to texts with planted
emails, API keys and phone numbers go into a real store; the command exports them through the
server (its own process, Parquet) and from the stopped store's file (JSONL). The planted strings
must be absent from the files' bytes and present in the ledger, the counts per rule exact, polars
must read both files, and the ledger's file must not change.

The ids decode with a ``CharTokenizer`` over printable ASCII, saved as a Hugging Face directory for
``--tokenizer`` (the toy tasks' alphabet has no ``@``). The command runs through its module's own
entry point, ``python -m rollbook.cli.export_data``.

Run: ``python -m pytest tests/integration/test_export_data.py -q``.
"""

from __future__ import annotations

import hashlib
import io
import json
import pathlib
import subprocess
import sys

import polars as pl
import pyarrow.parquet as pq
import pytest

from rollbook.cli import export_data as cli
from rollbook.tokenizers import CharTokenizer
from tests.integration import procs
from tests.integration.procs import ADMIN_KEY, InProcessStore, child_env, rows

MODEL = "chat-model"
TOK = CharTokenizer("".join(chr(c) for c in range(32, 127)) + "\n")

EMAILS = ["alice.smith@example.com", "bob@corp.example.org"]
KEYS = ["sk-proj-Abc123def456ghi789jkl012mno", "AKIAIOSFODNN7EXAMPLE", "ghp_" + "a1B2" * 9]
PHONES = ["+1 650 253 0000", "(415) 555-0132", "+44 20 7946 0958"]
PLANTED = EMAILS + KEYS + PHONES
# trajectory id -> (prompt, output); "other" is outside --where
TEXTS = {
    "t-email": (f"Contact {EMAILS[0]} about the invoice.", f"Sure, I will write to {EMAILS[1]} today."),
    "t-key": (f"my key is {KEYS[0]}", f"export AWS_ACCESS_KEY_ID={KEYS[1]}\ngit push with {KEYS[2]}"),
    "t-phone": (f"Call me at {PHONES[0]} or {PHONES[1]}.", f"Noted: {PHONES[2]}."),
    "t-clean": ("What is 12+34? Version 1.2.3 shipped on 2024-01-15.", "46"),
    "t-other": (f"also {EMAILS[0]}", "not exported"),
}
WHERE = "domain = 'chat'"
COUNTS = {"email": 2, "phone": 3, "api_key": 3, "ipv4": 0, "ipv6": 0}


def trajectory(tid: str, prompt: str, output: str) -> dict:
    ids = TOK.encode(output, add_eos=True)
    return procs.trajectory(
        tid,
        model_id=MODEL,
        domain="other" if tid == "t-other" else "chat",
        prompt_token_ids=TOK.encode(prompt, add_bos=True),
        output_token_ids=ids,
        output_logprobs=[-0.5] * len(ids),
        output_versions=[0] * len(ids),
        created_at=1.0,
    )


def fill(store: InProcessStore) -> None:
    with store.client() as client:
        client.register_model(MODEL, vocab_size=TOK.vocab_size)
        client.publish_version(MODEL, 0)
        result = client.submit([trajectory(tid, *texts) for tid, texts in TEXTS.items()])
        assert result.rejected_by_reason() == {}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> pathlib.Path:
    where = tmp_path_factory.mktemp("tokenizer")
    TOK.save_pretrained(where)
    return where


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A running store holding the trajectories, whose queries answer at most 3 rows: the export reads
    4 in two pages, the first cut by that cap."""
    s = InProcessStore(tmp_path_factory.mktemp("live") / "rollbook.duckdb", query_max_rows=3)
    fill(s)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def stopped_db(tmp_path_factory) -> pathlib.Path:
    """The ledger file of a store that held the same trajectories and has stopped."""
    db = tmp_path_factory.mktemp("stopped") / "rollbook.duckdb"
    s = InProcessStore(db)
    fill(s)
    s.stop()
    return db


def export(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rollbook.cli.export_data", *flags], capture_output=True, text=True, timeout=120, env=child_env()
    )


def contents(path: pathlib.Path) -> bytes:
    """The file's bytes, and for Parquet also its rows written again without compression or
    dictionaries: a zstd page hides a string from a byte search; the footer (schema, statistics) and
    a JSON Lines file are searched as they are."""
    data = path.read_bytes()
    if path.suffix == ".parquet":
        plain = io.BytesIO()
        pq.write_table(pq.read_table(path), plain, compression="none", use_dictionary=False)
        data += plain.getvalue()
    return data


def assert_redacted(path: pathlib.Path, frame: pl.DataFrame) -> None:
    data = contents(path)
    for planted in PLANTED:
        assert planted.encode() not in data, planted
    assert sorted(frame["trajectory_id"].to_list()) == ["t-clean", "t-email", "t-key", "t-phone"]
    by_id = {r["trajectory_id"]: r for r in frame.iter_rows(named=True)}
    assert by_id["t-email"]["prompt_text"] == "Contact [REDACTED:email] about the invoice."
    assert by_id["t-key"]["output_text"] == "export AWS_ACCESS_KEY_ID=[REDACTED:api_key]\ngit push with [REDACTED:api_key]"
    assert by_id["t-phone"]["prompt_text"] == "Call me at [REDACTED:phone] or [REDACTED:phone]."
    assert by_id["t-clean"]["prompt_text"] == TEXTS["t-clean"][0] and by_id["t-clean"]["output_text"] == "46"
    assert by_id["t-clean"]["domain"] == "chat" and by_id["t-clean"]["reward"] == 1.0


def test_through_the_server_to_parquet(store, tokenizer_dir, tmp_path, monkeypatch):
    out = tmp_path / "chat.parquet"
    done = export(
        "--server", store.address, "--where", WHERE, "--redact", "all", "--out", str(out), "--tokenizer", str(tokenizer_dir)
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1, done.stdout
    assert json.loads(lines[0]) == {"rows": 4, "counts": COUNTS, "path": str(out), "format": "parquet", "ids": "drop"}
    assert "rollbook export-data: 4 rows" in done.stderr  # progress goes to stderr

    frame = pl.read_parquet(out)
    assert frame.columns == [
        *(name for name, _ in cli.COLUMNS),
        *(["tenant"] if "tenant" in frame.columns else []),
        "prompt_text",
        "output_text",
    ]
    assert_redacted(out, frame)

    # the search can see a planted string when one is there: the same rows, redacting only IPs (the
    # command in this process this time: main(), keys from the environment)
    control = tmp_path / "control.parquet"
    monkeypatch.setenv("ROLLBOOK_ADMIN_KEY", ADMIN_KEY)
    flags = [
        "--server",
        store.address,
        "--where",
        WHERE,
        "--redact",
        "ip",
        "--out",
        str(control),
        "--tokenizer",
        str(tokenizer_dir),
    ]
    assert cli.main(flags) == 0
    assert all(planted.encode() in contents(control) for planted in PLANTED)

    # the ledger still holds every planted string, and one audit row per export records its counts
    with store.client() as client:
        (stored,) = rows(client, "SELECT list(prompt_token_ids) AS prompts, list(output_token_ids) AS outputs FROM trajectories")
        audit = rows(client, "SELECT action, actor_role, num_rows, detail->>'$.counts' AS counts FROM audit ORDER BY acted_at")
    assert [(a["action"], a["actor_role"], a["num_rows"], json.loads(a["counts"])) for a in audit][0] == (
        "export",
        "admin",
        4,
        COUNTS,
    )
    assert len(audit) == 2 and json.loads(audit[1]["counts"]) == {"ipv4": 0, "ipv6": 0}
    assert len(stored["prompts"]) == len(TEXTS)
    texts = "\n".join(TOK.decode(ids) for ids in stored["prompts"] + stored["outputs"])
    assert all(planted in texts for planted in PLANTED)


def ledger_files(db: pathlib.Path) -> dict[str, str]:
    """Every file of the ledger (DuckDB's, its write-ahead log's) and the SHA-256 of its bytes."""
    files = [p for p in db.parent.rglob("*") if p.is_file() and p.name.startswith(db.name)]
    return {str(p.relative_to(db.parent)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def test_the_file_of_a_stopped_store_to_jsonl_with_hashed_ids(stopped_db, tokenizer_dir, tmp_path, capsys, monkeypatch):
    before = ledger_files(stopped_db)
    monkeypatch.setattr(cli, "PAGE_ROWS", 3)  # pages of 3 rows, then 1
    out, salt = tmp_path / "chat.jsonl", tmp_path / "salt"
    salt.write_bytes(b"pepper\n")
    flags = ["--db", str(stopped_db), "--where", WHERE, "--format", "jsonl", "--out", str(out), "--tokenizer", str(tokenizer_dir)]
    flags += ["--redact", "email,phone,api_key,ip", "--ids", "hash", "--hash-salt-file", str(salt)]
    assert cli.main(flags) == 0, capsys.readouterr().err
    captured = capsys.readouterr()
    assert json.loads(captured.out) == {"rows": 4, "counts": COUNTS, "path": str(out), "format": "jsonl", "ids": "hash"}

    frame = pl.read_ndjson(out)
    assert_redacted(out, frame)
    assert "prompt_token_ids" not in frame.columns
    by_id = {r["trajectory_id"]: r for r in frame.iter_rows(named=True)}
    expected = TOK.encode(TEXTS["t-key"][0], add_bos=True)
    assert by_id["t-key"]["prompt_token_ids_sha256"] == cli.hash_ids(expected, b"pepper")

    assert cli.main(flags) == 1  # the file exists now
    assert "chat.jsonl exists: pass --force to replace it" in capsys.readouterr().err
    assert cli.main([*flags, "--force", "--where", "trajectory_id = 't-clean'"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == 1 and len(out.read_text().splitlines()) == 1
    # the ledger's rows were only read; each export appended its audit row, with the counts per rule
    from rollbook.store.ledger import Ledger

    ledger = Ledger(stopped_db)
    try:
        cur = ledger.cursor()
        audit = cur.execute("SELECT action, predicate, num_rows, detail->>'$.counts' FROM audit ORDER BY acted_at").fetchall()
        assert cur.execute("SELECT count(*) FROM trajectories").fetchone() == (len(TEXTS),)
        cur.close()
    finally:
        ledger.close()
    assert [(a, p, n, json.loads(c)) for a, p, n, c in audit] == [
        ("export", WHERE, 4, COUNTS),
        ("export", "trajectory_id = 't-clean'", 1, dict.fromkeys(COUNTS, 0)),
    ]
    assert set(ledger_files(stopped_db)) <= set(before) | {"rollbook.duckdb.wal"}
