"""Keys, limits, prices and budgets (SPEC TEN-2, GW-4, GW-5): who may call what, how much.

Keys belong to a project (``llmgw.evt.key.<key id>``). The key's secret never travels: the CLI
makes it, shows it once, and sends only its lookup prefix and SHA-256 hash. Limits, prices and
budgets are one aggregate each per scope or model (``llmgw.evt.limit.<scope>``,
``llmgw.evt.price.<model>``, ``llmgw.evt.budget.<scope>``); routers fold all of them live.

Scopes are written ``org:<id>``, ``team:<id>``, ``project:<id>`` or ``key:<id>`` on the log —
by id, so renames do not orphan them; commands accept paths and resolve them.
"""

from __future__ import annotations

import hashlib
import secrets
import string
from datetime import datetime

import msgspec

from llmgw.events.schema.registry import EventType

AGGREGATE = "key"  # the module's main aggregate, for the catalogue
KEY_AGGREGATE = "key"
LIMIT_AGGREGATE = "limit"
PRICE_AGGREGATE = "price"
BUDGET_AGGREGATE = "budget"
SERVICE = "access"
PERIODS = ("day", "month")


class KeyCreated(msgspec.Struct, frozen=True, kw_only=True):
    key_id: str
    prefix: str  # the lookup prefix, shown in lists (llmgw-<prefix>-…)
    secret_sha256: str
    project_id: str
    name: str = ""
    user: str | None = None
    rpm: int | None = None
    tpm: int | None = None
    models: list[str] = []  # allow-list; empty: every model
    expires_at: datetime | None = None
    external: bool = False  # may name models served outside the cluster (GW-12: prompts leave it)


class KeyRevoked(msgspec.Struct, frozen=True, kw_only=True):
    key_id: str
    reason: str = ""


class LimitSet(msgspec.Struct, frozen=True, kw_only=True):
    scope: str  # org:<id> | team:<id> | project:<id> | key:<id>
    rpm: int | None = None
    tpm: int | None = None


class PriceSet(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    input_usd_per_m: float
    output_usd_per_m: float


class BudgetSet(msgspec.Struct, frozen=True, kw_only=True):
    scope: str
    usd: float | None  # None clears the budget
    period: str = "month"


EVENTS = (
    EventType(
        "key.created",
        1,
        KeyCreated,
        "An API key was made for a project; only its hash is kept. `external`: it may call models served "
        "outside the cluster.",
    ),
    EventType("key.revoked", 1, KeyRevoked, "An API key was revoked; every router refuses it within seconds."),
    EventType("limit.set", 1, LimitSet, "Requests and tokens per minute for a scope (unset values: no limit)."),
    EventType("price.set", 1, PriceSet, "A model's price per million input and output tokens."),
    EventType("budget.set", 1, BudgetSet, "A scope's spending budget per day or month."),
)


class CreateKey(msgspec.Struct, frozen=True, kw_only=True, tag="key-create", forbid_unknown_fields=True):
    project: str  # a path (acme/ml/chat) or an id
    prefix: str
    secret_sha256: str
    name: str = ""
    user: str | None = None
    rpm: int | None = None
    tpm: int | None = None
    models: list[str] = []
    expires_at: datetime | None = None
    external: bool = False  # may name external models (`--allow-external`)


class RevokeKey(msgspec.Struct, frozen=True, kw_only=True, tag="key-revoke", forbid_unknown_fields=True):
    key: str  # id or prefix
    reason: str = ""


class SetLimit(msgspec.Struct, frozen=True, kw_only=True, tag="limit-set", forbid_unknown_fields=True):
    scope: str  # org:acme, team:acme/ml, project:acme/ml/chat, key:<id or prefix>
    rpm: int | None = None
    tpm: int | None = None


class SetPrice(msgspec.Struct, frozen=True, kw_only=True, tag="price-set", forbid_unknown_fields=True):
    model: str
    input_usd_per_m: float
    output_usd_per_m: float


class SetBudget(msgspec.Struct, frozen=True, kw_only=True, tag="budget-set", forbid_unknown_fields=True):
    scope: str
    usd: float | None
    period: str = "month"


AccessCommand = CreateKey | RevokeKey | SetLimit | SetPrice | SetBudget


# -- the key format, shared by the CLI (which makes keys) and the routers (which check them) ------

KEY_PREFIX = "llmgw"


def make_api_key() -> tuple[str, str, str]:
    """(key, lookup prefix, sha256 of the key). The key is ``llmgw-<8 chars>-<43 chars>``."""
    alphabet = string.ascii_lowercase + string.digits
    prefix = "".join(secrets.choice(alphabet) for _ in range(8))
    key = f"{KEY_PREFIX}-{prefix}-{secrets.token_urlsafe(32)}"
    return key, prefix, hashlib.sha256(key.encode()).hexdigest()


def key_prefix(key: str) -> str | None:
    """The lookup prefix of a well-formed key, else None."""
    parts = key.split("-", 2)
    if len(parts) != 3 or parts[0] != KEY_PREFIX or len(parts[1]) != 8 or len(parts[2]) < 20:
        return None
    return parts[1]


def hash_api_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()
