"""Sharded data parallel (``trainer.data_parallel = "shard"``, FSDP2, trainer/distributed.py) on real
gloo process groups: two sharded ranks take the step of one rank with the whole batch (gradients,
parameters after AdamW, the clip's norm, the statistics), a rank without a group still joins every
pass, and the whole state moves through checkpoints both ways: written by the sharded ranks it loads
into one rank, written by one rank it resumes the sharded ranks."""

from __future__ import annotations

import os
import pathlib
import shutil
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
import torch.multiprocessing as mp

from rollbook.language_models import TinyModelSpec, build_tiny_model
from rollbook.trainer.checkpoint import read_checkpoint
from rollbook.trainer.loop import Trainer, _Rows
from tests.unit.trainer.test_distributed import (
    KL,
    STATS_CASES,
    STEP,
    VOCAB,
    _assert_same,
    _assert_same_stats,
    _config,
    _model,
    _one_rank,
    _teacher,
    batch,
)

SHARD = {"data_parallel": "shard"}
# (groups in the batch, TrainerConfig fields) of each update case; one pair of rank processes takes
# them all (the ``sharded`` fixture), as test_distributed.py's replicated ones
STEP_CASES = {
    "unclipped": (6, {**STEP, "loss": {}}),
    "clipped": (6, {**STEP, "grad_clip": 0.05, "loss": {}}),
    "kl-penalty": (6, {**STEP, "loss": KL}),
    "sequence-mean": (6, {**STEP, "loss": {"aggregation": "sequence_mean", **KL}}),
    # rank 1 packs its share into two micro-batches, rank 0 into one: rank 0 adds a zero-weight pass
    "uneven-micro-batches": (3, {**STEP, "micro_batch_tokens": 64, "loss": {}}),
    "loglinear-proximal": (6, {**STEP, "loss": {"proximal": "loglinear"}}),
    "mopd-beside-rl": (
        3,
        {**STEP, "loss": {"aggregation": "sequence_mean", "distill_aggregation": "token_mean", "distill_coef": 1.0}},
    ),
    "one-group": (1, {"lr": 1e-2}),  # rank 1 has no share of the batch
    "offload-optimizer": (6, {**STEP, "offload_optimizer": True, "loss": {}}),  # no effect on the shards (a warning)
}
# several micro-batches per rank: passes with and without grad, then with grad again, in one autocast
BF16 = (6, {**STEP, "dtype": "bfloat16", "micro_batch_tokens": 64, "loss": {}})
# two optimizer updates in the step: each rank draws its own minibatches from its share, so the step is
# that of replicated ranks (test_distributed.py's path), not of one rank
MINIBATCHES = (6, {**STEP, "num_minibatches": 2, "loss": KL})
UPDATES = {
    **STEP_CASES,
    "bf16": BF16,
    "two-minibatches": MINIBATCHES,
    "two-minibatches-replicated": (MINIBATCHES[0], {**MINIBATCHES[1], "data_parallel": "replicate"}),
    **{f"stats-{name}": (4, kw) for name, kw in STATS_CASES.items()},
}
LOOP = {**STEP, "loss": {}, "num_steps": 2, "checkpoint_every": 1, "export_every": 1}  # the "steps" and "resume" cases


@dataclass
class _Batch:
    table: pa.Table | None
    lease_id: str
    stats: dict = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return 0 if self.table is None else self.table.num_rows


class _Store:
    """The store as rank 0's trainer sees it, in memory: the given batches, then none; calls recorded."""

    def __init__(self, tables: list[pa.Table]):
        self.tables, self.calls = list(tables), []

    def pull_batch(self, **_) -> _Batch:
        return _Batch(self.tables.pop(0) if self.tables else None, f"lease-{len(self.tables)}")

    def report_train_step(self, *, step, lease_id, **_) -> None:
        self.calls.append(("report", step, lease_id))

    def ack_batch(self, lease_id, trainer_id) -> None:
        self.calls.append(("ack", lease_id))

    def publish_version(self, model_id, version, **_) -> None:
        self.calls.append(("publish", version))


