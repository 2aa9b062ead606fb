"""The CLI's two ways in: the bus (commands, the log) and the admin API (read models).

Errors follow one small hierarchy (:mod:`llmgw.events.commands.errors`): rejected, timed out,
unreachable; each becomes one line on stderr and its own exit code.
"""

from __future__ import annotations

import asyncio
import http.client
import os
import ssl
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import msgspec

from llmgw.cli.context import Target, default_data_dir, resolve
from llmgw.events.commands.errors import CommandError, CommandRejectedError, Unreachable

# The bus (NATS, the store, signing) is imported by the Session's methods when a command first uses
# it, so a command that only reads the admin API never waits for NATS's imports (docs/benchmarks.md,
# "The CLI's start"); the admin API is called with the standard library (cli/admin_http.py).
if TYPE_CHECKING:
    from llmgw.events.commands.auth import TokenSigner
    from llmgw.events.runtime.connection import NatsCredential
    from llmgw.events.runtime.store import EventStore
    from llmgw.events.schema.outcomes import CommandCompleted

CONNECT_GIVE_UP_S = 10.0  # a person waits this long for NATS, then is told it cannot be reached (exit 4)


class Session:
    """One CLI invocation's connections, opened lazily."""

    def __init__(self, target: Target, *, ca: str | None = None) -> None:
        self.target = target
        self.ca = ca  # the CA an https admin API's certificate is checked against (None: the system's)
        self._store: EventStore | None = None
        self._tls: ssl.SSLContext | None = None  # the admin API's, made at its first call

    async def store(self) -> EventStore:
        if self._store is None:
            from llmgw.cli.natsd import CredentialError, read_credential
            from llmgw.events.runtime.connection import StoreError
            from llmgw.events.runtime.store import EventStore
            from llmgw.events.schema.catalog import default_registry

            tls_files = (
                os.environ.get("LLMGW_NATS_CA"),
                os.environ.get("LLMGW_NATS_CERT"),
                os.environ.get("LLMGW_NATS_KEY"),
            )
            if any(tls_files):  # the PKI (and cryptography's x509) is loaded only for NATS over TLS
                from llmgw.infra import pki

                try:
                    tls = nats_tls(*tls_files)
                except pki.PkiError as exc:
                    raise CommandError(str(exc)) from exc
            else:
                tls = None
            try:
                creds = read_credential(self.target.nats_creds) if self.target.nats_creds else None
                self._store = await EventStore.connect(
                    self.target.nats_url, default_registry(), tls=tls, creds=creds, give_up_s=CONNECT_GIVE_UP_S
                )
            except CredentialError as exc:
                raise CommandError(str(exc)) from exc
            except StoreError as exc:
                raise Unreachable(str(exc)) from exc
        return self._store

    async def command(
        self, service: str, verb: str, payload: msgspec.Struct, timeout: float = 15.0
    ) -> CommandCompleted:
        from llmgw.events.commands.client import CommandClient

        client = CommandClient(await self.store(), self.signer())
        # The actor is left to the verifier: the person whose token signed it (docs/people.md, Signed commands).
        return await client.send(service, verb, payload, actor="", timeout=timeout)

    def signer(self) -> TokenSigner:
        """Commands are signed with the person's token: `llmgw login`'s, $LLMGW_TOKEN, or this machine's admin's."""
        from llmgw.events.commands.auth import TokenSigner

        if not self.target.token:
            raise CommandRejectedError(
                "sign in first: `llmgw login` (or set LLMGW_TOKEN to a personal token); commands are signed "
                "with your token"
            )
        try:
            return TokenSigner(self.target.token)
        except ValueError as exc:
            raise CommandError(f"the token in use cannot sign commands: {exc}") from exc

    async def api(
        self, method: str, path: str, *, params: dict[str, Any] | None = None, json: Any = None, timeout: float = 120.0
    ) -> Any:
        if not self.target.api_url:
            raise Unreachable("no admin API address: pass --api URL (or LLMGW_API_URL), or run `llmgw up`")
        from llmgw.cli.admin_http import call, in_thread

        if self._tls is None and self.target.api_url.lower().startswith("https:"):
            from llmgw.infra import pki  # and cryptography's x509: only for an https admin API

            try:
                self._tls = api_tls(self.ca)
            except (pki.PkiError, ssl.SSLError) as exc:
                raise CommandError(
                    f"cannot trust the CA {self.ca} ({exc}): give a CA certificate with --ca FILE"
                ) from exc
        url = self.target.api_url.rstrip("/") + path
        headers = {"Authorization": f"Bearer {self.target.token}"} if self.target.token else {}
        context = self._tls
        try:
            answer = await in_thread(
                lambda: call(method, url, params=params, body=json, headers=headers, context=context, timeout=timeout)
            )
        except ssl.SSLCertVerificationError as exc:
            trusted = f"the CA {self.ca}" if self.ca else "this machine's CAs"
            raise Unreachable(
                f"the admin API at {self.target.api_url} has a certificate {trusted} does not vouch for "
                f"({exc}): give the CA that issued it with --ca FILE (or LLMGW_CA)"
            ) from exc
        except TimeoutError as exc:
            raise Unreachable(f"the admin API at {self.target.api_url} did not answer within {timeout:.0f}s") from exc
        except (OSError, http.client.HTTPException) as exc:
            raise Unreachable(
                f"the admin API at {self.target.api_url} did not answer ({exc}); is `llmgw up` running?"
            ) from exc
        body = answer.body
        if answer.status >= 400:
            error = (body or {}).get("error", {}) if isinstance(body, dict) else {}
            message = error.get("message") or f"{method} {path} answered {answer.status}"
            if answer.status < 500:  # refused: the reason says what to do (exit 2)
                raise CommandRejectedError(message, error.get("code") or str(answer.status))
            raise CommandError(message)
        return body

    async def close(self) -> None:
        if self._store is not None:
            await self._store.close()


