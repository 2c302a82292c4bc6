"""The redaction detectors (rollbook/redact.py): each built-in rule on what it must find and on the
near misses it must leave alone, overlapping spans, counts, rules of one's own (``module:function``)
and the messages for rules that cannot be used; then ``export_data`` on an in-memory table and the
``export-data`` command's refusals that need no store (rollbook/cli/export_data.py).

Run: ``python -m pytest tests/unit/test_redact.py -q``.
"""

from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollbook.cli import export_data as cli
from rollbook.errors import CommandError, ConfigError
from rollbook.redact import (
    BUILTIN_RULES,
    Hit,
    Rule,
    find,
    find_api_keys,
    find_emails,
    find_ipv4,
    find_ipv6,
    find_phones,
    parse_rules,
    redact,
)
from rollbook.tokenizers import CharTokenizer

ALL = parse_rules("all")


def found(detector, text: str) -> list[str]:
    return [text[start:end] for start, end in detector(text)]


# ---- user rules used below (importable as tests.unit.test_redact:NAME) ---------------------------

CODENAME = re.compile(r"\bproject-[a-z]+\b")
NOT_CALLABLE = 42


def find_codenames(text: str) -> list[tuple[int, int]]:
    return [m.span() for m in CODENAME.finditer(text)]


def find_codename_matches(text: str):
    return CODENAME.finditer(text)  # re.Match objects count as their spans


def out_of_range(text: str) -> list[tuple[int, int]]:
    return [(0, len(text) + 5)]


def not_pairs(text: str) -> list[str]:
    return ["project-x"]


# ---- email ---------------------------------------------------------------------------------------


def test_email_finds_addresses_and_keeps_the_sentence_around_them():
    text = "write to bob.smith+tag@mail.example.co.uk. or to X_Y@corp-1.example.org, thanks"
    assert found(find_emails, text) == ["bob.smith+tag@mail.example.co.uk", "X_Y@corp-1.example.org"]


@pytest.mark.parametrize(
    "text",
    ["user@localhost", "@property def f(self)", "a@b", "x@y.c", "icon@2x.png", "logo@1.5x.webp", "no at sign here", "a@-b.com"],
)
def test_email_near_misses(text):
    assert find_emails(text) == []


# ---- phone ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("number", ["+1 650 253 0000", "(650) 253-0000", "650.253.0000", "+44 20 7946 0958", "+33 1 42 68 53 00"])
def test_phone_finds_valid_numbers(number):
    assert found(find_phones, f"call {number} today") == [number]


@pytest.mark.parametrize(
    "text",
    ["on 2024-01-15", "1234567", "version 1.2.3", "order 123456789", "555-123-4567", "pi is 3.14159265", "at 10.0.0.1"],
)
def test_phone_near_misses(text):
    """Dates, short numbers, ids and numbers no numbering plan has (area code 555) are not phones."""
    assert find_phones(text) == []


def test_phone_national_numbers_follow_the_regions():
    text = "ring 07911 123456"
    assert find_phones(text) == []  # a UK mobile written nationally is not a US number
    assert found(lambda t: find_phones(t, ("US", "GB")), text) == ["07911 123456"]
    rules = parse_rules("phone", phone_regions=["us", "gb"])
    assert redact(text, rules).text == "ring [REDACTED:phone]"


# ---- api_key -------------------------------------------------------------------------------------

GH = "ghp_" + "a1B2" * 9


@pytest.mark.parametrize(
    "secret",
    [
        "sk-proj-Abc123def456ghi789jkl012mno",
        "sk-ant-api03-abcdefghijklmnopqrstuvwxyz",
        "AKIAIOSFODNN7EXAMPLE",
        GH,
        "github_pat_11ABCDEFG0123456789_abcdefghijklmnop",
        "xoxb-1234567890-abcdefghij",
        "AIzaSyA1234567890abcdefghijklmnopqrstuv",
        "sk_live_abcdefghij0123456789",
        "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
    ],
)
def test_api_key_prefixed_shapes(secret):
    assert found(find_api_keys, f"use {secret} here") == [secret]


