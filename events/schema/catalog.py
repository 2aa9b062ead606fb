"""Every event type the system writes, gathered from the per-aggregate modules."""

from __future__ import annotations

import msgspec

from llmgw.events.schema import (
    access,
    identity,
    jobs,
    mcp,
    mirror,
    models,
    nodes,
    outcomes,
    people,
    quotas,
    replicas,
    scheduler,
    tenancy,
)
from llmgw.events.schema.registry import EventRegistry, EventType

MODULES = (outcomes, tenancy, access, people, identity, models, nodes, replicas, scheduler, mirror, jobs, quotas, mcp)


def all_event_types() -> list[EventType]:
    return [t for module in MODULES for t in module.EVENTS]


def default_registry() -> EventRegistry:
    """A registry of every current event type, with the upcasters older versions need."""
    registry = EventRegistry(all_event_types())
    for module in MODULES:
        for name, from_v, upcaster in getattr(module, "UPCASTERS", ()):
            registry.add_upcaster(name, from_v, upcaster)
    return registry


def _type_name(t: object) -> str:
    name = getattr(t, "__name__", None)
    return name if name and not str(t).startswith(("list[", "dict[")) else str(t).replace("typing.", "")


def render_markdown() -> str:
    """`docs/events.md`: every event type with its version, meaning and fields (checked by a test)."""

    lines = [
        "# Event catalogue",
        "",
        "Every event type on `LLMGW_EVENTS`, generated from the registry by `llmgw events catalog`",
        "(a test fails when this file and the code disagree). Each event travels in the envelope",
        "`id, type, v, at, actor, causation, correlation, data`; `data` holds the fields below.",
        "Evolution: new fields are optional; a breaking change bumps `v` and ships an upcaster.",
        "",
    ]
    for module in MODULES:
        title = (module.__doc__ or module.__name__).strip().splitlines()[0]
        lines += [f"## `{module.AGGREGATE}` — {title}", ""]
        for t in module.EVENTS:
            lines += [f"### `{t.name}` (v{t.v})", "", t.doc, "", "| field | type | default |", "|---|---|---|"]
            for f in msgspec.structs.fields(t.struct):
                default = "" if f.default is msgspec.NODEFAULT else _shown(f.default)
                if f.default_factory is not msgspec.NODEFAULT:
                    default = repr(f.default_factory())
                kind = _type_name(f.type).replace("|", "\\|")  # a bare | would end the table cell
                lines.append(f"| `{f.encode_name}` | `{kind}` | {default} |")
            lines.append("")
    return "\n".join(lines)


def _shown(default: object) -> str:
    """A field's default as the catalogue prints it (raw JSON as its text, not an object's address)."""
    return bytes(default).decode() if isinstance(default, msgspec.Raw) else repr(default)
