"""Loading a config: one TOML per runnable scenario in ``configs/``, dotted overrides on the command
line (``--trainer.lr 1e-4 --rollout.group_size 4``), the resolved config written into the run
directory. Every command (``run``, ``train``, ``rollout``, ``proxy``, ``serve``) loads its config
through ``load_config`` and lists its fields with ``--help-config`` (``field_help``)."""

from __future__ import annotations

import json
import pathlib
import tomllib
import types
import typing
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ValidationError

from rollbook.errors import ConfigError, one_line

M = TypeVar("M", bound=BaseModel)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["--trainer.lr", "1e-4", "--placement=separated"]`` -> nested dict; values parse as TOML
    scalars when they can (numbers, booleans, arrays), else as strings."""
    out: dict[str, Any] = {}
    it = iter(items)
    for item in it:
        if not item.startswith("--"):
            raise ConfigError(f"expected --dotted.key VALUE, got {item!r}")
        key, eq, value = item[2:].partition("=")
        if not eq:
            following = next(it, None)
            if following is None:
                raise ConfigError(f"override {item} has no value")
            value = following
        node = out
        *parents, leaf = key.replace("-", "_").split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = _scalar(value)
    return out


def _scalar(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _merge(base: dict, extra: dict) -> dict:
    for k, v in extra.items():
        base[k] = _merge(base.get(k, {}), v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return base


def read_config_file(path: str | pathlib.Path) -> dict[str, Any]:
    """A TOML (or, by its ``.json`` suffix, JSON) config file as a dict; ``ConfigError`` when it is
    missing or does not parse."""
    path = pathlib.Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} not found (the examples are in configs/)") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror or exc}") from None
    try:
        return json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {str(path)!r} does not parse: {exc}") from None


def load_config(
    model: type[M],
    path: str | None,
    overrides: list[str],
    base: dict[str, Any] | None = None,
    final: dict[str, Any] | None = None,
) -> M:
    """``base`` (e.g. values from the environment), then the file, then the dotted overrides, then
    ``final`` (e.g. explicit flags); a missing file, a bad override or a refused value is a
    ``ConfigError`` in one line."""
    data: dict[str, Any] = dict(base or {})
    if path:
        data = _merge(data, read_config_file(path))
    try:
        data = _merge(_merge(data, parse_overrides(overrides)), dict(final or {}))
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(one_line(exc)) from None
    except ConfigError:
        raise
    except ValueError as exc:  # parse_overrides
        raise ConfigError(str(exc)) from None


def field_help(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every field of ``model`` as ``--dotted.name  TYPE  (default: VALUE)`` and its description,
    nested models expanded: what ``--help-config`` prints."""
    lines: list[str] = []
    for name, info in model.model_fields.items():
        nested = _model_of(info.annotation)
        dotted = f"{prefix}{name}"
        if nested is not None:
            if info.description:
                lines.append(f"[{dotted}]  {info.description}")
            lines += field_help(nested, f"{dotted}.")
            continue
        if info.exclude:  # keys: never in a config file, read from the environment
            default = "from the environment"
        elif info.is_required():
            default = "required"
        else:
            value = info.get_default(call_default_factory=True)
            default = repr(str(value) if isinstance(value, pathlib.PurePath) else value)
        lines.append(f"--{dotted}  {_type_name(info.annotation)}  (default: {default})")
        if info.description:
            lines.append(f"      {info.description}")
        inner = _inner_model(info.annotation)  # an optional section or a table of sections: their fields too
        if inner is not None:
            lines += field_help(inner[1], f"{dotted}.{inner[0]}")
    return lines


def _inner_model(annotation: Any) -> tuple[str, type[BaseModel]] | None:
    """``Model | None`` -> ("", Model); ``dict[str, Model]`` -> ("<key>.", Model); else None."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        models = [m for m in map(_model_of, args) if m is not None]
        return ("", models[0]) if len(models) == 1 else None
    if origin is dict and len(args) == 2 and _model_of(args[1]) is not None:
        return ("<key>.", args[1])
    return None


def _model_of(annotation: Any) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _type_name(annotation: Any) -> str:
    if annotation is type(None):
        return "None"
    if isinstance(annotation, type) and not typing.get_args(annotation):
        return annotation.__name__
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Literal:
        return "|".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is not None:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(_type_name(a) for a in args)}]"
    return str(annotation).replace("typing.", "")


def write_resolved(config: BaseModel, run_dir: str | pathlib.Path) -> pathlib.Path:
    path = pathlib.Path(run_dir) / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config.model_dump(mode="json"), indent=2) + "\n")
    return path
