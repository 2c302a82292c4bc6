"""The detector ingest rule: decode a model's rows and hold those where a redaction rule finds
something (an email address, a phone number, an API key, an IP address, a rule of your own), when
the model's policy names such rules (store/governance.py, docs/governance.md).

The store never loads a model: it decodes with the ``tokenizers`` library alone, from the
``tokenizer.json`` of the directory ``StoreConfig.detector_tokenizers`` names for the model (a
Hugging Face tokenizer directory, or what ``CharTokenizer.save_pretrained`` writes for the toy
tasks). The detectors are ``rollbook.redact``'s, the same that redact exports.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

DETECTOR_HIT = "DETECTOR_HIT"


class DetectorError(ValueError):
    """A detector rule or tokenizer the store cannot use (the message says what to fix)."""


class Scanner:
    """Decodes rows of the models it has a tokenizer for and runs detector rules over the text."""

    def __init__(self, tokenizers: Mapping[str, str | pathlib.Path] | None = None):
        self._paths = {model: pathlib.Path(path) for model, path in (tokenizers or {}).items()}
        self._decoders: dict[str, Any] = {}
        self._rules: dict[tuple[str, ...], tuple] = {}

    def models(self) -> list[str]:
        return sorted(self._paths)

    def decoder(self, model_id: str) -> Any:
        """The model's ``tokenizers.Tokenizer`` (loaded once); ``DetectorError`` if there is none."""
        found = self._decoders.get(model_id)
        if found is not None:
            return found
        path = self._paths.get(model_id)
        if path is None:
            raise DetectorError(
                f"the store has no tokenizer for model {model_id!r} to decode its rows with: start it with "
                f'[detector_tokenizers] "{model_id}" = "DIR" in its --config (a directory holding tokenizer.json)'
            )
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DetectorError("detector rules need the `tokenizers` package: pip install tokenizers") from None
        file = path / "tokenizer.json" if path.is_dir() else path
        try:
            found = Tokenizer.from_file(str(file))
        except Exception as exc:
            raise DetectorError(f"cannot load the tokenizer of model {model_id!r} from {file}: {exc}") from None
        self._decoders[model_id] = found
        return found

    def rules(self, names: Sequence[str]) -> tuple:
        """The parsed ``rollbook.redact`` rules (``DetectorError`` for an unknown one)."""
        key = tuple(names)
        found = self._rules.get(key)
        if found is None:
            from rollbook.errors import ConfigError
            from rollbook.redact import parse_rules

            try:
                found = parse_rules(list(names))
            except ConfigError as exc:
                raise DetectorError(str(exc)) from None
            self._rules[key] = found
        return found

    def hits(self, model_id: str, names: Sequence[str], token_lists: Sequence[Iterable[int]]) -> list[dict[str, int]]:
        """For each token list, how many regions each rule finds in its decoded text (empty: none)."""
        from rollbook.redact import find

        rules = self.rules(names)
        texts = self.decoder(model_id).decode_batch([list(map(int, ids)) for ids in token_lists], skip_special_tokens=True)
        out = []
        for text in texts:
            counts: dict[str, int] = {}
            for hit in find(text, rules):
                counts[hit.rule] = counts.get(hit.rule, 0) + 1
            out.append(counts)
        return out


def describe(prompt: dict[str, int], output: dict[str, int]) -> str:
    """An ingest hold's reason for these counts: the rules and where, never the matched text."""
    parts = []
    for where, counts in (("prompt", prompt), ("output", output)):
        if counts:
            parts.append(f"{where}: " + ", ".join(f"{rule} x{n}" for rule, n in sorted(counts.items())))
    return f"{DETECTOR_HIT}: " + "; ".join(parts)
