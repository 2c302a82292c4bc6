"""Tokenizers: what the rollout worker and the trainer need from one, and two implementations.

    tok = load_tokenizer(None, default=TOKENIZER)    # the toy tasks' CharTokenizer (rollbook/tasks.py)
    tok = load_tokenizer("models/my-llm", default=TOKENIZER, stop_strings=["</answer>"])  # HFTokenizer, local only
    ids = tok.encode_prompt(prompt="12+34=")         # plain prompt, as the tokenizer encodes it
    ids = tok.encode_prompt(messages=[{"role": "user", "content": "2+2?"}])   # chat template, generation prompt
    text = tok.completion_text(output_ids)           # up to the first eos / stop string, no special tokens
    tok.save_pretrained("export/")                   # AutoTokenizer.from_pretrained("export/") gives the same ids

``Tokenizer`` is the protocol. ``CharTokenizer`` (one token per character, ids 0/1/2 = pad/bos/eos)
is the toy tasks' tokenizer; its ``save_pretrained`` writes a real ``tokenizers``-library tokenizer
(word-level over the characters, a character-splitting pre-tokenizer, a ``<bos>`` post-processor) that
``AutoTokenizer`` loads with the same ids. ``HFTokenizer`` wraps a Hugging Face tokenizer loaded from a
local directory (``local_files_only=True``: nothing is ever downloaded).

Stops: generation ends on a stop token (the tokenizer's eos, plus the extra ids a rollout passes: the
model's generation-config eos ids and configured ones) inside the engine; stop strings are
checked by ``StopStrings`` on the decoded tail of the output after every token (the engine's
``GenerationRequest.stop``), and ``completion_text`` cuts the text before the first one.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"

Messages = Sequence[Mapping[str, Any]]


@runtime_checkable
class Tokenizer(Protocol):
    """What the worker and the trainer need from a tokenizer."""

    @property
    def vocab_size(self) -> int:
        """Number of token ids (added tokens included); every id the tokenizer emits is below it."""
        ...

    @property
    def eos_token_id(self) -> int: ...

    @property
    def pad_token_id(self) -> int: ...

    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def stop_token_ids(self) -> list[int]:
        """Token ids that end a completion (eos first)."""
        ...

    @property
    def stop_strings(self) -> list[str]:
        """Strings that end a completion (checked on the decoded text)."""
        ...

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids`` up to the first eos, without special tokens."""
        ...

    def encode_prompt(self, prompt: str | None = None, messages: Messages | None = None) -> list[int]:
        """The prompt ids: a chat row (``messages``) through the chat template with the generation
        prompt; a plain ``prompt`` as it is (with the tokenizer's usual special tokens)."""
        ...

    def completion_text(self, ids: Sequence[int]) -> str:
        """The completion's text for a verifier: up to the first stop token or stop string."""
        ...

    def save_pretrained(self, directory: str | pathlib.Path) -> None:
        """Write files ``transformers.AutoTokenizer.from_pretrained(directory)`` loads with the same ids."""
        ...


def cut_at_stop_strings(text: str, stop_strings: Sequence[str]) -> str:
    """``text`` before the earliest stop string (all of it when none occurs)."""
    cut = len(text)
    for s in stop_strings:
        at = text.find(s)
        if s and at != -1:
            cut = min(cut, at)
    return text[:cut]


