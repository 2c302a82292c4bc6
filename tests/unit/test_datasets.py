"""Dataset files (JSONL, Parquet, CSV) with bad rows: each bad row reported as file:line with its
reason and skipped (or the dataset refused), field mapping, the stable held-out split, shuffling and
epochs (at the reader's level; the worker test runs one to the end)."""

from __future__ import annotations

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rollbook.config import DatasetConfig, FieldMap
from rollbook.datasets import DatasetError, RowSampler, load_dataset, read_rows


def _jsonl(path, lines: list[bytes]):
    path.write_bytes(b"\n".join(lines) + b"\n")
    return str(path)


@pytest.fixture
def messy_jsonl(tmp_path):
    good = lambda i: json.dumps({"id": f"t{i}", "question": f"What is {i}+1?", "solution": i + 1, "domain": "math"}).encode()
    return _jsonl(
        tmp_path / "math.jsonl",
        [
            good(1),  # line 1
            b'{"id": "t2", "question": "What is 2+1?", "solution": 3',  # 2: invalid JSON (truncated)
            good(3),  # 3
            b'{"id": "t4", "question": "caf\xe9?", "solution": 1, "domain": "math"}',  # 4: latin-1, not UTF-8
            b"",  # 5: blank, ignored
            json.dumps({"id": "t6", "solution": 1, "domain": "math"}).encode(),  # 6: no prompt
            json.dumps({"id": "t7", "question": 7, "solution": 1, "domain": "math"}).encode(),  # 7: prompt not text
            json.dumps({"id": "t8", "question": "q", "domain": "math"}).encode(),  # 8: math needs an answer
            json.dumps([1, 2]).encode(),  # 9: not an object
            json.dumps({"id": "t10", "question": "q", "solution": [1], "domain": "math"}).encode(),  # 10: answer a list
            json.dumps({"id": "t11", "question": "q", "solution": "1", "domain": "poetry"}).encode(),  # 11: no reward
            good(12),  # 12
        ],
    )


MAPPING = FieldMap(prompt="question", answer="solution", task_id="id")


def test_jsonl_bad_rows_are_reported_with_file_line_and_reason_and_skipped(messy_jsonl, caplog):
    config = DatasetConfig(train_files=[messy_jsonl], fields=MAPPING, heldout_fraction=0.0)
    with caplog.at_level(logging.WARNING, logger="rollbook.datasets"):
        data = load_dataset(config, requirements={"math": ("answer",)}, known_domains={"math"})
    assert [r.task_id for r in data.train] == ["t1", "t3", "t12"]
    assert data.train[0].answer == "2" and data.train[0].prompt == "What is 1+1?"
    assert data.train[1].source == f"{messy_jsonl}:3"
    reasons = {b.line: b.reason for b in data.bad_rows}
    assert sorted(reasons) == [2, 4, 6, 7, 8, 9, 10, 11]
    assert reasons[2].startswith("invalid JSON")
    assert reasons[4].startswith("undecodable text")
    assert reasons[6] == "missing field 'question' (or 'messages')"
    assert reasons[7] == "field 'question' must be text, got int"
    assert "needs its answer" in reasons[8]
    assert reasons[9] == "not a JSON object but list"
    assert reasons[10] == "field 'solution' must be text or a number, got list"
    assert "no reward configured for domain 'poetry'" in reasons[11]
    logged = [r.getMessage() for r in caplog.records]
    for line in reasons:
        assert any(f"{messy_jsonl}:{line}:" in m for m in logged), line


def test_fail_refuses_at_load_time_naming_every_bad_row(messy_jsonl):
    config = DatasetConfig(train_files=[messy_jsonl], fields=MAPPING, on_bad_row="fail")
    with pytest.raises(DatasetError, match="8 bad rows") as err:
        load_dataset(config, requirements={"math": ("answer",)}, known_domains={"math"})
    assert f"{messy_jsonl}:2: invalid JSON" in str(err.value) and f"{messy_jsonl}:11:" in str(err.value)


def test_csv_with_messages_tests_and_bad_rows(tmp_path):
    path = tmp_path / "code.csv"
    path.write_bytes(
        b"task_id,messages,tests,domain\n"
        b'c1,"[{""role"": ""user"", ""content"": ""Write add(a, b).""}]","[""assert add(1, 2) == 3""]",code\n'
        b'c2,"[{""role"": ""user""}]","[]",code\n'  # 3: message without content
        b'c3,"not json","[""assert 1 == 1""]",code\n'  # 4: plain text is a prompt? no: messages must be a list
        b'c4,"[{""role"": ""user"", ""content"": ""multi\\nline""}]","def f(): return 1\nassert f() == 1",code\n'  # 5-6: quoted newline
        b'c5,"[{""role"": ""user"", ""content"": ""x\xff""}]","[]",code\n'  # 7: undecodable
        b"c6,only-two-values\n"  # 8: short row
    )
    config = DatasetConfig(train_files=[str(path)], heldout_fraction=0.0)
    rows, bad = read_rows([str(path)], config, requirements={"code": ("tests",)})
    assert [r.task_id for r in rows] == ["c1", "c4"]
    assert rows[0].messages == ({"role": "user", "content": "Write add(a, b)."},)
    assert rows[0].tests == ("assert add(1, 2) == 3",) and rows[1].tests == "def f(): return 1\nassert f() == 1"
    assert rows[1].messages[0]["content"] == "multi\nline" and rows[1].source.endswith(":5")
    reasons = {b.line: b.reason for b in bad}
    assert sorted(reasons) == [3, 4, 7, 8]
    assert "'messages'[0] must be an object" in reasons[3]
    assert "must be a non-empty list" in reasons[4]
    assert reasons[7].startswith("undecodable text")
    assert reasons[8] == "2 values for 4 columns"


