"""The admin API's OpenAPI 3.1 document (``GET /api/v1/openapi.json``), made from the types the handlers use.

The management endpoints come from :data:`~llmgw.services.api.manage.ENDPOINTS`: each body is the
msgspec type its handler decodes, each answer the :class:`~llmgw.services.api.act.Outcome` it encodes
(``msgspec.json.schema_components`` writes their schemas). The reads answer objects shaped by the
views (services/api/views.py), typed loosely here: an object (``/users``: a list of them).
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec

from llmgw.services.api.act import MAX_KEY_LENGTH, Outcome
from llmgw.services.api.manage import BODIES, ENDPOINTS, Endpoint, ErrorBody

REF = "#/components/schemas/{name}"
OPENAPI_PATH = "/api/v1/openapi.json"


class LoginBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``POST /api/v1/login``'s body (app.py's LoginRequest, named here as it is documented)."""

    user: str
    password: str
    provider: str = ""  # an LDAP directory's name: it checks the password ("" : this server does)


# The reads: path -> (summary, query parameters, whether the answer is a list). Each answers a JSON object.
READS: dict[str, tuple[str, tuple[str, ...], bool]] = {
    "/api/v1/whoami": ("Who the token stands for.", (), False),
    "/api/v1/users": ("Every person, their roles and live tokens (never a hash).", (), True),
    "/api/v1/tree": ("Organisations, their teams and projects.", (), False),
    "/api/v1/events/{id}": ("One event or command, its cause and effects.", (), False),
    "/api/v1/replay": ("The cluster as it was at `until`.", ("until", "keys_limit", "keys_after"), False),
    "/api/v1/audit": ("Who changed what, newest last.", ("actor", "since", "type", "limit"), False),
    "/api/v1/nodes": ("Nodes, their capacity and reservations.", (), False),
    "/api/v1/nodes/{id}": ("One node, its GPUs, heartbeat and replicas.", (), False),
    "/api/v1/models": ("The catalog's models and their replicas.", (), False),
    "/api/v1/models/{name}/headroom": ("How many more replicas of a model fit now.", (), False),
    "/api/v1/replicas": ("Replicas (running ones unless `all`).", ("model", "all"), False),
    "/api/v1/keys": ("API keys, never a secret.", ("project",), False),
    "/api/v1/limits": ("Every scope's limits.", (), False),
    "/api/v1/prices": ("Model prices.", (), False),
    "/api/v1/budgets": ("Every scope's budget.", (), False),
    "/api/v1/projections": ("The projections' positions and lag.", (), False),
    "/api/v1/usage": ("Usage sums over the per-minute rollups.", ("scope", "since", "by"), False),
    "/api/v1/usage/spend": ("What a scope spent in its budget period.", ("scope", "period"), False),
    "/api/v1/requests/{id}": ("One request's usage record.", (), False),
    "/api/v1/identity/providers": ("Identity providers (OIDC, LDAP) and their settings, never a secret.", (), True),
    "/api/v1/identity/mappings": ("Groups mapped to roles (`?provider=` one, or `scim`).", ("provider",), True),
    "/api/v1/scim-tokens": ("The SCIM bearer tokens, by prefix and label (never a hash).", (), True),
    "/api/v1/mcp/servers": ("MCP servers behind /mcp and their grants (header variables by name only).", (), True),
}
# The projections' own changes: cluster admin only (not commands: they rebuild what the log says).
PROJECTION_CHANGES = {
    "/api/v1/projections/rebuild": "Rebuild projections from the log (`?name=` one).",
    "/api/v1/projections/verify": "Fold the log again and compare with the projections (`?name=` one).",
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": REF.format(name=name)}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _path_parameters(
    path: str, schemas: dict[str, dict[str, Any]] | None = None, slashed: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """The path's parameters: never empty; a '/' only in those ``slashed`` (tenant paths, sent as is or as %2F)."""
    params = []
    for part in path.split("/"):
        if part.startswith("{") and part.endswith("}"):
            name = part[1:-1]
            schema = {**(schemas or {}).get(name, {"type": "string"}), "minLength": 1}
            if name not in slashed:
                schema["pattern"] = "^[^/]+$"
            params.append({"name": name, "in": "path", "required": True, "schema": schema})
    return params


def _query(name: str, schema: dict[str, Any] | None = None, required: bool = False) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": required, "schema": schema or {"type": "string"}}


def _field_schema(ep: Endpoint, name: str) -> dict[str, Any]:
    """The JSON schema of one payload field, inline (path and query fields are plain strings, numbers, booleans)."""
    (schema,), _ = msgspec.json.schema_components([ep.field_type(name)], ref_template=REF)
    return schema


ERRORS = {
    "400": "The request cannot make the command (a field named), or the command was refused as invalid.",
    "401": "No token, or one unknown, revoked or expired.",
    "403": "The person may not (the role needed is named), or is disabled.",
    "404": "What the command names does not exist.",
    "409": "The state refuses it (exists already, busy, …).",
    "503": "The bus or the command's service is not reachable.",
    "504": "The command's service did not answer in time (`llmgw events show ID` finds it later).",
}


REFUSED = {"anyOf": [_ref("Outcome"), _ref("ErrorBody")]}


def _management(ep: Endpoint, body: type[msgspec.Struct]) -> dict[str, Any]:
    op: dict[str, Any] = {
        "operationId": ep.operation_id,
        "summary": ep.summary,
        "description": f"Sends the `{ep.operation_id}` command signed with the caller's token; answers its outcome.",
        "tags": [ep.service],
        "parameters": [
            *_path_parameters(ep.openapi_path, {n: _field_schema(ep, n) for n in ep.path_fields}, ep.slashed_fields),
            *(_query(n, _field_schema(ep, n), ep.required(n)) for n in ep.query),
            {
                "name": "Idempotency-Key",
                "in": "header",
                "required": False,
                "description": "Names the command: the same key (per person) again answers the first outcome.",
                "schema": {"type": "string", "minLength": 1, "maxLength": MAX_KEY_LENGTH},
            },
        ],
        "responses": {
            "200": _json(_ref("Outcome"), "Applied: its events and result."),
            **{code: {"$ref": f"#/components/responses/Refused{code}"} for code in ERRORS},
            "default": {"$ref": "#/components/responses/Refused"},
        },
    }
    if msgspec.structs.fields(body):
        required = any(f.required for f in msgspec.structs.fields(body))
        op["requestBody"] = {"required": required, "content": {"application/json": {"schema": _ref(body.__name__)}}}
    return op


def _read(summary: str, path: str, query: tuple[str, ...], is_list: bool) -> dict[str, Any]:
    answer: dict[str, Any] = {"type": "array", "items": {"type": "object"}} if is_list else {"type": "object"}
    return {
        "summary": summary,
        "parameters": [*_path_parameters(path), *(_query(n) for n in query)],
        "responses": {
            "200": _json(answer, "The view."),
            "default": _json(_ref("ErrorBody"), "Refused or failed: a message and a code."),
        },
    }


@functools.cache
def served() -> bytes:
    """The document as the API serves it, made once: it is the same for the life of the process, and
    making it costs tens of milliseconds an open endpoint must not spend per call."""
    return msgspec.json.encode(document())


def document() -> dict[str, Any]:
    """The OpenAPI 3.1 document of the admin API."""
    _, components = msgspec.json.schema_components([Outcome, ErrorBody, LoginBody, *BODIES.values()], ref_template=REF)
    components = msgspec.json.decode(msgspec.json.encode(components))  # as served: a default tuple is an array
    paths: dict[str, dict[str, Any]] = {}
    for path, (summary, query, is_list) in READS.items():
        paths.setdefault(path, {})["get"] = _read(summary, path, query, is_list)
    for path, summary in PROJECTION_CHANGES.items():
        paths.setdefault(path, {})["post"] = _read(summary, path, ("name",), False)
    for ep in ENDPOINTS:
        paths.setdefault(ep.openapi_path, {})[ep.method.lower()] = _management(ep, BODIES[ep.route_name])
    paths["/api/v1/login"] = {
        "post": {
            "summary": "A session token (12 h) for a user name and password.",
            "security": [],
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("LoginBody")}}},
            "responses": {
                "200": _json({"type": "object"}, "The token, the user and when it expires."),
                "default": _json(_ref("ErrorBody"), "Wrong name or password, throttled, or disabled."),
            },
        }
    }
    # The CLI's device sign-in (services/identity/sso.py): open, like the login.
    paths["/api/v1/login/sso/{provider}/device"] = {
        "post": {
            "summary": "Start a sign-in through an OpenID provider by the device grant (`llmgw login --sso`).",
            "security": [],
            "parameters": [
                {"name": "provider", "in": "path", "required": True, "schema": {"type": "string"}},
            ],
            "responses": {
                "200": _json(
                    {"type": "object"},
                    "A handle to poll with, the code the person enters, where, and how often to poll.",
                ),
                "default": _json(_ref("ErrorBody"), "No such provider, too many under way, or the provider failed."),
            },
        }
    }
    paths["/api/v1/login/sso/device/poll"] = {
        "post": {
            "summary": "Poll a device sign-in: pending until the person confirms, then a session token.",
            "security": [],
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "properties": {"handle": {"type": "string"}},
                            "required": ["handle"],
                            "additionalProperties": False,
                        }
                    }
                },
            },
            "responses": {
                "200": _json({"type": "object"}, "The session token, the person and when it expires."),
                "202": _json({"type": "object"}, "Still pending: poll again after `retry_after_s`."),
                "default": _json(_ref("ErrorBody"), "Unknown or expired handle, refused, or denied at the provider."),
            },
        }
    }
    paths[OPENAPI_PATH] = {
        "get": {
            "summary": "This document.",
            "security": [],
            "responses": {"200": _json({"type": "object"}, "The OpenAPI 3.1 document.")},
        }
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "llmgw admin API",
            "version": "1",
            "description": "Views of the cluster, and every command the CLI sends (docs/api.md).",
        },
        "servers": [{"url": "/"}],
        "security": [{"bearer": []}],
        "paths": paths,
        "components": {
            "schemas": components,
            "responses": {
                # Refused by the command's service (an Outcome with its code), or before a command was made.
                **{f"Refused{code}": _json(REFUSED, text) for code, text in ERRORS.items()},
                "Refused": _json(REFUSED, "Another refusal or error."),
            },
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "A session token (`POST /api/v1/login`) or a personal access token.",
                }
            },
        },
    }
