"""`llmgw server --config FILE`: every setting of a server in one YAML file (SPEC OPS-2).

The file's keys mirror the settings structs (`scheduler:` is the scheduler's `Config`, `router:` the
router's `RouterConfig`, …), so a setting added to a struct is a key of the file, an environment
variable and a line of the reference in docs/operations.md without anything else to write.

Precedence, highest first: a flag, the environment (`LLMGW_<SECTION>_<KEY>`, see :func:`env_name`),
the file, the defaults. Every value is checked key by key before anything starts: an unknown key, a
wrong type or a value out of range is one :class:`ConfigError` naming the key's path and what it
takes. Pure, apart from reading the file: the CLI passes the environment and the flags in.
"""

from __future__ import annotations

import ast
import difflib
import inspect
import io
import json
import textwrap
import tokenize
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit, urlunsplit

import msgspec
import msgspec.inspect as mi
import yaml

from llmgw.cli.server_config import ALL_SERVICES, OPTIONAL_SERVICES, ServerConfig, SignInConfig, SnapshotsConfig
from llmgw.services.accountant.service import PRUNE_EVERY_S, RETENTION_DAYS
from llmgw.services.backup import service as backup_service
from llmgw.services.mirror.hub import DEFAULT_HUB
from llmgw.services.router.config import RouterConfig
from llmgw.services.scheduler.vocabulary import Config as SchedulerConfig

Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
Positive = Annotated[float, msgspec.Meta(gt=0)]


class ConfigError(Exception):
    """A setting that cannot be used; the message names its key and what it takes (exit code 2)."""


# -- the file's schema --------------------------------------------------------------------------


class NatsSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    url: str | None = None  # the NATS server(s) to connect to, comma-separated for a cluster (required)
    creds: str | None = None  # the NATS credential file this process connects with (none: no user)
    ca: str | None = None  # the CA that signed the NATS servers' certificates (NATS over TLS)
    cert: str | None = None  # this process's NATS client certificate, when the servers ask for one
    key: str | None = None  # the key of nats.cert
    # Replicas of the streams and buckets this server creates (none: the cluster's size, at most 3);
    # existing ones keep theirs: change them with `llmgw streams replicas N`.
    stream_replicas: Annotated[int, msgspec.Meta(ge=1)] | None = None


class GatewaySettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    host: str = "0.0.0.0"  # the address the gateway (and the mirror's file server) listens on
    port: Port = 8080  # the gateway's (OpenAI API) port


class AdminSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"  # the address the admin API listens on: loopback unless admin.insecure
    port: Port = 8081  # the admin API's, /healthz's and /metrics' port
    insecure: bool = False  # let the admin API listen beyond loopback with no TLS and no authentication
    # where people reach the admin API and console, e.g. https://llm.corp.example behind a proxy: OpenID sign-in
    # redirect URIs are made from it (empty: the address the browser used)
    public_url: str = ""


class TlsSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    cert: str | None = None  # serve the gateway and the admin API over HTTPS with this PEM certificate
    key: str | None = None  # the key of tls.cert


class UsageSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    retention_days: Positive = RETENTION_DAYS  # requests and rollups older than this are deleted
    prune_every_s: Positive = PRUNE_EVERY_S  # how often the accountant deletes what is older


class SnapshotsSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # The router and the scheduler save their folded state after this many events (0: never by count)…
    every_events: Annotated[int, msgspec.Meta(ge=0)] = SnapshotsConfig().every_events
    every_s: Annotated[float, msgspec.Meta(ge=0)] = (
        SnapshotsConfig().every_s
    )  # …or this many seconds (0: never by time)
    # The replayed projections' tables are saved every this many events, so `events replay` folds only a tail.
    replay_every_events: Annotated[int, msgspec.Meta(ge=1)] = SnapshotsConfig().replay_every_events


class MirrorSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    dir: str | None = None  # where the mirror keeps MODEL/VERSION/FILE (none: DATA_DIR/mirror)
    port: Port | None = None  # its file server's port (none: admin.port + 2)
    max_gb: Annotated[float, msgspec.Meta(gt=0)] | None = None  # the most the mirror directory may hold, in GB
    peer_of: str | None = None  # run the mirror as a peer (MIR-4) of the primary whose file server is at this URL
    peer_name: str = "peer"  # the peer's name in its own events
    # The mirror file server(s) the jobs service reads GGUF headers from, tried in order (none: this server's own).
    urls: tuple[str, ...] = ()


class HubSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    endpoint: str = DEFAULT_HUB  # the Hugging Face–compatible hub the mirror and the jobs read from
    # A hub token, for gated or private repositories (none: $HF_TOKEN, else the one `hf auth login` stored).
    token: str | None = None
    # Let the hub, and what it redirects to, be at private, loopback or link-local addresses.
    allow_private: bool = False


class JobsSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # What `ctl model serve` gives agents: "mirror" a mirror:MODEL/VERSION/FILE reference, "local"
    # the mirror's own path.
    source: Literal["mirror", "local"] = "mirror"


class BackupSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # The backup service's (when `services` names backup): where its archives go (none: DATA_DIR/backups).
    dir: str | None = None
    every_s: Positive = backup_service.EVERY_S  # how often it backs up
    keep: Annotated[int, msgspec.Meta(ge=1)] = backup_service.KEEP  # how many archives it keeps, the newest


Service = Literal[(*ALL_SERVICES, *OPTIONAL_SERVICES)]  # type: ignore[valid-type]


class Settings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything `llmgw server` takes: the config file's schema."""

    nats: NatsSettings = NatsSettings()
    db: str | None = None  # the projections' database: postgresql://… or a SQLite file path (required)
    services: tuple[Service, ...] = ALL_SERVICES  # which services run in this process
    catalog: str | None = None  # models declared in a YAML file (edited there, not at runtime)
    # Make the cluster's first administrator here the first time (user admin, DIR/admin-password, DIR/admin-token).
    first_admin_dir: str | None = None
    log_level: Literal["debug", "info", "warning", "error", "critical"] = "info"  # the least severe log line written
    gateway: GatewaySettings = GatewaySettings()
    admin: AdminSettings = AdminSettings()
    tls: TlsSettings = TlsSettings()
    scheduler: SchedulerConfig = SchedulerConfig()
    router: RouterConfig = RouterConfig()
    usage: UsageSettings = UsageSettings()
    snapshots: SnapshotsSettings = SnapshotsSettings()
    mirror: MirrorSettings = MirrorSettings()
    hub: HubSettings = HubSettings()
    jobs: JobsSettings = JobsSettings()
    signin: SignInConfig = SignInConfig()
    backup: BackupSettings = BackupSettings()


# What the scheduler's and the router's structs take, where it is narrower than "a number ≥ 0" (their
# own fields carry no constraints; ones that do, with msgspec.Meta, are read from the struct).
BOUNDS: dict[str, tuple[str, float]] = {
    "scheduler.lost_after_s": ("≥", 1),
    "scheduler.park_after": ("≥", 1),
    "scheduler.backoff_cap_s": (">", 0),
    "scheduler.idle_s": (">", 0),
    "scheduler.forget_after_s": (">", 0),
    "router.first_token_s": (">", 0),
    "router.idle_s": (">", 0),
    "router.total_s": (">", 0),
    "router.connect_s": (">", 0),
    "router.activation_s": (">", 0),
    "router.gossip_s": (">", 0),
    "router.header_s": (">", 0),
    "router.body_s": (">", 0),
    "router.usage_ack_timeout_s": (">", 0),
    "router.max_body_bytes": ("≥", 1),
    "router.max_attempts": ("≥", 1),
    "router.max_messages": ("≥", 1),
    "router.max_json_depth": ("≥", 1),
    "router.max_prompt_tokens": ("≥", 1),
    "router.max_output_tokens": ("≥", 1),
    "router.default_max_tokens": ("≥", 1),
    "router.saturation": ("≥", 1),
    "router.queue_max_per_model": ("≥", 1),
    "router.queue_max_per_project": ("≥", 1),
    "router.queue_wait_s": (">", 0),
    "signin.session_hours": (">", 0),
    "signin.login_failures": ("≥", 1),
    "signin.login_window_s": (">", 0),
}

