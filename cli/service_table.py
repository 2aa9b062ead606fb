"""The services a process can run, as a table: one entry each, with one lifecycle.

:func:`~llmgw.cli.runtime.serve` connects to the bus and the database, makes what the services share
(:class:`Shared`: the store, the projections' runner, the process's followers, the admin API, one
:class:`~llmgw.events.commands.auth.CommandVerifier` for every command service), then walks
:data:`TABLE` in order: each entry whose ``wanted`` says so is made and started, and the ones started
are told at once that the process is stopping, then stopped in reverse. An entry adapts its service
to :class:`~llmgw.services.lifecycle.Service` (``start``, ``stopping``, ``stop``, ``health``,
``loops``); what each service gets, and the order they start in, are as they always were.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry

from llmgw.cli.context import default_data_dir
from llmgw.cli.server_config import ServerConfig, TlsSetup
from llmgw.events.commands.auth import CommandVerifier
from llmgw.events.commands.errors import CommandError
from llmgw.events.runtime.follower import FollowerRegistry
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema.outcomes import Rejected
from llmgw.projections.backends import Backend
from llmgw.projections.runner import ProjectionRunner
from llmgw.services.access.bootstrap import ensure_demo_key
from llmgw.services.access.service import AccessService
from llmgw.services.accountant.service import AccountantService
from llmgw.services.api.app import AdminApi
from llmgw.services.api.signin import SignIn
from llmgw.services.backup import service as backup_service
from llmgw.services.catalog.service import CatalogService
from llmgw.services.fleet.service import FleetService
from llmgw.services.identity.service import IdentityService
from llmgw.services.jobs.service import JobsConfig, JobsService
from llmgw.services.lifecycle import Loops, Service
from llmgw.services.mcp.service import McpService
from llmgw.services.mirror.service import MirrorConfig, MirrorService
from llmgw.services.people.bootstrap import PASSWORD_FILE as ADMIN_PASSWORD_FILE
from llmgw.services.people.bootstrap import ensure_admin
from llmgw.services.people.service import PeopleService
from llmgw.services.router.app import Router
from llmgw.services.scheduler.service import SchedulerService
from llmgw.services.tenancy.service import TenancyService

log = structlog.get_logger("llmgw.runtime")

STOP_STEP_S = 10.0  # the most one service's stop may take: a process told to stop exits, whatever NATS does


class Shared:
    """What the services of one process share; made once by ``serve()``."""

    def __init__(
        self,
        config: ServerConfig,
        tls: TlsSetup,
        store: EventStore,
        backend: Backend,
        runner: ProjectionRunner,
        registry: CollectorRegistry,
        folds: FollowerRegistry,
        handles: dict[str, Any],
    ) -> None:
        self.config = config
        self.tls = tls
        self.store = store
        self.backend = backend
        self.runner = runner
        self.registry = registry  # Prometheus
        self.folds = folds  # the process's supervised readers: its /healthz answers 503 naming any not live
        self.handles = handles  # the running service objects, for tests and benchmarks
        # One check of who signed each command (one fold of the people and the tree) for every command service.
        self.verifier = CommandVerifier(store, registry=folds)
        # Every process serves health and metrics on its admin port; the API itself runs with "api".
        self.api = AdminApi(store, backend, runner, registry)
        self.api.folds = folds


async def listen(
    app: web.Application, host: str, port: int, ssl_context: ssl.SSLContext | None = None
) -> web.AppRunner:
    """``app`` served on ``host:port``; a port that is taken ends the process with one clear line."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise SystemExit(f"error: cannot listen on {host}:{port} ({exc.strerror}); choose another port") from exc
    return runner


