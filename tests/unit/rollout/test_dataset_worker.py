"""The rollout worker on dataset rows: the engine's stop predicate (stop strings), prompts
the tokenizer refuses reported as bad rows, verifier errors sent without a reward, and scoring that
overlaps generation (the next chunk generates while the reward pool scores the previous one)."""

from __future__ import annotations

import json
import pathlib
import time

import pytest
import torch

from rollbook.config import DatasetConfig, RewardConfig, RolloutConfig
from rollbook.language_models import TinyModelSpec, build_tiny_model
from rollbook.rollout.engine import GenerationRequest, GenerationResult, NativeEngine
from rollbook.rollout.worker import RolloutWorker
from rollbook.tasks import TOKENIZER


def test_the_stop_predicate_ends_an_output_after_the_token_that_completes_it():
    torch.manual_seed(0)
    engine = NativeEngine(build_tiny_model(TinyModelSpec(vocab_size=TOKENIZER.vocab_size)), version=0, seed=0)
    seen: list[list[int]] = []

    def stop(ids):
        seen.append(list(ids))
        return len(ids) >= 3

    (stopped, free) = engine.generate(
        [
            GenerationRequest(prompt_token_ids=[1, 5], max_new_tokens=8, stop=stop),
            GenerationRequest(prompt_token_ids=[1, 5], max_new_tokens=4),
        ]
    )
    assert len(stopped.output_token_ids) == 3 and stopped.finish_reason == "stop"
    assert [len(s) for s in seen] == [1, 2, 3]  # called with the output so far, after every token
    assert len(free.output_token_ids) == 4 and free.finish_reason == "length"


class FakeEngine:
    """Answers every prompt with a fixed completion and records when each generate call starts."""

    def __init__(self, completion: list[int]):
        self.completion = completion
        self.calls: list[tuple[float, int]] = []
        self.version = 0

    def generate(self, requests, *, seed=None):
        self.calls.append((time.time(), len(requests)))
        return [
            GenerationResult(
                request_id=r.request_id,
                prompt_token_ids=list(r.prompt_token_ids),
                output_token_ids=list(self.completion),
                output_logprobs=[-1.0] * len(self.completion),
                output_versions=[0] * len(self.completion),
                finish_reason="stop",
                temperature=r.temperature,
                top_p=r.top_p,
                top_k=r.top_k,
            )
            for r in requests
        ]


def slow_reward(completion: str, row: dict) -> float:
    """Sleeps, recording when it ran (the log file is in the row's extra)."""
    start = time.time()
    time.sleep(0.4)
    with open(row["extra"]["log"], "a") as f:
        f.write(json.dumps({"task": row["task_id"], "start": start, "end": time.time()}) + "\n")
    if row["extra"].get("crash"):
        raise RuntimeError("verifier bug")
    return float(completion == row["answer"])


def _dataset(tmp_path: pathlib.Path, rows: list[dict]) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_scoring_runs_in_the_pool_while_the_next_chunk_generates(tmp_path):
    log = str(tmp_path / "scores.jsonl")
    path = _dataset(tmp_path, [{"task_id": f"t{i}", "prompt": f"{i}+1=", "answer": str(i + 1), "log": log} for i in range(4)])
    config = RolloutConfig(
        dataset=DatasetConfig(train_files=[path], default_domain="add", heldout_fraction=0.0, shuffle=False),
        rewards={"add": RewardConfig(kind="tests.unit.rollout.test_dataset_worker:slow_reward")},
        group_size=1,
        num_prompts=4,
        chunk_prompts=1,
        reward_workers=2,
    )
    engine = FakeEngine(TOKENIZER.encode("2", add_eos=True))
    with RolloutWorker(engine, config, model_id="tiny") as worker:
        trajectories = worker.produce()
    assert [t.task_id for t in trajectories] == ["t0", "t1", "t2", "t3"]
    assert [t.reward for t in trajectories] == [0.0, 1.0, 0.0, 0.0]  # "2" is right for 1+1 only
    assert [n for _, n in engine.calls] == [1, 1, 1, 1]  # one chunk (one prompt) per generate call
    scores = [json.loads(line) for line in pathlib.Path(log).read_text().splitlines()]
    first = min(s["end"] for s in scores)
    assert engine.calls[-1][0] < first  # every chunk was generated before the first verifier finished
    assert all(list(t.prompt_token_ids) == TOKENIZER.encode(f"{i}+1=", add_bos=True) for i, t in enumerate(trajectories))