def run(ctx: click.Context, fn: Callable[[Session], Awaitable[int | None]]) -> None:
    """Run one async CLI action; a :class:`CommandError` is one line on stderr and its exit code."""
    opts = ctx.find_root().obj or {}

    async def main() -> int:
        try:
            target = resolve(opts.get("nats"), opts.get("api"), opts.get("data_dir"), opts.get("nats_creds"))
        except CommandError as exc:
            click.echo(f"error: {exc}", err=True)
            return exc.exit_code
        session = Session(target, ca=trusted_ca(opts.get("ca"), opts.get("data_dir")))
        try:
            return (await fn(session)) or 0
        except CommandError as exc:
            click.echo(f"error: {exc}", err=True)
            return exc.exit_code
        finally:
            await session.close()

    code = asyncio.run(main())
    sys.exit(code)


# -- TLS ---------------------------------------------------------------------------------------


def trusted_ca(chosen: str | None, data_dir: str | None) -> str | None:
    """The CA an https admin API is checked against: ``--ca``/``$LLMGW_CA``, else ``DATA_DIR/pki/ca.crt``
    when `llmgw ctl cert ca` made one there, else None (the system's CAs)."""
    if chosen:
        return chosen
    mine = (Path(data_dir).expanduser() if data_dir else default_data_dir()) / "pki" / "ca.crt"
    return str(mine) if mine.exists() else None


def api_tls(ca: str | None) -> ssl.SSLContext:
    """The client context for the admin API: TLS ≥ 1.2, the certificate checked against ``ca``."""
    from llmgw.infra import pki

    return pki.client_context(ca, now=time.time())


def nats_tls(ca: str | None, cert: str | None, key: str | None) -> ssl.SSLContext | None:
    """The context to reach NATS over TLS with (None: plain); :class:`pki.PkiError` names what is wrong."""
    if not (ca or cert or key):
        return None
    from llmgw.infra import pki

    if bool(cert) != bool(key):
        raise pki.PkiError("a NATS client certificate needs both --nats-cert FILE and --nats-key FILE")
    return pki.client_context(ca, cert, key, now=time.time())


def nats_creds_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--nats-creds FILE``: the NATS user a process connects as (`server`, `agent`; the CLI's is global)."""
    return click.option(
        "--nats-creds",
        envvar="LLMGW_NATS_CREDS",
        help="Connect to NATS as the user in this credential file ($LLMGW_NATS_CREDS; `llmgw up` makes one per "
        "role in DATA_DIR/nats/users/, `llmgw ctl nats add-agent NODE` one per node).",
    )(fn)


def load_creds(path: str | None) -> NatsCredential | None:
    """The credential in ``path`` (None: connect with no user); a click error naming what to do."""
    if not path:
        return None
    from llmgw.cli.natsd import CredentialError, read_credential

    try:
        return read_credential(path)
    except CredentialError as exc:
        raise click.ClickException(str(exc)) from exc


def nats_tls_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--nats-ca``/``--nats-cert``/``--nats-key``: NATS over TLS, with a client certificate when the
    servers verify one (`server`, `agent`; other commands read the same variables)."""
    fn = click.option("--nats-key", envvar="LLMGW_NATS_KEY", help="The key of --nats-cert ($LLMGW_NATS_KEY).")(fn)
    fn = click.option(
        "--nats-cert",
        envvar="LLMGW_NATS_CERT",
        help="This process's client certificate, for NATS servers that verify clients ($LLMGW_NATS_CERT; "
        "`llmgw ctl cert issue NAME --client`).",
    )(fn)
    return click.option(
        "--nats-ca",
        envvar="LLMGW_NATS_CA",
        help="Reach NATS over TLS, trusting this CA certificate for the servers' ($LLMGW_NATS_CA).",
    )(fn)
