"""The people service's decisions: pure functions over the folded :class:`~llmgw.events.folds.people.People`."""

from __future__ import annotations

import re
from datetime import datetime

import msgspec

from llmgw.events.commands import roles as R
from llmgw.events.commands import signing
from llmgw.events.commands.shell import Decision
from llmgw.events.folds.people import People, PeopleAndTree, Person
from llmgw.events.folds.tenancy import TenancyTree
from llmgw.events.schema import people as P
from llmgw.events.schema.ids import new_id
from llmgw.events.schema.outcomes import Rejected
from llmgw.events.schema.subjects import event_subject

MAX_DISPLAY = 100
MAX_LABEL = 100
MAX_REASON = 500
_PREFIX = re.compile(r"^[a-z0-9]{8}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# argon2id only, with parameters at least OWASP's minimum (19 MiB, 2 passes): a weaker hash is refused.
_ARGON2ID = re.compile(r"^\$argon2id\$v=19\$m=(\d+),t=(\d+),p=(\d+)\$[A-Za-z0-9+/]+\$[A-Za-z0-9+/]+$")
MIN_MEMORY_KIB = 19 * 1024
MIN_PASSES = 2


def decide(state: PeopleAndTree, c: P.PeopleCommand, now: datetime) -> Decision:
    """Pure: a people command over the people → its :class:`Decision`, or a refusal. The tree resolves
    a role's scope (``team:acme/ml``) to its id on the log."""
    people, tree = state.people, state.tree
    match c:
        case P.AddUser():
            return _add(people, c)
        case P.SetPassword():
            person = _person(people, c.name)
            if person.source:
                raise Rejected(
                    f"{person.name} signs in through {person.source}, which keeps their password; "
                    "a person from a provider has no password here",
                    "provider_account",
                )
            _check_hash(c.password_hash)
            return _decision(person, [P.PasswordSet(name=person.name, password_hash=c.password_hash)], "password set")
        case P.DisableUser():
            person = _person(people, c.name)
            if person.disabled:
                return Decision(message=f"{person.name} is disabled already")
            _check_text("reason", c.reason, MAX_REASON)
            tokens = len(person.tokens)
            return _decision(
                person,
                [P.UserDisabled(name=person.name, reason=c.reason)],
                f"{person.name} is disabled: {tokens} token(s) stop working at once",
            )
        case P.EnableUser():
            person = _person(people, c.name)
            if not person.disabled:
                return Decision(message=f"{person.name} is not disabled")
            return _decision(person, [P.UserEnabled(name=person.name)], f"{person.name} may sign in again")
        case P.GrantRole():
            person = _person(people, c.name)
            scope, label = role_scope(c.role, c.scope, tree)
            if (c.role, scope) in person.roles:
                return Decision(message=f"{person.name} is {R.needs(c.role, label)} already")
            return _decision(
                person,
                [P.RoleGranted(name=person.name, role=c.role, scope=scope)],
                f"{person.name} is {R.needs(c.role, label)}",
            )
        case P.RevokeRole():
            person = _person(people, c.name)
            scope, label = role_scope(c.role, c.scope, tree)
            if (c.role, scope) not in person.roles:
                held = ", ".join(f"{r} of {s}" for r, s in person.roles) or "none"
                raise Rejected(
                    f"{person.name} does not hold {R.needs(c.role, label)} (their roles: {held})", "not_found"
                )
            return _decision(
                person,
                [P.RoleRevoked(name=person.name, role=c.role, scope=scope)],
                f"{person.name} is no longer {R.needs(c.role, label)}",
            )
        case P.SetLanguage():
            person = _person(people, c.name)
            language = c.language.strip()
            if language and language not in P.LANGUAGES:
                raise Rejected(
                    f"the console speaks {', '.join(P.LANGUAGES)}, not {language[:20]!r}; give one of them "
                    "(or an empty one to follow the browser's language)",
                    "invalid_language",
                )
            shown = language or "the browser's language"
            if language == person.language:
                return Decision(message=f"{person.name} reads the console in {shown} already")
            return _decision(
                person,
                [P.LanguageSet(name=person.name, language=language)],
                f"{person.name} reads the console in {shown}",
            )
        case P.IssueToken():
            return _issue(people, c, now)
        case P.ProvisionUser():
            return _provision(people, c)
        case P.RemoveUser():
            person = _person(people, c.name)
            return _decision(
                person,
                [P.UserRemoved(name=person.name)],
                f"{person.name} removed: {len(person.tokens)} token(s) stop working at once; the log keeps their past",
            )
        case P.SyncRoles():
            return _sync_roles(people, tree, c)
        case P.RevokeToken():
            person = _person(people, c.name)
            token = people.find_token(person, c.token.strip())
            if token is None:
                raise Rejected(
                    f"{person.name} has no token {c.token.strip()!r}: give its id or prefix (`llmgw ctl user list`)",
                    "not_found",
                )
            _check_text("reason", c.reason, MAX_REASON)
            return _decision(
                person,
                [P.TokenRevoked(name=person.name, token_id=token.token_id, reason=c.reason)],
                f"token {token.prefix} of {person.name} revoked",
            )
    raise Rejected(f"unknown people command {type(c).__name__}", "unknown")  # pragma: no cover - a closed union


def _add(people: People, c: P.AddUser) -> Decision:
    if not P.NAME_RE.match(c.name):
        raise Rejected(
            f"{c.name[:40]!r} is not a user name: lower-case letters, digits, '.', '_' and '-', starting with a "
            "letter, at most 63",
            "invalid_name",
        )
    if c.name in people.by_name:
        raise Rejected(f"user {c.name} exists; change their password with `llmgw ctl user passwd {c.name}`", "exists")
    _check_text("display name", c.display_name, MAX_DISPLAY)
    _check_hash(c.password_hash)
    return Decision(
        subject=event_subject(P.AGGREGATE, c.name),
        payloads=[
            P.UserAdded(name=c.name, display_name=c.display_name),
            P.PasswordSet(name=c.name, password_hash=c.password_hash),
        ],
        message=f"user {c.name} added",
        result={"user": c.name},
    )


def _provision(people: People, c: P.ProvisionUser) -> Decision:
    """A person as their provider says they are: made on first sight (without a password), else their
    profile and whether they may sign in brought in line. A person added here is never taken over."""
    source, login = c.source.strip(), c.login.strip()
    if not (source.startswith("idp:") or source == "scim") or len(source) > 40:
        raise Rejected(f"a provisioned person's source is idp:NAME or scim, not {source[:40]!r}", "invalid_source")
    if not login or len(login) > 256 or not login.isprintable():
        raise Rejected("the provider's user name must be 1 to 256 printable characters", "invalid_login")
    for what, value in (("display name", c.display_name), ("email", c.email), ("external id", c.external_id)):
        _check_text(what, value, 256 if what != "display name" else MAX_DISPLAY)
    person = people.by_name.get(c.name.strip()) if c.name.strip() else people.by_provider_login(login)
    if person is not None and not person.source:
        raise Rejected(
            f"{person.name} was added here with a password, so no provider may sign them in or change them; "
            f"sign in as {person.name} with the password, or remove the clash at the provider",
            "local_account",
        )
    if person is not None and person.login.lower() != login.lower() and c.name.strip():
        clash = people.by_provider_login(login)
        if clash is not None and clash.name != person.name:
            raise Rejected(f"the user name {login!r} belongs to {clash.name} already", "exists")
    if person is None:
        return _new_provisioned(people, c, source, login)
    payloads: list[msgspec.Struct] = []
    profile = P.ProfileSet(
        name=person.name, login=login, display_name=c.display_name, email=c.email, external_id=c.external_id
    )
    if (person.login, person.display_name, person.email, person.external_id) != (
        login,
        c.display_name,
        c.email,
        c.external_id,
    ):
        payloads.append(profile)
    if c.active and person.disabled:
        payloads.append(P.UserEnabled(name=person.name))
    elif not c.active and not person.disabled:
        payloads.append(P.UserDisabled(name=person.name, reason=f"deactivated by {source}"))
    if not payloads:
        return Decision(message=f"{person.name} is so already", result={"user": person.name})
    what = "deactivated" if not c.active and not person.disabled else "updated"
    tokens = f": {len(person.tokens)} token(s) stop working at once" if what == "deactivated" else ""
    return _decision(person, payloads, f"{person.name} {what} by {source}{tokens}")


def _new_provisioned(people: People, c: P.ProvisionUser, source: str, login: str) -> Decision:
    name = c.name.strip() or P.person_name(login)
    if not P.NAME_RE.match(name):
        raise Rejected(f"{name[:40]!r} cannot be a user name here", "invalid_name")
    base, n = name, 2
    while name in people.by_name:  # two logins that come to one name: the later gets a number
        if c.name.strip():
            raise Rejected(f"user {name} exists", "exists")
        name = f"{base[:60]}-{n}"
        n += 1
    payloads: list[msgspec.Struct] = [
        P.UserAdded(
            name=name,
            display_name=c.display_name,
            source=source,
            login=login,
            email=c.email,
            external_id=c.external_id,
        )
    ]
    if not c.active:
        payloads.append(P.UserDisabled(name=name, reason=f"deactivated by {source}"))
    return Decision(
        subject=event_subject(P.AGGREGATE, name),
        payloads=payloads,
        message=f"user {name} made by {source} (no password here)",
        result={"user": name, "created": True},
    )


def _sync_roles(people: People, tree: TenancyTree, c: P.SyncRoles) -> Decision:
    """The person's roles from ``c.provider``'s mappings become exactly ``c.grants``; roles granted by
    hand, or by another provider's mappings, stay as they are."""
    person = _person(people, c.name)
    provider = c.provider.strip()
    if not provider:
        raise Rejected("say which provider's groups these are", "invalid_provider")
    wanted = {(g.role, g.scope): g for g in c.grants}
    for role, scope in wanted:
        if role not in R.RANKS or R.kind_of(scope) not in R.BINDABLE[role]:
            raise Rejected(f"{role} cannot be bound to {scope}", "invalid_scope")
    payloads: list[msgspec.Struct] = []
    groups = tuple(c.groups)
    if person.groups.get(provider) != groups:
        payloads.append(P.GroupsSeen(name=person.name, provider=provider, groups=groups))
    for (role, scope), grant in wanted.items():
        if (role, scope) not in person.roles:
            payloads.append(
                P.RoleGranted(
                    name=person.name,
                    role=role,
                    scope=scope,
                    provider=provider,
                    group=grant.group,
                    mapping=grant.mapping,
                )
            )
    revoked = []
    for role, scope in person.roles:
        via = person.via(role, scope)
        if via is not None and via[0] == provider and (role, scope) not in wanted:
            payloads.append(P.RoleRevoked(name=person.name, role=role, scope=scope, provider=provider))
            revoked.append(R.needs(role, tree.label(scope)))
    if not payloads:
        return Decision(message=f"{person.name}'s roles follow their groups already", result={"user": person.name})
    granted = [R.needs(g.role, tree.label(g.scope)) for g in c.grants if (g.role, g.scope) not in person.roles]
    said = "; ".join(
        part
        for part in (
            f"granted {', '.join(granted)}" if granted else "",
            f"revoked {', '.join(revoked)}" if revoked else "",
        )
        if part
    )
    return _decision(
        person, payloads, f"{person.name}'s roles follow their groups at {provider}: {said or 'groups seen'}"
    )


def _issue(people: People, c: P.IssueToken, now: datetime) -> Decision:
    person = _person(people, c.name)
    if person.disabled:
        raise Rejected(
            f"{person.name} is disabled: enable them first (`llmgw ctl user enable {person.name}`)", "disabled"
        )
    if c.kind not in P.TOKEN_KINDS:
        raise Rejected(f"a token is one of {', '.join(P.TOKEN_KINDS)}, not {c.kind!r}", "invalid_kind")
    if not _PREFIX.match(c.prefix) or not _SHA256.match(c.secret_sha256):
        raise Rejected("the token's prefix or hash is not in the format llmgw makes", "invalid_token")
    if c.prefix in people.by_prefix:
        raise Rejected(f"token prefix {c.prefix} is taken; make a new token and send it again", "taken")
    if c.expires_at is not None and c.expires_at <= now:
        raise Rejected(f"the token would expire at {c.expires_at.isoformat()}, which has passed", "invalid_expiry")
    _check_text("label", c.label, MAX_LABEL)
    if c.signing_key:
        try:
            signing.load_public_key(c.signing_key)
        except ValueError as exc:
            raise Rejected(f"the token's signing key is not an Ed25519 public key ({exc})", "invalid_token") from exc
    token_id = new_id()
    return _decision(
        person,
        [
            P.TokenIssued(
                name=person.name,
                token_id=token_id,
                prefix=c.prefix,
                secret_sha256=c.secret_sha256,
                kind=c.kind,
                label=c.label,
                expires_at=c.expires_at,
                signing_key=c.signing_key,
                method=c.method,
            )
        ],
        f"{c.kind} token {c.prefix} issued to {person.name}",
        {"token_id": token_id, "prefix": c.prefix},
    )


def role_scope(role: str, text: str, tree: TenancyTree) -> tuple[str, str]:
    """(the scope as the log keeps it, as a person reads it) for binding ``role`` to ``text``."""
    if role not in R.RANKS:
        raise Rejected(f"there is no role {role!r}: the roles are {', '.join(R.ROLES)}", "invalid_role")
    text = text.strip()
    kind, _, path = text.partition(":")
    kind = R.CLUSTER if text == R.CLUSTER else kind
    if kind not in R.BINDABLE[role]:
        where = " or ".join(R.BINDABLE[role])
        raise Rejected(f"{role} is bound to a {where}, not {text!r}", "invalid_scope")
    if kind == R.CLUSTER:
        return R.CLUSTER, R.CLUSTER
    if kind not in ("org", "team", "project") or not path:
        raise Rejected(
            f"{text!r} is not a scope: write cluster, org:ORG, team:ORG/TEAM or project:O/T/P", "invalid_scope"
        )
    found = tree.find(kind, path)
    if found is None:
        raise Rejected(f"there is no {kind} {path!r}: see `llmgw ctl tree`", "not_found")
    return f"{kind}:{found.id}", f"{kind}:{tree.path(found)}"


def _person(people: People, name: str) -> Person:
    person = people.by_name.get(name.strip())
    if person is None:
        known = ", ".join(sorted(people.by_name)[:20])
        raise Rejected(
            f"there is no user {name.strip()[:40]!r}"
            + (f" (users: {known})" if known else "")
            + ": add them with `llmgw ctl user add NAME`",
            "not_found",
        )
    return person


def _decision(person: Person, payloads: list, message: str, result: dict | None = None) -> Decision:
    return Decision(
        subject=event_subject(P.AGGREGATE, person.name),
        payloads=payloads,
        message=message,
        result={"user": person.name, **(result or {})},
    )


def _check_hash(password_hash: str) -> None:
    m = _ARGON2ID.match(password_hash)
    if m is None or int(m.group(1)) < MIN_MEMORY_KIB or int(m.group(2)) < MIN_PASSES:
        raise Rejected(
            "the password must arrive as an argon2id hash of at least 19 MiB and 2 passes, as `llmgw ctl user` "
            "makes it; a password is never sent as it is",
            "invalid_password_hash",
        )


def _check_text(what: str, value: str, most: int) -> None:
    if len(value) > most or not value.isprintable():
        raise Rejected(f"the {what} must be at most {most} printable characters", f"invalid_{what.replace(' ', '_')}")


# The least admin role that manages people's roles over a tenant of each kind.
_GRANTED_BY = {"org": "org-admin", "team": "team-admin", "project": "team-admin"}


_VERBS = {
    P.AddUser: "adding user",
    P.DisableUser: "disabling user",
    P.EnableUser: "enabling user",
    P.SetPassword: "setting the password of",
    P.IssueToken: "issuing a token to",
    P.RevokeToken: "revoking a token of",
    P.SetLanguage: "setting the language of",
    P.ProvisionUser: "provisioning user",
    P.RemoveUser: "removing user",
    P.SyncRoles: "syncing the roles of",
}


def need(actor: str, c: P.PeopleCommand) -> R.Need | None:
    """The role a person (``actor``, verified) needs to send ``c`` (pure); None: anyone may, for themself.

    A person sets their own password and language and issues and revokes their own tokens; adding,
    disabling and enabling people is the cluster admins'. A role over a tenant is granted by that tenant's admins,
    and never above what the granter holds (a team admin cannot make an org admin)."""
    own = actor == f"user:{c.name}"
    match c:
        case P.SetPassword() | P.IssueToken() | P.RevokeToken() | P.SetLanguage() if own:
            return None
        case P.GrantRole() | P.RevokeRole():
            verb = "granting" if isinstance(c, P.GrantRole) else "revoking"
            what = f"{verb} {c.role} of {c.scope}"
            kind, _, tenant = c.scope.partition(":")
            if kind not in _GRANTED_BY or c.role not in R.RANKS:
                return R.cluster_admin(what)
            role = max(_GRANTED_BY[kind], c.role, key=lambda r: R.RANKS[r])
            return R.Need(role=role, what=what, kind=kind, tenant=tenant)
    return R.cluster_admin(f"{_VERBS[type(c)]} {c.name or getattr(c, 'login', '')}")
