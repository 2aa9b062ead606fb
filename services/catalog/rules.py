"""The catalog's rules (SPEC CAT-1 to CAT-4): pure decisions over the folded catalog.

Runtime edits rebuild the whole catalog with the change applied and validate it before anything is
written, so a change can never leave the catalog inconsistent (an alias that shadows a model, a
fallback to nothing).
"""

from __future__ import annotations

import re
from datetime import datetime

import msgspec

from llmgw.events.commands.shell import Decision
from llmgw.events.folds import models as MF
from llmgw.events.schema import models as M
from llmgw.events.schema.envelope import RecordedEvent
from llmgw.events.schema.outcomes import Rejected
from llmgw.events.schema.quotas import owner_shape_error
from llmgw.events.schema.subjects import EVENTS_ROOT, aggregate_of, event_subject

_NAME = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")


class CatalogEntry(msgspec.Struct, MF.ModelStatusView, kw_only=True):
    """The shared fold of a model (``MF.fold_model``) and the sequence its next append expects."""

    status: MF.ModelStatus
    seq: int = 0  # last sequence on the model's subject (any event there, e.g. scheduler.unplaceable)


SUBJECTS = {f"{EVENTS_ROOT}.{M.AGGREGATE}.>": "catalog"}  # what the catalog folds, as /healthz names it


class Catalog:
    def __init__(self) -> None:
        self.models: dict[str, CatalogEntry] = {}
        self.position = 0

    def apply_event(self, event: RecordedEvent) -> None:
        """Fold one event of a model's subject (``llmgw.evt.model.<name>``)."""
        self.apply(aggregate_of(event.subject)[1], event)

    def apply(self, name: str, event: RecordedEvent) -> None:
        self.position = max(self.position, event.seq)
        p = event.payload
        entry = self.models.get(name)
        if isinstance(p, M.MODEL_EVENTS):
            status = MF.fold_model(entry.status if entry else None, p)
            if status is None:
                self.models.pop(name, None)
                return
            entry = self.models[name] = CatalogEntry(status=status)
        if entry is not None:
            entry.seq = event.seq


def validate_spec(spec: M.ModelSpec) -> None:
    """Refuse a definition that cannot run, saying which field and what would do."""
    if not _NAME.match(spec.name):
        raise Rejected(
            f"model name {spec.name!r} is not allowed: lower-case letters, digits, '.', '_' and '-', "
            "starting with a letter or digit, at most 64 characters",
            "invalid_name",
        )
    if spec.route not in M.ROUTES:
        raise Rejected(f"model {spec.name}: route {spec.route!r} is not one of {', '.join(M.ROUTES)}", "invalid_spec")
    if spec.external:
        _validate_external(spec)
        return
    if not spec.source:
        raise Rejected(f"model {spec.name} needs a source (a GGUF path, or a mirror path)", "invalid_spec")
    try:
        M.mirror_ref(spec.source)
    except ValueError as exc:
        raise Rejected(f"model {spec.name}: {exc}", "invalid_spec") from exc
    if spec.capacity_class is not None and spec.capacity_class not in M.CLASSES:
        raise Rejected(
            f"model {spec.name}: class {spec.capacity_class!r} is not one of {', '.join(M.CLASSES)} (or default)",
            "invalid_spec",
        )
    if spec.owner is not None and (why := owner_shape_error(spec.owner)):
        raise Rejected(f"model {spec.name}: {why}", "invalid_spec")
    if spec.slo is not None:
        for field, value in (("--ttft-p95", spec.slo.ttft_p95_s), ("--tokens-per-sec", spec.slo.tokens_per_s)):
            if value is not None and not value > 0:
                raise Rejected(f"model {spec.name}: SLO {field} {value:g} must be above 0", "invalid_spec")
    s = spec.scaling
    if s.min < 0:
        raise Rejected(f"model {spec.name}: min {s.min} is negative", "invalid_scaling")
    if s.max is not None and s.max < s.min:
        raise Rejected(f"model {spec.name}: max {s.max} is below min {s.min}", "invalid_scaling")
    if not spec.profiles:
        raise Rejected(
            f"model {spec.name} has no profile: say how a replica runs (engine, memory, cores)", "invalid_spec"
        )
    names = [p.name for p in spec.profiles]
    if len(set(names)) != len(names):
        raise Rejected(f"model {spec.name}: profile names repeat ({', '.join(names)})", "invalid_spec")
    for p in spec.profiles:
        where = f"profile {p.name} of model {spec.name}"
        if p.engine not in M.ENGINES:
            raise Rejected(f"{where}: engine {p.engine!r} is not one of {', '.join(M.ENGINES)}", "invalid_spec")
        gpus = p.gpus.count if p.gpus else 0
        if gpus < 0:
            raise Rejected(f"{where}: gpus {gpus} is negative", "invalid_spec")
        if p.engine == "vllm" and gpus == 0:
            raise Rejected(f"{where}: vllm needs at least one GPU (gpus: {{count: 1}})", "invalid_spec")
        if gpus == 0 and not p.min_memory_gb:
            raise Rejected(
                f"{where} is CPU-only and has no min_memory_gb: say how much host memory one replica reserves "
                "(--memory-gb N, or min_memory_gb in the profile), or the scheduler cannot keep nodes from "
                "running out of memory",
                "invalid_spec",
            )
        if p.min_memory_gb is not None and p.min_memory_gb < 0:
            raise Rejected(f"{where}: min_memory_gb {p.min_memory_gb} is negative", "invalid_spec")
        if p.cpu_cores is not None and p.cpu_cores < 0:
            raise Rejected(f"{where}: cpu_cores {p.cpu_cores} is negative", "invalid_spec")