# Shares, at most 1.
UPPER: dict[str, float] = {"scheduler.scale_down_below": 1, "router.trace_sample_ratio": 1}

# What a setting does, where its struct says nothing beside it (or says it for another reader).
DESCRIPTIONS: dict[str, str] = {
    "scheduler.lost_after_s": "a node silent this long is lost, and its replicas are placed elsewhere",
    "scheduler.park_after": "a model whose replicas failed to start this many times in a row is parked",
    "scheduler.backoff_base_s": "the wait after a model's first failed start; it doubles with each failure",
    "scheduler.backoff_cap_s": "the longest wait between a model's failed starts",
    "scheduler.stop_grace_s": "the drain a stopped replica gets before its engine is killed",
    "scheduler.preempt": "let a model that cannot be placed take replicas of lower classes, or beyond "
    "their scope's guarantee (SCHED-7, docs/fleet.md)",
    "scheduler.preempt_min_age_s": "a replica younger than this is never taken: it has not yet served its start's cost",
    "scheduler.preempt_max_victims": "the most replicas one placement may take",
    "scheduler.preempt_grace_s": "the drain a replica taken by preemption gets",
    "scheduler.preempt_hold_s": "a victim's model waits this long (or until the winner is placed) to be placed again",
    "router.first_token_s": "a request whose engine sends no first token within this is answered 504",
    "router.idle_s": "a stream with no token for this long is ended",
    "router.total_s": "the longest a request may take in all",
    "router.connect_s": "the longest a connection to an engine may take",
    "router.max_body_bytes": "a request body above this is answered 413 `body_too_large`",
    "router.gossip_s": "how often each router tells the others what it admitted (limits)",
    "router.max_attempts": "the replicas a request is tried on before it is answered with an error",
    "router.body_s": "a request body that has not arrived within this is answered 408",
    "router.trace_endpoint": "send OTLP/HTTP spans of each request to this collector URL "
    "(http://host:4318/v1/traces); null: no traces (GW-9)",
    "router.trace_sample_ratio": "the share of the traces a client did not start that are kept (1: every one, 0: none)",
    "scheduler.scale_up_waiting_per_replica": "waiting requests per ready replica, on average over "
    "scheduler.scale_up_after_s, that add a replica (a model with no measurement)",
    "scheduler.scale_down_below": "a replica the load added is removed only if the requests of the busiest "
    "moment fit in the other replicas under this share of their slots (or of the measured capacity)",
    "signin.login_failures": "an address that fails this many logins within signin.login_window_s is blocked",
    "signin.login_window_s": "the window in which an address's failed logins are counted",
    "signin.login_block_s": "how long an address is first blocked; each further block lasts twice the one before",
    "signin.login_max_block_s": "the longest an address is blocked",
}

# Environment variables whose names were chosen before this file existed.
ENV_NAMES: dict[str, str] = {"hub.endpoint": "HF_ENDPOINT", "hub.token": "HF_TOKEN"}

# Values the example file (ops/llmgw.yaml) shows instead of the defaults.
EXAMPLES: dict[str, Any] = {
    "nats.url": "nats://nats-1:4222,nats://nats-2:4222,nats://nats-3:4222",
    "db": "postgresql://llmgw@db.internal/llmgw",
    "first_admin_dir": "/var/lib/llmgw",
    "mirror.dir": "/var/lib/llmgw/mirror",
    "router.usage_journal": "/var/lib/llmgw/usage-journal",
    "admin.public_url": "https://llm.corp.example",
}

SECRETS = ("hub.token",)  # shown as *** by --print-config

