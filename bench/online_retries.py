"""The online falsifier (client timeouts and retries), shared by tests/integration/test_proxy.py and
``bench/placement.py --online``: agents play through a real ``rollbook proxy`` with an openai client
that times out after 2 s and retries, while an operator pauses the proxy's admission a few times so that
attempts wait past that timeout; every reward is sent after its session ended. Then the trainer's
view (every row ``PullBatch`` serves) is compared with the agents' (the completions they received).

    episodes, pauses = play_with_injected_retries(proxy_url, worker_key, admin_key)
    received, attempts = experienced(proxy_url, admin_key, episodes)
    served = pull_all(store_client, "tiny")

``run_scenario`` is the bench's whole run: a ``rollbook serve`` and a ``rollbook proxy`` of its own,
the scenario, and counts (its ``served_equals_experienced`` is computed, not asserted). ``http``,
``status`` and ``wait_idle`` are the small HTTP helpers for the proxy's control endpoints.
"""

from __future__ import annotations

import json
import os
import pathlib
import secrets
import threading
import time
import urllib.error
import urllib.request
from typing import Any

# (a, b, group_id, group_size) per agent: two groups of two, a singleton group, one without a group
PLAN = [(12, 34, "g0", 2), (12, 34, "g0", 2), (3, 4, "g1", 2), (3, 4, "g1", 2), (8, 8, "solo", 1), (9, 1, "", 1)]
TURNS = 2


def http(
    url: str,
    method: str = "GET",
    body: Any = None,
    key: str | None = None,
    raw: bytes | None = None,
    headers: dict | None = None,
    timeout: float = 60,
) -> tuple[int, Any]:
    """(status, parsed JSON body) of one request; HTTP errors are returned, not raised."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    request = urllib.request.Request(
        url,
        data=data,
        method=method,
        headers={"content-type": "application/json", **(headers or {}), **({"authorization": f"Bearer {key}"} if key else {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        text = exc.read()
        try:
            return exc.code, json.loads(text)
        except ValueError:
            return exc.code, text


def status(url: str, admin_key: str) -> dict:
    """The proxy's admission and weight state (``/rollbook/admin/version``)."""
    code, body = http(url + "/rollbook/admin/version", key=admin_key)
    if code != 200:
        raise RuntimeError(f"proxy status: HTTP {code}: {body}")
    return body


def wait_idle(url: str, admin_key: str, timeout: float = 120) -> None:
    """Until nothing runs, waits, is held or is still to be submitted."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = status(url, admin_key)
        if s["running"] == s["waiting"] == s["pending_submissions"] == s["held"] == 0:
            return
        time.sleep(0.1)
    raise RuntimeError(f"proxy not idle after {timeout} s: {status(url, admin_key)}")


def play_with_injected_retries(
    url: str,
    worker_key: str,
    admin_key: str,
    plan: list = PLAN,
    *,
    timeout_s: float = 2.0,
    max_retries: int = 12,
    retry_pauses: int = 3,
) -> tuple[dict[int, Any], int]:
    """One agent thread per ``plan`` entry (``TURNS`` turns, every other one streaming). While they
    run, pause admission until an attempt has been seen waiting for longer than the client's
    ``timeout_s`` (plus a margin), resume, and repeat until ``retry_pauses`` pauses have each held an
    attempt past its timeout (a pause nothing reaches in 3 s does not count); then let every call
    through. Holding past the first sighting, not a fixed time from the pause, makes each such pause
    certain to cause a retry; stopping after ``retry_pauses`` of them makes every call certain to
    finish (an endless pause cycle left admission open a fraction of the time, and a call whose
    13 attempts all fell in pauses failed on a loaded machine).
    Returns the episodes by plan index and the number of pauses; an agent's error is raised."""
    from examples.arithmetic_agent import play

    episodes: dict[int, Any] = {}
    errors: list[BaseException] = []

    def agent(i: int) -> None:
        a, b, group, size = plan[i]
        try:
            episodes[i] = play(
                url,
                a,
                b,
                group_id=group,
                group_size=size,
                turns=TURNS,
                stream=bool(i % 2),
                start_key=worker_key,
                max_tokens=4,
                client_kwargs={"timeout": timeout_s, "max_retries": max_retries},
                reward_after_end=True,
            )
        except BaseException as exc:
            errors.append(exc)

    agents = [threading.Thread(target=agent, args=(i,)) for i in range(len(plan))]
    for t in agents:
        t.start()
    pauses = held = 0
    while held < retry_pauses and any(t.is_alive() for t in agents):
        if http(url + "/rollbook/admin/pause", "POST", {}, key=admin_key)[0] != 200:
            raise RuntimeError("the proxy refused the admin pause")
        pauses += 1
        deadline, seen_waiting = time.monotonic() + 3.0, None
        while any(t.is_alive() for t in agents):
            now = time.monotonic()
            if seen_waiting is None and status(url, admin_key)["waiting"] >= 1:
                seen_waiting = now  # that attempt has waited at least since now: hold it past its timeout
            if seen_waiting is not None and now - seen_waiting > timeout_s + 0.5:
                held += 1
                break
            if seen_waiting is None and now > deadline:
                break
            time.sleep(0.05)
        if http(url + "/rollbook/admin/resume", "POST", {}, key=admin_key)[0] != 200:
            raise RuntimeError("the proxy refused the admin resume")
        time.sleep(0.3)
    for t in agents:
        t.join()
    if errors:
        raise errors[0]
    wait_idle(url, admin_key)
    return episodes, pauses


