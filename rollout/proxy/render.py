"""How the proxy turns OpenAI messages and prompts into token ids and back: the one place it uses a
tokenizer (``renderer()``), so another tokenizer (an HF tokenizer with a chat template) plugs in here.

The default is the character tokenizer of the toy tasks (``rollbook.tasks.TOKENIZER``) with a plain
transcript rendering of chat messages (docs/online.md, "Prompt rendering"):

    <bos> + content_1 + [<eos> if message 1 is the assistant's] + content_2 + ...

Roles are not tagged: user, system and tool contents are written as they are, and every assistant
message is closed by ``<eos>``, the token that also ends a generation. So a one-message chat
``[{"role": "user", "content": "12+34="}]`` renders exactly as the task prompt ``<bos>12+34=`` a
model trained on the toy tasks expects, and a conversation is the transcript the model wrote its
own turns into. ``/v1/completions`` renders ``<bos> + prompt`` (or takes token ids as given).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class RenderError(ValueError):
    """A message, prompt or stop string the tokenizer cannot represent (answered as HTTP 400)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class Renderer(Protocol):
    vocab_size: int
    eos_token_id: int

    def chat_prompt(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """Prompt ids of ``(role, content)`` messages, ending where the assistant's reply starts."""
        ...

    def text_prompt(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str:
        """The reply text of output ids (the end token and what follows it left out)."""
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

    def _encode(self, text: str, param: str) -> list[int]:
        try:
            return self.tokenizer.encode(text)
        except ValueError as exc:
            raise RenderError(
                f"{param}: {exc} (the character tokenizer knows digits, lowercase letters and '+-*=:;,.?! ')", param
            ) from None

    def chat_prompt(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        ids = [self.tokenizer.bos_token_id]
        for i, (role, content) in enumerate(messages):
            ids += self._encode(content, f"messages[{i}].content")
            if role == "assistant":
                ids.append(self.eos_token_id)
        return ids

    def text_prompt(self, text: str) -> list[int]:
        return [self.tokenizer.bos_token_id] + self._encode(text, "prompt")

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.tokens[token_id] if 0 <= token_id < self.vocab_size else ""

    def stop_token_ids(self, stop: Sequence[str]) -> list[int]:
        out = []
        for i, s in enumerate(stop):
            ids = self._encode(s, f"stop[{i}]")
            if len(ids) != 1:
                raise RenderError(
                    f"stop[{i}]: {s!r} is {len(ids)} tokens; a stop sequence must be one token with this "
                    "tokenizer (the recorded tokens must be exactly the ones the caller sees)",
                    "stop",
                )
            out += ids
        return out


def renderer() -> Renderer:
    """The proxy's tokenizer and chat rendering (swap here for another tokenizer)."""
    return CharRenderer()
