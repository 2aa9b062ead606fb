"""The mirror page (issue 24, item 4): the model versions the mirror holds and fetches (its files,
their size and checksums), its peers (what each copied), the space its files take, and the fetches
in progress with a progress bar; fetch and remove, as `llmgw mirror fetch|remove` send them.

Everything shown is folded from the log (events/folds/mirror.py, the fold `mirror list` uses), so the
page answers while the mirror is down, and with the time slider shows the mirror as the log told it
then. The disk's free space is not on the log: the page says so rather than guess.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmgw.events.commands import roles as R
from llmgw.events.folds.mirror import FETCHING, PRESENT, MirrorState
from llmgw.events.schema import mirror as E
from llmgw.events.schema.subjects import EVENTS_ROOT, aggregate_of
from llmgw.services.api.act import Outcome
from llmgw.services.console.forms import refused
from llmgw.services.console.page import Ctx, Page
from llmgw.services.console.source import marked


async def _state(ctx: Ctx, bound: int | None) -> MirrorState:
    state = MirrorState()
    for e in await ctx.api.store.read(f"{EVENTS_ROOT}.{E.AGGREGATE}.>"):
        if bound is None or e.seq <= bound:
            state.apply(aggregate_of(e.subject)[1], e)
    return state


async def _peers(ctx: Ctx, bound: int | None) -> list[dict[str, Any]]:
    """Each peer mirror (MIR-4): the files it copied and deleted, and its latest failure."""
    peers: dict[str, dict[str, Any]] = {}
    for e in await ctx.api.store.read(f"{EVENTS_ROOT}.{E.PEER_AGGREGATE}.>"):
        if bound is not None and e.seq > bound:
            continue
        name = aggregate_of(e.subject)[1]
        peer = peers.setdefault(
            name, {"name": name, "files": {}, "failure": None, "source": "", "last_at": e.envelope.at}
        )
        peer["last_at"] = e.envelope.at
        p = e.payload
        if isinstance(p, E.PeerFileCopied):
            peer["files"][(p.model, p.version, p.file)] = p.size
            peer["source"] = p.source
            peer["failure"] = None
        elif isinstance(p, E.PeerFileDeleted):
            peer["files"].pop((p.model, p.version, p.file), None)
        elif isinstance(p, E.PeerCopyFailed):
            peer["failure"] = f"{p.model}/{p.version} {p.file}: {p.reason} ({p.code})"
    return [
        {**p, "count": len(p["files"]), "bytes": sum(p["files"].values()), "state": "failing" if p["failure"] else "ok"}
        for p in sorted(peers.values(), key=lambda p: p["name"])
    ]


async def gather(ctx: Ctx) -> dict[str, Any]:
    bound = ctx.source.position if ctx.at is not None else None
    state = await _state(ctx, bound)
    rows = state.rows()
    for r in rows:
        r["id"] = f"{r['model']}/{r['version']}"
        r["share"] = r["done"] / r["bytes"] if r["bytes"] else (1.0 if r["state"] == PRESENT else 0.0)
    jobs = [r for r in rows if r["state"] == FETCHING]
    held = sum(r["bytes"] for r in rows if r["state"] == PRESENT)
    partial = sum(r["done"] for r in rows if r["state"] != PRESENT)
    if ctx.at is not None:
        now_rows = (await _state(ctx, None)).rows()
        for r in now_rows:
            r["id"] = f"{r['model']}/{r['version']}"
        rows = marked(rows, now_rows, fields=("state", "bytes", "done"))
        for r in rows:
            r.setdefault("share", r["done"] / r["bytes"] if r["bytes"] else 0.0)
    may = ctx.at is None and ctx.may(R.cluster_admin("fetching into the mirror"))
    return {
        "versions": rows,
        "jobs": jobs,
        "peers": await _peers(ctx, bound),
        "held_bytes": held,
        "partial_bytes": partial,
        "may_act": may,
    }


async def fetch(ctx: Ctx, form: Mapping[str, str]) -> Outcome:
    model, repo = (form.get("model") or "").strip(), (form.get("repo") or "").strip()
    if not model or not repo or "/" not in repo:
        return refused(f"{E.SERVICE}.fetch", "give the model's name and its repository as OWNER/NAME")
    files = [f.strip() for f in (form.get("files") or "").split(",") if f.strip()]
    payload = E.MirrorFetch(
        model=model,
        repo=repo,
        revision=(form.get("revision") or "main").strip() or "main",
        files=files or None,
        allow_pickle=form.get("allow_pickle") in ("on", "true", "1"),
    )
    return await ctx.act(E.SERVICE, "fetch", payload)


async def remove(ctx: Ctx, form: Mapping[str, str]) -> Outcome:
    model, version = (form.get("model") or "").strip(), (form.get("version") or "").strip()
    if not model:
        return refused(f"{E.SERVICE}.remove", "say which model to remove (and, to keep the others, which version)")
    return await ctx.act(E.SERVICE, "remove", E.MirrorRemove(model=model, version=version or None))


PAGES = [
    Page(
        path="/console/mirror",
        name="mirror",
        title="mirror.nav",
        template="mirror.html",
        gather=gather,
        actions={"fetch": fetch, "remove": remove},
        live=(E.AGGREGATE, E.PEER_AGGREGATE),
    )
]
