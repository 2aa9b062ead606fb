"""`llmgw ctl sso|ldap|scim` and `llmgw login --provider` (SPEC ID-1 to ID-4), end to end: the CLI as a
subprocess, signed with a person's token, against the identity service, the people service and the
admin API on a real nats-server (and, for the directory sign-in, a real OpenLDAP slapd)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import identity as I
from llmgw.events.schema import tenancy as T
from llmgw.events.schema.subjects import event_subject
from tests.fleet import Fleet
from tests.ldapd import harness
from tests.ldapd.harness import GROUPS, PASSWORDS, PEOPLE, READER_DN, READER_PASSWORD, Slapd
from tests.signin import headers, person_on_log
from tests.support import NatsServer, wait_until

pytestmark = [pytest.mark.timeout(180)]

LLMGW = str(Path(sys.executable).parent / "llmgw")
ISSUER = "https://idp.example.org/realms/corp"


@pytest.fixture
async def fleet(store: EventStore, nats: NatsServer, tmp_path: Path) -> AsyncIterator[Fleet]:
    f = await Fleet(store, nats.url, tmp_path).start(services=("tenancy", "people", "identity", "projections", "api"))
    for kind, path in (("org", "acme"), ("team", "acme/ml")):
        await f.command("create", T.CreateScope(kind=kind, path=path), service=T.SERVICE)
    yield f
    await f.stop()


async def llmgw(
    fleet: Fleet, *args: str, token: str | None = None, stdin: str = "", config: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``llmgw ARGS…`` as a person runs it, signed with ``token`` (the tester's by default); in a thread:
    the services answering it run on this test's event loop."""
    env = fleet.cli_env(LLMGW_NATS_URL=fleet.nats_url, LLMGW_API_URL=fleet.admin_url)
    if token is not None:
        env["LLMGW_TOKEN"] = token
    if config is not None:
        env["XDG_CONFIG_HOME"] = str(config)
        env.pop("LLMGW_TOKEN", None)
    return await asyncio.to_thread(
        subprocess.run, [LLMGW, *args], input=stdin, capture_output=True, text=True, env=env, timeout=60
    )


async def shown(fleet: Fleet, *args: str, until: str) -> str:
    """The output of ``llmgw ARGS…`` once it says ``until`` (the admin API folds a change a moment after
    the service applied it)."""

    async def attempt() -> str | None:
        done = await llmgw(fleet, *args)
        assert done.returncode == 0, done.stderr
        return done.stdout if until in done.stdout else None

    return await wait_until(attempt, what=f"`llmgw {' '.join(args)}` to show {until!r}")


async def viewer(fleet: Fleet, name: str = "vic") -> str:
    """A person who may look at the cluster and change nothing: their personal token, known to the API."""
    token = await person_on_log(fleet.store, name, "viewer")

    async def known() -> bool:
        async with (
            aiohttp.ClientSession() as s,
            s.get(f"{fleet.admin_url}/api/v1/identity/providers", headers=headers(token)) as r,
        ):
            return r.status == 200

    await wait_until(known, what=f"the admin API to know {name}'s token and role")
    return token


