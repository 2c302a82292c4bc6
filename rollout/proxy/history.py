"""Token-exact multi-turn histories: the prompt ids of a session's next call, and the call it continues.

An agent sends its whole conversation with every call. Rendering it again through the chat template
is not what the model saw: the model sampled token ids, some of which the text leaves out (special
tokens, a tokenization the text would not give), so the trainer would learn on a history the agent
did not experience. So the proxy keeps, per call, the messages it rendered, its prompt ids, and per
choice the sampled ids and the reply it returned, and ``plan`` decides:

- **Extends** a call ``k`` (choice ``c``): the request's messages are call ``k``'s messages, then an
  assistant message equal to the reply the proxy returned for a delivered choice ``c`` of ``k``
  (the same text; the same tool calls by name and arguments, ids ignored), then at least one new
  message. The prompt is then call ``k``'s prompt ids + choice ``c``'s sampled ids + the rest of the
  assistant turn's closing tokens the model did not sample (e.g. the newline after ``<|im_end|>``,
  or the whole close when the reply was cut by ``max_tokens``) + the new messages as the chat
  template renders them after that turn. Recorded as ``parent_request_id = turn-k.c``, not
  ``branched``. Of several such calls the latest is taken.
- **Branches** otherwise, when the messages share at least their first message with an earlier
  call's messages + reply (the agent edited, truncated or re-asked its history): the prompt is the
  messages rendered afresh, and the call is recorded with the parent whose history shares the
  longest prefix (the earliest of equals: where the histories part) and ``branched`` true. Also when the chat template does not
  render the new messages as an append to the old ones (the prompt could not be continued token for
  token).
- **Starts** a new tree otherwise (the session's first call, or a conversation unrelated to every
  earlier one): rendered afresh, no parent.

``/v1/completions`` takes the prompt as given (ids, or text encoded as is); a call whose prompt ids
start with an earlier call's prompt + sampled ids is recorded as extending it, else it has no parent.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollbook.rollout.proxy.render import Message, Renderer
    from rollbook.rollout.proxy.sessions import Call, Session


@dataclass
class Turn:
    """What a call's prompt is and what it continues."""

    prompt_ids: list[int]
    parent_request_id: str = ""
    branched: bool = False
    messages: list[Message] | None = None  # chat calls: the messages rendered (normalized)
    tools: list[dict] | None = None


@dataclass
class Reply:
    """One choice of a delivered attempt: the ids the model sampled and the message the caller got."""

    output_ids: list[int]
    finish_reason: str
    message: Message = field(default_factory=dict)  # chat: role, content, tool_calls (arguments as dicts)


def same_message(a: Message, b: Message) -> bool:
    """Equal as a history entry: role, text, and tool calls by name and arguments (ids ignored)."""
    return a.get("role") == b.get("role") and (a.get("content") or "") == (b.get("content") or "") and _calls(a) == _calls(b)


def _calls(m: Message) -> list[tuple[str, str]]:
    return [(c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True)) for c in m.get("tool_calls") or []]


def message_key(m: Message) -> str:
    """Equal for two messages exactly when ``same_message`` holds."""
    return json.dumps([m.get("role"), m.get("content") or "", _calls(m)], sort_keys=True)


def _common_prefix(a: Sequence[Message], b: Sequence[Message]) -> int:
    n = 0
    for x, y in zip(a, b):
        if not same_message(x, y):
            break
        n += 1
    return n


def _delivered(session: Session) -> list[tuple[Call, list[Reply]]]:
    """The session's planned calls with a delivered attempt, and its replies."""
    with session.lock:
        out = []
        for c in session.calls:
            attempt = c.delivered if c.turn_plan else None
            if attempt is not None and attempt.replies:
                out.append((c, attempt.replies))
        return out


def _replies(session: Session, call: Call) -> list[Reply]:
    """The replies of ``call``'s delivered attempt; empty while none was delivered."""
    with session.lock:
        attempt = call.delivered
        return attempt.replies if attempt is not None else []


