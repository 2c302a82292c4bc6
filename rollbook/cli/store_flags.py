"""What the ``rollbook`` subcommands that talk to a store share: the client flags and a
``StoreClient`` built from them and the environment (rollbook/environment.py). Its own module so that
``main`` and ``query`` both import it and not each other."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from rollbook.client import StoreClient


def client_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--reader-key", default=None, help="reader (or admin) key (default: env ROLLBOOK_READER_KEY, else ROLLBOOK_ADMIN_KEY)"
    )
    p.add_argument(
        "--tls-ca", default=None, help="PEM CA that signed the store's certificate: connect with TLS (env ROLLBOOK_TLS_CA)"
    )
    p.add_argument(
        "--tls-client-cert",
        default=None,
        help="PEM client certificate, for a store that requires one (env ROLLBOOK_TLS_CLIENT_CERT)",
    )
    p.add_argument("--tls-client-key", default=None, help="PEM key of --tls-client-cert (env ROLLBOOK_TLS_CLIENT_KEY)")


def store_client(args: argparse.Namespace, **kwargs: Any) -> StoreClient:
    """A ``StoreClient`` with the keys of the environment and the TLS files of the flags (or env)."""
    from rollbook.client import StoreClient
    from rollbook.tls import ClientTLS

    tls = ClientTLS.from_env()
    if args.tls_ca or args.tls_client_cert or args.tls_client_key:
        tls = ClientTLS(
            args.tls_ca or (tls.ca if tls else None),
            args.tls_client_cert or (tls.cert if tls else None),
            args.tls_client_key or (tls.key if tls else None),
            tls.server_name if tls else None,
        )
    return StoreClient.from_env(args.server, reader_key=getattr(args, "reader_key", None), tls=tls, **kwargs)
