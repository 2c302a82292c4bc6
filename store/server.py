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
    query_max_rows: int = Field(100_000, ge=1, description="Row cap of one Query; the last chunk says when it cut.")
    query_timeout_s: float = Field(30.0, gt=0, description="Per-query timeout in seconds.")
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
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


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
        query_limits=QueryLimits(max_rows=config.query_max_rows, timeout_s=config.query_timeout_s),
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
