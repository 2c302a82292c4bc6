"""Every environment variable Rollbook reads is read here, and only here.

==============================  ===================================================================
``ROLLBOOK_SERVER``             store address HOST:PORT for ``query``, ``stats``, ``admin`` (default
                                ``127.0.0.1:50551``, ``DEFAULT_SERVER``)
``ROLLBOOK_WORKER_KEY``         worker role key: Submit, SetReward, GetModel
``ROLLBOOK_TRAINER_KEY``        trainer role key: PullBatch, AckBatch, PublishVersion, ReportTrainStep
``ROLLBOOK_READER_KEY``         reader role key: Query, GetStats
``ROLLBOOK_ADMIN_KEY``          admin role key: every RPC, and the only one for RegisterModel
``ROLLBOOK_KEYS_FILE``          store: TOML key file of tenant-bound keys (docs/governance.md)
``ROLLBOOK_TLS_CERT``           server: PEM certificate (with ``ROLLBOOK_TLS_KEY``): serve TLS
``ROLLBOOK_TLS_KEY``            server: PEM key of ``ROLLBOOK_TLS_CERT``
``ROLLBOOK_TLS_CLIENT_CA``      server: PEM CA of client certificates (mutual TLS)
``ROLLBOOK_TLS_CA``             client: PEM CA that signed the server's certificate
``ROLLBOOK_TLS_CLIENT_CERT``    client: PEM certificate to present (mutual TLS)
``ROLLBOOK_TLS_CLIENT_KEY``     client: PEM key of ``ROLLBOOK_TLS_CLIENT_CERT``
``ROLLBOOK_TLS_SERVER_NAME``    client: the name checked in the server's certificate
``ROLLBOOK_BENCH_NOVALIDATE``   ``1``: the store skips the evidence rules (benchmarks only)
``ROLLBOOK_ARCHIVE_CRASH_AT``   tests only: the process moving rows into the archive SIGKILLs itself
                                at this named point of the move (store/archive.py ``CRASH_POINTS``)
``ROLLBOOK_REPLAY_CRASH_AFTER`` tests only: ``rollbook replay reward`` SIGKILLs itself instead of
                                committing the batch that brings its scored rows to this many
``ROLLBOOK_PARENT_PID``         set by ``rollbook run`` in its children: they stop when it dies
                                (rollbook/lifetime.py); not for users to set
``ROLLBOOK_QUERY_<FIELD>``      store: any ``query_*`` field of ``StoreConfig`` (SQL sandbox limits,
                                docs/sql.md), e.g. ``ROLLBOOK_QUERY_TIMEOUT_S=5``
==============================  ===================================================================

Keys and TLS paths live in the environment, never in a config file or on a command line others can
read in ``ps`` (docs/security.md). An empty value counts as unset. The list is also in the README.
"""

from __future__ import annotations

import os

DEFAULT_SERVER = "127.0.0.1:50551"

ROLES = ("worker", "trainer", "reader", "admin")

VARIABLES = (
    "ROLLBOOK_SERVER",
    *(f"ROLLBOOK_{role.upper()}_KEY" for role in ROLES),
    "ROLLBOOK_KEYS_FILE",
    "ROLLBOOK_TLS_CERT",
    "ROLLBOOK_TLS_KEY",
    "ROLLBOOK_TLS_CLIENT_CA",
    "ROLLBOOK_TLS_CA",
    "ROLLBOOK_TLS_CLIENT_CERT",
    "ROLLBOOK_TLS_CLIENT_KEY",
    "ROLLBOOK_TLS_SERVER_NAME",
    "ROLLBOOK_BENCH_NOVALIDATE",
    "ROLLBOOK_ARCHIVE_CRASH_AT",
    "ROLLBOOK_REPLAY_CRASH_AFTER",
    "ROLLBOOK_PARENT_PID",
)


def get(name: str) -> str | None:
    """The value of one of ``VARIABLES`` (None when unset or empty)."""
    if name not in VARIABLES:
        raise KeyError(f"{name} is not a Rollbook environment variable (rollbook/environment.py lists them)")
    return os.environ.get(name) or None


