"""An engine in a process of its own, driven as if it were in this one.

    engine = EngineProcess(functools.partial(build_native, config))   # the child builds the engine
    future = engine.submit(request, on_token=callback)                # as NativeEngine.submit
    engine.update_weights(state_dict, version=3)

Why: ``rollbook proxy`` serves HTTP (FastAPI, the session book, response building, the store's
submit stream) and runs the engine's decode loop, both Python. In one process they share one
interpreter lock: every small PyTorch op of a decode step releases and retakes it, and the HTTP
thread's work sits between them. Measured on the 2-core reference machine with 16 concurrent
sessions (bench/proxy.py), the proxy's process was busy on one core and held the lock more than half
of the time: the engine thread 52 % of those samples, the HTTP thread 37 % (FastAPI alone ~0.7 ms a
call), the submit stream 8 %, and the proxy served 0.45-0.58 of the engine's direct throughput.
vLLM's V1 server and SGLang split the same way (an API process and an engine-core process) for the
same reason. Here the decode loop runs in a child process; this process keeps the HTTP side.

What crosses the pipe (``multiprocessing`` connection, pickled): a request when it is submitted;
back, per scheduler step, every sampled token of every streamed request and every finished result,
batched into one message (sent by the child's scheduler thread at the end of the step, so no
sender thread wakes per result and takes the interpreter lock from the decoding thread). State
dicts travel through PyTorch's shared-memory tensor pickling, not the pipe's bytes.

Lifetime: the child is a daemon started with ``spawn`` (CUDA-safe) and exits within a second of
this process's death (``rollbook.lifetime.exit_with_parent``). If the child dies, every request in
flight fails with a ``RuntimeError`` saying so, and so does every later call.

``update_weights`` takes what ``NativeEngine`` takes: a state dict, or a callable that loads into a
model. The callable runs here against a stand-in whose ``load_state_dict`` copies what it is given
(``rollbook.weights.base.load_into`` and its torn-copy check work as with a real model); the copy
goes to the child.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

from rollbook.rollout.engine import GenerationRequest, GenerationResult, TokenCallback, Weights

log = logging.getLogger("rollbook.rollout")

START_TIMEOUT_S = 600.0  # building a large model from a local directory can take minutes


class EngineProcess:
    """A ``GenerationEngine`` (with ``submit``, ``release_memory`` and ``close``) whose engine lives in
    a child process built by ``build`` (a picklable callable returning the engine, run in the child)."""

    def __init__(self, build: Callable[[], Any], *, start_timeout_s: float = START_TIMEOUT_S, name: str = "rollbook-engine"):
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe(duplex=True)
        self._process = ctx.Process(target=_serve, args=(child, build, os.getpid()), daemon=True, name=name)
        self._process.start()
        child.close()
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # guards the tables below
        self._ids = itertools.count()
        self._requests: dict[int, tuple[Future[GenerationResult], TokenCallback | None]] = {}
        self._calls: dict[int, Future[Any]] = {}
        self._dead: str | None = None  # why every call now fails
        if not self._conn.poll(start_timeout_s):
            self._kill()
            raise RuntimeError(f"the engine process did not start within {start_timeout_s:g} s")
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError):
            self._process.join(5)
            raise RuntimeError(f"the engine process exited while starting (exit code {self._process.exitcode})") from None
        if kind == "failed":
            self._process.join(5)
            raise _unpack(payload)
        info: dict[str, Any] = payload
        self._version: int = info["version"]
        self.num_parameters: int = info["num_parameters"]
        self.max_top_logprobs: int = info["max_top_logprobs"]
        self.torch_threads: int = info["torch_threads"]
        self._reader = threading.Thread(target=self._read, name=f"{name}-reader", daemon=True)
        self._reader.start()

    # -- the engine's surface ---------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def submit(
        self, request: GenerationRequest, *, seed: int | None = None, index: int = 0, on_token: TokenCallback | None = None
    ) -> Future[GenerationResult]:
        """As ``NativeEngine.submit``; ``on_token`` is called from this object's reader thread."""
        future: Future[GenerationResult] = Future()
        future.set_running_or_notify_cancel()  # the child decodes it whatever the caller does: not cancellable
        with self._lock:
            self._raise_if_dead()
            rid = next(self._ids)
            self._requests[rid] = (future, on_token)
        self._send(("submit", rid, request, seed, index, on_token is not None))
        return future

    def generate(self, requests: list[GenerationRequest], *, seed: int | None = None) -> list[GenerationResult]:
        """As ``NativeEngine.generate``: request ``i`` samples as ``submit(r, seed=seed, index=i)``."""
        futures = [self.submit(r, seed=seed, index=i) for i, r in enumerate(requests)]
        return [f.result() for f in futures]

    def update_weights(self, weights: Weights, version: int) -> None:
        """As ``NativeEngine.update_weights``; a callable is run here against a copying stand-in."""
        state = weights if isinstance(weights, Mapping) else _materialize(weights)
        try:
            self._call("update_weights", state, version)
        except RuntimeError:
            raise
        except Exception as exc:
            raise RuntimeError(f"weight update to version {version} failed") from exc
        self._version = max(self._version, version)

    def pause(self) -> None:
        self._call("pause")

    def resume(self) -> None:
        self._call("resume")

    def release_memory(self) -> int:
        return int(self._call("release_memory"))

    def close(self) -> None:
        """Close the engine (what is in flight fails), then end the child. Idempotent."""
        if self._dead is None:
            try:
                self._call("close", timeout=60)
            except RuntimeError:
                pass
        self._fail_all("the engine was closed")
        with self._send_lock:
            self._conn.close()
        self._process.join(10)
        if self._process.is_alive():
            self._kill()

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the pipe --------------------------------------------------------------------------------------

    def _call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        future: Future[Any] = Future()
        with self._lock:
            self._raise_if_dead()
            cid = next(self._ids)
            self._calls[cid] = future
        self._send(("call", cid, method, args))
        return future.result(timeout)

    def _send(self, message: tuple) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError) as exc:  # the child is gone, or this end was closed
            self._fail_all(f"the engine process is gone ({type(exc).__name__}: {exc})")
            self._raise_if_dead()

    def _read(self) -> None:
        while True:
            try:
                batch = self._conn.recv()
            except (EOFError, OSError):
                self._process.join(5)
                self._fail_all(f"the engine process exited (exit code {self._process.exitcode})")
                return
            for message in batch:
                self._dispatch(message)

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "token":
            _, rid, args = message
            with self._lock:
                entry = self._requests.get(rid)
            if entry is not None and entry[1] is not None:
                try:
                    entry[1](*args)
                except Exception:  # a callback's failure is the caller's; the engine goes on
                    log.exception("on_token callback failed")
            return
        _, key, error, value = message
        with self._lock:
            future = self._requests.pop(key)[0] if kind == "done" else self._calls.pop(key)
        if error is not None:
            future.set_exception(_unpack(error))
        else:
            future.set_result(value)

    def _raise_if_dead(self) -> None:
        if self._dead is not None:
            raise RuntimeError(self._dead)

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            if self._dead is None:
                self._dead = reason
            futures = [f for f, _ in self._requests.values()] + list(self._calls.values())
            self._requests.clear()
            self._calls.clear()
        for future in futures:
            if not future.done():
                future.set_exception(RuntimeError(reason))

    def _kill(self) -> None:
        self._process.kill()
        self._process.join(5)


