"""The two errors the ``rollbook`` command reports in one line, without a traceback.

``ConfigError``: the configuration is wrong (a missing file, a bad override, a value pydantic
refused, two settings that disagree): exit code 2. ``CommandError``: the command cannot do what it
was asked and the reason is the user's to fix (the store is down, the port is taken, the ledger is
held by another server, the run is already past the requested step): exit code 1. Anything else is a
bug or a failure mid-work and keeps its traceback. ``unreachable`` words a gRPC error that means
"the store is down or refused the key" for a ``CommandError``.
"""

from __future__ import annotations


class ConfigError(ValueError):
    pass


class CommandError(RuntimeError):
    pass


def one_line(exc: BaseException) -> str:
    """A pydantic ValidationError as ``field: message; ...``; anything else as its text on one line."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            return "; ".join(_where(e) + str(e.get("msg", "")).removeprefix("Value error, ") for e in errors())
        except Exception:  # noqa: BLE001 - fall back to the plain text
            pass
    return " ".join(str(exc).split())


def _where(error: dict) -> str:
    loc = ".".join(str(p) for p in error.get("loc", ()))
    return f"{loc}: " if loc else ""


def unreachable(exc: BaseException, address: str) -> str | None:
    """The one-line reason when ``exc`` is a gRPC error that says the store cannot be reached (or
    refuses the key); None for anything else."""
    import grpc

    if not isinstance(exc, grpc.RpcError):
        return None
    code = exc.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return f"store at {address} is not reachable ({code.name}): start it with `rollbook serve` or pass --server HOST:PORT"
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return f"store at {address} refused the key ({code.name}: {exc.details()}); set the role's ROLLBOOK_*_KEY"
    return None