async def test_an_admin_adds_lists_maps_unmaps_and_removes_an_oidc_provider(fleet: Fleet) -> None:
    added = await llmgw(
        fleet,
        *("ctl", "sso", "add", "corp", "--issuer", ISSUER, "--client-id", "llmgw"),
        *("--client-secret-env", "CORP_OIDC_SECRET", "--scope", "openid", "--scope", "groups"),
        *("--display-name", "Corp SSO"),
    )
    assert added.returncode == 0, added.stderr
    assert f"oidc provider corp ({ISSUER}) added" in added.stdout
    assert "map its groups to roles: `llmgw ctl sso map corp GROUP ...`" in added.stdout

    listed = await shown(fleet, "ctl", "sso", "list", until="corp")
    header, row = listed.splitlines()[:2]
    assert header.split() == ["NAME", "KIND", "BUTTON", "ISSUER", "/", "URL", "SECRET", "FROM", "MAPPINGS"]
    assert row.split() == ["corp", "oidc", "Corp", "SSO", ISSUER, "$CORP_OIDC_SECRET", "0"]
    as_json = json.loads((await llmgw(fleet, "ctl", "sso", "list", "--json")).stdout)
    assert as_json[0]["settings"]["scopes"] == ["openid", "groups"]
    assert as_json[0]["settings"]["client_secret_env"] == "CORP_OIDC_SECRET"

    mapped = await llmgw(
        fleet, "ctl", "sso", "map", "corp", "ml-admins", "--role", "team-admin", "--scope", "team:acme/ml"
    )
    assert mapped.returncode == 0, mapped.stderr
    assert "corp's group ml-admins grants team-admin of team:acme/ml" in mapped.stdout
    mapping_id = mapped.stdout.split("mapping id: ")[1].strip()

    mappings = await shown(fleet, "ctl", "sso", "mappings", "corp", until=mapping_id)
    assert mappings.splitlines()[1].split() == ["corp", mapping_id, "ml-admins", "team-admin", "team:acme/ml"]
    assert (await shown(fleet, "ctl", "sso", "list", until="corp")).splitlines()[1].split()[-1] == "1"

    # The same command changes the provider; the mapping stays.
    changed = await llmgw(fleet, "ctl", "sso", "add", "corp", "--issuer", ISSUER, "--client-id", "llmgw-2")
    assert changed.returncode == 0 and "oidc provider corp" in changed.stdout and "changed" in changed.stdout

    unknown = await llmgw(fleet, "ctl", "sso", "unmap", "corp", "nosuchmapping")
    assert unknown.returncode == 2 and "corp has no group mapping 'nosuchmapping'" in unknown.stderr
    assert mapping_id in unknown.stderr, "the refusal lists the mappings there are"
    unmapped = await llmgw(fleet, "ctl", "sso", "unmap", "corp", mapping_id)
    assert unmapped.returncode == 0 and "no longer grants team-admin of team:acme/ml" in unmapped.stdout
    assert "no group mappings yet" in await shown(fleet, "ctl", "sso", "mappings", "corp", until="no group mappings")

    removed = await llmgw(fleet, "ctl", "sso", "remove", "corp")
    assert removed.returncode == 0 and "identity provider corp removed" in removed.stdout, removed.stderr
    assert "no identity providers yet" in await shown(fleet, "ctl", "sso", "list", until="no identity providers")


async def test_a_secret_given_where_a_variable_name_is_expected_is_refused_and_never_kept(fleet: Fleet) -> None:
    secret = "s3cr3t-Client-Secret/value=="
    refused = await llmgw(
        fleet, "ctl", "sso", "add", "corp", "--issuer", ISSUER, "--client-id", "llmgw", "--client-secret-env", secret
    )
    assert refused.returncode == 2
    assert "is not an environment variable's name: the secret itself is never sent" in refused.stderr
    assert "name the variable that holds it on the server" in refused.stderr

    added = await llmgw(
        fleet, "ctl", "sso", "add", "corp", "--issuer", ISSUER, "--client-id", "llmgw", "--client-secret-env", "CORP"
    )
    assert added.returncode == 0, added.stderr
    listed = await llmgw(fleet, "ctl", "sso", "list", "--json")
    assert secret not in listed.stdout and "$" not in json.loads(listed.stdout)[0]["secret_env"]
    events = await fleet.store.read(event_subject(I.AGGREGATE, "corp"))
    assert [e.type for e in events] == ["idp.set"] and secret not in str(events[0].payload)


