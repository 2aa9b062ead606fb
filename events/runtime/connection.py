"""Connecting to NATS: the servers to try, who this client is, and one clear line for each refusal.

Shared by the event store (which connects) and the log reader (which asks the connection how many
servers the cluster has): neither imports the other for it.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Sequence

import msgspec
import nats.errors
import structlog
from nats.aio.client import Client as NATS

log = structlog.get_logger("llmgw.events.runtime.connection")


def inbox_prefix(user: str) -> str:
    """Where replies to ``user`` come: its own inbox, which no other user may subscribe to."""
    return f"_INBOX.{user}"


class NatsCredential(msgspec.Struct, frozen=True, kw_only=True):
    """What a client connects with: the content of ``DATA_DIR/nats/users/<user>.json`` (0600)."""

    user: str
    password: str

    @property
    def inbox_prefix(self) -> str:
        return inbox_prefix(self.user)


def server_list(urls: str | Sequence[str]) -> list[str]:
    """NATS URLs from a comma-separated string (``--nats nats://a:4222,nats://b:4222``) or a list."""
    items = urls.split(",") if isinstance(urls, str) else list(urls)
    return [u.strip() for u in items if u and u.strip()]


def cluster_replicas(connect_urls: Sequence[str] | None) -> int:
    """The replicas a stream gets when none were configured: the cluster's size (1 alone), at most 3."""
    return max(1, min(3, len(connect_urls or ())))


class StoreError(Exception):
    """The event store could not do what was asked; the message says what to check."""


class Quarantined(msgspec.Struct, frozen=True):
    """A position in the log that held an undecodable message; readers move past it."""

    subject: str
    seq: int
    error: str


def connect_urls(nc: NATS) -> list[str]:
    info = getattr(nc, "_server_info", None) or {}
    return list(info.get("connect_urls") or [])


class ConnectionLog:
    """What happens to the connection, logged; quiet once it is being closed on purpose."""

    def __init__(self) -> None:
        self.nc: NATS | None = None
        # A TLS handshake refused before the first connection: a certificate retries cannot fix.
        self.tls_refused: asyncio.Future[ssl.SSLError] = asyncio.get_running_loop().create_future()
        # Likewise a user or password the server refuses: the client would try it again for ever.
        self.auth_refused: asyncio.Future[Exception] = asyncio.get_running_loop().create_future()

    def closing(self) -> bool:
        return self.nc is not None and (self.nc.is_closed or self.nc.is_draining)

    async def error(self, exc: Exception) -> None:
        if self.nc is None and isinstance(exc, ssl.SSLError) and not self.tls_refused.done():
            self.tls_refused.set_result(exc)
            return
        if self.nc is None and is_auth_refusal(exc) and not self.auth_refused.done():
            self.auth_refused.set_result(exc)
            return
        if not self.closing():
            log.warning("NATS connection trouble", error=f"{type(exc).__name__}: {exc}")

    async def disconnected(self) -> None:
        if not self.closing():
            log.warning("NATS disconnected; reconnecting to another listed node")

    async def reconnected(self) -> None:
        url = self.nc.connected_url if self.nc is not None else None
        log.info("NATS reconnected", server=f"{url.hostname}:{url.port}" if url else None)


def tls_refusal(servers: Sequence[str], exc: ssl.SSLError, configured: bool) -> str:
    """One line for a TLS handshake with NATS that failed: whose certificate, and what to give."""
    why = getattr(exc, "verify_message", None) or exc.reason or str(exc)
    where = ", ".join(servers)
    if isinstance(exc, ssl.SSLCertVerificationError):
        fix = "give the CA that signed the NATS servers' certificates with --nats-ca FILE (or LLMGW_NATS_CA)"
        return f"the TLS certificate of NATS at {where} is not trusted ({why}): {fix}"
    if not configured:
        return f"NATS at {where} refused the connection during TLS ({why}): give --nats-ca FILE (or LLMGW_NATS_CA)"
    return (
        f"NATS at {where} refused this client's TLS certificate ({why}): give a valid certificate issued by the "
        "servers' CA with --nats-cert FILE --nats-key FILE (`llmgw ctl cert issue NAME --client`)"
    )


def is_auth_refusal(exc: BaseException) -> bool:
    """Whether the server refused the connection's user or password (or asked for one not given)."""
    return isinstance(exc, nats.errors.AuthorizationError) or "authorization violation" in str(exc).lower()


def auth_refusal(servers: Sequence[str], creds: NatsCredential | None) -> str:
    """One line for a NATS server that refused who this client said it was."""
    where = ", ".join(servers)
    if creds is None:
        return (
            f"NATS at {where} asks for a user and password: give a credential file with --nats-creds FILE "
            "(or LLMGW_NATS_CREDS); on the `llmgw up` machine: DATA_DIR/nats/users/<role>.json"
        )
    return (
        f"NATS at {where} refused the user {creds.user!r}: its password was rotated or the user is unknown there; "
        "use the current credential file (`llmgw ctl nats rotate` rewrites them, `llmgw ctl nats add-agent NODE` "
        "makes one for a node)"
    )
