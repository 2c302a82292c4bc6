"""The OpenAI-format request bodies the proxy accepts, its control bodies, and its error answer.

Request bodies are strict: a JSON string is not a number or a boolean (``"stream": "yes"`` is a 400, as
at OpenAI). A field the proxy does not honour is refused (``unsupported_parameter``), not ignored:
only bookkeeping fields that change no token (``user``, ``metadata``, ``store``, ``service_tier``,
``parallel_tool_calls``) and neutral values of sampling fields it does not implement
(``presence_penalty`` / ``frequency_penalty`` 0, an empty ``logit_bias``, ``response_format``
text) pass.
"""

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from rollbook.rollout.proxy.render import RenderError


# strict: a JSON string is not a number or a boolean ("stream": "yes" is a 400, as at OpenAI)
class Message(BaseModel):
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


# fields that change no token: accepted and not acted on
BOOKKEEPING = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls"})
# sampling fields the proxy does not implement, with the value that means "off"
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
    "logit_bias": ({}, None),
    "response_format": ({"type": "text"}, None),
}


class Sampling(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # checked by refuse_unsupported
    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    seed: int | None = None  # the sampling keys of the choices derive from it: the same request, the same tokens

    @field_validator("temperature", "top_p")
    @classmethod
    def _finite(cls, v: float | None) -> float | None:
        if v is not None and not math.isfinite(v):
            raise ValueError("must be finite")
        return v


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionSpec

    def model_dump(self, **kwargs: Any) -> dict[str, Any]:  # as chat templates read it: no null entries
        return super().model_dump(exclude_none=True, **kwargs)


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None


class CompletionRequest(Sampling):
    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v


def refuse_unsupported(model: Sampling) -> None:
    """Raise a 400 ``unsupported_parameter`` for a field the proxy would otherwise silently ignore."""
    for name, value in (model.model_extra or {}).items():
        if name in BOOKKEEPING or (name in NEUTRAL and any(value == v and type(value) is type(v) for v in NEUTRAL[name])):
            continue
        hint = " (only its neutral value is accepted)" if name in NEUTRAL else ""
        raise ApiError(
            400,
            f"{name}: not supported by this proxy{hint}: refused rather than ignored",
            code="unsupported_parameter",
            param=name,
        )


class StartSession(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    task_id: str = Field("", max_length=256)
    domain: str = Field("", max_length=256)
    group_id: str = Field("", max_length=200)
    group_size: int = Field(1, ge=1, le=65536)


class Reward(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    reward: float
    call: str | int = "last"

    @field_validator("reward")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("must be finite")
        return v


class LoadWeights(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    path: str
    version: int = Field(ge=0)
    publish: bool = False


class RegisterModel(BaseModel):
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
            405: "invalid_request_error",
            409: "invalid_request_error",
            413: "invalid_request_error",
            429: "rate_limit_error",
            503: "overloaded_error",
        }.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def validation_error(exc: ValidationError) -> ApiError:
    first = exc.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ()))
    message = str(first.get("msg", "invalid")).removeprefix("Value error, ")
    return ApiError(400, f"{loc}: {message}" if loc else message, code="invalid_value", param=loc or None)