def test_api_key_a_pem_private_key_is_redacted_to_its_end_line_or_the_end_of_the_text():
    block = "-----BEGIN RSA PRIVATE KEY-----\nMIIEpAIBAAKCAQEA\n-----END RSA PRIVATE KEY-----"
    assert found(find_api_keys, f"key:\n{block}\nafter") == [block]
    assert found(find_api_keys, "-----BEGIN PRIVATE KEY-----\nMIIEv") == ["-----BEGIN PRIVATE KEY-----\nMIIEv"]


@pytest.mark.parametrize(
    "text, value",
    [
        ('api_key="0123456789abcdef0123"', "0123456789abcdef0123"),
        ("GITHUB_TOKEN=ab12cd34ef56gh78ij90", "ab12cd34ef56gh78ij90"),
        ('{"client_secret": "Zm9vYmFyYmF6cXV4MTIzNDU2"}', "Zm9vYmFyYmF6cXV4MTIzNDU2"),
        ("X-Api-Key: 9f86d081884c7d659a2feaa0c55ad015", "9f86d081884c7d659a2feaa0c55ad015"),
        ("password: hunter2!", "hunter2!"),
        ("Authorization: Bearer abcdefghijklmnop1234", "abcdefghijklmnop1234"),
    ],
)
def test_api_key_after_a_keyword_only_the_value_goes(text, value):
    assert found(find_api_keys, text) == [value]
    assert redact(text, ALL).text == text.replace(value, "[REDACTED:api_key]")


@pytest.mark.parametrize(
    "text",
    [
        "pip install sk-learn",
        "task-abcdefghijklmnopqrstuvwxyz0123",  # "sk-" inside a word
        "AKIA1234",  # too short
        "ghp_short",
        "monkey=0123456789abcdef0123",  # key is not a name part here
        "primary_key=user_profile_settings_x",  # no digit: a name, not a secret
        "max_tokens=1024",
        "token=abc123",  # too short
        "the password is long",  # no : or =
    ],
)
def test_api_key_near_misses(text):
    assert find_api_keys(text) == []


# ---- ipv4, ipv6 ----------------------------------------------------------------------------------


def test_ipv4_finds_host_addresses():
    text = "from 10.0.0.7. then 192.168.1.20:8080 and 8.8.8.8"
    assert found(find_ipv4, text) == ["10.0.0.7", "192.168.1.20", "8.8.8.8"]


@pytest.mark.parametrize(
    "text",
    ["256.1.1.1", "1.2.3.4.5", "1.2.3", "01.2.3.4", "v1.2.3.4", "127.0.0.1", "0.0.0.0", "255.255.255.0", "224.0.0.1"],
)
def test_ipv4_near_misses(text):
    """Out of range, longer dotted numbers, leading zeros, and addresses that name no host."""
    assert find_ipv4(text) == []


def test_ipv6_finds_host_addresses():
    text = "at 2001:db8::1, fe80::1%eth0 and [2001:db8:0:0:0:0:0:2]:80 or 2001:0db8:85a3:0000:0000:8a2e:0370:7334"
    assert found(find_ipv6, text) == ["2001:db8::1", "fe80::1", "2001:db8:0:0:0:0:0:2", "2001:0db8:85a3:0000:0000:8a2e:0370:7334"]
    assert redact("fe80::1%eth0", ALL).text == "[REDACTED:ipv6]%eth0"  # the zone stays


@pytest.mark.parametrize("text", ["::1", "::", "std::map<int>", "at 12:30:45", "mac 00:1a:2b:3c:4d:5e", "a::b", "fe80::1::2"])
def test_ipv6_near_misses(text):
    assert find_ipv6(text) == []


# ---- overlaps and counts -------------------------------------------------------------------------


def test_an_ipv4_mapped_address_is_one_region_labelled_by_the_span_that_starts_first():
    text = "peer ::ffff:192.0.2.1 up"
    assert redact(text, parse_rules("ip")) == redact(text, parse_rules("ipv4,ipv6"))
    done = redact(text, parse_rules("ipv4,ipv6"))
    assert done.text == "peer [REDACTED:ipv6] up" and done.counts == {"ipv6": 1}
    assert redact(text, parse_rules("ipv4")).text == "peer ::ffff:[REDACTED:ipv4] up"


