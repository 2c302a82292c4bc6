"""The proxy's policies without processes: chat rendering, which attempts are one logical call,
where a reward goes, the trajectories an attempt becomes, and admission (rollout/proxy/).

Run: python -m pytest tests/unit/rollout/test_proxy.py -q
"""

from __future__ import annotations

import asyncio

import pytest

from rollbook.rollout.engine import GenerationResult
from rollbook.rollout.proxy.admission import Gate
from rollbook.rollout.proxy.render import CharRenderer, RenderError
from rollbook.rollout.proxy.schemas import ApiError
from rollbook.rollout.proxy.sessions import SessionError, Sessions, reward_targets
from rollbook.tasks import TOKENIZER

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "1+2="}]}


def result(n: int = 3, version: int = 0) -> GenerationResult:
    return GenerationResult(
        request_id="r",
        prompt_token_ids=[1, 4, 5],
        output_token_ids=[5] * n,
        output_logprobs=[-0.5] * n,
        output_versions=[version] * n,
        finish_reason="length",
        temperature=1.0,
        top_p=1.0,
        top_k=0,
    )


def test_a_one_message_chat_renders_as_the_task_prompt_and_assistant_turns_end_with_eos():
    render = CharRenderer()
    assert render.chat_prompt([("user", "12+34=")]) == TOKENIZER.encode("12+34=", add_bos=True)
    assert render.chat_prompt([("user", "1="), ("assistant", "2"), ("user", "ok")]) == (
        TOKENIZER.encode("1=", add_bos=True) + TOKENIZER.encode("2", add_eos=True) + TOKENIZER.encode("ok")
    )
    with pytest.raises(RenderError, match=r"messages\[0\].content"):
        render.chat_prompt([("user", "Hello")])
    assert render.stop_token_ids(["."]) == TOKENIZER.encode(".")
    with pytest.raises(RenderError, match="one token"):
        render.stop_token_ids(["ab"])


def test_retries_join_their_call_and_a_new_request_opens_a_new_turn():
    sessions = Sessions(model_id="tiny", worker_id="w", max_sessions=10, ended_ttl_s=60)
    session, key = sessions.start(task_id="t", domain="d", group_id="g", group_size=2)
    assert sessions.authenticate(key) is session and sessions.authenticate(key + "x") is None
    call0, a0 = session.begin_attempt(BODY, None, 0, now=1.0)
    call0b, a1 = session.begin_attempt(dict(BODY), None, 1, now=2.0)  # the SDK's retry of the same body
    assert call0b is call0 and (a0.number, a1.number) == (0, 1)
    call1, _ = session.begin_attempt(BODY, None, 0, now=3.0)  # not a retry: the agent asked again
    assert call1.turn == 1
    other = {**BODY, "temperature": 0.5}
    call2, _ = session.begin_attempt(other, None, 2, now=4.0)  # a retry of nothing seen: a new call
    assert call2.turn == 2
    k1, _ = session.begin_attempt(other, "idem-1", 0, now=5.0)
    k2, b = session.begin_attempt({"anything": 1}, "idem-1", 0, now=6.0)  # Idempotency-Key decides alone
    assert k1 is k2 and k1.turn == 3 and b.number == 1


def test_trajectories_carry_the_turn_the_attempt_and_whether_it_was_delivered():
    sessions = Sessions(model_id="tiny", worker_id="w", max_sessions=10, ended_ttl_s=60)
    session, _ = sessions.start(task_id="t", domain="d", group_id="g", group_size=2)
    call, a0 = session.begin_attempt(BODY, None, 0, now=1.0)
    _, a1 = session.begin_attempt(BODY, None, 1, now=2.0)
    [lost] = sessions.trajectories(session, call, a0, [result()], delivered=False)
    [kept] = sessions.trajectories(session, call, a1, [result()], delivered=True)
    assert (lost["request_id"], lost["attempt"], lost["consumed"]) == ("turn-0.0", 0, False)
    assert (kept["request_id"], kept["attempt"], kept["consumed"]) == ("turn-0.0", 1, True)
    assert kept["trajectory_id"] == f"{session.session_id}/turn-0.0/a1"
    assert (kept["group_id"], kept["group_size"], kept["created_at"]) == ("g/turn-0", 2, 2.0)
    assert call.delivered is a1


