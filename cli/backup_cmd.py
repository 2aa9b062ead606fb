"""`llmgw backup` and `llmgw restore` (SPEC OPS-3): the cluster's streams, buckets and secrets in one archive.

Both connect as the operator (on the `llmgw up` machine its credential is found by itself; elsewhere
``--nats-creds``). A restore with no running `llmgw up` and no ``--nats`` starts a bare nats-server on
the data directory itself, so `llmgw --data-dir NEW restore ARCHIVE` then `llmgw up --data-dir NEW` is
the whole recovery of an embedded install.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
from pathlib import Path

import click
import msgspec

from llmgw.cli.client import Session, run
from llmgw.cli.context import default_data_dir, read_run_info
from llmgw.cli.natsd import EmbeddedNats, NatsStartError, read_credential
from llmgw.events.commands.errors import CommandError, CommandRejectedError
from llmgw.events.runtime.connection import StoreError
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema.catalog import default_registry
from llmgw.infra import backup as B
from llmgw.infra import nats_permissions as NP

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd])\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_every(text: str) -> float:
    """``30m``, ``24h``, ``7d`` in seconds; a click error naming the form otherwise."""
    m = _DURATION.match(text)
    if not m or float(m.group(1)) <= 0:
        raise click.BadParameter(f"{text!r} is no interval: write a number and a unit, such as 90s, 30m, 24h or 7d")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


def _data_dir(ctx: click.Context) -> Path:
    chosen = (ctx.find_root().obj or {}).get("data_dir")
    return Path(chosen).expanduser() if chosen else default_data_dir()


def _said(result: B.BackupResult) -> str:
    m = result.manifest
    messages = sum(s.messages for s in m.streams)
    line = (
        f"backed up {len(m.streams)} streams ({messages:,} messages) and {len(m.files)} files to {result.path} "
        f"({result.size:,} bytes, {result.duration_s:.1f}s)"
    )
    if result.deleted:
        line += f"; deleted the older {', '.join(result.deleted)}"
    return line


@click.command("backup")
@click.option("--to", "to_dir", help="Where archives go (default: DATA_DIR/backups).")
@click.option("--keep", default=14, show_default=True, type=click.IntRange(min=1), help="How many archives are kept.")
@click.option("--every", help="Back up on this schedule (90s, 30m, 24h, 7d) in the foreground until stopped.")
@click.pass_context
def backup(ctx: click.Context, to_dir: str | None, keep: int, every: str | None) -> None:
    """Copy every stream and key-value bucket, the CA and the NATS users into one archive (0600).

    The streams are the server's own snapshots, so a restore has the same sequence numbers, headers and
    timestamps. The newest KEEP archives in the directory are kept, older ones deleted.
    """
    period = parse_every(every) if every else None
    data_dir = _data_dir(ctx)
    target = Path(to_dir).expanduser() if to_dir else data_dir / "backups"

    async def act(session: Session) -> int:
        store = await session.store()
        stop = asyncio.Event()
        if period is not None:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
        while True:
            try:
                result = await B.backup(store.nc, target, data_dir=data_dir if data_dir.is_dir() else None, keep=keep)
                click.echo(_said(result))
            except (B.BackupError, OSError) as exc:
                if period is None:
                    raise CommandError(f"the backup failed: {exc}") from exc
                click.echo(f"error: the backup failed ({exc}); trying again in {every}", err=True)
            if period is None:
                return 0
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), period)
            if stop.is_set():
                return 0

    run(ctx, act)


@click.command("restore")
@click.argument("archive", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--force", is_flag=True, help="Replace the archive's streams even where the cluster already has them.")
@click.option(
    "--replicas",
    type=click.IntRange(min=1),
    help="Recreate the streams with this many replicas (default: as they were backed up).",
)
@click.option("--check", is_flag=True, help="Only check the archive against its manifest and say what it holds.")
@click.pass_context
def restore(ctx: click.Context, archive: Path, force: bool, replicas: int | None, check: bool) -> None:
    """Recreate the streams, buckets and secrets of ARCHIVE in an empty cluster, and its files in DATA_DIR.

    With no running `llmgw up` on DATA_DIR and no --nats, a nats-server is started on DATA_DIR for the
    restore and stopped after it: then start `llmgw up --data-dir DATA_DIR`. Projections are rebuilt
    from the restored log when the services start (`llmgw projections verify` to check).
    """
    try:
        manifest = B.read_manifest(archive)
    except B.BackupError as exc:
        click.echo(f"error: {exc}", err=True)
        raise SystemExit(CommandRejectedError.exit_code) from exc
    click.echo(B.describe(manifest))
    if check:
        click.echo("the archive is whole: every member matches its sha256")
        return
    data_dir = _data_dir(ctx)
    opts = ctx.find_root().obj or {}
    if not opts.get("nats") and read_run_info(data_dir) is None:
        raise SystemExit(_restore_embedded(archive, manifest, data_dir, force, replicas))

    async def act(session: Session) -> int:
        store = await session.store()
        try:
            result = await B.restore(store.nc, archive, force=force, replicas=replicas, manifest=manifest)
        except B.BackupError as exc:
            raise CommandRejectedError(str(exc)) from exc
        # Into a running system its own files stay: the server there runs with its NATS users, and a CA
        # is replaced only on purpose. Missing ones are written (a new machine's DATA_DIR).
        written, kept = B.restore_files(archive, manifest, data_dir, force=False) if data_dir.is_dir() else ([], [])
        _report(msgspec.structs.replace(result, files_written=tuple(written), files_kept=tuple(kept)))
        return 0

    run(ctx, act)


def _restore_embedded(archive: Path, manifest: B.Manifest, data_dir: Path, force: bool, replicas: int | None) -> int:
    """Restore into a nats-server of our own on ``data_dir``: the archive's NATS users are placed first,
    so the server starts with them (agents' credentials keep working)."""
    written, kept = B.restore_files(archive, manifest, data_dir, force)
    # Without a flush per write: a restore stores every message again, and one flush each would make it
    # hours long. The server is stopped cleanly afterwards, which writes everything out; a crash in
    # between means running the restore again.
    server = EmbeddedNats(data_dir, durable=False)
    try:
        server.start()
    except NatsStartError as exc:
        click.echo(f"error: {exc}", err=True)
        return CommandError.exit_code

    async def go() -> int:
        store = await EventStore.connect(
            server.url, default_registry(), creds=read_credential(server.creds(NP.OPERATOR)), give_up_s=10.0
        )
        try:
            result = await B.restore(store.nc, archive, force=force, replicas=replicas, manifest=manifest)
        except (B.BackupError, StoreError) as exc:
            click.echo(f"error: {exc}", err=True)
            return CommandRejectedError.exit_code
        finally:
            await store.close()
        _report(
            B.RestoreResult(
                streams=result.streams,
                replaced=result.replaced,
                files_written=tuple(written),
                files_kept=tuple(kept),
                duration_s=result.duration_s,
            )
        )
        click.echo(f"the store in {data_dir} is restored: start it with `llmgw up --data-dir {data_dir}`")
        return 0

    try:
        return asyncio.run(go())
    finally:
        server.stop()


def _report(result: B.RestoreResult) -> None:
    messages = sum(s.messages for s in result.streams)
    click.echo(f"restored {len(result.streams)} streams ({messages:,} messages) in {result.duration_s:.1f}s")
    if result.replaced:
        click.echo(f"replaced what was there: {', '.join(result.replaced)}")
    if result.files_written:
        click.echo(f"wrote {', '.join(result.files_written)}")
    if result.files_kept:
        click.echo(f"kept the files already there (--force replaces them): {', '.join(result.files_kept)}")
