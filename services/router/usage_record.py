"""One request's facts (:class:`Call`), filled in layer by layer, and the pure builder that turns them
into its usage record (SPEC GW-8): what it cost, who asked, what served it, how long it took."""

from __future__ import annotations

from datetime import datetime

import msgspec

from llmgw.events.schema.usage import UsageRecord
from llmgw.services.router.budgets import cost
from llmgw.services.router.limits import Level
from llmgw.services.router.state import KeyInfo, ModelInfo, Price, ReplicaInfo

# Statuses for which the engine did (or may have done) work: they are charged for their tokens.
CHARGED = (200, 499, 504, 502)


class Call(msgspec.Struct, kw_only=True):
    """One request's facts, filled in layer by layer, ending as its usage record."""

    request_id: str  # the gateway's own: keys the usage record, its de-duplication and budget holds
    client_request_id: str | None = None  # the client's X-Request-Id, kept beside it and echoed
    started: float
    at: datetime
    endpoint: str
    key: KeyInfo | None = None
    model_asked: str = ""
    model: ModelInfo | None = None
    replica: ReplicaInfo | None = None
    stream: bool = False
    status: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    queue_s: float = 0.0
    ttft_s: float | None = None
    error: str | None = None
    levels: list[Level] = []
    chain: list[ModelInfo] = []  # the model asked for, then the fallbacks the key may use (admission's)
    scopes: list[str] = []  # the key's levels, as admission found them
    holds: list[tuple[str, str, float]] = []  # (scope, period it was held in, usd) reserved
    cost_usd: float = 0.0
    price: Price | None = None  # an external provider's (GW-12), when one served it: the cost is at its price
    billed: bool = True  # False: refused before admission because usage could not be kept


def billed_prompt_tokens(call: Call) -> int:
    """The prompt tokens a call is billed for and its record shows: those of an answered call (or one
    the client left), none for an engine failure or timeout, whose count is only the router's upper
    bound from the body's size."""
    return call.tokens_in if call.status in (200, 499) else 0


def call_cost(call: Call, price: Price | None) -> float:
    """What the call cost: the tokens its record shows at the model's price, when the engine worked on it."""
    if price is None or call.model is None or call.status not in CHARGED:
        return 0.0
    return cost(billed_prompt_tokens(call), call.tokens_out, price.input_usd_per_m, price.output_usd_per_m)


def usage_record(call: Call, scopes: list[str], total_s: float, router: str) -> UsageRecord:
    """The call's usage record; ``scopes``: its key's levels (``key:…``, ``project:…``, ``team:…``, ``org:…``)."""
    key = call.key
    team = next((s.split(":", 1)[1] for s in scopes if s.startswith("team:")), None)
    org = next((s.split(":", 1)[1] for s in scopes if s.startswith("org:")), None)
    return UsageRecord(
        request_id=call.request_id,
        client_request_id=call.client_request_id,
        at=call.at,
        status=call.status or 500,
        key_id=key.id if key else None,
        project_id=key.project_id if key else None,
        team_id=team,
        org_id=org,
        user=key.user if key else None,
        model_asked=call.model_asked,
        model_served=call.model.name if call.model else None,
        replica_id=call.replica.replica_id if call.replica else None,
        node_id=call.replica.node_id if call.replica else None,
        endpoint=call.endpoint,
        stream=call.stream,
        tokens_in=billed_prompt_tokens(call),
        tokens_out=call.tokens_out,
        queue_s=round(call.queue_s, 6),
        ttft_s=round(call.ttft_s, 6) if call.ttft_s is not None else None,
        total_s=round(total_s, 6),
        cost_usd=round(call.cost_usd, 8),
        error=call.error,
        router=router,
    )