def test_rewards_go_to_the_delivered_attempt_of_the_chosen_calls():
    sessions = Sessions(model_id="tiny", worker_id="w", max_sessions=10, ended_ttl_s=60)
    session, _ = sessions.start(task_id="t", domain="d", group_id="", group_size=1)
    with pytest.raises(SessionError) as nothing:
        reward_targets(session, "last")
    assert nothing.value.status == 409
    c0, a0 = session.begin_attempt(BODY, None, 0, now=1.0)
    sessions.trajectories(session, c0, a0, [result()], delivered=True)
    c1, b0 = session.begin_attempt({**BODY, "n": 1}, None, 0, now=2.0)
    _, b1 = session.begin_attempt({**BODY, "n": 1}, None, 1, now=3.0)
    sessions.trajectories(session, c1, b0, [result()], delivered=False)
    sessions.trajectories(session, c1, b1, [result()], delivered=True)
    assert [(c.turn, a.number) for c, a in reward_targets(session, "last")] == [(1, 1)]
    assert [(c.turn, a.number) for c, a in reward_targets(session, "all")] == [(0, 0), (1, 1)]
    assert [(c.turn, a.number) for c, a in reward_targets(session, 0)] == [(0, 0)]
    assert [(c.turn, a.number) for c, a in reward_targets(session, b0.completion_id)] == [(1, 1)]  # by any attempt's id
    with pytest.raises(SessionError) as unknown:
        reward_targets(session, "chatcmpl-nope")
    assert unknown.value.status == 404


def test_the_gate_holds_completions_while_paused_and_refuses_beyond_its_bounds():
    async def scenario():
        gate = Gate(max_concurrent=1, max_waiting=1, wait_s=0.2)
        await gate.pause("loading weights")
        with pytest.raises(ApiError) as held:
            await gate.admit()
        assert held.value.status == 503 and "loading weights" in held.value.message
        await gate.resume("loading weights")
        await gate.admit()  # running 1
        waiter = asyncio.create_task(gate.admit())  # waiting 1
        await asyncio.sleep(0.01)
        with pytest.raises(ApiError) as full:
            await gate.admit()
        assert full.value.status == 429
        await gate.release()
        await waiter
        assert (gate.running, gate.waiting) == (1, 0)

    asyncio.run(scenario())


