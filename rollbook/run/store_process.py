"""The run's store: a ``rollbook serve`` child process on the run directory's ledger
(``StoreProcess``), also used by the demo, the benches and the integration tests."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

from rollbook import environment as rollbook_env
from rollbook.lifetime import child_env


class StoreProcess:
    """A ``rollbook serve`` child process on the run directory's ledger. The keys go to it through
    the environment (never the command line, which other users can read in ``ps``); a role given no
    key stays open (loopback only). ``tls`` (``rollbook.tls.ServerTLS``) turns TLS on; ``client()``
    then needs ``client_tls``."""

    def __init__(
        self,
        db: pathlib.Path,
        *,
        admin_key: str | None = None,
        trainer_key: str | None = None,
        worker_key: str | None = None,
        reader_key: str | None = None,
        port: int = 0,
        env: dict[str, str] | None = None,
        tls=None,
        client_tls=None,
        extra_args: tuple[str, ...] = (),
        config_file: str | pathlib.Path | None = None,
    ):
        self.db = pathlib.Path(db)
        self.keys = {"worker_key": worker_key, "trainer_key": trainer_key, "reader_key": reader_key, "admin_key": admin_key}
        self.admin_key, self.trainer_key = admin_key, trainer_key
        self.client_tls = client_tls
        env = rollbook_env.with_keys(dict(os.environ if env is None else env), self.keys)
        args = ["--db", str(db), "--port", str(port), "--log-level", "WARNING", *extra_args]
        if config_file is not None:  # store policies (StoreConfig fields); the flags above win
            args += ["--config", str(config_file)]
        if tls is not None:
            args += ["--tls-cert", tls.cert, "--tls-key", tls.key] + (["--tls-client-ca", tls.client_ca] if tls.client_ca else [])
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rollbook.cli", "serve", *args], stdout=subprocess.PIPE, text=True, env=child_env(env)
        )
        line = self.proc.stdout.readline().strip()
        if not line.startswith("listening on "):
            self.proc.kill()
            raise RuntimeError(f"store did not start (exit {self.proc.wait()}): {line!r}")
        self.address = line.removeprefix("listening on ")

    def client(self, **kwargs):
        """A ``StoreClient`` holding every key."""
        from rollbook.client import StoreClient

        return StoreClient(self.address, **{**self.keys, "tls": self.client_tls, **kwargs})

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=60)
