"""Limit gossip (SPEC GW-4): routers share what they admitted, so a limit holds across all of them.

Each router adds up what it admitted per scope and publishes the sums every ``interval_s`` on one
subject; every other router adds them into its own windows. docs/gateway.md works out the overshoot.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import msgspec
import structlog

from llmgw.events.schema import subjects as S
from llmgw.services.router.limits import Level, Limiter

log = structlog.get_logger("llmgw.router")

SUBJECT = f"{S.PREFIX}.gossip.limits"
_dec = msgspec.json.Decoder()
_enc = msgspec.json.Encoder()


class LimitGossip:
    def __init__(self, nc: Any, limiter: Limiter, instance: str, interval_s: float, clock: Callable[[], float]) -> None:
        self.nc = nc
        self.limiter = limiter
        self.instance = instance
        self.interval_s = interval_s
        self.clock = clock
        self._deltas: dict[str, list[int]] = {}  # scope -> [requests, tokens] admitted here since the last send

    def note(self, levels: list[Level], requests: int, tokens: int) -> None:
        """Count what this router admitted (``requests``) or what ran (``tokens``), to send next time."""
        for lv in levels:
            entry = self._deltas.setdefault(lv.scope, [0, 0])
            entry[0] += requests
            entry[1] += tokens

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            if not self._deltas:
                continue
            deltas, self._deltas = self._deltas, {}
            msg = {"from": self.instance, "at": self.clock(), "deltas": deltas}
            with contextlib.suppress(Exception):
                await self.nc.publish(SUBJECT, _enc.encode(msg))

    async def on_message(self, msg: Any) -> None:
        try:
            body = _dec.decode(msg.data)
            if body.get("from") == self.instance:
                return
            at = float(body["at"])
            for scope, (reqs, toks) in body["deltas"].items():
                self.limiter.merge(scope, at, int(reqs), int(toks))
        except (msgspec.DecodeError, KeyError, TypeError, ValueError):
            log.warning("malformed limit gossip ignored")
