"""Keys, limits, prices and budgets (SPEC TEN-2, GW-4, GW-5): state folded from events, and the
pure decisions over it.

The access state folds the tenancy tree (to resolve ``team:acme/ml`` to the team's id) and the
``key``, ``limit``, ``price`` and ``budget`` aggregates. Each decision is a function of (state,
command, now) that returns a :class:`~llmgw.events.commands.shell.Decision` — the aggregate's
subject and the payloads to append — or raises :class:`Rejected` with a reason a person can act on.
Routers enforce; this module only decides what is recorded.

Scopes are written ``org:<id>``, ``team:<id>``, ``project:<id>`` or ``key:<key id>`` on the log;
commands may name them by path (``team:acme/ml``), by id, or without the kind where that is
unambiguous (``acme/ml`` is a team: paths have one part per level).
"""

from __future__ import annotations

import math
import re
import secrets
import string
from datetime import datetime

import msgspec

from llmgw.events.commands import roles as R
from llmgw.events.commands.shell import Decision
from llmgw.events.folds import keys as K
from llmgw.events.folds.tenancy import TenancyTree
from llmgw.events.schema import access as A
from llmgw.events.schema import tenancy as T
from llmgw.events.schema.envelope import RecordedEvent
from llmgw.events.schema.outcomes import Rejected
from llmgw.events.schema.subjects import EVENTS_ROOT, aggregate_of, event_subject

