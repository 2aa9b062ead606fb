"""Every event type the system writes, gathered from the per-aggregate modules."""

from __future__ import annotations

from llmgw.events import outcomes, tenancy
from llmgw.events.registry import EventRegistry, EventType

MODULES = (outcomes, tenancy)


def all_event_types() -> list[EventType]:
    return [t for module in MODULES for t in module.EVENTS]


def default_registry() -> EventRegistry:
    """A registry of every current event type, with the upcasters older versions need."""
    return EventRegistry(all_event_types())