class Entry:
    """The part every entry shares: a name, its loops, its health from them."""

    stop_s = STOP_STEP_S

    def __init__(self, name: str, shared: Shared) -> None:
        self.name = name
        self.shared = shared
        self.running = Loops()

    async def start(self) -> None:
        raise NotImplementedError

    def stopping(self) -> None:
        self.running.signal()

    async def stop(self) -> None:
        self.running.signal()
        await self.running.cancel()

    def health(self) -> str | None:
        return self.running.health()

    def loops(self) -> list[asyncio.Task[Any]]:
        return self.running.tasks


class Projections(Entry):
    """The projections' live tables, folded from the log (the runner is shared: the admin API reads it)."""

    async def start(self) -> None:
        await self.shared.runner.start()

    async def stop(self) -> None:
        await self.shared.runner.stop()


class Commands(Entry):
    """A command service: its folds follow the log from now (in ``/healthz``), its commands are handled."""

    def __init__(self, name: str, shared: Shared, kind: type[Any]) -> None:
        super().__init__(name, shared)
        self.kind = kind  # the service's class: TenancyService, AccessService, …
        self.service: Any = None

    async def start(self) -> None:
        self.service = self.kind(self.shared.store, folds=self.shared.folds, verifier=self.shared.verifier)
        self.service.start()
        await self.prepare()
        self.running.run(f"{self.name}-commands", self.service.processor())

    async def prepare(self) -> None:
        """What the service does before it takes commands (the catalog: the declared models)."""

    async def stop(self) -> None:
        await super().stop()
        # After its processor: a command being handled is cut off and comes again, never refused.
        if self.service is not None:
            await self.service.close()


class Catalog(Commands):
    """The catalog: the catalog file's models and the demo model are declared before any command."""

    async def prepare(self) -> None:
        config = self.shared.config
        try:
            await self.service.sync_declared(list(config.declared_models))
        except Rejected as exc:
            raise SystemExit(f"error: the catalog file is not valid: {exc.reason}") from exc
        if config.demo_model is not None and config.demo_marker:
            await self.service.add_once(config.demo_model, Path(config.demo_marker))


class Scheduler(Entry):
    async def start(self) -> None:
        s = self.shared
        scheduler = SchedulerService(
            s.store,
            config=s.config.scheduler,
            registry=s.registry,
            folds=s.folds,
            snapshot_every_events=s.config.snapshots.every_events,
            snapshot_every_s=s.config.snapshots.every_s,
        )
        s.handles["scheduler"] = self.running.run("scheduler", scheduler)


class Bootstrap(Entry):
    """Not a service: the first administrator and the demo key, made once (`llmgw up`, `--first-admin-dir`)."""

    async def start(self) -> None:
        config = self.shared.config
        store = self.shared.store
        if config.bootstrap_dir is not None or config.first_admin_dir is not None:
            await bootstrap_admin(store, Path(config.first_admin_dir or config.bootstrap_dir or ""), config.services)
        if config.bootstrap_dir is not None:
            await bootstrap_access(store, Path(config.bootstrap_dir), config.services)


class Accountant(Entry):
    async def start(self) -> None:
        s = self.shared
        accountant = AccountantService(
            s.backend, retention_days=s.config.usage_retention_days, prune_every_s=s.config.usage_prune_every_s
        )
        s.handles["accountant"] = self.running.run("accountant", accountant)


class Backup(Entry):
    async def start(self) -> None:
        s, config = self.shared, self.shared.config
        backups = backup_service.BackupService(
            s.store,
            Path(config.backup_dir) if config.backup_dir else default_data_dir() / "backups",
            every_s=config.backup_every_s,
            keep=config.backup_keep,
            data_dir=default_data_dir(),
            registry=s.registry,
        )
        s.handles["backup"] = self.running.run("backup", backups)