# Defaults derived at start, for the reference's default column.
DERIVED: dict[str, str] = {
    "mirror.dir": "DATA_DIR/mirror",
    "mirror.port": "admin.port + 2",
    "router.usage_journal": "DATA_DIR/usage-journal",
    "router.usage_mode": "strict (`llmgw up`: available)",
    "hub.token": "$HF_TOKEN, else `hf auth login`'s",
    "nats.stream_replicas": "the cluster's size, at most 3",
}


# -- walking the schema ---------------------------------------------------------------------------


class Setting(msgspec.Struct, frozen=True, kw_only=True):
    """One leaf of the schema: what the reference lists."""

    path: str
    type: Any  # msgspec.inspect type
    default: Any
    doc: str


def env_name(path: str) -> str:
    """``scheduler.lost_after_s`` → ``LLMGW_SCHEDULER_LOST_AFTER_S`` (a few keep older names: ENV_NAMES)."""
    return ENV_NAMES.get(path) or "LLMGW_" + path.replace(".", "_").upper()


def _field_comments(cls: type) -> dict[str, str]:
    """Each field's comment in ``cls``'s source: the comment lines just above it and the one beside it."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    out: dict[str, str] = {}
    for node in ast.parse(source).body[0].body:  # type: ignore[attr-defined]
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above: list[str] = []
        n = node.lineno - 1
        while n >= 1 and n in comments and lines[n - 1].lstrip().startswith("#"):
            above.insert(0, comments[n])
            n -= 1
        beside = [comments[n] for n in range(node.lineno, (node.end_lineno or node.lineno) + 1) if n in comments]
        # A comment beside a field is its own; one above it may open a group of fields, so it is used only
        # when there is none beside.
        out[node.target.id] = " ".join(beside or above)
    return out


def _unwrap(t: Any) -> Any:
    """The type under a ``X | None``."""
    if isinstance(t, mi.UnionType):
        rest = [u for u in t.types if not isinstance(u, mi.NoneType)]
        if len(rest) == 1:
            return rest[0]
    return t


@cache
def settings() -> tuple[Setting, ...]:
    """Every leaf setting of :class:`Settings`, in the file's order."""
    out: list[Setting] = []

    def walk(cls: type, st: mi.StructType, prefix: str) -> None:
        comments = _field_comments(cls)
        for f in st.fields:
            path = prefix + f.encode_name
            if isinstance(f.type, mi.StructType):
                walk(f.type.cls, f.type, path + ".")
                continue
            default = f.default if f.default is not mi.NODEFAULT else None
            if default is None and f.default_factory is not mi.NODEFAULT:
                default = f.default_factory()
            doc = DESCRIPTIONS.get(path) or comments.get(f.name, "")
            out.append(Setting(path=path, type=f.type, default=default, doc=doc))

    walk(Settings, mi.type_info(Settings), "")  # type: ignore[arg-type]
    return tuple(out)


def _bound(path: str, t: Any) -> tuple[str, float] | None:
    """The lower bound a number takes: from the struct's Meta, else BOUNDS, else ≥ 0."""
    t = _unwrap(t)
    if not isinstance(t, mi.IntType | mi.FloatType):
        return None
    if t.gt is not None:
        return (">", t.gt)
    if t.ge is not None:
        return ("≥", t.ge)
    return BOUNDS.get(path, ("≥", 0))


def _upper(path: str, t: Any) -> float | None:
    """The most a number takes: from the struct's Meta, else UPPER, else no limit."""
    t = _unwrap(t)
    return t.le if t.le is not None else UPPER.get(path)


