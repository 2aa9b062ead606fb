"""A person the tests act as on the admin API: user ``tester``, cluster admin, and a personal token.

The admin API answers no call under ``/api/v1`` without a token, so every harness that runs it
makes one here. The password hash is made once per test process (argon2id costs about a second).
"""

from __future__ import annotations

import functools
import os

import aiohttp

from llmgw.events.commands.client import CommandClient
from llmgw.events.commands.errors import CommandRejectedError
from llmgw.events.runtime.store import EventStore, NewEvent
from llmgw.events.schema import people as P
from llmgw.events.schema.subjects import event_subject
from llmgw.services.people.passwords import hash_password
from tests.support import wait_until

TESTER = "tester"
PASSWORD = "the tester's long password"


@functools.cache
def tester_hash() -> str:
    return hash_password(PASSWORD)


async def sign_in_tester(store: EventStore, admin_url: str) -> str:
    """A new personal token for ``tester`` (added the first time), once the admin API at ``admin_url``
    knows it. Needs the people service running on the bus."""
    client = CommandClient.for_service(store, "tests")
    try:
        add = P.AddUser(name=TESTER, password_hash=tester_hash())
        await client.send(P.SERVICE, "user.add", add, actor="user:test", timeout=20)
    except CommandRejectedError as exc:
        if exc.code != "exists":
            raise
    grant = P.GrantRole(name=TESTER, role="cluster-admin", scope="cluster")
    await client.send(P.SERVICE, "role.grant", grant, actor="user:test", timeout=20)
    token, issue = P.issue(TESTER, "personal", label="tests")
    await client.send(P.SERVICE, "token.issue", issue, actor="user:test", timeout=20)

    async def known() -> bool:
        async with (
            aiohttp.ClientSession() as s,
            s.get(f"{admin_url}/api/v1/whoami", headers={"Authorization": f"Bearer {token}"}) as r,
        ):
            return r.status == 200

    await wait_until(known, what="the admin API to know the tester's token")
    return token


def headers(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def cli_env(token: str, **more: str) -> dict[str, str]:
    """The environment a CLI subprocess signs in with (``LLMGW_TOKEN``), plus ``more``."""
    return {**os.environ, "LLMGW_TOKEN": token, **more}


async def person_on_log(store: EventStore, name: str = "operator", role: str = "cluster-admin") -> str:
    """A person with ``role`` over the cluster and a personal token, written straight to the log as the
    people service writes them (for tests whose process runs no people service); returns the token, which
    the CLI signs commands with (``LLMGW_TOKEN``)."""
    token, issue = P.issue(name, "personal", label="tests")
    subject = event_subject(P.AGGREGATE, name)
    payloads = [
        P.UserAdded(name=name),
        P.RoleGranted(name=name, role=role, scope="cluster"),
        P.TokenIssued(
            name=name,
            token_id=f"t-{issue.prefix}",
            prefix=issue.prefix,
            secret_sha256=issue.secret_sha256,
            kind="personal",
            label=issue.label,
            signing_key=issue.signing_key,
        ),
    ]
    await store.append(subject, [NewEvent(payload=p, actor="system:tests") for p in payloads])
    return token
