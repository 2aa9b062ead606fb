"""SCIM 2.0 resources (RFC 7643) as this server keeps them: what it publishes, renders, reads and patches. Pure.

One fact lives in one place. A SCIM User is a person (events/folds/people.py) whose ``source`` is
``scim``; the attributes published are exactly those a person keeps, so what an identity provider
writes reads back the same:

=================  ==========================================================================
userName           Person.login (unique here, ignoring case)
displayName        Person.display_name; a body without it takes ``name.formatted``, else
                   "givenName familyName" (``name`` itself is not kept, so not published)
emails             one: Person.email, published with its ``value`` only. Of several sent, the
                   primary (else the first) is kept; it is taken as the person's work email, so
                   ``emails[type eq "work"].value`` reaches it
active             not Person.disabled (published as required: a person here is always one or the
                   other; a body without it keeps what is, or makes an active person)
externalId         Person.external_id
groups             read only: the SCIM groups whose members hold the person
=================  ==========================================================================

A SCIM Group is a group of events/folds/identity.py (displayName, externalId, members by the
people's ids). A member is published with its ``value`` and ``$ref`` only: its display name would be
a second copy of the person's (and scim2-tester, rightly, finds a read-only value it did not write).
Attributes of RFC 7643's User schema (or its enterprise extension) that are not kept are accepted
and ignored, so an identity provider's default mappings go through; an attribute of no schema, or of
another schema, is refused naming what is kept.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import msgspec

from llmgw.services.identity.scim_filter import (
    AttrInfo,
    FilterError,
    PatchPath,
    matches,
    parse_path,
    split_schema,
)

USER_SCHEMA = "urn:ietf:params:scim:schemas:core:2.0:User"
GROUP_SCHEMA = "urn:ietf:params:scim:schemas:core:2.0:Group"
ENTERPRISE_SCHEMA = "urn:ietf:params:scim:schemas:extension:enterprise:2.0:User"
LIST_SCHEMA = "urn:ietf:params:scim:api:messages:2.0:ListResponse"
ERROR_SCHEMA = "urn:ietf:params:scim:api:messages:2.0:Error"
PATCH_SCHEMA = "urn:ietf:params:scim:api:messages:2.0:PatchOp"
SEARCH_SCHEMA = "urn:ietf:params:scim:api:messages:2.0:SearchRequest"
SPC_SCHEMA = "urn:ietf:params:scim:schemas:core:2.0:ServiceProviderConfig"
RESOURCE_TYPE_SCHEMA = "urn:ietf:params:scim:schemas:core:2.0:ResourceType"
SCHEMA_SCHEMA = "urn:ietf:params:scim:schemas:core:2.0:Schema"
MAX_RESULTS = 200  # the most resources one page holds
DEFAULT_COUNT = 100
MAX_TEXT = 256  # the longest text attribute kept (the people service's bound)

# What a filter may name, per resource type (dotted, lower case).
USER_FILTERS: dict[str, AttrInfo] = {
    "id": AttrInfo(case_exact=True),
    "username": AttrInfo(),
    "displayname": AttrInfo(),
    "externalid": AttrInfo(case_exact=True),
    "emails.value": AttrInfo(),
    "active": AttrInfo(type="boolean"),
    "groups.value": AttrInfo(case_exact=True),
    "meta.created": AttrInfo(type="dateTime"),
    "meta.lastmodified": AttrInfo(type="dateTime"),
}
GROUP_FILTERS: dict[str, AttrInfo] = {
    "id": AttrInfo(case_exact=True),
    "displayname": AttrInfo(),
    "externalid": AttrInfo(case_exact=True),
    "members.value": AttrInfo(case_exact=True),
    "meta.created": AttrInfo(type="dateTime"),
    "meta.lastmodified": AttrInfo(type="dateTime"),
}
# RFC 7643 §4.1's User attributes this server does not keep: written, they are ignored, not refused.
_USER_IGNORED = frozenset(
    (
        "name nickname profileurl title usertype preferredlanguage locale timezone password phonenumbers ims "
        "photos addresses entitlements roles x509certificates"
    ).split()
)
_READ_ONLY = frozenset(("id", "meta", "schemas"))
_SPELLED = {"username": "userName", "displayname": "displayName", "externalid": "externalId"}


class ScimError(Exception):
    """An answer in RFC 7644 §3.12's shape: HTTP status, scimType (may be empty) and a detail to act on."""

    def __init__(self, status: int, detail: str, scim_type: str = "") -> None:
        super().__init__(detail)
        self.status, self.detail, self.scim_type = status, detail, scim_type

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"schemas": [ERROR_SCHEMA], "status": str(self.status), "detail": self.detail}
        if self.scim_type:
            body["scimType"] = self.scim_type
        return body