def test_bad_prompts_are_bad_rows_and_verifier_errors_go_without_a_reward(tmp_path):
    log = str(tmp_path / "scores.jsonl")
    path = _dataset(
        tmp_path,
        [
            {"task_id": "ok", "prompt": "1+1=", "answer": "2", "log": log},
            {"task_id": "upper", "prompt": "WHAT IS 1+1", "answer": "2", "log": log},
            {"task_id": "crash", "prompt": "2+2=", "answer": "4", "log": log, "crash": True},
        ],
    )
    config = RolloutConfig(
        dataset=DatasetConfig(train_files=[path], default_domain="add", heldout_fraction=0.0, epochs=1),
        rewards={"add": RewardConfig(kind="tests.unit.rollout.test_dataset_worker:slow_reward")},
        group_size=2,
        num_prompts=5,
        reward_workers=0,
    )
    with RolloutWorker(FakeEngine(TOKENIZER.encode("2", add_eos=True)), config, model_id="tiny") as worker:
        assert [(b.line, b.reason.split(":")[0]) for b in worker.bad_rows] == [(2, "prompt does not encode")]
        assert str(worker.bad_rows[0]).startswith(
            f"{path}:2: prompt does not encode: ValueError: characters not in the vocabulary"
        )
        trajectories = worker.produce()
        assert worker.exhausted and worker.produce() == []
    by_task = {t.task_id: t for t in trajectories}
    assert len(trajectories) == 4 and by_task["ok"].reward == 1.0
    assert not by_task["crash"].HasField("reward")  # an error outcome: no reward, never 0.0
    stats = worker.stats.metrics()
    assert (stats["reward/num_ok"], stats["reward/num_error"]) == (2, 2)
    assert stats["reward/reason/add/verifier_error"] == 2


def test_on_bad_row_fail_refuses_a_prompt_the_tokenizer_cannot_encode(tmp_path):
    path = _dataset(tmp_path, [{"prompt": "1+1=", "answer": "2"}, {"prompt": "WHAT", "answer": "2"}])
    config = RolloutConfig(
        dataset=DatasetConfig(train_files=[path], default_domain="add", on_bad_row="fail"),
        rewards={"add": RewardConfig(kind="exact")},
        reward_workers=0,
    )
    with pytest.raises(ValueError, match=r"1 bad rows .*rows.jsonl:2: prompt does not encode"):
        RolloutWorker(FakeEngine([2]), config, model_id="tiny")


def test_the_model_directory_gives_the_tokenizer_and_the_registered_vocabulary(tmp_path):
    from rollbook.config import ModelConfig
    from rollbook.rollout.worker import registered_vocab_size, tokenizer_for, use_model_tokenizer
    from tests.hf_fixtures import save_tiny_model_dir

    path = save_tiny_model_dir(tmp_path / "model", vocab_size=300)
    data = _dataset(tmp_path, [{"prompt": "What is 2 times 3?", "answer": "6"}])
    rollout = RolloutConfig(
        dataset=DatasetConfig(train_files=[data], default_domain="math"), rewards={"math": RewardConfig(kind="math")}
    )
    model = ModelConfig(path=str(path))
    use_model_tokenizer(rollout, model)
    assert rollout.tokenizer == str(path) and tokenizer_for(rollout).vocab_size == 300
    assert registered_vocab_size(rollout, model) == 300  # the model's config.json
    assert registered_vocab_size(rollout, ModelConfig(vocab_size=512)) == 512  # a tiny model's explicit size
    assert registered_vocab_size(RolloutConfig(), ModelConfig()) == TOKENIZER.vocab_size  # the toy tasks, as before
    toy = RolloutConfig()
    use_model_tokenizer(toy, model)
    assert toy.tokenizer is None  # no dataset: the toy domains keep the character tokenizer