async def test_a_directory_is_added_and_plain_ldap_is_refused_unless_asked_for_by_name(fleet: Fleet) -> None:
    base = ("ctl", "ldap", "add", "corp-ad", "--user-base", "ou=people,dc=corp,dc=example")
    plain = await llmgw(fleet, *base, "--url", "ldap://127.0.0.1:389")
    assert plain.returncode == 2 and "plain text: passwords would cross the network readable" in plain.stderr
    assert "--insecure-plain-ldap if you mean it" in plain.stderr

    both = await llmgw(fleet, *base, "--url", "ldaps://dc.corp.example", "--user-dn", "{user}@corp.example")
    assert both.returncode == 2 and "not both" in both.stderr

    added = await llmgw(
        fleet,
        *base,
        *("--url", "ldap://dc.corp.example:389", "--start-tls", "--active-directory"),
        *("--bind-dn", "cn=reader,dc=corp,dc=example", "--bind-password-env", "CORP_AD_READER"),
        *("--display-name", "Corp AD"),
    )
    assert added.returncode == 0 and "ldap provider corp-ad (ldap://dc.corp.example:389) added" in added.stdout

    listed = await shown(fleet, "ctl", "sso", "list", until="corp-ad")
    assert listed.splitlines()[1].split() == [
        *("corp-ad", "ldap", "Corp", "AD", "ldap://dc.corp.example:389", "$CORP_AD_READER", "0")
    ]
    settings = json.loads((await llmgw(fleet, "ctl", "sso", "list", "--json")).stdout)[0]["settings"]
    assert settings["start_tls"] and settings["active_directory"] and not settings["allow_plain"]
    assert (settings["user_filter"], settings["username_attr"]) == ("(sAMAccountName={user})", "sAMAccountName")

    lab = await llmgw(
        fleet, "ctl", "ldap", "add", "lab", "--url", "ldap://127.0.0.1:389", "--insecure-plain-ldap",
        "--user-dn", "uid={user},ou=people,dc=lab",
    )  # fmt: skip
    assert lab.returncode == 0 and "ldap provider lab" in lab.stdout, lab.stderr


async def test_a_viewer_may_list_providers_and_tokens_but_not_change_them(fleet: Fleet) -> None:
    added = await llmgw(fleet, "ctl", "sso", "add", "corp", "--issuer", ISSUER, "--client-id", "llmgw")
    assert added.returncode == 0, added.stderr
    token = await viewer(fleet)

    listed = await llmgw(fleet, "ctl", "sso", "list", token=token)
    assert listed.returncode == 0 and "corp" in listed.stdout, listed.stderr
    assert (await llmgw(fleet, "ctl", "scim", "token", "list", token=token)).returncode == 0

    for args in (
        ("ctl", "sso", "add", "other", "--issuer", ISSUER, "--client-id", "x"),
        ("ctl", "sso", "remove", "corp"),
        ("ctl", "sso", "map", "corp", "everyone", "--role", "viewer", "--scope", "cluster"),
        ("ctl", "scim", "token", "create"),
    ):
        refused = await llmgw(fleet, *args, token=token)
        assert refused.returncode == 2, (args, refused.stdout)
        assert "needs cluster-admin of the cluster; vic holds viewer of the cluster" in refused.stderr, args
        assert "llmgw-scim-" not in refused.stdout
    assert "corp" in await shown(fleet, "ctl", "sso", "list", until="corp")


async def test_a_scim_token_is_printed_once_and_listed_by_its_prefix_only(fleet: Fleet) -> None:
    made = await llmgw(fleet, "ctl", "scim", "token", "create", "--label", "okta")
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip()
    prefix = I.scim_token_prefix(token)
    assert prefix is not None and made.stdout == token + "\n", "only the token on stdout, for a script to take"
    assert f"SCIM token {prefix} issued (okta)" in made.stderr and "shown only this once" in made.stderr
    assert f"{fleet.admin_url}/scim/v2" in made.stderr

    listed = await shown(fleet, "ctl", "scim", "token", "list", until=prefix)
    row = listed.splitlines()[1].split()
    assert row[0] == prefix and row[2] == "okta"
    assert token not in listed and token.split("-", 3)[3] not in listed
    as_json = (await llmgw(fleet, "ctl", "scim", "token", "list", "--json")).stdout
    assert token not in as_json and "sha256" not in as_json

    mapped = await llmgw(fleet, "ctl", "scim", "map", "Engineering", "--role", "viewer", "--scope", "cluster")
    assert mapped.returncode == 0 and "scim's group Engineering grants viewer" in mapped.stdout, mapped.stderr
    assert "Engineering" in await shown(fleet, "ctl", "sso", "mappings", "scim", until="Engineering")

    revoked = await llmgw(fleet, "ctl", "scim", "token", "revoke", prefix)
    assert revoked.returncode == 0 and f"SCIM token {prefix} revoked" in revoked.stdout, revoked.stderr
    assert "no SCIM tokens" in await shown(fleet, "ctl", "scim", "token", "list", until="no SCIM tokens")
    again = await llmgw(fleet, "ctl", "scim", "token", "revoke", prefix)
    assert again.returncode == 2 and f"there is no SCIM token '{prefix}'" in again.stderr


