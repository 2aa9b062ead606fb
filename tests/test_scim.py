"""SCIM 2.0 provisioning at /scim/v2 (SPEC ID-4): filters and patches as pure rules, then the endpoint over
HTTP against real services on a real NATS — people made, changed, deactivated and removed as svc:scim,
groups whose mappings grant and revoke roles, and the refusals an identity provider can act on."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.events.folds.identity import Identity, ScimToken
from llmgw.events.folds.people import Person
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import identity as I
from llmgw.events.schema import people as P
from llmgw.events.schema.subjects import event_subject
from llmgw.services.console import session as SES
from llmgw.services.identity import scim
from llmgw.services.identity import scim_resources as R
from llmgw.services.identity.scim_filter import (
    FilterError,
    check,
    matches,
    parse_filter,
    parse_path,
)
from tests.fleet import Fleet
from tests.scim_support import SERVICES, bearer, scim_token
from tests.support import NatsServer, wait_until

USER = R.USER_SCHEMA
GROUP = R.GROUP_SCHEMA
PATCH = R.PATCH_SCHEMA

# -- filters, paths and patches: pure --------------------------------------------------------------------

ALICE = {
    "id": "alice",
    "userName": "Alice@Example.org",
    "displayName": "Alice Liddell",
    "externalId": "00u1",
    "emails": [{"value": "alice@example.org"}],
    "active": True,
    "meta": {"created": "2026-01-02T03:04:05Z"},
}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('userName eq "alice@example.org"', True),  # userName ignores case
        ('externalId eq "00U1"', False),  # externalId does not
        ('userName ne "bob"', True),
        ('displayName co "lid"', True),
        ('userName sw "alice@"', True),
        ('emails.value ew "@EXAMPLE.ORG"', True),
        ('emails co "example"', True),  # a multi-valued attribute stands for its values
        ('emails[value sw "alice"]', True),
        ("active eq true", True),
        ("active eq false", False),
        ("externalId pr", True),
        ("nickName pr", False),
        ('meta.created gt "2026-01-01T00:00:00Z"', True),
        ('meta.created lt "2026-01-01T00:00:00Z"', False),
        ('userName eq "x" or displayName sw "Alice" and active eq true', True),  # and binds tighter
        ('(userName eq "x" or displayName sw "Alice") and active eq false', False),
        ('not (userName eq "x") and not (active eq false)', True),
        ('urn:ietf:params:scim:schemas:core:2.0:User:userName EQ "ALICE@example.org"', True),
    ],
)
def test_a_filter_reads_each_operator_with_and_or_not_and_parentheses(text: str, expected: bool) -> None:
    f = parse_filter(text)
    assert matches(f, ALICE, R.USER_FILTERS) is expected


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('nickName eq "x"', "does not filter on 'nickname'"),
        ('userName eq "x" and', "ends where an expression"),
        ('userName eq "x"))', "unexpected ')'"),
        ("userName eq alice", 'a value is a "string"'),
        ('userName like "a"', "expected an operator"),
        ('active gt "a"', "compare it with eq or ne"),
        ("userName sw 3", "give a string"),
        ('"x"', "expected an attribute"),
        ("(" * 40 + "active eq true" + ")" * 40, "nests deeper"),
        ('userName eq "' + "x" * 3000 + '"', "longer than"),
    ],
)
def test_a_filter_that_is_malformed_or_names_what_is_not_kept_is_refused_saying_why(text: str, says: str) -> None:
    with pytest.raises(FilterError) as refused:
        check(parse_filter(text), R.USER_FILTERS)
    assert says in refused.value.detail
    assert refused.value.scim_type == "invalidFilter"


FILTER_WORDS = st.sampled_from(
    [
        "userName",
        "emails",
        "emails.value",
        "active",
        "meta.created",
        "eq",
        "co",
        "gt",
        "pr",
        "and",
        "or",
        "not",
        "(",
        ")",
        "[",
        "]",
        '"a"',
        '"',
        "true",
        "null",
        "3",
        "-1.5e3",
        "urn:x:y",
        ".",
        "\\",
        " ",
    ]
)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=80), st.lists(FILTER_WORDS, max_size=25).map(" ".join)))
def test_any_filter_text_is_either_read_or_refused_as_an_invalid_filter(text: str) -> None:
    try:
        f = parse_filter(text)
        check(f, R.USER_FILTERS)
    except FilterError as refused:
        assert refused.scim_type == "invalidFilter" and refused.detail
        return
    assert matches(f, ALICE, R.USER_FILTERS) in (True, False)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
OPERATION = st.fixed_dictionaries(
    {"op": st.sampled_from(["add", "replace", "remove", "Replace", "copy"])},
    optional={
        "path": st.sampled_from(
            [
                "userName",
                "displayName",
                "emails",
                'emails[type eq "work"].value',
                "active",
                "externalId",
                "members",
                'members[value eq "a"]',
                "name.givenName",
                "groups",
                "nickName",
                "x[",
                "urn:a:b:c",
            ]
        ),
        "value": JSON,
    },
)


@settings(max_examples=300, deadline=None)
@given(st.one_of(JSON, st.lists(OPERATION, max_size=4).map(lambda o: {"Operations": o})))
def test_any_patch_body_is_either_applied_or_refused_with_a_scim_error(body: Any) -> None:
    for apply, old in ((R.patch_user, BEFORE), (R.patch_group, R.GroupFields(display_name="g", members=("a",)))):
        try:
            after = apply(old, R.operations(body))  # type: ignore[operator]
        except R.ScimError as refused:
            assert refused.status == 400 and refused.scim_type and refused.detail
        else:
            assert type(after) is type(old)


@settings(max_examples=200, deadline=None)
@given(JSON)
def test_any_user_or_group_body_is_either_read_or_refused_with_a_scim_error(body: Any) -> None:
    for read in (R.user_fields, R.group_fields):
        try:
            read(body)
        except R.ScimError as refused:
            assert refused.status == 400 and refused.detail


def test_a_patch_path_reads_a_value_filter_a_sub_attribute_and_a_schema() -> None:
    p = parse_path('emails[type eq "work"].value')
    assert (p.attr, p.sub) == ("emails", "value") and matches(p.value_filter, {"type": "WORK"})  # type: ignore[arg-type]
    p = parse_path(f"{USER}:name.givenName")
    assert (p.attr, p.sub, p.schema) == ("name", "givenname", USER)
    with pytest.raises(FilterError) as bad:
        parse_path('members[value eq "x"')
    assert bad.value.scim_type == "invalidPath"


def ops(*operations: dict[str, Any]) -> list[R.Operation]:
    return R.operations({"schemas": [PATCH], "Operations": list(operations)})


BEFORE = R.UserFields(user_name="alice", display_name="Alice", email="a@x.org", external_id="e1")


def test_a_user_patch_without_a_path_sets_each_attribute_and_reads_azures_boolean_strings() -> None:
    after = R.patch_user(
        BEFORE,
        ops(
            {"op": "Replace", "value": {"active": "False", "displayName": "Alice L."}},
            {"op": "Replace", "value": {'emails[type eq "work"].value': "alice@new.org", "title": "ignored"}},
        ),
    )
    assert after == R.UserFields(
        user_name="alice", display_name="Alice L.", email="alice@new.org", external_id="e1", active=False
    )


def test_a_user_patch_adds_replaces_and_removes_by_path() -> None:
    after = R.patch_user(
        BEFORE,
        ops(
            {"op": "remove", "path": "externalId"},
            {"op": "add", "path": "emails", "value": [{"value": "b@x.org"}, {"value": "p@x.org", "primary": True}]},
            {"op": "replace", "path": "userName", "value": "alice2"},
            {"op": "add", "path": f"{R.ENTERPRISE_SCHEMA}:department", "value": "ignored"},
        ),
    )
    assert after == R.UserFields(user_name="alice2", display_name="Alice", email="p@x.org")
    assert R.patch_user(after, ops({"op": "remove", "path": 'emails[value eq "P@X.ORG"]'})).email == ""
    assert R.patch_user(after, ops({"op": "remove", "path": 'emails[value eq "other"]'})).email == "p@x.org"


@pytest.mark.parametrize(
    ("operation", "scim_type", "says"),
    [
        ({"op": "remove", "path": "userName"}, "invalidValue", "userName is required"),
        ({"op": "remove", "path": "active"}, "invalidValue", "active is required"),
        ({"op": "add", "path": "groups", "value": [{"value": "g"}]}, "mutability", "through /Groups"),
        ({"op": "replace", "path": "id", "value": "x"}, "mutability", "read only"),
        ({"op": "replace", "path": "shoeSize", "value": "9"}, "invalidPath", "it keeps userName"),
        ({"op": "replace", "path": "urn:acme:Thing:x", "value": "9"}, "invalidPath", "no attributes of the schema"),
        ({"op": "replace", "path": "active", "value": "maybe"}, "invalidValue", "true or false"),
        ({"op": "remove"}, "noTarget", "needs a path"),
        ({"op": "move", "path": "x"}, "invalidSyntax", "add, replace or remove"),
        ({"op": "replace", "value": "not an object"}, "invalidValue", "object of attributes"),
    ],
)
def test_a_user_patch_that_cannot_apply_is_refused_with_its_scim_type(
    operation: dict[str, Any], scim_type: str, says: str
) -> None:
    with pytest.raises(R.ScimError) as refused:
        R.patch_user(BEFORE, ops(operation))
    assert (refused.value.status, refused.value.scim_type) == (400, scim_type)
    assert says in refused.value.detail


def test_a_group_patch_adds_members_and_removes_them_by_filter_or_by_list() -> None:
    group = R.GroupFields(display_name="ml", members=("ann",))
    group = R.patch_group(group, ops({"op": "add", "path": "members", "value": [{"value": "bob"}, {"value": "cy"}]}))
    assert group.members == ("ann", "bob", "cy")
    group = R.patch_group(group, ops({"op": "remove", "path": 'members[value eq "bob"]'}))
    assert group.members == ("ann", "cy")
    group = R.patch_group(group, ops({"op": "Remove", "path": "members", "value": [{"value": "ann"}]}))
    assert group.members == ("cy",)
    rename = {"id": "g1", "displayName": "ml-admins", "members": []}  # Okta sends the id back: ignored
    group = R.patch_group(group, ops({"op": "replace", "value": rename}))
    assert group == R.GroupFields(display_name="ml-admins")
    with pytest.raises(R.ScimError, match="people only"):
        R.patch_group(group, ops({"op": "add", "path": "members", "value": [{"value": "g2", "type": "Group"}]}))


def test_a_user_body_takes_its_display_name_from_name_when_it_has_none_and_keeps_the_primary_email() -> None:
    body = {
        "userName": " bob ",
        "name": {"givenName": "Bob", "familyName": "Stone"},
        "emails": [{"value": "b@home.org", "type": "home"}, {"value": "b@work.org", "primary": True}],
    }
    assert R.user_fields(body) == R.UserFields(user_name="bob", display_name="Bob Stone", email="b@work.org")
    deactivated = R.UserFields(user_name="bob", active=False)
    assert R.user_fields({"userName": "bob"}, deactivated).active is False  # a PUT without active keeps it
    with pytest.raises(R.ScimError, match="userName must not be empty"):
        R.user_fields({"userName": "  "})


def test_a_page_starts_at_one_and_holds_at_most_two_hundred() -> None:
    assert scim.page({}) == (1, 100)
    assert scim.page({"startIndex": "0", "count": "100000"}) == (1, 200)
    assert scim.page({"startIndex": "3", "count": "-5"}) == (3, 0)
    with pytest.raises(R.ScimError) as refused:
        scim.page({"count": "ten"})
    assert refused.value.scim_type == "invalidValue"


def test_only_a_live_scim_token_is_let_in_and_a_persons_token_is_told_how_to_make_one() -> None:
    token, prefix, sha256 = I.make_scim_token()
    identity = Identity(
        scim_tokens_by_prefix={
            prefix: ScimToken(token_id="t1", prefix=prefix, secret_sha256=sha256, issued_at=datetime.now(UTC))
        }
    )
    assert isinstance(scim.authenticate(identity, f"Bearer {token}"), ScimToken)
    person = P.make_token("session")[0]
    for header, says in (
        ("", "send Authorization: Bearer"),
        (f"Basic {token}", "send Authorization: Bearer"),
        (f"Bearer {person}", "a person's token, not a SCIM token"),
        (f"Bearer {token[:-2]}xx", "unknown or was revoked"),
        (f"Bearer {I.make_scim_token()[0]}", "unknown or was revoked"),
    ):
        refused = scim.authenticate(identity, header)
        assert isinstance(refused, R.ScimError) and refused.status == 401, header
        assert says in refused.detail and "llmgw ctl scim token create" in refused.detail


# -- the endpoint over HTTP ----------------------------------------------------------------------------


@pytest.fixture
async def fleet(store: EventStore, nats: NatsServer, tmp_path: Path) -> AsyncIterator[Fleet]:
    f = await Fleet(store, nats.url, tmp_path).start(services=SERVICES)
    yield f
    await f.stop()


class Scim:
    """An identity provider's calls to /scim/v2 with its token."""

    def __init__(self, fleet: Fleet, token: str) -> None:
        self.fleet, self.token = fleet, token
        self.base = f"{fleet.admin_url}/scim/v2"

    async def call(
        self, method: str, path: str, body: Any = None, *, token: str | None = None, raw: bytes | None = None
    ) -> tuple[int, dict[str, Any]]:
        headers = {**bearer(self.token if token is None else token), "Content-Type": "application/scim+json"}
        data = raw if raw is not None else None
        async with (
            aiohttp.ClientSession() as s,
            s.request(method, self.base + path, json=body if raw is None else None, data=data, headers=headers) as r,
        ):
            if r.status == 204:
                return 204, {}
            assert r.content_type == "application/scim+json", (r.status, await r.text())
            return r.status, await r.json()

    async def user(self, user_name: str, **more: Any) -> dict[str, Any]:
        status, body = await self.call("POST", "/Users", {"schemas": [USER], "userName": user_name, **more})
        assert status == 201, body
        return body


