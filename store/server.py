"""Create and run the store's gRPC server.

``create_server(config) -> (server, port, ledger)`` builds everything without blocking (tests use
it in-process); ``serve(config)`` runs it until SIGINT/SIGTERM, printing ``listening on HOST:PORT``
as its first line (``rollbook serve --port 0`` relies on that).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import pathlib
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
from pydantic import BaseModel, Field, model_validator

from rollbook.store.ledger import Ledger
from rollbook.store.service import TrajectoryStoreService, handlers
from rollbook.store.sql import QueryLimits
from rollbook.validator.ingest import IngestConfig
from rollbook.validator.settle import ValidatorConfig

log = logging.getLogger("rollbook.store")

MAX_MESSAGE_BYTES = 64 << 20


class StoreConfig(BaseModel):
    """Configuration of ``rollbook serve``."""

    db: pathlib.Path = Field(pathlib.Path("runs/default/rollbook.duckdb"), description="DuckDB ledger file (created if missing); the write-ahead log lives beside it.")
    host: str = Field("127.0.0.1", description="Address to bind. A non-loopback address requires both keys.")
    port: int = Field(50551, ge=0, le=65535, description="Port to bind; 0 picks a free one.")
    admin_key: str | None = Field(None, description="Key for RegisterModel (env ROLLBOOK_ADMIN_KEY).")
    trainer_key: str | None = Field(None, description="Key for PublishVersion (env ROLLBOOK_TRAINER_KEY).")
    max_message_bytes: int = Field(MAX_MESSAGE_BYTES, ge=1 << 20, description="Largest gRPC message accepted; a bigger one is RESOURCE_EXHAUSTED.")
    num_workers: int = Field(32, ge=2, description="gRPC handler threads (each open Submit stream holds one).")
    # The SQL sandbox (docs/sql.md). Every query_* field can also be set as env ROLLBOOK_<FIELD>.
    query_max_rows: int = Field(100_000, ge=1, description="Row cap of one Query; the last chunk says when it cut.")
    query_timeout_s: float = Field(30.0, gt=0, le=3600, description="Per-query timeout in seconds: the default, and the most a caller may ask for (0, negative, NaN or inf mean this). A query still running query_kill_grace_s later has its sandbox process killed.")
    query_kill_grace_s: float = Field(2.0, ge=0.1, le=60, description="Seconds past the timeout before the server SIGKILLs the query's sandbox process (DuckDB's own interrupt comes first).")
    query_max_result_bytes: int = Field(256 << 20, ge=1 << 20, description="Byte cap of one Query's result (Arrow bytes); the result is cut there and the last chunk says so.")
    query_memory_limit_mb: int = Field(1024, ge=64, description="DuckDB memory_limit of each sandbox process, in MiB.")
    query_process_headroom_mb: int = Field(768, ge=128, description="Each sandbox process's data-segment limit (RLIMIT_DATA) is query_memory_limit_mb plus this; allocations past it fail inside the sandbox.")
    query_threads: int = Field(2, ge=1, le=64, description="DuckDB threads per sandbox process.")
    query_temp_limit_mb: int = Field(1024, ge=0, description="Spill space per sandbox process in its private temp folder, in MiB (0: no spilling).")
    query_workers: int = Field(2, ge=1, le=64, description="Sandbox processes: at most this many queries run at once. Query-engine memory is bounded by query_workers x (query_memory_limit_mb + query_process_headroom_mb).")
    query_queue: int = Field(8, ge=0, description="Queries that may wait for a free sandbox process; more are refused with RESOURCE_EXHAUSTED.")
    query_snapshot_max_age_s: float = Field(0.0, ge=0, description="Queries read a snapshot of the ledger; a new one is taken (checkpoint + file copy, under the ledger's lock) when the ledger changed and the current one is at least this old. 0: every query sees every acknowledged row; raise it when the ledger is large and queries frequent (see docs/sql.md for the cost).")
    ingest: IngestConfig = Field(default_factory=IngestConfig, description="Limits and tolerances of the ingest rules.")
    validator: ValidatorConfig = Field(default_factory=ValidatorConfig, description="Group readiness, normalization and lease settings.")
    validate_evidence: bool = Field(True, description="Run the evidence rules at ingest. Off only to measure their cost (env ROLLBOOK_BENCH_NOVALIDATE=1).")

    @model_validator(mode="after")
    def _keys_off_loopback(self) -> "StoreConfig":
        if not is_loopback(self.host) and not (self.admin_key and self.trainer_key):
            raise ValueError(
                f"refusing to bind non-loopback address {self.host!r} without keys: set ROLLBOOK_ADMIN_KEY and "
                "ROLLBOOK_TRAINER_KEY (or --admin-key/--trainer-key), or bind 127.0.0.1"
            )
        return self

    @classmethod
    def from_env(cls, **overrides) -> "StoreConfig":
        values = {"admin_key": os.environ.get("ROLLBOOK_ADMIN_KEY"), "trainer_key": os.environ.get("ROLLBOOK_TRAINER_KEY"),
                  "validate_evidence": os.environ.get("ROLLBOOK_BENCH_NOVALIDATE", "") != "1"}
        for name in cls.model_fields:
            if name.startswith("query_") and f"ROLLBOOK_{name.upper()}" in os.environ:
                values[name] = os.environ[f"ROLLBOOK_{name.upper()}"]
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def query_limits(self) -> QueryLimits:
        return QueryLimits(
            max_rows=self.query_max_rows, timeout_s=self.query_timeout_s, kill_grace_s=self.query_kill_grace_s,
            max_result_bytes=self.query_max_result_bytes, max_chunk_bytes=self.max_message_bytes - (1 << 20),
            memory_limit_mb=self.query_memory_limit_mb, process_headroom_mb=self.query_process_headroom_mb,
            threads=self.query_threads, temp_limit_mb=self.query_temp_limit_mb, workers=self.query_workers,
            queue=self.query_queue, snapshot_max_age_s=self.query_snapshot_max_age_s)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def create_server(config: StoreConfig, ledger: Ledger | None = None) -> tuple[grpc.Server, int, Ledger]:
    """The server (not started), its port and its ledger."""
    ledger = ledger or Ledger(config.db, ingest_config=config.ingest, validator_config=config.validator,
                              validate=config.validate_evidence)
    service = TrajectoryStoreService(
        ledger,
        admin_key=config.admin_key,
        trainer_key=config.trainer_key,
        query_limits=config.query_limits(),
    )
    options = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    server = grpc.server(ThreadPoolExecutor(max_workers=config.num_workers), options=options,
                         maximum_concurrent_rpcs=config.num_workers * 4)
    server.add_generic_rpc_handlers((handlers(service),))
    host = f"[{config.host}]" if ":" in config.host else config.host
    port = server.add_insecure_port(f"{host}:{config.port}")
    if port == 0:
        raise OSError(f"could not bind {config.host}:{config.port}")
    return server, port, ledger


def serve(config: StoreConfig) -> None:
    server, port, ledger = create_server(config)
    server.start()
    print(f"listening on {config.host}:{port}", flush=True)
    log.info("ledger %s", config.db)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    # Wait with a timeout: a signal that lands on one of gRPC's threads only wakes a main thread
    # that polls; a bare wait() can sleep through SIGTERM forever.
    while not done.wait(0.5):
        pass
    print("shutting down: draining streams and folding the log", file=sys.stderr, flush=True)
    server.stop(grace=5).wait()
    ledger.close()
