"""``rollbook proxy``: an OpenAI-compatible HTTP endpoint that records an agent's calls as trajectories.

    rollbook proxy --server 127.0.0.1:50551 --model_id tiny --port 8000     # prints 'listening on http://HOST:PORT'

An unchanged agent points its ``openai`` client at ``http://HOST:PORT/v1`` with a session key as its
API key. Every completion comes from a ``GenerationEngine`` (rollout/engine.py; vLLM where installed)
and is recorded, with its prompt and output token ids, behavior log-probs, per-token versions and
sampling parameters, as a trajectory of the calling session (rollout/proxy_sessions.py has the
session, retry and reward policies; rollout/proxy_render.py the tokenizer and chat rendering).
Endpoints, errors and the admin key: docs/online.md.

Control: the admin key is the store's (``ROLLBOOK_ADMIN_KEY``); starting a session takes the worker
key (``ROLLBOOK_WORKER_KEY``) or the admin key. With a key unset its endpoints are open, allowed on
loopback only, as for the store. The proxy reaches the store only through ``StoreClient``.
"""

# no `from __future__ import annotations`: FastAPI reads the handlers' annotations (Request is imported in create_app)
import asyncio
import concurrent.futures
import functools
import hmac
import json
import logging
import math
import pathlib
import threading
import time
from collections.abc import AsyncIterator, Collection, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from rollbook.models import ModelConfig
from rollbook.rollout.engine import GenerationEngine, GenerationRequest, GenerationResult
from rollbook.rollout.proxy_render import Renderer, RenderError, renderer
from rollbook.rollout.proxy_sessions import Session, SessionError, Sessions, SubmitQueue, reward_targets

log = logging.getLogger("rollbook.proxy")

LOOPBACK = ("127.0.0.1", "localhost", "::1")


class ProxyConfig(BaseModel):
    """Configuration of ``rollbook proxy``."""

    model_config = ConfigDict(extra="forbid")

    server: str = Field("127.0.0.1:50551", description="Store address HOST:PORT (keys from ROLLBOOK_*_KEY, docs/security.md).")
    host: str = Field(
        "127.0.0.1", description="HTTP bind address; a non-loopback one needs ROLLBOOK_ADMIN_KEY and ROLLBOOK_WORKER_KEY."
    )
    port: int = Field(
        8000, ge=0, le=65535, description="HTTP port; 0 = any free one (printed as 'listening on http://HOST:PORT')."
    )
    model_id: str = Field("tiny", description="The model name clients ask for and the store records trajectories under.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="The served model's architecture (or local path).")
    engine: Literal["native", "vllm"] = Field(
        "native", description="native: the PyTorch engine (CPU or CUDA); vllm: VllmEngine on model.path (GPU, optional)."
    )
    checkpoint: str | None = Field(
        None,
        description="A state dict file (.safetensors or torch .pt) loaded into the model at start; None keeps the built weights.",
    )
    version: int = Field(0, ge=0, description="The policy version of the starting weights (without a weight channel).")
    weights: str | None = Field(
        None,
        description="Follow a trainer's weight channel: 'shm:NAME' (one host) or 'grpc:HOST:PORT'. "
        "Completions wait for its first version (the built weights are never served), and each newer "
        "version is installed as load_weights does.",
    )
    weights_poll_s: float = Field(0.5, gt=0, description="How often the weight channel is asked for a newer version.")
    seed: int = Field(0, description="Sampling seed of the engine.")
    max_batch_size: int = Field(64, ge=1, description="Engine batch size.")
    max_context_tokens: int = Field(
        512, ge=2, description="Prompt plus max_tokens may not exceed this (400 context_length_exceeded)."
    )
    default_max_tokens: int = Field(16, ge=1, description="max_tokens when a request gives none.")
    max_tokens_limit: int = Field(256, ge=1, description="The largest max_tokens a request may ask for.")
    max_n: int = Field(8, ge=1, description="The largest n (choices per request).")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="Larger request bodies are refused with 413.")
    max_concurrent: int = Field(32, ge=1, description="Completions generating at once (engine threads).")
    max_waiting: int = Field(
        256, ge=0, description="Completions waiting for admission beyond max_concurrent; more are refused with 429."
    )
    admission_wait_s: float = Field(
        60.0, gt=0, description="How long a completion waits while the engine is paused or loading weights before 503."
    )
    max_sessions: int = Field(100_000, ge=1, description="Sessions held at once (ended ones count until ended_session_ttl_s).")
    ended_session_ttl_s: float = Field(3600.0, gt=0, description="How long an ended session still takes rewards.")
    consume_settle_s: float = Field(
        60.0,
        gt=0,
        description="A delivered completion is submitted as consumed once the session "
        "moves on (its next call, a reward, the end) or after this long; a retry of its call "
        "before then shows it was not consumed (docs/online.md).",
    )
    submit_batch_size: int = Field(64, ge=1, description="Trajectories per Submit batch.")
    spool_dir: str | None = Field(
        None,
        description="A local directory for the durable spool: every completion is written "
        "there (fsync'd) before its first byte goes out and stays until the store answered it, so "
        "a proxy killed and restarted on the same directory submits what it had delivered, exactly "
        "once (docs/online.md). None: in memory only.",
    )
    spool_max_bytes: int = Field(256 << 20, ge=1 << 20, description="Bound of the spool; a full spool makes completions wait.")
    worker_id: str = Field("proxy", description="worker_id recorded on every trajectory.")

    @field_validator("weights")
    @classmethod
    def _channel(cls, v: str | None) -> str | None:
        if v is not None and not (v.startswith("shm:") or v.startswith("grpc:")):
            raise ValueError(f"must be 'shm:NAME' or 'grpc:HOST:PORT', got {v!r}")
        return v