@pytest.fixture
async def idp(fleet: Fleet) -> Scim:
    return Scim(fleet, await scim_token(fleet))


def scim_error(body: dict[str, Any], status: int, scim_type: str | None = None) -> str:
    assert body["schemas"] == [R.ERROR_SCHEMA], body
    assert body["status"] == str(status), body
    if scim_type is not None:
        assert body.get("scimType") == scim_type, body
    return body["detail"]


async def events_by(fleet: Fleet, actor: str) -> list[dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"{fleet.admin_url}/api/v1/audit?actor={actor}&limit=1000", headers=fleet.api_headers()) as r,
    ):
        assert r.status == 200
        return (await r.json())["events"]


async def test_users_are_created_read_filtered_paged_replaced_patched_and_deleted_as_svc_scim(
    fleet: Fleet, idp: Scim
) -> None:
    alice = await idp.user("Alice@Example.org", displayName="Alice", emails=[{"value": "alice@example.org"}])
    assert alice["id"] == "alice@example.org" and alice["userName"] == "Alice@Example.org" and alice["active"]
    assert alice["meta"]["location"] == f"{idp.base}/Users/alice@example.org"
    for name in ("bob", "carol"):
        await idp.user(name, externalId=f"ext-{name}")

    status, got = await idp.call("GET", "/Users/alice@example.org")
    assert status == 200 and got == alice
    status, found = await idp.call("GET", '/Users?filter=userName eq "ALICE@example.ORG"')
    assert (found["totalResults"], [u["id"] for u in found["Resources"]]) == (1, ["alice@example.org"])
    status, found = await idp.call("GET", '/Users?filter=externalId sw "ext-" and not (userName eq "bob")')
    assert [u["id"] for u in found["Resources"]] == ["carol"]
    status, paged = await idp.call("GET", "/Users?startIndex=2&count=1&attributes=userName")
    assert (paged["totalResults"], paged["itemsPerPage"], paged["startIndex"]) == (3, 1, 2)
    assert paged["Resources"] == [{"schemas": [USER], "id": "bob", "userName": "bob"}]
    status, searched = await idp.call("POST", "/Users/.search", {"filter": "active eq true", "count": 2})
    assert (searched["totalResults"], searched["itemsPerPage"]) == (3, 2)

    status, replaced = await idp.call(
        "PUT", "/Users/bob", {"schemas": [USER], "userName": "bob.stone", "name": {"formatted": "Bob Stone"}}
    )
    assert status == 200 and (replaced["userName"], replaced["displayName"]) == ("bob.stone", "Bob Stone")
    assert "externalId" not in replaced  # a PUT replaces: what it leaves out is cleared
    patch = {"schemas": [PATCH], "Operations": [{"op": "replace", "path": "displayName", "value": "Robert"}]}
    status, patched = await idp.call("PATCH", "/Users/bob", patch)
    assert status == 200 and patched["displayName"] == "Robert" and patched["id"] == "bob"

    status, _ = await idp.call("DELETE", "/Users/carol")
    assert status == 204
    status, gone = await idp.call("GET", "/Users/carol")
    assert "no SCIM user 'carol'" in scim_error(gone, 404)
    assert "carol" not in fleet.handles["signin"].people.by_name

    async def on_the_log() -> set[str]:
        kinds = {e["type"] for e in await events_by(fleet, "svc:scim")}
        return kinds if {"user.added", "user.profile_set", "user.removed"} <= kinds else set()

    assert await wait_until(on_the_log, what="SCIM's changes on the log with actor svc:scim")