def _leased(seed: int) -> pa.Table:
    """A batch as ``PullBatch`` hands it out (the columns the step's report reads besides the loss's)."""
    table = batch(3, seed=seed)
    rewards = pa.array(np.linspace(0, 1, table.num_rows), pa.float64())
    return (
        table.append_column("original_reward", rewards)
        .append_column("reward", rewards)
        .append_column("min_version", pa.array([0] * table.num_rows, pa.int64()))
    )


def _whole(trainer) -> dict:
    """The whole parameters, gradients and optimizer state of a trainer (sharded: on rank 0, a collective)."""
    model, optimizer = trainer._full_state(optimizer=True)
    grads = {n: _full(p.grad) for n, p in trainer.model.named_parameters() if p.grad is not None}
    return {"params": model.state_dict(), "grads": grads, "optimizer": optimizer.state_dict()}


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.clone()


def _rank(rank: int, world: int, init_method: str, out: str, resume_dir: str) -> None:
    import faulthandler
    import traceback

    import torch.distributed as dist

    from rollbook.trainer.distributed import DistributedTrainer, init_group

    faulthandler.enable()
    torch.set_num_threads(1)
    init_group(rank, world, init_method, backend="gloo", timeout_s=60)

    def run(name: str, body) -> None:
        case_dir = pathlib.Path(out) / name
        case_dir.mkdir(exist_ok=True)
        try:
            result = body(case_dir)
        except Exception:  # this case's tests fail with it; the next case still runs
            result = {"error": traceback.format_exc()}
        torch.save(result, case_dir / f"rank{rank}.pt")

    def update(num_groups: int, kw: dict):
        def body(case_dir: pathlib.Path) -> dict:
            np.random.seed(0)
            table = batch(num_groups)
            config = _config(case_dir, **{**SHARD, **kw})
            trainer = DistributedTrainer(config, object() if rank == 0 else None, model=_model(), teacher=_teacher(kw))
            trainer._table = table
            stats = trainer.update(_Rows.from_table(table))
            return {**_whole(trainer), "stats": stats}

        return body

    def steps(run_dir: pathlib.Path, tables: list[pa.Table], published: list) -> DistributedTrainer:
        store = _Store(tables) if rank == 0 else None
        publishers = [lambda version, state: published.append((version, state))] if rank == 0 else []
        # rank 1 starts from other weights: the shards are cut from rank 0's
        model = _model() if rank == 0 else build_tiny_model(TinyModelSpec(vocab_size=VOCAB), seed=1)
        trainer = DistributedTrainer(_config(run_dir, **LOOP, **SHARD), store, model=model, publishers=publishers)
        trainer.start()
        while trainer.state.step < LOOP["num_steps"]:
            assert trainer.step() is not None
        return trainer

    def loop(case_dir: pathlib.Path) -> dict:
        published: list = []
        trainer = steps(case_dir, [_leased(1), _leased(2)], published)
        calls = trainer.client._client.calls if rank == 0 else []
        return {**_whole(trainer), "published": published, "calls": calls}

    def resume(case_dir: pathlib.Path) -> dict:
        published: list = []
        trainer = steps(pathlib.Path(resume_dir), [_leased(2)], published)
        return {**_whole(trainer), "state": trainer.state, "published": published}

    try:
        for name, (num_groups, kw) in UPDATES.items():
            run(name, update(num_groups, kw))
        run("steps", loop)
        run("resume", resume)
    finally:
        # rank 0 hosts the group's TCP store: it tears down last (as in test_distributed.py)
        down = [pathlib.Path(out) / f"rank{r}.down" for r in range(1, world)]
        deadline = time.monotonic() + 60
        while rank == 0 and not all(d.exists() for d in down) and time.monotonic() < deadline:
            time.sleep(0.01)
        dist.destroy_process_group()
        if rank != 0:
            (pathlib.Path(out) / f"rank{rank}.down").touch()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # done and saved: no interpreter teardown (test_distributed.py says why)


