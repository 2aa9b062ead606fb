"""What `llmgw up` and `llmgw server` share: their serving flags, how a flag given on the command
line layers over the config file, and the checks both make before anything starts."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from typing import Any

import click

from llmgw.cli.natsd import port_free
from llmgw.infra import pki
from llmgw.services.api.exposure import exposure_refusal
from llmgw.services.mirror.hub import DEFAULT_HUB


def hub_token() -> str | None:
    """HF_TOKEN, else the token `hf auth login` stored: what huggingface_hub itself would use."""
    from huggingface_hub import get_token

    return get_token()


def http_ports_problem(listeners: list[tuple[str, str, int]]) -> str | None:
    """Why `up` could not listen on one of its HTTP ports — ``(what, host, port)`` each, port 0 for
    any — asked before anything starts, so a taken port costs no NATS start and no service's."""
    seen: dict[int, str] = {}
    for what, host, port in listeners:
        if not port:
            continue
        if port in seen:
            return f"{port} is both {seen[port]} and {what}: give each its own port"
        seen[port] = what
        if not port_free(port, host):
            return f"cannot listen on {host}:{port}, {what}: another program listens there; choose another port"
    return None


def mirror_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The mirror's options, shared by `up` and `server`."""
    fn = click.option(
        "--hf-endpoint",
        envvar="HF_ENDPOINT",
        default=DEFAULT_HUB,
        show_default=True,
        help="The Hugging Face–compatible hub the mirror fetches from ($HF_ENDPOINT). A token: $HF_TOKEN.",
    )(fn)
    fn = click.option(
        "--hub-allow-private",
        envvar="LLMGW_HUB_ALLOW_PRIVATE",
        is_flag=True,
        help="Let the hub, and what it redirects to, be at private, loopback or link-local addresses "
        "(refused by default: a hub could otherwise point the mirror at internal services).",
    )(fn)
    fn = click.option("--mirror-max-gb", type=float, help="The most the mirror directory may hold, in GB.")(fn)
    return click.option("--mirror-port", type=int, help="The mirror's file server port (default: admin port + 2).")(fn)


def admin_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Where the admin API listens, and the one way to put it beyond loopback without TLS or authentication."""
    fn = click.option(
        "--insecure",
        is_flag=True,
        help="Let the admin API listen beyond loopback with no TLS and no authentication (a warning at every start).",
    )(fn)
    return click.option(
        "--admin-host",
        default="127.0.0.1",
        show_default=True,
        help="Address the admin API listens on: loopback unless --insecure (reach it through an SSH tunnel).",
    )(fn)


def tls_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """HTTPS for the gateway and the admin API (`up`, `server`)."""
    fn = click.option("--tls-key", envvar="LLMGW_TLS_KEY", help="The key of --tls-cert ($LLMGW_TLS_KEY).")(fn)
    return click.option(
        "--tls-cert",
        envvar="LLMGW_TLS_CERT",
        help="Serve the gateway and the admin API over HTTPS with this PEM certificate ($LLMGW_TLS_CERT; "
        "`llmgw ctl cert issue NAME --dns … --ip …`).",
    )(fn)


def refuse_bad_certificate(cert: str | None, key: str | None) -> None:
    """Before anything starts: a certificate that expired, is not valid yet or is not the key's, in one line."""
    if not (cert or key):
        return
    if not (cert and key):
        raise click.ClickException("HTTPS needs both --tls-cert FILE and --tls-key FILE")
    try:
        pki.check_pair(cert, key, time.time())
    except pki.PkiError as exc:
        raise click.ClickException(str(exc)) from exc


def refuse_exposed_admin(admin_host: str, admin_port: int, serves_api: bool, insecure: bool, tls: bool) -> None:
    """Before anything starts: an admin API beyond loopback without TLS or --insecure is refused in one line."""
    exposed = exposure_refusal(admin_host, admin_port, serves_api, tls)
    if exposed is not None and not insecure:
        raise click.ClickException(exposed)


def install_stop(stop: asyncio.Event) -> None:
    """SIGINT and SIGTERM set ``stop``: the services then stop in turn, instead of the process dying."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)


# Flags `llmgw up` and `llmgw server` both take: flag → (setting path, how its value is read).
SHARED_FLAGS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "host": ("gateway.host", str),
    "port": ("gateway.port", int),
    "admin_port": ("admin.port", int),
    "admin_host": ("admin.host", str),
    "insecure": ("admin.insecure", bool),
    "catalog_file": ("catalog", str),
    "log_level": ("log_level", str.lower),
    "mirror_port": ("mirror.port", int),
    "mirror_max_gb": ("mirror.max_gb", float),
    "hf_endpoint": ("hub.endpoint", str),
    "hub_allow_private": ("hub.allow_private", bool),
    "tls_cert": ("tls.cert", str),
    "tls_key": ("tls.key", str),
}


def given_flags(ctx: click.Context, flags: dict[str, tuple[str, Callable[[Any], Any]]]) -> dict[str, Any]:
    """The settings the command line gave (``{"gateway.port": 9000}``): flags left at their defaults,
    or taken from the environment by click, are not among them (the environment is read as a layer of its own)."""
    out: dict[str, Any] = {}
    for name, (path, convert) in flags.items():
        if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE:
            out[path] = convert(ctx.params[name])
    return out


def flag_defaults(ctx: click.Context, flags: dict[str, tuple[str, Callable[[Any], Any]]]) -> dict[str, Any]:
    """The command's own defaults for the settings its flags set (`up` listens on 127.0.0.1, `server` on
    0.0.0.0): below the config file, the environment and the flags."""
    out: dict[str, Any] = {}
    for name, (path, convert) in flags.items():
        value = ctx.params[name]
        if ctx.get_parameter_source(name) is click.core.ParameterSource.DEFAULT and value not in (None, ()):
            out[path] = convert(value)
    return out