async def test_a_user_name_is_unique_ignoring_case_and_a_person_with_a_password_is_never_taken_over(
    fleet: Fleet, idp: Scim
) -> None:
    await idp.user("dana")
    _, body = await idp.call("POST", "/Users", {"schemas": [USER], "userName": "DANA"})
    assert "belongs to dana" in scim_error(body, 409, "uniqueness")
    # The tests' own administrator was added with a password: SCIM may neither make nor change them.
    _, body = await idp.call("POST", "/Users", {"schemas": [USER], "userName": "tester"})
    assert "added here with a password" in scim_error(body, 409, "uniqueness")
    _, body = await idp.call("GET", "/Users/tester")
    scim_error(body, 404)
    _, listed = await idp.call("GET", "/Users")
    assert [u["id"] for u in listed["Resources"]] == ["dana"]


async def test_a_person_deactivated_by_scim_is_cut_off_mid_session(fleet: Fleet, idp: Scim) -> None:
    erin = await idp.user("erin")
    # A person SCIM made has no password here: their tokens are issued as a sign-in would issue them.
    token, issue = P.issue("erin", "personal", label="automation")
    await fleet.client.send(P.SERVICE, "token.issue", issue, actor="user:erin")
    expires = datetime.now(UTC) + timedelta(hours=1)
    session, issue = P.issue("erin", "session", expires_at=expires, method="oidc:corp")
    await fleet.client.send(P.SERVICE, "token.issue", issue, actor="user:erin")

    async def whoami(with_token: str = token) -> int:
        async with (
            aiohttp.ClientSession() as s,
            s.get(f"{fleet.admin_url}/api/v1/whoami", headers=bearer(with_token)) as r,
        ):
            return r.status

    async def console() -> str:
        async with (
            aiohttp.ClientSession(cookies={SES.COOKIE: session}) as s,
            s.get(f"{fleet.admin_url}/console", allow_redirects=False) as r,
        ):
            return r.headers.get("Location", "") if r.status in (302, 303) else str(r.status)

    async def works() -> bool:
        return await whoami() == 200 and await whoami(session) == 200

    assert await wait_until(works, what="erin's personal and session tokens to work")
    assert not (await console()).startswith("/console/login")  # signed in: served (or sent to a page they may see)

    deactivate = {"schemas": [PATCH], "Operations": [{"op": "Replace", "value": {"active": "False"}}]}
    status, body = await idp.call("PATCH", f"/Users/{erin['id']}", deactivate)
    assert status == 200 and body["active"] is False
    # Answered once the admin API read it: the very next call is refused, the console sends them to sign in.
    assert await whoami() == 403
    assert (await console()).startswith("/console/login")
    status, listed = await idp.call("GET", "/Users?filter=active eq false")
    assert [u["id"] for u in listed["Resources"]] == ["erin"]

    status, body = await idp.call(
        "PATCH", "/Users/erin", {"schemas": [PATCH], "Operations": [{"op": "replace", "path": "active", "value": True}]}
    )
    assert status == 200 and body["active"] is True and await whoami() == 200


