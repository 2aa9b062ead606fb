"""`llmgw ctl model serve OWNER/REPO` and `llmgw ctl job ID`: a serve job, followed step by step (SPEC MIR-3)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import click
import msgspec

from llmgw.cli.client import Session, run
from llmgw.cli.ctl import ctl
from llmgw.cli.fleet_cmd import model
from llmgw.cli.progress import Downloads
from llmgw.events.commands.errors import CommandRejectedError
from llmgw.events.folds.jobs import JobState
from llmgw.events.schema import jobs as J
from llmgw.events.schema import mirror as E
from llmgw.events.schema.envelope import RecordedEvent
from llmgw.events.schema.subjects import event_subject

if TYPE_CHECKING:
    from llmgw.events.runtime.store import EventStore  # the store comes from the Session, NATS with it


def step_line(p: J.JobStep) -> str:
    mark = {J.STARTED: "…", J.DONE: "✓", J.FAILED: "✗"}.get(p.status, "?")
    return f"{mark} {p.step}: {p.message}"


async def follow_job(store: EventStore, job_id: str) -> int:
    """Print the job's steps (those done already, then as they happen) until it finishes; its exit code.
    While the mirror fetches, each file's progress shows as a bar (from the mirror's telemetry)."""
    subject = event_subject(J.AGGREGATE, job_id)
    if not await store.last_seq(subject):
        raise CommandRejectedError(f"there is no job {job_id}", "not_found")
    job = JobState(job_id)  # the job's shared fold: what its done steps decided names the mirror's model
    bars = Downloads()
    watching = None
    try:
        async for batch in store.subscribe(subject):
            for e in batch:
                if not isinstance(e, RecordedEvent):
                    continue
                job.apply(e)
                p = e.payload
                if isinstance(p, J.JobStep):
                    if p.step == "fetch" and p.status == J.STARTED and watching is None and "model" in job.data:
                        watching = await watch_any_version(store, str(job.data["model"]), bars)
                    elif p.step == "fetch" and watching is not None:
                        for file in list(bars.files):
                            bars.finish(file)
                        await watching.unsubscribe()
                        watching = None
                done = _show(job_id, p)
                if done is not None:
                    return done
    finally:
        if watching is not None:
            with contextlib.suppress(Exception):
                await watching.unsubscribe()
    return 1


def _show(job_id: str, p: object) -> int | None:
    """Print one of the job's events; its exit code once it has finished."""
    if isinstance(p, J.JobStarted):
        click.echo(f"job {job_id}: serve {p.repo} (asked by {p.requested_by})")
    elif isinstance(p, J.JobStep):
        click.echo(step_line(p), err=p.status == J.FAILED)
    elif isinstance(p, J.JobFinished):
        if p.ok:
            click.echo(f"done: {p.summary}")
            return 0
        click.echo(f"error: {p.summary}", err=True)
        return 1
    return None


async def watch_any_version(store: EventStore, model: str, bars: Downloads) -> Any:
    """The mirror's progress for ``model`` (whatever version the job's fetch resolved to) into ``bars``."""
    decoder = msgspec.json.Decoder(E.DownloadProgress)

    async def on_msg(msg: Any) -> None:
        with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError):
            p = decoder.decode(msg.data)
            bars.update(p.file, p.done, p.size, p.at)

    return await store.nc.subscribe(E.progress_subject(model), cb=on_msg)


@model.command("serve")
@click.argument("repo")
@click.option("--quant", help="The quant to serve, e.g. Q4_K_M (default: Q4_K_M, then others in turn).")
@click.option("--file", "file", help="The GGUF file to serve (a shard names its whole set).")
@click.option("--name", help="The model's name in the catalog (default: from the repository and quant).")
@click.option("--on-demand", is_flag=True, help="Run no replica until the first request (min 0).")
@click.option("--ctx-pool", type=int, default=16384, show_default=True, help="Context tokens one replica holds.")
@click.option("--cores", type=int, help="Cores one replica reserves.")
@click.option("--detach", is_flag=True, help="Print the job id and return; follow it with `ctl job ID`.")
@click.pass_context
def model_serve(
    ctx: click.Context,
    repo: str,
    quant: str | None,
    file: str | None,
    name: str | None,
    on_demand: bool,
    ctx_pool: int,
    cores: int | None,
    detach: bool,
) -> None:
    """Serve a model from the hub in one command: pick, fetch, check, size, add, wait, smoke-test."""

    async def go(s: Session) -> int:
        cmd = J.ServeModel(
            repo=repo, quant=quant, file=file, name=name, on_demand=on_demand, ctx_pool=ctx_pool, cores=cores
        )
        out = await s.command(J.SERVICE, "serve", cmd, timeout=30)
        job_id = out.result["job"]
        click.echo(f"job {job_id}")
        if detach:
            click.echo(f"follow it with `llmgw ctl job {job_id}`")
            return 0
        return await follow_job(await s.store(), job_id)

    run(ctx, go)


@ctl.command("job")
@click.argument("job_id")
@click.pass_context
def job(ctx: click.Context, job_id: str) -> None:
    """Watch a job: the steps done so far, then each as it happens, until it finishes."""

    async def go(s: Session) -> int:
        return await follow_job(await s.store(), job_id)

    run(ctx, go)
