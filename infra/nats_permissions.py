"""NATS users and what each may publish and subscribe to (issue "Trust", item 4); pure data.

One user per role, each with subject permissions that let today's code do its work and little more:

- ``operator``: everything (the admin on the `up` machine, `llmgw events …`, `llmgw streams …`, benches);
- ``control``: the control plane (command services, scheduler, projections, accountant, mirror, jobs,
  admin API; in `up` the router too, one process, one connection): every llmgw subject, bucket and
  JetStream API, but it can never delete or purge the log's streams;
- ``router``: reads the events it folds (the whole event log), publishes usage, gossip and demand,
  keeps its budgets and snapshots, reads the cluster secret; never an event, a command or the secret;
- ``agent-<node>``: one per node: its own heartbeats and RPC subjects, the replica events it reads and
  appends (replica subjects are per replica, not per node, so any agent may append to any replica),
  the cluster secret read-only (engine keys and the mirror token are derived from it);
- ``cli``: people's CLIs: publish commands and read their outcomes (``llmgw.evt.command.<id>``), nothing else.

Each user's replies come to its own inbox prefix (``_INBOX.<user>``), and it may subscribe to no other
inbox: a reply to another user (a read of the cluster secret, say) is not for its eyes.

Reading a stream means creating a consumer; consumers are named (``events/runtime/reader.py``), so the filter is
part of the API subject (``$JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>``) and a role can be held to
the subjects it reads: the server refuses a body whose filter differs from the subject's.
"""

from __future__ import annotations

import msgspec

from llmgw.events.runtime.connection import NatsCredential, inbox_prefix
from llmgw.events.schema import subjects as S
from llmgw.events.schema.subjects import encode_token

OPERATOR = "operator"
CONTROL = "control"
ROUTER = "router"
CLI = "cli"
AGENT_PREFIX = "agent-"
ROLES = (OPERATOR, CONTROL, ROUTER, CLI)  # and one agent-<node> per node

SECRETS_BUCKET = "llmgw_secrets"  # events/runtime/secrets.py
CONTROL_SECRETS_BUCKET = "llmgw_control_secrets"  # events/runtime/secrets.py: the command-signing secret, control only
BUDGETS_BUCKET = "llmgw_budgets"  # services/router/budgets.py
LEASES_BUCKET = "llmgw_leases"  # services/scheduler/service.py
RESPONSES_BUCKET = "llmgw_responses"  # services/router/response_store.py: stored /v1/responses
SNAPSHOTS_BUCKET = "llmgw_snapshots"  # events/runtime/snapshots.py (an object store)
LOG_STREAMS = (S.STREAM_EVENTS, S.STREAM_COMMANDS, S.STREAM_USAGE, S.STREAM_TELEMETRY, S.STREAM_QUARANTINE)
JS = "$JS.API"


class SubjectRules(msgspec.Struct, frozen=True, kw_only=True):
    """Subjects allowed and denied (a deny wins); an empty ``allow`` with rules present allows nothing."""

    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()


class Permissions(msgspec.Struct, frozen=True, kw_only=True):
    publish: SubjectRules
    subscribe: SubjectRules
    allow_responses: bool = False  # may answer the requests it receives (whatever their reply subject)


class NatsUser(msgspec.Struct, frozen=True, kw_only=True):
    """A user of the server's ``authorization`` block; ``permissions`` None: may do everything."""

    user: str
    password: str  # plain, or a bcrypt hash ("$2a$…"), which nats-server also accepts
    permissions: Permissions | None = None


def agent_user(node_id: str) -> str:
    """The NATS user of node ``node_id``'s agent (the node id as a subject token: safe in a file name too)."""
    return f"{AGENT_PREFIX}{encode_token(node_id)}"


def is_role(name: str) -> bool:
    """Whether ``name`` is a role's user name (an ``agent-<node>`` included, its node a valid subject token)."""
    if name in ROLES:
        return True
    if not name.startswith(AGENT_PREFIX) or len(name) == len(AGENT_PREFIX):
        return False
    try:
        S.decode_token(name[len(AGENT_PREFIX) :])
    except ValueError:
        return False
    return True