async def test_a_mapped_group_grants_its_members_the_role_and_revokes_it_when_they_leave(
    fleet: Fleet, idp: Scim
) -> None:
    mapping = I.MapGroup(provider=I.SCIM, group="ML-Admins", role="viewer", scope="cluster")
    await fleet.client.send(I.SERVICE, "idp.map", mapping, actor="user:tester")
    await wait_until(lambda: fleet.handles["signin"].identity.mappings_of(I.SCIM), what="the mapping to be read")
    frank, gina = await idp.user("frank"), await idp.user("gina")
    people = fleet.handles["signin"].people

    status, group = await idp.call(
        "POST", "/Groups", {"schemas": [GROUP], "displayName": "ml-admins", "members": [{"value": frank["id"]}]}
    )
    assert status == 201 and group["members"] == [{"value": "frank", "$ref": f"{idp.base}/Users/frank"}]
    # Answered once the roles are read back: frank holds the role the mapping grants, and says how.
    assert ("viewer", "cluster") in people.by_name["frank"].roles
    assert people.by_name["frank"].via("viewer", "cluster")[:2] == ("scim", "ML-Admins")  # type: ignore[index]
    status, got = await idp.call("GET", "/Users/frank")
    assert got["groups"] == [{"value": group["id"], "$ref": f"{idp.base}/Groups/{group['id']}", "display": "ml-admins"}]

    add = {"schemas": [PATCH], "Operations": [{"op": "add", "path": "members", "value": [{"value": gina["id"]}]}]}
    status, _ = await idp.call("PATCH", f"/Groups/{group['id']}", add)
    assert status == 200 and ("viewer", "cluster") in people.by_name["gina"].roles
    status, found = await idp.call("GET", '/Groups?filter=members[value eq "gina"]')
    assert [g["id"] for g in found["Resources"]] == [group["id"]]

    leave = {"schemas": [PATCH], "Operations": [{"op": "remove", "path": 'members[value eq "frank"]'}]}
    status, changed = await idp.call("PATCH", f"/Groups/{group['id']}", leave)
    assert status == 200 and [m["value"] for m in changed["members"]] == ["gina"]
    assert ("viewer", "cluster") not in people.by_name["frank"].roles
    assert ("viewer", "cluster") in people.by_name["gina"].roles

    status, _ = await idp.call("DELETE", f"/Groups/{group['id']}")
    assert status == 204 and ("viewer", "cluster") not in people.by_name["gina"].roles
    status, body = await idp.call("GET", f"/Groups/{group['id']}")
    scim_error(body, 404)

    async def logged() -> bool:
        kinds = {e["type"] for e in await events_by(fleet, "svc:scim")}
        return {"scimgroup.set", "scimgroup.removed", "user.role_granted", "user.role_revoked"} <= kinds

    assert await wait_until(logged, what="the groups' changes and the roles they moved, as svc:scim")


