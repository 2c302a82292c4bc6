"""Your own data through the real store: a BPE tokenizer trained here with a chat template,
a tiny Llama of that vocabulary, a JSONL dataset of math rows and code rows (hidden asserts) with bad
rows, rewards from math-verify and the code sandbox in the reward pool. The stored token ids decode with that tokenizer to the prompts (chat template applied
to chat rows) and to the completions that were scored; the dataset runs to the end of its epoch with
each bad row reported as file:line."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from transformers import AutoTokenizer

from rollbook.client import StoreClient
from rollbook.config import DatasetConfig, FieldMap, ModelConfig, RewardConfig, RolloutConfig
from rollbook.language_models import TinyModelSpec, build_tiny_model
from rollbook.rewards import build_reward, score_row
from rollbook.rollout.engine import NativeEngine
from rollbook.rollout.worker import RolloutWorker, registered_vocab_size
from rollbook.run.store_process import StoreProcess
from tests.hf_fixtures import save_bpe_tokenizer

CODE = RewardConfig(kind="code", timeout_s=10, cpu_s=2, memory_mb=256)
KEYS = {
    "admin_key": "admin-test-key",
    "trainer_key": "trainer-test-key",
    "worker_key": "worker-test-key",
    "reader_key": "reader-test-key",
}
GOOD = [
    {"id": "m1", "q": "Tom has 3 apples and buys 4 more. How many apples does he have?", "a": "7"},
    {"id": "m2", "q": "What is 6 times 7?", "a": 42},
    {"id": "m3", "messages": [{"role": "user", "content": "Tom has 12 apples and buys 5 more. How many?"}], "a": "17"},
    {
        "id": "m4",
        "messages": [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 2 times 3?"}],
        "a": "6",
    },
    {"id": "m5", "q": "What is half of one? Give a fraction.", "a": "\\frac{1}{2}"},
    {
        "id": "c1",
        "domain": "code",
        "messages": [{"role": "user", "content": "Write a function solve(x) that returns x times 3."}],
        "tests": ["assert solve(2) == 6", "assert solve(5) == 15"],
    },
    {"id": "c2", "domain": "code", "q": "def solve(x):\n    return x *", "tests": ["assert solve(1) == 2"]},
]


@pytest.fixture
def store(tmp_path):
    proc = StoreProcess(tmp_path / "rollbook.duckdb", **KEYS)
    yield proc
    proc.stop()


def _write_dataset(path) -> dict[int, str]:
    lines = [
        json.dumps(GOOD[0]),
        json.dumps(GOOD[1]),
        '{"id": "bad1", "q": "What is 1+1?", "a": ',  # line 3: invalid JSON
        json.dumps(GOOD[2]),
        json.dumps({"id": "bad2", "q": "What is 9 times 9?"}),  # line 5: no answer
        json.dumps(GOOD[3]),
        json.dumps({"id": "bad3", "q": ["not", "text"], "a": "1"}),  # line 7: prompt not text
        json.dumps(GOOD[4]),
        json.dumps(GOOD[5]),
        json.dumps(GOOD[6]),
    ]
    path.write_text("\n".join(lines) + "\n")
    return {3: "invalid JSON", 5: "missing field 'a'", 7: "must be text"}


def test_a_dataset_runs_to_the_end_through_the_store_with_real_token_ids_and_math_verify_rewards(tmp_path, store, caplog):
    tok_dir = save_bpe_tokenizer(tmp_path / "tokenizer")
    hf = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    data = tmp_path / "math.jsonl"
    expected_bad = _write_dataset(data)
    group = 3
    config = RolloutConfig(
        dataset=DatasetConfig(
            train_files=[str(data)],
            fields=FieldMap(prompt="q", answer="a", task_id="id"),
            default_domain="math",
            heldout_fraction=0.0,
            epochs=1,
            seed=1,
        ),
        rewards={"math": RewardConfig(kind="math"), "code": CODE},
        tokenizer=str(tok_dir),
        stop_strings=["\n\n"],
        group_size=group,
        num_prompts=2,
        max_new_tokens=12,
        reward_workers=1,
        chunk_prompts=1,
        num_eval_samples=0,
    )
    vocab = registered_vocab_size(config, ModelConfig())
    assert vocab == len(hf) > 50  # the BPE vocabulary, not the toy tasks' 50 characters
    torch.manual_seed(0)
    engine = NativeEngine(build_tiny_model(TinyModelSpec(vocab_size=vocab)), version=0, seed=0)
    submitted = 0
    with (
        caplog.at_level(logging.WARNING, logger="rollbook.datasets"),
        RolloutWorker(engine, config, model_id="tiny") as worker,
        StoreClient(store.address, **KEYS) as client,
    ):
        client.register_model("tiny", vocab)
        client.publish_version("tiny", 0)
        rounds = 0
        while not worker.exhausted:
            trajectories = worker.produce()
            result = client.submit(trajectories)
            assert result.accepted == len(trajectories), result.rejected_by_reason()
            submitted += len(trajectories)
            rounds += 1
            assert rounds < 10
        assert worker.produce() == []  # the epoch is done: nothing more
        stats = worker.stats.metrics()
        stored = client.query(
            "SELECT task_id, domain, prompt_token_ids, output_token_ids, finish_reason, original_reward "
            "FROM trajectories ORDER BY task_id"
        ).to_pylist()

    # every good row once per epoch, group_size samples each; each bad row reported with file:line
    assert submitted == len(stored) == len(GOOD) * group
    assert sorted({r["task_id"] for r in stored}) == sorted(g["id"] for g in GOOD)
    assert sorted(b.line for b in worker.bad_rows) == sorted(expected_bad)
    for bad in worker.bad_rows:
        assert bad.path == str(data) and expected_bad[bad.line] in bad.reason, bad
    logged = " ".join(r.getMessage() for r in caplog.records)
    for line in expected_bad:
        assert f"{data}:{line}:" in logged

    verifiers = {"math": build_reward(RewardConfig(kind="math")), "code": build_reward(CODE)}
    by_id = {g["id"]: g for g in GOOD}
    for row in stored:
        source = by_id[row["task_id"]]
        prompt_text = hf.decode(row["prompt_token_ids"])
        if "messages" in source:  # chat rows: the chat template with the generation prompt
            assert prompt_text == hf.apply_chat_template(source["messages"], tokenize=False, add_generation_prompt=True)
        else:  # plain prompts as they are
            assert prompt_text == source["q"]
        assert max(row["prompt_token_ids"]) < vocab and max(row["output_token_ids"]) < vocab
        out = row["output_token_ids"]
        text = hf.decode(out[: out.index(hf.eos_token_id)] if hf.eos_token_id in out else out, skip_special_tokens=True)
        completion = text.split("\n\n")[0]  # what was scored: up to eos, cut before the stop string
        assert completion == worker.tokenizer.completion_text(out)
        if row["finish_reason"] == "stop":  # stopped on eos or on the stop string, nothing after it
            assert out[-1] == hf.eos_token_id or "\n\n" in hf.decode(out[-4:])
        # the stored reward is math-verify's (or the sandbox's) verdict on the decoded completion
        domain = source.get("domain", "math")
        assert row["domain"] == domain
        check = score_row(verifiers[domain], completion, {"answer": str(source.get("a")), "tests": source.get("tests")})
        assert check.outcome.status == "ok" and row["original_reward"] == check.outcome.reward, (row["task_id"], completion)
    assert stats["reward/num_ok"] == len(stored) and stats["reward/num_error"] == 0
    assert sum(v for k, v in stats.items() if k.startswith("reward/reason/")) == len(stored)
    assert sum(v for k, v in stats.items() if k.startswith("reward/reason/code/")) == 2 * group
    assert "reward/tests_passed/code" in stats  # the fraction of tests passed is recorded