def _validate_external(spec: M.ModelSpec) -> None:
    """An external model (GW-12): providers that can be called, and nothing that would run here."""
    if spec.source or spec.profiles:
        raise Rejected(
            f"model {spec.name} is served by external providers, so it runs nothing here: leave out its source "
            "and profiles (or make it a local model without --external)",
            "invalid_spec",
        )
    for i, p in enumerate(spec.external, 1):
        if (why := M.provider_problem(p)) is not None:
            raise Rejected(f"model {spec.name}: provider #{i} ({p.host}): {why}", "invalid_spec")
    urls = [p.url.rstrip("/") for p in spec.external]
    if len(set(urls)) != len(urls):
        raise Rejected(f"model {spec.name} lists a provider URL twice", "invalid_spec")


def validate_catalog(specs: dict[str, M.ModelSpec]) -> None:
    """Rules across models: aliases unique and never a model's name; fallbacks name models."""
    owners: dict[str, str] = {}
    for name, spec in sorted(specs.items()):
        for alias in spec.aliases:
            if alias in specs:
                raise Rejected(f"alias {alias!r} of model {name} is the name of another model", "invalid_alias")
            if alias in owners and owners[alias] != name:
                raise Rejected(f"alias {alias!r} is used by models {owners[alias]} and {name}", "invalid_alias")
            owners[alias] = name
        for fb in spec.fallbacks:
            if fb == name:
                raise Rejected(f"model {name} lists itself as a fallback", "invalid_fallback")
            if fb not in specs and fb not in owners:
                raise Rejected(f"model {name} falls back to {fb!r}, which is not in the catalog", "invalid_fallback")


def _entry(catalog: Catalog, name: str) -> CatalogEntry:
    entry = catalog.models.get(name)
    if entry is None:
        known = ", ".join(sorted(catalog.models)) or "none"
        raise Rejected(f"there is no model {name!r} (models: {known})", "not_found")
    return entry


def _not_declared(entry: CatalogEntry, what: str) -> None:
    if entry.declared:
        raise Rejected(
            f"model {entry.spec.name} is declared in the catalog file; {what} it there and restart the server",
            "declared",
        )