async def test_a_mapping_made_after_its_group_reaches_its_members_at_once_and_its_removal_too(
    fleet: Fleet, idp: Scim
) -> None:
    await idp.user("jo")
    await idp.call("POST", "/Groups", {"displayName": "readers", "members": [{"value": "jo"}]})
    people = fleet.handles["signin"].people
    assert people.by_name["jo"].roles == [] and people.by_name["jo"].groups == {"scim": ("readers",)}
    mapping = I.MapGroup(provider=I.SCIM, group="readers", role="viewer", scope="cluster")
    done = await fleet.client.send(I.SERVICE, "idp.map", mapping, actor="user:tester")
    # Nothing touches the group: the mapping itself reaches jo.
    await wait_until(lambda: people.by_name["jo"].roles == [("viewer", "cluster")], what="jo to be granted viewer")
    granted = [
        e for e in await fleet.store.read(event_subject(P.AGGREGATE, "jo")) if isinstance(e.payload, P.RoleGranted)
    ]
    assert [(e.envelope.actor, e.payload.mapping) for e in granted] == [("svc:scim", done.result["mapping"])]

    unmap = I.UnmapGroup(provider=I.SCIM, mapping=str(done.result["mapping"]))
    await fleet.client.send(I.SERVICE, "idp.unmap", unmap, actor="user:tester")
    await wait_until(lambda: people.by_name["jo"].roles == [], what="jo's viewer to go with its mapping")


