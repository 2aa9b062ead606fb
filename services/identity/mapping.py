"""Groups to roles (SPEC ID-3): which roles a person's groups at a provider grant, as a pure rule.

A mapping names a group as its provider does: an OIDC group (``ml-admins``), an LDAP group's DN
(``cn=ml-admins,ou=groups,dc=example,dc=org``) or, for a DN, just its name (``ml-admins`` matches the DN
whose first value is ml-admins), a SCIM group's displayName. Matching ignores case, as directories do.
"""

from __future__ import annotations

from collections.abc import Iterable

from llmgw.events.folds.identity import Mapping
from llmgw.events.schema import people as P


def _names(group: str) -> set[str]:
    """What a group a provider reports can be called by: itself and, for a DN, its first RDN's value."""
    text = group.strip().lower()
    names = {text}
    first, sep, _ = text.partition(",")
    key, eq, value = first.partition("=")
    if sep and eq and key.strip() and value.strip():
        names.add(value.strip())
    return names


def matches(mapping_group: str, group: str) -> bool:
    wanted = mapping_group.strip().lower()
    if "=" in wanted:  # a DN matches only the very DN (spaces after commas are not significant)
        return _dn(wanted) == _dn(group.lower())
    return wanted in _names(group)


def _dn(text: str) -> str:
    return ",".join(part.strip() for part in text.split(","))


def grants_for(mappings: Iterable[Mapping], groups: Iterable[str]) -> tuple[P.MappedGrant, ...]:
    """The roles ``groups`` grant through ``mappings``, each (role, scope) once, the first mapping naming it."""
    groups = list(groups)
    seen: set[tuple[str, str]] = set()
    grants: list[P.MappedGrant] = []
    for m in mappings:
        hit = next((g for g in groups if matches(m.group, g)), None)
        if hit is None or (m.role, m.scope) in seen:
            continue
        seen.add((m.role, m.scope))
        grants.append(P.MappedGrant(role=m.role, scope=m.scope, group=m.group, mapping=m.mapping_id))
    return tuple(grants)


def no_role_refusal(person: str, provider: str, groups: Iterable[str], mappings: Iterable[Mapping]) -> str:
    """What a person whose groups map to no role, and who holds none here, reads: the groups they are in,
    any of which an administrator could map (or, in none, the groups that are mapped)."""
    groups = sorted({g for g in groups})
    if groups:
        shown = ", ".join(groups[:10]) + (f" (and {len(groups) - 10} more)" if len(groups) > 10 else "")
        return f"{person} is in no group mapped to a role: ask an administrator to map one of {shown}"
    mapped = sorted({m.group for m in mappings})
    if mapped:
        return f"{person} is in no group at {provider}: ask its administrators to add them to one of " + ", ".join(
            mapped[:10]
        )
    return f"{person} is in no group at {provider}, and none of its groups is mapped to a role: ask an administrator"