def decide(catalog: Catalog, command: M.CatalogCommand, now: datetime | None = None) -> Decision:
    """Pure: the model's events for a command (on the model's subject), or a refusal. ``now`` is unused:
    nothing in the catalog's rules depends on the time."""
    name, payloads, message = _decide(catalog, command)
    return Decision(
        subject=event_subject(M.AGGREGATE, name), payloads=payloads, message=message, result={"model": name}
    )


def _decide(catalog: Catalog, command: M.CatalogCommand) -> tuple[str, list[msgspec.Struct], str]:
    """(model name, payloads, message) for a command, or a refusal."""
    match command:
        case M.AddModel(spec=spec):
            validate_spec(spec)
            if spec.name in catalog.models:
                raise Rejected(
                    f"model {spec.name} already exists: `llmgw ctl model remove {spec.name}` first, "
                    "or edit it with `ctl model scale|resources`",
                    "exists",
                )
            specs = {n: e.spec for n, e in catalog.models.items()} | {spec.name: spec}
            validate_catalog(specs)
            return spec.name, [M.ModelAdded(spec=spec)], f"model {spec.name} added"
        case M.ScaleModel(name=name, min=lo, max=hi):
            entry = _entry(catalog, name)
            _not_declared(entry, "scale")
            hi = lo if hi is None else hi
            if lo < 0:
                raise Rejected(f"min {lo} is negative", "invalid_scaling")
            if hi < lo:
                raise Rejected(f"max {hi} is below min {lo}", "invalid_scaling")
            if entry.stopped:
                raise Rejected(f"model {name} is stopped: `llmgw ctl model start {name}` first", "stopped")
            return name, [M.ModelScaled(min=lo, max=hi)], f"model {name} scaled to min {lo}, max {hi}"
        case M.SetResources(name=name):
            entry = _entry(catalog, name)
            _not_declared(entry, "change resources of")
            if entry.spec.external:
                raise Rejected(f"model {name} is served by external providers: it reserves nothing here", "external")
            if command.memory_gb is None and command.cores is None:
                raise Rejected("say what to change: --memory GB and/or --cores N", "invalid_spec")
            profiles = [
                msgspec.structs.replace(
                    p,
                    min_memory_gb=command.memory_gb if command.memory_gb is not None else p.min_memory_gb,
                    cpu_cores=command.cores if command.cores is not None else p.cpu_cores,
                )
                for p in entry.spec.profiles
            ]
            spec = msgspec.structs.replace(entry.spec, profiles=profiles)
            validate_spec(spec)
            what = ", ".join(
                x
                for x in (
                    f"memory {command.memory_gb} GB" if command.memory_gb is not None else "",
                    f"{command.cores} cores" if command.cores is not None else "",
                )
                if x
            )
            return name, [M.ModelChanged(spec=spec, what=what)], f"model {name} now reserves {what}"
        case M.SetClass(name=name, capacity_class=klass):
            entry = _entry(catalog, name)
            _not_declared(entry, "change the class of")
            if klass == "default":
                klass = None
            if klass == entry.spec.capacity_class:
                return name, [], f"model {name} is already of class {klass or 'default'}"
            spec = msgspec.structs.replace(entry.spec, capacity_class=klass)
            validate_spec(spec)
            what = f"class {klass or 'default'}"
            return name, [M.ModelChanged(spec=spec, what=what)], f"model {name} is now of {what}"
        case M.SetOwner(name=name, owner=owner):
            entry = _entry(catalog, name)
            _not_declared(entry, "change the owner of")
            if owner == entry.spec.owner:
                return name, [], f"model {name} already has owner {owner or 'none'}"
            spec = msgspec.structs.replace(entry.spec, owner=owner)
            validate_spec(spec)
            what = f"owner {owner}" if owner else "no owner"
            return name, [M.ModelChanged(spec=spec, what=what)], f"model {name} now has {what}"
        case M.SetSlo(name=name, ttft_p95_s=ttft, tokens_per_s=tps):
            entry = _entry(catalog, name)
            _not_declared(entry, "change the SLO of")
            slo = None if ttft is None and tps is None else M.Slo(ttft_p95_s=ttft, tokens_per_s=tps)
            if slo == entry.spec.slo:
                return name, [], f"model {name} already has {_slo_words(slo)}"
            spec = msgspec.structs.replace(entry.spec, slo=slo)
            validate_spec(spec)
            what = _slo_words(slo)
            return name, [M.ModelChanged(spec=spec, what=what)], f"model {name} now has {what}"
        case M.SaveMeasurement(name=name, measured=found):
            entry = _entry(catalog, name)
            _measurement_problem(entry.spec, found)
            what = (
                f"one replica of profile {found.profile} on {found.shape.words()} serves {found.concurrency} "
                f"concurrent {'request' if found.concurrency == 1 else 'requests'}, "
                f"{found.tokens_per_s:.0f} tokens/s"
            )
            return name, [found], f"model {name}: measured {what}"
        case M.StopModel(name=name):
            entry = _entry(catalog, name)
            if entry.stopped:
                raise Rejected(f"model {name} is already stopped", "unchanged")
            return name, [M.ModelStopped(saved_min=entry.min, saved_max=entry.max)], f"model {name} stopped"
        case M.StartModel(name=name):
            entry = _entry(catalog, name)
            if not entry.stopped:
                raise Rejected(f"model {name} is not stopped", "unchanged")
            lo, hi = entry.saved or (entry.spec.scaling.min, entry.spec.scaling.upper)
            return name, [M.ModelStarted(min=lo, max=hi)], f"model {name} started (min {lo}, max {hi})"
        case M.RemoveModel(name=name, purge=purge):
            entry = _entry(catalog, name)
            _not_declared(entry, "remove")
            users = sorted(n for n, e in catalog.models.items() if name in e.spec.fallbacks)
            if users:
                raise Rejected(f"model {name} is a fallback of {', '.join(users)}; change those first", "in_use")
            return name, [M.ModelRemoved(purge=purge)], f"model {name} removed"
        case M.RetryModel(name=name):
            entry = _entry(catalog, name)
            if entry.parked is None:
                raise Rejected(f"model {name} is not parked; nothing to retry", "unchanged")
            return name, [M.ModelRetried()], f"model {name} will be placed again"
    raise Rejected(f"unknown catalog command {type(command).__name__}")