def experienced(url: str, admin_key: str, episodes: dict[int, Any]) -> tuple[dict[str, tuple[float, int]], set[str]]:
    """What the agents experienced: the trajectory id of each completion they received (the attempt
    whose response reached them) with its reward and plan index, and the trajectory ids of every
    attempt the proxy made (its session summaries)."""
    received: dict[str, tuple[float, int]] = {}
    every_attempt: set[str] = set()
    for i, ep in episodes.items():
        summary = http(url + f"/rollbook/sessions/{ep.session_id}", key=admin_key)[1]
        for call in summary["calls"]:
            every_attempt.update(tid for a in call["attempts"] for tid in a["trajectory_ids"])
        for turn, (completion_id, reward) in enumerate(zip(ep.completion_ids, ep.rewards)):
            attempt = int(completion_id.rsplit("-a", 1)[1])
            received[f"{ep.session_id}/turn-{turn}.0/a{attempt}"] = (reward, i)
    return received, every_attempt


def pull_all(client, model_id: str, *, trainer_id: str = "t", max_pulls: int = 20) -> list[dict]:
    """Every row a trainer at version 0 is served, pull after pull (each acked), until one is empty."""
    served: list[dict] = []
    for step in range(max_pulls):
        batch = client.pull_batch(
            trainer_id=trainer_id,
            trainer_version=0,
            max_staleness=4,
            num_samples=64,
            step=step,
            model_id=model_id,
            lease_seconds=60,
        )
        if batch.num_rows == 0:
            break
        served += batch.table.to_pylist()
        client.ack_batch(batch.lease_id, trainer_id)
    return served


def run_scenario(work: pathlib.Path, plan: list = PLAN) -> dict:
    """A store and a proxy of its own under ``work``, the scenario, then counts from the agents' side,
    the proxy's and the ledger's."""
    from rollbook import environment as rollbook_env
    from rollbook.config import ProxyConfig, write_resolved
    from rollbook.rollout.proxy.render import renderer
    from rollbook.run.online import ProxyProcess
    from rollbook.run.store_process import StoreProcess

    work.mkdir(parents=True, exist_ok=True)
    keys = {f"{role}_key": secrets.token_hex(16) for role in ("worker", "trainer", "reader", "admin")}
    base = {k: v for k, v in os.environ.items() if not k.startswith("ROLLBOOK_")}
    store = StoreProcess(work / "rollbook.duckdb", **keys, env=base)
    proxy = None
    try:
        with store.client() as client:
            client.register_model("tiny", vocab_size=renderer().vocab_size)
            client.publish_version("tiny", 0)
        write_resolved(ProxyConfig(server=store.address, port=0, model_id="tiny"), work / "proxy")
        env = rollbook_env.with_keys(base, {"worker_key": keys["worker_key"], "admin_key": keys["admin_key"]})
        proxy = ProxyProcess(work / "proxy" / "config.json", env)
        started = time.monotonic()
        episodes, pauses = play_with_injected_retries(proxy.url, keys["worker_key"], keys["admin_key"], plan)
        received, attempts = experienced(proxy.url, keys["admin_key"], episodes)
        with store.client() as client:
            served = pull_all(client, "tiny")
            stored = client.query("SELECT count(*) AS n FROM trajectories").to_pylist()[0]["n"]
            rejected = {
                r["reason"]: r["n"] for r in client.query("SELECT reason, count(*) AS n FROM rejections GROUP BY ALL").to_pylist()
            }
    finally:
        if proxy is not None:
            proxy.stop()
        store.stop()
    served_rewards = {r["trajectory_id"]: r["original_reward"] for r in served}
    return {
        "agents": len(plan),
        "turns_per_agent": TURNS,
        "pauses": pauses,
        "completions_received": len(received),
        "attempts": len(attempts),
        "rewards_after_session_end": len(received),
        "accepted_rows": stored,
        "served_rows": len(served),
        "served_distinct": len(served_rewards),
        "retry_orphans": rejected.get("RETRY_ORPHAN", 0),
        "rejected_by_reason": rejected,
        "served_equals_experienced": len(served) == len(served_rewards)
        and served_rewards == {tid: reward for tid, (reward, _) in received.items()},
        "wall_s": round(time.monotonic() - started, 1),
    }