class StopStrings:
    """A stop predicate for ``GenerationRequest.stop``: true once the decoded output contains one of
    ``strings``. Decodes only the last ``window`` tokens (enough for the longest string when every
    token is at least one character), so the check costs the same at every step."""

    def __init__(self, tokenizer: Tokenizer, strings: Sequence[str], window: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.strings = [s for s in strings if s]
        self.window = window or (max((len(s) for s in self.strings), default=0) + 4)

    def __call__(self, output_ids: Sequence[int]) -> bool:
        if not self.strings:
            return False
        tail = self.tokenizer.decode(list(output_ids[-self.window :]))
        return any(s in tail for s in self.strings)


class CharTokenizer:
    """One token per character; ids 0, 1, 2 are ``<pad>``, ``<bos>``, ``<eos>``. Completions stop on
    ``<eos>`` (plus ``extra_stop_token_ids``) and on ``stop_strings``."""

    def __init__(self, chars: str, stop_strings: Sequence[str] = (), extra_stop_token_ids: Sequence[int] = ()) -> None:
        if len(set(chars)) != len(chars):
            raise ValueError("tokenizer characters must be distinct")
        self.chars = chars
        self.tokens = [PAD, BOS, EOS, *chars]
        self._ids = {ch: i for i, ch in enumerate(self.tokens) if len(ch) == 1}
        self.pad_token_id, self.bos_token_id, self.eos_token_id = 0, 1, 2
        self._stop_strings = list(stop_strings)
        self._stop_ids = list(dict.fromkeys([self.eos_token_id, *(int(i) for i in extra_stop_token_ids)]))

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @property
    def stop_token_ids(self) -> list[int]:
        return list(self._stop_ids)

    @property
    def stop_strings(self) -> list[str]:
        return list(self._stop_strings)

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        unknown = sorted(set(text) - self._ids.keys())
        if unknown:
            raise ValueError(f"characters not in the vocabulary: {unknown!r}")
        ids = [self._ids[ch] for ch in text]
        return [self.bos_token_id] * add_bos + ids + [self.eos_token_id] * add_eos

    def decode(self, ids: Sequence[int]) -> str:
        """The text up to the first ``<eos>``, without ``<pad>``/``<bos>``."""
        chars = []
        for i in ids:
            if i == self.eos_token_id:
                break
            if i not in (self.pad_token_id, self.bos_token_id):
                chars.append(self.tokens[i])
        return "".join(chars)

    def encode_prompt(self, prompt: str | None = None, messages: Messages | None = None) -> list[int]:
        """``<bos>`` + the prompt's characters. A chat row has no template here: its messages'
        contents are joined with newlines only if the alphabet has one, else refused."""
        if messages is not None:
            if "\n" not in self._ids:
                raise ValueError(
                    "CharTokenizer has no chat template (and no newline to join messages); "
                    "use a plain prompt or a Hugging Face tokenizer"
                )
            prompt = "\n".join(str(m.get("content", "")) for m in messages) + "\n"
        if prompt is None:
            raise ValueError("encode_prompt needs prompt or messages")
        return self.encode(prompt, add_bos=True)

    def completion_text(self, ids: Sequence[int]) -> str:
        return cut_at_stop_strings(self.decode(_before_stop(ids, self._stop_ids)), self._stop_strings)

    def backend(self):
        """The same tokenizer as a ``tokenizers.Tokenizer`` (word level over the characters, each
        character its own pre-token, ``<bos>`` prepended by the post-processor, no-space decoding)."""
        from tokenizers import Regex, decoders, models, pre_tokenizers, processors
        from tokenizers import Tokenizer as Backend

        backend = Backend(models.WordLevel({t: i for i, t in enumerate(self.tokens)}, unk_token=None))
        backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"(?m)."), behavior="isolated")
        backend.decoder = decoders.Fuse()
        backend.add_special_tokens([PAD, BOS, EOS])
        backend.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, self.bos_token_id)]
        )
        return backend

    def save_pretrained(self, directory: str | pathlib.Path) -> None:
        """``tokenizer.json`` and friends: ``AutoTokenizer.from_pretrained(directory)`` encodes a text
        to ``encode(text, add_bos=True)`` (``add_special_tokens=False``: without the ``<bos>``)."""
        from transformers import PreTrainedTokenizerFast

        fast = PreTrainedTokenizerFast(
            tokenizer_object=self.backend(), bos_token=BOS, eos_token=EOS, pad_token=PAD, clean_up_tokenization_spaces=False
        )
        fast.save_pretrained(str(directory))


