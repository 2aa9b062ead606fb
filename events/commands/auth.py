"""Who signs a command, and the check every command service makes of it before deciding anything.

A caller signs with a :class:`TokenSigner` (a person: the CLI with their login's or personal
token) or a :class:`ServiceSigner` (a part of the system, its key derived from the cluster
secret). The :class:`CommandVerifier` (one per process, shared by its command services) checks,
in this order, and refuses with a reason a person can act on:

1. the command is signed (``unsigned``), by a key it knows — a live token of a person who is not
   disabled, or a service (``unknown_signer``, ``disabled``, ``expired``);
2. the signature is over these very bytes (``bad_signature``: altered, or signed by another key);
3. a person's command says it is from that person, or leaves its actor blank (``forged_actor``):
   the actor written on the events is the verified one; a service may act for a person it
   authenticated itself (the admin API at a login);
4. a person holds the role the command needs over its scope (``forbidden``), by the roles over the
   tenancy tree (:mod:`llmgw.events.commands.roles`); services are not held to roles.

The people and the tree are folded live from the log (:class:`~llmgw.events.runtime.followers.Followers`); a
signer or role not known yet is looked for again once the fold has read to the log's head, so a
token used the moment it is issued is not refused.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Protocol

import msgspec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from llmgw.events.commands import roles as R
from llmgw.events.commands import signing
from llmgw.events.commands.command import Command
from llmgw.events.folds.people import People, PeopleAndTree
from llmgw.events.runtime.follower import FollowerRegistry
from llmgw.events.runtime.followers import Followers, NotCaughtUp
from llmgw.events.runtime.secrets import signing_secret
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import people as P
from llmgw.events.schema.outcomes import Rejected


class Signer(Protocol):
    """Who signs a caller's commands: ``name`` goes in the command, ``key`` makes the signature."""

    name: str

    async def key(self) -> Ed25519PrivateKey: ...


async def sign_command(command: Command, signer: Signer) -> Command:
    """``command`` signed by ``signer``: its name in the command, the signature over the rest."""
    command = msgspec.structs.replace(command, signer=signer.name, signature="")
    return msgspec.structs.replace(command, signature=signing.sign(await signer.key(), command.signed_bytes()))


class TokenSigner:
    """A person, by one of their tokens (the CLI: a login's session token or a personal access token)."""

    def __init__(self, token: str) -> None:
        prefix = P.token_prefix(token)
        if prefix is None:
            raise ValueError("not an llmgw sign-in token (llmgw-ses-… or llmgw-pat-…): sign in with `llmgw login`")
        self.name = f"{signing.TOKEN_SIGNER}{prefix}"
        self._key = signing.token_key(token)

    async def key(self) -> Ed25519PrivateKey:
        return self._key


class ServiceSigner:
    """A part of the system (``api``, ``jobs``, ``bootstrap``…), its key derived from the command-signing
    secret (events/runtime/secrets.py), which only the control plane may read."""

    def __init__(self, store: EventStore, service: str) -> None:
        self.store = store
        self.service = service
        self.name = f"{signing.SERVICE_SIGNER}{service}"
        self._key: Ed25519PrivateKey | None = None

    async def key(self) -> Ed25519PrivateKey:
        if self._key is None:
            self._key = signing.service_key(await signing_secret(self.store.js), self.service)
        return self._key


class Verified(msgspec.Struct, frozen=True, kw_only=True):
    """Who a command is proven to come from: ``person`` when a person signed it, else a service."""

    signer: str
    actor: str
    person: str | None = None


SIGN_IN = "sign in again (`llmgw login`, or a new personal token: `llmgw ctl token create`)"


def check_token_signature(
    people: People, command: Command, now: datetime, public: Callable[[str], Ed25519PublicKey]
) -> Verified:
    """A person's signature on ``command``, checked against the people as folded (pure but for the
    key cache ``public``). Raises :class:`~llmgw.events.schema.outcomes.Rejected`."""
    prefix = command.signer.removeprefix(signing.TOKEN_SIGNER)
    found = people.by_prefix.get(prefix)
    person = people.by_name.get(found[0]) if found else None
    token = person.tokens.get(found[1]) if person and found else None
    if person is None or token is None:
        raise Rejected(f"the signing token {prefix} is unknown or was revoked: {SIGN_IN}", "unknown_signer")
    if not token.signing_key:
        raise Rejected(f"token {prefix} was issued before commands were signed: {SIGN_IN}", "unknown_signer")
    if token.expires_at is not None and token.expires_at <= now:
        raise Rejected(f"token {prefix} expired at {token.expires_at.isoformat()}: {SIGN_IN}", "expired")
    if person.disabled:
        why = f" ({person.disabled_reason})" if person.disabled_reason else ""
        raise Rejected(f"user {person.name} is disabled{why}: their commands are refused", "disabled")
    if not signing.valid(public(token.signing_key), command.signed_bytes(), command.signature):
        raise Rejected(BAD_SIGNATURE, "bad_signature")
    if command.actor not in ("", f"user:{person.name}"):
        raise Rejected(
            f"the command says it is from {command.actor} but is signed by user:{person.name}'s token: "
            "a person may act only as themself",
            "forged_actor",
        )
    return Verified(signer=command.signer, actor=f"user:{person.name}", person=person.name)


