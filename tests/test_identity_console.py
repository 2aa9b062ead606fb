"""The console's sign-in page (/console/identity) and the login page's ways in (SPEC ID-1 to ID-4), rendered by
the real admin API over a real nats-server, the identity and people services: what it lists, the forms an
admin gets and what they send, what a viewer is refused."""

from __future__ import annotations

import html
import re
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from llmgw.events.schema import identity as I
from llmgw.events.schema import people as P
from llmgw.events.schema import tenancy as T
from llmgw.events.schema.subjects import event_subject
from llmgw.services.api.act import act
from llmgw.services.console import session as SES
from llmgw.services.console.forms import BadInput
from llmgw.services.console.pages.identity import ldap_command, oidc_command
from tests.fleet import Fleet
from tests.signin import PASSWORD, TESTER
from tests.signin import tester_hash as the_password_hash
from tests.support import NatsServer, wait_until

pytestmark = [pytest.mark.timeout(180)]

ISSUER = "https://idp.example.org/realms/corp"


@pytest.fixture
async def console(store, nats: NatsServer, tmp_path: Path) -> AsyncIterator[Fleet]:
    f = await Fleet(store, nats.url, tmp_path).start(services=("tenancy", "people", "identity", "projections", "api"))
    for kind, path in (("org", "acme"), ("team", "acme/ml")):
        await f.command("create", T.CreateScope(kind=kind, path=path), service=T.SERVICE)
    try:
        yield f
    finally:
        await f.stop()


class Browser:
    """One signed-in person's cookie jar against the console, as a browser without scripts uses it."""

    def __init__(self, fleet: Fleet, session: aiohttp.ClientSession) -> None:
        self.fleet = fleet
        self.s = session

    @property
    def csrf(self) -> str:
        token = next(c.value for c in self.s.cookie_jar if c.key == SES.COOKIE)
        return SES.csrf_token(token)

    async def get(self, path: str) -> tuple[int, str]:
        async with self.s.get(f"{self.fleet.admin_url}{path}", allow_redirects=False) as r:
            return r.status, await r.text()

    async def page(self, path: str = "/console/identity") -> str:
        status, text = await self.get(path)
        assert status == 200, f"{path}: {status} {text[:2000]}"
        return text

    async def act(self, action: str, csrf: str | None = None, **form: str) -> tuple[int, str]:
        data = {"csrf": self.csrf if csrf is None else csrf, **form}
        async with self.s.post(f"{self.fleet.admin_url}/console/act/identity/{action}", data=data) as r:
            return r.status, await r.text()


async def signed_in(fleet: Fleet, session: aiohttp.ClientSession, user: str = TESTER) -> Browser:
    r = await session.post(
        f"{fleet.admin_url}/console/login", data={"user": user, "password": PASSWORD}, allow_redirects=False
    )
    assert r.status == 303, await r.text()
    return Browser(fleet, session)


def jar() -> aiohttp.CookieJar:
    return aiohttp.CookieJar(unsafe=True)


async def person(fleet: Fleet, name: str, role: str, scope: str) -> None:
    """A person who signs in with the tester's password, holding ``role`` over ``scope``."""
    await fleet.client.send(
        P.SERVICE, "user.add", P.AddUser(name=name, password_hash=the_password_hash()), actor="user:test"
    )
    await fleet.client.send(P.SERVICE, "role.grant", P.GrantRole(name=name, role=role, scope=scope), actor="user:test")
    signin = fleet.handles["signin"]

    def known() -> bool:
        return name in signin.people.by_name and bool(signin.people.by_name[name].roles)

    await wait_until(known, what=f"the admin API to know {name}")