def _measurement_problem(spec: M.ModelSpec, found: M.ModelMeasured) -> None:
    """Refuse a measurement no rule could use, saying what to measure instead."""
    profiles = [p.name for p in spec.profiles]
    if found.profile not in profiles:
        raise Rejected(
            f"model {spec.name} has no profile {found.profile!r} (profiles: {', '.join(profiles)}): measure a "
            "replica of one of its profiles",
            "invalid_measurement",
        )
    if found.concurrency < 1:
        raise Rejected(
            f"model {spec.name}: a measurement of {found.concurrency} concurrent requests says nothing to scale "
            "on; one replica must serve at least one request within the SLO (loosen it with `ctl model slo`)",
            "invalid_measurement",
        )
    if found.basis not in ("slo", "knee"):
        raise Rejected(f"model {spec.name}: basis {found.basis!r} is not slo or knee", "invalid_measurement")
    if found.tokens_per_s < 0 or found.ttft_p95_s < 0 or found.request_tokens_per_s < 0 or found.requests < 1:
        raise Rejected(
            f"model {spec.name}: a measurement needs at least one request and no negative figure", "invalid_measurement"
        )


def _slo_words(slo: M.Slo | None) -> str:
    if slo is None:
        return "no SLO"
    parts = [
        f"time to first token p95 {slo.ttft_p95_s:g} s" if slo.ttft_p95_s is not None else "",
        f"{slo.tokens_per_s:g} tokens/s per request" if slo.tokens_per_s is not None else "",
    ]
    return "SLO " + ", ".join(p for p in parts if p)
