"""How the proxy turns OpenAI messages and prompts into token ids and back: the one place it uses a
tokenizer. ``renderer(config)`` picks one:

- ``CharRenderer`` (the default, the demo's): the character tokenizer of the toy tasks
  (``rollbook.tasks.TOKENIZER``) with a plain transcript rendering of chat messages
  (docs/online.md, "Prompt rendering")::

      <bos> + content_1 + [<eos> if message 1 is the assistant's] + content_2 + ...

  Roles are not tagged: user, system and tool contents are written as they are, and every
  assistant message is closed by ``<eos>``, the token that also ends a generation. So a one-message
  chat ``[{"role": "user", "content": "12+34="}]`` renders exactly as the task prompt
  ``<bos>12+34=`` a model trained on the toy tasks expects. No tool calls.
- ``HFRenderer``: a Hugging Face tokenizer from a local model directory (``ProxyConfig.model.path``,
  or ``ProxyConfig.tokenizer``) with its chat template: ``apply_chat_template(messages, tools=...,
  add_generation_prompt=True)``, encoded without added special tokens (the template writes its own).
  Tool calls in the output are parsed by a ``ToolParser`` (``tool_parser``, "hermes": the
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks of Hermes, Qwen 2.5 and 3).

Messages reach a renderer as plain dicts: ``role``, ``content`` (text), and for tools
``tool_calls`` (``[{"id", "type": "function", "function": {"name", "arguments": {...}}}]``, the
arguments parsed into a dict, as chat templates expect) and ``tool_call_id``.
``/v1/completions`` renders ``<bos> + prompt`` (the tokenizer's own special tokens with an HF
tokenizer) or takes token ids as given.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

Message = dict[str, Any]


class RenderError(ValueError):
    """A message, prompt or stop string the tokenizer cannot represent (answered as HTTP 400)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class Renderer(Protocol):
    vocab_size: int
    eos_token_id: int
    tool_parser: ToolParser | None  # None: this renderer takes no tools

    def render(self, messages: Sequence[Message], tools: list[dict] | None, generation_prompt: bool) -> list[int]:
        """Ids of ``messages``; with ``generation_prompt``, ending where the assistant's reply starts."""
        ...

    def text_prompt(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str:
        """The reply text of output ids (the end token and what follows it, and special tokens, left out)."""
        ...

    def token_text(self, token_id: int) -> str: ...

    def stop_token_ids(self, stop: Sequence[str]) -> list[int]: ...


@dataclass
class CharRenderer:
    """The character tokenizer with the transcript rendering of the module docstring."""

    def __post_init__(self) -> None:
        from rollbook.tasks import TOKENIZER

        self.tokenizer = TOKENIZER
        self.vocab_size = TOKENIZER.vocab_size
        self.eos_token_id = TOKENIZER.eos_token_id
        self.tool_parser: ToolParser | None = None

    def _encode(self, text: str, param: str) -> list[int]:
        try:
            return self.tokenizer.encode(text)
        except ValueError as exc:
            raise RenderError(
                f"{param}: {exc} (the character tokenizer knows digits, lowercase letters and '+-*=:;,.?! ')", param
            ) from None

    def render(self, messages: Sequence[Message], tools: list[dict] | None, generation_prompt: bool) -> list[int]:
        if tools:
            raise RenderError("tools: the character tokenizer's transcript has no tool-call format", "tools")
        ids = [self.tokenizer.bos_token_id]
        for i, m in enumerate(messages):
            if m.get("tool_calls"):
                raise RenderError(f"messages[{i}].tool_calls: the character tokenizer's transcript has no tool calls", "messages")
            ids += self._encode(m.get("content") or "", f"messages[{i}].content")
            if m["role"] == "assistant":
                ids.append(self.eos_token_id)
        return ids

    def chat_prompt(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """``(role, content)`` pairs rendered with the generation prompt (callers outside the proxy)."""
        return self.render([{"role": r, "content": c} for r, c in messages], None, True)

    def text_prompt(self, text: str) -> list[int]:
        return [self.tokenizer.bos_token_id] + self._encode(text, "prompt")

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.tokens[token_id] if 0 <= token_id < self.vocab_size else ""

    def stop_token_ids(self, stop: Sequence[str]) -> list[int]:
        return _single_token_stops(stop, lambda s, param: self._encode(s, param))


class HFRenderer:
    """A Hugging Face tokenizer from a local directory and its chat template (module docstring)."""

    def __init__(self, path: str, *, tool_parser: str | None = "hermes", tokenizer: Any = None) -> None:
        from rollbook.tokenizers import HFTokenizer

        self.tokenizer = HFTokenizer(path, tokenizer=tokenizer)
        self.hf = self.tokenizer.hf
        self.path = str(path)
        self.vocab_size = self.tokenizer.vocab_size
        self.eos_token_id = self.tokenizer.eos_token_id
        self.tool_parser: ToolParser | None = TOOL_PARSERS[tool_parser]() if tool_parser else None

    def render(self, messages: Sequence[Message], tools: list[dict] | None, generation_prompt: bool) -> list[int]:
        if not getattr(self.hf, "chat_template", None):
            raise RenderError(f"messages: the tokenizer at {self.path} has no chat template; use /v1/completions", "messages")
        if tools and self.tool_parser is None:
            raise RenderError("tools: this proxy parses no tool calls (tool_parser is off)", "tools")
        try:
            text = self.hf.apply_chat_template(
                [dict(m) for m in messages], tools=tools or None, tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as exc:  # a template that raises on these messages (jinja's own error types)
            raise RenderError(f"messages: the chat template refused them: {type(exc).__name__}: {exc}", "messages") from None
        return list(self.hf.encode(text, add_special_tokens=False))

    def text_prompt(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=True))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def token_text(self, token_id: int) -> str:
        return self.hf.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def stop_token_ids(self, stop: Sequence[str]) -> list[int]:
        return _single_token_stops(stop, lambda s, param: list(self.hf.encode(s, add_special_tokens=False)))


def _single_token_stops(stop: Sequence[str], encode) -> list[int]:
    out = []
    for i, s in enumerate(stop):
        ids = encode(s, f"stop[{i}]")
        if len(ids) != 1:
            raise RenderError(
                f"stop[{i}]: {s!r} is {len(ids)} tokens; a stop sequence must be one token with this "
                "tokenizer (the recorded tokens must be exactly the ones the caller sees)",
                "stop",
            )
        out += ids
    return out


# -- tool calls ------------------------------------------------------------------------------------


class ToolParser(Protocol):
    def parse(self, text: str) -> tuple[str, list[dict]]:
        """(the reply's content without the calls, the calls as ``{"name", "arguments": dict}``)."""
        ...


class HermesToolParser:
    """``<tool_call>{"name": "f", "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen 2.5/3). The
    content is the text around the blocks as written ("" when that is only whitespace). A block that
    is not a JSON object with a string ``name`` and an object ``arguments`` stays in the content:
    what the model wrote is never dropped."""

    BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def parse(self, text: str) -> tuple[str, list[dict]]:
        calls, kept, at = [], [], 0
        for match in self.BLOCK.finditer(text):
            try:
                body = json.loads(match.group(1))
            except ValueError:
                continue
            if not (isinstance(body, dict) and isinstance(body.get("name"), str) and isinstance(body.get("arguments", {}), dict)):
                continue
            calls.append({"name": body["name"], "arguments": body.get("arguments", {})})
            kept.append(text[at : match.start()])
            at = match.end()
        kept.append(text[at:])
        if not calls:
            return text, calls
        content = "".join(kept)
        return (content if content.strip() else ""), calls


TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser}


def openai_tool_calls(calls: list[dict], completion_id: str, choice: int) -> list[dict]:
    """Parsed calls in the OpenAI response form (``arguments`` a JSON string)."""
    return [
        {
            "id": f"call_{uuid.uuid5(uuid.NAMESPACE_URL, f'{completion_id}/{choice}/{i}').hex[:24]}",
            "type": "function",
            "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)},
        }
        for i, c in enumerate(calls)
    ]


def renderer(config: Any = None) -> Renderer:
    """The proxy's tokenizer and chat rendering: an ``HFRenderer`` of ``config.tokenizer`` or
    ``config.model.path`` when one is set, else the ``CharRenderer``."""
    path = getattr(config, "tokenizer", None) or getattr(getattr(config, "model", None), "path", None)
    if path:
        return HFRenderer(path, tool_parser=getattr(config, "tool_parser", "hermes"))
    return CharRenderer()