async def provider_and_mapping(fleet: Fleet) -> str:
    """The OIDC provider ``corp`` (its secret read from $CORP_OIDC_SECRET), a directory ``corp-ad``, and
    ml-admins → team-admin of acme/ml; answers the mapping's id once the admin API has folded all three."""
    token = fleet.admin_token
    oidc = I.OidcSettings(issuer=ISSUER, client_id="llmgw", client_secret_env="CORP_OIDC_SECRET")
    ldap = I.LdapSettings(url="ldaps://127.0.0.1:1", user_dn="{user}@corp.example", active_directory=True)
    for provider in (
        I.SetProvider(name="corp", kind="oidc", display_name="Corp SSO", oidc=oidc),
        I.SetProvider(name="corp-ad", kind="ldap", display_name="Corp AD", ldap=ldap),
    ):
        done = await act(fleet.store, token, I.SERVICE, "idp.set", provider)
        assert done.applied, done.message
    mapping = I.MapGroup(provider="corp", group="ml-admins", role="team-admin", scope="team:acme/ml")
    mapped = await act(fleet.store, token, I.SERVICE, "idp.map", mapping)
    assert mapped.applied, mapped.message
    identity = fleet.handles["signin"].identity
    await wait_until(lambda: bool(identity.mappings_of("corp")), what="the admin API to fold the providers")
    return str(mapped.result["mapping"])


def row(page: str, element_id: str) -> str:
    found = re.search(rf'<tr id="{re.escape(element_id)}".*?</tr>', page, re.DOTALL)
    assert found, f"no row {element_id} in the page"
    return found.group(0)


async def test_the_page_lists_providers_and_their_mappings_never_a_secret(console: Fleet) -> None:
    mapping_id = await provider_and_mapping(console)
    async with aiohttp.ClientSession(cookie_jar=jar()) as s:
        b = await signed_in(console, s)
        page = await b.page()
    corp = row(page, "provider-corp")
    assert 'data-kind="oidc"' in corp and ISSUER in corp and "Corp SSO" in corp
    assert "$CORP_OIDC_SECRET" in corp and "llmgw" in corp
    assert f'id="mapping-{mapping_id}"' in corp and html.escape("ml-admins → team-admin of team:acme/ml") in corp
    ad = row(page, "provider-corp-ad")
    assert 'data-kind="ldap"' in ad and "ldaps://127.0.0.1:1" in ad and "Active Directory" in ad
    assert 'id="no-scim-tokens"' in page
    # The sign-in page is in the navigation, and speaks German to a German browser.
    assert 'href="/console/identity"' in page
    async with aiohttp.ClientSession(cookie_jar=jar(), headers={"Accept-Language": "de"}) as s:
        b = await signed_in(console, s)
        german = await b.page()
    assert "Identitätsanbieter" in german and "Gruppe einer Rolle zuordnen" in german