# ---- OpenAI request bodies ------------------------------------------------------------------------


# strict: a JSON string is not a number or a boolean ("stream": "yes" is a 400, as at OpenAI)
class _Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self, index: int) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for j, part in enumerate(self.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RenderError(f"messages[{index}].content[{j}]: only text parts are supported", "messages")
            parts.append(part["text"])
        return "".join(parts)


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # OpenAI fields the proxy does not use (user, seed, ...) pass
    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None

    @field_validator("temperature", "top_p")
    @classmethod
    def _finite(cls, v: float | None) -> float | None:
        if v is not None and not math.isfinite(v):
            raise ValueError("must be finite")
        return v


class _ChatRequest(_Sampling):
    messages: list[_Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=0)


class _CompletionRequest(_Sampling):
    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=0)
    echo: bool = False

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v


class _StartSession(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    task_id: str = Field("", max_length=256)
    domain: str = Field("", max_length=256)
    group_id: str = Field("", max_length=200)
    group_size: int = Field(1, ge=1, le=65536)


class _Reward(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    reward: float
    call: str | int = "last"

    @field_validator("reward")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("must be finite")
        return v


class _LoadWeights(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    path: str
    version: int = Field(ge=0)
    publish: bool = False


class _RegisterModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model_id: str | None = None
    publish_version: bool = True


class ApiError(Exception):
    """An OpenAI-format error answer."""

    def __init__(self, status: int, message: str, *, code: str, param: str | None = None, type_: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.type = type_ or {
            400: "invalid_request_error",
            401: "authentication_error",
            403: "permission_error",
            404: "not_found_error",
            409: "invalid_request_error",
            413: "invalid_request_error",
            429: "rate_limit_error",
            503: "overloaded_error",
        }.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _validation_error(exc: ValidationError) -> ApiError:
    first = exc.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ()))
    message = str(first.get("msg", "invalid")).removeprefix("Value error, ")
    return ApiError(400, f"{loc}: {message}" if loc else message, code="invalid_value", param=loc or None)


# ---- admission ------------------------------------------------------------------------------------


class Gate:
    """Admission of completions to the engine: at most ``max_concurrent`` at once, ``max_waiting``
    waiting (more: 429); while paused (admin pause, a weight load) new ones wait up to ``wait_s``
    (then 503). In-flight completions are never stopped."""

    def __init__(self, max_concurrent: int, max_waiting: int, wait_s: float):
        self.max_concurrent, self.max_waiting, self.wait_s = max_concurrent, max_waiting, wait_s
        self.running = self.waiting = 0
        self.paused: set[str] = set()
        self._cond = asyncio.Condition()

    async def admit(self) -> None:
        async with self._cond:
            if self.running + self.waiting >= self.max_concurrent + self.max_waiting:
                raise ApiError(
                    429,
                    f"overloaded: {self.running} completions running and {self.waiting} waiting "
                    "(max_concurrent, max_waiting); retry later",
                    code="overloaded",
                )
            self.waiting += 1
            try:
                await asyncio.wait_for(
                    self._cond.wait_for(lambda: not self.paused and self.running < self.max_concurrent), self.wait_s
                )
            except TimeoutError:
                why = ", ".join(sorted(self.paused)) or "busy"
                raise ApiError(
                    503,
                    f"not admitted within {self.wait_s:g} s (admission_wait_s): engine {why}; retry later",
                    code="engine_unavailable",
                ) from None
            finally:
                self.waiting -= 1
            self.running += 1

    async def release(self) -> None:
        async with self._cond:
            self.running -= 1
            self._cond.notify_all()

    async def pause(self, reason: str) -> None:
        async with self._cond:
            self.paused.add(reason)

    async def resume(self, reason: str) -> None:
        async with self._cond:
            self.paused.discard(reason)
            self._cond.notify_all()


# ---- the proxy ------------------------------------------------------------------------------------


class Proxy:
    """The state behind the HTTP app: engine, sessions, submission, admission, keys."""

    def __init__(
        self,
        config: ProxyConfig,
        engine: GenerationEngine,
        client,
        *,
        admin_key: str | None,
        worker_key: str | None,
        render: Renderer | None = None,
    ):
        self.config, self.engine, self.client = config, engine, client
        self.render = render or renderer()
        self.admin_key, self.worker_key = admin_key, worker_key
        self.sessions = Sessions(
            model_id=config.model_id,
            worker_id=config.worker_id,
            max_sessions=config.max_sessions,
            ended_ttl_s=config.ended_session_ttl_s,
        )
        self.submitter = SubmitQueue(
            client, batch_size=config.submit_batch_size, spool_dir=config.spool_dir, spool_max_bytes=config.spool_max_bytes
        )
        self.gate = Gate(config.max_concurrent, config.max_waiting, config.admission_wait_s)
        self.pool = concurrent.futures.ThreadPoolExecutor(config.max_concurrent, thread_name_prefix="proxy-engine")
        self.control_pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="proxy-control")
        self.loading: int | None = None  # the version being loaded
        self._load_lock = asyncio.Lock()
        self.counters = {"completions": 0, "delivered": 0, "undelivered": 0, "errors": 0, "retracted": 0}
        self.held: dict[int, tuple[Session, Any]] = {}  # id(attempt) -> delivered attempts not yet submitted

    def close(self) -> None:
        self.submitter.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.control_pool.shutdown(wait=False, cancel_futures=True)

    # -- keys --

    @staticmethod
    def _bearer(headers) -> str | None:
        value = headers.get("authorization") or ""
        return value[7:].strip() if value[:7].lower() == "bearer " else None

    @staticmethod
    def _matches(given: str | None, key: str | None) -> bool:
        return given is not None and key is not None and hmac.compare_digest(given.encode("utf-8", "surrogatepass"), key.encode())

    def require_admin(self, headers) -> None:
        if self.admin_key is None:
            return
        given = self._bearer(headers)
        if given is None:
            raise ApiError(
                401, "control endpoints need the admin key: Authorization: Bearer <ROLLBOOK_ADMIN_KEY>", code="missing_key"
            )
        if not self._matches(given, self.admin_key):
            raise ApiError(401, "wrong admin key", code="invalid_api_key")

    def require_starter(self, headers) -> None:
        if self.admin_key is None and self.worker_key is None:
            return
        given = self._bearer(headers)
        if given is None:
            raise ApiError(
                401, "starting a session needs the worker or admin key: Authorization: Bearer <key>", code="missing_key"
            )
        if not (self._matches(given, self.worker_key) | self._matches(given, self.admin_key)):
            raise ApiError(401, "wrong key: starting a session needs the worker or admin key", code="invalid_api_key")

    def session_of_key(self, headers) -> Session:
        given = self._bearer(headers)
        if given is None:
            raise ApiError(
                401, "missing API key: pass the session key from POST /rollbook/sessions as the API key", code="missing_key"
            )
        session = self.sessions.authenticate(given)
        if session is None:
            raise ApiError(
                401,
                "unknown API key: not the key of a session of this proxy (start one: POST /rollbook/sessions)",
                code="invalid_api_key",
            )
        return session

    def session_for(self, headers, session_id: str) -> Session:
        """The session ``session_id`` when the caller holds its key or the admin key; a session key
        of another session gets 404, as an unknown session does (no way to probe which ids exist)."""
        given = self._bearer(headers)
        if self.admin_key is not None and self._matches(given, self.admin_key):
            session = self.sessions.get(session_id)
        else:
            own = self.session_of_key(headers)
            session = own if own.session_id == session_id else None
        if session is None:
            raise ApiError(404, f"no session {session_id!r} for this key", code="session_not_found", param="session_id")
        return session

    # -- completions --

    def _params(self, req: _Sampling, prompt_ids: list[int], max_tokens: int | None) -> tuple[list[GenerationRequest], list[int]]:
        if req.model != self.config.model_id:
            raise ApiError(
                404,
                f"model {req.model!r} is not served here (this proxy serves {self.config.model_id!r})",
                code="model_not_found",
                param="model",
            )
        if req.n > self.config.max_n:
            raise ApiError(400, f"n: at most {self.config.max_n} (max_n)", code="invalid_value", param="n")
        max_new = max_tokens or self.config.default_max_tokens
        if max_new > self.config.max_tokens_limit:
            raise ApiError(
                400,
                f"max_tokens: at most {self.config.max_tokens_limit} (max_tokens_limit)",
                code="invalid_value",
                param="max_tokens",
            )
        if len(prompt_ids) + max_new > self.config.max_context_tokens:
            raise ApiError(
                400,
                f"the prompt is {len(prompt_ids)} tokens and max_tokens {max_new}: more than the "
                f"{self.config.max_context_tokens}-token context (max_context_tokens)",
                code="context_length_exceeded",
                param="messages",
            )
        if max(prompt_ids, default=0) >= self.render.vocab_size or min(prompt_ids, default=0) < 0:
            raise ApiError(
                400, f"prompt: token ids must be in [0, {self.render.vocab_size})", code="invalid_value", param="prompt"
            )
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stops) > 4:
            raise ApiError(400, "stop: at most 4 sequences", code="invalid_value", param="stop")
        stop_ids = sorted({self.render.eos_token_id, *self.render.stop_token_ids(stops)})
        temperature = 1.0 if req.temperature is None else req.temperature
        top_p = 1.0 if req.top_p is None else req.top_p
        top_k = 0 if req.top_k is None else req.top_k
        requests = [
            GenerationRequest(
                prompt_token_ids=prompt_ids,
                max_new_tokens=max_new,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                stop_token_ids=stop_ids,
            )
            for _ in range(req.n)
        ]
        return requests, stop_ids

    async def complete(self, kind: Literal["chat", "text"], headers, body: Any) -> tuple[dict, Any, Any]:
        """Run one completion request: (the response payload, the ``deliver(delivered)`` callback that
        records the attempt once its delivery is known, the validated request)."""
        session = self.session_of_key(headers)
        if session.ended_at is not None:
            raise ApiError(409, f"session {session.session_id} has ended; start a new one", code="session_ended")
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
        try:
            if kind == "chat":
                chat = _ChatRequest.model_validate(body)
                prompt_ids = self.render.chat_prompt([(m.role, m.text(i)) for i, m in enumerate(chat.messages)])
                req: _Sampling = chat
                max_tokens = chat.max_completion_tokens or chat.max_tokens
            else:
                text = _CompletionRequest.model_validate(body)
                prompt_ids = self.render.text_prompt(text.prompt) if isinstance(text.prompt, str) else list(text.prompt)
                if not prompt_ids:
                    raise ApiError(400, "prompt: empty", code="invalid_value", param="prompt")
                req, max_tokens = text, text.max_tokens
        except ValidationError as exc:
            raise _validation_error(exc) from None
        except RenderError as exc:
            raise ApiError(400, str(exc), code="invalid_value", param=exc.param) from None
        try:
            requests, _ = self._params(req, prompt_ids, max_tokens)
        except RenderError as exc:
            raise ApiError(400, str(exc), code="invalid_value", param=exc.param) from None
        try:
            retry_count = int(headers.get("x-stainless-retry-count") or 0)
        except ValueError:
            retry_count = 0
        idem = headers.get("idempotency-key") or None
        call, attempt = session.begin_attempt(body, idem, retry_count, time.time())
        # the caller retried this call: its delivered attempts were not read; any other call: it moved on
        self.release(session, retracted=set(map(id, call.attempts[:-1])))
        await self.gate.admit()
        try:
            loop = asyncio.get_running_loop()
            results: list[GenerationResult] = await loop.run_in_executor(self.pool, self.engine.generate, requests)
        except Exception as exc:
            self.counters["errors"] += 1
            log.exception("generation failed")
            raise ApiError(500, f"generation failed: {type(exc).__name__}: {exc}", code="engine_error") from None
        finally:
            await self.gate.release()
        self.counters["completions"] += 1
        # durable (with spool_dir) before any byte of it goes out: a restarted proxy submits it as consumed
        hold = self.submitter.hold(self.sessions.trajectories(session, call, attempt, results, True, record=False))

        def deliver(delivered: bool) -> None:
            self.counters["delivered" if delivered else "undelivered"] += 1
            trajectories = self.sessions.trajectories(session, call, attempt, results, delivered)
            if delivered:  # held until the caller shows it read it (release)
                attempt.held, attempt.held_since, attempt.hold = trajectories, time.monotonic(), hold
                self.held[id(attempt)] = (session, attempt)
            else:
                attempt.verdicts = self.submitter.put(trajectories, unhold=hold)

        payload = (_chat_payload if kind == "chat" else _text_payload)(self, req, attempt.completion_id, results, call.turn)
        return payload, deliver, req

    # -- sessions, rewards --

    def release(self, session: Session | None, retracted: Collection[int] = (), older_than: float | None = None) -> None:
        """Submit held delivered attempts (of ``session``, or of every session older than
        ``older_than`` seconds): as consumed, except those in ``retracted`` (ids of attempts whose
        call was retried: the caller never read them)."""
        now = time.monotonic()
        for key, (owner, attempt) in list(self.held.items()):
            if session is not None and owner is not session:
                continue
            if older_than is not None and now - attempt.held_since < older_than:
                continue
            del self.held[key]
            trajectories, attempt.held = attempt.held, None
            consumed = key not in retracted
            if not consumed:
                self.counters["retracted"] += 1
                with owner.lock:
                    attempt.delivered = False
                for t in trajectories:
                    t["consumed"] = False
            attempt.verdicts = self.submitter.put(trajectories, unhold=attempt.hold)

    async def settle_held(self) -> None:
        """Submit delivered attempts held longer than ``consume_settle_s`` (a session that stopped
        without a reward or an end), as consumed."""
        while True:
            await asyncio.sleep(min(1.0, self.config.consume_settle_s / 4))
            self.release(None, older_than=self.config.consume_settle_s)

    async def reward(self, session: Session, which: str | int, value: float) -> dict:
        self.release(session)  # a reward means the caller has read its completions
        targets = reward_targets(session, which)
        loop = asyncio.get_running_loop()
        rewarded, skipped = [], []
        for call, attempt in targets:
            verdicts = await asyncio.gather(*(asyncio.wrap_future(f) for f in attempt.verdicts), return_exceptions=True)
            for tid, verdict in zip(attempt.trajectory_ids, verdicts):
                if isinstance(verdict, BaseException) or verdict is None or verdict.reason:
                    why = (
                        verdict.reason
                        if verdict is not None and not isinstance(verdict, BaseException)
                        else f"not stored: {verdict}"
                    )
                    skipped.append({"trajectory_id": tid, "turn": call.turn, "reason": why})
                    continue
                try:
                    await loop.run_in_executor(
                        self.control_pool, functools.partial(self.client.set_reward, value, trajectory_id=tid)
                    )
                except Exception as exc:
                    details = getattr(exc, "details", None)
                    skipped.append(
                        {
                            "trajectory_id": tid,
                            "turn": call.turn,
                            "reason": details() if callable(details) else f"{type(exc).__name__}: {exc}",
                        }
                    )
                    continue
                rewarded.append({"trajectory_id": tid, "turn": call.turn, "reward": value})
        return {"session_id": session.session_id, "rewarded": rewarded, "skipped": skipped}

    async def end(self, session: Session) -> dict:
        self.release(session)
        with session.lock:
            if session.ended_at is None:
                session.ended_at = time.time()
            futures = [f for c in session.calls for a in c.attempts for f in a.verdicts]
        await asyncio.gather(*(asyncio.wrap_future(f) for f in futures), return_exceptions=True)
        return session.summary()

    # -- control --

    async def install(self, weights: Any, version: int) -> None:
        """Install ``weights`` (a state dict, a file path, or a ``Weights`` callable) as ``version``
        with the gate closed: new completions wait, in-flight ones continue under the new weights
        from their next decode step."""
        async with self._load_lock:
            await self.gate.pause("loading weights")
            self.loading = version
            try:
                loop = asyncio.get_running_loop()
                if isinstance(weights, str):
                    weights = await loop.run_in_executor(self.control_pool, read_state_dict, weights)
                await loop.run_in_executor(self.control_pool, self.engine.update_weights, weights, version)
            finally:
                self.loading = None
                await self.gate.resume("loading weights")

    async def load_weights(self, path: str, version: int, publish: bool) -> dict:
        try:
            await self.install(path, version)
            if publish:
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(self.control_pool, self.client.publish_version, self.config.model_id, version)
        except (OSError, ValueError, RuntimeError) as exc:
            raise ApiError(400, f"load_weights: {type(exc).__name__}: {exc}", code="invalid_weights") from None
        return self.status()

    async def follow_weights(self, spec: str, poll_s: float) -> None:
        """Install every newer version of the weight channel ``spec``; completions wait (the gate's
        "first weights" pause) until the first one is in."""
        from rollbook.rollout.main import _fetch_or_none, open_channel
        from rollbook.weights.base import load_into

        loop = asyncio.get_running_loop()
        channel = None
        while True:
            try:
                if channel is None:
                    channel = await loop.run_in_executor(self.control_pool, open_channel, spec)
                snapshot = await loop.run_in_executor(self.control_pool, _fetch_or_none, channel)
                if snapshot is not None and snapshot.version > self.engine.version:
                    await self.install(functools.partial(_load_snapshot, load_into, snapshot), snapshot.version)
                    log.info("installed version %d from %s", snapshot.version, spec)
                    await self.gate.resume("waiting for the first weights")
            except FileNotFoundError:  # the trainer has not created the channel yet
                pass
            except (RuntimeError, ValueError) as exc:  # a torn copy: fetch the newest version whole again
                log.warning("weight update from %s failed (%s); reopening the channel", spec, exc)
                if channel is not None:
                    channel.close()
                channel = None
            except asyncio.CancelledError:
                if channel is not None:
                    channel.close()
                raise
            await asyncio.sleep(poll_s)

    def status(self) -> dict:
        return {
            "model_id": self.config.model_id,
            "version": self.engine.version,
            "paused": "admin pause" in self.gate.paused,
            "waiting_for_weights": "waiting for the first weights" in self.gate.paused,
            "loading_version": self.loading,
            "running": self.gate.running,
            "waiting": self.gate.waiting,
            "pending_submissions": self.submitter.pending,
            "held": len(self.held),
            **self.counters,
        }


