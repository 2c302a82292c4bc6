"""What makes a trainer step replayable, piece by piece (``rollbook replay step``, rollbook/cli/replay_step.py):
the minibatch order drawn from (seed, step) alone, the leases' row positions and served advantages
(validator/pull.py, store/schema.py), the bit-for-bit comparisons and the refusals of a step that
cannot be replayed, on an in-memory or real DuckDB file with the ledger's DDL. The whole command on a
real run: tests/integration/test_replay_step.py.

Run: python -m pytest tests/unit/test_replay_step.py -q
"""

from __future__ import annotations

import json
import math
import pathlib
import random
import subprocess
import sys

import duckdb
import numpy as np
import pyarrow as pa
import pytest
import torch

from rollbook.cli.replay_step import _steps, compare_scalar, compare_tensors, read_step, same_bits
from rollbook.config import TrainerConfig, ValidatorConfig
from rollbook.errors import ConfigError
from rollbook.language_models import TinyModelSpec, build_tiny_model
from rollbook.store.schema import DDL
from rollbook.trainer.loop import Trainer, _Rows, minibatch_order
from tests.unit.validator.ledger_rows import T0, connect, insert, pull, traj

# ---- the minibatch order ---------------------------------------------------------------------------------


def test_the_minibatch_order_is_a_permutation_drawn_from_the_seed_and_the_step_alone():
    np.random.seed(1)
    random.seed(1)
    first = minibatch_order(7, 3, 50)
    np.random.seed(2)  # whatever the global generators hold or draw in between
    np.random.rand(1000)
    random.random()
    assert np.array_equal(minibatch_order(7, 3, 50), first)
    assert sorted(first.tolist()) == list(range(50))
    assert not np.array_equal(minibatch_order(7, 4, 50), first)  # another step, another order
    assert not np.array_equal(minibatch_order(8, 3, 50), first)  # another seed, another order
    assert sorted(minibatch_order(-1, 0, 5).tolist()) == list(range(5))  # a negative seed is a seed too
    assert len(minibatch_order(0, 0, 0)) == 0


def _batch() -> pa.Table:
    rng = np.random.default_rng(0)
    outputs = [rng.integers(3, 20, int(n)).tolist() for n in rng.integers(2, 6, 8)]
    return pa.table(
        {
            "prompt_token_ids": [[1, 5]] * 8,
            "output_token_ids": outputs,
            "output_logprobs": [[-1.5] * len(o) for o in outputs],
            "output_versions": [[0] * len(o) for o in outputs],
            "advantage": pa.array(rng.normal(size=8), pa.float32()),
            "temperature": [1.0] * 8,
            "domain": ["d"] * 8,
        }
    )


def _updated(tmp_path: pathlib.Path, numpy_seed: int) -> tuple[dict, dict]:
    config = TrainerConfig(run_dir=str(tmp_path), num_minibatches=4, micro_batch_tokens=64, model={"vocab_size": 32})
    trainer = Trainer(config, None, model=build_tiny_model(TinyModelSpec(vocab_size=32)))
    trainer.state.step = 5
    np.random.seed(numpy_seed)  # a colocated rollout, an evaluation: the global generator moved on
    stats = trainer.update(_Rows.from_table(_batch()))
    return stats, {k: v.clone() for k, v in trainer.model.state_dict().items()}


def test_a_step_of_several_minibatches_trains_the_same_bits_whatever_numpy_drew_before_it(tmp_path):
    stats, params = _updated(tmp_path / "a", 1)
    again_stats, again = _updated(tmp_path / "b", 2)
    assert stats["loss/total"] == again_stats["loss/total"] and stats["grad/norm"] == again_stats["grad/norm"]
    assert compare_tensors(params, again)[1] is None


# ---- the leases' positions and advantages -------------------------------------------------------------


def _leased(con, lease_id: str) -> list[tuple]:
    return con.execute(
        "SELECT trajectory_id, position, advantage FROM leases WHERE lease_id = ? ORDER BY position", [lease_id]
    ).fetchall()


def test_a_lease_records_each_rows_position_in_the_served_batch_and_the_advantage_served():
    con = connect()
    insert(con, *[traj(f"b{i}", group_id="b", group_size=3, reward=float(i)) for i in range(3)], at=T0 + 1)
    insert(con, *[traj(f"a{i}", group_id="a", group_size=3, reward=float(i % 2)) for i in range(3)], at=T0)
    batch = pull(con, now=T0 + 2)
    table = batch.table
    assert table.column("trajectory_id").to_pylist() == ["a0", "a1", "a2", "b0", "b1", "b2"]  # oldest group first
    served = list(zip(table.column("trajectory_id").to_pylist(), range(table.num_rows), table.column("advantage").to_pylist()))
    assert _leased(con, batch.lease_id) == served  # DuckDB FLOAT and Arrow float32: the same bits
    assert len({a for _, _, a in served}) > 1


def test_an_expired_lease_keeps_the_advantage_it_served_when_its_rows_are_served_again_otherwise():
    con = connect()
    insert(con, traj("p", group_id="g", group_size=2, reward=1.0), traj("q", group_id="g", group_size=2, reward=0.0))
    first = pull(con, now=T0, lease_s=1)
    # scored again (a reward version), the same rows go to a later lease with other advantages
    con.executemany("INSERT INTO reward_versions VALUES ('v2', ?, ?, 'ok', NULL, NULL, 0)", [["p", 0.0], ["q", 1.0]])
    second = pull(con, now=T0 + 5, config=ValidatorConfig(reward_version="v2"))
    assert second.table.column("trajectory_id").to_pylist() == ["p", "q"]
    before, after = _leased(con, first.lease_id), _leased(con, second.lease_id)
    assert [a for _, _, a in before] == pytest.approx([1.0, -1.0], abs=1e-3)
    assert [a for _, _, a in after] == pytest.approx([-1.0, 1.0], abs=1e-3)
    stored = dict(con.execute("SELECT trajectory_id, reward FROM trajectories").fetchall())
    assert stored["p"] == pytest.approx(-1.0, abs=1e-3)  # trajectories.reward holds the later lease's