def _one_rank_steps(run_dir: pathlib.Path, tables: list[pa.Table]) -> Trainer:
    """One rank through ``start`` and the steps of ``tables`` (the same loop the sharded ranks run)."""
    torch.set_num_threads(1)
    trainer = Trainer(_config(run_dir, **LOOP), _Store(tables), model=_model())  # type: ignore[arg-type]
    trainer.start()
    while trainer.state.step < LOOP["num_steps"]:
        assert trainer.step() is not None
    return trainer


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> dict[str, Any]:
    """Every case on two sharded gloo ranks: one spawn for the module. The "resume" case starts from
    a checkpoint one rank wrote after its first step, written here first."""
    out = tmp_path_factory.mktemp("sharded")
    resume_dir = out / "resume-run"
    np.random.seed(0)
    first = Trainer(_config(resume_dir, **LOOP), _Store([_leased(1)]), model=_model())  # type: ignore[arg-type]
    first.start()
    first.step()  # checkpoint_every = 1: step-000001 on disk
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    mp.spawn(_rank, args=(2, init, str(out), str(resume_dir)), nprocs=2, join=True)
    names = [*UPDATES, "steps", "resume"]
    results: dict[str, Any] = {
        name: [torch.load(out / name / f"rank{r}.pt", weights_only=False) for r in range(2)] for name in names
    }
    results["dirs"] = {"steps": out / "steps", "resume": resume_dir}
    return results


def _ranks_of(sharded: dict[str, Any], case: str) -> list[dict]:
    ranks = sharded[case]
    for rank, result in enumerate(ranks):
        assert "error" not in result, f"rank {rank} of case {case}:\n{result['error']}"
    return ranks


@pytest.mark.slow  # two gloo rank processes
@pytest.mark.parametrize("case", list(STEP_CASES))
def test_two_sharded_ranks_take_the_step_of_one_rank_with_the_whole_batch(tmp_path, sharded, case):
    """FSDP2 sums the gradients over the ranks (each rank's losses are already scaled by its share):
    the same gradients, parameters after AdamW and norm as one rank. "one-group" leaves rank 1 without
    a share: it runs zero-weight passes beside rank 0's, or rank 0 would wait in its collectives."""
    num_groups, kw = STEP_CASES[case]
    one = _one_rank(tmp_path / "one", num_groups, **kw)
    whole = _ranks_of(sharded, case)[0]  # rank 0 holds the gathered state
    before = _model().state_dict()
    assert any(not torch.equal(before[k], v) for k, v in one["params"].items())  # the step moved the weights
    assert whole["params"].keys() == one["params"].keys()
    _assert_same(one, whole)
    assert whole["stats"]["grad/norm"] == pytest.approx(one["stats"]["grad/norm"], rel=1e-4)
    assert whole["stats"]["dist/world_size"] == 2


@pytest.mark.slow  # two gloo rank processes
def test_a_bfloat16_sharded_step_is_the_single_rank_step_within_bfloat16_rounding(tmp_path, sharded):
    """dtype = "bfloat16": float32 sharded parameters, forward passes under autocast (no FSDP2
    mixed-precision policy); the ranks' micro-batches round differently, hence the looser tolerance."""
    num_groups, kw = BF16
    one = _one_rank(tmp_path / "one", num_groups, **kw)
    whole = _ranks_of(sharded, "bf16")[0]
    for name, grad in one["grads"].items():
        assert whole["params"][name].dtype == torch.float32
        assert float((whole["grads"][name] - grad).norm()) <= 0.03 * float(grad.norm()) + 1e-6, name
    assert whole["stats"]["grad/norm"] == pytest.approx(one["stats"]["grad/norm"], rel=0.03)