def plan_chat(render: Renderer, session: Session, messages: list[Message], tools: list[dict] | None) -> Turn:
    """The prompt of a chat call with ``messages`` in ``session`` (module docstring).

    Only the calls whose history starts with the same first message are looked at, and the cost per
    call stays flat as a session grows when its conversations differ, or when they repeat one
    (extensions are looked for among shorter histories only, newest first; the branch parent is the
    earliest call sharing the most messages, so that scan stops at the first call that shares all)."""
    candidates = [
        c
        for c in (session.calls_starting_with(messages[0]) if messages else [])
        if c.turn_plan.messages is not None and (c.turn_plan.tools or None) == (tools or None)
    ]
    for call in reversed(candidates):  # extend: the newest call whose history + reply the messages continue
        before = call.turn_plan.messages
        if len(before) + 1 >= len(messages):
            continue
        for choice, reply in enumerate(_replies(session, call)):
            history = [*before, reply.message]
            if _common_prefix(history, messages) == len(history):
                continued = continue_prompt(render, call.turn_plan, reply, messages, tools)
                if continued is not None:
                    return Turn(continued, f"turn-{call.turn}.{choice}", False, messages, tools)
    best: tuple[int, Call, int] | None = None  # branch: (shared messages, call, choice); earliest call, latest choice
    for call in candidates:
        replies = _replies(session, call)
        for choice in reversed(range(len(replies))):
            shared = _common_prefix([*call.turn_plan.messages, replies[choice].message], messages)
            if best is None or shared > best[0]:
                best = (shared, call, choice)
        if best is not None and best[0] == len(messages):  # no later call can share more
            break
    prompt = render.render(messages, tools, True)
    if best is None:
        return Turn(prompt, "", False, messages, tools)
    return Turn(prompt, f"turn-{best[1].turn}.{best[2]}", True, messages, tools)


def continue_prompt(
    render: Renderer, earlier: Turn, reply: Reply, messages: list[Message], tools: list[dict] | None
) -> list[int] | None:
    """Earlier prompt + sampled ids + the unsampled rest of the assistant turn's close + the new
    messages; None when the template does not render the new messages as an append."""
    assert earlier.messages is not None
    before = earlier.messages
    n = len(before) + 1
    head = render.render(before, tools, True)
    base = render.render(messages[:n], tools, False)
    empty = render.render([*before, {"role": "assistant", "content": ""}], tools, False)
    full = render.render(messages, tools, True)
    if base[: len(head)] != head or empty[: len(head)] != head or full[: len(base)] != base:
        return None
    close = empty[len(head) :]
    if base[len(base) - len(close) :] != close:
        return None
    sampled = reply.output_ids
    rest = close[1:] if sampled and close and sampled[-1] == close[0] else close
    return [*earlier.prompt_ids, *sampled, *rest, *full[len(base) :]]


def plan_text(session: Session, prompt_ids: list[int]) -> Turn:
    """A ``/v1/completions`` call: extends the latest earlier call whose prompt + sampled ids start its prompt."""
    for call, replies in reversed(_delivered(session)):
        earlier = call.turn_plan.prompt_ids
        for choice, reply in enumerate(replies):
            history = [*earlier, *reply.output_ids]
            if len(prompt_ids) > len(history) and prompt_ids[: len(history)] == history:
                return Turn(prompt_ids, f"turn-{call.turn}.{choice}", False)
    return Turn(prompt_ids)


def normalize_messages(messages: Sequence[Any]) -> list[Message]:
    """Request messages (``schemas.Message``) as renderer dicts: text content, tool calls with their
    arguments parsed (a ``RenderError`` when they are not a JSON object), tool results with their id."""
    from rollbook.rollout.proxy.render import RenderError

    out: list[Message] = []
    for i, m in enumerate(messages):
        entry: Message = {"role": m.role, "content": m.text(i)}
        extra = m.model_extra or {}
        calls = extra.get("tool_calls")
        if calls:
            if m.role != "assistant" or not isinstance(calls, list):
                raise RenderError(f"messages[{i}].tool_calls: only an assistant message has a list of tool calls", "messages")
            parsed = []
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise RenderError(f"messages[{i}].tool_calls[{j}]: needs function.name", "messages")
                args = fn.get("arguments", "{}")
                try:
                    args = json.loads(args) if isinstance(args, str) else args
                except ValueError:
                    raise RenderError(f"messages[{i}].tool_calls[{j}].function.arguments: not JSON", "messages") from None
                if not isinstance(args, dict):
                    raise RenderError(f"messages[{i}].tool_calls[{j}].function.arguments: not a JSON object", "messages")
                parsed.append({"id": call.get("id", ""), "type": "function", "function": {"name": fn["name"], "arguments": args}})
            entry["tool_calls"] = parsed
        if m.role == "tool":
            if not isinstance(extra.get("tool_call_id"), str):
                raise RenderError(f"messages[{i}].tool_call_id: a tool message needs the id of the call it answers", "messages")
            entry["tool_call_id"] = extra["tool_call_id"]
        if isinstance(extra.get("name"), str):
            entry["name"] = extra["name"]
        out.append(entry)
    return out