def _load_snapshot(load_into, snapshot, model):
    load_into(model, snapshot)


def read_state_dict(path: str):
    p = pathlib.Path(path)
    if not p.is_file():
        raise ValueError(f"no file {path}")
    if p.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(p))
    import torch

    state = torch.load(str(p), map_location="cpu", weights_only=True)
    return state.get("model", state) if isinstance(state, dict) and "model" in state else state


# ---- response payloads ----------------------------------------------------------------------------


def _usage(results: Sequence[GenerationResult]) -> dict:
    prompt = len(results[0].prompt_token_ids)
    completion = sum(len(r.output_token_ids) for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _rollbook_extra(proxy: Proxy, results: Sequence[GenerationResult], turn: int) -> dict:
    return {"turn": turn, "version": proxy.engine.version, "output_versions": [r.output_versions for r in results]}


def _chat_payload(proxy: Proxy, req: Any, completion_id: str, results: Sequence[GenerationResult], turn: int) -> dict:
    choices = []
    for i, r in enumerate(results):
        logprobs = None
        if req.logprobs:
            logprobs = {
                "content": [
                    {"token": (t := proxy.render.token_text(tok)), "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                    for tok, lp in zip(r.output_token_ids, r.output_logprobs)
                ],
                "refusal": None,
            }
        choices.append(
            {
                "index": i,
                "message": {"role": "assistant", "content": proxy.render.decode(r.output_token_ids)},
                "logprobs": logprobs,
                "finish_reason": r.finish_reason,
            }
        )
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": proxy.config.model_id,
        "choices": choices,
        "usage": _usage(results),
        "system_fingerprint": f"v{proxy.engine.version}",
        "rollbook": _rollbook_extra(proxy, results, turn),
    }


def _text_payload(proxy: Proxy, req: Any, completion_id: str, results: Sequence[GenerationResult], turn: int) -> dict:
    choices = []
    for i, r in enumerate(results):
        logprobs = None
        if req.logprobs is not None:
            tokens = [proxy.render.token_text(t) for t in r.output_token_ids]
            offsets, at = [], 0
            for t in tokens:
                offsets.append(at)
                at += len(t)
            logprobs = {"tokens": tokens, "token_logprobs": list(r.output_logprobs), "top_logprobs": None, "text_offset": offsets}
        choices.append(
            {"index": i, "text": proxy.render.decode(r.output_token_ids), "logprobs": logprobs, "finish_reason": r.finish_reason}
        )
    return {
        "id": completion_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": proxy.config.model_id,
        "choices": choices,
        "usage": _usage(results),
        "system_fingerprint": f"v{proxy.engine.version}",
        "rollbook": _rollbook_extra(proxy, results, turn),
    }


def stream_chunks(proxy: Proxy, kind: str, payload: dict, include_usage: bool) -> list[bytes]:
    """The server-sent events of a finished completion: a role chunk (chat), one chunk per token of
    every choice, a finish chunk per choice, the usage chunk when asked, then ``[DONE]``."""
    events: list[dict] = []
    base = {
        "id": payload["id"],
        "created": payload["created"],
        "model": payload["model"],
        "system_fingerprint": payload["system_fingerprint"],
    }
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    for choice in payload["choices"]:
        i = choice["index"]
        if kind == "chat":
            events.append(
                {
                    **base,
                    "object": obj,
                    "choices": [
                        {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                    ],
                }
            )
            text = choice["message"]["content"]
            items = choice["logprobs"]["content"] if choice["logprobs"] else None
            pieces = _split(text, items)
            for piece, item in pieces:
                events.append(
                    {
                        **base,
                        "object": obj,
                        "choices": [
                            {
                                "index": i,
                                "delta": {"content": piece},
                                "logprobs": {"content": [item], "refusal": None} if item else None,
                                "finish_reason": None,
                            }
                        ],
                    }
                )
            events.append(
                {
                    **base,
                    "object": obj,
                    "choices": [{"index": i, "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}],
                }
            )
        else:
            lp = choice["logprobs"]
            pieces = _split(
                choice["text"], None if lp is None else list(zip(lp["tokens"], lp["token_logprobs"], lp["text_offset"]))
            )
            for piece, item in pieces:
                logprobs = None
                if item is not None:
                    logprobs = {"tokens": [item[0]], "token_logprobs": [item[1]], "top_logprobs": None, "text_offset": [item[2]]}
                events.append(
                    {**base, "object": obj, "choices": [{"index": i, "text": piece, "logprobs": logprobs, "finish_reason": None}]}
                )
            events.append(
                {
                    **base,
                    "object": obj,
                    "choices": [{"index": i, "text": "", "logprobs": None, "finish_reason": choice["finish_reason"]}],
                }
            )
    if include_usage:
        events.append({**base, "object": obj, "choices": [], "usage": payload["usage"]})
    return [f"data: {json.dumps(e)}\n\n".encode() for e in events] + [b"data: [DONE]\n\n"]


def _split(text: str, items: list | None) -> list[tuple[str, Any]]:
    """Per-token pieces of ``text`` (one character a token with the character tokenizer); with log-probs,
    one piece per output token (special tokens as empty text)."""
    if items is None:
        return [(ch, None) for ch in text]
    out, at = [], 0
    for item in items:
        token = item["token"] if isinstance(item, dict) else item[0]
        piece = text[at : at + len(token)] if text[at : at + len(token)] == token else ""
        at += len(piece)
        out.append((piece, item))
    return out


# ---- the HTTP app ---------------------------------------------------------------------------------


def create_app(proxy: Proxy):
    import contextlib

    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @contextlib.asynccontextmanager
    async def lifespan(app):
        follower = None
        settler = asyncio.create_task(proxy.settle_held())
        if proxy.config.weights:
            await proxy.gate.pause("waiting for the first weights")
            follower = asyncio.create_task(proxy.follow_weights(proxy.config.weights, proxy.config.weights_poll_s))
        yield
        settler.cancel()
        proxy.release(None)  # shutting down: what was delivered counts as consumed
        if follower is not None:
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await follower

    app = FastAPI(title="rollbook proxy", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

    def error(exc: ApiError) -> JSONResponse:
        headers = {"retry-after": "1"} if exc.status in (429, 503) else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return error(exc)

    @app.exception_handler(SessionError)
    async def _session_error(request: Request, exc: SessionError):
        return error(ApiError(exc.status, exc.message, code=exc.code, param=exc.param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "unknown_url", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return error(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return error(ApiError(400, str(exc.errors()[0].get("msg", "invalid request")), code="invalid_value"))

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception):
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return error(ApiError(500, f"internal error ({type(exc).__name__}); see the proxy's log", code="internal_error"))

    async def read_json(request: Request, model: type[BaseModel] | None = None) -> Any:
        declared = request.headers.get("content-length")
        limit = proxy.config.max_body_bytes
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(
                413, f"request body of {declared} bytes is over the {limit}-byte limit (max_body_bytes)", code="request_too_large"
            )
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"request body over the {limit}-byte limit (max_body_bytes)", code="request_too_large")
            chunks.append(chunk)
        raw = b"".join(chunks)
        try:
            body = json.loads(raw) if raw else {}
        except (ValueError, RecursionError) as exc:
            raise ApiError(400, f"the body is not valid JSON: {str(exc)[:200]}", code="invalid_json") from None
        if model is None:
            return body
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
        try:
            return model.model_validate(body)
        except ValidationError as exc:
            raise _validation_error(exc) from None

    async def completion(kind: Literal["chat", "text"], request: Request):
        proxy.session_of_key(request.headers)  # 401 before the body is read
        body = await read_json(request)
        payload, deliver, req = await proxy.complete(kind, request.headers, body)
        if not req.stream:
            await asyncio.sleep(0)  # let a pending connection loss be seen
            deliver(not await request.is_disconnected())
            return JSONResponse(payload, headers={"x-rollbook-turn": str(payload["rollbook"]["turn"])})
        include_usage = bool((req.stream_options or {}).get("include_usage"))
        chunks = stream_chunks(proxy, kind, payload, include_usage)

        async def events() -> AsyncIterator[bytes]:
            finished = False
            try:
                for chunk in chunks:
                    if await request.is_disconnected():
                        return
                    yield chunk
                await asyncio.sleep(0)
                finished = not await request.is_disconnected()
            finally:
                deliver(finished)

        return StreamingResponse(
            events(),
            media_type="text/event-stream",
            headers={"x-rollbook-turn": str(payload["rollbook"]["turn"]), "cache-control": "no-cache"},
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await completion("chat", request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await completion("text", request)

    @app.get("/v1/models")
    async def models(request: Request):
        proxy.session_of_key(request.headers)
        return {
            "object": "list",
            "data": [{"id": proxy.config.model_id, "object": "model", "created": 0, "owned_by": "rollbook"}],
        }

    @app.get("/health")
    async def health():
        return {"ok": True}

    @app.post("/rollbook/sessions")
    async def start_session(request: Request):
        proxy.require_starter(request.headers)
        start = await read_json(request, _StartSession)
        session, key = proxy.sessions.start(
            task_id=start.task_id, domain=start.domain, group_id=start.group_id, group_size=start.group_size
        )
        return {"session_id": session.session_id, "api_key": key, "model": proxy.config.model_id}

    @app.get("/rollbook/sessions/{session_id}")
    async def get_session(session_id: str, request: Request):
        return proxy.session_for(request.headers, session_id).summary()

    @app.post("/rollbook/sessions/{session_id}/reward")
    async def reward(session_id: str, request: Request):
        session = proxy.session_for(request.headers, session_id)
        body = await read_json(request, _Reward)
        return await proxy.reward(session, body.call, body.reward)

    @app.post("/rollbook/sessions/{session_id}/end")
    async def end(session_id: str, request: Request):
        session = proxy.session_for(request.headers, session_id)
        return await proxy.end(session)

    @app.get("/rollbook/admin/version")
    async def version(request: Request):
        proxy.require_admin(request.headers)
        return proxy.status()

    @app.post("/rollbook/admin/pause")
    async def pause(request: Request):
        proxy.require_admin(request.headers)
        await proxy.gate.pause("admin pause")
        return proxy.status()

    @app.post("/rollbook/admin/resume")
    async def resume(request: Request):
        proxy.require_admin(request.headers)
        await proxy.gate.resume("admin pause")
        return proxy.status()

    @app.post("/rollbook/admin/load_weights")
    async def load_weights(request: Request):
        proxy.require_admin(request.headers)
        body = await read_json(request, _LoadWeights)
        return await proxy.load_weights(body.path, body.version, body.publish)

    @app.post("/rollbook/admin/register_model")
    async def register_model(request: Request):
        proxy.require_admin(request.headers)
        body = await read_json(request, _RegisterModel)
        model_id = body.model_id or proxy.config.model_id
        if model_id != proxy.config.model_id:
            raise ApiError(
                404,
                f"model {model_id!r} is not served here (this proxy serves {proxy.config.model_id!r})",
                code="model_not_found",
                param="model_id",
            )
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(proxy.control_pool, proxy.client.register_model, model_id, proxy.render.vocab_size)
            if body.publish_version:
                await loop.run_in_executor(proxy.control_pool, proxy.client.publish_version, model_id, proxy.engine.version)
        except Exception as exc:
            details = getattr(exc, "details", None)
            raise ApiError(502, f"the store refused: {details() if callable(details) else exc}", code="store_error") from None
        return {"model_id": model_id, "vocab_size": proxy.render.vocab_size, "version": proxy.engine.version}

    return app


# ---- building and serving -------------------------------------------------------------------------


def build_engine(config: ProxyConfig) -> GenerationEngine:
    if config.engine == "vllm":
        from rollbook.rollout.vllm_engine import VllmEngine

        if not config.model.path:
            from rollbook.errors import ConfigError

            raise ConfigError("engine = 'vllm' needs model.path (a local model directory)")
        return VllmEngine(config.model.path, version=config.version)
    from rollbook.models import build_student
    from rollbook.rollout.engine import NativeEngine

    model = build_student(config.model)
    if config.checkpoint:
        model.load_state_dict(read_state_dict(config.checkpoint), strict=True)
    # with a weight channel the built weights are never served: version -1 until the first one arrives
    version = -1 if config.weights else config.version
    return NativeEngine(model, version=version, seed=config.seed, max_batch_size=config.max_batch_size)


def check_exposure(config: ProxyConfig, admin_key: str | None, worker_key: str | None) -> None:
    if config.host not in LOOPBACK and (admin_key is None or worker_key is None):
        from rollbook.errors import ConfigError

        raise ConfigError(
            f"host {config.host} is not loopback: set ROLLBOOK_ADMIN_KEY and ROLLBOOK_WORKER_KEY, else anyone "
            "who reaches the port may start sessions and load weights"
        )


class ProxyServer:
    """The app under uvicorn on its own thread (tests, ``rollbook run``); ``url`` once started."""

    def __init__(self, proxy: Proxy, host: str = "127.0.0.1", port: int = 0):
        import socket
        import threading

        import uvicorn

        self.proxy = proxy
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(create_app(proxy), log_level="warning", access_log=False, timeout_graceful_shutdown=5)
        )
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self) -> "ProxyServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the proxy's HTTP server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.proxy.close()


def serve(config: ProxyConfig, stop: threading.Event | None = None) -> None:
    """``rollbook proxy``: build the engine, serve until ``stop`` is set (None: SIGINT/SIGTERM set it;
    the CLI passes ``rollbook.lifetime.stop_event()``, also set when a tied parent dies)."""
    from rollbook import env

    admin_key, worker_key = env.role_key("admin"), env.role_key("worker")
    check_exposure(config, admin_key, worker_key)  # before anything slow is imported
    import torch

    from rollbook.client import StoreClient

    torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    engine = build_engine(config)
    client = StoreClient.from_env(config.server)
    proxy = Proxy(config, engine, client, admin_key=admin_key, worker_key=worker_key)
    server = ProxyServer(proxy, config.host, config.port).start()
    print(f"listening on {server.url}", flush=True)
    if stop is None:
        from rollbook.lifetime import stop_event  # a handler that takes no lock (StopEvent)

        stop = stop_event()
    try:
        while not stop.is_set() and server.thread.is_alive():
            stop.wait(0.5)
    finally:
        server.stop()
        client.close()
