"""Budgets (SPEC GW-5): reserve a request's maximum cost before it runs, settle on completion.

The book lives in a JetStream KV bucket (``llmgw_budgets``), one entry per scope and period, updated
by compare-and-set; so any number of routers share it and concurrent or streaming requests cannot
take a scope past its budget: a request is admitted only if what is spent plus what is held by
requests still running plus its own maximum fits. A hold whose router died expires after
``hold_ttl_s`` so a crash cannot freeze a budget.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import msgspec
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType

from llmgw.events.runtime.buckets import open_bucket

BUCKET = "llmgw_budgets"


class Entry(msgspec.Struct, kw_only=True):
    spent: float = 0.0
    holds: dict[str, tuple[float, float]] = {}  # request id -> (usd, expires epoch)


class BudgetExceeded(Exception):
    def __init__(self, scope: str, budget: float, period: str, spent: float, held: float, need: float) -> None:
        self.scope = scope
        self.period = period
        self.budget, self.spent, self.held, self.need = budget, spent, held, need
        # Only running requests' holds stand in the way: they settle (usually for less) within seconds.
        self.held_only = spent + need <= budget
        super().__init__(self.describe(scope))

    def describe(self, label: str) -> str:
        """The refusal, naming the scope as ``label`` (``project:acme/ml/chat`` rather than its id)."""
        return (
            f"{label} has spent ${self.spent:.4f} of its ${self.budget:.2f} {self.period} budget (${self.held:.4f} "
            f"held by running requests); this request may cost up to ${self.need:.4f}: lower max_tokens, raise the "
            "budget, or wait for the next period"
        )


def seconds_to_period_end(period: str, now: float) -> int:
    """Whole seconds from ``now`` until the budget ``period`` (UTC day or month) ends: at least 1."""
    t = datetime.fromtimestamp(now, UTC)
    start = t.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "day":
        end = start + timedelta(days=1)
    else:
        first = start.replace(day=1)
        end = first.replace(year=first.year + 1, month=1) if first.month == 12 else first.replace(month=first.month + 1)
    return max(1, math.ceil((end - t).total_seconds()))


def period_key(period: str, now: float) -> str:
    t = datetime.fromtimestamp(now, UTC)
    return t.strftime("%Y-%m-%d") if period == "day" else t.strftime("%Y-%m")


def max_cost(tokens_in: int, max_tokens: int, input_per_m: float, output_per_m: float) -> float:
    return (tokens_in * input_per_m + max_tokens * output_per_m) / 1e6


def cost(tokens_in: int, tokens_out: int, input_per_m: float, output_per_m: float) -> float:
    return (tokens_in * input_per_m + tokens_out * output_per_m) / 1e6


def _kv_key(scope: str, when: str) -> str:
    """The book's entry for a scope in one period (``when``: a ``period_key``)."""
    return f"{scope.replace(':', '_')}.{when}"


class BudgetBook:
    def __init__(self, js: JetStreamContext, hold_ttl_s: float = 900.0, clock: Callable[[], float] = time.time) -> None:
        self.js = js
        self.clock = clock
        self.hold_ttl_s = hold_ttl_s
        self._kv = None

    async def _bucket(self):
        if self._kv is None:
            self._kv = await open_bucket(self.js, KeyValueConfig(bucket=BUCKET, history=1, storage=StorageType.FILE))
        return self._kv

    async def _update(self, key: str, change) -> Entry:
        kv = await self._bucket()
        for _ in range(50):
            try:
                got = await kv.get(key)
                entry, rev = msgspec.json.decode(got.value or b"{}", type=Entry), got.revision
            except nats.js.errors.KeyNotFoundError:
                entry, rev = Entry(), None
            now = self.clock()
            entry.holds = {rid: h for rid, h in entry.holds.items() if h[1] > now}
            change(entry)
            data = msgspec.json.encode(entry)
            try:
                if rev is None:
                    await kv.create(key, data)
                else:
                    await kv.update(key, data, last=rev)
                return entry
            except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.APIError):
                continue  # another router changed it: read again
        raise RuntimeError(f"budget entry {key} kept changing; try again")

    async def reserve(self, scope: str, budget: float, period: str, request_id: str, amount: float) -> str:
        """Hold ``amount`` for a request; returns the period it was held in, which its settle names."""
        now = self.clock()
        when = period_key(period, now)

        def change(e: Entry) -> None:
            held = sum(h[0] for h in e.holds.values())
            if e.spent + held + amount > budget + 1e-12:
                raise BudgetExceeded(scope, budget, period, e.spent, held, amount)
            e.holds[request_id] = (amount, now + self.hold_ttl_s)

        await self._update(_kv_key(scope, when), change)
        return when

    async def settle(self, scope: str, when: str, request_id: str, actual: float) -> None:
        """Release a request's hold and count what it cost, in the period the hold was taken in
        (``when``, from ``reserve``): a request that ends after midnight is still the day it began."""

        def change(e: Entry) -> None:
            e.holds.pop(request_id, None)
            e.spent += actual

        await self._update(_kv_key(scope, when), change)

    async def spent(self, scope: str, period: str) -> float:
        kv = await self._bucket()
        try:
            got = await kv.get(_kv_key(scope, period_key(period, self.clock())))
        except nats.js.errors.KeyNotFoundError:
            return 0.0
        return msgspec.json.decode(got.value or b"{}", type=Entry).spent
