"""Prometheus series for the projection runner. Each process passes its own registry: no global state."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class ProjectionMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.lag = Gauge(
            "llmgw_projection_lag_events",
            "Sequence distance from the projection's checkpoint to the last event on its subject",
            ["projection"],
            registry=self.registry,
        )
        self.position = Gauge(
            "llmgw_projection_position",
            "Stream sequence up to which the projection has applied every event on its subject",
            ["projection"],
            registry=self.registry,
        )
        self.applied = Counter(
            "llmgw_projection_applied_events",
            "Events applied to the projection's live tables (skipped and unknown types included)",
            ["projection"],
            registry=self.registry,
        )
        self.errors = Counter(
            "llmgw_projection_errors",
            "Failed batches and reads; a batch failing twice in a row stops the projection",
            ["projection"],
            registry=self.registry,
        )
        self.failed = Gauge(
            "llmgw_projection_failed",
            "1 while the projection is stopped by an error (see the log and `llmgw projections status`)",
            ["projection"],
            registry=self.registry,
        )