def spans_rule(name: str, *spans: tuple[int, int]) -> Rule:
    return Rule(name, lambda text: list(spans))


def test_overlapping_spans_merge_so_nothing_flagged_survives():
    text = "0123456789abcdef"
    a, b, c = spans_rule("a", (0, 5)), spans_rule("b", (3, 10)), spans_rule("c", (10, 12))
    assert find(text, [a, b, c]) == [Hit(0, 10, "a"), Hit(10, 12, "c")]  # touching spans stay two regions
    done = redact(text, [b, c, a])
    assert done.text == "[REDACTED:a][REDACTED:c]cdef" and done.counts == {"a": 1, "c": 1}


def test_ties_go_to_the_longer_span_then_to_the_rule_listed_first():
    text = "0123456789"
    short, long_ = spans_rule("short", (2, 4)), spans_rule("long", (2, 8))
    assert find(text, [short, long_]) == [Hit(2, 8, "long")]
    x, y = spans_rule("x", (2, 6)), spans_rule("y", (2, 6))
    assert find(text, [x, y]) == [Hit(2, 6, "x")] and find(text, [y, x]) == [Hit(2, 6, "y")]
    nested = spans_rule("outer", (1, 9))
    assert find(text, [short, nested]) == [Hit(1, 9, "outer")]  # a span inside another adds nothing


def test_counts_are_per_region_and_rule():
    text = "a@example.com, b@example.com, 10.1.2.3, +1 650 253 0000 and sk-" + "x1" * 12
    done = redact(text, ALL)
    assert done.counts == {"email": 2, "ipv4": 1, "phone": 1, "api_key": 1}
    assert done.text.count("[REDACTED:") == 5 and "example.com" not in done.text


def test_a_text_without_findings_is_returned_as_it_is():
    text = "12+34=46, version 1.2.3 on 2024-01-15"
    done = redact(text, ALL)
    assert done.text is text and done.counts == {}


# ---- parsing rules -------------------------------------------------------------------------------


def test_aliases_expand_in_order_and_names_come_once():
    assert [r.name for r in parse_rules("ip")] == ["ipv4", "ipv6"]
    assert [r.name for r in parse_rules("all")] == list(BUILTIN_RULES)
    assert [r.name for r in parse_rules(" email , ip,email,all")] == ["email", "ipv4", "ipv6", "phone", "api_key"]
    assert [r.name for r in parse_rules(["api_key", "email"])] == ["api_key", "email"]


def test_user_rules_by_module_and_function():
    text = "ship project-apollo to bob@example.com"
    for spec in ("tests.unit.test_redact:find_codenames", "tests.unit.test_redact:find_codename_matches"):
        done = redact(text, parse_rules(f"email,{spec}"))
        assert done.text == f"ship [REDACTED:{spec}] to [REDACTED:email]"
        assert done.counts == {spec: 1, "email": 1}


def test_a_user_rule_that_answers_wrongly_is_named():
    with pytest.raises(ValueError, match=r"out_of_range' returned span \(0, 9\) for a text of 4 characters"):
        redact("abcd", parse_rules("tests.unit.test_redact:out_of_range"))
    with pytest.raises(ValueError, match=r"not_pairs' returned 'project-x': a rule returns \(start, end\) pairs"):
        redact("project-x", parse_rules("tests.unit.test_redact:not_pairs"))


