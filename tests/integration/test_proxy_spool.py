"""Durability of ``rollbook proxy``'s trajectories (docs/online.md "Durability"): with ``spool_dir``,
every completion is written to a local durable spool before its first byte goes to the caller, so a
proxy killed with SIGKILL and restarted on the same spool directory submits what it had delivered,
exactly once. Real ``rollbook serve`` and ``rollbook proxy`` processes, the official ``openai``
client."""

from __future__ import annotations

import signal
import time

import pytest

from tests.integration.test_proxy import ADMIN, MODEL, ProxyProcess, http, sql, start_store

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")


@pytest.fixture
def store(tmp_path):
    store = start_store(tmp_path)
    yield store
    store.kill()


def _session(proxy: ProxyProcess, group: str) -> tuple[str, str]:
    status, body = http(
        proxy.url + "/rollbook/sessions",
        "POST",
        {"task_id": "t", "domain": "arithmetic", "group_id": group, "group_size": 1},
        key=ADMIN,
    )
    assert status == 200, body
    return body["session_id"], body["api_key"]


def test_a_killed_proxy_restarted_on_its_spool_stores_every_delivered_completion_once(store, tmp_path):
    spool = tmp_path / "proxy-spool"
    # consume_settle_s: nothing is released by the timer before the kill; only the end call releases
    proxy = ProxyProcess(store.address, tmp_path, "--spool_dir", str(spool), "--consume_settle_s", "3600")
    delivered: list[str] = []  # completion ids the agent received
    ended: list[str] = []
    try:
        for i in range(6):
            session_id, key = _session(proxy, "")
            client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=key, max_retries=0)
            messages = [{"role": "user", "content": f"{i}+1="}]
            for _ in range(2):
                completion = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
                delivered.append(completion.id)
                messages += [
                    {"role": "assistant", "content": completion.choices[0].message.content or ""},
                    {"role": "user", "content": "wrong."},
                ]
            if i % 2 == 0:  # ended: submitted before the kill; the others' last turn is still held
                status, body = http(f"{proxy.url}/rollbook/sessions/{session_id}/end", "POST", {}, key=key)
                assert status == 200, body
                ended.append(session_id)
            client.close()
        before = sql(store, "SELECT count(*) AS n FROM trajectories")[0]["n"]
        assert before < len(delivered)  # held completions are not in the store yet: the kill would lose them
        proxy.proc.send_signal(signal.SIGKILL)
        proxy.proc.wait(30)
    finally:
        proxy.kill()

    restarted = ProxyProcess(store.address, tmp_path, "--spool_dir", str(spool))
    try:
        # trajectory id of completion chatcmpl-<session>-t<turn>-a<attempt>: <session>/turn-<turn>.0/a<attempt>
        wanted = []
        for cid in delivered:
            session, _, rest = cid.removeprefix("chatcmpl-").rpartition("-t")
            turn, _, attempt = rest.partition("-a")
            wanted.append(f"{session}/turn-{turn}.0/a{attempt}")
        deadline = time.monotonic() + 120
        rows: list[dict] = []
        listed = ", ".join(f"'{t}'" for t in wanted)
        while time.monotonic() < deadline:
            rows = sql(
                store,
                "SELECT w.id, count(t.trajectory_id) AS stored, bool_and(t.consumed) AS consumed, "
                "(SELECT count(*) FROM trajectories) AS total "
                f"FROM (SELECT unnest([{listed}]) AS id) w LEFT JOIN trajectories t ON t.trajectory_id = w.id "
                "GROUP BY w.id",
            )
            if all(r["stored"] == 1 for r in rows):
                break
            time.sleep(0.5)
        assert len(rows) == len(wanted) == 12
        assert all(r["stored"] == 1 and r["consumed"] for r in rows), rows  # every delivered completion, once
        assert rows[0]["total"] == len(wanted)  # and nothing else
        assert restarted.alive
    finally:
        restarted.stop()
    assert "Traceback" not in restarted.log(), restarted.log()[-3000:]