def test_the_proxy_command_refuses_an_open_non_loopback_bind_and_a_bad_channel_in_one_line(monkeypatch, capsys):
    from rollbook.cli.main import main

    for role in ("ADMIN", "WORKER"):
        monkeypatch.delenv(f"ROLLBOOK_{role}_KEY", raising=False)
    assert main(["proxy", "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rollbook proxy: error: host 0.0.0.0 is not loopback") and "\n" not in err
    assert main(["proxy", "--weights", "ftp:somewhere"]) == 2
    assert "shm:NAME" in capsys.readouterr().err


class _FakeEngine:
    version = 0

    def generate(self, requests, *, seed=None):
        return [result(2) for _ in requests]


class _FakeStore:
    def __init__(self):
        self.submitted: list[dict] = []

    def submit(self, trajectories):
        from rollbook.client import SubmitResult
        from rollbook.v1 import rollbook_pb2 as pb

        out = SubmitResult()
        for t in trajectories:
            self.submitted.append(dict(t))
            out.add(pb.Verdict(trajectory_id=t["trajectory_id"], status=pb.Verdict.ACCEPTED))
        return out


def test_a_delivered_attempt_whose_call_is_retried_is_submitted_unconsumed_and_the_rest_once_the_agent_moves_on():
    """The race a timeout leaves: the response was written, but the client had already given up and
    retries. The proxy holds a delivered attempt until the session shows it was read (next call,
    reward, end, or consume_settle_s); a retry of its call first means it was not."""
    from rollbook.config import ProxyConfig
    from rollbook.rollout.proxy.core import Proxy

    async def scenario(store: _FakeStore) -> Proxy:
        proxy = Proxy(ProxyConfig(), _FakeEngine(), store, admin_key=None, worker_key=None)
        session, key = proxy.sessions.start(task_id="t", domain="d", group_id="", group_size=1)
        headers = {"authorization": f"Bearer {key}"}
        _, deliver, _ = await proxy.complete("chat", headers, BODY)
        deliver(True)  # written to an open connection, but the client's timer had fired
        assert proxy.status()["held"] == 1 and not store.submitted
        _, deliver, _ = await proxy.complete("chat", {**headers, "x-stainless-retry-count": "1"}, BODY)
        deliver(True)  # the retry, read by the client
        _, deliver, _ = await proxy.complete("chat", headers, {**BODY, "n": 1})  # the agent moved on
        deliver(True)
        await proxy.end(session)
        proxy.submitter.close()
        return proxy

    store = _FakeStore()
    proxy = asyncio.run(scenario(store))
    got = {t["trajectory_id"].split("/", 1)[1]: t["consumed"] for t in store.submitted}
    assert got == {"turn-0.0/a0": False, "turn-0.0/a1": True, "turn-1.0/a0": True}
    assert proxy.counters["retracted"] == 1
    proxy.close()


def _app_client():
    from fastapi.testclient import TestClient

    from rollbook.config import ProxyConfig
    from rollbook.rollout.proxy.app import create_app
    from rollbook.rollout.proxy.core import Proxy

    proxy = Proxy(ProxyConfig(), _FakeEngine(), _FakeStore(), admin_key=None, worker_key=None)
    return proxy, TestClient(create_app(proxy))


def test_a_wrong_method_is_an_invalid_request_error_not_a_server_error():
    proxy, client = _app_client()
    with client:
        answer = client.get("/v1/chat/completions")
    proxy.close()
    assert answer.status_code == 405
    assert answer.json()["error"]["type"] == "invalid_request_error"
    assert answer.json()["error"]["code"] == "method_not_allowed"


def test_load_weights_of_a_corrupt_or_foreign_file_is_a_400_invalid_weights_without_a_traceback(tmp_path, caplog):
    import torch

    (tmp_path / "cut.pt").write_bytes(b"PK\x03\x04 not really a zip")
    (tmp_path / "noise.pt").write_bytes(b"\x80\x02noise, not a pickle")
    (tmp_path / "cut.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    torch.save([torch.zeros(2)], tmp_path / "list.pt")
    proxy, client = _app_client()
    with client:
        answers = {
            name: client.post("/rollbook/admin/load_weights", json={"path": str(tmp_path / name), "version": 1})
            for name in ("cut.pt", "noise.pt", "cut.safetensors", "list.pt", "missing.pt")
        }
    proxy.close()
    for name, answer in answers.items():
        assert answer.status_code == 400, (name, answer.text)
        error = answer.json()["error"]
        assert error["code"] == "invalid_weights" and error["type"] == "invalid_request_error", (name, error)
        assert name in error["message"], (name, error)
    assert "not a state dict" in answers["list.pt"].json()["error"]["message"]
    assert not [r for r in caplog.records if r.exc_info], "a refused file is not a bug: no traceback in the log"


def test_an_idle_session_expires_its_delivered_call_is_stored_and_late_calls_and_rewards_are_refused():
    from rollbook.config import ProxyConfig
    from rollbook.rollout.proxy.core import Proxy

    store = _FakeStore()

    async def scenario():
        proxy = Proxy(ProxyConfig(idle_session_ttl_s=30), _FakeEngine(), store, admin_key=None, worker_key=None)
        session, key = proxy.sessions.start(task_id="t", domain="d", group_id="", group_size=1)
        busy, _ = proxy.sessions.start(task_id="t", domain="d", group_id="", group_size=1)
        headers = {"authorization": f"Bearer {key}"}
        _, deliver, _ = await proxy.complete("chat", headers, BODY)
        deliver(True)  # held: the agent never comes back
        assert proxy.expire_idle() == [] and not store.submitted  # not idle yet
        session.last_active -= 31
        assert proxy.expire_idle() == [session]
        assert session.expired and busy.ended_at is None  # the other session was active
        with pytest.raises(ApiError) as late_call:
            await proxy.complete("chat", headers, BODY)
        with pytest.raises(ApiError) as late_reward:
            await proxy.reward(session, "last", 1.0)
        proxy.submitter.close()
        proxy.close()
        return session, late_call.value, late_reward.value

    session, late_call, late_reward = asyncio.run(scenario())
    assert [t["consumed"] for t in store.submitted] == [True]  # what it delivered is stored, as read
    assert (late_call.status, late_call.code) == (409, "session_expired") and "completions" in late_call.message
    assert (late_reward.status, late_reward.code) == (409, "session_expired") and "rewards" in late_reward.message
    assert session.summary()["expired"] is True


def test_a_call_refused_as_overloaded_uses_up_no_turn():
    from rollbook.config import ProxyConfig
    from rollbook.rollout.proxy.core import Proxy

    async def scenario():
        proxy = Proxy(ProxyConfig(max_concurrent=1, max_waiting=0), _FakeEngine(), _FakeStore(), admin_key=None, worker_key=None)
        session, key = proxy.sessions.start(task_id="t", domain="d", group_id="", group_size=1)
        headers = {"authorization": f"Bearer {key}"}
        await proxy.gate.admit()  # another completion holds the only slot
        with pytest.raises(ApiError) as refused:
            await proxy.complete("chat", headers, BODY)
        await proxy.gate.release()
        payload, deliver, _ = await proxy.complete("chat", headers, BODY)
        deliver(True)
        proxy.submitter.close()
        proxy.close()
        return refused.value, payload, session

    refused, payload, session = asyncio.run(scenario())
    assert refused.status == 429
    assert payload["rollbook"]["turn"] == 0 and [c["turn"] for c in session.summary()["calls"]] == [0]


def test_an_ended_session_s_409_tells_the_sdk_not_to_retry():
    proxy, client = _app_client()
    with client:
        started = client.post("/rollbook/sessions", json={"task_id": "t"}).json()
        auth = {"authorization": f"Bearer {started['api_key']}"}
        client.post(f"/rollbook/sessions/{started['session_id']}/end", headers=auth)
        answer = client.post("/v1/chat/completions", json=BODY, headers=auth)
    proxy.close()
    assert answer.status_code == 409 and answer.json()["error"]["code"] == "session_ended"
    assert answer.headers["x-should-retry"] == "false"


def test_the_engine_of_a_small_model_decodes_on_one_torch_thread_unless_configured():
    from rollbook.config import ModelConfig
    from rollbook.language_models import build_student
    from rollbook.rollout.engine import NativeEngine
    from rollbook.rollout.proxy.server import SMALL_MODEL_PARAMETERS, torch_threads

    assert torch_threads(None, SMALL_MODEL_PARAMETERS - 1, 8) == 1
    assert torch_threads(None, SMALL_MODEL_PARAMETERS, 8) == 4 and torch_threads(None, SMALL_MODEL_PARAMETERS, 2) == 2
    assert torch_threads(None, None, 2) == 2  # an engine that does not say (vLLM)
    assert torch_threads(3, 100, 8) == 3
    engine = NativeEngine(build_student(ModelConfig()), version=0)
    assert engine.num_parameters == sum(p.numel() for p in build_student(ModelConfig()).parameters()) < SMALL_MODEL_PARAMETERS
    engine.close()


class _SlowEngine(_FakeEngine):
    def generate(self, requests, *, seed=None):
        import time

        time.sleep(0.6)
        return super().generate(requests, seed=seed)


def test_under_uvicorn_a_caller_that_left_before_its_answer_is_seen_from_the_cycles_flag(monkeypatch):
    """The answer's delivery comes from uvicorn's own disconnect flag (not Starlette's cancel-scope
    poll): a caller that closed its connection while generating gets an undelivered attempt, one that
    waited a delivered one."""
    import json
    import socket
    import time
    import urllib.parse

    from rollbook.config import ProxyConfig
    from rollbook.rollout.proxy import app as app_module
    from rollbook.rollout.proxy.core import Proxy
    from rollbook.rollout.proxy.server import ProxyServer

    checks: list[bool] = []
    original = app_module.disconnect_check

    def recording(request):
        check = original(request)
        checks.append(getattr(check, "__self__", None) is request)  # True: Starlette's own method
        return check

    monkeypatch.setattr(app_module, "disconnect_check", recording)
    proxy = Proxy(ProxyConfig(), _SlowEngine(), _FakeStore(), admin_key=None, worker_key=None)
    server = ProxyServer(proxy).start()
    try:
        session, key = proxy.sessions.start(task_id="t", domain="d", group_id="", group_size=1)
        url = urllib.parse.urlparse(server.url)
        body = json.dumps(BODY).encode()
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {key}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
        ).encode()

        def call(wait: bool) -> bytes:
            with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
                sock.sendall(head + body)
                if not wait:
                    time.sleep(0.1)
                    return b""
                return sock.recv(65536)

        assert call(wait=False) == b""
        assert call(wait=True).startswith(b"HTTP/1.1 200")
        deadline = time.monotonic() + 10
        while len(session.calls) < 2 or any(a.delivered is None for c in session.calls for a in c.attempts):
            assert time.monotonic() < deadline, "the calls were not recorded"
            time.sleep(0.02)
        assert [a.delivered for c in session.calls for a in c.attempts] == [False, True]
        assert checks == [False, False]
    finally:
        server.stop()


def _trajectory(i: int) -> dict:
    return {"trajectory_id": f"s/turn-{i}.0/a0"}


def test_the_submit_queue_lingers_for_a_batch_but_sends_at_once_when_hurried_full_or_closed():
    """A batch waits ``linger_s`` for more completions (one Submit for all of them), unless a reward
    or an end waits for its verdicts (``hurry``), the queue holds a whole batch, or the queue closes."""
    import concurrent.futures

    from rollbook.rollout.proxy.sessions import SubmitQueue

    store = _FakeStore()
    queue = SubmitQueue(store, batch_size=3, linger_s=600.0)  # a linger no test outwaits
    try:
        first = queue.put([_trajectory(0)]) + queue.put([_trajectory(1)])
        with pytest.raises(concurrent.futures.TimeoutError):
            first[0].result(timeout=0.3)  # lingering for a third
        queue.hurry()
        assert [f.result(timeout=30).status for f in first] == [1, 1]  # ACCEPTED, in one Submit
        assert [t["trajectory_id"] for t in store.submitted] == ["s/turn-0.0/a0", "s/turn-1.0/a0"]
        full = queue.put([_trajectory(2), _trajectory(3), _trajectory(4)])  # a whole batch: no linger
        assert all(f.result(timeout=30) is not None for f in full)
        last = queue.put([_trajectory(5)])
    finally:
        queue.close(timeout=30)  # sends what is queued without its linger
    assert last[0].result(timeout=0) is not None
    assert len(store.submitted) == 6


def test_a_reward_does_not_wait_out_the_submit_linger():
    from rollbook.config import ProxyConfig
    from rollbook.rollout.proxy.core import Proxy

    async def scenario(store: _FakeStore) -> dict:
        proxy = Proxy(ProxyConfig(submit_linger_s=600.0), _FakeEngine(), store, admin_key=None, worker_key=None)
        try:
            session, key = proxy.sessions.start(task_id="t", domain="d", group_id="", group_size=1)
            _, deliver, _ = await proxy.complete("chat", {"authorization": f"Bearer {key}"}, BODY)
            deliver(True)
            rewarded = await asyncio.wait_for(proxy.reward(session, "last", 1.0), timeout=60)
            await asyncio.wait_for(proxy.end(session), timeout=60)
            return rewarded
        finally:
            proxy.submitter.close(timeout=30)
            proxy.close()

    store = _FakeStore()
    store.set_reward = lambda value, trajectory_id: None  # type: ignore[attr-defined]
    rewarded = asyncio.run(scenario(store))
    assert [r["trajectory_id"].split("/", 1)[1] for r in rewarded["rewarded"]] == ["turn-0.0/a0"]
    assert len(store.submitted) == 1
