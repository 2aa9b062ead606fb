"""Admission: may this request run? Pure verdicts over plain data, in the documented order

    key → model → servable → limits → budget

Each function returns what the next layer needs or a :class:`Refusal` (status, code, message,
headers): nothing here does I/O. The router (``app.py``) calls them in that order and does the
little I/O there is at the edge — the budget book's compare-and-set, and telling the scheduler a
model is wanted — so a request that is refused early never spends a limit slot or holds budget.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import msgspec

from llmgw.events.schema import access as A
from llmgw.services.router.budgets import BudgetExceeded, max_cost, seconds_to_period_end
from llmgw.services.router.external import dearest
from llmgw.services.router.limits import Level, Limiter
from llmgw.services.router.state import Budget, KeyInfo, ModelInfo, Price
from llmgw.services.router.validation import max_prompt_tokens


class Refusal(msgspec.Struct, frozen=True, kw_only=True):
    """The answer to a request that may not run."""

    status: int
    code: str
    message: str
    headers: dict[str, str] = {}
    demand: bool = False  # tell the scheduler the model is wanted (a fresh placement attempt)
    layer: str = ""  # which layer refused: key, usage, model, servable, limits, budget


class Admitted(msgspec.Struct, frozen=True, kw_only=True):
    """A request within its limits: the levels it counts against, the headers it is answered with."""

    levels: list[Level] = []
    headers: dict[str, str] = {}


class Verdict(msgspec.Struct, frozen=True, kw_only=True):
    """Admission's answer, with what was known when it was given (the usage record names them)."""

    key: KeyInfo | None = None
    model: ModelInfo | None = None
    levels: list[Level] = []  # the levels the request counts against once admitted
    headers: dict[str, str] = {}  # x-ratelimit-* for the answer
    refusal: Refusal | None = None
    wanted: list[str] = []  # models to tell the scheduler about (refused for want of a replica)
    chain: list[ModelInfo] = []  # the model, then the fallbacks the key may use, in the order tried
    scopes: list[str] = []  # the key's levels (key:…, project:…, team:…, org:…), found once per request


class View(Protocol):
    """What admission reads of the router's fold (:class:`~.state.RouterState` is one)."""

    keys: dict[str, KeyInfo]
    models: dict[str, ModelInfo]
    limits: dict[str, tuple[int | None, int | None]]

    def resolve(self, name: str) -> ModelInfo | None: ...

    def ready(self, model: str) -> list[Any]: ...

    def starting(self, model: str) -> int: ...

    def scopes_of(self, key: KeyInfo) -> list[str]: ...


def admit(
    authorization: str | KeyInfo,
    asked: str,
    tokens: int,
    view: View,
    limiter: Limiter,
    now: float,
    usage_refusal: str | None = None,
) -> Verdict:
    """Key → (usage can be kept) → model → servable → limits, the first refusal wins; nothing is
    spent here (the caller admits into the limiter, then reserves budget). ``tokens``: the prompt's
    estimate; ``usage_refusal``: why usage records cannot be kept now, if they cannot (GW-8).
    ``authorization`` may be the key already authenticated (the router checks it before the body)."""
    key = authorization if isinstance(authorization, KeyInfo) else authenticate(authorization, view.keys, now)
    if isinstance(key, Refusal):
        return Verdict(refusal=msgspec.structs.replace(key, layer="key"))
    scopes = view.scopes_of(key)
    if usage_refusal is not None:
        refusal = Refusal(
            status=503, code="usage_unavailable", message=usage_refusal, headers={"retry-after": "10"}, layer="usage"
        )
        return Verdict(key=key, refusal=refusal, scopes=scopes)
    model = choose_model(key, asked, view.resolve(asked), view.models)  # names read only to refuse
    if isinstance(model, Refusal):
        return Verdict(key=key, refusal=msgspec.structs.replace(model, layer="model"), scopes=scopes)
    chain = chain_of(model, view, key)
    verdicts = [model_servable(m, view) for m in chain]
    refusal = servable_chain(verdicts)
    if refusal is not None:
        wanted = [m.name for m, v in zip(chain, verdicts, strict=True) if v is not None and v.demand]
        refusal = msgspec.structs.replace(refusal, layer="servable")
        return Verdict(key=key, model=model, refusal=refusal, wanted=wanted, chain=chain, scopes=scopes)
    within = within_limits(limiter, limit_levels(scopes, view.limits), now, tokens)
    if isinstance(within, Refusal):
        refusal = msgspec.structs.replace(within, layer="limits")
        return Verdict(key=key, model=model, refusal=refusal, chain=chain, scopes=scopes)
    return Verdict(key=key, model=model, levels=within.levels, headers=within.headers, chain=chain, scopes=scopes)


