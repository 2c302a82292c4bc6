"""Dataset files for the rollout worker: JSONL, Parquet and CSV rows mapped to prompts (or chat
messages), reference answers, tests, domains and task ids. Their configuration, ``DatasetConfig`` and ``FieldMap``, is in rollbook/config/rollout.py.

    config = DatasetConfig(train_files=["data/math.jsonl"], fields=FieldMap(prompt="question"))
    data = load_dataset(config, requirements={"math": ("answer",)})
    data.train[0]           # Row(task_id=..., domain="math", prompt=..., answer="12", source="data/math.jsonl:1")
    data.bad_rows           # [BadRow("data/math.jsonl", 7, "missing field 'answer'"), ...]
    sampler = RowSampler(data.train, shuffle=True, seed=0, epochs=2)
    batch = sampler.take(8)  # rows in a seeded order, epoch after epoch; [] once the epochs are done

Every file is read and every row checked when the dataset loads, so a bad row can never stop a run in
its middle: a row with a missing field, a wrong type, undecodable text (not UTF-8) or an invalid JSON
line is reported as ``file:line: reason`` (logged, and kept in ``bad_rows``) and skipped, or, with
``on_bad_row = "fail"``, refused at load time with every bad row named. Lines are 1-based file lines
(JSONL, CSV: the line where the record starts); Parquet rows are 1-based row numbers.

Splits: ``heldout_files`` when given; otherwise one row in ``1 / heldout_fraction`` goes to the
held-out split by a stable hash of its task id (the same row lands in the same split in every run).
A row without a task id gets one from a hash of its prompt (or messages), so it is stable too.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import pathlib
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollbook.config.rollout import DatasetConfig, FieldMap, Format
from rollbook.errors import ConfigError

log = logging.getLogger("rollbook.datasets")


class DatasetError(ConfigError):
    """The dataset cannot be used (a missing file, an unknown format, bad rows under ``on_bad_row = "fail"``):
    a ``ConfigError``, so the CLI says it in one line."""


@dataclass(frozen=True)
class Row:
    """One task of a dataset. ``prompt`` or ``messages`` is set; ``source`` is ``file:line``."""

    task_id: str
    domain: str
    prompt: str | None = None
    messages: tuple[Mapping[str, str], ...] | None = None
    answer: str | None = None
    tests: tuple[str, ...] | str | None = None
    source: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """What a verifier receives (``rollbook/rewards.py``): plain, picklable values."""
        return {
            "task_id": self.task_id,
            "domain": self.domain,
            "prompt": self.prompt,
            "messages": [dict(m) for m in self.messages] if self.messages is not None else None,
            "answer": self.answer,
            "tests": list(self.tests) if isinstance(self.tests, tuple) else self.tests,
            "source": self.source,
            "extra": dict(self.extra),
        }


@dataclass(frozen=True)
class BadRow:
    path: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


@dataclass
class Dataset:
    train: list[Row]
    heldout: list[Row]
    bad_rows: list[BadRow]


class _Bad(Exception):
    pass


def _format_of(path: pathlib.Path, fmt: Format) -> str:
    if fmt != "auto":
        return fmt
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    if suffix == ".csv":
        return "csv"
    raise DatasetError(f"{path}: cannot tell the format from the suffix {suffix!r}; set dataset.format")


def _records(path: pathlib.Path, fmt: str, max_rows: int | None):
    """``(line, record or _Bad)`` for every row of the file."""
    if fmt == "jsonl":
        with path.open("rb") as f:
            n = 0
            for line_no, raw in enumerate(f, start=1):
                if not raw.strip():
                    continue
                n += 1
                if max_rows is not None and n > max_rows:
                    return
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    yield line_no, _Bad(f"undecodable text (not UTF-8: {exc.reason} at byte {exc.start})")
                    continue
                try:
                    record = json.loads(text)
                except ValueError as exc:
                    yield line_no, _Bad(f"invalid JSON: {exc}")
                    continue
                yield line_no, record if isinstance(record, dict) else _Bad(f"not a JSON object but {type(record).__name__}")
    elif fmt == "csv":
        with path.open("rb") as f:
            data = f.read()
        text = data.decode("utf-8", errors="surrogateescape")
        reader = csv.reader(io.StringIO(text, newline=""))
        header = next(reader, None)
        if header is None:
            return
        start = reader.line_num + 1
        n = 0
        for values in reader:
            line_no, start = start, reader.line_num + 1
            if not any(v.strip() for v in values):
                continue
            n += 1
            if max_rows is not None and n > max_rows:
                return
            if any(_has_surrogates(v) for v in values):
                yield line_no, _Bad("undecodable text (not UTF-8)")
            elif len(values) != len(header):
                yield line_no, _Bad(f"{len(values)} values for {len(header)} columns")
            else:
                yield line_no, dict(zip(header, values))
    elif fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as exc:
            raise DatasetError(f"{path}: cannot read as Parquet: {exc}") from None
        for i, record in enumerate(table.to_pylist(), start=1):
            if max_rows is not None and i > max_rows:
                return
            yield i, record
    else:
        raise DatasetError(f"{path}: unknown format {fmt!r}")


def _has_surrogates(text: str) -> bool:
    return any("\udc80" <= ch <= "\udcff" for ch in text)


def _stable_id(stem: str, content: Any) -> str:
    digest = hashlib.blake2b(json.dumps(content, sort_keys=True, ensure_ascii=False).encode(), digest_size=6).hexdigest()
    return f"{stem}/{digest}"


def _maybe_json(value: Any, csv_text: bool) -> Any:
    if csv_text and isinstance(value, str) and value.strip()[:1] in ("[", "{"):
        try:
            return json.loads(value)
        except ValueError as exc:
            raise _Bad(f"invalid JSON in a CSV cell: {exc}") from None
    return value


def _row(
    record: Mapping[str, Any],
    m: FieldMap,
    config: DatasetConfig,
    stem: str,
    source: str,
    csv_text: bool,
    requirements: Mapping[str, Sequence[str]],
    known_domains: set[str] | None,
) -> Row:
    def cell(name: str) -> Any:
        value = record.get(name)
        return None if value is None or (csv_text and value == "") else value

    prompt, messages = cell(m.prompt), _maybe_json(cell(m.messages), csv_text)
    if prompt is None and messages is None:
        raise _Bad(f"missing field {m.prompt!r} (or {m.messages!r})")
    if prompt is not None and not isinstance(prompt, str):
        raise _Bad(f"field {m.prompt!r} must be text, got {type(prompt).__name__}")
    if messages is not None:
        if not isinstance(messages, list) or not messages:
            raise _Bad(f"field {m.messages!r} must be a non-empty list of {{role, content}}, got {type(messages).__name__}")
        for i, msg in enumerate(messages):
            if not (isinstance(msg, dict) and isinstance(msg.get("role"), str) and isinstance(msg.get("content"), str)):
                raise _Bad(f"field {m.messages!r}[{i}] must be an object with text 'role' and 'content'")
        messages = tuple({"role": msg["role"], "content": msg["content"]} for msg in messages)
    answer = cell(m.answer)
    if answer is not None:
        if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
            raise _Bad(f"field {m.answer!r} must be text or a number, got {type(answer).__name__}")
        answer = str(answer)
    tests = _maybe_json(cell(m.tests), csv_text)
    if tests is not None:
        if isinstance(tests, list):
            if not all(isinstance(t, str) for t in tests):
                raise _Bad(f"field {m.tests!r} must be a list of text")
            tests = tuple(tests)
        elif not isinstance(tests, str):
            raise _Bad(f"field {m.tests!r} must be a list of text or text, got {type(tests).__name__}")
    domain = cell(m.domain)
    if domain is None:
        domain = config.default_domain
    if domain is None:
        raise _Bad(f"missing field {m.domain!r} (and no default_domain)")
    if not isinstance(domain, str):
        raise _Bad(f"field {m.domain!r} must be text, got {type(domain).__name__}")
    if known_domains is not None and domain not in known_domains:
        raise _Bad(f"no reward configured for domain {domain!r} (configured: {sorted(known_domains)})")
    values = {"answer": answer, "tests": tests}
    for needed in requirements.get(domain, ()):
        if values.get(needed) is None:
            raise _Bad(f"missing field {getattr(m, needed)!r} (domain {domain!r} needs its {needed})")
    task_id = cell(m.task_id)
    if task_id is None:
        task_id = _stable_id(stem, prompt if prompt is not None else [dict(x) for x in messages])
    elif isinstance(task_id, (str, int)) and not isinstance(task_id, bool):
        task_id = str(task_id)
    else:
        raise _Bad(f"field {m.task_id!r} must be text or an integer, got {type(task_id).__name__}")
    mapped = {m.prompt, m.messages, m.answer, m.tests, m.domain, m.task_id}
    extra = {k: v for k, v in record.items() if k not in mapped}
    return Row(
        task_id=task_id, domain=domain, prompt=prompt, messages=messages, answer=answer, tests=tests, source=source, extra=extra
    )


def read_rows(
    paths: Sequence[str],
    config: DatasetConfig,
    *,
    requirements: Mapping[str, Sequence[str]] = {},
    known_domains: set[str] | None = None,
) -> tuple[list[Row], list[BadRow]]:
    """Every good row of ``paths`` in file order, and every bad one (each also logged as file:line)."""
    rows: list[Row] = []
    bad: list[BadRow] = []
    for name in paths:
        path = pathlib.Path(name)
        if not path.is_file():
            raise DatasetError(f"dataset file {path} does not exist")
        fmt = _format_of(path, config.format)
        for line, record in _records(path, fmt, config.max_rows):
            try:
                if isinstance(record, _Bad):
                    raise record
                rows.append(
                    _row(record, config.fields, config, path.stem, f"{path}:{line}", fmt == "csv", requirements, known_domains)
                )
            except _Bad as exc:
                bad.append(BadRow(str(path), line, str(exc)))
                if config.on_bad_row == "skip":  # under "fail" the refusal names every bad row, in one line
                    log.warning("bad row %s:%d: %s (skipped)", path, line, exc)
    return rows, bad


def heldout_bucket(task_id: str) -> float:
    """A stable number in [0, 1) from the task id (the same in every process and run)."""
    return int.from_bytes(hashlib.blake2b(task_id.encode(), digest_size=8).digest(), "big") / 2**64


def load_dataset(
    config: DatasetConfig, *, requirements: Mapping[str, Sequence[str]] = {}, known_domains: set[str] | None = None
) -> Dataset:
    """Read and check every row now. ``requirements``: the fields each domain's reward needs (a row
    without them is bad); ``known_domains``: the domains with a reward (a row of another is bad)."""
    train, bad = read_rows(config.train_files, config, requirements=requirements, known_domains=known_domains)
    if config.heldout_files:
        heldout, more_bad = read_rows(config.heldout_files, config, requirements=requirements, known_domains=known_domains)
        bad += more_bad
    else:
        heldout = [r for r in train if heldout_bucket(r.task_id) < config.heldout_fraction]
        train = [r for r in train if heldout_bucket(r.task_id) >= config.heldout_fraction]
    if bad and config.on_bad_row == "fail":
        shown = "; ".join(str(b) for b in bad[:20]) + (f"; ... and {len(bad) - 20} more" if len(bad) > 20 else "")
        raise DatasetError(f"{len(bad)} bad rows (on_bad_row = 'fail'): {shown}")
    if not train:
        raise DatasetError(f"no usable training rows in {config.train_files} ({len(bad)} bad rows)")
    return Dataset(train=train, heldout=heldout, bad_rows=bad)


class RowSampler:
    """Rows in order, epoch after epoch: shuffled by ``Random(f"{seed}/{epoch}")`` when ``shuffle``.
    ``epochs = 0`` never ends. ``take(n)`` returns fewer than ``n`` (possibly none) only at the end."""

    def __init__(self, rows: Sequence[Row], *, shuffle: bool = True, seed: int = 0, epochs: int = 0) -> None:
        if not rows:
            raise DatasetError("no rows to sample")
        self.rows = list(rows)
        self.shuffle, self.seed, self.epochs = shuffle, seed, epochs
        self.epoch, self._order, self._pos = 0, self._order_of(0), 0

    def _order_of(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(f"{self.seed}/{epoch}").shuffle(order)
        return order

    @property
    def exhausted(self) -> bool:
        return self.epochs > 0 and self.epoch >= self.epochs

    def take(self, n: int) -> list[Row]:
        out: list[Row] = []
        while len(out) < n and not self.exhausted:
            if self._pos == len(self._order):
                self.epoch += 1
                self._order, self._pos = self._order_of(self.epoch), 0
                continue
            out.append(self.rows[self._order[self._pos]])
            self._pos += 1
        return out
