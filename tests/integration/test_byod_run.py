"""Your own model, tokenizer and data, end to end through the real `rollbook run` CLI: a tiny Llama and a BPE
tokenizer trained here with the ``tokenizers`` library (with a chat template), both saved with
``save_pretrained`` (tests/hf_fixtures.py); a JSONL math dataset (word problems with numeric answers)
and a JSONL code dataset (write a function; hidden asserts), the ``math`` and ``code`` rewards per
domain. The run's store process writes its DuckDB ledger; afterwards (store down) the ledger is read:
the stored token ids decode with that tokenizer to the prompts (chat template applied to chat rows)
and to the completions, each stored reward is math-verify's or the sandbox's verdict recomputed on the
decoded completion, the code rows' reasons and fractions of tests passed are in metrics.jsonl, and
the exported Hugging Face checkpoint loads with ``AutoModelForCausalLM`` / ``AutoTokenizer`` (the
run's very tokenizer files) and generates. Also: the inputs a run needs are checked before its store
starts (one line, no ledger), and the toy-task warm start is refused with a dataset."""

from __future__ import annotations

import json
import pathlib
from collections import Counter

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollbook.config import RewardConfig
from rollbook.rewards import build_reward, score_row
from tests.hf_fixtures import save_tiny_model_dir
from tests.integration.conftest import query_file, rollbook_cli