def chain_of(model: ModelInfo, view: View, key: KeyInfo | None = None) -> list[ModelInfo]:
    """The model, then its fallbacks that exist, in the order they are tried; for ``key``, only the
    fallbacks it may use: an external one (GW-12) only when the key allows external models."""
    fallbacks = [m for m in (view.resolve(f) for f in model.spec.fallbacks) if m]
    if key is not None and not key.external:
        fallbacks = [m for m in fallbacks if not m.spec.external]
    return [model, *fallbacks]


def fallback_answers_now(model: ModelInfo, fallbacks: list[ModelInfo], view: View) -> bool:
    """Whether a request should skip ``model`` for a fallback: it has no ready replica, would wait for one
    (on demand, or one starting), and one of ``fallbacks`` can answer at once (external, or ready)."""
    if view.ready(model.name) or model_servable(model, view) is not None:
        return False  # it answers now, or it refuses at once and the fallbacks are tried anyway
    return any((m.spec.external and not m.stopped) or view.ready(m.name) for m in fallbacks)


def price_for_holds(chain: list[ModelInfo], prices: Mapping[str, Price]) -> Price | None:
    """The price a budget hold is taken at (GW-5): the dearest of the models a request may be served by
    (its fallbacks too) and, for an external model, of any of its providers; None: no model has one."""
    found = []
    for m in chain:
        table = prices.get(m.name)
        price = dearest(m, table) if m.spec.external else table
        if price is not None:
            found.append(price)
    if not found:
        return None
    return Price(
        input_usd_per_m=max(p.input_usd_per_m for p in found),
        output_usd_per_m=max(p.output_usd_per_m for p in found),
    )


def model_servable(model: ModelInfo, view: View) -> Refusal | None:
    ready = len(view.ready(model.name))
    # Counting the replicas starting walks them all: only needed when none is ready.
    return servable(model, ready, view.starting(model.name) if not ready else 0)


# -- key ------------------------------------------------------------------------------------------


def authenticate(authorization: str, keys: Mapping[str, KeyInfo], now: float) -> KeyInfo | Refusal:
    """The key an ``Authorization`` header names, or why it is refused (401)."""
    if not authorization.lower().startswith("bearer "):
        return Refusal(
            status=401,
            code="missing_api_key",
            message="no API key: send `Authorization: Bearer <key>` (make one with "
            "`llmgw ctl key create --project ORG/TEAM/PROJECT`)",
        )
    secret = authorization[7:].strip()
    if not secret.isascii():
        # aiohttp passes bytes that are not UTF-8 through as surrogates; a key is plain ASCII.
        return Refusal(status=401, code="invalid_api_key", message="invalid API key: it has characters no key has")
    prefix = A.key_prefix(secret)
    key = keys.get(prefix) if prefix else None
    if key is None or not hmac.compare_digest(key.secret_sha256, A.hash_api_key(secret)):
        return Refusal(status=401, code="invalid_api_key", message="invalid API key: it is unknown or was revoked")
    if key.expires_at is not None and key.expires_at.timestamp() <= now:
        return Refusal(status=401, code="expired_api_key", message=f"API key {key.prefix} expired; make a new one")
    return key


# -- model ----------------------------------------------------------------------------------------


def choose_model(key: KeyInfo, asked: str, model: ModelInfo | None, names: Iterable[str]) -> ModelInfo | Refusal:
    """The model a request asked for (``model``: what ``asked`` resolves to; ``names``: every model)."""
    if model is None:
        visible = ", ".join(sorted(m for m in names if not key.models or m in key.models)[:20])
        return Refusal(
            status=404,
            code="model_not_found",
            message=f"model {asked!r} does not exist" + (f" (models: {visible})" if visible else ""),
        )
    if key.models and model.name not in key.models and asked not in key.models:
        return Refusal(
            status=403,
            code="model_not_allowed",
            message=f"this key may not use model {model.name} (allowed: {', '.join(sorted(key.models))})",
        )
    if model.spec.external and not key.external:
        return Refusal(
            status=403,
            code="external_not_allowed",
            message=f"model {model.name} is served by a provider outside the cluster, so prompts sent to it leave "
            "the cluster, and this key is not allowed that: use a key made with `llmgw ctl key create --project "
            "ORG/TEAM/PROJECT --allow-external`, or a model served here",
        )
    return model


