"""Asking a scheduler about one model over the bus (`ctl explain`, `ctl model headroom`, `ctl bench`):
any instance answers; its error becomes the CLI's."""

from __future__ import annotations

import json
from typing import Any

from llmgw.cli.client import Session
from llmgw.events.commands.errors import CommandRejectedError, Unreachable


async def ask_scheduler(s: Session, subject: str, name: str) -> dict[str, Any]:
    """A scheduler's answer about model ``name`` (any instance answers); its error as a CommandError."""
    store = await s.store()
    import nats.errors  # loaded with the store

    try:
        msg = await store.nc.request(subject, name.encode(), timeout=10)
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as exc:
        raise Unreachable("no scheduler answered: is the scheduler service running?") from exc
    body = json.loads(msg.data)
    if body.get("error"):
        raise CommandRejectedError(body["error"], "not_found")
    return body