def test_parquet_and_default_domain_and_heldout_file(tmp_path):
    train = tmp_path / "train.parquet"
    pq.write_table(pa.table({"prompt": ["1+1=", None, "3+3="], "answer": ["2", "4", "6"]}), train)
    held = tmp_path / "held.parquet"
    pq.write_table(pa.table({"prompt": ["5+5="], "answer": ["10"]}), held)
    config = DatasetConfig(train_files=[str(train)], heldout_files=[str(held)], default_domain="math")
    data = load_dataset(config, requirements={"math": ("answer",)})
    assert [r.prompt for r in data.train] == ["1+1=", "3+3="] and [r.prompt for r in data.heldout] == ["5+5="]
    assert [(b.line, b.reason) for b in data.bad_rows] == [(2, "missing field 'prompt' (or 'messages')")]
    assert all(r.domain == "math" for r in data.train)
    assert data.train[0].task_id == load_dataset(config).train[0].task_id  # made from the prompt: stable


def test_hash_split_is_stable_and_disjoint(tmp_path):
    path = _jsonl(tmp_path / "many.jsonl", [json.dumps({"prompt": f"p{i}", "answer": "1"}).encode() for i in range(400)])
    config = DatasetConfig(train_files=[path], default_domain="d", heldout_fraction=0.25)
    a, b = load_dataset(config), load_dataset(config)
    assert [r.task_id for r in a.heldout] == [r.task_id for r in b.heldout]
    assert not {r.task_id for r in a.train} & {r.task_id for r in a.heldout}
    assert 60 < len(a.heldout) < 140 and len(a.train) + len(a.heldout) == 400


def test_sampler_shuffles_by_seed_and_stops_after_its_epochs(tmp_path):
    path = _jsonl(tmp_path / "few.jsonl", [json.dumps({"prompt": f"p{i}"}).encode() for i in range(5)])
    rows = load_dataset(DatasetConfig(train_files=[path], default_domain="d", heldout_fraction=0.0)).train
    sampler = RowSampler(rows, shuffle=True, seed=3, epochs=2)
    got = sampler.take(4) + sampler.take(4) + sampler.take(4)
    assert len(got) == 10 and sampler.exhausted and sampler.take(1) == []
    first, second = [r.prompt for r in got[:5]], [r.prompt for r in got[5:]]
    assert sorted(first) == sorted(second) == [f"p{i}" for i in range(5)]
    again = RowSampler(rows, shuffle=True, seed=3, epochs=2)
    assert [r.prompt for r in again.take(10)] == first + second
    plain = RowSampler(rows, shuffle=False, epochs=0)
    assert [r.prompt for r in plain.take(7)] == [f"p{i}" for i in range(5)] + ["p0", "p1"] and not plain.exhausted


def test_missing_file_and_unknown_suffix_are_precise(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        load_dataset(DatasetConfig(train_files=[str(tmp_path / "nope.jsonl")]))
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(DatasetError, match="cannot tell the format"):
        load_dataset(DatasetConfig(train_files=[str(tmp_path / "x.txt")]))


def test_the_example_config_loads_and_dataset_fields_are_checked_together():
    import pathlib

    from rollbook.config import RolloutConfig, RunConfig, load_config

    root = pathlib.Path(__file__).resolve().parents[2]
    config = load_config(RunConfig, str(root / "configs" / "byod.toml"), [])
    assert config.rollout.dataset is not None and set(config.rollout.rewards) == {"math", "code"}
    assert config.rollout.dataset.fields.prompt == "question" and config.rollout.rewards["code"].kind == "code"
    with pytest.raises(ValueError, match="needs rewards"):
        RolloutConfig(dataset=DatasetConfig(train_files=["x.jsonl"]))
    with pytest.raises(ValueError, match="applies to dataset rows"):
        RolloutConfig(tokenizer="models/x")
    RolloutConfig()  # the toy domains, as before


def test_help_config_lists_the_dataset_and_reward_fields():
    from rollbook.config import RunConfig, field_help

    text = "\n".join(field_help(RunConfig))
    assert "--rollout.dataset  DatasetConfig | None  (default: None)" in text  # the section itself, as before
    assert "--rollout.dataset.on_bad_row  'skip'|'fail'  (default: 'skip')" in text
    assert "--rollout.dataset.fields.messages  str  (default: 'messages')" in text
    assert "--rollout.rewards.<key>.timeout_s  float  (default: 10.0)" in text