def test_a_ledger_made_before_the_columns_gets_them_with_nulls_in_the_same_column_order():
    old = duckdb.connect()
    for ddl in DDL:
        if "leases ADD COLUMN" not in ddl:
            old.execute(ddl)
    old.execute("INSERT INTO leases VALUES ('L', 't', 'trainer', 0, 0, 1.0, 2.0, NULL, NULL)")
    for ddl in DDL:  # the store opening the file
        old.execute(ddl)
    fresh = connect()
    columns = "SELECT column_name, data_type FROM duckdb_columns() WHERE table_name = 'leases' ORDER BY column_index"
    assert old.execute(columns).fetchall() == fresh.execute(columns).fetchall()
    assert old.execute(columns).fetchall()[-2:] == [("position", "INTEGER"), ("advantage", "FLOAT")]
    assert old.execute("SELECT position, advantage FROM leases").fetchall() == [(None, None)]


# ---- what the command refuses, on a real file -----------------------------------------------------------


@pytest.fixture
def ledger_file(tmp_path) -> pathlib.Path:
    """A ledger file with steps 0..2 recorded, step 2's lease made before positions were recorded."""
    db = tmp_path / "rollbook.duckdb"
    con = duckdb.connect(str(db))
    for ddl in DDL:
        con.execute(ddl)
    for step in range(3):
        con.execute(
            "INSERT INTO train_steps VALUES (?, 'trainer-0', ?, ?, 0, 1, ?)", [step, step + 1, f"L{step}", json.dumps({})]
        )
        position = None if step == 2 else 0
        con.execute(
            "INSERT INTO leases VALUES (?, 't', 'trainer-0', ?, ?, 0, 1, 1, NULL, ?, ?)", [f"L{step}", step, step, position, 0.5]
        )
    con.close()
    return db


def test_a_step_not_recorded_or_without_a_state_before_it_is_refused_with_the_replayable_steps(ledger_file):
    with pytest.raises(
        ConfigError, match=r"no step 7 in train_steps of trainer 'trainer-0' .*\(0-2 recorded; replayable: 0, 2\)"
    ):
        read_step(ledger_file, "trainer-0", 7, [0, 2])
    with pytest.raises(ConfigError, match=r"before step 1 .*replayable steps are 0, 2; `trainer.checkpoint_every = 1`"):
        read_step(ledger_file, "trainer-0", 1, [0, 2])


def test_a_lease_without_positions_or_a_row_gone_is_refused(ledger_file):
    with pytest.raises(ConfigError, match="made before leases recorded row positions"):
        read_step(ledger_file, "trainer-0", 2, [0, 1, 2])
    with pytest.raises(ConfigError, match="1 rows of lease L0 .* are no longer in"):
        read_step(ledger_file, "trainer-0", 0, [0, 1, 2])  # its trajectory 't' is not in trajectories


def test_a_ledger_another_process_holds_is_refused_and_a_missing_one_named(ledger_file):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import duckdb, sys; c = duckdb.connect({str(ledger_file)!r}); print('held', flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match="is held by a running store; stop it"):
            read_step(ledger_file, "trainer-0", 0, [0])
    finally:
        holder.communicate("", timeout=30)
    with pytest.raises(ConfigError, match="no such ledger file"):
        read_step(ledger_file.with_name("missing.duckdb"), "trainer-0", 0, [0])


# ---- comparing bits ---------------------------------------------------------------------------------------


def test_equal_means_the_same_bits():
    assert same_bits(math.nan, math.nan) and not same_bits(0.0, -0.0) and not same_bits(1.0, math.nextafter(1.0, 2.0))
    assert compare_scalar("loss/total", 0.5, 0.5).equal
    off = compare_scalar("loss/total", 0.5, 0.25)
    assert not off.equal and off.difference == 0.25
    assert not compare_scalar("grad/norm", None, 1.0).equal  # recorded on one side only


def test_tensors_are_compared_bit_for_bit_and_the_first_one_that_differs_is_named():
    a = {"w": torch.tensor([1.0, math.nan]), "b": torch.zeros(2), "c": torch.ones(3)}
    same = {k: v.clone() for k, v in a.items()}
    summary, first = compare_tensors(a, same)
    assert (summary.total, summary.differing, first) == (3, 0, None)  # NaN in the same place: equal
    other = {**same, "b": torch.tensor([0.0, -0.0]), "c": torch.tensor([1.0, 1.5, 1.0])}
    summary, first = compare_tensors(a, other)
    assert (summary.differing, summary.first) == (2, "b") and first == {"name": "b", "max_abs_diff": 0.0}
    assert summary.max_abs_diff == 0.5
    summary, first = compare_tensors(a, {**same, "c": torch.ones(4)})
    assert first == {"name": "c", "max_abs_diff": math.inf}  # another shape


def test_replayable_steps_are_listed_as_ranges():
    assert _steps([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    assert _steps([]) == "none"