def test_a_persons_roles_lag_their_groups_until_synced_and_roles_granted_by_hand_are_not_theirs_to_sync() -> None:
    grant = P.MappedGrant(role="viewer", scope="cluster", group="readers", mapping="m1")
    now = datetime.now(UTC)
    jo = Person(name="jo", added_at=now, source="scim", groups={"scim": ("readers",)})
    assert scim.roles_lag(jo, ("readers",), (grant,))  # not held yet
    jo.roles, jo.granted_by = [("viewer", "cluster")], {"viewer cluster": ("scim", "readers", "m1")}
    assert not scim.roles_lag(jo, ("readers",), (grant,))
    assert scim.roles_lag(jo, ("readers", "writers"), (grant,))  # groups changed
    assert scim.roles_lag(jo, ("readers",), ())  # the mapping went: SCIM's grant must go
    by_hand = Person(name="kim", added_at=now, source="scim", roles=[("viewer", "cluster")], groups={"scim": ()})
    assert not scim.roles_lag(by_hand, (), ())


async def test_members_added_to_one_group_in_parallel_all_land(fleet: Fleet, idp: Scim) -> None:
    names = [f"p{i}" for i in range(6)]
    for name in names:
        await idp.user(name)
    _, group = await idp.call("POST", "/Groups", {"displayName": "everyone"})

    def add(name: str) -> dict[str, Any]:
        return {"schemas": [PATCH], "Operations": [{"op": "add", "path": "members", "value": [{"value": name}]}]}

    # Entra ID sends one PATCH per member, several at once: none may be lost to another's write.
    answers = await asyncio.gather(*(idp.call("PATCH", f"/Groups/{group['id']}", add(n)) for n in names))
    assert [status for status, _ in answers] == [200] * len(names)
    _, got = await idp.call("GET", f"/Groups/{group['id']}")
    assert sorted(m["value"] for m in got["members"]) == names


