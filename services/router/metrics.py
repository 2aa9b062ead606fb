"""Gateway metrics (SPEC GW-10): labels only from catalog names ("unknown" otherwise).

The request path reaches labelled children through :class:`Children`, which asks
``labels()`` once per label values and keeps the child: ``labels()`` takes a lock and builds
tuples on every call. prometheus_client keeps every child it has made for the life of the process
anyway, so the caches hold nothing it would not; a child still appears on first use, as before.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Children:
    """A labelled metric's children by label values (in the metric's label order), made on first use."""

    __slots__ = ("_cache", "_metric")

    def __init__(self, metric: Any) -> None:
        self._metric = metric
        self._cache: dict[tuple[Any, ...], Any] = {}

    def __call__(self, *values: Any) -> Any:
        child = self._cache.get(values)
        if child is None:
            child = self._cache[values] = self._metric.labels(*values)
        return child


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.requests = Counter("llmgw_gateway_requests", "Requests answered", ["model", "status"], registry=r)
        self.latency = Histogram(
            "llmgw_gateway_request_seconds", "Time to the last byte", ["model"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.ttft = Histogram(
            "llmgw_gateway_time_to_first_token_seconds",
            "Time to the first streamed byte",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens = Counter("llmgw_gateway_tokens", "Tokens in and out", ["model", "direction"], registry=r)
        self.in_flight = Gauge("llmgw_gateway_in_flight", "Requests being served", ["model", "replica"], registry=r)
        self.retries = Counter(
            "llmgw_gateway_replica_retries",
            "Attempts moved to another replica before the first byte",
            ["model"],
            registry=r,
        )
        # The same metrics, children cached: requests_of(model, status), latency_of(model), ...
        self.requests_of = Children(self.requests)
        self.latency_of = Children(self.latency)
        self.ttft_of = Children(self.ttft)
        self.tokens_of = Children(self.tokens)
        self.in_flight_of = Children(self.in_flight)
        self.retries_of = Children(self.retries)
