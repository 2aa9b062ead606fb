"""Models served outside the cluster (SPEC GW-12): a request for one goes to its providers, cheapest first.

A provider is an OpenAI-compatible API named in the model's spec (``external``): its base URL, the names
of the router's environment variables that hold its keys (read at each request, so a key is rotated by
restarting the router with a new value, and is never on the log), the model's name there and its price.
Several keys of one provider are used in turn; a provider that cannot be reached, or answers 401/403,
408, 429 or 5xx before the first byte reaches the client, passes the request to the next one.

The choices are pure (:func:`attempts`, :func:`price_of`); :class:`Providers` keeps the turns and sends
through the router's :class:`~.proxy.Upstream`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import msgspec
from aiohttp import web

from llmgw.events.schema import models as M
from llmgw.services.router.errors import ApiError
from llmgw.services.router.proxy import RetryElsewhere, Target, Upstream
from llmgw.services.router.state import ModelInfo, Price, ReplicaInfo
from llmgw.services.router.usage_record import Call

_enc = msgspec.json.Encoder()

NODE = "external"  # the node a usage record names for a request a provider served


class Attempt(msgspec.Struct, frozen=True, kw_only=True):
    """One provider to try, with the key it is tried with (``secret`` None: none of its variables is set)."""

    provider: M.ExternalProvider
    secret: str | None
    secrets: tuple[str, ...]  # all of its keys: none may appear in what is passed on


def provider_keys(provider: M.ExternalProvider, environ: Mapping[str, str]) -> list[str]:
    """The keys the provider's variables hold in ``environ``, in their order; unset or empty ones left out."""
    return [v for name in provider.key_env if (v := environ.get(name, "").strip())]


def attempts(model: ModelInfo, environ: Mapping[str, str], turns: Mapping[str, int]) -> list[Attempt]:
    """The model's providers in the order to try them (cheapest first), each with the key whose turn it
    is (``turns``: requests each provider URL has had). Pure."""
    out = []
    for p in M.cheapest_first(model.spec.external):
        keys = provider_keys(p, environ)
        secret = keys[turns.get(p.url, 0) % len(keys)] if keys else None
        out.append(Attempt(provider=p, secret=secret, secrets=tuple(keys)))
    return out


def price_of(provider: M.ExternalProvider, table: Price | None) -> Price | None:
    """What a request a provider served costs per million tokens: its own price, else the model's in the
    price table (`ctl price set`), else nothing."""
    if provider.priced:
        assert provider.input_usd_per_m is not None and provider.output_usd_per_m is not None
        return Price(input_usd_per_m=provider.input_usd_per_m, output_usd_per_m=provider.output_usd_per_m)
    return table


def dearest(model: ModelInfo, table: Price | None) -> Price | None:
    """The highest price any of the model's providers may charge (a budget's hold must cover any of them)."""
    prices = [p for x in model.spec.external if (p := price_of(x, table)) is not None]
    if not prices:
        return table
    return Price(
        input_usd_per_m=max(p.input_usd_per_m for p in prices),
        output_usd_per_m=max(p.output_usd_per_m for p in prices),
    )


def request_url(base: str, endpoint: str) -> str:
    """The provider's URL for a gateway endpoint: its base URL (which ends in ``/v1`` for OpenAI's
    clients) and the endpoint past ``/v1``."""
    return base.rstrip("/") + endpoint.removeprefix("/v1")


def payload_for(body: dict[str, Any], provider: M.ExternalProvider, model: ModelInfo) -> bytes:
    """The request as the provider gets it: the model under the name it knows."""
    return _enc.encode({**body, "model": provider.model or model.name})


def unreachable(model: ModelInfo, failures: list[str]) -> ApiError:
    """The answer when no provider of ``model`` answered: 502 naming each (host and why), never a 500."""
    return ApiError(
        502,
        f"no provider of model {model.name} answered: {'; '.join(failures)}",
        "provider_error",
    )


class Providers:
    """The external providers as this router reaches them: whose key's turn it is, and the sending."""

    def __init__(self, upstream: Upstream, environ: Mapping[str, str] | None = None) -> None:
        self.upstream = upstream
        self.environ = environ if environ is not None else os.environ  # read at each request
        self.turns: dict[str, int] = {}  # provider URL -> requests sent there (its keys are used in turn)

    async def send(
        self,
        request: web.Request,
        call: Call,
        model: ModelInfo,
        body: dict[str, Any],
        limit_headers: dict[str, str],
        table: Price | None,
    ) -> tuple[web.StreamResponse | None, ApiError | None]:
        """Try the model's providers cheapest first: the answer (``call.replica`` names the provider, and
        ``call.price`` its price), or (None, 502 naming every provider and why it failed)."""
        failures: list[str] = []
        for n, a in enumerate(attempts(model, self.environ, self.turns)):
            p = a.provider
            if n:
                self.upstream.metrics.retries_of(model.name).inc()
            if a.secret is None:
                names = ", ".join(p.key_env)
                failures.append(f"{p.host}: none of its key variables ({names}) is set in the router's environment")
                continue
            self.turns[p.url] = self.turns.get(p.url, 0) + 1
            target = Target(
                url=request_url(p.url, call.endpoint),
                authorization=f"Bearer {a.secret}",
                label=f"provider {p.host}",
                secrets=a.secrets,
            )
            call.replica = ReplicaInfo(
                replica_id=f"{NODE}:{p.host}", model=model.name, node_id=NODE, state="ready", url=p.url
            )
            call.price = price_of(p, table)
            with self.upstream.tracing.attempt(call.replica.replica_id, n + 1, model.name):
                try:
                    resp = await self.upstream.send(
                        request, call, call.replica, payload_for(body, p, model), limit_headers, target=target
                    )
                    return resp, None
                except RetryElsewhere as exc:
                    failures.append(f"{p.host}: {target.redact(str(exc))}")
        call.replica, call.price = None, None
        return None, unreachable(model, failures)