@pytest.fixture
def slapd(tmp_path: Path) -> Iterator[Slapd]:
    why = harness.missing()
    if why:
        pytest.skip(why)
    with harness.running(tmp_path / "slapd") as server:
        yield server


async def test_a_person_signs_in_from_the_cli_with_a_directory_set_up_from_the_cli(
    fleet: Fleet, slapd: Slapd, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLMGW_TEST_LDAP_READER", READER_PASSWORD)  # the server (this process) reads it at sign-in
    added = await llmgw(
        fleet,
        *("ctl", "ldap", "add", "corp", "--url", slapd.ldaps_url, "--ca-file", slapd.ca_file),
        *("--user-base", PEOPLE, "--bind-dn", READER_DN, "--bind-password-env", "LLMGW_TEST_LDAP_READER"),
        *("--group-base", GROUPS, "--display-name", "Example directory"),
    )
    assert added.returncode == 0, added.stderr
    mapped = await llmgw(fleet, "ctl", "sso", "map", "corp", "ml-admins", "--role", "viewer", "--scope", "cluster")
    assert mapped.returncode == 0, mapped.stderr
    config = tmp_path / "config"

    wrong = await llmgw(fleet, "login", "--provider", "nope", "--user", "alice", "--password-stdin", stdin="x\n")
    assert wrong.returncode == 2 and "'nope' is not a directory people sign in to with a password" in wrong.stderr

    async def signed_in() -> subprocess.CompletedProcess[str] | None:
        done = await llmgw(
            fleet,
            *("login", "--provider", "corp", "--user", "alice", "--password-stdin"),
            stdin=PASSWORDS["alice"] + "\n",
            config=config,
        )
        # Until the admin API has folded the directory and its mapping, it does not know them (nothing is kept).
        if done.returncode != 0 and ("not a directory" in done.stderr or "no group mapped" in done.stderr):
            return None
        return done

    done = await wait_until(signed_in, what="alice to sign in through the directory from the CLI")
    assert done.returncode == 0 and "signed in as alice" in done.stdout, done.stderr
    listed = await llmgw(fleet, "ctl", "sso", "list", config=config)
    assert listed.returncode == 0 and "Example directory" in listed.stdout, "alice is a viewer: she may list them"
    people = await llmgw(fleet, "ctl", "user", "list", config=config)
    alice = next(line for line in people.stdout.splitlines() if line.startswith("alice "))
    assert "idp:corp" in alice and "viewer of cluster (corp: ml-admins)" in alice, people.stdout

    # Every sign-in is on the log with how it was made (a local password's would say "password").
    async def sign_ins() -> list[dict] | None:
        done = await llmgw(fleet, "ctl", "audit", "--type", "user.token_issued", "--actor", "user:alice", "--json")
        assert done.returncode == 0, done.stderr
        rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        return rows or None

    rows = await wait_until(sign_ins, what="alice's sign-in to reach the audit")
    assert [row["data"]["method"] for row in rows] == ["ldap:corp"]
    assert "secret_sha256" in rows[0]["data"]  # the whole data in JSON; a line leaves digests out
    line = await llmgw(fleet, "ctl", "audit", "--type", "user.token_issued", "--actor", "user:alice")
    assert "secret_sha256" not in line.stdout and '"prefix"' in line.stdout