async def test_a_key_is_locked_for_one_holder_at_a_time_and_forgotten_once_free() -> None:
    locks, order = scim.KeyedLocks(), []

    async def hold(key: str, tag: str, release: asyncio.Event) -> None:
        async with locks.hold(key):
            order.append(f"{tag} in")
            await release.wait()
            order.append(f"{tag} out")

    first, second, other = asyncio.Event(), asyncio.Event(), asyncio.Event()
    tasks = [asyncio.create_task(hold("g", "a", first)), asyncio.create_task(hold("g", "b", second))]
    tasks.append(asyncio.create_task(hold("h", "c", other)))
    await wait_until(lambda: order == ["a in", "c in"], what="a and c to hold their keys, b to wait")
    first.set()
    await wait_until(lambda: order[-1] == "b in", what="b to get g once a let go")
    second.set()
    other.set()
    await asyncio.gather(*tasks)
    assert len(locks) == 0


async def test_a_group_names_people_only_once_each_name_once(fleet: Fleet, idp: Scim) -> None:
    await idp.user("hal")
    status, body = await idp.call("POST", "/Groups", {"displayName": "ops", "members": [{"value": "nobody"}]})
    assert "no SCIM user has the id 'nobody'" in scim_error(body, 400, "invalidValue")
    status, body = await idp.call("POST", "/Groups", {"displayName": "ops", "members": [{"value": "tester"}]})
    scim_error(body, 400, "invalidValue")  # a person added here with a password is not SCIM's to group
    status, ops_group = await idp.call("POST", "/Groups", {"displayName": "ops", "members": [{"value": "hal"}]})
    assert status == 201
    status, body = await idp.call("POST", "/Groups", {"displayName": "OPS"})
    assert ops_group["id"] in scim_error(body, 409, "uniqueness")
    # A person deleted leaves their groups, so a name given again later inherits nothing.
    status, _ = await idp.call("DELETE", "/Users/hal")
    status, group = await idp.call("GET", f"/Groups/{ops_group['id']}")
    assert group["members"] == []


