"""First-run demo access for `llmgw up`: a default org/team/project and a key in DATA_DIR/demo-key.

Everything goes through the bus as commands (actor ``system:bootstrap``), so the tenancy and
access services decide it as they decide anything else, and the log records it. The key is
written to a ``.pending`` file (mode 0600) before it is sent, and renamed to ``demo-key`` once the
access service has recorded it: a crash in between leaves the pending key, which the next start
sends again (the service answers that it exists) instead of making a second one.
"""

from __future__ import annotations

import os
from pathlib import Path

import structlog

from llmgw.events.commands.client import CommandClient
from llmgw.events.commands.errors import CommandRejectedError
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import access as A
from llmgw.events.schema import tenancy as T
from llmgw.infra.private import write_private

log = structlog.get_logger("llmgw.services.access.bootstrap")

DEMO_KEY_FILE = "demo-key"
DEMO_SCOPES = (("org", "default"), ("team", "default/default"), ("project", "default/default/default"))
DEMO_PROJECT = DEMO_SCOPES[-1][1]
DEMO_KEY_NAME = "demo"
ACTOR = "system:bootstrap"


def _pending_key(path: Path) -> str | None:
    try:
        key = path.read_text().strip()
    except FileNotFoundError:
        return None
    return key if A.key_prefix(key) is not None else None


async def ensure_demo_key(store: EventStore, data_dir: Path, *, timeout: float = 15.0) -> Path | None:
    """Create the demo org, team, project and key the first time; the key file's path, or None when it existed.

    Needs the tenancy and access services running (their commands are sent through the bus).
    Raises :class:`~llmgw.events.commands.errors.CommandError` when they refuse or do not answer.
    """
    target = data_dir / DEMO_KEY_FILE
    if target.exists():
        return None
    client = CommandClient.for_service(store, "bootstrap")
    for kind, path in DEMO_SCOPES:
        try:
            await client.send(T.SERVICE, "create", T.CreateScope(kind=kind, path=path), actor=ACTOR, timeout=timeout)
        except CommandRejectedError as exc:
            if exc.code != "exists":
                raise
    pending = data_dir / f"{DEMO_KEY_FILE}.pending"
    key = _pending_key(pending)
    if key is None:
        key, _, _ = A.make_api_key()
        write_private(pending, key + "\n")
    prefix = A.key_prefix(key)
    assert prefix is not None  # made or checked above
    create = A.CreateKey(
        project=DEMO_PROJECT, prefix=prefix, secret_sha256=A.hash_api_key(key), name=DEMO_KEY_NAME, user=None
    )
    try:
        await client.send(A.SERVICE, "key.create", create, actor=ACTOR, timeout=timeout)
    except CommandRejectedError as exc:
        if exc.code != "exists":  # sent before a crash: recorded, only the rename was missing
            raise
    os.chmod(pending, 0o600)
    os.replace(pending, target)
    log.info("demo key written", path=str(target), project=DEMO_PROJECT, prefix=prefix)
    return target
