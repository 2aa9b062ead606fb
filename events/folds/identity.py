"""Identity providers folded from their events: the one place providers, mappings and SCIM state are computed.

The identity service decides on it, the admin API's sign-in reads providers and mappings from it, and
the SCIM endpoint checks its bearer tokens and serves its groups from it.
"""

from __future__ import annotations

from datetime import datetime

import msgspec

from llmgw.events.schema import identity as I
from llmgw.events.schema.envelope import RecordedEvent
from llmgw.events.schema.subjects import EVENTS_ROOT, aggregate_of


class Mapping(msgspec.Struct, kw_only=True):
    mapping_id: str
    provider: str
    group: str
    role: str
    scope: str  # as the log keeps it


class Provider(msgspec.Struct, kw_only=True):
    name: str
    kind: str  # oidc | ldap
    display_name: str = ""
    oidc: I.OidcSettings | None = None
    ldap: I.LdapSettings | None = None
    added_at: datetime
    changed_at: datetime

    @property
    def shown(self) -> str:
        return self.display_name or self.name


class ScimToken(msgspec.Struct, kw_only=True):
    token_id: str
    prefix: str
    secret_sha256: str
    label: str = ""
    issued_at: datetime


class ScimGroup(msgspec.Struct, kw_only=True):
    group_id: str
    display_name: str
    external_id: str = ""
    members: tuple[str, ...] = ()
    created_at: datetime
    updated_at: datetime


class Identity(msgspec.Struct, kw_only=True):
    providers: dict[str, Provider] = {}
    mappings: dict[str, list[Mapping]] = {}  # provider (or ``scim``) -> its mappings, in the order made
    scim_tokens_by_prefix: dict[str, ScimToken] = {}
    scim_groups: dict[str, ScimGroup] = {}
    position: int = 0

    @staticmethod
    def subjects() -> tuple[str, str]:
        return f"{EVENTS_ROOT}.{I.AGGREGATE}.>", f"{EVENTS_ROOT}.{I.SCIM_GROUP_AGGREGATE}.>"

    def mappings_of(self, provider: str) -> list[Mapping]:
        return self.mappings.get(provider, [])

    def find_mapping(self, provider: str, mapping: str) -> Mapping | None:
        return next((m for m in self.mappings_of(provider) if m.mapping_id == mapping), None)

    def scim_groups_of(self, person: str) -> list[ScimGroup]:
        return [g for g in self.scim_groups.values() if person in g.members]

    def apply(self, event: RecordedEvent) -> None:
        """Fold one event of ``llmgw.evt.idp.>`` or ``llmgw.evt.scimgroup.>`` (others are ignored)."""
        self.position = max(self.position, event.seq)
        try:
            aggregate, _ = aggregate_of(event.subject)
        except ValueError:
            return
        if aggregate not in (I.AGGREGATE, I.SCIM_GROUP_AGGREGATE):
            return
        p, at = event.payload, event.envelope.at
        if isinstance(p, I.ProviderSet):
            old = self.providers.get(p.name)
            self.providers[p.name] = Provider(
                name=p.name,
                kind=p.kind,
                display_name=p.display_name,
                oidc=p.oidc,
                ldap=p.ldap,
                added_at=old.added_at if old else at,
                changed_at=at,
            )
        elif isinstance(p, I.ProviderRemoved):
            self.providers.pop(p.name, None)
            self.mappings.pop(p.name, None)
        elif isinstance(p, I.GroupMapped):
            self.mappings.setdefault(p.provider, []).append(
                Mapping(mapping_id=p.mapping_id, provider=p.provider, group=p.group, role=p.role, scope=p.scope)
            )
        elif isinstance(p, I.GroupUnmapped):
            kept = [m for m in self.mappings_of(p.provider) if m.mapping_id != p.mapping_id]
            self.mappings[p.provider] = kept
        elif isinstance(p, I.ScimTokenIssued):
            self.scim_tokens_by_prefix[p.prefix] = ScimToken(
                token_id=p.token_id, prefix=p.prefix, secret_sha256=p.secret_sha256, label=p.label, issued_at=at
            )
        elif isinstance(p, I.ScimTokenRevoked):
            for prefix, token in list(self.scim_tokens_by_prefix.items()):
                if token.token_id == p.token_id:
                    del self.scim_tokens_by_prefix[prefix]
        elif isinstance(p, I.ScimGroupSet):
            old_group = self.scim_groups.get(p.group_id)
            self.scim_groups[p.group_id] = ScimGroup(
                group_id=p.group_id,
                display_name=p.display_name,
                external_id=p.external_id,
                members=p.members,
                created_at=old_group.created_at if old_group else at,
                updated_at=at,
            )
        elif isinstance(p, I.ScimGroupRemoved):
            self.scim_groups.pop(p.group_id, None)