class UserFields(msgspec.Struct, frozen=True, kw_only=True):
    """What a SCIM User says of a person, all of it kept on the person."""

    user_name: str
    display_name: str = ""
    email: str = ""
    external_id: str = ""
    active: bool = True


class GroupFields(msgspec.Struct, frozen=True, kw_only=True):
    display_name: str
    external_id: str = ""
    members: tuple[str, ...] = ()  # people's names (their SCIM ids)


# -- discovery ---------------------------------------------------------------------------------------


def _attr(
    name: str,
    type_: str = "string",
    *,
    multi: bool = False,
    required: bool = False,
    mutability: str = "readWrite",
    uniqueness: str = "none",
    case_exact: bool = False,
    description: str = "",
    sub: Sequence[dict[str, Any]] = (),
    ref_types: Sequence[str] = (),
) -> dict[str, Any]:
    a: dict[str, Any] = {
        "name": name,
        "type": type_,
        "multiValued": multi,
        "description": description or name,
        "required": required,
        "caseExact": case_exact,
        "mutability": mutability,
        "returned": "default",
        "uniqueness": uniqueness,
    }
    if sub:
        a["subAttributes"] = list(sub)
    if ref_types:
        a["referenceTypes"] = list(ref_types)
    return a


def schemas(base: str) -> list[dict[str, Any]]:
    """The User and Group schemas as this server keeps them (RFC 7643 §7)."""
    user = [
        _attr("userName", required=True, uniqueness="server", description="The person's user name at the provider."),
        _attr("displayName", description="The name shown for the person."),
        _attr(
            "emails",
            "complex",
            multi=True,
            description="The person's email (one is kept).",
            sub=[_attr("value", description="The email address.")],
        ),
        _attr(
            "active",
            "boolean",
            required=True,
            description="Whether the person may sign in; false stops their sessions and tokens at once.",
        ),
        _attr(
            "groups",
            "complex",
            multi=True,
            mutability="readOnly",
            description="The SCIM groups the person is in (set through /Groups).",
            sub=[
                _attr("value", mutability="readOnly", case_exact=True, description="The group's id."),
                _attr("$ref", "reference", mutability="readOnly", ref_types=["Group"], description="The group."),
                _attr("display", mutability="readOnly", description="The group's displayName."),
            ],
        ),
    ]
    group = [
        _attr("displayName", required=True, uniqueness="server", description="The group's name, as mappings name it."),
        _attr(
            "members",
            "complex",
            multi=True,
            description="The people in the group.",
            sub=[
                _attr("value", mutability="immutable", case_exact=True, description="The person's id."),
                _attr("$ref", "reference", mutability="immutable", ref_types=["User"], description="The person."),
            ],
        ),
    ]
    return [
        {
            "schemas": [SCHEMA_SCHEMA],
            "id": schema_id,
            "name": name,
            "description": description,
            "attributes": attributes,
            "meta": {"resourceType": "Schema", "location": f"{base}/Schemas/{schema_id}"},
        }
        for schema_id, name, description, attributes in (
            (USER_SCHEMA, "User", "A person who may sign in", user),
            (GROUP_SCHEMA, "Group", "A group whose members' roles follow its mappings", group),
        )
    ]


def resource_types(base: str) -> list[dict[str, Any]]:
    return [
        {
            "schemas": [RESOURCE_TYPE_SCHEMA],
            "id": name,
            "name": name,
            "endpoint": f"/{name}s",
            "description": description,
            "schema": schema,
            "meta": {"resourceType": "ResourceType", "location": f"{base}/ResourceTypes/{name}"},
        }
        for name, schema, description in (
            ("User", USER_SCHEMA, "People who may sign in"),
            ("Group", GROUP_SCHEMA, "Groups whose mappings grant their members roles"),
        )
    ]