class HFTokenizer:
    """A Hugging Face tokenizer from a local directory (``local_files_only``). Chat rows go through
    its chat template (``add_generation_prompt``), plain prompts are encoded as they are (with the
    special tokens the tokenizer adds by default, e.g. a BOS). Completions stop on its eos (plus
    ``extra_stop_token_ids``) and on ``stop_strings``."""

    def __init__(
        self,
        path: str | pathlib.Path,
        *,
        stop_strings: Sequence[str] = (),
        extra_stop_token_ids: Sequence[int] = (),
        tokenizer: Any = None,
    ) -> None:
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.path = str(path)
        self.hf = tokenizer
        if tokenizer.eos_token_id is None:
            raise ValueError(f"tokenizer at {path} has no eos token: a completion could never stop")
        self._stop_strings = [s for s in stop_strings if s]
        self._stop_ids = [int(tokenizer.eos_token_id)] + [int(i) for i in extra_stop_token_ids if i != tokenizer.eos_token_id]

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def eos_token_id(self) -> int:
        return int(self.hf.eos_token_id)

    @property
    def pad_token_id(self) -> int:
        pad = self.hf.pad_token_id
        return int(self.eos_token_id if pad is None else pad)

    @property
    def bos_token_id(self) -> int | None:
        bos = self.hf.bos_token_id
        return None if bos is None else int(bos)

    @property
    def stop_token_ids(self) -> list[int]:
        return list(self._stop_ids)

    @property
    def stop_strings(self) -> list[str]:
        return list(self._stop_strings)

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = list(self.hf.encode(text, add_special_tokens=False))
        if add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids + [self.eos_token_id] * add_eos

    def decode(self, ids: Sequence[int]) -> str:
        ids = list(ids)
        if self.eos_token_id in ids:
            ids = ids[: ids.index(self.eos_token_id)]
        return self.hf.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def encode_prompt(self, prompt: str | None = None, messages: Messages | None = None) -> list[int]:
        if messages is not None:
            if not getattr(self.hf, "chat_template", None):
                raise ValueError(f"tokenizer at {self.path} has no chat template; a chat row (messages) needs one")
            text = self.hf.apply_chat_template([dict(m) for m in messages], tokenize=False, add_generation_prompt=True)
            return list(self.hf.encode(text, add_special_tokens=False))  # the template writes its own specials
        if prompt is None:
            raise ValueError("encode_prompt needs prompt or messages")
        return list(self.hf.encode(prompt, add_special_tokens=True))

    def completion_text(self, ids: Sequence[int]) -> str:
        return cut_at_stop_strings(
            self.hf.decode(_before_stop(ids, self._stop_ids), skip_special_tokens=True, clean_up_tokenization_spaces=False),
            self._stop_strings,
        )

    def save_pretrained(self, directory: str | pathlib.Path) -> None:
        self.hf.save_pretrained(str(directory))


def load_tokenizer(
    path: str | pathlib.Path | None,
    *,
    default: CharTokenizer,
    stop_strings: Sequence[str] = (),
    extra_stop_token_ids: Sequence[int] = (),
) -> Tokenizer:
    """``None``: ``default`` (the toy tasks' ``rollbook.tasks.TOKENIZER``; passed in, since tasks.py
    imports this module), with ``stop_strings`` and ``extra_stop_token_ids`` if any; a directory: an
    ``HFTokenizer`` from it (a missing directory is a ``FileNotFoundError`` naming it). The extra ids
    of a rollout are ``rollbook.language_models.stop_token_ids``'s (rollout/worker.py ``use_model_stops``)."""
    if path is None:
        if not stop_strings and not set(extra_stop_token_ids) - {default.eos_token_id}:
            return default
        return CharTokenizer(default.chars, stop_strings=stop_strings, extra_stop_token_ids=extra_stop_token_ids)
    where = pathlib.Path(path)
    if not where.is_dir():
        raise FileNotFoundError(f"tokenizer directory {where} does not exist (tokenizers load from local files only)")
    return HFTokenizer(where, stop_strings=stop_strings, extra_stop_token_ids=extra_stop_token_ids)


def _before_stop(ids: Sequence[int], stop_ids: Sequence[int]) -> list[int]:
    """``ids`` up to (without) the first stop token."""
    ids = list(ids)
    first = min((ids.index(s) for s in stop_ids if s in ids), default=len(ids))
    return ids[:first]


def describe(tokenizer: Tokenizer) -> dict[str, Any]:
    """A small summary for logs and run directories."""
    return {
        "kind": type(tokenizer).__name__,
        "vocab_size": tokenizer.vocab_size,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "stop_strings": tokenizer.stop_strings,
    }
