"""kill -9 under load: four client processes submit 20,000 trajectories while the store is
SIGKILLed twice and restarted on the same port; every acknowledged trajectory is stored exactly
once and every submitted one is there at the end.

Run: ``python -m pytest tests/integration/test_crash_recovery.py -q``.
"""

from __future__ import annotations

import collections
import json
import multiprocessing
import pathlib
import time

import grpc

from rollbook.client import STATUS_NAMES, StoreClient
from tests.integration.conftest import query_file, register, rows, start_store, traj

NUM_CLIENTS = 4
PER_CLIENT = 5_000
TOTAL = NUM_CLIENTS * PER_CLIENT
KILL_AT = (0.2 * TOTAL, 0.5 * TOTAL)  # accepted rows at which the store is SIGKILLed


def _client_main(address: str, index: int, out_dir: str) -> None:
    """One rollout client: submit its share with batching and retries, then write every final
    verdict (``id<TAB>STATUS``) and its counters."""

    def workload():
        for i in range(PER_CLIENT):
            yield traj(f"crash-{index}-{i}", n=16 + (i * 7 + index) % 17, version=i % 2, worker_id=f"w{index}")

    with StoreClient(address, timeout_s=60) as client:
        result = client.submit(workload(), batch_size=32, max_in_flight=4, retry_deadline_s=180)
    out = pathlib.Path(out_dir)
    lines = "".join(f"{tid}\t{STATUS_NAMES[v.status]}\n" for tid, v in result.verdicts.items())
    (out / f"verdicts-{index}.tmp").write_text(lines)
    (out / f"verdicts-{index}.tmp").rename(out / f"verdicts-{index}.tsv")
    summary = {
        "accepted": result.accepted,
        "duplicates": result.duplicates,
        "rejected": result.rejected,
        "reconnects": result.reconnects,
        "resent_batches": result.resent_batches,
    }
    (out / f"summary-{index}.json").write_text(json.dumps(summary))


def _accepted(address: str) -> int:
    with StoreClient(address, timeout_s=10) as client:
        return client.stats().accepted


def _wait_for_accepted(address: str, at_least: float, procs, timeout: float = 300.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            n = _accepted(address)
        except grpc.RpcError:
            n = -1  # the store is still starting or replaying
        if n >= at_least:
            return n
        assert all(p.exitcode in (None, 0) for p in procs), [p.exitcode for p in procs]
        time.sleep(0.05)
    raise AssertionError(f"store did not reach {at_least} accepted rows within {timeout} s")


def test_sigkill_twice_under_four_clients_loses_and_duplicates_nothing(tmp_path, stores):
    db = tmp_path / "rollbook.duckdb"
    stores.append(store := start_store(db))
    port = store.port
    with store.client() as client:
        register(client)

    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_client_main, args=(store.address, i, str(tmp_path)), daemon=True) for i in range(NUM_CLIENTS)]
    for p in procs:
        p.start()
    try:
        seen_at_kill = []
        for threshold in KILL_AT:
            seen_at_kill.append(_wait_for_accepted(store.address, threshold, procs))
            store.kill()
            stores.append(store := start_store(db, port=port))
            assert store.port == port
        for p in procs:
            p.join(timeout=300)
        assert [p.exitcode for p in procs] == [0] * NUM_CLIENTS, "a client failed (see its traceback above)"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert all(n < TOTAL for n in seen_at_kill), f"the kills came too late to matter: {seen_at_kill}"

    verdicts: dict[str, str] = {}
    summaries = []
    for i in range(NUM_CLIENTS):
        for line in (tmp_path / f"verdicts-{i}.tsv").read_text().splitlines():
            tid, status = line.split("\t")
            verdicts[tid] = status
        summaries.append(json.loads((tmp_path / f"summary-{i}.json").read_text()))
    submitted = {f"crash-{c}-{i}" for c in range(NUM_CLIENTS) for i in range(PER_CLIENT)}
    assert set(verdicts) == submitted
    final = collections.Counter(verdicts.values())
    assert set(final) <= {"ACCEPTED", "DUPLICATE"}, final
    # an ACCEPTED verdict is never given twice for one id: a resend after a kill comes back DUPLICATE
    assert sum(s["accepted"] for s in summaries) <= TOTAL
    assert sum(s["accepted"] for s in summaries) >= final["ACCEPTED"]
    assert sum(s["reconnects"] for s in summaries) >= 1

    def check(stored_ids: list[str], totals: dict) -> None:
        assert totals == {"n": TOTAL, "d": TOTAL}
        assert len(stored_ids) == TOTAL and set(stored_ids) == submitted

    # through the server ...
    with store.client() as client:
        totals = rows(client, "SELECT count(*) AS n, count(DISTINCT trajectory_id) AS d FROM trajectories")[0]
        ids = client.query("SELECT trajectory_id FROM trajectories").column("trajectory_id").to_pylist()
        check(ids, totals)
        assert rows(client, "SELECT count(*) AS n FROM rejections") == [{"n": 0}]
        assert rows(
            client,
            "SELECT count(*) AS n FROM trajectories WHERE num_output_tokens != len(output_logprobs) "
            "OR num_output_tokens != len(output_versions) OR num_output_tokens NOT BETWEEN 16 AND 32",
        ) == [{"n": 0}]
    # ... and through the file after shutdown
    assert store.terminate() == 0
    totals = query_file(db, "SELECT count(*) AS n, count(DISTINCT trajectory_id) AS d FROM trajectories")[0]
    ids = [r["trajectory_id"] for r in query_file(db, "SELECT trajectory_id FROM trajectories")]
    check(ids, totals)