def service_provider_config(base: str) -> dict[str, Any]:
    return {
        "schemas": [SPC_SCHEMA],
        "patch": {"supported": True},
        "bulk": {"supported": False, "maxOperations": 0, "maxPayloadSize": 0},
        "filter": {"supported": True, "maxResults": MAX_RESULTS},
        "changePassword": {"supported": False},
        "sort": {"supported": False},
        "etag": {"supported": False},
        "authenticationSchemes": [
            {
                "type": "oauthbearertoken",
                "name": "Bearer token",
                "description": "A token made for the identity provider with `llmgw ctl scim token create`",
                "primary": True,
            }
        ],
        "meta": {"resourceType": "ServiceProviderConfig", "location": f"{base}/ServiceProviderConfig"},
    }


def list_response(resources: Sequence[Mapping[str, Any]], total: int, start: int) -> dict[str, Any]:
    return {
        "schemas": [LIST_SCHEMA],
        "totalResults": total,
        "itemsPerPage": len(resources),
        "startIndex": start,
        "Resources": list(resources),
    }


# -- rendering ---------------------------------------------------------------------------------------


def _iso(at: datetime) -> str:
    return at.isoformat().replace("+00:00", "Z")


def render_user(
    *,
    name: str,
    fields: UserFields,
    created: datetime,
    groups: Sequence[tuple[str, str]],
    base: str,
    modified: datetime | None = None,
) -> dict[str, Any]:
    """A person as a SCIM User; ``groups``: (id, displayName) of the SCIM groups holding them."""
    user: dict[str, Any] = {"schemas": [USER_SCHEMA], "id": name}
    if fields.external_id:
        user["externalId"] = fields.external_id
    user["userName"] = fields.user_name
    if fields.display_name:
        user["displayName"] = fields.display_name
    if fields.email:
        user["emails"] = [{"value": fields.email}]
    user["active"] = fields.active
    if groups:
        user["groups"] = [
            {"value": gid, "$ref": f"{base}/Groups/{gid}", "display": shown} for gid, shown in sorted(groups)
        ]
    user["meta"] = {
        "resourceType": "User",
        "created": _iso(created),
        "lastModified": _iso(modified or created),
        "location": f"{base}/Users/{name}",
    }
    return user


def render_group(
    *, group_id: str, fields: GroupFields, created: datetime, modified: datetime, base: str
) -> dict[str, Any]:
    group: dict[str, Any] = {"schemas": [GROUP_SCHEMA], "id": group_id}
    if fields.external_id:
        group["externalId"] = fields.external_id
    group["displayName"] = fields.display_name
    group["members"] = [{"value": m, "$ref": f"{base}/Users/{m}"} for m in fields.members]
    group["meta"] = {
        "resourceType": "Group",
        "created": _iso(created),
        "lastModified": _iso(modified),
        "location": f"{base}/Groups/{group_id}",
    }
    return group


def attribute_list(text: str) -> list[str]:
    """``attributes=userName,urn:…:User:emails.value`` → ["username", "emails.value"]."""
    return [split_schema(part.strip())[1].lower() for part in text.split(",") if part.strip()]


def select(resource: Mapping[str, Any], attributes: Sequence[str], excluded: Sequence[str]) -> dict[str, Any]:
    """``resource`` with only ``attributes`` (and its id and schemas), or without ``excluded`` (RFC 7644
    §3.9); names dotted, lower case."""
    keep_always = {"id", "schemas"}
    if attributes:
        wanted: dict[str, set[str]] = {}
        for a in attributes:
            head, _, sub = a.partition(".")
            wanted.setdefault(head, set()).add(sub)
        out: dict[str, Any] = {}
        for key, value in resource.items():
            subs = wanted.get(key.lower())
            if key in keep_always:
                out[key] = value
            elif subs is None:
                continue
            elif "" in subs:
                out[key] = value
            else:
                out[key] = _only(value, subs)
        return out
    dropped = {a.partition(".")[0] for a in excluded if "." not in a}
    return {k: v for k, v in resource.items() if k in keep_always or k.lower() not in dropped}


