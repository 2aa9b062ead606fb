"""The composition root: which services run in this process, wired to one bus and one database.

`llmgw up` and `llmgw server` both call :func:`serve`; they differ only in where NATS and the
database are. Services never import one another; they meet here: :func:`serve` connects, makes what
they share, and walks the table of services (cli/service_table.py) — each with one lifecycle, started
in order and stopped in reverse.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import structlog
from prometheus_client import CollectorRegistry

from llmgw.cli import logs
from llmgw.cli.log_sink import DroppedLinesCollector
from llmgw.cli.natsd import CredentialError, read_credential
from llmgw.cli.server_config import ALL_SERVICES, OPTIONAL_SERVICES, ServerConfig, tls_setup
from llmgw.cli.service_table import STOP_STEP_S, TABLE, Shared, bounded
from llmgw.events.runtime.follower import FollowerRegistry
from llmgw.events.runtime.metrics import StoreMetrics
from llmgw.events.runtime.secrets import engine_key_secret, signing_secret
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema.catalog import default_registry
from llmgw.infra.pki import CertificateExpiry, PkiError, load_cert
from llmgw.projections.access import AccessProjection
from llmgw.projections.backends import open_backend
from llmgw.projections.eventlog import EventLogProjection
from llmgw.projections.fleet import FleetProjection
from llmgw.projections.replay_snapshots import ReplaySnapshotter
from llmgw.projections.runner import ProjectionRunner
from llmgw.projections.tenancy import TenancyProjection
from llmgw.projections.usage import UsageProjection
from llmgw.services.api.exposure import exposure_refusal
from llmgw.services.lifecycle import Service

log = structlog.get_logger("llmgw.runtime")


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
    registry.register(DroppedLinesCollector(logs.current_sink))
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