class _Capture:
    """A stand-in model for a weights callable: keeps a copy of the state dict it is loaded with."""

    state: dict | None = None

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        self.state = {k: v.detach().clone() for k, v in state.items()}


def _materialize(weights: Callable[[Any], Any]) -> Mapping[str, Any]:
    capture = _Capture()
    returned = weights(capture)
    state = returned if returned is not None else capture.state
    if state is None:
        raise RuntimeError("the weights callable loaded nothing (it neither called load_state_dict nor returned a state dict)")
    return state


# -- the child ------------------------------------------------------------------------------------------


def _serve(conn: Connection, build: Callable[[], Any], parent: int) -> None:
    """The child's main: build the engine, announce it, then run the parent's commands until the pipe
    closes. Results and sampled tokens go back batched, once per scheduler step."""
    from rollbook.lifetime import exit_with_parent

    exit_with_parent(parent)
    try:
        import torch

        engine = build()
        if not hasattr(engine, "on_step_end"):
            raise TypeError(
                f"an engine process needs an engine that calls on_step_end after each step (NativeEngine), not {type(engine).__name__}"
            )
        info = {
            "version": engine.version,
            "num_parameters": int(getattr(engine, "num_parameters", 0)),
            "max_top_logprobs": int(getattr(engine, "max_top_logprobs", 0)),
            "torch_threads": torch.get_num_threads(),
        }
    except BaseException as exc:
        conn.send(("failed", _pack(exc)))
        conn.close()
        return
    conn.send(("ready", info))
    outbox = _Outbox(conn)
    engine.on_step_end = outbox.flush  # the scheduler thread sends what each step produced
    try:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            if message[0] == "submit":
                _submit(engine, outbox, *message[1:])
            else:
                _, cid, method, args = message
                try:
                    outbox.post(("reply", cid, None, getattr(engine, method)(*args)))
                except BaseException as exc:
                    outbox.post(("reply", cid, _pack(exc), None))
            outbox.flush()  # what this thread posted (a reply, a refused request, what a call settled)
            if message[0] == "call" and message[2] == "close":
                break
    finally:
        engine.close()
        outbox.close()


