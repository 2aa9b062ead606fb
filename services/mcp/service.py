"""The mcp service: owns the ``mcp`` aggregates and handles `llmgw ctl mcp …`.

Its rules are :mod:`.rules` (pure); :class:`~llmgw.events.commands.shell.CommandShell` does the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from llmgw.events.commands.auth import CommandVerifier
from llmgw.events.commands.processor import CommandProcessor
from llmgw.events.commands.shell import CommandShell
from llmgw.events.runtime.follower import FollowerRegistry
from llmgw.events.runtime.followers import Followers
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import mcp as P
from llmgw.events.schema.envelope import utc_now
from llmgw.services.mcp import rules


class McpService:
    def __init__(
        self,
        store: EventStore,
        *,
        folds: FollowerRegistry | None = None,
        clock: Callable[[], datetime] = utc_now,
        verifier: CommandVerifier | None = None,
    ) -> None:
        self.store = store
        self.state = rules.McpState()
        self.fold = Followers(store, rules.SUBJECTS, self.state.apply, registry=folds)
        self.shell = CommandShell(
            store,
            service=P.SERVICE,
            what="the MCP servers",
            fold=self.fold,
            state=self.state,
            decide=rules.decide,
            payload_type=P.McpCommand,
            authorize=lambda command, payload: rules.need(payload),
            verifier=verifier,
            clock=clock,
        )

    def start(self) -> None:
        self.fold.start()

    async def close(self) -> None:
        await self.fold.close()

    def processor(self) -> CommandProcessor:
        return self.shell.processor()
