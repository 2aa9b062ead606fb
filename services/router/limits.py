"""Rate limits (SPEC GW-4): requests and tokens per minute per key, project, team and org.

Each scope has its own sliding one-minute window of 60 one-second buckets. Admission checks
every level before the request runs; the ``x-ratelimit-*`` headers come from the level with the
least left after this request. Pure: the clock is passed in.

Several routers share the limits by gossip (:class:`LimitGossip` in the router): each publishes
what it admitted every ``sync_s`` and adds what the others admitted into its own windows. Between
two syncs each other router can admit what it sees as free, so a burst can overshoot a limit by at
most (routers − 1) × (what one router admits in ``sync_s``) — docs/gateway.md works it out.
"""

from __future__ import annotations

import math

import msgspec

WINDOW_S = 60


class Window:
    """Counts in 60 one-second buckets; the sum of the last 60 seconds is the sliding minute."""

    __slots__ = ("counts", "seconds", "total")

    def __init__(self) -> None:
        self.counts = [0] * WINDOW_S
        self.seconds = [0] * WINDOW_S
        self.total = 0

    def _roll(self, now_s: int) -> None:
        # Dropping stale buckets lazily keeps every operation O(1) amortised.
        for i in range(WINDOW_S):
            if self.seconds[i] <= now_s - WINDOW_S and self.counts[i]:
                self.total -= self.counts[i]
                self.counts[i] = 0

    def add(self, now: float, n: int) -> None:
        s = int(now)
        i = s % WINDOW_S
        if self.seconds[i] != s:
            self.total -= self.counts[i]
            self.counts[i] = 0
            self.seconds[i] = s
        self.counts[i] += n
        self.total += n

    def used(self, now: float) -> int:
        self._roll(int(now))
        return self.total

    def reset_in(self, now: float) -> float:
        """Seconds until the oldest counted bucket leaves the window (when capacity frees up)."""
        s = int(now)
        live = [sec for sec, c in zip(self.seconds, self.counts, strict=True) if c and sec > s - WINDOW_S]
        if not live:
            return 0.0
        return max(min(live) + WINDOW_S - now, 0.0)


class Level(msgspec.Struct, frozen=True, kw_only=True):
    scope: str
    rpm: int | None
    tpm: int | None


class Verdict(msgspec.Struct, frozen=True, kw_only=True):
    allowed: bool
    reason: str = ""
    retry_after_s: int = 0
    headers: dict[str, str] = {}


class Limiter:
    def __init__(self) -> None:
        self.requests: dict[str, Window] = {}
        self.tokens: dict[str, Window] = {}

    def _w(self, table: dict[str, Window], scope: str) -> Window:
        w = table.get(scope)
        if w is None:
            w = table[scope] = Window()
        return w

    def check(self, levels: list[Level], now: float, tokens: int) -> Verdict:
        """Admit one request expected to use ``tokens`` at every level, or say which level refuses."""
        best_req: tuple[int, Level, Window] | None = None
        best_tok: tuple[int, Level, Window] | None = None
        for lv in levels:
            if lv.rpm is not None:
                w = self._w(self.requests, lv.scope)
                left = lv.rpm - w.used(now) - 1
                if left < 0:
                    wait = max(1, math.ceil(w.reset_in(now)))
                    return Verdict(
                        allowed=False,
                        retry_after_s=wait,
                        reason=f"{lv.scope} is at its limit of {lv.rpm} requests per minute; retry in {wait}s",
                        headers=_headers(lv.rpm, 0, wait, None),
                    )
                if best_req is None or left < best_req[0]:
                    best_req = (left, lv, w)
            if lv.tpm is not None:
                w = self._w(self.tokens, lv.scope)
                left = lv.tpm - w.used(now) - tokens
                if left < 0 and w.used(now) > 0:
                    wait = max(1, math.ceil(w.reset_in(now)))
                    return Verdict(
                        allowed=False,
                        retry_after_s=wait,
                        reason=f"{lv.scope} is at its limit of {lv.tpm} tokens per minute; retry in {wait}s",
                        headers=_headers(None, None, None, (lv.tpm, 0, wait)),
                    )
                if best_tok is None or left < best_tok[0]:
                    best_tok = (left, lv, w)
        headers: dict[str, str] = {}
        if best_req is not None:
            left, lv, w = best_req
            headers.update(_headers(lv.rpm, left, w.reset_in(now) or WINDOW_S, None))
        if best_tok is not None:
            left, lv, w = best_tok
            headers.update(_headers(None, None, None, (lv.tpm or 0, max(left, 0), w.reset_in(now) or WINDOW_S)))
        return Verdict(allowed=True, headers=headers)

    def admit(self, levels: list[Level], now: float) -> None:
        for lv in levels:
            if lv.rpm is not None:
                self._w(self.requests, lv.scope).add(now, 1)

    def spend_tokens(self, levels: list[Level], now: float, tokens: int) -> None:
        for lv in levels:
            if lv.tpm is not None and tokens:
                self._w(self.tokens, lv.scope).add(now, tokens)

    def merge(self, scope: str, now: float, requests: int, tokens: int) -> None:
        """Add what another router admitted."""
        if requests:
            self._w(self.requests, scope).add(now, requests)
        if tokens:
            self._w(self.tokens, scope).add(now, tokens)


def _headers(
    rpm: int | None, left: int | None, reset: float | None, tok: tuple[int, int, float] | None
) -> dict[str, str]:
    out: dict[str, str] = {}
    if rpm is not None:
        out["x-ratelimit-limit-requests"] = str(rpm)
        out["x-ratelimit-remaining-requests"] = str(max(left or 0, 0))
        out["x-ratelimit-reset-requests"] = f"{reset or 0:.0f}s"
    if tok is not None:
        out["x-ratelimit-limit-tokens"] = str(tok[0])
        out["x-ratelimit-remaining-tokens"] = str(max(tok[1], 0))
        out["x-ratelimit-reset-tokens"] = f"{tok[2]:.0f}s"
    return out