class Admin(Entry):
    """The admin port: ``/healthz`` and ``/metrics`` in every process, the admin API and its sign-in with "api"."""

    def __init__(self, name: str, shared: Shared) -> None:
        super().__init__(name, shared)
        self.site: web.AppRunner | None = None
        self.signin: SignIn | None = None

    async def start(self) -> None:
        s, config = self.shared, self.shared.config
        full = "api" in config.services
        if full:
            s.api.signin = self.signin = SignIn(
                s.store, folds=s.folds, throttle=config.signin.throttle(), session_hours=config.signin.session_hours
            )
            s.handles["signin"] = self.signin
            self.signin.start()
        s.api.public_url = config.admin_public_url
        self.site = await listen(s.api.app(full=full), config.admin_host, config.admin_port, s.tls.https)

    async def stop(self) -> None:
        if self.site is not None:
            await self.site.cleanup()
        if self.signin is not None:
            await self.signin.close()


class RouterEntry(Entry):
    """The gateway on ``host:port``; stopping it publishes (or journals) the usage records it holds."""

    stop_s = STOP_STEP_S + 10.0  # the router publishes for up to 10 s, then journals the rest

    def __init__(self, name: str, shared: Shared) -> None:
        super().__init__(name, shared)
        self.router: Router | None = None
        self.site: web.AppRunner | None = None

    async def start(self) -> None:
        s, config = self.shared, self.shared.config
        router = Router(
            s.store,
            config.router,
            registry=s.registry,
            folds=s.folds,
            snapshot_every_events=config.snapshots.every_events,
            snapshot_every_s=config.snapshots.every_s,
        )
        await router.start()
        self.router = router  # stopped from here on: one that failed to start has nothing to publish
        s.handles["router"] = self.router
        s.api.usage_backlog = self.router.usage.backlog  # the process's health says what the router holds
        self.site = await listen(self.router.app(), config.host, config.port, s.tls.https)

    async def stop(self) -> None:
        if self.site is not None:
            await bounded("close a listener", self.site.cleanup())
        if self.router is None:
            return
        try:
            async with asyncio.timeout(self.stop_s):
                report = await self.router.stop()
        except TimeoutError:
            log.error("the router did not stop in time; usage records it still held may be lost")
            return
        if report.lost:
            log.error("router stopped with usage records lost", lost=report.lost, error=report.error)
        elif report.journaled:
            log.warning("router stopped with usage records journaled", journaled=report.journaled)


class Mirror(Entry):
    """The mirror: model files kept on this server's disk, served on ``host:mirror_port``."""

    def __init__(self, name: str, shared: Shared) -> None:
        super().__init__(name, shared)
        self.mirror: MirrorService | None = None
        self.site: web.AppRunner | None = None

    async def start(self) -> None:
        s, config = self.shared, self.shared.config
        if not config.mirror_dir:
            raise SystemExit("error: the mirror service needs a directory to keep models in (--mirror-dir)")
        self.mirror = MirrorService(
            s.store,
            MirrorConfig(
                dir=config.mirror_dir,
                hub=config.hub_endpoint,
                token=config.hub_token,
                hub_allow_private=config.hub_allow_private,
                max_bytes=config.mirror_max_bytes,
                peer_of=config.mirror_peer_of,
                peer_name=config.mirror_peer_name,
            ),
            folds=s.folds,
            verifier=s.verifier,
        )
        await self.mirror.start()
        s.handles["mirror"] = self.running.run("mirror-commands", self.mirror)
        self.site = await listen(self.mirror.app(), config.host, config.mirror_port)

    async def stop(self) -> None:
        self.running.signal()
        if self.site is not None:
            await bounded("close a listener", self.site.cleanup())
        if self.mirror is not None:
            await bounded("stop the mirror", self.mirror.close())
        await self.running.cancel()