BAD_SIGNATURE = (
    "the signature does not match the command (altered on the way, or signed with another key): "
    "nothing was done; send it again with `llmgw`"
)


class CommandVerifier:
    """The check of who sent each command and whether they may (see the module), for every command
    service of a process: nothing in it depends on the service, so one instance (one fold of the
    people and the tree) serves them all.

    ``name`` is what its followers show on ``/healthz`` (``name``, ``name-tenancy``). Each
    :class:`~llmgw.events.commands.processor.CommandProcessor` that uses it calls :meth:`start` and
    :meth:`close` once; the fold follows the log from the first start until the last close.
    """

    def __init__(
        self,
        store: EventStore,
        *,
        name: str = "signers",
        registry: FollowerRegistry | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.store = store
        self.clock = clock
        self.folded = PeopleAndTree()
        self.people, self.tree = self.folded.people, self.folded.tree
        self.fold = Followers(store, PeopleAndTree.subjects(name), self.folded.apply, registry=registry)
        self._users = 0  # processors between their start and their close
        self._secret: bytes | None = None
        self._keys: dict[str, Ed25519PublicKey] = {}  # recorded public key (or svc:name) -> loaded key

    def fold_to_decide_on(self) -> Followers:
        """The verifier's fold of the people and the tree, for a service of the same process that decides
        on that very fold (the people service), so the process folds them once. It keeps what deciding
        needs (each subject's sequence, the commands that caused events) from its first event, so it
        may be shared whenever the service is made, before or after the first command started it."""
        return self.fold

    def start(self) -> None:
        """One more processor uses the verifier: follow the log (from the first)."""
        self._users += 1
        self.fold.start()

    async def close(self) -> None:
        """One processor is done with the verifier: the fold stops with the last."""
        self._users -= 1
        if self._users <= 0:
            await self.fold.close()

    def _public(self, text: str) -> Ed25519PublicKey:
        key = self._keys.get(text)
        if key is None:
            key = self._keys[text] = signing.load_public_key(text)
        return key

    async def _service_key(self, service: str) -> Ed25519PublicKey:
        name = f"{signing.SERVICE_SIGNER}{service}"
        key = self._keys.get(name)
        if key is None:
            if self._secret is None:
                self._secret = await signing_secret(self.store.js)
            key = self._keys[name] = signing.service_key(self._secret, service).public_key()
        return key

    async def verify(self, command: Command) -> Verified:
        """Who ``command`` is proven to come from; raises :class:`~llmgw.events.schema.outcomes.Rejected`."""
        if not command.signature or not command.signer:  # checked first: nothing else about it can be trusted
            raise Rejected(
                f"{command.kind} command {command.id} is not signed: send commands with `llmgw` after signing in "
                "(`llmgw login`); nothing was done",
                "unsigned",
            )
        if command.signer.startswith(signing.SERVICE_SIGNER):
            key = await self._service_key(command.signer.removeprefix(signing.SERVICE_SIGNER))
            if not signing.valid(key, command.signed_bytes(), command.signature):
                raise Rejected(BAD_SIGNATURE, "bad_signature")
            return Verified(signer=command.signer, actor=command.actor)
        if not command.signer.startswith(signing.TOKEN_SIGNER):
            raise Rejected(f"unknown kind of signer {command.signer!r}: {SIGN_IN}", "unknown_signer")
        try:
            return check_token_signature(self.people, command, self.clock(), self._public)
        except Rejected as refused:
            if refused.code != "unknown_signer":
                raise
        await self._catch_up()  # a token issued a moment ago: look again once the fold is at the head
        return check_token_signature(self.people, command, self.clock(), self._public)

    async def authorize(self, verified: Verified, need: R.Need | None) -> None:
        """Raises :class:`~llmgw.events.schema.outcomes.Rejected` (``forbidden``) when a person lacks ``need``."""
        if verified.person is None or need is None:
            return  # a service acts within its own rules
        refusal = self._refusal(verified.person, need)
        if refusal is not None:
            await self._catch_up()  # a role granted a moment ago
            refusal = self._refusal(verified.person, need)
        if refusal is not None:
            raise Rejected(refusal, "forbidden")

    def _refusal(self, name: str, need: R.Need) -> str | None:
        person = self.people.by_name.get(name)
        chain, scope_label = self.tree.chain(need.kind, need.tenant)
        bindings = person.roles if person is not None else []
        return R.refusal(name, bindings, need.role, chain, scope_label, need.what, self.tree.label)

    async def _catch_up(self) -> None:
        try:
            await self.fold.catch_up()
        except NotCaughtUp as exc:
            raise Rejected(str(exc), "unavailable") from exc