def _submit(engine, outbox: _Outbox, rid: int, request: GenerationRequest, seed, index: int, stream: bool) -> None:
    def on_token(*args: Any) -> None:
        outbox.post(("token", rid, args))

    def finished(future: Future) -> None:
        error = future.exception()
        outbox.post(("done", rid, _pack(error), None) if error is not None else ("done", rid, None, future.result()))

    try:
        future = engine.submit(request, seed=seed, index=index, on_token=on_token if stream else None)
    except BaseException as exc:
        outbox.post(("done", rid, _pack(exc), None))
        return
    future.add_done_callback(finished)


class _Outbox:
    """Messages for the parent, sent in batches: everything posted since the last ``flush`` goes in one
    message (one pickle and one write per scheduler step instead of one per token). The engine's
    scheduler thread flushes after each step (``NativeEngine.on_step_end``) and the command loop
    after each command, so no thread of its own wakes for each result and takes the interpreter
    lock from the decoding thread."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._items: list[tuple] = []
        self._lock = threading.Lock()  # guards _items
        self._send_lock = threading.Lock()  # one writer at a time, batches in the order they were taken
        self._gone = False  # the parent's end is closed: nothing more is sent

    def post(self, item: tuple) -> None:
        with self._lock:
            self._items.append(item)

    def flush(self) -> None:
        with self._send_lock:
            with self._lock:
                items, self._items = self._items, []
            if items and not self._gone:
                try:
                    self._conn.send(items)
                except (OSError, ValueError):  # the parent is gone
                    self._gone = True

    def close(self) -> None:
        self.flush()
        with self._send_lock:
            self._gone = True
            self._conn.close()


def _pack(exc: BaseException) -> tuple[BaseException, BaseException | None]:
    """An exception and its cause, each pickle-safe (pickling an exception drops ``__cause__``, which
    the proxy reports: a weight update's "failed" names what failed in its cause)."""
    return _portable(exc), (_portable(exc.__cause__) if exc.__cause__ is not None else None)


def _unpack(packed: tuple[BaseException, BaseException | None]) -> BaseException:
    exc, cause = packed
    if cause is not None:
        exc.__cause__ = cause
    return exc


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else a ``RuntimeError`` with its text (the parent raises it)."""
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
