"""Prometheus series for the event store. Each process passes its own registry: no global state."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram


class StoreMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.appended = Counter(
            "llmgw_eventstore_appended_events", "Events appended to the log", registry=self.registry
        )
        self.conflicts = Counter(
            "llmgw_eventstore_append_conflicts",
            "Appends refused because the aggregate had moved on",
            registry=self.registry,
        )
        self.quarantined = Counter(
            "llmgw_eventstore_quarantined_messages",
            "Messages no reader could decode, kept in LLMGW_QUARANTINE",
            ["stream"],
            registry=self.registry,
        )
        self.append_seconds = Histogram(
            "llmgw_eventstore_append_seconds",
            "Time from append to acknowledgement (one event or one atomic batch)",
            registry=self.registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0),
        )
