"""`llmgw mirror`: model weights fetched from a Hugging Face hub, verified and served (SPEC MIR-1, MIR-2).

Commands go to the mirror service over the bus; what the mirror holds is folded from its events
in the log, so `mirror list` answers even while the mirror is down and shows why a fetch failed.
"""

from __future__ import annotations

import contextlib
import json
from typing import TYPE_CHECKING, Any

import click
import msgspec

from llmgw.cli.client import Session, run
from llmgw.cli.progress import Downloads
from llmgw.cli.table import table
from llmgw.events.commands.errors import CommandError
from llmgw.events.folds.mirror import FETCHING, PRESENT, MirrorState
from llmgw.events.schema import mirror as E
from llmgw.events.schema.envelope import RecordedEvent
from llmgw.events.schema.subjects import EVENTS_ROOT, aggregate_of, event_subject
from llmgw.services.mirror.rules import human

if TYPE_CHECKING:
    from llmgw.events.runtime.store import EventStore  # the store comes from the Session, NATS with it


@click.group()
def mirror() -> None:
    """Model weights on the mirror: fetch them from a Hugging Face hub, list, remove."""


def _line(e: RecordedEvent) -> str | None:
    p = e.payload
    match p:
        case E.FileProgress():
            return f"{p.file}: {100 * p.done // max(p.size, 1)}% of {human(p.size)}"
        case E.FileVerified():
            resumed = f", resumed from {human(p.resumed_from)}" if p.resumed_from else ""
            return f"{p.file}: {human(p.size)}, sha256 {p.sha256[:16]}… verified{resumed}"
        case E.FetchCompleted():
            return f"done: {p.files} file(s), {human(p.bytes)}, {human(p.downloaded)} downloaded in {p.seconds:.0f}s"
    return None


async def watch_progress(store: EventStore, model: str, version: str, bars: Downloads) -> Any:
    """Feed ``bars`` with the mirror's progress telemetry for ``model``/``version``; the subscription
    (unsubscribe it when the fetch ends). Progress is telemetry: missed samples only make a bar jump."""
    decoder = msgspec.json.Decoder(E.DownloadProgress)

    async def on_msg(msg: Any) -> None:
        try:
            p = decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        if p.version == version:
            bars.update(p.file, p.done, p.size, p.at)

    return await store.nc.subscribe(E.progress_subject(model), cb=on_msg)


async def _follow(s: Session, model: str, version: str, start: int) -> int:
    """Print a fetch's progress until it completes (0) or fails (1): each file's bar from the mirror's
    telemetry, and what lasts (a file verified, the fetch done or failed) from the log."""
    store = await s.store()
    subject = event_subject(E.AGGREGATE, model)
    start = start or await store.last_seq(subject)
    state = MirrorState()
    click.echo("(Ctrl-C stops watching; the fetch goes on in the mirror)", err=True)
    bars = Downloads()
    watching = await watch_progress(store, model, version, bars)
    try:
        return await _follow_log(store, subject, model, version, start, state, bars)
    finally:
        with contextlib.suppress(Exception):
            await watching.unsubscribe()


async def _follow_log(
    store: EventStore, subject: str, model: str, version: str, start: int, state: MirrorState, bars: Downloads
) -> int:
    seen = 0
    async for batch in store.subscribe(subject, after=0, follow=True):
        for e in batch:
            if not isinstance(e, RecordedEvent):
                continue
            state.apply(model, e)
            if e.seq > start and getattr(e.payload, "version", None) == version:
                if isinstance(e.payload, E.FileVerified):
                    bars.finish(e.payload.file)
                line = _line(e)
                if line:
                    click.echo(line)
            seen = e.seq
        if seen < start:
            continue
        v = state.version(model, version)
        if v is None:
            raise CommandError(f"{model}/{version} was removed while it was fetched")
        if v.state == PRESENT:
            click.echo(f"{model}/{version} is on the mirror")
            return 0
        if v.state != FETCHING:
            click.echo(f"error: {v.error}", err=True)
            return 1
    return 1


@mirror.command("fetch")
@click.argument("model")
@click.argument("repo")
@click.option("--revision", default="main", show_default=True, help="A branch, tag or commit; pinned to its commit.")
@click.option("--file", "files", multiple=True, help="Only this file of the repository (repeatable); all by default.")
@click.option(
    "--allow-pickle",
    is_flag=True,
    help="Accept pickled weights (.bin, .pt, .pth, .ckpt), which can run code when they are loaded.",
)
@click.option("--detach", is_flag=True, help="Return once the fetch is accepted; `llmgw mirror list` follows it.")
@click.pass_context
def fetch(
    ctx: click.Context, model: str, repo: str, revision: str, files: tuple[str, ...], allow_pickle: bool, detach: bool
) -> None:
    """Fetch REPO (owner/name) at a revision into the mirror as MODEL/VERSION, checking every sha256."""

    async def go(s: Session) -> int:
        payload = E.MirrorFetch(
            model=model, repo=repo, revision=revision, files=list(files) or None, allow_pickle=allow_pickle
        )
        out = await s.command(E.SERVICE, "fetch", payload, timeout=60.0)
        click.echo(out.message)
        if detach or out.result.get("state") != FETCHING:
            return 0
        return await _follow(s, model, out.result["version"], out.last_seq)

    run(ctx, go)


async def _mirror_state(s: Session) -> MirrorState:
    """What the mirror holds: its events in the log through the shared fold (so it answers while the mirror is down)."""
    store = await s.store()
    state = MirrorState()
    for e in await store.read(f"{EVENTS_ROOT}.{E.AGGREGATE}.>"):
        state.apply(aggregate_of(e.subject)[1], e)
    return state


@mirror.command("list")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def list_(ctx: click.Context, as_json: bool) -> None:
    """What the mirror holds and fetches: model, version, state, files, size, repository."""

    async def go(s: Session) -> None:
        rows = (await _mirror_state(s)).rows()
        if as_json:
            click.echo(json.dumps(rows, indent=2))
            return
        if not rows:
            click.echo("the mirror holds nothing yet: `llmgw mirror fetch MODEL OWNER/REPO`")
            return
        cells = []
        for r in rows:
            state = r["state"]
            if state == FETCHING:
                state += f" {100 * r['done'] // max(r['bytes'], 1)}%"
            cells.append(
                [r["model"], r["version"], state, len(r["files"]), human(r["bytes"]), f"{r['repo']}@{r['commit'][:12]}"]
            )
        head, *lines = table(["MODEL", "VERSION", "STATE", "FILES", "SIZE", "REPOSITORY"], cells, right={3, 4})
        click.echo(head)
        for r, line in zip(rows, lines, strict=True):
            click.echo(line)
            if r["error"]:
                click.echo(f"  {r['error']}")

    run(ctx, go)


@mirror.command("remove")
@click.argument("target", metavar="MODEL[/VERSION]")
@click.pass_context
def remove(ctx: click.Context, target: str) -> None:
    """Delete a model's files from the mirror: one version, or all of them."""
    model, _, version = target.partition("/")
    if not model or "/" in version:
        raise click.UsageError(f"{target!r}: give MODEL or MODEL/VERSION")

    async def go(s: Session) -> None:
        out = await s.command(E.SERVICE, "remove", E.MirrorRemove(model=model, version=version or None))
        click.echo(out.message)

    run(ctx, go)