@pytest.mark.parametrize(
    "spec, message",
    [
        ("emial", "unknown redaction rule 'emial' (did you mean 'email'?): the built-in rules are email, phone, api_key"),
        ("ssn", "unknown redaction rule 'ssn': the built-in rules are"),
        ("", "no redaction rules"),
        ("email,,phone", "an empty name between commas"),
        ("no_such_pkg.mod:find", "cannot import 'no_such_pkg.mod' (ModuleNotFoundError"),
        ("tests.unit.test_redact:missing", "'tests.unit.test_redact' has no attribute 'missing'"),
        ("tests.unit.test_redact:NOT_CALLABLE", "'NOT_CALLABLE' in 'tests.unit.test_redact' is not callable"),
        (":find", "a rule of your own is package.module:function"),
    ],
)
def test_rules_that_cannot_be_used_are_refused_with_the_reason(spec, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_rules(spec)


def test_an_unknown_phone_region_is_refused():
    with pytest.raises(ConfigError, match="phone region 'XX' is not a region libphonenumber knows"):
        parse_rules("phone", phone_regions=["xx"])
    parse_rules("email", phone_regions=["xx"])  # regions matter only to the phone rule


# ---- export_data on an in-memory table -----------------------------------------------------------

TOK = CharTokenizer("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,:;@+-_()=")


def rows(*pairs: tuple[str, str], tenant: bool = False) -> pa.Table:
    n = len(pairs)
    columns = {
        "trajectory_id": [f"t{i}" for i in range(n)],
        "session_id": ["s"] * n,
        "group_id": ["g"] * n,
        "model_id": ["m"] * n,
        "task_id": ["task"] * n,
        "domain": ["chat"] * n,
        "reward": [1.0] * n,
        "status": ["ready"] * n,
        "created_at": [1.5] * n,
        "prompt_token_ids": pa.array([TOK.encode(p, add_bos=True) for p, _ in pairs], pa.list_(pa.int32())),
        "output_token_ids": pa.array([TOK.encode(o, add_eos=True) for _, o in pairs], pa.list_(pa.int32())),
        "output_logprobs": [[-0.5]] * n,
    }
    if tenant:
        columns["tenant"] = ["acme"] * n
    return pa.table(columns)


def test_export_data_writes_redacted_texts_and_the_ids_as_asked(tmp_path):
    table = rows(("mail a@example.com", "ok"), ("key sk-" + "ab12" * 6, "call +1 650 253 0000"), tenant=True)
    seen = []
    summary = cli.export_data(table, tokenizer=TOK, rules="all", fmt="parquet", out=tmp_path / "x.parquet", on_done=seen.append)
    assert summary == {
        "rows": 2,
        "counts": {"email": 1, "phone": 1, "api_key": 1, "ipv4": 0, "ipv6": 0},
        "path": str(tmp_path / "x.parquet"),
        "format": "parquet",
        "ids": "drop",
    }
    assert seen == [summary]
    got = pq.read_table(tmp_path / "x.parquet")
    assert got.column_names == [*(name for name, _ in cli.COLUMNS), "tenant", "prompt_text", "output_text"]
    assert got.column("prompt_text").to_pylist() == ["mail [REDACTED:email]", "key [REDACTED:api_key]"]
    assert got.column("output_text").to_pylist() == ["ok", "call [REDACTED:phone]"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.parquet"]  # no temporary file left

    kept = cli.export_data(table, tokenizer=TOK, rules="email", fmt="jsonl", out=tmp_path / "k.jsonl", ids="keep")
    lines = [json.loads(line) for line in (tmp_path / "k.jsonl").read_text().splitlines()]
    assert kept["counts"] == {"email": 1} and lines[0]["prompt_token_ids"] == table.column("prompt_token_ids")[0].as_py()

    cli.export_data(table, tokenizer=TOK, rules="email", fmt="jsonl", out=tmp_path / "h.jsonl", ids="hash", hash_salt="pepper")
    hashed = [json.loads(line) for line in (tmp_path / "h.jsonl").read_text().splitlines()]
    assert "prompt_token_ids" not in hashed[0]
    assert hashed[0]["prompt_token_ids_sha256"] == cli.hash_ids(table.column("prompt_token_ids")[0].as_py(), b"pepper")
    assert cli.hash_ids([1, 2], b"pepper") != cli.hash_ids([1, 2], b"salt") != cli.hash_ids([2, 1], b"salt")


def test_export_data_refuses_to_overwrite_and_leaves_nothing_behind_on_failure(tmp_path):
    out = tmp_path / "x.jsonl"
    out.write_text("before\n")
    with pytest.raises(CommandError, match="exists: pass --force to replace it"):
        cli.export_data(rows(("a", "b")), tokenizer=TOK, rules="email", fmt="jsonl", out=out)
    assert out.read_text() == "before\n"

    def pages():
        yield rows(("a@example.com", "b"))
        raise RuntimeError("the store went away")

    with pytest.raises(RuntimeError, match="went away"):
        cli.export_data(pages(), tokenizer=TOK, rules="email", fmt="parquet", out=out, force=True)
    assert out.read_text() == "before\n" and sorted(p.name for p in tmp_path.iterdir()) == ["x.jsonl"]
    cli.export_data(iter([]), tokenizer=TOK, rules="email", fmt="parquet", out=out, force=True)
    assert pq.read_table(out).num_rows == 0


def test_paged_rows_goes_on_after_the_last_id_of_each_page():
    ids = [f"t{i}" for i in range(7)]
    asked: list[str] = []

    def run(sql: str, cap: int) -> tuple[pa.Table, bool]:
        asked.append(sql)
        after = re.search(r"trajectory_id > '([^']*)'", sql)
        rest = [i for i in ids if after is None or i > after.group(1)]
        return pa.table({"trajectory_id": pa.array(rest[:cap], pa.string())}), len(rest) > cap

    pages = list(cli.paged_rows(lambda sql: run(sql, 3), "TRUE", page_rows=4))  # a cap of 3 cuts pages of 4
    assert [p.column("trajectory_id").to_pylist() for p in pages] == [["t0", "t1", "t2"], ["t3", "t4", "t5"], ["t6"]]
    assert len(asked) == 3 and "trajectory_id > 't5'" in asked[-1]
    asked.clear()
    pages = list(cli.paged_rows(lambda sql: run(sql, 100), "TRUE", page_rows=7))  # a full page: one more query, empty
    assert [p.num_rows for p in pages] == [7] and len(asked) == 2


def test_page_sql_quotes_the_last_id():
    sql = cli.page_sql("domain = 'chat'", "it's", 10)
    assert sql.endswith("WHERE (\ndomain = 'chat'\n)\nAND trajectory_id > 'it''s'\nORDER BY trajectory_id\nLIMIT 10")


# ---- the command's refusals before any row is read -----------------------------------------------


@pytest.mark.parametrize(
    "flags, code, message",
    [
        (["--redact", "emial"], 2, "unknown redaction rule 'emial'"),
        (["--where", "TRUE) UNION SELECT * FROM trajectories WHERE (TRUE"], 2, "the whole WHERE of SELECT * FROM trajectories"),
        (["--where", "reward >"], 2, "--where does not parse"),
        (["--timeout", "-1"], 2, "--timeout -1: seconds >= 0"),
        (["--phone-regions", "ZZ"], 2, "phone region 'ZZ'"),
        (["--hash-salt-file", "salt.txt"], 2, "--hash-salt-file is for --ids hash"),
        (["--tokenizer", "/nonexistent/tok"], 2, "--tokenizer: tokenizer directory /nonexistent/tok does not exist"),
    ],
)
def test_the_command_refuses_bad_flags_in_one_line(tmp_path, capsys, flags, code, message):
    out = tmp_path / "x.parquet"
    assert cli.main(["--db", str(tmp_path / "none.duckdb"), "--out", str(out), *flags]) == code
    err = capsys.readouterr().err
    assert err.startswith("rollbook export-data: error: ") and message in err and len(err.splitlines()) == 1
    assert not out.exists()


def test_the_command_refuses_an_existing_file_and_an_unknown_suffix(tmp_path, capsys):
    (tmp_path / "x.parquet").write_bytes(b"keep")
    assert cli.main(["--db", str(tmp_path / "none.duckdb"), "--out", str(tmp_path / "x.parquet")]) == 1
    assert "x.parquet exists: pass --force to replace it" in capsys.readouterr().err
    assert cli.main(["--db", str(tmp_path / "none.duckdb"), "--out", str(tmp_path / "x.csv")]) == 2
    assert "give --format parquet or jsonl" in capsys.readouterr().err
    assert cli.main(["--db", str(tmp_path / "none.duckdb"), "--out", str(tmp_path / "y.jsonl")]) == 1
    assert "no such ledger file" in capsys.readouterr().err
    assert (tmp_path / "x.parquet").read_bytes() == b"keep"
