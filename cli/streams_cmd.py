"""`llmgw streams …`: llmgw's JetStream streams and key-value buckets, and their replicas."""

from __future__ import annotations

import click

from llmgw.cli.client import Session, run
from llmgw.events.commands.errors import CommandError
from llmgw.events.runtime.connection import StoreError


@click.group()
def streams() -> None:
    """llmgw's JetStream streams and key-value buckets."""


@streams.command("replicas")
@click.argument("count", type=click.IntRange(min=1), required=False)
@click.pass_context
def streams_replicas(ctx: click.Context, count: int | None) -> None:
    """Show each stream's and bucket's replicas; with COUNT, change them all to COUNT.

    The only way replicas change: servers and agents create what is missing and never rescale.
    JetStream copies the data to the new replicas itself; it refuses more replicas than nodes.
    """

    async def act(session: Session) -> int:
        store = await session.store()
        try:
            if count is not None:
                for name, before, after in await store.set_replicas(count):
                    click.echo(f"{name}: {before} -> {after} replicas")
            rows = await store.replica_counts()
        except StoreError as exc:
            raise CommandError(str(exc)) from exc
        for name, n in rows:
            click.echo(f"{name:<24} {n}")
        return 0

    run(ctx, act)