def _only(value: Any, subs: set[str]) -> Any:
    if isinstance(value, list):
        return [_only(v, subs) for v in value]
    if isinstance(value, Mapping):
        return {k: v for k, v in value.items() if k.lower() in subs}
    return value


# -- reading bodies ----------------------------------------------------------------------------------


def _get(body: Mapping[str, Any], name: str) -> tuple[bool, Any]:
    """(present, value) of attribute ``name`` in ``body``, ignoring case (RFC 7643 §2.1)."""
    lowered = name.lower()
    for key, value in body.items():
        if key.lower() == lowered or (":" in key and split_schema(key)[1].lower() == lowered):
            return True, value
    return False, None


def _text(name: str, value: Any, *, required: bool = False) -> str:
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        raise ScimError(400, f"{name} must be a string, not {type(value).__name__}", "invalidValue")
    value = value.strip()
    if required and not value:
        raise ScimError(400, f"{name} must not be empty", "invalidValue")
    if len(value) > MAX_TEXT or not value.isprintable():
        raise ScimError(400, f"{name} must be at most {MAX_TEXT} printable characters", "invalidValue")
    return value


def _bool(name: str, value: Any) -> bool:
    # Some identity providers (Azure's) send booleans as the strings "True" and "False".
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise ScimError(400, f"{name} must be true or false, not {value!r:.40}", "invalidValue")


def _email_of(value: Any) -> str:
    """The one email kept of ``emails`` (a list of {value, type, primary}, or one of them): the primary,
    else the first; "" for none."""
    items = value if isinstance(value, list) else [value] if value is not None else []
    if not all(isinstance(i, Mapping) for i in items):
        raise ScimError(400, 'emails is a list of {"value": ADDRESS}', "invalidValue")
    chosen = next((i for i in items if i.get("primary") is True), items[0] if items else None)
    return _text("emails.value", chosen.get("value")) if chosen is not None else ""


def _display_from_name(value: Any) -> str:
    if not isinstance(value, Mapping):
        return ""
    formatted = value.get("formatted")
    if isinstance(formatted, str) and formatted.strip():
        return _text("name.formatted", formatted)
    parts = [value.get(k) for k in ("givenName", "familyName")]
    return _text("name", " ".join(p.strip() for p in parts if isinstance(p, str) and p.strip()))


