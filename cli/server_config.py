"""What a server process runs: which services, where, and with what settings (`llmgw up`, `llmgw server`,
the config file). Plain data, checked once at start; :func:`~llmgw.cli.runtime.serve` runs it and
the table of services (cli/service_table.py) reads it.
"""

from __future__ import annotations

import ssl

import msgspec

from llmgw.events.runtime.snapshots import EVERY_EVENTS as SNAPSHOT_EVERY_EVENTS
from llmgw.events.runtime.snapshots import EVERY_S as SNAPSHOT_EVERY_S
from llmgw.events.schema.models import ModelSpec
from llmgw.infra.pki import PkiError, client_context, server_context
from llmgw.projections.replay_snapshots import EVERY_EVENTS as REPLAY_EVERY_EVENTS
from llmgw.services.accountant.service import PRUNE_EVERY_S, RETENTION_DAYS
from llmgw.services.api.signin import SESSION_HOURS
from llmgw.services.backup import service as backup_service
from llmgw.services.mirror.hub import DEFAULT_HUB
from llmgw.services.people.throttle import LoginThrottle
from llmgw.services.router.app import RouterConfig
from llmgw.services.scheduler.vocabulary import Config as SchedulerConfig

ALL_SERVICES = (
    "tenancy",
    "access",
    "people",
    "identity",
    "mcp",
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
    admin_public_url: str = ""  # where people reach the console (OpenID redirect URIs); "" : as the browser did
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
