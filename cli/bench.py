"""`llmgw bench …`: thin entry points; the benchmarks themselves live in ``llmgw.bench``.

Nothing here measures: each command checks its options, runs the benchmark and prints its report.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import click
import msgspec

from llmgw.bench import BenchError
from llmgw.bench.backbone import BackboneOptions, backbone_text, run_backbone
from llmgw.bench.coldstart import ColdstartOptions, coldstart_json, coldstart_text, run_coldstart
from llmgw.bench.console_pages import LARGE, SMALL, ConsoleOptions, Scale, console_json, console_text, run_console
from llmgw.bench.replay import ReplayOptions, replay_json, replay_text, run_replay
from llmgw.bench.scheduler import SchedulerOptions, run_scheduler, scheduler_json, scheduler_text
from llmgw.bench.signing import run_signing, signing_text
from llmgw.cli import logs
from llmgw.projections.replay_snapshots import EVERY_EVENTS


def progress(line: str) -> None:
    click.echo(f"[bench] {line}", err=True)


@click.group()
def bench() -> None:
    """Benchmarks: figures compared as ratios within one run, never pass/fail."""


@bench.command("backbone")
@click.option("--events", "events", default=20_000, show_default=True, help="Events per throughput figure.")
@click.option(
    "--rebuild-events", default=1_000_000, show_default=True, help="Events in the log for the full-rebuild figure."
)
@click.option(
    "--pg",
    "pg_dsn",
    envvar=["LLMGW_BENCH_POSTGRES_DSN", "LLMGW_TEST_POSTGRES_DSN"],
    help="PostgreSQL admin DSN: a fresh database is created for the run and dropped after. Without: skipped.",
)
@click.option("--repeat", default=3, show_default=True, help="Each throughput figure is the best of this many runs.")
@click.option("--skip-rebuild", is_flag=True, help="Leave out the full-rebuild figure (the slowest).")
@click.option("--dir", "base_dir", help="Where the temporary servers and databases go (default: the system's temp).")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON instead of a table.")
def backbone(
    events: int,
    rebuild_events: int,
    pg_dsn: str | None,
    repeat: int,
    skip_rebuild: bool,
    base_dir: str | None,
    as_json: bool,
) -> None:
    """Append, read and projection throughput, and a full rebuild, next to raw nats-py figures."""
    if events < 1 or rebuild_events < 1 or repeat < 1:
        raise click.BadParameter("event counts and --repeat must be at least 1")
    logs.configure("warning")
    opts = BackboneOptions(
        events=events,
        repeat=repeat,
        rebuild_events=rebuild_events,
        pg_dsn=pg_dsn,
        skip_rebuild=skip_rebuild,
        base_dir=base_dir,
    )
    try:
        report = asyncio.run(run_backbone(opts, progress))
    except BenchError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(json.dumps(report.as_dict(), indent=2) if as_json else backbone_text(report))


@bench.command("scheduler")
@click.option("--nodes", default=1000, show_default=True, help="Nodes in the main simulated cluster.")
@click.option("--models", default=500, show_default=True, help="Models in it.")
@click.option("--replicas", default=5000, show_default=True, help="Replicas placed and ready in it.")
@click.option("--runs", default=50, show_default=True, help="Repetitions per figure (fewer at 5,000 nodes if slow).")
@click.option(
    "--scales",
    default="100,1000,5000",
    show_default=True,
    help="Node counts for the growth figures, models and replicas in the main cluster's ratio; empty for none.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON instead of a table.")
def scheduler(nodes: int, models: int, replicas: int, runs: int, scales: str, as_json: bool) -> None:
    """Reconcile pass and placement times over a simulated cluster, in memory (no NATS)."""
    if min(nodes, models, replicas, runs) < 1:
        raise click.BadParameter("nodes, models, replicas and runs must be at least 1")
    try:
        sizes = tuple(int(s) for s in scales.split(",") if s.strip())
    except ValueError:
        raise click.BadParameter(f"--scales takes node counts separated by commas, not {scales!r}") from None
    opts = SchedulerOptions(nodes=nodes, models=models, replicas=replicas, runs=runs, scales=sizes)
    try:
        results = run_scheduler(opts, progress)
    except BenchError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(json.dumps(scheduler_json(opts, results), indent=2) if as_json else scheduler_text(opts, results))


@bench.command("coldstart")
@click.option(
    "--events",
    default="200000",
    show_default=True,
    help="Events in the log, or several separated by commas (one fresh server each).",
)
@click.option("--dir", "base_dir", help="Where the temporary server goes (default: the system's temp).")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON instead of a table.")
def coldstart(events: str, base_dir: str | None, as_json: bool) -> None:
    """A router's and a scheduler's start on a long log: from 0, and from a snapshot plus its tail."""
    try:
        sizes = tuple(int(s) for s in events.split(",") if s.strip())
    except ValueError:
        raise click.BadParameter(f"--events takes event counts separated by commas, not {events!r}") from None
    if not sizes or min(sizes) < 1:
        raise click.BadParameter("--events must name at least one count of 1 or more")
    logs.configure("warning")
    try:
        results = asyncio.run(run_coldstart(ColdstartOptions(events=sizes, base_dir=base_dir), progress))
    except BenchError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(json.dumps(coldstart_json(results), indent=2) if as_json else coldstart_text(results))


@bench.command("replay")
@click.option(
    "--events",
    default="200000",
    show_default=True,
    help="Events in the log, or several separated by commas (one fresh server each).",
)
@click.option("--every", default=EVERY_EVENTS, show_default=True, help="Events between two replay snapshots.")
@click.option("--dir", "base_dir", help="Where the temporary server goes (default: the system's temp).")
@click.option(
    "--keep",
    type=click.Path(file_okay=False),
    help="Keep each built log (server, snapshots) in this directory, and reuse one built there before.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON instead of a table.")
def replay(events: str, every: int, base_dir: str | None, keep: str | None, as_json: bool) -> None:
    """`events replay --until T` on a long log: from 0, and from the newest replay snapshot plus its tail."""
    try:
        sizes = tuple(int(s) for s in events.split(",") if s.strip())
    except ValueError:
        raise click.BadParameter(f"--events takes event counts separated by commas, not {events!r}") from None
    if not sizes or min(sizes) < 1 or every < 1:
        raise click.BadParameter("--events must name at least one count of 1 or more, and --every be 1 or more")
    logs.configure("warning")
    try:
        results = asyncio.run(
            run_replay(ReplayOptions(events=sizes, every=every, base_dir=base_dir, keep=keep), progress)
        )
    except BenchError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(json.dumps(replay_json(results), indent=2) if as_json else replay_text(results))


@bench.command("signing")
@click.option("--checks", default=20000, show_default=True, help="Signed commands checked for the rate.")
@click.option("--rounds", default=6, show_default=True, help="Alternating rounds of signed and unchecked commands.")
@click.option("--per-round", default=50, show_default=True, help="Commands sent per round.")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON instead of text.")
def signing(checks: int, rounds: int, per_round: int, as_json: bool) -> None:
    """What signed commands cost: checks per second on one core, and a command end to end against unchecked."""
    logs.configure("warning")
    try:
        result = asyncio.run(run_signing(checks, rounds, per_round))
    except BenchError as exc:
        raise click.ClickException(str(exc)) from exc
    if as_json:
        click.echo(json.dumps({**msgspec.to_builtins(result), "ratio": result.ratio}, indent=2))
    else:
        click.echo(signing_text(result))


async def serve_console(
    nats_url: str,
    db_dsn: str,
    admin_port: int,
    stop: asyncio.Event,
    on_ready: Callable[[], None],
    handles: dict[str, Any],
) -> None:
    """The console's services as `llmgw up` runs them (the projections, the admin API, the people), for the
    console bench: composed here, where services meet."""
    from llmgw.cli.runtime import serve
    from llmgw.cli.server_config import ServerConfig

    config = ServerConfig(
        nats_url=nats_url, db_dsn=db_dsn, services=("projections", "api", "people"), admin_port=admin_port
    )
    await serve(config, stop, on_ready=on_ready, handles=handles)


@bench.command("console")
@click.option("--nodes", default=LARGE.nodes, show_default=True, help="Nodes in the large world.")
@click.option("--replicas", default=LARGE.replicas, show_default=True, help="Replicas placed and ready in it.")
@click.option("--keys", default=LARGE.keys, show_default=True, help="API keys in it (one in ten revoked).")
@click.option("--events", default=LARGE.events, show_default=True, help="Events on its log (at least).")
@click.option("--usage", default=LARGE.usage, show_default=True, help="Usage records over its last day.")
@click.option("--runs", default=20, show_default=True, help="Times each page is fetched (after one warm-up).")
@click.option("--dir", "base_dir", help="Where the temporary servers and databases go (default: the system's temp).")
@click.option(
    "--keep",
    type=click.Path(file_okay=False),
    help="Keep each built world (log, read models) in this directory, and reuse one built there before.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON instead of a table.")
def console(
    nodes: int,
    replicas: int,
    keys: int,
    events: int,
    usage: int,
    runs: int,
    base_dir: str | None,
    keep: str | None,
    as_json: bool,
) -> None:
    """Every console page's time on the server at scale, beside the same pages over a small world."""
    if min(nodes, replicas, keys, events, runs) < 1 or usage < 0:
        raise click.BadParameter("nodes, replicas, keys, events and runs must be at least 1, usage at least 0")
    logs.configure("warning")
    large = Scale(nodes=nodes, replicas=replicas, keys=keys, events=events, usage=usage)
    opts = ConsoleOptions(large=large, small=SMALL, runs=runs, base_dir=base_dir, keep=keep)
    try:
        report = asyncio.run(run_console(opts, serve_console, progress))
    except BenchError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(json.dumps(console_json(report), indent=2) if as_json else console_text(report))
