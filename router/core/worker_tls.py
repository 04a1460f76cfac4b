"""TLS toward the workers (sgl-router's and SMG's --client-cert-path, --client-key-path, --ca-cert-paths): one
client context for both of the router's clients (the legs' pool and the control plane's session), made once at
start-up.

As the peers' reqwest client: the CA bundles are trusted besides the system's own store (they add root
certificates, they do not replace the store), the worker's name or IP is checked against its certificate, and
the client certificate (with its key) is presented to a worker that asks for one (mTLS).
"""

from __future__ import annotations

import ssl


class WorkerTlsError(ValueError):
    """A certificate, key or CA bundle that does not load: the message names the flag and the file."""


def worker_ssl_context(client_cert_path: str | None, client_key_path: str | None,
                       ca_cert_paths: tuple[str, ...]) -> ssl.SSLContext | None:
    """The context for https:// workers; None when no flag asks for one (the system's defaults then)."""
    if client_cert_path is None and not ca_cert_paths:
        return None
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    for path in ca_cert_paths:
        try:
            context.load_verify_locations(cafile=path)
        except (OSError, ssl.SSLError) as exc:
            raise WorkerTlsError(f"--ca-cert-paths {path}: {_why(exc)}") from None
    if client_cert_path is not None:
        try:
            context.load_cert_chain(client_cert_path, client_key_path)
        except (OSError, ssl.SSLError) as exc:
            raise WorkerTlsError(f"--client-cert-path {client_cert_path} / --client-key-path {client_key_path}: "
                                 f"{_why(exc)}") from None
    return context


def _why(exc: BaseException) -> str:
    """ssl's short reason ("PEM lib", "NO_CERTIFICATE_OR_CRL_FOUND"), else the OS's ("No such file or directory")."""
    return getattr(exc, "reason", None) or getattr(exc, "strerror", None) or str(exc)
