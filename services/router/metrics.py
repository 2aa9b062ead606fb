"""Gateway metrics (SPEC GW-10): labels only from catalog names ("unknown" otherwise).

The request path reaches labelled children through :class:`Children`, which asks
``labels()`` once per label values and keeps the child: ``labels()`` takes a lock and builds
tuples on every call. prometheus_client keeps every child it has made for the life of the process
anyway, so the caches hold nothing it would not; a child still appears on first use, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

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
        self.queue_wait = Histogram(
            "llmgw_gateway_queue_wait_seconds",
            "Time requests waited in the gateway's queue for a slot (those that waited)",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_rejections = Counter(
            "llmgw_gateway_queue_rejections",
            "Requests the queue refused: queue_full, project_queue_full, timeout",
            ["model", "reason"],
            registry=r,
        )
        # The same metrics, children cached: requests_of(model, status), latency_of(model), ...
        self.requests_of = Children(self.requests)
        self.latency_of = Children(self.latency)
        self.ttft_of = Children(self.ttft)
        self.tokens_of = Children(self.tokens)
        self.in_flight_of = Children(self.in_flight)
        self.retries_of = Children(self.retries)
        self.queue_wait_of = Children(self.queue_wait)
        self.queue_rejections_of = Children(self.queue_rejections)


def pool_loads(
    ready: Mapping[str, Iterable[str]],
    outstanding: Mapping[str, int],
    slots: int | Mapping[str, int],
    waiting: Mapping[str, int] | None = None,
) -> list[tuple[str, float]]:
    """(model, saturation) for each model with ready replicas: requests this router has in flight
    to them, plus those waiting in its queue for them, over what they take at once (``slots`` each,
    or by replica id). Above 1, requests wait — in the gateway's queue or the engines'; summed over
    routers it is the pool's. Pure."""
    out = []
    for model, replicas in sorted(ready.items()):
        ids = list(replicas)
        if ids:
            room = len(ids) * slots if isinstance(slots, int) else sum(slots[r] for r in ids)
            demand = sum(outstanding.get(r, 0) for r in ids) + (waiting or {}).get(model, 0)
            out.append((model, demand / max(room, 1)))
    return out


class PoolSaturation:
    """``llmgw_pool_saturation{model}``, computed when scraped: nothing on the request path."""

    def __init__(self, loads: Callable[[], list[tuple[str, float]]]) -> None:
        self.loads = loads

    def describe(self) -> list[Any]:
        return []  # the family is made at scrape time

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "llmgw_pool_saturation",
            "Requests this router has in flight to a model's ready replicas over the slots they have",
            labels=["model"],
        )
        for model, load in self.loads():
            family.add_metric([model], load)
        yield family


class QueueDepth:
    """``llmgw_gateway_queue_depth{model}``, computed when scraped: nothing on the request path."""

    def __init__(self, depths: Callable[[], Mapping[str, int]]) -> None:
        self.depths = depths

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "llmgw_gateway_queue_depth", "Requests waiting in the gateway's queue for a slot", labels=["model"]
        )
        for model, depth in sorted(self.depths().items()):
            family.add_metric([model], depth)
        yield family


class UsageMetrics:
    """The usage publisher's series: counters it adds to, and the backlog read at scrape time."""

    def __init__(self, registry: CollectorRegistry, backlog: Callable[[], tuple[int, float | None, bool, int]]) -> None:
        r = registry
        self.journaled = Counter("llmgw_usage_journaled_records", "Usage records written to the journal", registry=r)
        self.replayed = Counter(
            "llmgw_usage_replayed_records", "Journaled usage records the bus has acknowledged", registry=r
        )
        self.failures = Counter(
            "llmgw_usage_publish_failures", "Usage record publishes not acknowledged (each attempt)", registry=r
        )
        self.lost = Counter(
            "llmgw_usage_lost_records",
            "Usage records neither published nor journaled when a router stopped",
            registry=r,
        )
        self.refused = Counter(
            "llmgw_usage_refused_requests", "Billable requests refused because usage could not be kept", registry=r
        )
        r.register(UsageBacklogCollector(backlog))


class UsageBacklogCollector:
    """``llmgw_usage_backlog_records``, ``llmgw_usage_backlog_oldest_seconds``, ``llmgw_usage_refusing``
    and ``llmgw_usage_memory_only_records``, computed when scraped: ``backlog()`` gives (records, oldest
    age, refusing, memory only)."""

    def __init__(self, backlog: Callable[[], tuple[int, float | None, bool, int]]) -> None:
        self.backlog = backlog

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        records, oldest, refusing, memory_only = self.backlog()
        yield GaugeMetricFamily(
            "llmgw_usage_backlog_records",
            "Usage records not yet acknowledged by the bus (in memory and in the journal)",
            value=records,
        )
        yield GaugeMetricFamily(
            "llmgw_usage_backlog_oldest_seconds",
            "Age of the oldest usage record not yet acknowledged",
            value=oldest or 0,
        )
        yield GaugeMetricFamily(
            "llmgw_usage_refusing", "1 while billable requests are refused because usage cannot be kept", value=refusing
        )
        yield GaugeMetricFamily(
            "llmgw_usage_memory_only_records",
            "Usage records held in memory and on no disk (a crash now loses them): the disk cannot take them",
            value=memory_only,
        )