@pytest.mark.slow  # two gloo rank processes
def test_offload_optimizer_leaves_the_sharded_state_where_it_is(sharded):
    """Each rank keeps its share of the AdamW state (the checkpoint's gather of it is a collective on
    the device); the step is the one-rank step all the same (the ``offload-optimizer`` step case)."""
    assert all("perf/offload_s" not in result["stats"] for result in _ranks_of(sharded, "offload-optimizer"))


@pytest.mark.slow  # two gloo rank processes
def test_two_optimizer_updates_in_a_step_are_those_of_replicated_ranks(sharded):
    replicated = _ranks_of(sharded, "two-minibatches-replicated")[0]
    whole = _ranks_of(sharded, "two-minibatches")[0]
    _assert_close_after_steps(replicated["params"], whole["params"])
    for name, grad in replicated["grads"].items():  # the second update's
        torch.testing.assert_close(whole["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"grad {n}: {m}")
    assert whole["stats"]["grad/norm"] == pytest.approx(replicated["stats"]["grad/norm"], rel=1e-4)


@pytest.mark.slow  # two gloo rank processes
@pytest.mark.parametrize("case", list(STATS_CASES))
def test_two_sharded_ranks_report_the_step_statistics_of_one_rank(tmp_path, sharded, case):
    one = _one_rank(tmp_path / "one", 4, **STATS_CASES[case])
    whole = _ranks_of(sharded, f"stats-{case}")[0]
    _assert_same_stats(one["stats"], whole["stats"])


@pytest.mark.slow  # two gloo rank processes
def test_a_checkpoint_the_sharded_ranks_write_loads_into_one_rank_as_they_hold_it(tmp_path, sharded):
    """Two sharded steps through ``start``/``step`` (rank 0: report, checkpoint, ack, export,
    publish; rank 1: the matching gathers): one lease, one ack and one version per step, and the
    checkpoint, the Hugging Face export and the last published version are the ranks' whole state, in
    the format one rank reads."""
    whole, _ = _ranks_of(sharded, "steps")
    case_dir = sharded["dirs"]["steps"]
    assert whole["calls"] == [
        ("publish", 0),
        ("report", 0, "lease-1"),
        ("ack", "lease-1"),
        ("publish", 1),
        ("report", 1, "lease-0"),
        ("ack", "lease-0"),
        ("publish", 2),
    ]
    assert [version for version, _ in whole["published"]] == [0, 1, 2]
    one = Trainer(_config(tmp_path, **LOOP), None, model=_model())  # type: ignore[arg-type]
    found = read_checkpoint(case_dir)
    assert found is not None and found[1].step == 2
    one.model.load_state_dict(found[0]["model"])
    one.optimizer.load_state_dict(found[0]["optimizer"])  # the format of one rank's
    for name, tensor in one.model.state_dict().items():
        assert torch.equal(tensor, whole["params"][name]), name
        assert torch.equal(whole["published"][-1][1][name], tensor), name
    for i, state in one.optimizer.state_dict()["state"].items():
        for key, value in state.items():
            assert torch.equal(value, whole["optimizer"]["state"][i][key]), (i, key)
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(case_dir / "hf" / "step-000002")
    assert exported.config.architectures == ["LlamaForCausalLM"]  # the model's class, not FSDP2's wrapper of it
    for name, tensor in exported.state_dict().items():
        assert torch.equal(tensor, whole["params"][name]), name


@pytest.mark.slow  # two gloo rank processes
def test_two_sharded_steps_are_the_two_steps_of_one_rank(tmp_path, sharded):
    """From rank 0's weights (rank 1 built other ones: version 0 is rank 0's model), two steps."""
    whole, _ = _ranks_of(sharded, "steps")
    for name, tensor in _model().state_dict().items():
        assert torch.equal(whole["published"][0][1][name], tensor), name
    np.random.seed(0)
    one = _one_rank_steps(tmp_path, [_leased(1), _leased(2)])
    _assert_close_after_steps(one.model.state_dict(), whole["params"])


@pytest.mark.slow  # two gloo rank processes
def test_sharded_ranks_resume_from_a_checkpoint_one_rank_wrote(tmp_path, sharded):
    """Rank 0 reads the checkpoint of one rank and scatters model and AdamW state to the shards: the
    ranks republish its version and their next step is the one rank's next step from it."""
    whole, other = _ranks_of(sharded, "resume")
    resume_dir = sharded["dirs"]["resume"]
    assert whole["state"].step == other["state"].step == 2
    assert whole["published"][0][0] == 1  # the checkpoint's version, republished on start
    first = torch.load(resume_dir / "checkpoints" / "step-000001" / "state.pt", weights_only=False)
    for name, tensor in first["model"].items():
        assert torch.equal(whole["published"][0][1][name], tensor), name
    # one rank, from the same checkpoint, the same next step
    np.random.seed(0)
    shutil.copytree(resume_dir / "checkpoints" / "step-000001", tmp_path / "checkpoints" / "step-000001")
    (tmp_path / "checkpoints" / "LATEST").write_text("step-000001")
    one = _one_rank_steps(tmp_path, [_leased(2)])
    _assert_close_after_steps(one.model.state_dict(), whole["params"])


def _assert_close_after_steps(one: dict, two: dict, lr: float = 1e-2) -> None:
    """Parameters after AdamW steps on the same batches: float32 summation order moves an element by
    a small part of ``lr`` at most, except the few whose gradient is near 0 (Adam's first step is
    ``lr * sign(g)`` there), which stay within the steps' bound."""
    for name, tensor in one.items():
        diff = (two[name] - tensor).abs()
        assert float(diff.max()) <= 2 * lr * 1.001, name
        assert float((diff > lr * 1e-2).float().mean()) <= 0.01, name


def test_shard_on_one_rank_trains_the_whole_model_and_says_so(tmp_path, caplog):
    from torch.distributed.fsdp import FSDPModule

    with caplog.at_level("WARNING", logger="rollbook.trainer"):
        trainer = Trainer(_config(tmp_path, **SHARD), None, model=_model())  # type: ignore[arg-type]
    assert not isinstance(trainer.model, FSDPModule)
    assert "nothing to shard" in caplog.text


def test_auto_picks_nccl_for_a_trainer_on_cuda_and_gloo_otherwise():
    from rollbook.trainer.distributed import backend_for

    assert backend_for("auto", "cpu") == "gloo"
    assert backend_for("auto", "cuda") == backend_for("auto", "cuda:1") == "nccl"
    assert backend_for("auto", "auto") == ("nccl" if torch.cuda.is_available() else "gloo")
    assert backend_for("gloo", "cuda") == "gloo"


@pytest.mark.parametrize(
    ("device", "rank", "local_rank", "gpu"),
    [("cuda", 3, None, 1), ("cuda", 0, "1", 1), ("auto", None, "0", 0), ("cuda:0", 1, "1", None), ("cpu", 1, None, None)],
)
def test_each_rank_of_a_trainer_on_cuda_takes_its_own_gpu_before_joining(monkeypatch, device, rank, local_rank, gpu):
    """LOCAL_RANK (torchrun), else the rank modulo the GPUs seen (two here), before the group is joined
    (nccl then binds to it); an indexed device is taken as written. No GPU needed: torch.cuda is stubbed."""
    import torch.distributed as dist

    from rollbook.trainer import distributed

    chosen: list[int] = []
    joined: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **_: joined.append(backend))
    monkeypatch.setattr(dist, "get_rank", lambda: rank or 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 4)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    if local_rank is not None:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    distributed.init_group(rank, 4 if rank is not None else None, device=device)
    assert chosen == ([] if gpu is None else [gpu])
    assert joined == ["gloo" if device == "cpu" else "nccl"]