async def test_bad_tokens_filters_and_bodies_get_scim_errors_never_a_500(fleet: Fleet, idp: Scim) -> None:
    status, body = await idp.call("GET", "/Users", token="")
    assert "send Authorization: Bearer" in scim_error(body, 401)
    status, body = await idp.call("GET", "/Users", token=fleet.admin_token)
    assert "llmgw ctl scim token create" in scim_error(body, 401)

    revoked = await scim_token(fleet, label="to revoke")
    await fleet.client.send(
        I.SERVICE, "scim.token-revoke", I.RevokeScimToken(token=I.scim_token_prefix(revoked) or ""), actor="user:tester"
    )

    async def refused() -> bool:
        return (await idp.call("GET", "/Users", token=revoked))[0] == 401

    assert await wait_until(refused, what="a revoked SCIM token to be refused")

    await idp.user("ivy")
    for path, says in (
        ('/Users?filter=userName eq "ivy', "cannot be read"),
        ('/Users?filter=password eq "x"', "does not filter on 'password'"),
        ("/Users?filter=active gt true", "compare it with eq or ne"),
    ):
        status, body = await idp.call("GET", path)
        assert says in scim_error(body, 400, "invalidFilter"), path
    status, body = await idp.call("GET", "/Users?startIndex=first")
    scim_error(body, 400, "invalidValue")
    status, body = await idp.call("GET", "/Users?count=100000")
    assert status == 200 and body["itemsPerPage"] == 1

    status, body = await idp.call("POST", "/Users", raw=b'{"userName": ')
    assert "not JSON" in scim_error(body, 400, "invalidSyntax")
    _, body = await idp.call("POST", "/Users", raw=b"[" * 100_000 + b"]" * 100_000)
    scim_error(body, 400, "invalidSyntax")
    status, body = await idp.call("POST", "/Users", ["not", "an", "object"])
    scim_error(body, 400, "invalidSyntax")
    status, body = await idp.call("POST", "/Users", {"userName": 7})
    assert "userName must be a string" in scim_error(body, 400, "invalidValue")
    status, body = await idp.call(
        "PATCH", "/Users/ivy", {"Operations": [{"op": "add", "path": "shoeSize", "value": 9}]}
    )
    scim_error(body, 400, "invalidPath")
    status, body = await idp.call("PATCH", "/Users/ivy", {"Operations": [{"op": "add", "path": "emails[", "value": 9}]})
    scim_error(body, 400, "invalidPath")
    status, body = await idp.call("PUT", "/Users/nobody", {"userName": "nobody"})
    scim_error(body, 404)
    status, body = await idp.call("GET", "/Nothing/here")
    scim_error(body, 404)
    status, body = await idp.call("DELETE", "/ServiceProviderConfig")
    scim_error(body, 405)
    status, body = await idp.call("POST", "/.search", {"filter": "active eq true"})
    scim_error(body, 501)
