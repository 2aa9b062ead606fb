"""The admin API's views of the company's identity (SPEC ID-1 to ID-4): providers, group mappings, SCIM tokens.

Read from the sign-in's live fold (``SignIn.identity``), so a provider added a moment ago is listed as
soon as its event is read. A provider's secret never reaches the log, so it cannot reach these views
either: only the name of the environment variable the server reads it from. A SCIM token is shown by
its prefix and label, never its hash. Each view needs a viewer of the cluster (app.py's ``_authorize``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import web

from llmgw.events.folds.identity import Identity, Mapping, Provider, ScimToken
from llmgw.events.schema import identity as I

PROVIDERS_PATH = "/api/v1/identity/providers"
MAPPINGS_PATH = "/api/v1/identity/mappings"
SCIM_TOKENS_PATH = "/api/v1/scim-tokens"


def provider_view(p: Provider, mappings: int) -> dict[str, Any]:
    """One provider as the views show it: its settings (secret-free by construction) and how many mappings."""
    settings = p.oidc if p.kind == "oidc" else p.ldap
    where = p.oidc.issuer if p.oidc else p.ldap.url if p.ldap else ""
    secret_env = p.oidc.client_secret_env if p.oidc else p.ldap.bind_password_env if p.ldap else ""
    return {
        "name": p.name,
        "kind": p.kind,
        "display_name": p.display_name,
        "shown": p.shown,
        "where": where,  # the issuer of an OIDC provider, the URL of a directory
        "secret_env": secret_env,
        "settings": msgspec.to_builtins(settings) if settings is not None else {},
        "mappings": mappings,
        "added_at": p.added_at.isoformat(),
        "changed_at": p.changed_at.isoformat(),
    }


def providers_view(identity: Identity) -> list[dict[str, Any]]:
    """Every provider, by name."""
    return [
        provider_view(p, len(identity.mappings_of(p.name)))
        for p in sorted(identity.providers.values(), key=lambda p: p.name)
    ]


def mapping_view(m: Mapping, label: Callable[[str], str]) -> dict[str, Any]:
    return {
        "id": m.mapping_id,
        "provider": m.provider,
        "group": m.group,
        "role": m.role,
        "scope": m.scope,  # as the log keeps it (team:<id>)
        "scope_label": label(m.scope),  # as people name it (team:acme/ml)
    }


def mappings_view(identity: Identity, label: Callable[[str], str], provider: str = "") -> list[dict[str, Any]]:
    """Every group mapping (of one provider, or ``scim``, when given), providers by name, each in the order made."""
    names = [provider] if provider else sorted(identity.mappings)
    return [mapping_view(m, label) for name in names for m in identity.mappings_of(name)]


def scim_token_view(t: ScimToken) -> dict[str, Any]:
    return {"id": t.token_id, "prefix": t.prefix, "label": t.label, "issued_at": t.issued_at.isoformat()}


def scim_tokens_view(identity: Identity) -> list[dict[str, Any]]:
    return [scim_token_view(t) for t in sorted(identity.scim_tokens_by_prefix.values(), key=lambda t: t.issued_at)]


class IdentityViews:
    """The handlers, over a function giving the sign-in's fold and one naming a scope."""

    def __init__(self, identity: Callable[[], Identity], label: Callable[[str], str]) -> None:
        self.identity = identity
        self.label = label

    def routes(self, app: web.Application) -> None:
        app.router.add_get(PROVIDERS_PATH, self.providers)
        app.router.add_get(MAPPINGS_PATH, self.mappings)
        app.router.add_get(SCIM_TOKENS_PATH, self.scim_tokens)

    async def providers(self, request: web.Request) -> web.Response:
        """``GET /api/v1/identity/providers``: the OIDC providers and LDAP directories, never a secret."""
        return web.json_response(providers_view(self.identity()))

    async def mappings(self, request: web.Request) -> web.Response:
        """``GET /api/v1/identity/mappings[?provider=NAME]``: groups mapped to roles (``scim`` for SCIM groups)."""
        identity = self.identity()
        provider = request.query.get("provider", "").strip()
        if provider and provider != I.SCIM and provider not in identity.providers:
            known = ", ".join([*sorted(identity.providers), I.SCIM])
            return web.json_response(
                {
                    "error": {
                        "message": f"there is no identity provider {provider[:40]!r} (providers: {known})",
                        "code": "not_found",
                    }
                },
                status=404,
            )
        return web.json_response(mappings_view(identity, self.label, provider))

    async def scim_tokens(self, request: web.Request) -> web.Response:
        """``GET /api/v1/scim-tokens``: the SCIM bearer tokens by prefix and label (never a hash)."""
        return web.json_response(scim_tokens_view(self.identity()))