def server() -> str:
    """The store address: ``ROLLBOOK_SERVER``, else ``DEFAULT_SERVER``."""
    return get("ROLLBOOK_SERVER") or DEFAULT_SERVER


def role_key(role: str) -> str | None:
    return get(f"ROLLBOOK_{role.upper()}_KEY")


def keys() -> dict[str, str | None]:
    """``{"worker_key": ..., "trainer_key": ..., "reader_key": ..., "admin_key": ...}``."""
    return {f"{role}_key": role_key(role) for role in ROLES}


def server_tls() -> dict[str, str | None]:
    """``{"cert", "key", "client_ca"}`` of the store's (and the weight server's) TLS."""
    return {"cert": get("ROLLBOOK_TLS_CERT"), "key": get("ROLLBOOK_TLS_KEY"), "client_ca": get("ROLLBOOK_TLS_CLIENT_CA")}


def client_tls() -> dict[str, str | None]:
    """``{"ca", "cert", "key", "server_name"}`` of a client's TLS."""
    return {
        "ca": get("ROLLBOOK_TLS_CA"),
        "cert": get("ROLLBOOK_TLS_CLIENT_CERT"),
        "key": get("ROLLBOOK_TLS_CLIENT_KEY"),
        "server_name": get("ROLLBOOK_TLS_SERVER_NAME"),
    }


def validate_evidence() -> bool:
    return get("ROLLBOOK_BENCH_NOVALIDATE") != "1"


def archive_crash_point() -> str | None:
    """The named point of an archive move where the mover kills itself (``ROLLBOOK_ARCHIVE_CRASH_AT``;
    the crash tests' hook, never set in production)."""
    return get("ROLLBOOK_ARCHIVE_CRASH_AT")


def replay_crash_after() -> int | None:
    """The row count at which ``rollbook replay reward`` kills itself before a commit
    (``ROLLBOOK_REPLAY_CRASH_AFTER``; the resume tests' hook, never set in production)."""
    value = get("ROLLBOOK_REPLAY_CRASH_AFTER")
    return int(value) if value else None


# Ray reads its own settings from the environment. Its GCS writes a port file that the starting driver
# waits 30 s for; on a loaded 2-core machine the GCS can take longer, and ray.init fails with "Timed
# out waiting for file .../gcs_server_port_...". A local instance we start waits this long instead.
RAY_STARTUP = {"RAY_gcs_server_port_wait_time_s": "120"}


def prepare_local_ray() -> None:
    """Ray's startup settings (``RAY_STARTUP``) for an instance this process starts; a value the user
    set already wins."""
    for name, value in RAY_STARTUP.items():
        os.environ.setdefault(name, value)


# vLLM's engine core in this process (V1 otherwise runs it in a child process): VllmEngine installs
# new weights by calling a function on the model (LLM.apply_model), which then needs no pickling
VLLM_STARTUP = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def prepare_vllm() -> None:
    """vLLM's settings (``VLLM_STARTUP``) for an engine this process builds; a value the user set already wins."""
    for name, value in VLLM_STARTUP.items():
        os.environ.setdefault(name, value)


def with_keys(base: dict[str, str], keys: dict[str, str | None]) -> dict[str, str]:
    """A child process's environment: ``base`` without any role key, plus the given ones (so a child
    gets exactly the roles it is handed)."""
    roles = {f"ROLLBOOK_{role.upper()}_KEY" for role in ROLES}
    env = {k: v for k, v in base.items() if k not in roles}
    env.update({f"ROLLBOOK_{name.upper()}": key for name, key in keys.items() if key})
    return env


def query_settings(field_names: list[str]) -> dict[str, str]:
    """``ROLLBOOK_QUERY_<FIELD>`` values for the given ``query_*`` field names, where set."""
    out = {}
    for name in field_names:
        value = os.environ.get(f"ROLLBOOK_{name.upper()}") or None
        if value is not None:
            out[name] = value
    return out