class Jobs(Entry):
    """`ctl model serve` jobs, resumed where they were at start."""

    def __init__(self, name: str, shared: Shared) -> None:
        super().__init__(name, shared)
        self.jobs: JobsService | None = None

    async def start(self) -> None:
        s, config = self.shared, self.shared.config
        self.jobs = JobsService(
            s.store,
            JobsConfig(
                hub=config.hub_endpoint,
                token=config.hub_token,
                hub_allow_private=config.hub_allow_private,
                source=config.jobs_source,
                # headers are read from the mirror's directory when it runs here, else over HTTP
                mirror_dir=config.mirror_dir if "mirror" in config.services else None,
                mirror_url=config.mirror_urls or f"http://{config.host}:{config.mirror_port}",
            ),
            folds=s.folds,
            verifier=s.verifier,
        )
        await self.jobs.start()
        s.handles["jobs"] = self.running.run("jobs-commands", self.jobs)

    async def stop(self) -> None:
        self.running.signal()
        if self.jobs is not None:
            await bounded("stop the jobs", self.jobs.close())
        await self.running.cancel()


def _named(name: str) -> Callable[[ServerConfig], bool]:
    return lambda config: name in config.services


def _commands(kind: type[Any], entry: type[Commands] = Commands) -> Callable[[str, Shared], Entry]:
    return lambda name, shared: entry(name, shared, kind)


# (name, whether this process runs it, the entry), in the order they start; they stop in reverse.
TABLE: tuple[tuple[str, Callable[[ServerConfig], bool], Callable[[str, Shared], Service]], ...] = (
    ("projections", _named("projections"), Projections),
    ("tenancy", _named("tenancy"), _commands(TenancyService)),
    ("access", _named("access"), _commands(AccessService)),
    ("people", _named("people"), _commands(PeopleService)),
    ("identity", _named("identity"), _commands(IdentityService)),
    ("mcp", _named("mcp"), _commands(McpService)),
    ("catalog", _named("catalog"), _commands(CatalogService, Catalog)),
    ("fleet", _named("fleet"), _commands(FleetService)),
    ("scheduler", _named("scheduler"), Scheduler),
    ("bootstrap", lambda c: c.bootstrap_dir is not None or c.first_admin_dir is not None, Bootstrap),
    ("accountant", _named("accountant"), Accountant),
    ("backup", _named("backup"), Backup),
    ("admin", lambda c: True, Admin),  # every process: /healthz and /metrics
    ("router", _named("router"), RouterEntry),
    ("mirror", _named("mirror"), Mirror),
    ("jobs", _named("jobs"), Jobs),
)


async def bootstrap_admin(store: EventStore, data_dir: Path, services: tuple[str, ...]) -> None:
    if "people" not in services:
        log.warning("no first administrator: the people service does not run here", services=list(services))
        return
    try:
        if await ensure_admin(store, data_dir):
            log.info("first administrator made: user admin", password_file=str(data_dir / ADMIN_PASSWORD_FILE))
    except (CommandError, OSError) as exc:
        log.error("could not make the first administrator; the next start tries again", error=str(exc))


async def bootstrap_access(store: EventStore, data_dir: Path, services: tuple[str, ...]) -> None:
    if not {"tenancy", "access"} <= set(services):
        log.warning("no demo key: the tenancy and access services do not run here", services=list(services))
        return
    try:
        written = await ensure_demo_key(store, data_dir)
    except (CommandError, OSError) as exc:
        log.error("could not create the demo key; create one with `llmgw ctl key create`", error=str(exc))
        return
    if written is not None:
        log.info("demo key created", path=str(written))


async def bounded(what: str, step: Awaitable[Any], timeout_s: float = STOP_STEP_S) -> None:
    """Await one shutdown step for at most ``timeout_s``; a step that fails or hangs is logged and left behind."""
    try:
        async with asyncio.timeout(timeout_s):
            await step
    except TimeoutError:
        log.error("a shutdown step did not finish in time; going on without it", step=what, timeout_s=timeout_s)
    except Exception as exc:
        log.warning("a shutdown step failed", step=what, error=str(exc))


__all__ = ["STOP_STEP_S", "TABLE", "Entry", "Shared", "bootstrap_access", "bootstrap_admin", "bounded", "listen"]
