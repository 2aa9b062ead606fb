"""The login throttle: per address, bounded in size, and it never forgets an address that is blocked.

Each address may fail ``failures`` logins within ``window_s``; past that it is refused for
``block_s`` (doubling with each further block, to ``max_block_s``). The table holds at most
``capacity`` addresses. When it is full, entries whose window has passed and that are not blocked
are dropped; if every entry is still live, a login from an address not in the table is refused
("too many addresses are failing to sign in") rather than evicting one that is: an attacker with
many addresses must not be able to wash a blocked one out of the table.
"""

from __future__ import annotations

import msgspec


class Entry(msgspec.Struct, kw_only=True):
    failures: int = 0
    window_start: float = 0.0
    blocked_until: float = 0.0
    blocks: int = 0  # how many times it was blocked: each block lasts twice the one before


class Verdict(msgspec.Struct, frozen=True, kw_only=True):
    allowed: bool
    retry_after_s: int = 0
    reason: str = ""


class LoginThrottle:
    def __init__(
        self,
        *,
        failures: int = 5,
        window_s: float = 300.0,
        block_s: float = 60.0,
        max_block_s: float = 3600.0,
        capacity: int = 10_000,
    ) -> None:
        self.failures = failures
        self.window_s = window_s
        self.block_s = block_s
        self.max_block_s = max_block_s
        self.capacity = capacity
        self.entries: dict[str, Entry] = {}
        self.in_flight: dict[str, int] = {}  # address -> its logins being checked now (only while they are)

    def check(self, address: str, now: float) -> Verdict:
        """May a login from ``address`` be tried now?"""
        e = self.entries.get(address)
        if e is not None:
            if e.blocked_until > now:
                wait = int(e.blocked_until - now) + 1
                return Verdict(
                    allowed=False,
                    retry_after_s=wait,
                    reason=f"too many failed logins from {address}: try again in {wait} s",
                )
            return Verdict(allowed=True)
        if len(self.entries) >= self.capacity:
            self._drop_stale(now)
            if len(self.entries) >= self.capacity:
                return Verdict(
                    allowed=False,
                    retry_after_s=int(self.window_s),
                    reason="too many addresses are failing to sign in at once: try again later",
                )
        return Verdict(allowed=True)

    def begin(self, address: str, now: float) -> Verdict:
        """:meth:`check`, and if allowed, count the login as in flight until :meth:`end`.

        Logins still being checked count toward the limit as if they will fail: without that, an
        address sending 100 at once had all 100 checked before the first failure was counted."""
        verdict = self.check(address, now)
        if not verdict.allowed:
            return verdict
        e = self.entries.get(address)
        recent = e.failures if e is not None and now - e.window_start <= self.window_s else 0
        pending = self.in_flight.get(address, 0)
        if recent + pending >= self.failures:
            return Verdict(
                allowed=False,
                retry_after_s=1,
                reason=f"{pending} logins from {address} are being checked already: wait for them to finish",
            )
        self.in_flight[address] = pending + 1
        return verdict

    def end(self, address: str) -> None:
        """A login :meth:`begin` let through is done (whatever its outcome)."""
        left = self.in_flight.get(address, 0) - 1
        if left > 0:
            self.in_flight[address] = left
        else:
            self.in_flight.pop(address, None)

    def failed(self, address: str, now: float) -> None:
        e = self.entries.get(address)
        if e is None:
            if len(self.entries) >= self.capacity:
                self._drop_stale(now)
                if len(self.entries) >= self.capacity:
                    return  # check() refuses such an address: nothing was tried
            e = self.entries[address] = Entry(window_start=now)
        if now - e.window_start > self.window_s:
            e.failures, e.window_start = 0, now
        e.failures += 1
        if e.failures >= self.failures:
            e.blocked_until = now + min(self.block_s * 2**e.blocks, self.max_block_s)
            e.blocks += 1
            e.failures, e.window_start = 0, now

    def succeeded(self, address: str) -> None:
        self.entries.pop(address, None)

    def _live(self, e: Entry, now: float) -> bool:
        return e.blocked_until > now or now - e.window_start <= self.window_s

    def _drop_stale(self, now: float) -> None:
        for address in [a for a, e in self.entries.items() if not self._live(e, now)]:
            del self.entries[address]