async def test_an_admin_adds_a_provider_and_a_mapping_through_the_forms(console: Fleet) -> None:
    async with aiohttp.ClientSession(cookie_jar=jar()) as s:
        b = await signed_in(console, s)
        page = await b.page()
        for form in ('id="oidc-set"', 'id="ldap-set"', 'id="map-group"', 'id="scim-token-create"'):
            assert form in page, form
        assert 'id="no-providers"' in page

        status, answer = await b.act(
            "oidc_set",
            name="corp",
            display_name="Corp SSO",
            issuer=ISSUER,
            client_id="llmgw",
            client_secret_env="CORP_OIDC_SECRET",
            groups_claim="groups",
            username_claim="preferred_username",
            scopes="openid profile email groups",
        )
        assert status == 200 and 'data-outcome="applied"' in answer, answer
        assert f"oidc provider corp ({ISSUER}) added" in answer

        # A secret typed where the variable's name belongs is refused with the service's words, and never kept.
        status, answer = await b.act(
            "oidc_set", name="corp", issuer=ISSUER, client_id="x", client_secret_env="hunter2!"
        )
        assert status == 400 and "is not an environment variable&#39;s name" in answer, answer

        status, answer = await b.act("map", provider="corp", group="ml-admins", role="team-admin", scope="team:acme/ml")
        assert status == 200 and "corp&#39;s group ml-admins grants team-admin of team:acme/ml" in answer, answer

        status, answer = await b.act("map", provider="corp", group="ml-admins", role="emperor", scope="cluster")
        assert status == 400 and "the role: one of" in answer, "a form that cannot be a command is a 400, not a 500"

        status, answer = await b.act(
            "ldap_set", name="lab", url="ldap://127.0.0.1:389", tls="ldaps", user_dn="uid={user},ou=people,dc=lab"
        )
        assert status == 409 and "plain text" in answer, answer
        status, answer = await b.act(
            "ldap_set", name="lab", url="ldap://127.0.0.1:389", tls="plain", user_dn="uid={user},ou=people,dc=lab"
        )
        assert status == 200 and "ldap provider lab" in answer, answer

        identity = console.handles["signin"].identity
        await wait_until(lambda: "lab" in identity.providers, what="the admin API to fold the directory")
        page = await b.page()
        corp = row(page, "provider-corp")
        assert "$CORP_OIDC_SECRET" in corp and "hunter2" not in page
        assert html.escape("ml-admins → team-admin of team:acme/ml") in corp
        mapping_id = identity.mappings_of("corp")[0].mapping_id
        assert identity.providers["corp"].oidc.scopes == ("openid", "profile", "email", "groups")
        assert identity.providers["lab"].ldap.allow_plain

        status, answer = await b.act("unmap", provider="corp", mapping=mapping_id)
        assert status == 200 and "no longer grants team-admin" in answer, answer
        status, answer = await b.act("provider_remove", name="lab")
        assert status == 200 and "identity provider lab removed" in answer, answer
    events = await console.store.read(event_subject(I.AGGREGATE, "corp"))
    assert "hunter2" not in "".join(str(e.payload) for e in events)


async def test_a_scim_token_made_on_the_page_is_shown_once_and_listed_by_its_prefix(console: Fleet) -> None:
    async with aiohttp.ClientSession(cookie_jar=jar()) as s:
        b = await signed_in(console, s)
        status, answer = await b.act("scim_token_create", label="okta", idem="scim-token-1")
        assert status == 200, answer
        token = re.search(r'value="(llmgw-scim-[a-z0-9]{8}-[A-Za-z0-9_-]+)"', answer)
        assert token, answer
        prefix = I.scim_token_prefix(token.group(1))
        assert f"{console.admin_url}/scim/v2" in answer
        again = await b.act("scim_token_create", label="okta", idem="scim-token-1")
        assert "llmgw-scim-" not in again[1], "the same form sent twice answers the first outcome, without a secret"

        identity = console.handles["signin"].identity
        await wait_until(lambda: prefix in identity.scim_tokens_by_prefix, what="the admin API to fold the token")
        page = await b.page()
        listed = row(page, f"scim-token-{prefix}")
        assert "okta" in listed and token.group(1) not in page
        status, answer = await b.act("scim_token_revoke", token=identity.scim_tokens_by_prefix[prefix].token_id)
        assert status == 200 and f"SCIM token {prefix} revoked" in answer, answer


async def test_a_viewer_sees_no_forms_and_a_forged_post_is_refused(console: Fleet) -> None:
    await provider_and_mapping(console)
    await person(console, "vic", "viewer", "cluster")
    await person(console, "mo", "member", "team:acme/ml")
    async with aiohttp.ClientSession(cookie_jar=jar()) as s:
        b = await signed_in(console, s, "vic")
        page = await b.page()
        assert 'id="provider-corp"' in page and "$CORP_OIDC_SECRET" in page
        for form in ("oidc-set", "ldap-set", "map-group", "scim-token-create", "/console/act/identity/"):
            assert form not in page, form
        # A post made up by hand, with the viewer's own CSRF token: the identity service refuses it.
        status, answer = await b.act("provider_remove", name="corp")
        assert status == 403 and "needs cluster-admin of the cluster; vic holds viewer of the cluster" in answer
        # One without the CSRF token (another site making the browser post): refused before anything is sent.
        status, answer = await b.act("provider_remove", csrf="", name="corp")
        assert status == 403 and "without its security token (CSRF)" in answer, answer
    assert "corp" in console.handles["signin"].identity.providers
    async with aiohttp.ClientSession(cookie_jar=jar()) as s:
        b = await signed_in(console, s, "mo")
        status, _ = await b.get("/console/identity")
        assert status == 403, "the page needs a viewer of the cluster"


