"""Create and run the store's gRPC server.

``create_server(config) -> (server, port, ledger)`` builds everything without blocking (tests use
it in-process): ``server`` is a ``StoreServer``, a ``grpc.aio`` server on its own event-loop thread
with the blocking ``start()`` / ``stop(grace).wait()`` of a classic gRPC server. ``serve(config)``
runs it until SIGINT/SIGTERM, printing ``listening on HOST:PORT`` as its first line (``rollbook
serve --port 0`` relies on that).

Why aio: a classic gRPC server ties one handler thread to every open stream, so a few dozen idle
Submit streams starved every other caller. Here an open stream is a coroutine; the blocking work of
a batch, a query or a control call runs on one of three bounded thread pools (service.py).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import pathlib
import signal
import sys
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollbook.store.access import ROLES, KeyRing, check_keys
from rollbook.store.ledger import Ledger
from rollbook.store.service import AsyncStore, Pools, StreamLimits, TrajectoryStoreService, handlers
from rollbook.store.sql import QueryLimits
from rollbook.tls import ServerTLS, add_port
from rollbook.validator.groups import ValidatorConfig
from rollbook.validator.ingest import IngestConfig

log = logging.getLogger("rollbook.store")
T = TypeVar("T")

MAX_MESSAGE_BYTES = 64 << 20


def _key_field(role: str, rpcs: str) -> Any:  # a pydantic FieldInfo, typed Any like Field()
    # repr=False and exclude=True: a key never shows in a log line or a dumped config
    return Field(
        None,
        repr=False,
        exclude=True,
        description=f"The {role} role's key, for {rpcs} "
        f"(env ROLLBOOK_{role.upper()}_KEY). Unset on loopback leaves those RPCs open; required off loopback.",
    )


_LIMITS = QueryLimits()  # the query_* defaults live in one place, store/sql.py


class StoreConfig(BaseModel):
    """Configuration of ``rollbook serve`` (``--config FILE``, dotted overrides such as
    ``--validator.norm.mode group_mean``, ``rollbook serve --help-config``) and of the ``[store]``
    section of ``rollbook run``."""

    model_config = ConfigDict(extra="forbid")

    db: pathlib.Path = Field(
        pathlib.Path("runs/default/rollbook.duckdb"),
        description="DuckDB ledger file (created if missing); the write-ahead log lives beside it.",
    )
    host: str = Field(
        "127.0.0.1", description="Address to bind. A non-loopback address requires all four role keys, and TLS unless `insecure`."
    )
    port: int = Field(50551, ge=0, le=65535, description="Port to bind; 0 picks a free one.")
    worker_key: str | None = _key_field("worker", "Submit, SetReward and GetModel")
    trainer_key: str | None = _key_field("trainer", "PullBatch, AckBatch, PublishVersion and ReportTrainStep")
    reader_key: str | None = _key_field("reader", "Query and GetStats")
    admin_key: str | None = _key_field("admin", "RegisterModel and every other RPC")
    tls_cert: pathlib.Path | None = Field(
        None, description="PEM certificate (chain) of the server; with tls_key turns TLS on (env ROLLBOOK_TLS_CERT)."
    )
    tls_key: pathlib.Path | None = Field(None, description="PEM private key of tls_cert (env ROLLBOOK_TLS_KEY).")
    tls_client_ca: pathlib.Path | None = Field(
        None, description="PEM CA that must have signed every client's certificate: mutual TLS (env ROLLBOOK_TLS_CLIENT_CA)."
    )
    insecure: bool = Field(
        False, description="Allow a non-loopback address without TLS (keys then cross the network in clear text)."
    )
    max_message_bytes: int = Field(
        MAX_MESSAGE_BYTES, ge=1 << 20, description="Largest gRPC message accepted; a bigger one is RESOURCE_EXHAUSTED."
    )
    num_workers: int = Field(
        8, ge=1, description="Threads that prepare and commit Submit batches (an open stream holds none while it waits)."
    )
    control_workers: int = Field(
        8, ge=1, description="Threads for PullBatch, AckBatch, SetReward, GetStats and the other unary RPCs."
    )
    query_threads: int = Field(
        4, ge=1, description="Threads that run Query calls (so slow queries cannot hold up the control RPCs)."
    )
    max_submit_streams: int = Field(1024, ge=1, description="Open Submit streams in all; one more is RESOURCE_EXHAUSTED.")
    max_submit_streams_per_host: int = Field(
        256, ge=1, description="Open Submit streams from one client address (host); one more is RESOURCE_EXHAUSTED."
    )
    max_streams_per_connection: int = Field(
        128,
        ge=1,
        description="Concurrent RPCs on one connection (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS); more wait in the client.",
    )
    max_concurrent_rpcs: int = Field(8192, ge=16, description="Open RPCs in all; one more is RESOURCE_EXHAUSTED.")
    stream_idle_timeout_s: float = Field(
        120.0,
        gt=0,
        le=86400,
        description="A Submit stream that sends no batch, or reads no answer, for this long is closed (DEADLINE_EXCEEDED; StoreClient reconnects).",
    )
    # The SQL sandbox (docs/sql.md); defaults are QueryLimits'. Every query_* field can also be set
    # as env ROLLBOOK_<FIELD>.
    query_max_rows: int = Field(_LIMITS.max_rows, ge=1, description="Row cap of one Query; the last chunk says when it cut.")
    query_timeout_s: float = Field(
        _LIMITS.timeout_s,
        gt=0,
        le=3600,
        description="Per-query timeout in seconds: the default, and the most a caller may ask for (0, negative, NaN or inf mean this). A query still running query_kill_grace_s later has its sandbox process killed.",
    )
    query_kill_grace_s: float = Field(
        _LIMITS.kill_grace_s,
        ge=0.1,
        le=60,
        description="Seconds past the timeout before the server SIGKILLs the query's sandbox process (DuckDB's own interrupt comes first).",
    )
    query_max_result_bytes: int = Field(
        _LIMITS.max_result_bytes,
        ge=1 << 20,
        description="Byte cap of one Query's result (Arrow bytes); the result is cut there and the last chunk says so.",
    )
    query_memory_limit_mb: int = Field(
        _LIMITS.memory_limit_mb, ge=64, description="DuckDB memory_limit of each sandbox process, in MiB."
    )
    query_process_headroom_mb: int = Field(
        _LIMITS.process_headroom_mb,
        ge=128,
        description="Each sandbox process's data-segment limit (RLIMIT_DATA) is query_memory_limit_mb plus this; allocations past it fail inside the sandbox.",
    )
    query_duckdb_threads: int = Field(_LIMITS.threads, ge=1, le=64, description="DuckDB threads per sandbox process.")
    query_temp_limit_mb: int = Field(
        _LIMITS.temp_limit_mb,
        ge=0,
        description="Spill space per sandbox process in its private temp folder, in MiB (0: no spilling).",
    )
    query_workers: int = Field(
        _LIMITS.workers,
        ge=1,
        le=64,
        description="Sandbox processes: at most this many queries run at once. Query-engine memory is bounded by query_workers x (query_memory_limit_mb + query_process_headroom_mb).",
    )
    query_queue: int = Field(
        _LIMITS.queue,
        ge=0,
        description="Queries that may wait for a free sandbox process; more are refused with RESOURCE_EXHAUSTED.",
    )
    query_snapshot_max_age_s: float = Field(
        _LIMITS.snapshot_max_age_s,
        ge=0,
        description="Queries read a snapshot of the ledger; a new one is taken (checkpoint + file copy, under the ledger's lock) when the ledger changed and the current one is at least this old. 0: every query sees every acknowledged row; raise it when the ledger is large and queries frequent (see docs/sql.md for the cost).",
    )
    ingest: IngestConfig = Field(default_factory=IngestConfig, description="Limits and tolerances of the ingest rules.")
    validator: ValidatorConfig = Field(
        default_factory=ValidatorConfig, description="Group readiness, normalization and lease settings."
    )
    validate_evidence: bool = Field(
        True, description="Run the evidence rules at ingest. Off only to measure their cost (env ROLLBOOK_BENCH_NOVALIDATE=1)."
    )

    @model_validator(mode="after")
    def _access(self) -> "StoreConfig":
        loopback = is_loopback(self.host)
        check_keys(self.keys(), loopback=loopback)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together (--tls-cert/--tls-key, env ROLLBOOK_TLS_CERT/ROLLBOOK_TLS_KEY)")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca (mutual TLS) needs tls_cert and tls_key")
        if not loopback and self.tls_cert is None and not self.insecure:
            raise ValueError(
                f"refusing to bind non-loopback address {self.host!r} without TLS: give --tls-cert and "
                "--tls-key (env ROLLBOOK_TLS_CERT/ROLLBOOK_TLS_KEY), or --insecure to send keys in clear text"
            )
        return self

    def keys(self) -> dict[str, str | None]:
        return {role: getattr(self, f"{role}_key") for role in ROLES}

    def tls(self) -> ServerTLS | None:
        if self.tls_cert is None:
            return None
        return ServerTLS(str(self.tls_cert), str(self.tls_key), str(self.tls_client_ca) if self.tls_client_ca else None)

    @classmethod
    def from_env(cls, **overrides: Any) -> "StoreConfig":
        return cls(**{**env_values(), **{k: v for k, v in overrides.items() if v is not None}})

    def query_limits(self) -> QueryLimits:
        return QueryLimits(
            max_rows=self.query_max_rows,
            timeout_s=self.query_timeout_s,
            kill_grace_s=self.query_kill_grace_s,
            max_result_bytes=self.query_max_result_bytes,
            max_chunk_bytes=self.max_message_bytes - (1 << 20),
            memory_limit_mb=self.query_memory_limit_mb,
            process_headroom_mb=self.query_process_headroom_mb,
            threads=self.query_duckdb_threads,
            temp_limit_mb=self.query_temp_limit_mb,
            workers=self.query_workers,
            queue=self.query_queue,
            snapshot_max_age_s=self.query_snapshot_max_age_s,
        )


def env_values() -> dict:
    """The StoreConfig fields the environment sets: the four keys, the TLS files,
    ``ROLLBOOK_BENCH_NOVALIDATE`` and ``ROLLBOOK_QUERY_<FIELD>`` (read in rollbook/env.py)."""
    from rollbook import env

    tls = env.server_tls()
    values: dict[str, Any] = {**env.keys(), "tls_cert": tls["cert"], "tls_key": tls["key"], "tls_client_ca": tls["client_ca"]}
    values = {k: v for k, v in values.items() if v is not None}
    if not env.validate_evidence():
        values["validate_evidence"] = False
    values.update(env.query_settings([name for name in StoreConfig.model_fields if name.startswith("query_")]))
    return values


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class StoreServer:
    """A ``grpc.aio`` server and its event loop, on a thread of their own, behind a blocking API."""

    def __init__(self, build: Callable[[], Coroutine[Any, Any, tuple[grpc.aio.Server, int]]], pools: Pools):
        self.pools = pools
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="rollbook-grpc-loop", daemon=True)
        self._thread.start()
        try:
            self.server, self.port = self._call(build())
        except BaseException:
            self.loop.call_soon_threadsafe(self.loop.stop)
            raise

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> None:
        self._call(self.server.start())

    def stop(self, grace: float | None = None) -> threading.Event:
        """Stop accepting calls, give open ones ``grace`` seconds, then cancel them; the returned
        event is set once the server, its pools and its loop are down."""
        done = threading.Event()

        def finish(_future: object) -> None:
            for pool in (self.pools.ingest, self.pools.query, self.pools.control):
                pool.shutdown(wait=True)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=30)
            done.set()

        future = asyncio.run_coroutine_threadsafe(self.server.stop(grace), self.loop)
        future.add_done_callback(lambda f: threading.Thread(target=finish, args=(f,), daemon=True).start())
        return done


def create_server(config: StoreConfig, ledger: Ledger | None = None) -> tuple[StoreServer, int, Ledger]:
    """The server (not started), its port and its ledger."""
    ledger = ledger or Ledger(
        config.db, ingest_config=config.ingest, validator_config=config.validator, validate=config.validate_evidence
    )
    service = TrajectoryStoreService(ledger, query_limits=config.query_limits())
    pools = Pools(
        ingest=ThreadPoolExecutor(config.num_workers, thread_name_prefix="rollbook-ingest"),
        # enough threads for every query the sandbox admits (running + waiting), so an excess
        # one reaches the sandbox's RESOURCE_EXHAUSTED at once instead of an untimed backlog
        query=ThreadPoolExecutor(
            max(config.query_threads, config.query_workers + config.query_queue), thread_name_prefix="rollbook-query"
        ),
        control=ThreadPoolExecutor(config.control_workers, thread_name_prefix="rollbook-control"),
    )
    store = AsyncStore(
        service,
        KeyRing(config.keys()),
        StreamLimits(config.max_submit_streams, config.max_submit_streams_per_host, config.stream_idle_timeout_s),
        pools,
    )
    options = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 0),
        ("grpc.max_concurrent_streams", config.max_streams_per_connection),
        # find dead peers: ping a silent connection every minute, drop it after 20 s without an answer
        ("grpc.keepalive_time_ms", 60_000),
        ("grpc.keepalive_timeout_ms", 20_000),
    ]
    host = f"[{config.host}]" if ":" in config.host else config.host
    tls = config.tls()

    async def build() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server(options=options, maximum_concurrent_rpcs=config.max_concurrent_rpcs)
        server.add_generic_rpc_handlers((handlers(store),))
        return server, add_port(server, f"{host}:{config.port}", tls)

    try:
        server = StoreServer(build, pools)
    except RuntimeError as exc:  # grpc.aio raises RuntimeError when it cannot bind
        raise OSError(f"could not bind {config.host}:{config.port}: {exc}") from exc
    if server.port == 0:
        raise OSError(f"could not bind {config.host}:{config.port}")
    return server, server.port, ledger


def _check_port_free(host: str, port: int) -> None:
    """Refuse a port another process listens on in one line (before gRPC tries, which would log its
    own multi-line error first)."""
    import errno
    import socket

    from rollbook.errors import CommandError

    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
    except OSError:
        return  # gRPC reports an address it cannot resolve
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # as gRPC binds: a port whose old connections linger in TIME_WAIT (a store just restarted on it)
        # is free; only a listener makes it busy
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise CommandError(
                    f"cannot bind {host}:{port}: address already in use (another store? --port 0 picks a free one)"
                ) from None


def serve(config: StoreConfig, stop: threading.Event | None = None) -> None:
    """Run the store until ``stop`` is set (None: SIGINT/SIGTERM set it; the CLI passes
    ``rollbook.lifetime.stop_event()``, which a store started by ``rollbook run`` also sets when the run
    dies). A ledger another process holds, or an address that cannot be bound, is a ``CommandError``
    (one line from the CLI)."""
    import duckdb

    from rollbook.errors import CommandError

    _check_port_free(config.host, config.port)
    try:
        server, port, ledger = create_server(config)
    except duckdb.IOException as exc:
        if "lock" not in str(exc).lower():
            raise
        raise CommandError(
            f"ledger {config.db} is held by another process (another rollbook serve on it?): {' '.join(str(exc).split())[:300]}"
        ) from None
    except OSError as exc:
        raise CommandError(f"{exc} (is the port in use? --port 0 picks a free one)") from None
    server.start()
    print(f"listening on {config.host}:{port}", flush=True)
    log.info("ledger %s, TLS %s", config.db, "on" if config.tls_cert else "off")
    if config.tls_cert is None and not is_loopback(config.host):
        log.warning("--insecure: serving %s without TLS; keys cross the network in clear text", config.host)
    if stop is None:
        from rollbook.lifetime import stop_event  # a handler that takes no lock (StopEvent)

        stop = stop_event()
    # Wait with a timeout: a signal that lands on one of gRPC's threads only wakes a main thread
    # that polls; a bare wait() can sleep through SIGTERM forever.
    while not stop.wait(0.5):
        pass
    print("shutting down: draining streams and folding the log", file=sys.stderr, flush=True)
    _exit_if_stuck(SHUTDOWN_DEADLINE_S)
    server.stop(grace=5).wait()
    ledger.close()


SHUTDOWN_DEADLINE_S = 20.0  # from SIGTERM to exit: 5 s of gRPC grace, then the pools, the fold, DuckDB


def _exit_if_stuck(seconds: float) -> None:
    """A stop that hangs must not leave the store running, holding the ledger and its port (a
    ``rollbook run`` killed by SIGKILL counts on its store stopping; rollbook/lifetime.py). After
    ``seconds`` faulthandler's own thread, which needs no GIL, prints every thread's stack to stderr
    (what hung) and exits with status 1; ``SIGALRM``'s default action backs it up past interpreter
    teardown. Exiting there loses nothing: every acknowledged batch is in the fsync'd write-ahead log,
    and the next start folds it, as after a SIGKILL (docs/design.md, "Durability and exactly-once")."""
    import faulthandler

    faulthandler.dump_traceback_later(seconds, exit=True, file=sys.stderr)
    signal.alarm(int(seconds) + 10)
