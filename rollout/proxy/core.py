"""The proxy's state and behaviour behind the HTTP app (``Proxy``): keys, completions recorded as
trajectories of the calling session, rewards, session ends, weight installs and the weight follower."""

import asyncio
import concurrent.futures
import dataclasses
import functools
import hmac
import logging
import pathlib
import time
from collections.abc import Collection
from typing import Any, Literal

from pydantic import ValidationError

from rollbook.config import ProxyConfig
from rollbook.language_models import stop_token_ids
from rollbook.rollout.engine import GenerationEngine, GenerationRequest, GenerationResult
from rollbook.rollout.proxy.admission import Gate
from rollbook.rollout.proxy.history import Reply, normalize_messages, plan_chat, plan_text
from rollbook.rollout.proxy.payloads import chat_payload, chat_reply, text_payload
from rollbook.rollout.proxy.render import Renderer, RenderError, renderer
from rollbook.rollout.proxy.schemas import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    Sampling,
    refuse_unsupported,
    validation_error,
)
from rollbook.rollout.proxy.sessions import Session, Sessions, SubmitQueue, reward_targets
from rollbook.rollout.proxy.streaming import TokenStream

log = logging.getLogger("rollbook.proxy")


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
        self.render = render or renderer(config)
        self.stop_ids = stop_token_ids(self.render.eos_token_id, config.model)  # the tokenizer's eos, the model's eos ids
        self.admin_key, self.worker_key = admin_key, worker_key
        self.sessions = Sessions(
            model_id=config.model_id,
            worker_id=config.worker_id,
            max_sessions=config.max_sessions,
            ended_ttl_s=config.ended_session_ttl_s,
            idle_ttl_s=config.idle_session_ttl_s,
        )
        self.submitter = SubmitQueue(
            client,
            batch_size=config.submit_batch_size,
            linger_s=config.submit_linger_s,
            spool_dir=config.spool_dir,
            spool_max_bytes=config.spool_max_bytes,
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

    def _params(self, req: Sampling, prompt_ids: list[int], max_tokens: int | None) -> tuple[list[GenerationRequest], list[int]]:
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
        stop_ids = sorted({*self.stop_ids, *self.render.stop_token_ids(stops)})
        if isinstance(req, ChatRequest):
            top = req.top_logprobs or 0
        else:
            assert isinstance(req, CompletionRequest)
            top = req.logprobs or 0
        if isinstance(req, ChatRequest) and top and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", code="invalid_value", param="top_logprobs")
        if top > getattr(self.engine, "max_top_logprobs", 0):
            param = "top_logprobs" if isinstance(req, ChatRequest) else "logprobs"
            raise ApiError(400, f"{param}: this engine serves no top log-probs", code="unsupported_value", param=param)
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
                top_logprobs=top,
            )
            for _ in range(req.n)
        ]
        return requests, stop_ids

    def _tools(self, chat: ChatRequest) -> list[dict] | None:
        """The tools rendered into the prompt and parsed from the output, or None (none given, or
        ``tool_choice`` "none"). A choice the proxy cannot honour is refused."""
        if not chat.tools or chat.tool_choice == "none":
            return None
        if chat.tool_choice not in (None, "auto"):
            raise ApiError(
                400,
                "tool_choice: only 'auto' and 'none' are served (the proxy does not constrain decoding to force a call)",
                code="unsupported_value",
                param="tool_choice",
            )
        if self.render.tool_parser is None:
            raise ApiError(
                400,
                "tools: this proxy's model takes no tools (the character tokenizer, or tool_parser off)",
                code="unsupported_value",
                param="tools",
            )
        return [t.model_dump() for t in chat.tools]

    async def complete(self, kind: Literal["chat", "text"], headers, body: Any) -> tuple[dict, Any, Any] | TokenStream:
        """Run one completion request. Streamed, on an engine that samples token by token
        (``submit``): a ``TokenStream`` at once, its tokens arriving as they are sampled. Otherwise,
        once generated: (the response payload, the ``deliver(delivered)`` callback that records the
        attempt once its delivery is known, the validated request)."""
        session = self.session_of_key(headers)
        refuse_if_over(session, "completions")
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
        try:
            if kind == "chat":
                chat = ChatRequest.model_validate(body)
                refuse_unsupported(chat)
                messages = normalize_messages(chat.messages)
                turn = plan_chat(self.render, session, messages, self._tools(chat))
                req: Sampling = chat
                max_tokens = chat.max_completion_tokens or chat.max_tokens
            else:
                text = CompletionRequest.model_validate(body)
                refuse_unsupported(text)
                prompt_ids = self.render.text_prompt(text.prompt) if isinstance(text.prompt, str) else list(text.prompt)
                if not prompt_ids:
                    raise ApiError(400, "prompt: empty", code="invalid_value", param="prompt")
                turn = plan_text(session, prompt_ids)
                req, max_tokens = text, text.max_tokens
            requests, _ = self._params(req, turn.prompt_ids, max_tokens)
        except ValidationError as exc:
            raise validation_error(exc) from None
        except RenderError as exc:
            raise ApiError(400, str(exc), code="invalid_value", param=exc.param) from None
        try:
            retry_count = int(headers.get("x-stainless-retry-count") or 0)
        except ValueError:
            retry_count = 0
        idem = headers.get("idempotency-key") or None
        await self.gate.admit()  # before the turn is numbered: a 429 or 503 uses up no turn
        try:
            refuse_if_over(session, "completions")  # it may have ended while this call waited
            call, attempt = session.begin_attempt(body, idem, retry_count, time.time())
        except BaseException:
            await self.gate.release()
            raise
        planned = session.plan_turn(call, turn)
        if planned is not turn and planned.prompt_ids != turn.prompt_ids:  # a retry: the same prompt as its call's first attempt
            requests = [dataclasses.replace(r, prompt_token_ids=list(planned.prompt_ids)) for r in requests]
        # the caller retried this call: its delivered attempts were not read; any other call: it moved on
        self.release(session, retracted=set(map(id, call.attempts[:-1])))
        if req.stream:
            return self._stream(kind, req, session, call, attempt, requests)
        try:
            submit = getattr(self.engine, "submit", None)
            if submit is not None:  # into the running batch; awaited here, no thread parked on it
                futures = [submit(r, seed=req.seed, index=i) for i, r in enumerate(requests)]
                results: list[GenerationResult] = [await asyncio.wrap_future(f) for f in futures]
            else:
                loop = asyncio.get_running_loop()
                generate = functools.partial(self.engine.generate, requests, seed=req.seed)
                results = await loop.run_in_executor(self.pool, generate)
        except Exception as exc:
            raise self._engine_error(exc) from None
        finally:
            await self.gate.release()
        payload, deliver = self._finished(kind, req, session, call, attempt, results)
        return payload, deliver, req

    def _engine_error(self, exc: BaseException) -> ApiError:
        self.counters["errors"] += 1
        log.error("generation failed", exc_info=exc)
        return ApiError(500, f"generation failed: {type(exc).__name__}: {exc}", code="engine_error")

    def _finished(
        self, kind: str, req: Sampling, session: Session, call, attempt, results: list[GenerationResult]
    ) -> tuple[dict, Any]:
        """Hold a generated attempt and build its answer: (payload, ``deliver(delivered)``)."""
        self.counters["completions"] += 1
        # durable (with spool_dir) before the answer is complete at the caller: a restarted proxy
        # submits it as consumed
        hold = self.submitter.hold(self.sessions.trajectories(session, call, attempt, results, True, record=False))

        def deliver(delivered: bool) -> None:
            self.counters["delivered" if delivered else "undelivered"] += 1
            trajectories = self.sessions.trajectories(session, call, attempt, results, delivered)
            if delivered:  # held until the caller shows it read it (release)
                attempt.held, attempt.held_since, attempt.hold = trajectories, time.monotonic(), hold
                self.held[id(attempt)] = (session, attempt)
            else:
                attempt.verdicts = self.submitter.put(trajectories, unhold=hold)

        payload = (chat_payload if kind == "chat" else text_payload)(self, req, attempt.completion_id, results, call.turn)
        attempt.replies = [
            Reply(
                list(r.output_token_ids),
                r.finish_reason,
                chat_reply(self, req, attempt.completion_id, i, r)[2] if kind == "chat" else {},
            )
            for i, r in enumerate(results)
        ]
        return payload, deliver

    def _stream(
        self, kind: str, req: Sampling, session: Session, call, attempt, requests: list[GenerationRequest]
    ) -> TokenStream:
        """Generate a streamed completion: on an engine that samples token by token (``submit``),
        each choice with a callback that queues every token as it is sampled; on one that does not
        (vLLM), whole, then its tokens queued at once. The gate is released when all are done."""
        loop = asyncio.get_running_loop()
        stream = TokenStream(self, kind, req, attempt.completion_id, call.turn, len(requests))
        submit = getattr(self.engine, "submit", None)

        def on_token(index: int):
            def queue(token: int, logprob: float, version: int, top: list | None = None) -> None:
                loop.call_soon_threadsafe(stream.queue.put_nowait, (index, token, logprob, top))

            return queue

        futures = []
        if submit is not None:
            try:
                futures = [submit(r, seed=req.seed, index=i, on_token=on_token(i)) for i, r in enumerate(requests)]
            except Exception as exc:
                loop.create_task(self.gate.release())
                raise self._engine_error(exc) from None

        async def generate() -> list[GenerationResult]:
            if submit is not None:  # the callbacks queued every token before its future resolved
                return [await asyncio.wrap_future(f) for f in futures]
            results = await loop.run_in_executor(self.pool, functools.partial(self.engine.generate, requests, seed=req.seed))
            for i, r in enumerate(results):
                tops = r.output_top_logprobs or [None] * len(r.output_token_ids)
                for token, logprob, top in zip(r.output_token_ids, r.output_logprobs, tops):
                    stream.queue.put_nowait((i, token, logprob, top))
            return results

        async def outcome() -> tuple[dict, Any]:
            try:
                results = await generate()
            except Exception as exc:
                raise self._engine_error(exc) from None
            finally:
                await self.gate.release()
                stream.queue.put_nowait(None)
            return self._finished(kind, req, session, call, attempt, results)

        stream.outcome = loop.create_task(outcome())
        return stream

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
        without a reward or an end), as consumed; end sessions idle for ``idle_session_ttl_s``."""
        while True:
            await asyncio.sleep(min(1.0, self.config.consume_settle_s / 4, self.config.idle_session_ttl_s / 4))
            self.release(None, older_than=self.config.consume_settle_s)
            self.expire_idle()

    def expire_idle(self) -> list[Session]:
        """End idle sessions (``Sessions.expire_idle``); what they had delivered is submitted as consumed."""
        expired = self.sessions.expire_idle(time.time())
        for session in expired:
            self.release(session)
            log.info("session %s expired after %g s without a request", session.session_id, self.config.idle_session_ttl_s)
        return expired

    async def reward(self, session: Session, which: str | int, value: float) -> dict:
        if session.expired:
            refuse_if_over(session, "rewards")
        self.release(session)  # a reward means the caller has read its completions
        targets = reward_targets(session, which)
        loop = asyncio.get_running_loop()
        rewarded, skipped = [], []
        if any(not f.done() for _, attempt in targets for f in attempt.verdicts):
            self.submitter.hurry()
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
        if any(not f.done() for f in futures):
            self.submitter.hurry()
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
        except (OSError, ValueError, RuntimeError) as exc:
            cause = f" ({type(exc.__cause__).__name__}: {exc.__cause__})" if exc.__cause__ is not None else ""
            raise ApiError(400, f"load_weights: {type(exc).__name__}: {exc}{cause}", code="invalid_weights") from None
        if publish:
            loop = asyncio.get_running_loop()
            try:
                await loop.run_in_executor(self.control_pool, self.client.publish_version, self.config.model_id, version)
            except Exception as exc:
                details = getattr(exc, "details", None)
                raise ApiError(
                    502,
                    f"version {version} is installed, but the store refused PublishVersion: "
                    f"{details() if callable(details) else exc}",
                    code="store_error",
                ) from None
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


def refuse_if_over(session: Session, what: str) -> None:
    """409 for a session that ended (``what`` = "completions") or expired (anything)."""
    if session.expired:
        raise ApiError(
            409,
            f"session {session.session_id} expired after idle_session_ttl_s without a request; its calls are "
            f"stored, but it takes no more {what}; start a new session",
            code="session_expired",
        )
    if session.ended_at is not None and what == "completions":
        raise ApiError(409, f"session {session.session_id} has ended; start a new one", code="session_ended")


def _load_snapshot(load_into, snapshot, model):
    load_into(model, snapshot)


def read_state_dict(path: str):
    """The state dict in ``path`` (``.safetensors``, else a torch ``.pt`` file, optionally a
    checkpoint with a ``model`` entry); a ``ValueError`` naming the file for anything else."""
    p = pathlib.Path(path)
    if not p.is_file():
        raise ValueError(f"no file {path}")
    state: Any
    try:
        if p.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(p))
        else:
            import torch

            state = torch.load(str(p), map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or foreign file: each library raises its own error types
        raise ValueError(f"{path} is not a readable state dict: {type(exc).__name__}: {str(exc)[:300]}") from None
    if isinstance(state, dict) and "model" in state:
        state = state["model"]
    import torch

    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
        raise ValueError(f"{path} holds a {type(state).__name__}, not a state dict (names to tensors)")
    return state
