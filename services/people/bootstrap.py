"""The first administrator, made by the first `llmgw up`: user ``admin``, cluster admin, with a password written once
to ``DATA_DIR/admin-password`` and a personal access token in ``DATA_DIR/admin-token`` (both 0600,
never logged). The CLI on the machine running `llmgw up` signs in with that token, so the README's
commands need no login; a person elsewhere signs in with `llmgw login`.

As for the demo key, the secrets are written to ``.pending`` files before the commands are sent and
renamed once the people service has recorded them: a crash in between is finished by the next
start with the same password and token, never a second pair.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import structlog

from llmgw.events.commands.client import CommandClient
from llmgw.events.commands.errors import CommandRejectedError
from llmgw.events.folds.people import People
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import people as P
from llmgw.events.schema.subjects import event_subject
from llmgw.infra.private import write_private
from llmgw.services.people.passwords import hash_password

log = structlog.get_logger("llmgw.services.people.bootstrap")

ADMIN = "admin"
PASSWORD_FILE = "admin-password"
TOKEN_FILE = "admin-token"
ACTOR = "system:bootstrap"


def _pending(path: Path, make: str) -> tuple[str, bool]:
    """The secret in ``path`` and True (kept from an interrupted start), else ``make`` written there (0600)."""
    try:
        kept = path.read_text().strip()
    except FileNotFoundError:
        kept = ""
    if kept:
        return kept, True
    write_private(path, make + "\n")
    return make, False


async def ensure_admin(store: EventStore, data_dir: Path, *, timeout: float = 15.0) -> bool:
    """Make the first administrator if ``DATA_DIR/admin-token`` is not there yet; True when made now.

    Needs the people service running. Raises :class:`~llmgw.events.commands.errors.CommandError` when it
    refuses or does not answer.
    """
    token_file, password_file = data_dir / TOKEN_FILE, data_dir / PASSWORD_FILE
    client = CommandClient.for_service(store, "bootstrap")
    if token_file.exists():
        await _renew_unsigned(store, client, token_file, timeout)
        return False
    # `--first-admin-dir` names a directory that need not exist yet (a fresh machine's /etc/llmgw/admin).
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    pending_password = data_dir / f"{PASSWORD_FILE}.pending"
    password, kept = _pending(pending_password, secrets.token_urlsafe(18))
    ours = True  # whether the admin's password is the one in this directory
    try:
        add = P.AddUser(name=ADMIN, password_hash=hash_password(password), display_name="first administrator")
        await client.send(P.SERVICE, "user.add", add, actor=ACTOR, timeout=timeout)
    except CommandRejectedError as exc:
        if exc.code != "exists":
            raise
        # Made before an interrupted start (the kept password is theirs), or long before, elsewhere.
        ours = kept
    grant = P.GrantRole(name=ADMIN, role="cluster-admin", scope="cluster")
    await client.send(P.SERVICE, "role.grant", grant, actor=ACTOR, timeout=timeout)  # "already" when it is
    kept_token, _ = _pending(data_dir / f"{TOKEN_FILE}.pending", P.make_token("personal")[0])
    _, issue = P.issue(ADMIN, "personal", label="this machine's CLI", token=kept_token)
    try:
        await client.send(P.SERVICE, "token.issue", issue, actor=ACTOR, timeout=timeout)
    except CommandRejectedError as exc:
        if exc.code != "taken":  # issued before an interrupted start
            raise
    if ours:
        pending_password.replace(password_file)
    else:
        pending_password.unlink()
        log.warning("user admin existed already: its password is not in this directory", data_dir=str(data_dir))
    (data_dir / f"{TOKEN_FILE}.pending").replace(token_file)
    log.info("first administrator made", user=ADMIN, password_file=str(password_file), token_file=str(token_file))
    return True


async def _renew_unsigned(store: EventStore, client: CommandClient, token_file: Path, timeout: float) -> None:
    """Replace this machine's admin token when it was issued before commands were signed (it has no signing
    key, so the CLI's commands would be refused): a new token in the file, the old one revoked."""
    old = token_file.read_text().strip()
    prefix = P.token_prefix(old)
    people = People()
    for event in await store.read(event_subject(P.AGGREGATE, ADMIN)):
        people.apply(event)
    found = people.by_prefix.get(prefix or "")
    admin = people.by_name.get(ADMIN)
    held = admin.tokens.get(found[1]) if admin and found else None
    if held is None or held.signing_key:
        return  # current, or not the admin's any more (revoked: a person decided that)
    token, issue = P.issue(ADMIN, "personal", label="this machine's CLI")
    write_private(token_file.with_suffix(".pending"), token + "\n")
    await client.send(P.SERVICE, "token.issue", issue, actor=ACTOR, timeout=timeout)
    token_file.with_suffix(".pending").replace(token_file)
    revoke = P.RevokeToken(name=ADMIN, token=held.token_id, reason="replaced by a token that signs commands")
    await client.send(P.SERVICE, "token.revoke", revoke, actor=ACTOR, timeout=timeout)
    log.info("this machine's admin token was renewed to sign commands", token_file=str(token_file))
