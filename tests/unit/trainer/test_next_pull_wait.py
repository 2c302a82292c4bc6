"""The other ranks' wait for rank 0's next pull (trainer/distributed.py ``_broadcast_table``, over
``_rank0_group``) on real gloo groups: it outlasts the group's collective timeout (``dist_timeout_s``)
while rank 0 is busy elsewhere (waiting for rollout, evaluating), and it ends with an error when rank
0's process dies."""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import socket
import time

import pytest
import torch.multiprocessing as mp

TIMEOUT_S = 3.0  # the default group's collective timeout, as init_group sets it from dist_timeout_s
BUSY_S = 8.0  # rank 0's time away from the group between two pulls: longer than that


def _rank(rank: int, port: int, out: str) -> None:
    import pyarrow as pa
    import torch.distributed as dist

    from rollbook.trainer.distributed import _broadcast_table

    # The ranks meet on a store of their own first (it waits as long as an interpreter takes to start),
    # so that the group's short timeout counts from a common moment.
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=300))
    store.add("ready", 1)
    while int(store.add("ready", 0)) < 2:
        time.sleep(0.01)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    first = _broadcast_table(pa.table({"x": [1, 2, 3]}) if rank == 0 else None)  # both make the wait's group here
    result: dict = {"first": first.column("x").to_pylist() if first is not None else None}
    if rank == 0:
        pathlib.Path(out, "rank0.json").write_text(json.dumps(result))
        time.sleep(BUSY_S)  # away from the group: rollout, an evaluation
        _broadcast_table(pa.table({"x": [4, 5]}))
        time.sleep(BUSY_S)
        os._exit(3)  # dies while rank 1 waits for its next pull
    for wait in ("outlasted", "rank0-died"):
        started = time.monotonic()
        try:
            got = _broadcast_table(None)
            result[wait] = {"rows": got.column("x").to_pylist() if got is not None else None}
        except Exception as e:  # noqa: BLE001 - the test reads what ended the wait
            result[wait] = {"error": f"{type(e).__name__}: {e}"}
        result[wait]["waited_s"] = time.monotonic() - started
    pathlib.Path(out, "rank1.json").write_text(json.dumps(result))
    os._exit(0)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Two gloo ranks: rank 0 broadcasts a table, is away BUSY_S, broadcasts another, is away again and
    dies; rank 1 waits for each of its pulls in turn."""
    out = tmp_path_factory.mktemp("next-pull")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, port, str(out))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
        if p.is_alive():
            p.kill()
            pytest.fail("a rank did not finish: rank 1's wait neither outlasted rank 0's absence nor ended with its death")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_the_other_ranks_wait_for_rank_0s_next_pull_longer_than_the_collective_timeout(ranks):
    rank0, rank1 = ranks
    assert rank0["first"] == rank1["first"] == [1, 2, 3]
    outlasted = rank1["outlasted"]
    assert "error" not in outlasted, outlasted["error"]
    assert outlasted["rows"] == [4, 5]
    assert outlasted["waited_s"] > TIMEOUT_S  # rank 0 was away longer than the default group's timeout


def test_a_rank_0_that_dies_ends_the_other_ranks_wait_with_an_error(ranks):
    died = ranks[1]["rank0-died"]
    assert "rows" not in died and "error" in died
