"""The proxy's HTTP app (FastAPI): OpenAI endpoints, session endpoints and admin control."""

# no `from __future__ import annotations`: FastAPI reads the handlers' annotations
import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from rollbook.rollout.proxy.core import Proxy
from rollbook.rollout.proxy.schemas import ApiError, LoadWeights, RegisterModel, Reward, StartSession, validation_error
from rollbook.rollout.proxy.sessions import SessionError
from rollbook.rollout.proxy.streaming import TokenStream

log = logging.getLogger("rollbook.proxy")


def disconnect_check(request: Any) -> Callable[[], Awaitable[bool]]:
    """How an answer learns that its caller left. Under uvicorn the request's ``receive`` is its
    request cycle's, whose ``disconnected`` flag the server sets when the connection is lost (what
    ``receive`` would then answer); it is read as is. Starlette's ``Request.is_disconnected`` enters
    and cancels an anyio cancel scope on every call to ask ``receive`` without waiting (about 0.1 ms
    of the proxy's 3 ms of CPU per call on the 2-core reference machine, and once per streamed
    token). Any other server: Starlette's."""
    cycle = getattr(request.receive, "__self__", None)
    if cycle is None or not isinstance(getattr(cycle, "disconnected", None), bool):
        return request.is_disconnected

    async def disconnected() -> bool:
        return bool(cycle.disconnected)

    return disconnected


def create_app(proxy: Proxy):
    """The proxy's ASGI app: POSTs to the two completion endpoints are answered by ``completion``
    directly; everything else (sessions, admin, ``/v1/models``, lifespan) by a FastAPI app."""
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
        if exc.status == 409:  # an ended or expired session, nothing to reward: retrying cannot help
            headers = {"x-should-retry": "false"}
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
            raise validation_error(exc) from None

    async def completion(kind: Literal["chat", "text"], request: Request):
        proxy.session_of_key(request.headers)  # 401 before the body is read
        body = await read_json(request)
        answer = await proxy.complete(kind, request.headers, body)
        disconnected = disconnect_check(request)
        if isinstance(answer, TokenStream):  # tokens leave as they are sampled
            return StreamingResponse(
                answer.events(disconnected),
                media_type="text/event-stream",
                headers={"x-rollbook-turn": str(answer.turn), "cache-control": "no-cache"},
            )
        payload, deliver, req = answer
        await asyncio.sleep(0)  # let a pending connection loss be seen
        deliver(not await disconnected())
        return JSONResponse(payload, headers={"x-rollbook-turn": str(payload["rollbook"]["turn"])})

    # The two completion endpoints are answered before the FastAPI app (asgi below): they read and
    # answer the request themselves, and FastAPI's per-call work around an endpoint (its middleware
    # stack, dependency and response handling) is CPU that every call takes from the engine on a
    # small machine. Other methods on their paths go to the app (its 405).
    async def chat_completions(request: Request):
        return await completion("chat", request)

    async def completions(request: Request):
        return await completion("text", request)

    app.add_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_route("/v1/completions", completions, methods=["POST"])
    direct = {"/v1/chat/completions": "chat", "/v1/completions": "text"}

    async def asgi(scope, receive, send) -> None:
        kind = direct.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if kind is None:
            await app(scope, receive, send)
            return
        request = Request(scope, receive, send)
        try:
            response = await completion(kind, request)  # type: ignore[arg-type]
        except ApiError as exc:
            response = error(exc)
        except SessionError as exc:
            response = await _session_error(request, exc)
        except Exception as exc:
            response = await _bug(request, exc)
        await response(scope, receive, send)

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
        start = await read_json(request, StartSession)
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
        body = await read_json(request, Reward)
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
        body = await read_json(request, LoadWeights)
        return await proxy.load_weights(body.path, body.version, body.publish)

    @app.post("/rollbook/admin/register_model")
    async def register_model(request: Request):
        proxy.require_admin(request.headers)
        body = await read_json(request, RegisterModel)
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

    return asgi
