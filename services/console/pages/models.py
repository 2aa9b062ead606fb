"""The console's models: the catalog with each model's status, and one model (its replicas, `explain`,
headroom, SLO and measurements); add, scale, stop, start, retry, restart, remove, and serve from a hub
with the job's progress as its events arrive.

Every change is the command the CLI sends (cli/fleet_cmd.py, cli/jobs_cmd.py), built the same way.
The scheduler's answers (explain, headroom) and the serve jobs' progress are read as they are now; at a
past moment the page shows the catalog and the replicas as they were, and says the rest is now-only.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import msgspec
import nats.errors

from llmgw.events.folds.jobs import JobState
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import jobs as J
from llmgw.events.schema import models as M
from llmgw.events.schema import nodes as N
from llmgw.events.schema import replicas as R
from llmgw.events.schema import scheduler as SCH
from llmgw.events.schema.envelope import RecordedEvent
from llmgw.events.schema.subjects import EVENTS_ROOT, aggregate_of
from llmgw.services.api.act import Outcome
from llmgw.services.api.views import ACTIVE_STATES, shape_model
from llmgw.services.console.forms import BadInput, refused
from llmgw.services.console.page import Ctx, Page
from llmgw.services.console.pages.nodes import active_clause, fleet_sql, paged
from llmgw.services.console.source import Source, marked
from llmgw.services.jobs.rules import STEPS

ASK_TIMEOUT_S = 3.0  # a scheduler that has not answered by then is said not to answer
JOBS_SHOWN = 5  # the newest serve jobs the models page follows
EXPLAIN_NODES_SHOWN = 50  # the nodes a model's explain lists on its page
REPLICAS_SHOWN = 20  # a model's replicas the model page lists: the active ones, then the latest ended
MODEL_FIELDS = ("standing", "status", "ready", "starting", "min_replicas", "max_replicas", "nodes")
REPLICA_FIELDS = ("state", "node_id", "port", "reason")
STANDINGS = ("satisfied", "short", "parked", "stopped")
MOST = 1_000_000  # the largest number a form field takes: past it, a typing slip (and past 2**63, unencodable)


def standing(m: dict[str, Any]) -> str:
    """A shaped model in one word (for ``data-status`` and the message key): stopped, parked, satisfied
    (its minimum ready, or served outside the cluster) or short. Pure."""
    if m["stopped"]:
        return "stopped"
    if m["parked"]:
        return "parked"
    if m.get("external") or m["ready"] >= (m["min_replicas"] or 0):
        return "satisfied"
    return "short"


def _spec_summary(spec: dict[str, Any]) -> dict[str, Any]:
    """The parts of a model's spec the page shows: its source, scaling and each profile's reservation."""
    profiles = []
    for p in spec.get("profiles") or []:
        gpus = p.get("gpus") or {}
        profiles.append(
            {
                "name": p.get("name", "default"),
                "engine": p.get("engine", "llamacpp"),
                "cpu_cores": p.get("cpu_cores"),
                "memory_gb": p.get("min_memory_gb"),
                "gpus": gpus.get("count", 0),
                "ctx_size": p.get("ctx_size"),
            }
        )
    return {"profiles": profiles, "description": spec.get("description", ""), "aliases": spec.get("aliases", [])}


async def active_of_models(src: Source, name: str | None = None) -> dict[str, list[dict[str, Any]]]:
    """The active replicas of each model (or of the one named) as :func:`shape_model` counts them (state,
    spec hash, node), grouped by the database: one row stands for every replica alike, repeated here."""
    where, args = f"WHERE {active_clause()}", []
    if name is not None:
        where, args = where + " AND model = ?", [name]
    rows = await fleet_sql(
        src,
        f"SELECT model, state, spec_hash, node_id, COUNT(*) FROM {{replicas}} {where} "
        "GROUP BY model, state, spec_hash, node_id",
        *args,
    )
    out: dict[str, list[dict[str, Any]]] = {}
    for model, state, spec_hash, node_id, count in rows:
        alike = {"model": model, "state": state, "spec_hash": spec_hash, "node_id": node_id}
        out.setdefault(model, []).extend([alike] * int(count))
    return out


async def catalog(src: Source, name: str | None = None) -> list[dict[str, Any]]:
    """Every model (or the one named), shaped as `ctl models` shows it, with its standing and spec summary."""
    if name is None:
        rows = await src.fleet("models", "ORDER BY name")
    else:
        rows = await src.fleet("models", "WHERE name = ?", name)
    of_model = await active_of_models(src, name)
    out = []
    for m in rows:
        summary = _spec_summary(msgspec.json.decode(m["spec"] or "{}"))
        m = shape_model(m, of_model.get(m["name"], []))
        m.update(summary, standing=standing(m))
        out.append(m)
    return out


async def ask_scheduler(store: EventStore, subject: str, name: str) -> dict[str, Any]:
    """A scheduler's answer about ``name`` (`ctl explain`, `ctl model headroom`); ``{"error": ...}`` naming
    why there is none, and ``{"unreached": True}`` when no scheduler answered."""
    try:
        msg = await store.nc.request(subject, name.encode(), timeout=ASK_TIMEOUT_S)
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
        return {"unreached": True}
    try:
        body = json.loads(msg.data)
    except ValueError as exc:
        return {"error": f"the scheduler's answer could not be read: {exc}"}
    return body if isinstance(body, dict) else {"error": "the scheduler's answer could not be read"}


class _Job(JobState):
    """The shared job fold, keeping the last step line a person reads (the progress bar's words)."""

    def __init__(self, job_id: str) -> None:
        super().__init__(job_id)
        self.last_message = ""
        self.first_seq = 0

    def apply(self, event: RecordedEvent) -> None:
        super().apply(event)
        self.first_seq = self.first_seq or event.seq
        if isinstance(event.payload, J.JobStep):
            self.last_message = f"{event.payload.step}: {event.payload.message}"


def job_view(job: _Job) -> dict[str, Any]:
    """A serve job as the page shows it: what was asked, the steps done of all, the step under way, and its
    end. Pure."""
    req = job.request
    done = [s for s in STEPS if s in job.done]
    data = job.data
    return {
        "id": job.id,
        "repo": req.repo if req else "",
        "quant": req.quant if req else None,
        "model": data.get("model") or (req.name if req else None),
        "requested_by": req.requested_by if req else "",
        "done": len(done),
        "total": len(STEPS),
        "running": job.running,
        "finished": job.finished is not None,
        "ok": bool(job.finished and job.finished.ok),
        "summary": job.finished.summary if job.finished else "",
        "last": job.last_message,
    }


async def serve_jobs(store: EventStore, up_to: int | None = None, model: str | None = None) -> list[dict[str, Any]]:
    """The newest serve jobs (of ``model``, when named), folded from their events up to sequence ``up_to``
    (None: all), newest first."""
    jobs: dict[str, _Job] = {}
    for e in await store.read(f"{EVENTS_ROOT}.{J.AGGREGATE}.>"):
        if up_to is not None and e.seq > up_to:
            break
        _, job_id = aggregate_of(e.subject)
        jobs.setdefault(job_id, _Job(job_id)).apply(e)
    views = [job_view(j) for j in sorted(jobs.values(), key=lambda j: -j.first_seq)]
    if model is not None:
        views = [v for v in views if v["model"] == model]
    return views[:JOBS_SHOWN]


def may_act(ctx: Ctx) -> bool:
    """Whether the page shows the catalog's controls: to a cluster admin (the catalog, fleet and jobs
    services need one), and only for now. The service decides again when the command comes."""
    return ctx.at is None and ctx.can("cluster-admin")


def _up_to(ctx: Ctx) -> int | None:
    return ctx.source.position if ctx.at is not None else None


# -- gather ---------------------------------------------------------------------------------------


async def gather_models(ctx: Ctx) -> dict[str, Any]:
    models = await catalog(ctx.source)
    if ctx.at is not None:
        models = marked(models, await catalog(ctx.now), key="name", fields=MODEL_FIELDS)
    counts = {s: sum(1 for m in models if m.get("standing") == s and m.get("_diff") != "added") for s in STANDINGS}
    state = ctx.query.get("state", "")
    listing = paged([m for m in models if m.get("standing") == state] if state in STANDINGS else models, ctx.query)
    return {
        "models": listing["rows"],
        "listing": listing,
        "state": state if state in STANDINGS else "",
        "counts": counts,
        "jobs": await serve_jobs(ctx.api.store, _up_to(ctx)),
        "engines": M.ENGINES,
        "may_act": may_act(ctx),
    }


async def gather_model(ctx: Ctx) -> dict[str, Any]:
    name = ctx.params["name"]
    found = await catalog(ctx.source, name)
    model = found[0] if found else None
    tail = "WHERE model = ? ORDER BY placed_at DESC LIMIT ?"
    replicas = await ctx.source.fleet("replicas", tail, name, REPLICAS_SHOWN)
    if ctx.at is not None:
        now_found = await catalog(ctx.now, name)
        if model is not None:
            model = marked([model], now_found, key="name", fields=MODEL_FIELDS)[0]
        replicas = marked(replicas, await ctx.now.fleet("replicas", tail, name, REPLICAS_SHOWN), fields=REPLICA_FIELDS)
    replicas.sort(key=lambda r: (r["state"] not in ACTIVE_STATES, -_placed(r)))
    for r in replicas:  # a ready replica started from another spec runs a stale profile (CAT-5), as `ctl replicas`
        r["stale"] = model is not None and r["state"] == "ready" and r["spec_hash"] != model["spec_hash"]
    explain: dict[str, Any] = {}
    headroom: dict[str, Any] = {}
    if ctx.at is None and model is not None and not model.get("external"):
        explain, headroom = await asyncio.gather(
            ask_scheduler(ctx.api.store, SCH.EXPLAIN_SUBJECT, name),
            ask_scheduler(ctx.api.store, SCH.HEADROOM_SUBJECT, name),
        )
    verdicts = explain.get("nodes") or []
    if verdicts:  # those that fit first; a thousand nodes' verdicts are `ctl explain`'s to list, not a page's
        explain["nodes"] = sorted(verdicts, key=lambda v: not v.get("fits"))[:EXPLAIN_NODES_SHOWN]
        explain["nodes_more"] = max(len(verdicts) - EXPLAIN_NODES_SHOWN, 0)
    return {
        "name": name,
        "model": model,
        "replicas": replicas,
        "explain": explain,
        "headroom": headroom,
        "jobs": await serve_jobs(ctx.api.store, _up_to(ctx), name),
        "may_act": may_act(ctx),
    }


def _placed(r: dict[str, Any]) -> float:
    try:
        return datetime.fromisoformat(r["placed_at"]).timestamp() if r.get("placed_at") else 0.0
    except ValueError:
        return 0.0


# -- form fields ----------------------------------------------------------------------------------


def _text(form: Mapping[str, str], field: str, what: str, *, required: bool = False) -> str | None:
    value = (form.get(field) or "").strip()
    if required and not value:
        raise BadInput(f"give {what} (the form's `{field}` field)")
    return value or None


def _int(form: Mapping[str, str], field: str, what: str, *, required: bool = False, least: int = 0) -> int | None:
    raw = _text(form, field, what, required=required)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise BadInput(f"{what} {raw!r} is not a whole number") from None
    if not least <= value <= MOST:
        raise BadInput(f"{what} must be from {least} to {MOST:,}")
    return value


def _float(form: Mapping[str, str], field: str, what: str) -> float | None:
    raw = _text(form, field, what)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise BadInput(f"{what} {raw!r} is not a number") from None
    if not 0 < value <= MOST:  # also refuses nan and infinity, which no command field takes
        raise BadInput(f"{what} must be more than 0 and at most {MOST:,}")
    return value


def _checked(form: Mapping[str, str], field: str) -> bool:
    return (form.get(field) or "").strip().lower() in ("on", "1", "true", "yes")


def _estimated_memory_gb(source: str, ctx_size: int | None) -> float | None:
    """What `ctl model add` reserves for a GGUF it can read (the serve job's sizing rule over its header);
    None when the file is not on this machine (a path on the nodes: the catalog then asks for it)."""
    from llmgw.modelfiles.gguf_header import read_header_file
    from llmgw.modelfiles.sizing import estimate_memory

    path = Path(source).expanduser()
    if not path.is_file():
        return None
    try:
        header = read_header_file(path)
        return estimate_memory(header, path.stat().st_size, ctx_size or J.DEFAULT_CTX_POOL).total_gb
    except (OSError, ValueError):
        return None


# -- actions --------------------------------------------------------------------------------------


async def add(ctx: Ctx, form: Mapping[str, str]) -> Outcome:
    """`ctl model add NAME --source PATH [--min N] [--max N] [--cpu-cores N] [--memory-gb N] [--engine E]
    [--ctx-size N]`: the same spec."""
    try:
        name = _text(form, "name", "the model's name", required=True)
        source = _text(
            form, "source", "the model's GGUF file (a path on the nodes, or mirror:MODEL/VERSION/FILE)", required=True
        )
        engine = _text(form, "engine", "the engine") or "llamacpp"
        if engine not in M.ENGINES:
            raise BadInput(f"the engine {engine!r} is not one of {', '.join(M.ENGINES)}")
        min_ = _int(form, "min", "the minimum of replicas")
        max_ = _int(form, "max", "the maximum of replicas")
        cores = _int(form, "cpu_cores", "the cores one replica reserves", least=1)
        memory_gb = _float(form, "memory_gb", "the memory (GB) one replica reserves")
        ctx_size = _int(form, "ctx_size", "the context size", least=1)
    except BadInput as exc:
        return refused("catalog.add", str(exc))
    assert name is not None and source is not None
    if ctx.can("cluster-admin"):
        # Only for whom may add: a file on this machine is named absolutely and sized from its header, as the
        # CLI does on its own machine; a path on the nodes only goes as it is.
        local = Path(source).expanduser()
        source = str(local.resolve()) if local.exists() else source
        if memory_gb is None and engine == "llamacpp":
            memory_gb = await asyncio.to_thread(_estimated_memory_gb, source, ctx_size)
    profile = M.Profile(engine=engine, cpu_cores=cores, min_memory_gb=memory_gb, ctx_size=ctx_size)
    spec = M.ModelSpec(
        name=name,
        source=source,
        scaling=M.Scaling(min=1 if min_ is None else min_, max=max_),
        profiles=[profile],
    )
    return await ctx.act(M.SERVICE, "add", M.AddModel(spec=spec))


async def serve(ctx: Ctx, form: Mapping[str, str]) -> Outcome:
    """`ctl model serve OWNER/REPO [--quant Q] [--file F] [--name N] [--on-demand] [--ctx-pool N] [--cores N]`."""
    try:
        repo = _text(form, "repo", "the hub repository (OWNER/REPO)", required=True)
        ctx_pool = _int(form, "ctx_pool", "the context tokens one replica holds", least=1)
        cores = _int(form, "cores", "the cores one replica reserves", least=1)
    except BadInput as exc:
        return refused("jobs.serve", str(exc))
    assert repo is not None
    cmd = J.ServeModel(
        repo=repo,
        quant=_text(form, "quant", "the quant"),
        file=_text(form, "file", "the GGUF file"),
        name=_text(form, "name", "the model's name"),
        on_demand=_checked(form, "on_demand"),
        ctx_pool=ctx_pool or J.DEFAULT_CTX_POOL,
        cores=cores,
    )
    return await ctx.act(J.SERVICE, "serve", cmd)


def _name(ctx: Ctx, form: Mapping[str, str]) -> str:
    name = (form.get("name") or ctx.params.get("name") or "").strip()
    if not name:
        raise BadInput("say which model: the form's `name` field names it")
    return name


async def scale(ctx: Ctx, form: Mapping[str, str]) -> Outcome:
    try:
        name = _name(ctx, form)
        min_ = _int(form, "min", "the minimum of replicas", required=True)
        max_ = _int(form, "max", "the maximum of replicas")
    except BadInput as exc:
        return refused("catalog.scale", str(exc))
    assert min_ is not None
    return await ctx.act(M.SERVICE, "scale", M.ScaleModel(name=name, min=min_, max=max_))


def _simple(verb: str, payload_of: Any) -> Any:
    async def action(ctx: Ctx, form: Mapping[str, str]) -> Outcome:
        try:
            name = _name(ctx, form)
        except BadInput as exc:
            return refused(f"catalog.{verb}", str(exc))
        return await ctx.act(M.SERVICE, verb, payload_of(name))

    action.__name__ = verb
    return action


stop = _simple("stop", lambda n: M.StopModel(name=n))
start = _simple("start", lambda n: M.StartModel(name=n))
retry = _simple("retry", lambda n: M.RetryModel(name=n))


async def remove(ctx: Ctx, form: Mapping[str, str]) -> Outcome:
    """`ctl model remove NAME [--purge]`; the purge's progress shows on the audit page and the log."""
    try:
        name = _name(ctx, form)
    except BadInput as exc:
        return refused("catalog.remove", str(exc))
    return await ctx.act(M.SERVICE, "remove", M.RemoveModel(name=name, purge=_checked(form, "purge")))


async def restart(ctx: Ctx, form: Mapping[str, str]) -> Outcome:
    """`ctl restart REPLICA [--reason WHY]` (the fleet service restarts it with surge)."""
    replica = (form.get("replica") or "").strip()
    if not replica:
        return refused("fleet.restart", "say which replica: the form's `replica` field names it")
    reason = (form.get("reason") or "").strip()
    return await ctx.act(N.SERVICE, "restart", R.RestartReplica(replica_id=replica, reason=reason))


ACTIONS = {
    "add": add,
    "serve": serve,
    "scale": scale,
    "stop": stop,
    "start": start,
    "retry": retry,
    "remove": remove,
    "restart": restart,
}

PAGES = [
    Page(
        path="/console/models",
        name="models",
        title="models.title",
        template="models.html",
        gather=gather_models,
        actions=ACTIONS,
        live=("model", "replica", "job"),
    ),
    Page(
        path="/console/models/{name}",
        name="model",
        title="models.model_title",
        template="model.html",
        gather=gather_model,
        actions=ACTIONS,
        live=("model", "replica", "job"),
        nav=False,
    ),
]