def _words(path: str, t: Any) -> str:
    """What a setting takes, in words: ``a number ≥ 1``, ``a list of text``, ``true or false or null``."""
    if isinstance(t, mi.UnionType):
        parts = [_words(path, u) for u in t.types if not isinstance(u, mi.NoneType)]
        nullable = any(isinstance(u, mi.NoneType) for u in t.types)
        return " or ".join(parts + (["null"] if nullable else []))
    if isinstance(t, mi.IntType | mi.FloatType):
        noun = "a whole number" if isinstance(t, mi.IntType) else "a number"
        op, low = _bound(path, t) or ("≥", 0)
        top = _upper(path, t)
        high = f" and ≤ {_num(top)}" if top is not None else ""
        return f"{noun} {op} {_num(low)}{high}"
    if isinstance(t, mi.BoolType):
        return "true or false"
    if isinstance(t, mi.StrType):
        return "text"
    if isinstance(t, mi.LiteralType):
        return "one of " + ", ".join(str(v) for v in t.values)
    if isinstance(t, mi.VarTupleType | mi.ListType):
        inner = _words(path, t.item_type)
        if isinstance(t.item_type, mi.LiteralType):
            return "a list, each " + inner
        return "a list of " + (inner[2:] if inner.startswith("a ") else inner)
    return "a value"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _shown(value: Any) -> str:
    """A value as the message that refuses it shows it."""
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return json.dumps(value, default=str)


# -- checking a layer ------------------------------------------------------------------------------


def _check_leaf(path: str, t: Any, value: Any) -> str | None:
    """Why ``value`` cannot be ``path``, or None."""
    expected = _words(path, t)
    if isinstance(t, mi.UnionType):
        if value is None and any(isinstance(u, mi.NoneType) for u in t.types):
            return None
        inner = [u for u in t.types if not isinstance(u, mi.NoneType)]
        if len(inner) == 1:
            why = _check_leaf(path, inner[0], value)
            return None if why is None else f"expected {expected}, got {_shown(value)}"
    if isinstance(t, mi.IntType | mi.FloatType):
        ok_type = isinstance(value, int) if isinstance(t, mi.IntType) else isinstance(value, int | float)
        if isinstance(value, bool) or not ok_type:
            return f"expected {expected}, got {_shown(value)}"
        op, low = _bound(path, t) or ("≥", 0)
        top = _upper(path, t)
        if (op == "≥" and value < low) or (op == ">" and value <= low) or (top is not None and value > top):
            return f"expected {expected}, got {_shown(value)}"
        return None
    if isinstance(t, mi.BoolType):
        return None if isinstance(value, bool) else f"expected {expected}, got {_shown(value)}"
    if isinstance(t, mi.StrType):
        return None if isinstance(value, str) else f"expected {expected}, got {_shown(value)}"
    if isinstance(t, mi.LiteralType):
        return None if value in t.values else f"expected {expected}, got {_shown(value)}"
    if isinstance(t, mi.VarTupleType | mi.ListType):
        if not isinstance(value, list | tuple):
            return f"expected {expected}, got {_shown(value)}"
        for i, item in enumerate(value):
            why = _check_leaf(f"{path}[{i}]", t.item_type, item)
            if why is not None:
                return f"[{i}]: {why}"  # the item's index, joined to the key by the caller
        return None
    if isinstance(t, mi.NoneType):
        return None if value is None else f"expected null, got {_shown(value)}"
    return None


def check(raw: Any, where: str = "") -> None:
    """Refuse a layer (a file's mapping, the environment's, the flags') with one line naming the
    first key that is unknown, of the wrong type or out of range; ``where`` prefixes it."""
    prefix = f"{where}: " if where else ""

    def walk(value: Any, st: mi.StructType, path: str) -> None:
        if not isinstance(value, dict):
            what = f"{path[:-1]}: expected a mapping" if path else "expected a mapping of settings"
            raise ConfigError(f"{prefix}{what}, got {_shown(value)}")
        fields = {f.encode_name: f for f in st.fields}
        for key, item in value.items():
            if key not in fields:
                raise ConfigError(f"{prefix}{path}{key}: unknown key ({_suggest(str(key), list(fields))})")
            t = fields[key].type
            if isinstance(t, mi.StructType):
                walk(item, t, f"{path}{key}.")
                continue
            why = _check_leaf(f"{path}{key}", t, item)
            if why is not None:
                raise ConfigError(f"{prefix}{path}{key}{_joined(why)}")

    walk(raw, mi.type_info(Settings), "")  # type: ignore[arg-type]