async def test_the_login_page_offers_each_sso_provider_and_a_choice_of_directories(console: Fleet) -> None:
    async with aiohttp.ClientSession(cookie_jar=jar()) as s, s.get(f"{console.admin_url}/console/login") as r:
        bare = await r.text()
    assert 'id="sso-providers"' not in bare and 'name="provider"' not in bare, "no provider: the login as it was"

    await provider_and_mapping(console)
    url = f"{console.admin_url}/console/login?next=/console/models%3Fat%3D2h"
    async with aiohttp.ClientSession(cookie_jar=jar()) as s, s.get(url) as r:
        page = await r.text()
    sso = re.search(r'<a class="button" id="sso-corp" href="([^"]+)">([^<]+)</a>', page)
    assert sso, page
    assert html.unescape(sso.group(1)) == "/console/sso/corp?next=%2Fconsole%2Fmodels%3Fat%3D2h"
    assert sso.group(2) == "Sign in with Corp SSO"
    assert 'id="sso-corp-ad"' not in page, "a directory has no button: its people type their password"
    select = re.search(r'<select id="provider" name="provider">(.*?)</select>', page, re.DOTALL)
    assert select, page
    options = [
        (v, html.unescape(text))
        for v, text in re.findall(r'<option value="([^"]*)"[^>]*>([^<]+)</option>', select.group(1))
    ]
    assert options == [("", "this server's password"), ("corp-ad", "Corp AD")]

    # The directory chosen goes to the sign-in: an unreachable one says so, and stays chosen.
    form = {"user": "alice", "password": "whatever-it-is-1", "provider": "corp-ad", "next": "/console"}
    async with (
        aiohttp.ClientSession(cookie_jar=jar()) as s,
        s.post(f"{console.admin_url}/console/login", data=form, allow_redirects=False) as r,
    ):
        answer = await r.text()
        assert r.status == 503, answer
    assert "the directory corp-ad could not sign anyone in" in html.unescape(answer)
    assert '<option value="corp-ad" selected>' in answer
    async with (
        aiohttp.ClientSession(cookie_jar=jar(), headers={"Accept-Language": "de"}) as s,
        s.get(f"{console.admin_url}/console/login") as r,
    ):
        german = await r.text()
    assert "Anmelden mit Corp SSO" in german and "dem Passwort dieses Servers" in german


def test_a_form_that_cannot_make_a_provider_says_what_to_give() -> None:
    with pytest.raises(BadInput, match="the issuer must not be empty"):
        oidc_command({"name": "corp", "client_id": "x"})
    with pytest.raises(BadInput, match="not both"):
        ldap_command({"name": "corp", "url": "ldaps://dc", "user_dn": "{user}@corp", "user_base": "ou=people"})
    made = ldap_command(
        {"name": "ad", "url": "ldap://dc:389", "tls": "start_tls", "user_base": "dc=corp", "active_directory": "on"}
    )
    assert made.ldap is not None and made.ldap.start_tls and not made.ldap.allow_plain
    assert (made.ldap.user_filter, made.ldap.username_attr) == ("(sAMAccountName={user})", "sAMAccountName")
    assert oidc_command({"name": "c", "issuer": ISSUER, "client_id": "x"}).oidc.scopes == ("openid", "profile", "email")
