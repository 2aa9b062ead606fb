"""A console page: what it shows (``gather``), what it can do (``actions``), and the context both get.

A page is plain data (:class:`Page`); the core (services/console/app.py) routes it, signs the person in,
checks CSRF, chooses the moment and the language, renders its template and answers its actions. A page's
``gather`` reads through ``ctx.source`` (now, or the moment of the time slider) and returns its template's
variables; an action sends one command through ``ctx.act`` and returns its outcome, so the console acts
only through the commands the CLI and the management API send.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from llmgw.events.commands import roles as R
from llmgw.services.api.act import Outcome, act, command_id_for
from llmgw.services.api.signin import Identity
from llmgw.services.console.source import Source

IDEMPOTENCY = web.RequestKey("console_idem", str)  # the form's ``idem`` field, the command's Idempotency-Key

if TYPE_CHECKING:
    from llmgw.services.api.app import AdminApi
    from llmgw.services.console.i18n import Formats

Gather = Callable[["Ctx"], Awaitable[dict[str, Any]]]
Action = Callable[["Ctx", Mapping[str, str]], Awaitable[Outcome]]


@dataclass(frozen=True)
class Page:
    path: str  # the route: "/console/nodes", "/console/nodes/{id}"
    name: str  # unique; names the page's actions: POST /console/act/{name}/{action}
    title: str  # a message key
    template: str
    gather: Gather
    actions: Mapping[str, Action] = field(default_factory=dict)
    live: tuple[str, ...] = ()  # aggregates whose events refresh the page; () = every event
    nav: bool = True
    # Who may look: "cluster" pages (the fleet, the log) need a viewer of the cluster; "tenant" pages are
    # open to anyone signed in and show only the tenants the person holds a role in.
    scope: str = "cluster"


@dataclass
class Ctx:
    """What a page's gather and actions get: who, in which language, at which moment, and how to act."""

    request: web.Request
    api: AdminApi
    who: Identity
    token: str  # the session's token: the person's own signature on every command the page sends
    lang: str
    t: Callable[..., str]
    fmt: Formats
    csrf: str
    source: Source
    now: Source
    params: Mapping[str, str] = field(default_factory=dict)
    page: Page | None = None

    @property
    def at(self) -> datetime | None:
        return self.source.at

    @property
    def query(self) -> Mapping[str, str]:
        return self.request.query

    def can(self, role: str, kind: str = R.CLUSTER, tenant: str = "") -> bool:
        """Whether the person holds ``role`` over the tenant ``kind:tenant`` (path or id), or the cluster."""
        signin = self.api.signin
        if signin is None:
            return False
        person = signin.people.by_name.get(self.who.name)
        if person is None:
            return False
        chain, _ = signin.chain(kind, tenant) if kind != R.CLUSTER else ([R.CLUSTER], R.CLUSTER)
        return R.allows(person.roles, role, chain)

    def may(self, need: R.Need | None) -> bool:
        """Whether a command with this need would be allowed (None: anyone may): to show its control or not."""
        return need is None or self.can(need.role, need.kind, need.tenant)

    async def act(self, service: str, verb: str, payload: msgspec.Struct) -> Outcome:
        """Send one command as the signed-in person; the form's ``idem`` field is its Idempotency-Key."""
        idem = self.request.get(IDEMPOTENCY)
        command_id = command_id_for(self.who.name, idem) if idem else None
        return await act(self.api.store, self.token, service, verb, payload, command_id=command_id)
