"""`llmgw server`: the cluster shape — the services named run against an external NATS and
PostgreSQL, set by flags, $LLMGW_… variables and a config file."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any

import click
import msgspec

from llmgw.cli import config_file as config_file_mod
from llmgw.cli import logs
from llmgw.cli.client import nats_creds_option, nats_tls_options
from llmgw.cli.context import default_data_dir
from llmgw.cli.fleet_cmd import load_model_file
from llmgw.cli.runtime import serve
from llmgw.cli.serve_options import (
    SHARED_FLAGS,
    admin_options,
    flag_defaults,
    given_flags,
    http_ports_problem,
    hub_token,
    install_stop,
    mirror_options,
    refuse_bad_certificate,
    refuse_exposed_admin,
    tls_options,
)
from llmgw.cli.server_config import ALL_SERVICES

# `llmgw server`'s flags and the settings they set (cli/config_file.py): a flag given wins over
# the environment and the config file; one not given leaves them be.
SERVER_FLAGS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    **SHARED_FLAGS,
    "nats_url": ("nats.url", str),
    "db_dsn": ("db", str),
    "services": ("services", lambda v: [s.strip() for s in v.split(",") if s.strip()]),
    "replicas": ("nats.stream_replicas", int),
    "mirror_dir": ("mirror.dir", str),
    "mirror_peer_of": ("mirror.peer_of", str),
    "mirror_peer_name": ("mirror.peer_name", str),
    "mirror_urls": ("mirror.urls", lambda v: [u.strip() for part in v for u in part.split(",") if u.strip()]),
    "usage_journal": ("router.usage_journal", str),
    "first_admin_dir": ("first_admin_dir", str),
    "nats_ca": ("nats.ca", str),
    "nats_cert": ("nats.cert", str),
    "nats_key": ("nats.key", str),
    "nats_creds": ("nats.creds", str),
}


@click.command()
@click.option(
    "--config",
    "config_file",
    envvar="LLMGW_CONFIG",
    help="Every setting in one YAML file (ops/llmgw.yaml; docs/operations.md lists the keys). Flags and "
    "$LLMGW_<SECTION>_<KEY> win over it.",
)
@click.option("--print-config", is_flag=True, help="Print the settings this would run with, as YAML, and exit.")
@click.option(
    "--nats",
    "nats_url",
    envvar="LLMGW_NATS_URL",
    help="NATS URL (a cluster: comma-separated). Required, here or in the config file.",
)
@click.option(
    "--db",
    "db_dsn",
    envvar="LLMGW_DB",
    help="postgresql://… or a SQLite file path. Required, here or in the config file.",
)
@click.option("--services", default=",".join(ALL_SERVICES), show_default=True, help="Which services to run here.")
@click.option("--host", default="0.0.0.0", show_default=True, help="Address the gateway listens on.")
@click.option("--port", default=8080, show_default=True)
@click.option("--admin-port", default=8081, show_default=True)
@click.option(
    "--replicas",
    type=click.IntRange(min=1),
    help="Replicas of the streams and buckets this server creates (default: the cluster's size, at most 3). "
    "Existing ones keep theirs: change them with `llmgw streams replicas N`.",
)
@click.option("--catalog", "catalog_file", help="Models declared in a YAML file (edited there, not at runtime).")
@click.option("--mirror-dir", help="Where the mirror keeps models (default: DATA_DIR/mirror).")
@click.option(
    "--mirror-peer-of",
    help="Run the mirror as a peer (MIR-4) of the primary whose file server is at this URL: it copies what the "
    "primary verified, takes no commands.",
)
@click.option("--mirror-peer-name", default="peer", show_default=True, help="The peer's name in its own events.")
@click.option(
    "--mirror-url",
    "mirror_urls",
    multiple=True,
    help="The mirror file server(s) the jobs service reads GGUF headers from (repeated, or comma-separated): "
    "tried in order, the next when one does not answer (default: this server's own mirror). Give the primary "
    "and its peers.",
)
@click.option(
    "--usage-journal",
    help="Where the router keeps usage records the bus has not acknowledged yet, on this machine's own disk "
    "(default: DATA_DIR/usage-journal).",
)
@click.option(
    "--first-admin-dir",
    help="Make the cluster's first administrator here the first time (user admin, with DIR/admin-password and "
    "DIR/admin-token, 0600): commands are signed, so a cluster needs one person to start with. Needs the people "
    "service in this process.",
)
@click.option("--log-level", default="info", show_default=True)
@mirror_options
@admin_options
@tls_options
@nats_tls_options
@nats_creds_option
@click.pass_context
def server(
    ctx: click.Context,
    config_file: str | None,
    print_config: bool,
    nats_url: str | None,
    db_dsn: str | None,
    services: str,
    host: str,
    port: int,
    admin_port: int,
    replicas: int | None,
    catalog_file: str | None,
    mirror_dir: str | None,
    mirror_peer_of: str | None,
    mirror_peer_name: str,
    mirror_urls: tuple[str, ...],
    usage_journal: str | None,
    first_admin_dir: str | None,
    log_level: str,
    mirror_port: int | None,
    mirror_max_gb: float | None,
    hf_endpoint: str,
    hub_allow_private: bool,
    admin_host: str,
    insecure: bool,
    tls_cert: str | None,
    tls_key: str | None,
    nats_ca: str | None,
    nats_cert: str | None,
    nats_key: str | None,
    nats_creds: str | None,
) -> None:
    """Run services against an external NATS and PostgreSQL (the cluster shape)."""
    # The flags are read through ctx (given_flags), not their parameters: only a flag given on the
    # command line wins over the environment and the file.
    try:
        settings = config_file_mod.resolve(
            config_file_mod.load(
                config_file, os.environ, given_flags(ctx, SERVER_FLAGS), base=flag_defaults(ctx, SERVER_FLAGS)
            ),
            default_data_dir(),
            hub_token=hub_token(),
        )
        if print_config:
            click.echo(config_file_mod.show(settings), nl=False)
            return
        config = config_file_mod.server_config(settings)
    except config_file_mod.ConfigError as exc:
        click.echo(f"error: {exc}", err=True)
        ctx.exit(2)
    logs.configure(settings.log_level)
    refuse_exposed_admin(
        config.admin_host, config.admin_port, "api" in config.services, config.insecure, bool(config.tls_cert)
    )
    refuse_bad_certificate(config.tls_cert, config.tls_key)
    listeners = [("the admin port (--admin-port)", config.admin_host, config.admin_port)]
    if "router" in config.services:
        listeners.append(("the gateway's port (--port)", config.host, config.port))
    if "mirror" in config.services:
        listeners.append(("the mirror's port (--mirror-port)", config.host, config.mirror_port))
    problem = http_ports_problem(listeners)
    if problem:
        raise click.ClickException(problem)
    if settings.catalog:
        config = msgspec.structs.replace(config, declared_models=tuple(load_model_file(settings.catalog)))

    async def go() -> None:
        stop = asyncio.Event()
        install_stop(stop)
        await serve(config, stop)

    asyncio.run(go())
