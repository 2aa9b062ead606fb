"""The mcp service: owns the ``mcp`` aggregates and handles `llmgw ctl mcp …`.

Its rules are :mod:`.rules` (pure); :class:`~llmgw.events.commands.shell.FoldedService` does the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from llmgw.events.commands.auth import CommandVerifier
from llmgw.events.commands.shell import FoldedService
from llmgw.events.runtime.follower import FollowerRegistry
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import mcp as P
from llmgw.events.schema.envelope import utc_now
from llmgw.services.mcp import rules


class McpService(FoldedService):
    def __init__(
        self,
        store: EventStore,
        *,
        folds: FollowerRegistry | None = None,
        clock: Callable[[], datetime] = utc_now,
        verifier: CommandVerifier | None = None,
    ) -> None:
        super().__init__(
            store,
            service=P.SERVICE,
            what="the MCP servers",
            state=rules.McpState(),
            subjects=rules.SUBJECTS,
            decide=rules.decide,
            payload_type=P.McpCommand,
            need=rules.need,
            folds=folds,
            verifier=verifier,
            clock=clock,
        )