MATH = [
    {"id": "m1", "question": "Tom has 3 apples and buys 4 more. How many apples does he have?", "answer": "7"},
    {"id": "m2", "question": "What is 6 times 7?", "answer": "42"},
    {
        "id": "m3",
        "messages": [{"role": "user", "content": "Tom has 12 apples and buys 5 more. How many apples?"}],
        "answer": "17",
    },
    {
        "id": "m4",
        "messages": [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 2 times 3?"}],
        "answer": "6",
    },
]
CODE = [
    {
        "id": "c1",
        "messages": [{"role": "user", "content": "Write a function solve(x) that returns x times 3."}],
        "tests": ["assert solve(2) == 6", "assert solve(5) == 15"],
    },
    {"id": "c2", "question": "def solve(x):\n    return x *", "tests": ["assert solve(1) == 2", "assert solve(4) == 8"]},
]
HELDOUT = [{"id": "h1", "question": "What is 3 times 3?", "answer": "9"}]
CODE_REWARD = {"kind": "code", "timeout_s": 10, "cpu_s": 2, "memory_mb": 256}
GROUP, PROMPTS, STEPS = 3, 3, 2  # 2 steps x 3 prompts = the 6 training rows, one epoch


def _jsonl(path: pathlib.Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _config(tmp_path: pathlib.Path, model: pathlib.Path, **extra: str) -> pathlib.Path:
    for domain, rows in (("math", MATH), ("code", CODE)):
        _jsonl(tmp_path / f"{domain}.jsonl", [{**r, "domain": domain} for r in rows])
    _jsonl(tmp_path / "heldout.jsonl", [{**r, "domain": "math"} for r in HELDOUT])
    text = f"""
run_dir = "{tmp_path / "run"}"
placement = "colocated"
num_steps = {STEPS}
eval_every = {STEPS}
{extra.get("top", "")}

[trainer]
model_id = "byod"
num_samples = {GROUP * PROMPTS}
lr = 1e-3

[trainer.model]
path = "{model}"

[rollout]
stop_strings = ["</answer>"]
group_size = {GROUP}
num_prompts = {PROMPTS}
max_new_tokens = 12
num_eval_tasks = 1
num_eval_samples = 0
reward_workers = 1
chunk_prompts = 1

[rollout.dataset]
train_files = ["{tmp_path / "math.jsonl"}", "{tmp_path / "code.jsonl"}"]
heldout_files = ["{tmp_path / "heldout.jsonl"}"]
epochs = 1
seed = 3

[rollout.dataset.fields]
prompt = "question"
task_id = "id"

[rollout.rewards.math]
kind = "math"

[rollout.rewards.code]
kind = "code"
timeout_s = {CODE_REWARD["timeout_s"]}
cpu_s = {CODE_REWARD["cpu_s"]}
memory_mb = {CODE_REWARD["memory_mb"]}
"""
    path = tmp_path / "byod.toml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def byod_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("byod")
    model = save_tiny_model_dir(tmp_path / "model")
    done = rollbook_cli("run", "--config", str(_config(tmp_path, model)), timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return tmp_path / "run", model


def test_stored_token_ids_decode_to_the_prompts_and_rewards_are_the_verifiers_verdicts(byod_run):
    run_dir, model = byod_run
    db = run_dir / "rollbook.duckdb"
    hf = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    assert vocab == len(hf) > 50  # the BPE vocabulary, not the toy tasks' characters
    assert query_file(db, "SELECT model_id, vocab_size FROM models") == [{"model_id": "byod", "vocab_size": vocab}]
    assert query_file(db, "SELECT count(*) AS n FROM rejections")[0]["n"] == 0
    stored = query_file(
        db, "SELECT task_id, domain, prompt_token_ids, output_token_ids, original_reward FROM trajectories ORDER BY task_id"
    )
    # one epoch: every training row once, group_size samples each; the held-out row never trains
    assert sorted(r["task_id"] for r in stored) == sorted(r["id"] for r in MATH + CODE for _ in range(GROUP))
    assert query_file(db, "SELECT count(*) AS n FROM train_steps")[0]["n"] == STEPS

    verifiers = {"math": build_reward(RewardConfig(kind="math")), "code": build_reward(RewardConfig(**CODE_REWARD))}
    source = {r["id"]: (d, r) for d, rows in (("math", MATH), ("code", CODE)) for r in rows}
    reasons: Counter[str] = Counter()
    fractions: list[float] = []
    for row in stored:
        domain, src = source[row["task_id"]]
        assert row["domain"] == domain
        prompt = hf.decode(row["prompt_token_ids"])
        if "messages" in src:  # chat rows: the tokenizer's chat template with the generation prompt
            assert prompt == hf.apply_chat_template(src["messages"], tokenize=False, add_generation_prompt=True)
            assert prompt.startswith("<|bos|>") and prompt.endswith("<|assistant|>")
        else:  # plain prompts as they are
            assert prompt == src["question"]
        out = row["output_token_ids"]
        assert out and max(out) < vocab and max(row["prompt_token_ids"]) < vocab
        text = hf.decode(out[: out.index(hf.eos_token_id)] if hf.eos_token_id in out else out, skip_special_tokens=True)
        completion = text.split("</answer>")[0]  # what was scored: up to eos, cut before the stop string
        check = score_row(verifiers[domain], completion, {"answer": src.get("answer"), "tests": src.get("tests")})
        assert check.outcome.status == "ok", check
        assert row["original_reward"] == check.outcome.reward, (row["task_id"], completion, check)
        reasons[f"reward/reason/{domain}/{check.info['reason']}"] += 1
        if domain == "code":
            assert 0.0 <= check.info["fraction"] <= 1.0, check.info  # the fraction of the hidden asserts passed
            fractions.append(check.info["fraction"])
    # the worker's tally of its verdicts (metrics.jsonl, cumulative over the run's training rows) is the
    # recomputed one, reason for reason: math-verify's correct / wrong / no_answer, the sandbox's own
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [m for m in metrics if "loss/total" in m][-1]
    assert {k: v for k, v in last.items() if k.startswith("reward/reason/")} == dict(reasons)
    assert last["reward/tests_passed/code"] == pytest.approx(sum(fractions) / len(fractions))
    assert last["reward/num_ok"] == len(stored) and last["reward/num_error"] == 0


def test_code_rewards_record_their_reasons_and_fractions(byod_run):
    run_dir, _ = byod_run
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss/total" in r]
    assert len(steps) == STEPS
    reasons = {k: v for r in steps for k, v in r.items() if k.startswith("reward/reason/")}
    assert any(k.startswith("reward/reason/code/") for k in reasons), reasons
    assert any(k.startswith("reward/reason/math/") for k in reasons), reasons
    fractions = [r["reward/tests_passed/code"] for r in steps if "reward/tests_passed/code" in r]
    assert fractions and all(0.0 <= f <= 1.0 for f in fractions)
    assert all(r["reward/num_error"] == 0 for r in steps)


def test_the_export_holds_the_runs_tokenizer_and_generates(byod_run):
    run_dir, model = byod_run
    out = run_dir / "hf" / f"step-{STEPS:06d}"
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the run's tokenizer, byte for byte
        assert (out / name).read_bytes() == (model / name).read_bytes()
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    messages = MATH[3]["messages"]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    generated = loaded.generate(**ids, max_new_tokens=6, do_sample=False)
    assert generated.shape[1] > ids["input_ids"].shape[1]
    assert isinstance(tokenizer.decode(generated[0, ids["input_ids"].shape[1] :], skip_special_tokens=True), str)
    # `rollbook export` of the kept checkpoint writes the same tokenizer (the run config names it)
    done = rollbook_cli("export", str(run_dir), "--to", str(run_dir.parent / "exported"))
    assert done.returncode == 0, done.stderr
    assert (run_dir.parent / "exported" / "tokenizer.json").read_bytes() == (model / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("what", ["dataset", "tokenizer", "model"])
def test_a_missing_input_is_one_line_before_the_store_starts(tmp_path, what):
    model = save_tiny_model_dir(tmp_path / "model")
    config = _config(tmp_path, model)
    args = {
        "dataset": ["--rollout.dataset.heldout_files", json.dumps([str(tmp_path / "nope.jsonl")])],
        "tokenizer": ["--rollout.tokenizer", str(tmp_path / "no-tokenizer")],
        "model": ["--trainer.model.path", str(tmp_path / "no-model")],
    }[what]
    done = rollbook_cli("run", "--config", str(config), *args, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "store:" not in done.stdout
    last = done.stderr.strip().splitlines()
    assert len(last) == 1 and last[0].startswith("rollbook run: error: "), done.stderr
    assert {
        "dataset": "nope.jsonl does not exist",
        "tokenizer": "no-tokenizer does not exist",
        "model": "no-model': no such directory",
    }[what] in last[0]
    assert not (tmp_path / "run" / "rollbook.duckdb").exists()  # no store was started, no ledger made


def test_bad_rows_under_on_bad_row_fail_are_one_line_before_the_store_starts(tmp_path):
    model = save_tiny_model_dir(tmp_path / "model")
    config = _config(tmp_path, model)
    with open(tmp_path / "math.jsonl", "a") as f:  # lines 5 and 6: no answer for the math reward; a domain without a reward
        f.write(json.dumps({"id": "m5", "question": "What is 1 plus 1?", "domain": "math"}) + "\n")
        f.write(json.dumps({"id": "m6", "question": "Name a colour.", "answer": "red", "domain": "art"}) + "\n")
    done = rollbook_cli("run", "--config", str(config), "--rollout.dataset.on_bad_row", "fail", timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "store:" not in done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rollbook run: error: "), done.stderr
    assert "2 bad rows (on_bad_row = 'fail')" in lines[0]
    assert f"{tmp_path / 'math.jsonl'}:5" in lines[0] and f"{tmp_path / 'math.jsonl'}:6" in lines[0]
    run = tmp_path / "run"
    assert not any((run / name).exists() for name in ("rollbook.duckdb", "keys.json", "store.json")), sorted(
        p.name for p in run.iterdir()
    )


def test_the_toy_task_warm_start_is_refused_with_a_dataset(tmp_path):
    model = save_tiny_model_dir(tmp_path / "model")
    config = _config(tmp_path, model, top="[warm_start]\nstudent_steps = 20")
    done = rollbook_cli("run", "--config", str(config), timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert "warm_start.student_steps = 20: the warm start trains on the toy tasks" in done.stderr.strip().splitlines()[-1]


def test_the_readmes_own_model_commands_run_as_written(tmp_path):
    """The bash block of README "Your own model and data" that builds the stand-in model and runs
    `configs/byod.toml` on it, line for line (``python`` and ``rollbook`` as this interpreter), in a
    directory holding a copy of configs/ (the config's paths are relative to the current directory)."""
    import re
    import shutil
    import subprocess
    import sys

    from tests.integration.conftest import clean_env

    repo = pathlib.Path(__file__).resolve().parents[2]
    readme = (repo / "README.md").read_text()
    section = readme[readme.index("## Your own model and data") :]
    block = next(b for b in re.findall(r"```bash\n(.*?)```", section, flags=re.S) if "make_tiny_hf_model.py" in b)
    commands = [line.strip() for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    assert [c.split()[0] for c in commands] == ["python", "rollbook"], commands
    shutil.copytree(repo / "configs", tmp_path / "configs")
    shutil.copytree(repo / "examples", tmp_path / "examples")
    for command in commands:
        program, *args = command.split()
        argv = [sys.executable, *args] if program == "python" else [sys.executable, "-m", "rollbook.cli", *args]
        done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=900, env=clean_env())
        assert done.returncode == 0, (command, done.stdout[-3000:], done.stderr[-3000:])
    run_dir = tmp_path / "runs" / "byod"
    db = run_dir / "rollbook.duckdb"
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "models" / "my-llm"), local_files_only=True)
    assert query_file(db, "SELECT vocab_size FROM models") == [{"vocab_size": len(hf)}]
    assert query_file(db, "SELECT count(*) AS n FROM train_steps")[0]["n"] == 2
    rows = query_file(db, "SELECT domain, prompt_token_ids FROM trajectories")
    assert rows and {r["domain"] for r in rows} <= {"math", "code"}
    assert all(hf.decode(r["prompt_token_ids"]).strip() for r in rows)
    export = run_dir / "hf" / "step-000002"
    assert (export / "tokenizer.json").read_bytes() == (tmp_path / "models" / "my-llm" / "tokenizer.json").read_bytes()
    model = AutoModelForCausalLM.from_pretrained(export, local_files_only=True)
    assert model.generate(**hf("What is 2 times 3?", return_tensors="pt"), max_new_tokens=3, do_sample=False).shape[1] > 3


def test_rollbook_train_alone_registers_the_vocabulary_of_its_tokenizers_student(tmp_path):
    """`rollbook train` with `tokenizer` (the rollout's tokenizer directory) and a tiny student of unset
    size: the student gets the tokenizer's vocabulary and the store is told its embedding rows, the
    number `rollbook run` and `rollbook rollout` use for the same tokenizer (not the toy tasks' 50)."""
    import subprocess
    import sys

    from rollbook.run.store_process import StoreProcess
    from tests.hf_fixtures import save_bpe_tokenizer
    from tests.integration.conftest import clean_env

    keys = {"admin_key": "admin-k", "trainer_key": "trainer-k", "worker_key": "worker-k", "reader_key": "reader-k"}
    tok = save_bpe_tokenizer(tmp_path / "tok")
    store = StoreProcess(tmp_path / "rollbook.duckdb", **keys)
    try:
        env = clean_env(ROLLBOOK_ADMIN_KEY=keys["admin_key"], ROLLBOOK_TRAINER_KEY=keys["trainer_key"])
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "rollbook.cli",
                "train",
                "--server",
                store.address,
                "--run_dir",
                str(tmp_path / "trainer"),
                "--tokenizer",
                str(tok),
                "--num_samples",
                "4",
                "--max_wait_s",
                "2",
                "--poll_interval_s",
                "0.5",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        # no worker submits: it gives up after max_wait_s, in one line, having registered and published
        assert done.returncode != 0 and "no batch from the store" in done.stderr.strip().splitlines()[-1], done.stderr
        with store.client() as client:
            models = client.query("SELECT model_id, vocab_size FROM models").to_pylist()
    finally:
        store.stop()
    assert models == [{"model_id": "tiny", "vocab_size": len(AutoTokenizer.from_pretrained(str(tok)))}]
