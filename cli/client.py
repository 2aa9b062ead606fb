"""The CLI's two ways in: the bus (commands, the log) and the admin API (read models).

Errors follow one small hierarchy (:mod:`llmgw.events.commands`): rejected, timed out,
unreachable; each becomes one line on stderr and its own exit code.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import click
import msgspec

from llmgw.cli.context import Target, cli_actor, resolve
from llmgw.events.catalog import default_registry
from llmgw.events.commands import CommandClient, CommandError, Unreachable
from llmgw.events.outcomes import CommandCompleted
from llmgw.events.store import EventStore, StoreError


class Session:
    """One CLI invocation's connections, opened lazily."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self._store: EventStore | None = None
        self._http: aiohttp.ClientSession | None = None

    async def store(self) -> EventStore:
        if self._store is None:
            try:
                self._store = await EventStore.connect(self.target.nats_url, default_registry())
            except StoreError as exc:
                raise Unreachable(str(exc)) from exc
        return self._store

    async def command(
        self, service: str, verb: str, payload: msgspec.Struct, timeout: float = 15.0
    ) -> CommandCompleted:
        client = CommandClient(await self.store())
        return await client.send(service, verb, payload, actor=cli_actor(), timeout=timeout)

    async def api(
        self, method: str, path: str, *, params: dict[str, Any] | None = None, json: Any = None, timeout: float = 120.0
    ) -> Any:
        if not self.target.api_url:
            raise Unreachable("no admin API address: pass --api URL (or LLMGW_API_URL), or run `llmgw up`")
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout))
        url = self.target.api_url.rstrip("/") + path
        try:
            async with self._http.request(method, url, params=params, json=json) as resp:
                body = await resp.json(content_type=None)
                if resp.status >= 400:
                    message = (body or {}).get("error", {}).get("message") if isinstance(body, dict) else None
                    raise CommandError(message or f"{method} {path} answered {resp.status}")
                return body
        except aiohttp.ClientConnectionError as exc:
            raise Unreachable(
                f"the admin API at {self.target.api_url} did not answer ({exc}); is `llmgw up` running?"
            ) from exc
        except TimeoutError as exc:
            raise Unreachable(f"the admin API at {self.target.api_url} did not answer within {timeout:.0f}s") from exc

    async def close(self) -> None:
        if self._store is not None:
            await self._store.close()
        if self._http is not None:
            await self._http.close()


def run(ctx: click.Context, fn: Callable[[Session], Awaitable[int | None]]) -> None:
    """Run one async CLI action; a :class:`CommandError` is one line on stderr and its exit code."""
    opts = ctx.find_root().obj or {}

    async def main() -> int:
        try:
            target = resolve(opts.get("nats"), opts.get("api"), opts.get("data_dir"))
        except CommandError as exc:
            click.echo(f"error: {exc}", err=True)
            return exc.exit_code
        session = Session(target)
        try:
            return (await fn(session)) or 0
        except CommandError as exc:
            click.echo(f"error: {exc}", err=True)
            return exc.exit_code
        finally:
            await session.close()

    code = asyncio.run(main())
    sys.exit(code)
