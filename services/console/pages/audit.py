"""The audit page (issue 24, item 4): the log, newest first, filtered by actor, type, scope (the
aggregate, or one aggregate instance) and time, a page at a time; each event with its data, what
caused it and what it caused, and whether the signature of the command behind it still verifies
(the check `llmgw events verify` makes, for that one command).

The index is the eventlog projection (every event's id, sequence, type, subject, actor, time and
causes); the data is read from the log itself. With the time slider, only events up to the moment.
"""

from __future__ import annotations

import contextlib
from datetime import datetime
from typing import Any

import msgspec

from llmgw.events.commands.audit import CommandAudit
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import outcomes as O
from llmgw.events.schema import people as P
from llmgw.events.schema.envelope import RecordedEvent, utc_now
from llmgw.events.schema.subjects import EVENTS_ROOT, decode_token, event_subject
from llmgw.projections.eventlog import matching
from llmgw.projections.usage import parse_since
from llmgw.services.console.page import Ctx, Page

PER_PAGE = 25
COLUMNS = ("id", "seq", "type", "subject", "actor", "at", "causation", "correlation")
OUTCOME_TYPES = ("command.completed", "command.rejected")


class Verifier:
    """Checks one command's signature at a time, as `llmgw events verify` checks them all: against the
    key its person's token was issued with (kept after a revocation), or a service's key from the
    cluster secret. What it reads (a person's events, the secret) is read once per page."""

    def __init__(self, store: EventStore) -> None:
        self.store = store
        self._people: dict[str, list[RecordedEvent]] = {}
        self._secret: bytes | None = None
        self._done: dict[str, dict[str, Any]] = {}

    async def _secret_bytes(self) -> bytes:
        if self._secret is None:
            self._secret = b""
            with contextlib.suppress(Exception):  # without it a service's signature is reported unchecked
                from llmgw.events.runtime.secrets import signing_secret

                self._secret = await signing_secret(self.store.js)
        return self._secret

    async def check(self, outcome: RecordedEvent) -> dict[str, Any]:
        """``state``: verified | failed | refused (unproven when sent: nothing applied) | not_kept; ``why``."""
        found = self._done.get(outcome.envelope.id)
        if found is not None:
            return found
        p = outcome.payload
        assert isinstance(p, O.CommandCompleted | O.CommandRejected)
        secret = await self._secret_bytes() if p.signer.startswith("svc:") else b""
        audit = CommandAudit(secret=secret)
        person = p.requested_by.removeprefix("user:") if p.requested_by.startswith("user:") else ""
        if person and p.signer.startswith("token:"):
            if person not in self._people:
                self._people[person] = await self.store.read(event_subject(P.AGGREGATE, person))
            for e in self._people[person]:
                audit.apply(e)
        audit.apply(outcome)
        r = audit.result
        if r.failures:
            found = {"state": "failed", "why": r.failures[0].why}
        elif r.checked:
            found = {"state": "verified", "why": ""}
        elif r.refused:
            found = {"state": "refused", "why": ""}
        else:
            found = {"state": "not_kept", "why": ""}
        found |= {"signer": p.signer, "kind": p.kind, "requested_by": p.requested_by}
        self._done[outcome.envelope.id] = found
        return found


def _moment(text: str, now: datetime) -> datetime:
    return parse_since(text, now)


def _rows(found: list[Any]) -> list[dict[str, Any]]:
    return [dict(zip(COLUMNS, r, strict=True)) for r in found]