# -- servable -------------------------------------------------------------------------------------


def servable(model: ModelInfo, ready: int, starting: int) -> Refusal | None:
    """None when the model can answer now, or once a replica it is waiting for is ready (on demand,
    or one starting); else why not. ``ready`` and ``starting``: its replicas in those states."""
    if model.stopped:
        return Refusal(status=503, code="model_stopped", message=f"model {model.name} was stopped by an administrator")
    if model.spec.external:
        return None  # its providers answer, or say why not, when the request is sent (GW-12)
    if model.parked and not ready:  # ready replicas of an earlier definition still serve
        return Refusal(
            status=503,
            code="model_parked",
            message=f"model {model.name} is parked: {model.parked}; an administrator can "
            f"`llmgw ctl retry {model.name}` once it is fixed",
            demand=True,
        )
    if ready:
        return None
    if model.unplaceable and not starting:
        return Refusal(
            status=503,
            code="model_unplaceable",
            message=f"model {model.name} cannot be placed: {model.unplaceable}",
            demand=True,
        )
    if not model.on_demand and not starting:
        return Refusal(
            status=503,
            code="no_replica",
            message=f"model {model.name} has no ready replica yet and none is starting: the scheduler starts one "
            f"as soon as a node can take it (`llmgw ctl explain {model.name}` says what it waits for); retry in "
            "a few seconds",
            headers={"retry-after": "5"},
            demand=True,
        )
    return None


def servable_chain(verdicts: list[Refusal | None]) -> Refusal | None:
    """A model and its fallbacks, in order: servable when one is; else the last one's reason (the
    one the client would have got after trying them all)."""
    if not verdicts or any(v is None for v in verdicts):
        return None
    return verdicts[-1]


# -- limits ---------------------------------------------------------------------------------------


def limit_levels(scopes: list[str], limits: Mapping[str, tuple[int | None, int | None]]) -> list[Level]:
    """The levels (key, project, team, org) that have a limit, most specific first."""
    levels = []
    for scope in scopes:
        lim = limits.get(scope)
        if lim and (lim[0] is not None or lim[1] is not None):
            levels.append(Level(scope=scope, rpm=lim[0], tpm=lim[1]))
    return levels


def within_limits(limiter: Limiter, levels: list[Level], now: float, tokens: int) -> Admitted | Refusal:
    """Whether one more request expected to use ``tokens`` fits every level (reads the limiter only)."""
    if not levels:
        return Admitted()
    verdict = limiter.check(levels, now, tokens)
    if not verdict.allowed:
        return Refusal(
            status=429,
            code="rate_limited",
            message=verdict.reason,
            headers={"retry-after": str(verdict.retry_after_s), **verdict.headers},
        )
    return Admitted(levels=levels, headers=verdict.headers)


# -- budget ---------------------------------------------------------------------------------------


def budget_scopes(scopes: list[str], budgets: Mapping[str, Budget]) -> list[str]:
    return [s for s in scopes if s in budgets]


def most_it_may_cost(
    body: Mapping[str, Any],
    endpoint: str,
    model: ModelInfo,
    price: Price,
    default_max_tokens: int,
    prompt: str | None = None,
) -> float:
    """What a request may cost at most: its prompt's upper bound and every output token it may ask for,
    for each answer it asks for (``n`` choices, or ``best_of`` candidates the engine generates and bills).
    ``prompt``: the prompt's text, when already found (:func:`.validation.prompt_text`)."""
    out = body.get("max_tokens") or body.get("max_completion_tokens") or model.spec.max_output or default_max_tokens
    answers = max(_count(body.get("n")), _count(body.get("best_of")))
    bound = max_prompt_tokens(body, endpoint, prompt)
    return max_cost(bound, int(out) * answers, price.input_usd_per_m, price.output_usd_per_m)


def _count(value: Any) -> int:
    """A count a client sent (already type-checked), 1 when absent."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 1 else 1


HELD_RETRY_S = 5  # a budget full only of running requests' holds frees up as soon as they settle


def over_budget(exc: BudgetExceeded, now: float, label: str) -> Refusal:
    """The 429 of a budget that cannot cover the request, naming its scope as ``label`` (a path, not an
    id): ``Retry-After`` in a few seconds when only running requests' holds stand in the way, else
    when the period ends (a new budget)."""
    wait = HELD_RETRY_S if exc.held_only else seconds_to_period_end(exc.period, now)
    return Refusal(
        status=429,
        code="budget_exceeded",
        message=exc.describe(label),
        headers={"retry-after": str(wait)},
        layer="budget",
    )
