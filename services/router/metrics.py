"""Gateway metrics (SPEC GW-10): labels only from catalog names ("unknown" otherwise)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


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