def _stream_reader(stream: str, filters: tuple[str, ...] = (">",), *, direct_by_seq: bool = True) -> tuple[str, ...]:
    """The API subjects to read ``stream`` through consumers filtered to ``filters``, and by direct gets.

    ``direct_by_seq``: also get any message by its sequence (the subject is then not in the API subject,
    so only for a role that may read the whole stream)."""
    out: list[str] = [f"{JS}.STREAM.INFO.{stream}"]
    for f in filters:
        out += [f"{JS}.CONSUMER.CREATE.{stream}.*.{f}", f"{JS}.DIRECT.GET.{stream}.{f}"]
    if filters == (">",):
        # Unnamed consumers, named ones of the whole stream, gets by sequence: the subject is in the body only.
        out += [f"{JS}.CONSUMER.CREATE.{stream}", f"{JS}.CONSUMER.CREATE.{stream}.*", f"{JS}.STREAM.MSG.GET.{stream}"]
    if direct_by_seq:
        out.append(f"{JS}.DIRECT.GET.{stream}")
    out += [
        f"{JS}.CONSUMER.MSG.NEXT.{stream}.*",
        f"{JS}.CONSUMER.INFO.{stream}.*",
        f"{JS}.CONSUMER.DELETE.{stream}.*",
    ]
    return tuple(out)


def _kv_reader(bucket: str) -> tuple[str, ...]:
    """Open a key-value bucket and get its keys (never write them)."""
    stream = f"KV_{bucket}"
    return (
        f"{JS}.STREAM.INFO.{stream}",
        f"{JS}.DIRECT.GET.{stream}",
        f"{JS}.DIRECT.GET.{stream}.$KV.{bucket}.>",
        f"{JS}.STREAM.MSG.GET.{stream}",
    )


def _kv_owner(bucket: str) -> tuple[str, ...]:
    """Create a bucket when missing, read and write its keys."""
    return (*_kv_reader(bucket), f"{JS}.STREAM.CREATE.KV_{bucket}", f"$KV.{bucket}.>")


def _object_store_owner(bucket: str) -> tuple[str, ...]:
    """Create an object store when missing, put, get, list and delete objects (snapshots)."""
    stream = f"OBJ_{bucket}"
    return (
        *_stream_reader(stream),
        f"{JS}.STREAM.CREATE.{stream}",
        f"{JS}.STREAM.PURGE.{stream}",  # deleting an object purges its chunks
        f"$O.{bucket}.>",
    )


# Every process that opens the event store at start checks the streams and buckets (EventStore.ensure_streams),
# and creates a missing stream (an existing one cannot be changed by a create).
_STREAM_CHECKS = (
    f"{JS}.INFO",
    f"{JS}.STREAM.INFO.*",
    f"{JS}.STREAM.LIST",
    f"{JS}.STREAM.NAMES",
    *(f"{JS}.STREAM.CREATE.{s}" for s in LOG_STREAMS),
)
_QUARANTINE = f"{S.QUARANTINE_ROOT}.>"  # every reader keeps what it cannot decode
_FLOW_CONTROL = "$JS.FC.>"  # a push consumer's (an object store read) flow-control answers


def operator() -> Permissions | None:
    return None


def control() -> Permissions:
    """The control plane: everything llmgw, but it never deletes or purges the log's streams or the secret."""
    keep = (*LOG_STREAMS, f"KV_{SECRETS_BUCKET}", f"KV_{CONTROL_SECRETS_BUCKET}")
    return Permissions(
        publish=SubjectRules(
            allow=(
                f"{S.PREFIX}.>",
                f"{JS}.>",
                "$JS.ACK.>",
                _FLOW_CONTROL,
                "$JS.SNAPSHOT.ACK.>",  # the backup service's snapshots (infra/backup.py); restoring is the operator's
                *(f"$KV.{b}.>" for b in (SECRETS_BUCKET, CONTROL_SECRETS_BUCKET, BUDGETS_BUCKET, LEASES_BUCKET)),
                f"$KV.{RESPONSES_BUCKET}.>",
                f"$O.{SNAPSHOTS_BUCKET}.>",
            ),
            deny=tuple(f"{JS}.STREAM.{verb}.{s}" for s in keep for verb in ("DELETE", "PURGE", "MSG.DELETE")),
        ),
        subscribe=SubjectRules(allow=(f"{S.PREFIX}.>", f"{inbox_prefix(CONTROL)}.>")),
        allow_responses=True,  # the scheduler answers `explain` and `headroom`
    )


