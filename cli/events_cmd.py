"""`llmgw events …`: the log as a product (SPEC EVT-1)."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import click
import msgspec

from llmgw.cli.client import Session, run
from llmgw.cli.from_services import KEYS_LIMIT, KEYS_LIMIT_MAX
from llmgw.events.commands.audit import CommandAudit
from llmgw.events.commands.errors import CommandError, CommandRejectedError
from llmgw.events.schema.envelope import RecordedEvent
from llmgw.events.schema.subjects import EVENTS_ROOT, aggregate_of

if TYPE_CHECKING:
    from llmgw.events.runtime.connection import Quarantined  # with NATS: the reader's, when it reads


@click.group()
def events() -> None:
    """Read the event log: every change, who made it, and why."""


def event_dict(e: RecordedEvent) -> dict:
    env = e.envelope
    data = msgspec.json.decode(env.data) if env.data else {}
    return {
        "seq": e.seq,
        "id": env.id,
        "type": env.type,
        "v": env.v,
        "at": env.at.isoformat(),
        "actor": env.actor,
        "subject": e.subject,
        "causation": env.causation,
        "correlation": env.correlation,
        "data": data,
    }


ACTOR_W, TYPE_W, WHERE_W = 20, 22, 30  # the columns' widths; a longer value is cut in its middle


def _fit(text: str, width: int) -> str:
    """``text`` in exactly ``width`` characters: padded, or cut in the middle with … (both ends stay readable)."""
    if len(text) <= width:
        return text.ljust(width)
    keep = width - 1
    return text[: (keep + 1) // 2] + "…" + text[len(text) - keep // 2 :]


UNREAD_FIELDS = frozenset({"secret_sha256", "signing_key", "password_hash"})


def one_line(e: RecordedEvent) -> str:
    """One event as `events tail` and `ctl audit` print it: the sequence and the id (either is what
    `events show` takes), time, actor, type, aggregate, what caused it and the thread it is part of
    (when that is not its cause), and its data."""
    try:
        agg, agg_id = aggregate_of(e.subject)
        where = f"{agg}/{agg_id}"
    except ValueError:
        where = e.subject
    decoded = msgspec.json.decode(e.envelope.data)
    if isinstance(decoded, dict):  # digests and public keys say nothing to a person reading a line
        decoded = {k: v for k, v in decoded.items() if k not in UNREAD_FIELDS}
    data = msgspec.json.encode(decoded).decode()
    if len(data) > 100:
        data = data[:97] + "..."
    env = e.envelope
    at = env.at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")
    cause = f"by {env.causation}" if env.causation else "by -"
    if env.correlation and env.correlation != env.causation:
        cause += f" in {env.correlation}"
    return (
        f"{e.seq:>8}  {env.id}  {at}  {_fit(env.actor, ACTOR_W)} {_fit(e.type, TYPE_W)} {_fit(where, WHERE_W)} "
        f"{cause}  {data}"
    )


def parse_since(value: str) -> datetime:
    """``10m``, ``2h``, ``3d`` ago, or an ISO time."""
    m = re.fullmatch(r"(\d+)([smhd])", value.strip())
    if m:
        n, unit = int(m.group(1)), m.group(2)
        delta = {"s": timedelta(seconds=n), "m": timedelta(minutes=n), "h": timedelta(hours=n), "d": timedelta(days=n)}
        return datetime.now(UTC) - delta[unit]
    try:
        at = datetime.fromisoformat(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is neither a duration (10m, 2h, 3d) nor an ISO time") from None
    return at if at.tzinfo else at.replace(tzinfo=UTC)


@events.command("tail")
@click.option("--limit", "-n", default=20, show_default=True, help="How many of the newest events.")
@click.option("--type", "types", multiple=True, help="Only events of this type (repeatable), e.g. org.created.")
@click.option("--aggregate", help="Only events of this aggregate, e.g. tenancy.")
@click.option("--since", help="Only events after this time (10m, 2h, 3d, or ISO).")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new events as they arrive.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.pass_context
def tail(
    ctx: click.Context,
    limit: int,
    types: tuple[str, ...],
    aggregate: str | None,
    since: str | None,
    follow: bool,
    as_json: bool,
) -> None:
    """Print the newest events, oldest first: sequence, id, time, actor, type, aggregate, causation
    (``by``: the command or event that caused it), correlation (``in``: the thread, when not its cause)
    and data. `events show` takes the sequence or the id."""
    since_at = parse_since(since) if since else None
    subject = f"{EVENTS_ROOT}.{aggregate}.>" if aggregate else f"{EVENTS_ROOT}.>"

    def wanted(e: RecordedEvent | Quarantined) -> bool:
        if not isinstance(e, RecordedEvent):
            return False
        if types and e.type not in types:
            return False
        return not (since_at and e.envelope.at < since_at)

    def show(e: RecordedEvent) -> None:
        click.echo(json.dumps(event_dict(e)) if as_json else one_line(e))

    async def go(s: Session) -> None:
        store = await s.store()
        last = await store.stream_last_seq()
        # Scan backwards in growing windows until enough matching events are found.
        found: list[RecordedEvent] = []
        window, end = max(limit, 100), last
        while end > 0 and len(found) < limit:
            start = max(0, end - window)
            chunk: list[RecordedEvent] = []
            async for batch in store.subscribe(subject, after=start, follow=False, until=end):
                chunk.extend(e for e in batch if wanted(e))
            found = chunk + found
            end, window = start, window * 4
        for e in found[-limit:] if limit else []:
            show(e)
        if follow:
            async for batch in store.subscribe(subject, after=last, follow=True):
                for e in batch:
                    if wanted(e):
                        show(e)

    run(ctx, go)


@events.command("show")
@click.argument("event_id")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def show(ctx: click.Context, event_id: str, as_json: bool) -> None:
    """One event in full, with what caused it and what it caused. EVENT is its id or its sequence number
    (as `events tail` prints both); also takes a command id."""

    async def go(s: Session) -> int:
        store = await s.store()
        nonlocal event_id
        if event_id.isdigit():  # a sequence number: the event there, then its causes and effects by its id
            at = await store.get(int(event_id))
            if not isinstance(at, RecordedEvent):
                raise CommandRejectedError(
                    f"there is no event at sequence {event_id} (`llmgw events tail` lists them)", "not_found"
                )
            event_id = at.envelope.id
        found = await s.api("GET", f"/api/v1/events/{event_id}")
        event = await store.get(found["seq"]) if found.get("seq") else None
        if found.get("seq") and not isinstance(event, RecordedEvent):
            raise CommandError(f"event {event_id} is indexed at {found['seq']} but no longer in the stream")
        if as_json:
            out = {
                "event": event_dict(event) if event else None,
                "cause": found.get("cause"),
                "effects": found.get("effects", []),
            }
            click.echo(json.dumps(out, indent=2))
            return 0
        if event is not None:
            d = event_dict(event)
            for key in ("id", "type", "v", "seq", "at", "actor", "subject", "causation", "correlation"):
                click.echo(f"{key:<12} {d[key] if d[key] is not None else '-'}")
            click.echo("data")
            click.echo("  " + json.dumps(d["data"], indent=2).replace("\n", "\n  "))
        else:
            click.echo(f"{event_id} is not an event; it is the cause (command) of the events below")
        cause = found.get("cause")
        if cause:
            click.echo(f"caused by    {cause['type']} {cause['id']} ({cause['actor']}, seq {cause['seq']})")
        for eff in found.get("effects", []):
            click.echo(f"caused       {eff['type']} {eff['id']} (seq {eff['seq']})")
        return 0

    run(ctx, go)


@events.command("catalog")
def catalog() -> None:
    """Print the catalogue of event types (docs/events.md is this output)."""
    from llmgw.events.schema.catalog import render_markdown

    click.echo(render_markdown(), nl=False)


@events.command("replay")
@click.option(
    "--until", required=True, help="The moment: an ISO time (UTC unless it names a zone), or 10m, 2h, 3d ago."
)
@click.option(
    "--keys-limit",
    type=click.IntRange(0, KEYS_LIMIT_MAX),
    default=KEYS_LIMIT,
    show_default=True,
    help="Keys to list (all are counted); 0 for the counts only.",
)
@click.option("--keys-after", help="List the keys after this cursor (the one the page before ends with).")
@click.option("--json", "as_json", is_flag=True, help="The answer as the admin API returns it.")
@click.pass_context
def replay(ctx: click.Context, until: str, keys_limit: int, keys_after: str | None, as_json: bool) -> None:
    """The cluster as it was at a moment: nodes, models, replicas, the tree and keys, folded from the log."""
    parse_since(until)  # a bad time is refused here, before the fold

    async def go(s: Session) -> None:
        params = {"until": until, "keys_limit": str(keys_limit)} | ({"keys_after": keys_after} if keys_after else {})
        c = await s.api("GET", "/api/v1/replay", params=params, timeout=3600)
        if as_json:
            click.echo(json.dumps(c, indent=2))
            return
        if not c["position"]:
            click.echo(f"the log holds nothing from {c['until']} or before")
            return
        click.echo(
            f"the cluster at {c['until']}: {c['events_folded']} events up to #{c['position']} ({c['last_event_at']})"
        )
        click.echo(f"\nnodes ({len(c['nodes'])})")
        for n in c["nodes"]:
            flags = ", ".join(
                f for f in ("cordoned" if n["cordoned"] else "", "draining" if n["draining"] else "") if f
            )
            click.echo(
                f"  {n['id']:<20} {n['state']:<8} {n['replicas']} replica(s)" + (f"  [{flags}]" if flags else "")
            )
        click.echo(f"\nmodels ({len(c['models'])})")
        for m in c["models"]:
            click.echo(f"  {m['name']:<24} {m['ready']}/{m['min_replicas']} ready  {m['status']}")
        click.echo(f"\nreplicas ({len(c['replicas'])})")
        for r in c["replicas"]:
            click.echo(f"  {r['id']:<32} {r['model']:<20} on {r['node_id']:<16} {r['state']}")
        click.echo(f"\norgs, teams and projects ({len(c['scopes'])})")
        for sc in c["scopes"]:
            click.echo(f"  {sc['kind']:<8} {sc['path']}")
        if c.get("quotas"):
            click.echo(f"\ncapacity quotas ({len(c['quotas'])})")
            for q in c["quotas"]:
                holds, guarantee, limit = (
                    _capacity(q["holds"], held=True),
                    _capacity(q["guarantee"]),
                    _capacity(q["limit"]),
                )
                click.echo(f"  {q['scope']:<28} holds {holds}; guarantee {guarantee}; limit {limit}")
        k = c["counts"]["keys"]
        click.echo(
            f"\nkeys ({k['total']}: {k['active']} active, {k['revoked']} revoked, {k['expired']} expired"
            + (f"; {len(c['keys'])} listed" if len(c["keys"]) < k["total"] else "")
            + ")"
        )
        for key in c["keys"]:
            click.echo(f"  {key['prefix']:<10} {key['project']:<28} {key['name']:<20} {key['state']}")
        if c["keys_next"]:
            click.echo(
                f"  … more: llmgw events replay --until {c['until']} --keys-limit {keys_limit} "
                f"--keys-after {c['keys_next']}"
            )

    run(ctx, go)


def _capacity(r: dict[str, Any], held: bool = False) -> str:
    """``2 GPUs, 16 cores, 64 GB`` for what is set (what is ``held``: no GPUs unless some); ``—`` for nothing."""
    parts = []
    if r.get("gpus") is not None and (r["gpus"] or not held):
        parts.append(f"{r['gpus']} GPU" + ("" if r["gpus"] == 1 else "s"))
    if r.get("cores") is not None:
        parts.append(f"{r['cores']} cores")
    if r.get("memory_bytes") is not None:
        parts.append(f"{r['memory_bytes'] / 1024**3:g} GB")
    return ", ".join(parts) or "—"


@events.command("verify")
@click.option("--json", "as_json", is_flag=True, help="Print the findings as JSON.")
@click.pass_context
def verify(ctx: click.Context, as_json: bool) -> None:
    """Check every carried-out command's signature again, from the log alone: who asked for each change.

    Exits 1 when a signature does not hold (the log was altered) and lists those commands."""

    async def go(s: Session) -> int:
        store = await s.store()
        from llmgw.events.runtime.secrets import signing_secret  # NATS's: loaded with the store

        audit = CommandAudit(secret=await signing_secret(store.js))
        async for batch in store.subscribe(f"{EVENTS_ROOT}.>", follow=False):
            for event in batch:
                if isinstance(event, RecordedEvent):
                    audit.apply(event)
        found = audit.result
        if as_json:
            click.echo(msgspec.json.encode(found).decode())
        else:
            click.echo(
                f"{found.checked:,} command(s) carried out, each signature holds; {found.refused:,} refused when sent "
                f"as unproven; {found.not_kept:,} from before commands were kept"
            )
            for signer, n in sorted(found.signers.items(), key=lambda kv: -kv[1]):
                click.echo(f"  {n:>8,}  signed by {signer}")
            for f in found.failures:
                click.echo(f"FAILED {f.kind} {f.command_id} (#{f.seq}, by {f.requested_by}, {f.signer}): {f.why}")
        return 0 if found.ok else 1

    run(ctx, go)
