"""Keys with their limits, and the limits, prices and budgets per scope, folded once for every reader.

The access service (which decides), the routers (which enforce) and the ``access`` projection
(what `ctl key|limit|price|budget list` read) all follow the ``key``, ``limit``, ``price`` and
``budget`` aggregates, and each used to fold them its own way. These pure functions are the one
fold: :func:`fold_key` (a key after one of its events, or a ``limit.set`` on it), :func:`fold_limit`,
:func:`fold_price` and :func:`fold_budget` (a scope's or a model's setting after its event).
:class:`AccessBook` keeps their results in dicts for the readers that hold them all in memory.

The rules they settle: a key is created once (a second ``key.created`` for its id changes nothing);
revoking is final; a key's own limits are those it was made with until a ``limit.set key:<id>``
replaces them; a ``limit.set`` with neither value, and a ``budget.set`` without an amount, clear.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import msgspec

from llmgw.events.schema import access as A

ACCESS_EVENTS = (A.KeyCreated, A.KeyRevoked, A.LimitSet, A.PriceSet, A.BudgetSet)


class Key(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """One API key as its events tell it. ``rpm``/``tpm`` are its own limits (None: none).

    Encoded as an array (``array_like``), not a map: a router's snapshot holds 100,000 keys or more,
    and naming each field in each one made it twice the size and half again slower to decode. The
    fields are read by position, so adding, removing or moving one needs the router's
    ``SNAPSHOT_VERSION`` bumped (services/router/state.py)."""

    id: str
    prefix: str
    secret_sha256: str
    project_id: str
    name: str = ""
    user: str | None = None
    rpm: int | None = None
    tpm: int | None = None
    models: list[str] = []  # allow-list; empty: every model
    expires_at: datetime | None = None
    revoked: bool = False
    revoke_reason: str = ""
    external: bool = False  # may name models served outside the cluster (GW-12); last, as fields go by position

    def label(self) -> str:
        return f"{self.id} ({self.name})" if self.name else self.id


class Limit(msgspec.Struct, frozen=True, kw_only=True):
    """Requests and tokens per minute for a scope; at least one is set (else there is no limit)."""

    rpm: int | None = None
    tpm: int | None = None


class Price(msgspec.Struct, frozen=True, kw_only=True):
    input_usd_per_m: float
    output_usd_per_m: float


class Budget(msgspec.Struct, frozen=True, kw_only=True):
    usd: float
    period: str


def key_of_scope(scope: str) -> str | None:
    """The key id of a ``key:<id>`` scope, else None."""
    kind, _, key_id = scope.partition(":")
    return key_id if kind == "key" else None


def fold_key(key: Key | None, payload: msgspec.Struct) -> Key | None:
    """The key after one of its events or a ``limit.set`` on ``key:<its id>`` (None: not created). Pure."""
    match payload:
        case A.KeyCreated():
            if key is not None:
                return key
            p = payload
            return Key(
                id=p.key_id,
                prefix=p.prefix,
                secret_sha256=p.secret_sha256,
                project_id=p.project_id,
                name=p.name,
                user=p.user,
                rpm=p.rpm,
                tpm=p.tpm,
                models=list(p.models),
                expires_at=p.expires_at,
                external=p.external,
            )
        case A.KeyRevoked() if key is not None and not key.revoked:
            return msgspec.structs.replace(key, revoked=True, revoke_reason=payload.reason)
        case A.LimitSet() if key is not None and key_of_scope(payload.scope) == key.id:
            return msgspec.structs.replace(key, rpm=payload.rpm, tpm=payload.tpm)
    return key


def fold_limit(payload: A.LimitSet) -> Limit | None:
    """A scope's limit after its ``limit.set``: None when it sets neither value (the limit is cleared)."""
    if payload.rpm is None and payload.tpm is None:
        return None
    return Limit(rpm=payload.rpm, tpm=payload.tpm)


def fold_price(payload: A.PriceSet) -> Price:
    return Price(input_usd_per_m=payload.input_usd_per_m, output_usd_per_m=payload.output_usd_per_m)


def fold_budget(payload: A.BudgetSet) -> Budget | None:
    """A scope's budget after its ``budget.set``: None when it has no amount (the budget is cleared)."""
    return None if payload.usd is None else Budget(usd=payload.usd, period=payload.period)


def key_id_of(payload: msgspec.Struct) -> str | None:
    """The key an access event changes: its own for key events, the scope's for a ``limit.set key:<id>``."""
    match payload:
        case A.KeyCreated() | A.KeyRevoked():
            return payload.key_id
        case A.LimitSet():
            return key_of_scope(payload.scope)
    return None


class AccessBook:
    """Every key, limit, price and budget, folded. Mutable, but changed only by :meth:`apply`.

    ``limits`` holds what ``limit.set`` set per scope (a key's too); a key's effective limits are
    its own ``rpm``/``tpm`` (see :meth:`limit_of`).
    """

    def __init__(self) -> None:
        self.keys: dict[str, Key] = {}  # by id, revoked ones included
        self.limits: dict[str, Limit] = {}
        self.prices: dict[str, Price] = {}
        self.budgets: dict[str, Budget] = {}

    def apply(self, payload: msgspec.Struct) -> None:
        key_id = key_id_of(payload)
        if key_id is not None:
            key = fold_key(self.keys.get(key_id), payload)
            if key is not None:
                self.keys[key_id] = key
        match payload:
            case A.LimitSet():
                _put(self.limits, payload.scope, fold_limit(payload))
            case A.PriceSet():
                self.prices[payload.model] = fold_price(payload)
            case A.BudgetSet():
                _put(self.budgets, payload.scope, fold_budget(payload))

    def limit_of(self, scope: str) -> Limit | None:
        """The limit a scope is held to: a key's own, else what ``limit.set`` set on the scope."""
        key_id = key_of_scope(scope)
        if key_id is not None:
            key = self.keys.get(key_id)
            if key is None or (key.rpm is None and key.tpm is None):
                return None
            return Limit(rpm=key.rpm, tpm=key.tpm)
        return self.limits.get(scope)


def _put(table: dict[str, Any], name: str, value: object | None) -> None:
    if value is None:
        table.pop(name, None)
    else:
        table[name] = value
