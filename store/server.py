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
import logging
import signal
import sys
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import grpc

from rollbook.config import StoreConfig
from rollbook.config.store import is_loopback
from rollbook.store.access import KeyRing, load_key_file
from rollbook.store.archive import Schedule
from rollbook.store.ledger import Ledger
from rollbook.store.service import AsyncStore, Pools, StreamLimits, TrajectoryStoreService, handlers
from rollbook.store.sql import QueryLimits
from rollbook.tls import ServerTLS, add_port

log = logging.getLogger("rollbook.store")
T = TypeVar("T")


def store_tls(config: StoreConfig) -> ServerTLS | None:
    """The server's TLS credentials (``tls_cert``, ``tls_key``, ``tls_client_ca`` for mutual TLS), or
    None without TLS."""
    if config.tls_cert is None:
        return None
    return ServerTLS(str(config.tls_cert), str(config.tls_key), str(config.tls_client_ca) if config.tls_client_ca else None)


def query_limits(config: StoreConfig) -> QueryLimits:
    """The SQL sandbox's limits (store/sql.py) from the ``query_*`` fields."""
    return QueryLimits(
        max_rows=config.query_max_rows,
        timeout_s=config.query_timeout_s,
        kill_grace_s=config.query_kill_grace_s,
        max_result_bytes=config.query_max_result_bytes,
        max_chunk_bytes=config.max_message_bytes - (1 << 20),
        memory_limit_mb=config.query_memory_limit_mb,
        process_headroom_mb=config.query_process_headroom_mb,
        threads=config.query_duckdb_threads,
        temp_limit_mb=config.query_temp_limit_mb,
        workers=config.query_workers,
        queue=config.query_queue,
        snapshot_max_age_s=config.query_snapshot_max_age_s,
    )


def env_values() -> dict:
    """The StoreConfig fields the environment sets: the four keys, the key file, the TLS files,
    ``ROLLBOOK_BENCH_NOVALIDATE`` and ``ROLLBOOK_QUERY_<FIELD>`` (read in rollbook/environment.py)."""
    from rollbook import environment as env

    tls = env.server_tls()
    values: dict[str, Any] = {
        **env.keys(),
        "keys_file": env.get("ROLLBOOK_KEYS_FILE"),
        "tls_cert": tls["cert"],
        "tls_key": tls["key"],
        "tls_client_ca": tls["client_ca"],
    }
    values = {k: v for k, v in values.items() if v is not None}
    if not env.validate_evidence():
        values["validate_evidence"] = False
    values.update(env.query_settings([name for name in StoreConfig.model_fields if name.startswith("query_")]))
    return values


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
        config.db,
        ingest_config=config.ingest,
        validator_config=config.validator,
        validate=config.validate_evidence,
        detector_tokenizers=config.detector_tokenizers,
    )
    if config.ageing.interval_s > 0:  # [store.ageing]: trained rows into Parquet, stopped when the ledger closes
        Schedule(ledger, config.ageing).start()
    service = TrajectoryStoreService(ledger, query_limits=query_limits(config))
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
        KeyRing(config.keys(), load_key_file(config.keys_file) if config.keys_file is not None else None),
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
    tls = store_tls(config)

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


def _check_reward_version(ledger: Ledger, name: str | None) -> None:
    """Refuse to serve a reward version the ledger does not hold (``validator.reward_version``): its
    groups would never be served, and the trainer would wait without a word why."""
    from rollbook.errors import CommandError
    from rollbook.store import reward_versions

    if not name:
        return
    cur = ledger.cursor()
    try:
        known = reward_versions.state(cur, name)
    finally:
        cur.close()
    if known is None:
        ledger.close()
        raise CommandError(
            f"validator.reward_version {name!r}: {ledger.db_path} holds no such reward version "
            "(`rollbook replay reward --name` makes one; SELECT name FROM reward_version_runs lists them)"
        )


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
    _check_reward_version(ledger, config.validator.reward_version)
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
