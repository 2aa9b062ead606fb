"""The composition root: which services run in this process, wired to one bus and one database.

`llmgw up` and `llmgw server` both call :func:`serve`; they differ only in where NATS and the
database are. Services never import one another; they meet here: :func:`serve` connects, makes what
they share, and walks the table of services (cli/service_table.py) — each with one lifecycle, started
in order and stopped in reverse.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from typing import Any

import msgspec
import structlog
from prometheus_client import CollectorRegistry

from llmgw.cli.natsd import CredentialError, read_credential
from llmgw.cli.service_table import STOP_STEP_S, TABLE, Shared, bounded
from llmgw.events.runtime.follower import FollowerRegistry
from llmgw.events.runtime.metrics import StoreMetrics
from llmgw.events.runtime.secrets import engine_key_secret, signing_secret
from llmgw.events.runtime.snapshots import EVERY_EVENTS as SNAPSHOT_EVERY_EVENTS
from llmgw.events.runtime.snapshots import EVERY_S as SNAPSHOT_EVERY_S
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema.catalog import default_registry
from llmgw.events.schema.models import ModelSpec
from llmgw.infra.pki import CertificateExpiry, PkiError, client_context, load_cert, server_context
from llmgw.projections.access import AccessProjection
from llmgw.projections.backends import open_backend
from llmgw.projections.eventlog import EventLogProjection
from llmgw.projections.fleet import FleetProjection
from llmgw.projections.replay_snapshots import EVERY_EVENTS as REPLAY_EVERY_EVENTS
from llmgw.projections.replay_snapshots import ReplaySnapshotter
from llmgw.projections.runner import ProjectionRunner
from llmgw.projections.tenancy import TenancyProjection
from llmgw.projections.usage import UsageProjection
from llmgw.services.access.bootstrap import DEMO_KEY_FILE as DEMO_KEY_FILE  # for `up`'s message
from llmgw.services.accountant.service import PRUNE_EVERY_S, RETENTION_DAYS
from llmgw.services.api.exposure import exposure_refusal
from llmgw.services.api.signin import SESSION_HOURS
from llmgw.services.backup import service as backup_service
from llmgw.services.lifecycle import Service
from llmgw.services.mirror.hub import DEFAULT_HUB
from llmgw.services.people.throttle import LoginThrottle
from llmgw.services.router.app import RouterConfig
from llmgw.services.scheduler.vocabulary import Config as SchedulerConfig

log = structlog.get_logger("llmgw.runtime")

ALL_SERVICES = (
    "tenancy",
    "access",
    "people",
    "catalog",
    "fleet",
    "scheduler",
    "projections",
    "api",
    "router",
    "accountant",
    "mirror",
    "jobs",
)
# Run only when named in `--services` (a backup belongs on one server, not on every one).
OPTIONAL_SERVICES = ("backup",)


class SnapshotsConfig(msgspec.Struct, frozen=True, kw_only=True):
    """How often folded state is saved, so that a start folds only a tail (docs/operations.md#snapshots)."""

    every_events: int = SNAPSHOT_EVERY_EVENTS  # the router's and the scheduler's, after this many events…
    every_s: float = SNAPSHOT_EVERY_S  # …or this many seconds (0 turns a trigger off)
    replay_every_events: int = REPLAY_EVERY_EVENTS  # the replayed projections' tables (`events replay`)


class SignInConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The admin API's sign-in (docs/people.md): how long a session lasts, and how logins are throttled."""

    session_hours: float = SESSION_HOURS  # how long the session token `llmgw login` gets lasts
    # An address with this many failed logins within login_window_s is blocked for login_block_s,
    # doubled with each block after it, up to login_max_block_s (services/people/throttle.py).
    login_failures: int = 5
    login_window_s: float = 300.0
    login_block_s: float = 60.0
    login_max_block_s: float = 3600.0

    def throttle(self) -> LoginThrottle:
        return LoginThrottle(
            failures=self.login_failures,
            window_s=self.login_window_s,
            block_s=self.login_block_s,
            max_block_s=self.login_max_block_s,
        )


class ServerConfig(msgspec.Struct, frozen=True, kw_only=True):
    nats_url: str
    db_dsn: str
    services: tuple[str, ...] = ALL_SERVICES
    host: str = "127.0.0.1"  # the gateway's (and the mirror's file server's) address
    port: int = 8080
    admin_host: str = "127.0.0.1"  # the admin API's: loopback unless insecure (services/api/exposure.py)
    admin_port: int = 8081
    insecure: bool = False  # let the admin API listen beyond loopback without TLS or authentication
    stream_replicas: int | None = None  # None: the cluster's size, at most 3 (1 on a single server)
    declared_models: tuple[ModelSpec, ...] = ()
    demo_model: ModelSpec | None = None
    demo_marker: str | None = None
    bootstrap_dir: str | None = None  # `llmgw up`: the first time, a default org/team/project and DIR/demo-key
    first_admin_dir: str | None = None  # the first time, user admin with DIR/admin-password and DIR/admin-token
    scheduler: SchedulerConfig = SchedulerConfig()
    usage_retention_days: float = RETENTION_DAYS  # requests and rollups older than this are deleted
    usage_prune_every_s: float = PRUNE_EVERY_S  # how often the accountant deletes them
    snapshots: SnapshotsConfig = SnapshotsConfig()
    signin: SignInConfig = SignInConfig()
    router: RouterConfig = RouterConfig()
    mirror_dir: str | None = None  # where the mirror keeps MODEL/VERSION/FILE; needed when it runs here
    mirror_port: int = 8083  # its file server
    mirror_max_bytes: int | None = None  # the most the mirror directory may hold
    mirror_peer_of: str | None = None  # run the mirror as a peer of this primary file server (MIR-4)
    mirror_peer_name: str = "peer"
    # the mirror file server(s) the jobs service reads GGUF headers from, comma-separated, the first
    # that answers; None: this server's own mirror
    mirror_urls: str | None = None
    hub_endpoint: str = DEFAULT_HUB  # the Hugging Face–compatible hub (HF_ENDPOINT)
    hub_token: str | None = None  # a hub token (HF_TOKEN), for gated or private repositories
    # the hub (and what it redirects to) may be at private, loopback or link-local addresses (--hub-allow-private)
    hub_allow_private: bool = False
    # jobs (`ctl model serve`): "mirror" gives agents mirror:MODEL/VERSION/FILE; "local" the mirror's own path
    jobs_source: str = "mirror"
    # HTTPS for the gateway and the admin API (not the mirror's file server): a PEM certificate and its key
    tls_cert: str | None = None
    tls_key: str | None = None
    # NATS over TLS: the CA that signed the servers' certificates, and this process's client certificate
    # when the servers ask for one (`verify: true`)
    nats_ca: str | None = None
    nats_cert: str | None = None
    nats_key: str | None = None
    nats_creds: str | None = None  # the NATS credential file this process connects with (None: no user)
    # the backup service (`--services …,backup`): where archives go (None: DATA_DIR/backups), how often, how many
    backup_dir: str | None = None
    backup_every_s: float = backup_service.EVERY_S
    backup_keep: int = backup_service.KEEP


class TlsSetup(msgspec.Struct, frozen=True, kw_only=True):
    """What a process serves and presents over TLS, checked once at start."""

    https: ssl.SSLContext | None = None
    nats: ssl.SSLContext | None = None
    # (name, path) of each certificate served or presented, for llmgw_certificate_expiry_timestamp_seconds
    certificates: tuple[tuple[str, str], ...] = ()


def tls_setup(config: ServerConfig, now: float) -> TlsSetup:
    """The TLS contexts ``config`` asks for; :class:`PkiError` (naming the file and its dates) for a
    certificate that is expired, not valid yet or not the key's, or a half-given pair."""
    certificates: list[tuple[str, str]] = []
    https = None
    if config.tls_cert or config.tls_key:
        if not (config.tls_cert and config.tls_key):
            raise PkiError("HTTPS needs both --tls-cert FILE and --tls-key FILE")
        https = server_context(config.tls_cert, config.tls_key, now)
        certificates.append(("https", config.tls_cert))
    nats = None
    if config.nats_ca or config.nats_cert or config.nats_key:
        if bool(config.nats_cert) != bool(config.nats_key):
            raise PkiError("a NATS client certificate needs both --nats-cert FILE and --nats-key FILE")
        nats = client_context(config.nats_ca, config.nats_cert, config.nats_key, now=now)
        if config.nats_cert:
            certificates.append(("nats-client", config.nats_cert))
    return TlsSetup(https=https, nats=nats, certificates=tuple(certificates))


def projections() -> list:
    return [TenancyProjection(), EventLogProjection(), FleetProjection(), AccessProjection(), UsageProjection()]


async def serve(
    config: ServerConfig,
    stop: asyncio.Event,
    on_ready: Callable[[], None] | None = None,
    handles: dict[str, Any] | None = None,
) -> None:
    """Run the configured services until ``stop`` is set; then stop them cleanly.

    The services are the entries of :data:`~llmgw.cli.service_table.TABLE` this process runs, started
    in the table's order and stopped in reverse, here and only here. ``handles``, when given, is
    filled with the running service objects (tests and benchmarks).
    """
    handles = handles if handles is not None else {}
    unknown = set(config.services) - set(ALL_SERVICES) - set(OPTIONAL_SERVICES)
    if unknown:
        known = ", ".join((*ALL_SERVICES, *OPTIONAL_SERVICES))
        raise SystemExit(f"error: unknown service(s) {', '.join(sorted(unknown))}; known: {known}")
    exposed = exposure_refusal(config.admin_host, config.admin_port, "api" in config.services, bool(config.tls_cert))
    if exposed is not None and not config.insecure:
        raise SystemExit(f"error: {exposed}")
    if exposed is not None:
        log.warning(
            "the admin API listens beyond loopback with no TLS (--insecure): the passwords and tokens it is "
            "called with cross the network in the clear",
            admin_host=config.admin_host,
            admin_port=config.admin_port,
        )
    try:
        tls = tls_setup(config, time.time())
    except PkiError as exc:
        raise SystemExit(f"error: {exc}") from exc
    registry = CollectorRegistry()
    expiry = CertificateExpiry(registry)
    for name, path in tls.certificates:
        expiry.observe(name, path, load_cert(path))
    try:
        creds = read_credential(config.nats_creds) if config.nats_creds else None
    except CredentialError as exc:
        raise SystemExit(f"error: {exc}") from exc
    store = await EventStore.connect(
        config.nats_url,
        default_registry(),
        replicas=config.stream_replicas,
        metrics=StoreMetrics(registry),
        tls=tls.nats,
        creds=creds,
    )
    # A router alone leaves existing streams as they are: its NATS user may create a missing one, never change one.
    await store.ensure_streams(update=set(config.services) != {"router"})
    if set(config.services) != {"router"}:
        # Made here, by a control plane: routers and agents may only read it, and wait until it is there.
        await engine_key_secret(store.js)
        await signing_secret(store.js)  # what services sign commands with: the control plane's alone
    backend = await open_backend(config.db_dsn)
    # The process's supervised readers (followers, subscribers, projections): its /healthz answers 503
    # naming any that is not live.
    folds = FollowerRegistry(registry)
    # Every 10,000 events the replayed projections' tables are saved, so `events replay` folds only a tail.
    replay_saver = ReplaySnapshotter(store, backend, every=config.snapshots.replay_every_events)
    runner = ProjectionRunner(
        store, backend, projections(), registry=registry, on_batch=replay_saver.folded, folds=folds
    )
    handles.update(store=store, backend=backend, runner=runner, folds=folds)
    shared = Shared(config, tls, store, backend, runner, registry, folds, handles)
    running: list[Service] = []
    try:
        for name, wanted, entry in TABLE:
            if wanted(config):
                service = entry(name, shared)
                running.append(service)  # before it starts: one that fails half-way is stopped too
                await service.start()
        log.info("services started", services=list(config.services), port=config.port, admin_port=config.admin_port)
        if on_ready:
            on_ready()
        stopped = asyncio.create_task(stop.wait())
        loops = [t for s in running for t in s.loops()]
        await asyncio.wait([stopped, *loops], return_when=asyncio.FIRST_COMPLETED)
        for s in running:
            why = s.health()
            if why is not None:
                log.error("a service failed; stopping the process", service=s.name, reason=why)
        stopped.cancel()
    finally:
        for s in running:
            s.stopping()  # all at once: none takes new work while the others stop
        # Every step is bounded: a process told to stop exits, whatever NATS or the database do meanwhile.
        for s in reversed(running):
            await bounded(f"stop {s.name}", s.stop(), timeout_s=s.stop_s)
        await bounded("stop the replay snapshots", replay_saver.close())
        await bounded("close the database", backend.close())
        await bounded("close the NATS connection", store.close(), timeout_s=STOP_STEP_S + 5.0)
        log.info("services stopped")
