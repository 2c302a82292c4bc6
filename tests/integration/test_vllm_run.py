"""``rollbook run`` with ``--rollout.engine vllm`` (CUDA and vllm only; skipped elsewhere): the separated
placement's rollout process generates with vLLM from the model directory and takes every version the
trainer publishes. The engine's own contract: tests/unit/rollout/test_vllm_engine.py."""

from __future__ import annotations

import pytest

from tests.hf_fixtures import save_head64_model_dir

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_rollbook_run_separated_generates_with_vllm_and_trains(tmp_path):
    """``rollbook run --placement separated --rollout.engine vllm``: the rollout process generates with
    vLLM from the model directory and takes the trainer's versions over shared memory."""
    pytest.importorskip("vllm")
    import duckdb

    from rollbook.tasks import TOKENIZER
    from tests.integration.conftest import rollbook_cli

    save_head64_model_dir(tmp_path / "model", vocab_size=TOKENIZER.vocab_size)
    run_dir = tmp_path / "run"
    done = rollbook_cli(
        "run",
        "--config",
        "configs/smoke.toml",
        "--placement",
        "separated",
        "--run_dir",
        str(run_dir),
        "--num_steps",
        "3",
        "--warm_start.student_steps",
        "0",
        "--trainer.model.path",
        str(tmp_path / "model"),
        "--rollout.engine",
        "vllm",
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    con = duckdb.connect(str(run_dir / "rollbook.duckdb"), read_only=True)
    assert [s for (s,) in con.execute("SELECT step FROM train_steps ORDER BY step").fetchall()] == [0, 1, 2]
    (newest,) = con.execute("SELECT max(max_version) FROM trajectories").fetchone()
    assert newest >= 1  # vLLM generated with a version the trainer published