def body_object(body: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise ScimError(400, f"the body must be a JSON object: {what}", "invalidSyntax")
    return body


def user_fields(body: Any, old: UserFields | None = None) -> UserFields:
    """A User body (POST, PUT) as the fields kept; a PUT's absent attributes are cleared, ``active`` kept."""
    body = body_object(body, 'a User, {"schemas": [...User], "userName": ...}')
    user_name = _text("userName", _get(body, "userName")[1], required=True)
    present, display = _get(body, "displayName")
    display_name = _text("displayName", display) if present and display is not None else ""
    if not display_name:
        display_name = _display_from_name(_get(body, "name")[1])
    present, active = _get(body, "active")
    return UserFields(
        user_name=user_name,
        display_name=display_name,
        email=_email_of(_get(body, "emails")[1]),
        external_id=_text("externalId", _get(body, "externalId")[1]),
        active=_bool("active", active) if present and active is not None else (old.active if old else True),
    )


def _member_ids(value: Any) -> list[str]:
    items = value if isinstance(value, list) else [value] if value is not None else []
    out: list[str] = []
    for item in items:
        if not isinstance(item, Mapping) or not isinstance(item.get("value"), str) or not item["value"].strip():
            raise ScimError(400, 'members is a list of {"value": USER_ID}', "invalidValue")
        kind = item.get("type")
        if isinstance(kind, str) and kind.lower() == "group":
            raise ScimError(400, "a group here holds people only, not other groups", "invalidValue")
        out.append(item["value"].strip())
    return out


def group_fields(body: Any) -> GroupFields:
    body = body_object(body, 'a Group, {"schemas": [...Group], "displayName": ...}')
    return GroupFields(
        display_name=_text("displayName", _get(body, "displayName")[1], required=True),
        external_id=_text("externalId", _get(body, "externalId")[1]),
        members=tuple(dict.fromkeys(_member_ids(_get(body, "members")[1]))),
    )


# -- PATCH (RFC 7644 §3.5.2) -------------------------------------------------------------------------


class Operation(msgspec.Struct, frozen=True):
    op: str  # add | replace | remove
    path: PatchPath | None
    value: Any


def operations(body: Any) -> list[Operation]:
    """The operations of a PatchOp body, their paths parsed; raises :class:`ScimError`."""
    body = body_object(body, 'a PatchOp, {"schemas": [...PatchOp], "Operations": [...]}')
    ops = _get(body, "Operations")[1]
    if not isinstance(ops, list) or not ops:
        raise ScimError(400, 'a PatchOp lists its changes in "Operations"', "invalidSyntax")
    out: list[Operation] = []
    for raw in ops:
        if not isinstance(raw, Mapping):
            raise ScimError(400, "each operation is an object with op, path and value", "invalidSyntax")
        op = raw.get("op")
        if not isinstance(op, str) or op.lower() not in ("add", "replace", "remove"):
            raise ScimError(400, f"op is add, replace or remove, not {op!r:.40}", "invalidSyntax")
        path_text = raw.get("path")
        if path_text is not None and not isinstance(path_text, str):
            raise ScimError(400, "path must be a string", "invalidPath")
        try:
            path = parse_path(path_text) if path_text else None
        except FilterError as exc:
            raise ScimError(400, exc.detail, exc.scim_type) from exc
        if path is None and op.lower() == "remove":
            raise ScimError(400, "remove needs a path naming what to remove", "noTarget")
        if path is None and not isinstance(raw.get("value"), Mapping):
            raise ScimError(400, f"{op} without a path needs an object of attributes as its value", "invalidValue")
        out.append(Operation(op.lower(), path, raw.get("value")))
    return out


def _spread(op: Operation) -> list[Operation]:
    """An add or replace without a path: one operation per attribute of its value."""
    if op.path is not None:
        return [op]
    out: list[Operation] = []
    for key, value in op.value.items():
        if key.lower() in _READ_ONLY:
            continue  # read only, sent back as read (Okta's group rename carries the id): ignored, RFC 7644 §3.5.2
        if ":" in key and isinstance(value, Mapping):  # attributes nested under their schema's URN
            if key in (USER_SCHEMA, GROUP_SCHEMA):
                out.extend(_spread(Operation(op.op, None, value)))
            elif key != ENTERPRISE_SCHEMA:
                raise ScimError(400, f"this server keeps no attributes of the schema {key[:100]}", "invalidPath")
            continue
        try:
            out.append(Operation(op.op, parse_path(key), value))
        except FilterError as exc:
            raise ScimError(400, exc.detail, exc.scim_type) from exc
    return out


def _check_schema(path: PatchPath, own: str) -> bool:
    """Whether ``path`` is in this resource's own schema (False: an extension this server ignores)."""
    if not path.schema or path.schema.lower() == own.lower():
        return True
    if own == USER_SCHEMA and path.schema.lower() == ENTERPRISE_SCHEMA.lower():
        return False
    raise ScimError(400, f"this server keeps no attributes of the schema {path.schema[:100]}", "invalidPath")


def patch_user(old: UserFields, ops: Sequence[Operation]) -> UserFields:
    """``old`` with ``ops`` applied, in order; raises :class:`ScimError` for what cannot be applied."""
    state = old
    for op in (s for o in ops for s in _spread(o)):
        state = _patch_user_one(state, op)
    return state


_USER_KEPT = "userName, displayName, emails, active, externalId"


def _patch_user_one(s: UserFields, op: Operation) -> UserFields:
    path = op.path
    assert path is not None
    if not _check_schema(path, USER_SCHEMA):
        return s
    attr, remove, value = path.attr, op.op == "remove", op.value
    shown = _SPELLED.get(attr, attr)
    if attr in _READ_ONLY or attr == "groups":
        where = " (set them through /Groups)" if attr == "groups" else ""
        raise ScimError(400, f"{attr} is read only{where}", "mutability")
    if attr in ("username", "active"):
        if path.value_filter is not None or path.sub:
            raise ScimError(400, f"{shown} has no sub-attributes", "invalidPath")
        if remove:
            raise ScimError(400, f"{shown} is required: replace it instead of removing it", "invalidValue")
        if attr == "username":
            return msgspec.structs.replace(s, user_name=_text("userName", value, required=True))
        return msgspec.structs.replace(s, active=_bool("active", value))
    if attr in ("displayname", "externalid"):
        if path.value_filter is not None or path.sub:
            raise ScimError(400, f"{shown} has no sub-attributes", "invalidPath")
        text = "" if remove else _text(shown, value)
        return msgspec.structs.replace(s, **{"display_name" if attr == "displayname" else "external_id": text})
    if attr == "emails":
        return _patch_email(s, op, path)
    if attr == "name":
        if remove:
            return s
        if path.sub == "formatted":
            return msgspec.structs.replace(s, display_name=_text("name.formatted", value))
        if not path.sub and (_display_from_name(value) and (not s.display_name or "formatted" in value)):
            return msgspec.structs.replace(s, display_name=_display_from_name(value))
        return s
    if attr in _USER_IGNORED:
        return s  # a standard attribute this server does not keep
    raise ScimError(400, f"a User here has no attribute {attr!r}; it keeps {_USER_KEPT}", "invalidPath")


def _patch_email(s: UserFields, op: Operation, path: PatchPath) -> UserFields:
    if path.sub and path.sub not in ("value", "type", "primary", "display"):
        raise ScimError(400, f"emails has no sub-attribute {path.sub!r}", "invalidPath")
    if path.sub in ("type", "primary", "display"):
        return s  # not kept: the one email is the primary, work one
    current = {"value": s.email, "type": "work", "primary": True}
    hit = bool(s.email) and (path.value_filter is None or matches(path.value_filter, current))
    if op.op == "remove":
        return msgspec.structs.replace(s, email="") if hit else s
    if path.sub == "value" or (path.value_filter is not None and isinstance(op.value, str)):
        return msgspec.structs.replace(s, email=_text("emails.value", op.value))
    return msgspec.structs.replace(s, email=_email_of(op.value))


def patch_group(old: GroupFields, ops: Sequence[Operation]) -> GroupFields:
    state = old
    for op in (s for o in ops for s in _spread(o)):
        state = _patch_group_one(state, op)
    return state


def _patch_group_one(s: GroupFields, op: Operation) -> GroupFields:
    path = op.path
    assert path is not None
    _check_schema(path, GROUP_SCHEMA)
    attr, remove, value = path.attr, op.op == "remove", op.value
    if attr in _READ_ONLY:
        raise ScimError(400, f"{attr} is read only", "mutability")
    if attr == "displayname":
        if remove:
            raise ScimError(400, "displayName is required: replace it instead of removing it", "invalidValue")
        return msgspec.structs.replace(s, display_name=_text("displayName", value, required=True))
    if attr == "externalid":
        return msgspec.structs.replace(s, external_id="" if remove else _text("externalId", value))
    if attr != "members":
        raise ScimError(
            400, f"a Group here has no attribute {attr!r}; it keeps displayName, members, externalId", "invalidPath"
        )
    if path.sub:
        raise ScimError(400, "change members as a whole or by members[value eq ID], not a sub-attribute", "invalidPath")
    if path.value_filter is not None:
        kept = tuple(m for m in s.members if not matches(path.value_filter, {"value": m}))
        if op.op == "add":
            raise ScimError(400, "add members with the path members and a list of values", "invalidPath")
        if remove:
            return msgspec.structs.replace(s, members=kept)
        return msgspec.structs.replace(s, members=tuple(dict.fromkeys((*kept, *_member_ids(value)))))
    if remove:
        if value is None:
            return msgspec.structs.replace(s, members=())
        gone = set(_member_ids(value))  # Azure's way: remove members, listing them in value
        return msgspec.structs.replace(s, members=tuple(m for m in s.members if m not in gone))
    if op.op == "replace":
        return msgspec.structs.replace(s, members=tuple(dict.fromkeys(_member_ids(value))))
    return msgspec.structs.replace(s, members=tuple(dict.fromkeys((*s.members, *_member_ids(value)))))