def _joined(why: str) -> str:
    """What follows a key in a message: ``: expected …``, or ``[2]: expected …`` for a list's item."""
    return why if why.startswith("[") else f": {why}"


def _suggest(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
    if close:
        return f"did you mean {close[0]}?"
    return "known: " + ", ".join(known)


# -- the layers --------------------------------------------------------------------------------------


def read_file(path: str | Path) -> dict[str, Any]:
    """A config file's mapping, checked; :class:`ConfigError` naming the file and what is wrong."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such config file") from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot be read ({exc.strerror})") from None
    try:
        raw = yaml.load(text, Loader=_LOADER)  # a safe loader, C or Python
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{p}: not valid YAML{at}: {problem}") from None
    raw = _without_empty_sections({} if raw is None else raw, mi.type_info(Settings))  # type: ignore[arg-type]
    check(raw, str(p))
    return raw


def _without_empty_sections(raw: Any, st: mi.StructType) -> Any:
    """``raw`` less the sections with nothing under them (``router:`` with every key commented out)."""
    if not isinstance(raw, dict):
        return raw
    sections = {f.encode_name: f.type for f in st.fields if isinstance(f.type, mi.StructType)}
    return {
        k: _without_empty_sections(v, sections[k]) if k in sections else v
        for k, v in raw.items()
        if not (k in sections and v is None)
    }


# libyaml's safe loader where PyYAML was built with it: 14 times faster on ops/llmgw.yaml (12 ms, not 177).
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_MISSING = object()
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _from_env(path: str, t: Any, text: str) -> Any:
    """An environment variable's text as the value ``path`` takes (lists: comma-separated)."""
    inner = _unwrap(t)
    if isinstance(t, mi.UnionType) and text == "":
        return None
    if isinstance(inner, mi.LiteralType):
        return text.lower() if text.lower() in inner.values else text  # LLMGW_LOG_LEVEL=DEBUG
    if isinstance(inner, mi.StrType):
        return text
    if isinstance(inner, mi.BoolType):
        low = text.strip().lower()
        return True if low in _TRUE else False if low in _FALSE else text
    if isinstance(inner, mi.VarTupleType | mi.ListType):
        return [_from_env(path, inner.item_type, part.strip()) for part in text.split(",") if part.strip()]
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _under(path: str, keys: Mapping[str, str]) -> str | None:
    """The key of ``keys`` that ``path`` is or lies under, if any."""
    return next((k for k in keys if path == k or path.startswith(k + ".")), None)


def from_env(environ: Mapping[str, str], ignored: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The settings the environment sets (each :func:`env_name` present), checked and nested; those
    under a key of ``ignored`` are left out (a command that decides them itself)."""
    out: dict[str, Any] = {}
    for s in settings():
        name = env_name(s.path)
        if name not in environ or _under(s.path, ignored or {}):
            continue
        value = _from_env(s.path, s.type, environ[name])
        why = _check_leaf(s.path, s.type, value)
        if why is not None:
            raise ConfigError(f"${name}: {s.path}{_joined(why)}")
        _put(out, s.path, value)
    return out


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``{"router.total_s": 5}`` → ``{"router": {"total_s": 5}}``."""
    out: dict[str, Any] = {}
    for path, value in flat.items():
        _put(out, path, value)
    return out


def _put(out: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(".")
    for p in parents:
        out = out.setdefault(p, {})
    out[leaf] = value


def merge(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """The layers, later ones over earlier ones, key by key."""
    out: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if isinstance(value, Mapping) and isinstance(out.get(key), dict):
                out[key] = merge(out[key], value)
            elif isinstance(value, Mapping):
                out[key] = merge(value)
            else:
                out[key] = value
    return out


def load(
    file: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
    *,
    base: Mapping[str, Any] | None = None,
    not_here: Mapping[str, str] | None = None,
) -> Settings:
    """The settings: ``flags`` (``{"router.total_s": 5}``) over ``environ`` over ``file`` over ``base``
    (a command's own defaults) over the defaults. A key of ``not_here`` in the file is refused with its
    reason (the command decides it itself); in the environment it is ignored."""
    from_file = read_file(file) if file else {}
    for path, why in (not_here or {}).items():
        node: Any = from_file
        for part in path.split("."):
            node = node.get(part, _MISSING) if isinstance(node, dict) else _MISSING
        if node is not _MISSING:
            raise ConfigError(f"{file}: {path}: {why}")
    given = nest(flags or {})
    check(given, "flags")
    raw = merge(nest(base or {}), from_file, from_env(environ or {}, not_here), given)
    try:
        return msgspec.convert(raw, Settings)
    except msgspec.ValidationError as exc:  # what the key-by-key check let through, in msgspec's words
        raise ConfigError(str(exc)) from None


def resolve(s: Settings, data_dir: Path, hub_token: str | None = None) -> Settings:
    """The settings with what defaults to something derived filled in (the mirror's port and directory,
    the usage journal, the hub token when none is set), as the services will see them."""
    return msgspec.structs.replace(
        s,
        mirror=msgspec.structs.replace(
            s.mirror,
            dir=s.mirror.dir or str(data_dir / "mirror"),
            port=s.mirror.port if s.mirror.port else s.admin.port + 2,
        ),
        router=msgspec.structs.replace(
            s.router, usage_journal=s.router.usage_journal or str(data_dir / "usage-journal")
        ),
        hub=msgspec.structs.replace(s.hub, token=s.hub.token or hub_token),
        backup=msgspec.structs.replace(s.backup, dir=s.backup.dir or str(data_dir / "backups")),
    )


def snapshots_config(s: Settings) -> SnapshotsConfig:
    return SnapshotsConfig(
        every_events=s.snapshots.every_events,
        every_s=s.snapshots.every_s,
        replay_every_events=s.snapshots.replay_every_events,
    )


def server_config(s: Settings, **more: Any) -> ServerConfig:
    """What :func:`llmgw.cli.runtime.serve` runs from ``s`` (resolved); ``more``: fields the settings
    do not hold (the declared models)."""
    if not s.nats.url:
        raise ConfigError("nats.url: required: give --nats URL, $LLMGW_NATS_URL or nats.url in the config file")
    if not s.db:
        raise ConfigError("db: required: give --db DSN, $LLMGW_DB or db in the config file")
    public = urlsplit(s.admin.public_url)
    if s.admin.public_url and (public.scheme not in ("http", "https") or not public.hostname or public.query):
        raise ConfigError(
            f"admin.public_url: {s.admin.public_url!r} is not where people reach the console: write its "
            "scheme and address, e.g. https://llm.corp.example (a path prefix is kept, a query is not allowed)"
        )
    return ServerConfig(
        nats_url=s.nats.url,
        db_dsn=s.db,
        services=tuple(s.services),
        host=s.gateway.host,
        port=s.gateway.port,
        admin_host=s.admin.host,
        admin_port=s.admin.port,
        insecure=s.admin.insecure,
        admin_public_url=s.admin.public_url,
        stream_replicas=s.nats.stream_replicas,
        first_admin_dir=s.first_admin_dir,
        scheduler=s.scheduler,
        router=s.router,
        usage_retention_days=s.usage.retention_days,
        usage_prune_every_s=s.usage.prune_every_s,
        snapshots=snapshots_config(s),
        signin=s.signin,
        mirror_dir=s.mirror.dir,
        mirror_port=s.mirror.port or s.admin.port + 2,
        mirror_max_bytes=int(s.mirror.max_gb * 1e9) if s.mirror.max_gb else None,
        mirror_peer_of=s.mirror.peer_of,
        mirror_peer_name=s.mirror.peer_name,
        mirror_urls=",".join(s.mirror.urls) or None,
        hub_endpoint=s.hub.endpoint,
        hub_token=s.hub.token,
        hub_allow_private=s.hub.allow_private,
        jobs_source=s.jobs.source,
        tls_cert=s.tls.cert,
        tls_key=s.tls.key,
        nats_ca=s.nats.ca,
        nats_cert=s.nats.cert,
        nats_key=s.nats.key,
        nats_creds=s.nats.creds,
        backup_dir=s.backup.dir,
        backup_every_s=s.backup.every_s,
        backup_keep=s.backup.keep,
        **more,
    )


# -- what people read -----------------------------------------------------------------------------------


def _mask_dsn(dsn: str) -> str:
    """A database URL with its password as ***."""
    try:
        parts = urlsplit(dsn)
        if parts.password is None:
            return dsn
        port = f":{parts.port}" if parts.port else ""
    except ValueError:  # not a URL (a SQLite path, say), or a malformed one: shown whole, as it was given
        return dsn if "@" not in dsn else "***"
    netloc = f"{parts.username or ''}:***@{parts.hostname or ''}{port}"
    return urlunsplit(parts._replace(netloc=netloc))


def show(s: Settings) -> str:
    """The settings as YAML (the config file's own shape), with secrets masked."""
    raw = msgspec.to_builtins(s)
    for path in SECRETS:
        *parents, leaf = path.split(".")
        node = raw
        for p in parents:
            node = node[p]
        if node.get(leaf):
            node[leaf] = "***"
    if raw.get("db"):
        raw["db"] = _mask_dsn(raw["db"])
    return yaml.safe_dump(raw, sort_keys=False, allow_unicode=True)


def _default_text(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, tuple | list):
        return ", ".join(str(v) for v in value) if value else "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value) if isinstance(value, str) else _num(value) if isinstance(value, float) else str(value)


def render_reference() -> str:
    """The settings reference in docs/operations.md (between its markers), from the structs."""
    rows = [
        "| key | takes | default | environment | what it does |",
        "|---|---|---|---|---|",
    ]
    for s in settings():
        doc = s.doc.replace("|", "\\|")
        rows.append(
            f"| `{s.path}` | {_words(s.path, s.type)} | {DERIVED.get(s.path) or _default_text(s.default)} "
            f"| `{env_name(s.path)}` | {doc} |"
        )
    return "\n".join(rows) + "\n"


BEGIN = "<!-- settings reference: generated by `llmgw config reference --write`; do not edit -->\n"
END = "<!-- end of the settings reference -->\n"


def spliced(page: str, reference: str) -> str:
    """``page`` with the text between its markers replaced by ``reference``."""
    start, end = page.find(BEGIN), page.find(END)
    if start < 0 or end < start:
        raise ConfigError("the page has no settings reference markers to write between")
    return page[: start + len(BEGIN)] + reference + page[end:]


def reference_on(page: str) -> str:
    """The reference a page holds between its markers ('' without them)."""
    start, end = page.find(BEGIN), page.find(END)
    return page[start + len(BEGIN) : end] if 0 <= start < end else ""


def render_example() -> str:
    """ops/llmgw.yaml: every key, with what it does above it and its default (or an example) as its value."""
    out = [
        "# llmgw server --config /etc/llmgw/llmgw.yaml: every setting, at its default unless an example is shown.",
        "# Flags and the environment (LLMGW_<SECTION>_<KEY>) win over this file; docs/operations.md lists them all.",
        "# Generated by `llmgw config example`.",
    ]
    section = ""
    for s in settings():
        head, _, leaf = s.path.rpartition(".")
        if head != section:
            if head:
                out += ["", f"{head}:"]
            section = head
        indent = "  " if head else ""
        if not head:
            out.append("")
        doc = s.doc or s.path
        for line in [*textwrap.wrap(doc, 100), f"{_words(s.path, s.type)}; ${env_name(s.path)}"]:
            out.append(f"{indent}# {line}")
        value = EXAMPLES.get(s.path, s.default)
        if isinstance(value, tuple):
            value = list(value)
        dumped = yaml.safe_dump({leaf: value}, default_flow_style=True, width=1000, allow_unicode=True).strip()
        out.append(indent + dumped[1:-1])
    return "\n".join(out) + "\n"
