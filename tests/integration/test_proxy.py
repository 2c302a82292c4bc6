"""``rollbook proxy`` as a real process beside a real ``rollbook serve`` store: the example
agent through the official ``openai`` client, retries and late rewards, weight updates, and keys and
malformed requests.

The store runs with all four role keys; the proxy gets the admin key (its control endpoints, model
registration) and the worker key (starting sessions; Submit and SetReward at the store).

Run: python -m pytest tests/integration/test_proxy.py -q
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time

import pytest

from bench import online_retries
from bench.online_retries import http
from rollbook.rollout.proxy.render import CharRenderer
from rollbook.tasks import TOKENIZER
from tests.integration.conftest import StoreProcess, _readline, clean_env

ADMIN = "proxy-test-admin-key-0123456789"
WORKER = "proxy-test-worker-key-abcdefghij"
TRAINER = "proxy-test-trainer-key-klmnopqrst"
READER = "proxy-test-reader-key-uvwxyz0123"
MODEL = "tiny"


def start_store(tmp_path: pathlib.Path) -> StoreProcess:
    store = StoreProcess(tmp_path / "rollbook.duckdb", admin_key=ADMIN, worker_key=WORKER, trainer_key=TRAINER, reader_key=READER)
    with store.client() as client:
        client.register_model(MODEL, vocab_size=TOKENIZER.vocab_size)
        client.publish_version(MODEL, 0)
    return store


class ProxyProcess:
    """``python -m rollbook.cli proxy --port 0 ...``; ``url`` from its 'listening on' line."""

    def __init__(self, store_address: str, log_dir: pathlib.Path, *args: str):
        env = clean_env(ROLLBOOK_ADMIN_KEY=ADMIN, ROLLBOOK_WORKER_KEY=WORKER)
        self.log_path = log_dir / f"proxy-{time.monotonic_ns()}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "rollbook.cli",
                    "proxy",
                    "--port",
                    "0",
                    "--server",
                    store_address,
                    "--model_id",
                    MODEL,
                    "--log-level",
                    "WARNING",
                    *args,
                ],
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=env,
            )
        line = _readline(self.proc, 120)
        if not line.startswith("listening on "):
            self.kill()
            raise RuntimeError(f"proxy did not start: {line!r}\n{self.log()}")
        self.url = line.removeprefix("listening on ").strip()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


@pytest.fixture
def store(tmp_path):
    store = start_store(tmp_path)
    yield store
    store.kill()


@pytest.fixture
def proxy(store, tmp_path):
    proxy = ProxyProcess(store.address, tmp_path)
    yield proxy
    proxy.stop()
    assert "Traceback" not in proxy.log(), proxy.log()[-3000:]


def sql(store: StoreProcess, query: str) -> list[dict]:
    with store.client() as client:
        return client.query(query).to_pylist()


def wait_for_rows(store: StoreProcess, where: str, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sql(store, f"SELECT count(*) AS n FROM trajectories WHERE {where}")[0]["n"] >= n:
            return
        time.sleep(0.2)
    raise AssertionError(f"fewer than {n} rows WHERE {where}")


# ---- the example agent, streaming and not, found with one SQL query ------------------------------


def test_the_example_agent_s_turns_tokens_versions_and_rewards_are_in_the_store(store, proxy):
    from examples.arithmetic_agent import play

    render = CharRenderer()
    episodes = []
    for g, (a, b, stream) in enumerate([(12, 34, False), (5, 7, True)]):
        for _ in range(2):
            episodes.append(
                (
                    a,
                    b,
                    play(proxy.url, a, b, group_id=f"g{g}", group_size=2, turns=2, stream=stream, start_key=WORKER, max_tokens=4),
                )
            )
    ids = ", ".join(f"'{ep.session_id}'" for _, _, ep in episodes)
    got = sql(
        store,
        f"""
        SELECT session_id, request_id, attempt, consumed, group_id, group_size, task_id, domain, prompt_token_ids,
               output_token_ids, output_versions, output_logprobs, temperature, top_p, original_reward, finish_reason
        FROM trajectories WHERE session_id IN ({ids}) ORDER BY session_id, request_id""",
    )
    assert len(got) == 4 * 2  # exactly the agent's turns: nothing more, nothing lost
    by_key = {(r["session_id"], r["request_id"]): r for r in got}
    for a, b, ep in episodes:
        messages: list[tuple[str, str]] = [("user", f"{a}+{b}=")]
        for turn, answer in enumerate(ep.answers):
            row = by_key[(ep.session_id, f"turn-{turn}.0")]
            assert row["prompt_token_ids"] == render.chat_prompt(messages)
            assert render.decode(row["output_token_ids"]) == answer
            assert row["output_versions"] == [0] * len(row["output_token_ids"])
            if ep.versions[turn]:  # the non-streaming response carries the versions it was served with
                assert ep.versions[turn] == row["output_versions"]
            assert all(lp <= 0 for lp in row["output_logprobs"])
            assert row["original_reward"] == ep.rewards[turn]
            assert (row["attempt"], row["consumed"], row["temperature"], row["top_p"]) == (0, True, 1.0, 1.0)
            assert (row["task_id"], row["domain"]) == (f"arithmetic/{a}+{b}=", "arithmetic")
            assert row["group_id"].endswith(f"/turn-{turn}") and row["group_size"] == 2
            messages += [("assistant", answer), ("user", ("right." if ep.rewards[turn] else "wrong.") + f"{a}+{b}=")]
    assert not sql(store, "SELECT * FROM rejections")


# ---- client timeouts and retries, rewards after the session ended -------------------------------


def status(proxy: ProxyProcess) -> dict:
    return online_retries.status(proxy.url, ADMIN)


def wait_idle(proxy: ProxyProcess, timeout: float = 120) -> None:
    online_retries.wait_idle(proxy.url, ADMIN, timeout)


def test_served_rows_are_exactly_the_completions_the_agent_received_despite_timeouts_and_retries(store, proxy):
    """The online falsifier of the AReaL 2.1 review (bench/online_retries.py). The admin pause holds
    attempts at admission until the client's 2 s timeout fires; the openai client retries
    (``x-stainless-retry-count``); on resume the abandoned attempts still generate, and are recorded
    as not consumed."""
    plan = online_retries.PLAN
    episodes, pauses = online_retries.play_with_injected_retries(proxy.url, WORKER, ADMIN, plan)
    received, every_attempt = online_retries.experienced(proxy.url, ADMIN, episodes)
    assert len(received) == 12
    assert len(every_attempt) > len(received), "no retry happened: the injection did not work"

    with store.client() as client:
        rows = online_retries.pull_all(client, MODEL)
    served = {row["trajectory_id"]: row for row in rows}
    assert len(served) == len(rows)  # no row served twice
    assert set(served) == set(received)
    assert {tid: row["original_reward"] for tid, row in served.items()} == {tid: r for tid, (r, _) in received.items()}
    for tid, (reward, i) in received.items():
        if plan[i][2] in ("solo", ""):  # singletons keep their reward (not centered to 0)
            assert served[tid]["reward"] == reward
    assert {r["trajectory_id"]: r["consumed"] for r in sql(store, "SELECT trajectory_id, consumed FROM trajectories")} == {
        tid: True for tid in received
    }
    rejected = sql(store, "SELECT trajectory_id, reason, consumed FROM rejections")
    assert {r["trajectory_id"] for r in rejected} == every_attempt - set(received)
    assert {(r["reason"], r["consumed"]) for r in rejected} == {("RETRY_ORPHAN", False)}  # abandoned: not consumed
    print(f"pauses {pauses}, attempts {len(every_attempt)} for {len(received)} calls")


# ---- a weight update during the run -------------------------------------------------------------


def start_session(proxy: ProxyProcess, **fields) -> tuple[str, str]:
    code, body = http(proxy.url + "/rollbook/sessions", "POST", fields, key=WORKER)
    assert code == 200, body
    return body["session_id"], body["api_key"]


def test_calls_during_a_weight_update_wait_and_carry_the_new_version(store, proxy, tmp_path):
    import threading

    import openai
    import torch

    from rollbook.config import ModelConfig
    from rollbook.language_models import build_student

    weights = tmp_path / "v1.pt"
    torch.save(build_student(ModelConfig(seed=1)).state_dict(), weights)
    results: dict[str, dict] = {}
    errors: list[BaseException] = []

    def call(name: str, max_tokens: int) -> None:
        try:
            session_id, key = start_session(proxy, task_id=name)
            client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=key, max_retries=0, timeout=120)
            completion = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "1+2="}], max_tokens=max_tokens, temperature=1.0
            )
            results[name] = {
                "session_id": session_id,
                "versions": completion.model_extra["rollbook"]["output_versions"][0],
                "done_at": time.monotonic(),
            }
            assert http(proxy.url + f"/rollbook/sessions/{session_id}/end", "POST", {}, key=key)[0] == 200
        except BaseException as exc:
            errors.append(exc)

    call("warm-up", 2)  # the process's first forward pass is slow (lazy initialisation)
    # long calls in flight when the update starts; they finish under whatever weights each step saw
    in_flight = [threading.Thread(target=call, args=(f"long-{i}", 200)) for i in range(2)]
    for t in in_flight:
        t.start()
    while status(proxy)["running"] < 2:
        time.sleep(0.01)
    assert http(proxy.url + "/rollbook/admin/pause", "POST", {}, key=ADMIN)[0] == 200
    waiting = [threading.Thread(target=call, args=(f"wait-{i}", 4)) for i in range(4)]
    for t in waiting:
        t.start()
    deadline = time.monotonic() + 60
    while status(proxy)["waiting"] < 4:  # all four are held at admission, none failed
        assert time.monotonic() < deadline and not errors, errors
        time.sleep(0.02)
    code, body = http(
        proxy.url + "/rollbook/admin/load_weights", "POST", {"path": str(weights), "version": 1, "publish": True}, key=ADMIN
    )
    assert code == 200, body
    assert body["version"] == 1
    assert http(proxy.url + "/rollbook/admin/resume", "POST", {}, key=ADMIN)[0] == 200
    for t in in_flight + waiting:
        t.join(120)
    assert not errors, errors
    for i in range(4):  # waited, then served entirely by the new weights
        assert set(results[f"wait-{i}"]["versions"]) == {1}
    for i in range(2):  # in flight: versions as served, non-decreasing (the split depends on timing)
        versions = results[f"long-{i}"]["versions"]
        assert versions == sorted(versions) and set(versions) <= {0, 1}
    assert set(results["warm-up"]["versions"]) == {0}
    wait_idle(proxy)
    ids = ", ".join(f"'{r['session_id']}'" for r in results.values())
    stored = {
        r["session_id"]: r["output_versions"]
        for r in sql(store, f"SELECT session_id, output_versions FROM trajectories WHERE session_id IN ({ids})")
    }
    assert stored == {r["session_id"]: r["versions"] for r in results.values()}
    assert not sql(store, "SELECT * FROM rejections")


# ---- keys, sessions, and 1,000 malformed requests -----------------------------------------------


def is_openai_error(body) -> bool:
    return (
        isinstance(body, dict)
        and set(body) == {"error"}
        and isinstance(body["error"].get("message"), str)
        and isinstance(body["error"].get("type"), str)
        and "code" in body["error"]
        and "param" in body["error"]
    )


def test_control_calls_need_the_admin_key_and_a_session_key_touches_only_its_own_session(store, proxy):
    import openai

    a_id, a_key = start_session(proxy, task_id="a", group_id="ga", group_size=1)
    b_id, b_key = start_session(proxy, task_id="b", group_id="gb", group_size=1)
    for path, method in [
        ("/rollbook/admin/version", "GET"),
        ("/rollbook/admin/pause", "POST"),
        ("/rollbook/admin/resume", "POST"),
        ("/rollbook/admin/load_weights", "POST"),
        ("/rollbook/admin/register_model", "POST"),
    ]:
        for key in (None, "wrong-key-wrong-key-wrong", a_key, WORKER):
            code, body = http(proxy.url + path, method, {} if method == "POST" else None, key=key)
            assert code == 401 and is_openai_error(body), (path, key, code, body)
    assert status(proxy)["paused"] is False  # no refused pause took effect
    for key in (None, "wrong-key-wrong-key-wrong", a_key):
        code, body = http(proxy.url + "/rollbook/sessions", "POST", {"task_id": "x"}, key=key)
        assert code == 401 and is_openai_error(body)
    code, body = http(proxy.url + "/rollbook/admin/register_model", "POST", {}, key=ADMIN)  # idempotent at the store
    assert code == 200, body

    b_client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=b_key, max_retries=0)
    b_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "1+1="}], max_tokens=3)
    for path, body in [
        (f"/rollbook/sessions/{b_id}/reward", {"reward": 1.0}),
        (f"/rollbook/sessions/{b_id}/end", {}),
        (f"/rollbook/sessions/{b_id}", None),
    ]:
        code, answer = http(proxy.url + path, "POST" if body is not None else "GET", body, key=a_key)
        assert code == 404 and is_openai_error(answer) and answer["error"]["code"] == "session_not_found", (path, code, answer)
    summary = http(proxy.url + f"/rollbook/sessions/{b_id}", key=b_key)[1]
    assert summary["ended"] is False and len(summary["calls"]) == 1  # A could neither end nor reward B
    assert http(proxy.url + f"/rollbook/sessions/{b_id}", key=ADMIN)[0] == 200  # the admin key sees every session
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=proxy.url + "/v1", api_key="rbs-not-a-session", max_retries=0).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "1+1="}]
        )
    assert http(proxy.url + f"/rollbook/sessions/{b_id}/end", "POST", {}, key=b_key)[0] == 200
    wait_idle(proxy)
    assert sql(store, "SELECT count(*) AS n FROM rewards")[0]["n"] == 0
    assert [r["session_id"] for r in sql(store, "SELECT session_id FROM trajectories")] == [b_id]


def malformed_requests(key: str, session_id: str) -> list[tuple[str, str, bytes, dict, set[int]]]:
    """(path, method, body, headers, acceptable statuses): bad JSON, wrong types, huge bodies,
    unknown models, bad keys, bad URLs."""
    chat = "/v1/chat/completions"
    ok_msg = [{"role": "user", "content": "1+1="}]
    auth = {"authorization": f"Bearer {key}"}
    cases: list[tuple[str, str, bytes, dict, set[int]]] = []
    bad_json = [
        b"{",
        b"{'model': 1}",
        b"\xff\xfe\x00",
        b'{"model": "tiny", "messages": [',
        b"[" * 100_000 + b"]" * 100_000,
        b"nul",
        b'{"a": NaN',
        b'"just a string"',
        b"[1, 2, 3]",
        b"12",
        b"",
    ]
    for raw in bad_json:
        cases.append((chat, "POST", raw, auth, {400}))
    wrong = [
        {"model": MODEL},
        {"model": MODEL, "messages": "hi"},
        {"model": MODEL, "messages": []},
        {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
        {"model": MODEL, "messages": [{"content": "x"}]},
        {"model": MODEL, "messages": ok_msg, "temperature": "hot"},
        {"model": MODEL, "messages": ok_msg, "temperature": -1},
        {"model": MODEL, "messages": ok_msg, "temperature": 1e999},
        {"model": MODEL, "messages": ok_msg, "top_p": 0},
        {"model": MODEL, "messages": ok_msg, "top_p": 7},
        {"model": MODEL, "messages": ok_msg, "n": 0},
        {"model": MODEL, "messages": ok_msg, "n": 10_000},
        {"model": MODEL, "messages": ok_msg, "max_tokens": 0},
        {"model": MODEL, "messages": ok_msg, "max_tokens": 10**12},
        {"model": MODEL, "messages": ok_msg, "max_tokens": "many"},
        {"model": MODEL, "messages": ok_msg, "stop": ["ab"]},
        {"model": MODEL, "messages": ok_msg, "stop": 5},
        {"model": MODEL, "messages": [{"role": "user", "content": "UPPER CASE"}]},
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
        {"model": MODEL, "messages": [{"role": "user", "content": "1" * 5000}]},
        {"model": MODEL, "messages": ok_msg, "stream": "yes"},
        {"model": MODEL, "messages": ok_msg, "logprobs": True, "top_logprobs": 21},
        {"model": MODEL, "messages": ok_msg, "top_logprobs": 5},  # without logprobs: true
        {"model": MODEL, "messages": ok_msg, "seed": "7"},
        {"model": MODEL, "messages": ok_msg, "frequency_penalty": 0.5},
        {"model": MODEL, "messages": ok_msg, "tools": [{"type": "function", "function": {"name": "f"}}]},  # no tool format
        {"model": [MODEL], "messages": ok_msg},
    ]
    for body in wrong:
        cases.append((chat, "POST", json.dumps(body).encode(), auth, {400}))
    for body in [
        {"model": MODEL, "prompt": 5},
        {"model": MODEL, "prompt": [-1]},
        {"model": MODEL, "prompt": [10**9]},
        {"model": MODEL, "prompt": []},
        {"model": MODEL, "prompt": "1+1=", "echo": True},
        {"model": MODEL, "prompt": ["a", "b"]},
    ]:
        cases.append(("/v1/completions", "POST", json.dumps(body).encode(), auth, {400}))
    for model in ("gpt-4o", "", "tiny ", "../tiny"):
        cases.append((chat, "POST", json.dumps({"model": model, "messages": ok_msg}).encode(), auth, {404}))
    huge = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "1" * (2 << 20)}]}).encode()
    cases.append((chat, "POST", huge, auth, {413}))
    cases.append((chat, "POST", b'{"model": "tiny", "messages": []}' + b" " * (2 << 20), auth, {413}))
    for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "Basic abc"}, {"authorization": "Bearer "}):
        cases.append((chat, "POST", json.dumps({"model": MODEL, "messages": ok_msg}).encode(), headers, {401}))
    cases += [
        ("/v2/chat", "POST", b"{}", auth, {404}),
        (chat, "GET", b"", auth, {405}),
        ("/v1/completions", "PUT", b"{}", auth, {405}),
        (f"/rollbook/sessions/{session_id}/reward", "POST", b'{"reward": "NaN"}', auth, {400}),
        (f"/rollbook/sessions/{session_id}/reward", "POST", b'{"reward": NaN}', auth, {400}),
        (f"/rollbook/sessions/{session_id}/reward", "POST", b'{"reward": 1, "call": 99}', auth, {404}),
        (f"/rollbook/sessions/{session_id}/reward", "POST", b'{"reward": 1, "extra": 1}', auth, {400}),
        ("/rollbook/sessions/s-nope/end", "POST", b"{}", auth, {404}),
        ("/rollbook/sessions", "POST", b'{"group_size": "x"}', {"authorization": f"Bearer {WORKER}"}, {400}),
        ("/rollbook/sessions", "POST", b'{"group_size": 0}', {"authorization": f"Bearer {WORKER}"}, {400}),
        (
            "/rollbook/admin/load_weights",
            "POST",
            b'{"path": "/nonexistent", "version": 5}',
            {"authorization": f"Bearer {ADMIN}"},
            {400},
        ),
        ("/rollbook/admin/load_weights", "POST", b'{"path": 3}', {"authorization": f"Bearer {ADMIN}"}, {400}),
    ]
    return cases


@pytest.mark.slow  # about a quarter of a minute on two loaded cores
def test_three_hundred_malformed_requests_each_get_an_openai_error_and_the_proxy_stays_up(store, proxy):
    """Every malformed case once, then random ones again (huge bodies among them) on one connection."""
    import http.client
    import random
    import urllib.parse

    import openai

    session_id, key = start_session(proxy, task_id="fuzz")
    cases = malformed_requests(key, session_id)
    assert len(cases) < 300  # each case is sent at least once
    rng = random.Random(0)
    parsed = urllib.parse.urlsplit(proxy.url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=60)
    huge_sent = 0
    for i in range(300):
        path, method, body, headers, expected = cases[i] if i < len(cases) else rng.choice(cases)
        huge_sent += len(body) > 1 << 20
        try:
            conn.request(method, path, body=body, headers={"content-type": "application/json", **headers})
            response = conn.getresponse()
            status_code, raw = response.status, response.read()
        except (ConnectionError, http.client.HTTPException):  # the server may close after a refused huge body
            conn.close()
            conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=60)
            conn.request(method, path, body=body, headers={"content-type": "application/json", **headers})
            response = conn.getresponse()
            status_code, raw = response.status, response.read()
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = None
        assert status_code in expected and is_openai_error(answer), (i, path, body[:120], status_code, raw[:300])
    assert huge_sent >= 2 and proxy.alive
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=key, max_retries=0)
    completion = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "1+1="}], max_tokens=3)
    assert completion.choices[0].finish_reason in ("stop", "length")
    assert status(proxy)["errors"] == 0


def test_the_proxy_serves_only_the_trainer_s_versions_from_a_weight_channel(store, tmp_path):
    """``--weights shm:NAME``: nothing is served before the first version arrives (the built weights
    never are), then each newer version is installed and carried by later calls."""
    import secrets

    import openai

    from rollbook.config import ModelConfig
    from rollbook.language_models import build_student
    from rollbook.weights.shm import SharedMemoryPublisher

    name = f"rollbook-proxy-test-{secrets.token_hex(4)}"
    proxy = ProxyProcess(
        store.address, tmp_path, "--weights", f"shm:{name}", "--weights_poll_s", "0.1", "--admission_wait_s", "1"
    )
    publisher = None
    try:
        session_id, key = start_session(proxy, task_id="w")
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=key, max_retries=0)
        ask = lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "2+2="}], max_tokens=3)
        assert status(proxy)["waiting_for_weights"] is True
        with pytest.raises(openai.APIStatusError) as held:  # no weights yet: held, then 503 after admission_wait_s
            ask()
        assert held.value.status_code == 503
        trained = build_student(ModelConfig(seed=3)).state_dict()
        publisher = SharedMemoryPublisher(name, trained)
        publisher.publish(0, trained)
        deadline = time.monotonic() + 60
        while status(proxy)["version"] != 0:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert set(ask().model_extra["rollbook"]["output_versions"][0]) == {0}
        with store.client() as admin:
            admin.publish_version(MODEL, 1)
        publisher.publish(1, build_student(ModelConfig(seed=4)).state_dict())
        while status(proxy)["version"] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert set(ask().model_extra["rollbook"]["output_versions"][0]) == {1}
        assert http(proxy.url + f"/rollbook/sessions/{session_id}/end", "POST", {}, key=key)[0] == 200
        wait_idle(proxy)
        assert sorted(r["v"] for r in sql(store, "SELECT max_version AS v FROM trajectories")) == [0, 1]
    finally:
        proxy.stop()
        if publisher is not None:
            publisher.close()
    assert "Traceback" not in proxy.log(), proxy.log()[-3000:]


def test_sampling_fields_of_both_endpoints_are_served_and_recorded_as_sent(store, proxy):
    """n, temperature, top_p, top_k, max_tokens, stop and logprobs through the official client, on
    /v1/chat/completions and /v1/completions, streaming and not: what the caller got is what is stored."""
    import openai

    render = CharRenderer()
    session_id, key = start_session(proxy, task_id="fields")
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key=key, max_retries=0)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "7+8="}],
        n=2,
        temperature=0.7,
        top_p=0.9,
        max_tokens=5,
        stop=["."],
        logprobs=True,
        extra_body={"top_k": 20},
    )
    assert len(chat.choices) == 2 and chat.usage.completion_tokens == sum(len(c.logprobs.content) for c in chat.choices)
    text = client.completions.create(model=MODEL, prompt="rev:abc=", temperature=0.0, max_tokens=4, logprobs=0)
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(model=MODEL, prompt="9+9=", max_tokens=4, stream=True) if c.choices
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "1+1="}],
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert http(proxy.url + f"/rollbook/sessions/{session_id}/end", "POST", {}, key=key)[0] == 200
    wait_idle(proxy)
    rows = {r["request_id"]: r for r in sql(store, f"SELECT * FROM trajectories WHERE session_id = '{session_id}'")}
    assert sorted(rows) == ["turn-0.0", "turn-0.1", "turn-1.0", "turn-2.0", "turn-3.0"]
    for i, choice in enumerate(chat.choices):
        row = rows[f"turn-0.{i}"]
        assert (row["temperature"], row["top_p"], row["top_k"]) == (pytest.approx(0.7), pytest.approx(0.9), 20)
        assert row["group_id"] == "" and len(row["output_token_ids"]) <= 5
        assert [t.logprob for t in choice.logprobs.content] == pytest.approx(row["output_logprobs"], abs=1e-6)
        assert render.decode(row["output_token_ids"]) == choice.message.content
        stops = {TOKENIZER.eos_token_id, *TOKENIZER.encode(".")}
        assert not stops & set(row["output_token_ids"][:-1])  # a stop token ends the output
        assert (row["finish_reason"] == "stop") == (row["output_token_ids"][-1] in stops)
    greedy = rows["turn-1.0"]
    assert greedy["prompt_token_ids"] == TOKENIZER.encode("rev:abc=", add_bos=True) and greedy["temperature"] == 0.0
    assert text.choices[0].logprobs.token_logprobs == pytest.approx(greedy["output_logprobs"], abs=1e-6)
    assert render.decode(greedy["output_token_ids"]) == text.choices[0].text
    assert render.decode(rows["turn-2.0"]["output_token_ids"]) == streamed
    assert render.decode(rows["turn-3.0"]["output_token_ids"]) == "".join(
        c.choices[0].delta.content or "" for c in chunks if c.choices
    )
