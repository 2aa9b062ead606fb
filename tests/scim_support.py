"""What the SCIM tests share: the services a fleet runs for /scim/v2, and a SCIM token made as the CLI makes it."""

from __future__ import annotations

import aiohttp

from llmgw.events.schema import identity as I
from tests.fleet import Fleet
from tests.support import wait_until

SERVICES = ("people", "identity", "projections", "api")


async def scim_token(fleet: Fleet, label: str = "tests") -> str:
    """A new SCIM bearer token (issued by the identity service, actor the tests' cluster admin), once the
    endpoint takes it."""
    token, prefix, sha256 = I.make_scim_token()
    issue = I.IssueScimToken(prefix=prefix, secret_sha256=sha256, label=label)
    await fleet.client.send(I.SERVICE, "scim.token-issue", issue, actor="user:tester", timeout=20)

    async def taken() -> bool:
        async with (
            aiohttp.ClientSession() as s,
            s.get(f"{fleet.admin_url}/scim/v2/ServiceProviderConfig", headers=bearer(token)) as r,
        ):
            return r.status == 200

    await wait_until(taken, what="the SCIM endpoint to know its new token")
    return token


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}