SCOPE_KINDS = ("org", "team", "project", "key")
SCOPE_FORMS = "org:acme, team:acme/ml, project:acme/ml/chat or key:<key id or prefix>"
KEY_ID_PREFIX = "key_"
KEY_ID_LENGTH = 12
MIN_PARTIAL = 4  # characters of a key id or prefix that may name a key by its start
MAX_KEY_NAME = 64
MAX_USER = 128
MAX_MODEL = 128
MAX_REASON = 500
_PREFIX = re.compile(r"^[a-z0-9]{8}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_ALPHABET = string.ascii_lowercase + string.digits
TREE = event_subject(T.AGGREGATE, T.TREE_ID)
# What the state folds, each subject filter with the name its follower shows on /healthz.
SUBJECTS = {
    TREE: "access-tenancy",
    **{
        f"{EVENTS_ROOT}.{aggregate}.>": f"access-{aggregate}s"
        for aggregate in (A.KEY_AGGREGATE, A.LIMIT_AGGREGATE, A.PRICE_AGGREGATE, A.BUDGET_AGGREGATE)
    },
}


def new_key_id() -> str:
    """``key_`` and 12 random lower-case letters and digits: short, and safe in a subject."""
    return KEY_ID_PREFIX + "".join(secrets.choice(_ALPHABET) for _ in range(KEY_ID_LENGTH))


# A key as the one fold keeps it (``events/folds/keys.py``): the routers and `ctl key list` see the same.
KeyEntry = K.Key


class ResolvedScope(msgspec.Struct, frozen=True, kw_only=True):
    scope: str  # as on the log: kind:id
    label: str  # for people: "team acme/ml", "key key_… (ci)"


class AccessState:
    """Mutable, but changed only by :meth:`apply`, so the same events always give the same state."""

    def __init__(self) -> None:
        self.tree = TenancyTree()
        # The keys, limits, prices and budgets are the shared fold's (``events/folds/keys.py``).
        self.book = K.AccessBook()
        self.keys: dict[str, KeyEntry] = self.book.keys
        self.limits: dict[str, K.Limit] = self.book.limits
        self.prices: dict[str, K.Price] = self.book.prices
        self.budgets: dict[str, K.Budget] = self.book.budgets

    # -- fold --------------------------------------------------------------------------------

    def apply(self, event: RecordedEvent) -> None:
        aggregate, _ = aggregate_of(event.subject)
        if aggregate == T.AGGREGATE:
            self.tree.apply(event)
            return
        self.book.apply(event.payload)

    # -- queries -----------------------------------------------------------------------------

    def find_keys(self, text: str) -> list[KeyEntry]:
        """Keys named by ``text``: an id, a lookup prefix (``abcd1234`` or ``llmgw-abcd1234``), or
        the start of either (at least 4 characters). An exact match wins over starts."""
        t = text.strip()
        t = t.removeprefix("key:")
        t = t.removeprefix(f"{A.KEY_PREFIX}-")
        if not t:
            return []
        exact = [k for k in self.keys.values() if t in (k.id, k.prefix)]
        if exact or len(t) < MIN_PARTIAL:
            return exact
        return sorted(
            (k for k in self.keys.values() if k.id.startswith(t) or k.prefix.startswith(t)), key=lambda k: k.id
        )


# -- helpers -------------------------------------------------------------------------------------


def _known(names: list[str], what: str) -> str:
    if not names:
        return f" (there are no {what} yet)"
    names = sorted(names)
    shown = ", ".join(names[:10]) + (" …" if len(names) > 10 else "")
    return f" ({what}: {shown})"


def _scope_candidates(state: AccessState, kind: str, text: str, *, partial_keys: bool) -> list[ResolvedScope]:
    if kind == "key":
        keys = state.find_keys(text) if partial_keys else [k for k in state.keys.values() if text in (k.id, k.prefix)]
        return [ResolvedScope(scope=f"key:{k.id}", label=f"key {k.label()}") for k in keys]
    found = state.tree.find(kind, text)
    if found is None:
        return []
    return [ResolvedScope(scope=f"{kind}:{found.id}", label=f"{kind} {state.tree.path(found)}")]


def resolve_scope(state: AccessState, text: str) -> ResolvedScope:
    """The scope ``text`` names, by id on the log; refused when unknown or ambiguous, naming what exists."""
    text = text.strip()
    if not text:
        raise Rejected(f"a scope is needed: write {SCOPE_FORMS}", "invalid_scope")
    kind, sep, rest = text.partition(":")
    if sep:
        if kind not in SCOPE_KINDS:
            raise Rejected(f"unknown scope kind {kind!r} in {text!r}: write {SCOPE_FORMS}", "invalid_scope")
        if not rest.strip():
            raise Rejected(f"scope {text!r} names no {kind}: write {SCOPE_FORMS}", "invalid_scope")
        found = _scope_candidates(state, kind, rest.strip(), partial_keys=True)
        if not found:
            if kind == "key":
                live = [k.label() for k in state.keys.values() if not k.revoked]
                raise Rejected(
                    f"there is no key {rest.strip()!r}{_known(live, 'keys')}; `llmgw ctl key list` lists them",
                    "not_found",
                )
            names = [state.tree.path(s) for s in state.tree.scopes.values() if s.kind == kind]
            raise Rejected(f"there is no {kind} {rest.strip()!r}{_known(names, kind + 's')}", "not_found")
    else:
        found = [c for k in SCOPE_KINDS for c in _scope_candidates(state, k, text, partial_keys=False)]
        if not found:
            orgs = [s.name for s in state.tree.scopes.values() if s.kind == "org"]
            raise Rejected(f"there is no scope {text!r}: write {SCOPE_FORMS}{_known(orgs, 'orgs')}", "not_found")
    if len(found) > 1:
        options = "; ".join(f"{c.label} ({c.scope})" for c in found[:10])
        raise Rejected(
            f"scope {text!r} is ambiguous: it names {options}; write it with its kind and id (e.g. {found[0].scope})",
            "ambiguous",
        )
    resolved = found[0]
    if resolved.scope.startswith("key:") and state.keys[resolved.scope[4:]].revoked:
        raise Rejected(f"{resolved.label} is revoked; nothing can be set on it", "revoked")
    return resolved


def _resolve_project(state: AccessState, text: str) -> tuple[str, str]:
    """(project id, path) of a project named by path, id, or ``project:…``."""
    raw = text.strip().removeprefix("project:")
    if not raw:
        raise Rejected("a key needs a project: --project ORG/TEAM/PROJECT (e.g. acme/ml/chat)", "invalid_project")
    found = state.tree.find("project", raw)
    if found is None:
        names = [state.tree.path(s) for s in state.tree.scopes.values() if s.kind == "project"]
        create = f"`llmgw ctl project create {raw}`" if raw.count("/") == 2 else "`llmgw ctl project create O/T/P`"
        raise Rejected(f"there is no project {raw!r}{_known(names, 'projects')}; create it with {create}", "not_found")
    return found.id, state.tree.path(found)


def _positive(what: str, value: int | None) -> None:
    if value is not None and value <= 0:
        raise Rejected(
            f"{what} {value} is not allowed: give a positive number, or leave it out for no limit", "invalid_limit"
        )


def _per_minute(rpm: int | None, tpm: int | None) -> str:
    r = f"{rpm} requests" if rpm is not None else "no request limit"
    t = f"{tpm} tokens" if tpm is not None else "no token limit"
    return f"{r}, {t} per minute"


# -- decisions -----------------------------------------------------------------------------------


def decide_create_key(state: AccessState, c: A.CreateKey, now: datetime) -> Decision:
    project_id, path = _resolve_project(state, c.project)
    if not _PREFIX.match(c.prefix) or not _SHA256.match(c.secret_sha256):
        raise Rejected(
            "the key's prefix or hash is not in the format llmgw makes (8 lower-case letters and digits, and a "
            "SHA-256 in hex); make keys with `llmgw ctl key create`",
            "invalid_key",
        )
    for k in state.keys.values():
        if k.prefix == c.prefix:
            if k.secret_sha256 == c.secret_sha256:
                raise Rejected(f"this key was created before, as key {k.label()}", "exists")
            raise Rejected(f"key prefix {c.prefix} is taken by key {k.id}; make a new key and send it again", "taken")
    if len(c.name) > MAX_KEY_NAME or not c.name.isprintable():
        raise Rejected(
            f"key name {c.name[:20]!r} is not allowed: at most {MAX_KEY_NAME} printable characters", "invalid_name"
        )
    if c.user is not None and (not c.user.strip() or len(c.user) > MAX_USER or not c.user.isprintable()):
        raise Rejected(
            f"user {c.user[:20]!r} is not allowed: a person's name or login, at most {MAX_USER} printable characters",
            "invalid_user",
        )
    _positive("rpm", c.rpm)
    _positive("tpm", c.tpm)
    for model in c.models:
        if not model.strip() or len(model) > MAX_MODEL:
            raise Rejected(
                f"model allow-list entry {model[:20]!r} is not a model name: give names as in `llmgw ctl models`, "
                "separated by commas (--models a,b)",
                "invalid_models",
            )
    if c.expires_at is not None:
        if c.expires_at.tzinfo is None:
            raise Rejected(
                f"expiry {c.expires_at.isoformat()} has no time zone: give it in UTC (…Z) or as a duration (30d)",
                "invalid_expiry",
            )
        if c.expires_at <= now:
            raise Rejected(
                f"expiry {c.expires_at.isoformat()} is in the past (now {now.isoformat(timespec='seconds')}): "
                "give a future time or a duration (--expires 30d)",
                "invalid_expiry",
            )
    key_id = new_key_id()
    while key_id in state.keys:
        key_id = new_key_id()
    payload = A.KeyCreated(
        key_id=key_id,
        prefix=c.prefix,
        secret_sha256=c.secret_sha256,
        project_id=project_id,
        name=c.name,
        user=c.user,
        rpm=c.rpm,
        tpm=c.tpm,
        models=list(c.models),
        expires_at=c.expires_at,
        external=c.external,
    )
    named = f" ({c.name})" if c.name else ""
    return Decision(
        subject=event_subject(A.KEY_AGGREGATE, key_id),
        payloads=[payload],
        message=f"key {key_id}{named} created for project {path}"
        + ("; it may call external models (its prompts may leave the cluster)" if c.external else ""),
        result={"id": key_id, "prefix": c.prefix, "project": path, "project_id": project_id},
        fence=TREE,  # appended only while the tree is as decided on: never a key for a project deleted meanwhile
    )


def decide_revoke_key(state: AccessState, c: A.RevokeKey) -> Decision:
    matches = state.find_keys(c.key)
    if not matches:
        live = [k.label() for k in state.keys.values() if not k.revoked]
        raise Rejected(
            f"there is no key {c.key.strip()!r}{_known(live, 'live keys')}: give its id or prefix "
            "(`llmgw ctl key list`)",
            "not_found",
        )
    if len(matches) > 1:
        names = ", ".join(f"{k.label()} prefix {k.prefix}" for k in matches[:10])
        raise Rejected(f"{c.key.strip()!r} names {len(matches)} keys ({names}); give the whole id", "ambiguous")
    key = matches[0]
    if key.revoked:
        raise Rejected(f"key {key.label()} is already revoked", "already_revoked")
    if len(c.reason) > MAX_REASON:
        raise Rejected(f"the reason is {len(c.reason)} characters long; keep it under {MAX_REASON}", "invalid_reason")
    return Decision(
        subject=event_subject(A.KEY_AGGREGATE, key.id),
        payloads=[A.KeyRevoked(key_id=key.id, reason=c.reason)],
        message=f"key {key.label()} revoked; routers refuse it within seconds",
        result={"id": key.id, "prefix": key.prefix},
    )


def decide_set_limit(state: AccessState, c: A.SetLimit) -> Decision:
    scope = resolve_scope(state, c.scope)
    _positive("rpm", c.rpm)
    _positive("tpm", c.tpm)
    if c.rpm is None and c.tpm is None:
        key = state.keys.get(scope.scope[4:]) if scope.scope.startswith("key:") else None
        has_limit = scope.scope in state.limits or (key is not None and (key.rpm, key.tpm) != (None, None))
        if not has_limit:
            raise Rejected(f"{scope.label} has no limit to clear; give --rpm and/or --tpm to set one", "unchanged")
        message = f"limits of {scope.label} cleared"
    else:
        message = f"limits of {scope.label} set: {_per_minute(c.rpm, c.tpm)}"
    return Decision(
        subject=event_subject(A.LIMIT_AGGREGATE, scope.scope),
        payloads=[A.LimitSet(scope=scope.scope, rpm=c.rpm, tpm=c.tpm)],
        message=message,
        result={"scope": scope.scope, "label": scope.label},
    )


def _usd(what: str, value: float, *, positive: bool) -> None:
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        need = "a positive amount" if positive else "zero or a positive amount"
        raise Rejected(f"{what} {value} is not allowed: give {need} in US dollars", "invalid_amount")


def decide_set_price(state: AccessState, c: A.SetPrice) -> Decision:
    model = c.model
    if not model.strip() or len(model) > MAX_MODEL:
        raise Rejected("a price needs a model name (as in `llmgw ctl models`)", "invalid_model")
    _usd("input price", c.input_usd_per_m, positive=False)
    _usd("output price", c.output_usd_per_m, positive=False)
    return Decision(
        subject=event_subject(A.PRICE_AGGREGATE, model),
        payloads=[A.PriceSet(model=model, input_usd_per_m=c.input_usd_per_m, output_usd_per_m=c.output_usd_per_m)],
        message=(
            f"price of {model} set: ${c.input_usd_per_m:g} input, ${c.output_usd_per_m:g} output per million tokens"
        ),
        result={"model": model},
    )


def decide_set_budget(state: AccessState, c: A.SetBudget) -> Decision:
    scope = resolve_scope(state, c.scope)
    if c.period not in A.PERIODS:
        raise Rejected(f"budget period {c.period!r} is not one of {', '.join(A.PERIODS)}", "invalid_period")
    if c.usd is None:
        if scope.scope not in state.budgets:
            raise Rejected(f"{scope.label} has no budget to clear; give --usd N to set one", "unchanged")
        message = f"budget of {scope.label} cleared"
    else:
        _usd("budget", c.usd, positive=True)
        message = f"budget of {scope.label} set: ${c.usd:g} per {c.period}"
    return Decision(
        subject=event_subject(A.BUDGET_AGGREGATE, scope.scope),
        payloads=[A.BudgetSet(scope=scope.scope, usd=c.usd, period=c.period)],
        message=message,
        result={"scope": scope.scope, "label": scope.label},
    )


def decide(state: AccessState, command: A.AccessCommand, now: datetime) -> Decision:
    match command:
        case A.CreateKey():
            return decide_create_key(state, command, now)
        case A.RevokeKey():
            return decide_revoke_key(state, command)
        case A.SetLimit():
            return decide_set_limit(state, command)
        case A.SetPrice():
            return decide_set_price(state, command)
        case A.SetBudget():
            return decide_set_budget(state, command)
    raise Rejected(f"unknown access command {type(command).__name__}")


# -- who may send what ------------------------------------------------------------------------------

# The role that sets limits and budgets on a tenant of each kind: its own admins (a project's: its team's).
_ADMIN_OF = {"org": "org-admin", "team": "team-admin", "project": "team-admin", "key": "team-admin"}


def need(state: AccessState, c: A.AccessCommand) -> R.Need:
    """The role a person needs to send ``c`` (pure over ``state``): a member makes and revokes keys in its
    projects; a tenant's admins set its limits and budgets; prices are the cluster admins'.

    Something that does not resolve is checked against the cluster (only its admins learn it is unknown)."""
    match c:
        case A.CreateKey():
            return R.Need(role="member", what=f"creating a key in {c.project}", kind="project", tenant=c.project)
        case A.RevokeKey():
            keys = state.find_keys(c.key)
            project = keys[0].project_id if len(keys) == 1 else ""
            return R.Need(role="member", what=f"revoking key {c.key}", kind="project", tenant=project)
        case A.SetLimit() | A.SetBudget():
            what = f"setting a {'limit' if isinstance(c, A.SetLimit) else 'budget'} on {c.scope}"
            try:
                scope = resolve_scope(state, c.scope).scope
            except Rejected:
                return R.Need(role="cluster-admin", what=what)
            kind, _, sid = scope.partition(":")
            role = _ADMIN_OF[kind]
            if kind == "key":
                return R.Need(role=role, what=what, kind="project", tenant=state.keys[sid].project_id)
            return R.Need(role=role, what=what, kind=kind, tenant=sid)
        case _:
            return R.cluster_admin(f"setting the price of {c.model}")