async def gather(ctx: Ctx) -> dict[str, Any]:
    q = ctx.query
    backend = ctx.api.backend
    actor = q.get("actor", "user:").strip() if "actor" in q else "user:"
    etype = (q.get("type") or "").strip()
    scope = (q.get("scope") or "").strip()
    since_text, until_text = (q.get("since") or "").strip(), (q.get("until") or "").strip()
    problems: list[str] = []
    where: list[str] = []
    args: list[Any] = []
    for column, value, marks in (("actor", actor, ":"), ("type", etype, ".")):
        if value:  # a kind of actor (user:, svc:) or a family of types (key., user.), else one
            clause, bounds = matching(column, value, marks)
            where.append(clause)
            args += bounds
    if scope:
        aggregate, dot, instance = scope.partition(".")
        if dot and instance:
            with contextlib.suppress(ValueError):  # a link's id comes encoded, as in the subject
                instance = decode_token(instance)
            where.append("subject = ?")
            args.append(event_subject(aggregate, instance))
        else:
            prefix = f"{EVENTS_ROOT}.{aggregate}."
            where.append("substr(subject, 1, ?) = ?")  # a family of aggregates: see matching()
            args += [len(prefix), prefix]
    now = ctx.at or utc_now()
    for name, text, op in (("since", since_text, ">="), ("until", until_text, "<=")):
        if text:
            try:
                where.append(f"at {op} ?")
                args.append(_moment(text, now).isoformat())
            except (ValueError, OverflowError):  # not a time, or one before the calendar starts
                where.pop()
                problems.append(name)
    if ctx.at is not None:
        where.append("seq <= ?")
        args.append(ctx.source.position)
    before = q.get("before", "").strip()
    if before:
        try:
            where.append("seq < ?")
            args.append(int(before))
        except ValueError:
            where.pop()
    await ctx.now.caught_up("eventlog")
    tail = f"WHERE {' AND '.join(where)}" if where else ""
    found = _rows(
        await backend.query(
            "eventlog",
            f"SELECT {', '.join(COLUMNS)} FROM {{events}} {tail} ORDER BY seq DESC LIMIT {PER_PAGE + 1}",
            *args,
        )
    )
    more = len(found) > PER_PAGE
    found = found[:PER_PAGE]
    verifier = Verifier(ctx.api.store)
    bound = ctx.source.position if ctx.at is not None else None
    for row in found:
        await _expand(ctx, row, verifier, bound)
    older = {k: v for k, v in q.items() if k != "before"}
    if more and found:
        older["before"] = str(found[-1]["seq"])
    return {
        "events": found,
        "actor": actor,
        "type": etype,
        "scope": scope,
        "since": since_text,
        "until": until_text,
        "problems": problems,
        "older": older if more else None,
        "newest": bool(before),
        "newest_query": {k: v for k, v in q.items() if k != "before"},
    }


async def _expand(ctx: Ctx, row: dict[str, Any], verifier: Verifier, bound: int | None) -> None:
    """The event's data, its cause and effects, and the command behind it with its signature checked."""
    store, backend = ctx.api.store, ctx.api.backend
    event = await store.get(row["seq"])
    row["data"] = (
        msgspec.json.format(bytes(event.envelope.data), indent=2).decode() if isinstance(event, RecordedEvent) else None
    )
    seq_bound = "" if bound is None else f" AND seq <= {int(bound)}"
    effects = _rows(
        await backend.query(
            "eventlog",
            f"SELECT {', '.join(COLUMNS)} FROM {{events}} WHERE causation = ?{seq_bound} ORDER BY seq LIMIT 50",
            row["id"],
        )
    )
    row["effects"] = effects
    row["cause"] = None
    row["command"] = None
    cause_id = row["causation"]
    command_outcome: dict[str, Any] | None = None
    if row["type"] in OUTCOME_TYPES:
        command_outcome = row
    elif cause_id:
        causes = _rows(
            await backend.query(
                "eventlog", f"SELECT {', '.join(COLUMNS)} FROM {{events}} WHERE id = ?{seq_bound}", cause_id
            )
        )
        row["cause"] = causes[0] if causes else None
        siblings = _rows(
            await backend.query(
                "eventlog",
                f"SELECT {', '.join(COLUMNS)} FROM {{events}} WHERE causation = ? AND type IN (?, ?){seq_bound}",
                cause_id,
                *OUTCOME_TYPES,
            )
        )
        command_outcome = siblings[0] if siblings else None
    if command_outcome is not None:
        got = event if command_outcome is row else await store.get(command_outcome["seq"])
        if isinstance(got, RecordedEvent) and isinstance(got.payload, O.CommandCompleted | O.CommandRejected):
            row["command"] = {"id": command_outcome["causation"], **await verifier.check(got)}


PAGES = [
    Page(
        path="/console/audit",
        name="audit",
        title="audit.nav",
        template="audit.html",
        gather=gather,
        live=(),
    )
]