def router() -> Permissions:
    """A gateway: reads the event log and the heartbeats, publishes usage, gossip and demand; no event,
    command or secret write."""
    return Permissions(
        publish=SubjectRules(
            allow=(
                f"{S.USAGE_ROOT}.>",
                f"{S.PREFIX}.gossip.limits",  # services/router/gossip.py
                f"{S.PREFIX}.demand.*",  # services/router/app.py: wakes an on-demand model
                f"{S.PREFIX}.queue.*",  # its queue's depth per model: load for the autoscaler (SCHED-9)
                _QUARANTINE,
                *_STREAM_CHECKS,
                *_stream_reader(S.STREAM_EVENTS),
                *_kv_reader(SECRETS_BUCKET),
                *_kv_owner(BUDGETS_BUCKET),
                *_kv_owner(RESPONSES_BUCKET),
                *_object_store_owner(SNAPSHOTS_BUCKET),
                _FLOW_CONTROL,
            ),
        ),
        subscribe=SubjectRules(
            allow=(
                f"{S.PREFIX}.gossip.limits",
                f"{S.TELEMETRY_ROOT}.node.*",  # services/router/app.py: the engines' load, to route on
                f"{inbox_prefix(ROUTER)}.>",
            )
        ),
    )


def agent(node_id: str) -> Permissions:
    """Node ``node_id``'s agent: its heartbeats and RPC subjects; the replica events; the secret, read-only."""
    node = encode_token(node_id)
    replicas = f"{S.EVENTS_ROOT}.replica"
    return Permissions(
        publish=SubjectRules(
            allow=(
                f"{S.TELEMETRY_ROOT}.node.{node}",
                f"{replicas}.*",
                _QUARANTINE,
                *_STREAM_CHECKS,
                *_stream_reader(S.STREAM_EVENTS, (f"{replicas}.>",), direct_by_seq=False),
                *_kv_reader(SECRETS_BUCKET),
            ),
        ),
        subscribe=SubjectRules(
            allow=(f"{S.PREFIX}.rpc.agent.{node}.>", f"{inbox_prefix(agent_user(node_id))}.>"),
        ),
        allow_responses=True,  # it answers `logs` and `weights` requests
    )


def cli() -> Permissions:
    """A person's CLI: publish commands, read their outcomes; reads go through the admin API."""
    outcomes = f"{S.EVENTS_ROOT}.command.*"
    return Permissions(
        publish=SubjectRules(allow=(f"{S.COMMANDS_ROOT}.>", f"{JS}.DIRECT.GET.{S.STREAM_EVENTS}.{outcomes}")),
        subscribe=SubjectRules(allow=(outcomes, f"{inbox_prefix(CLI)}.>")),
    )


def permissions_of(user: str) -> Permissions | None:
    """The permissions of role ``user`` (``agent-<node token>`` included); ValueError for no role."""
    fixed = {OPERATOR: operator, CONTROL: control, ROUTER: router, CLI: cli}
    if user in fixed:
        return fixed[user]()
    if is_role(user):
        return agent(S.decode_token(user[len(AGENT_PREFIX) :]))
    raise ValueError(
        f"{user!r} is no NATS role: the roles are {', '.join(ROLES)} and agent-NODE (`llmgw ctl nats add-agent NODE`)"
    )


def users(credentials: list[NatsCredential]) -> tuple[NatsUser, ...]:
    """The authorization block's users for these credentials, each with its role's permissions."""
    return tuple(
        NatsUser(user=c.user, password=c.password, permissions=permissions_of(c.user))
        for c in sorted(credentials, key=lambda c: c.user)
    )
