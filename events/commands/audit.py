"""The log as evidence: every command's signature checked again, long after it was carried out.

Each command's outcome keeps the command's bytes as received (:mod:`llmgw.events.schema.outcomes`), so
`llmgw events verify` can prove who asked for every change: a person's command against the public
key recorded when their token was issued (kept after the token is revoked: it was valid then), a
service's against the key derived from the cluster secret. A carried-out command whose signature
does not hold means the log was altered after the fact.
"""

from __future__ import annotations

import msgspec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from llmgw.events.commands import signing
from llmgw.events.commands.command import Command
from llmgw.events.schema import people as P
from llmgw.events.schema.envelope import RecordedEvent
from llmgw.events.schema.outcomes import CommandCompleted, CommandRejected

# Refusals at the time for who sent it: their signatures were never good, and they changed nothing.
REFUSED_AS_UNPROVEN = ("unsigned", "bad_signature", "unknown_signer", "forged_actor", "disabled", "expired")


class Failure(msgspec.Struct, frozen=True, kw_only=True):
    command_id: str
    kind: str
    requested_by: str
    signer: str
    why: str
    seq: int


class Verification(msgspec.Struct, kw_only=True):
    """What `llmgw events verify` found."""

    checked: int = 0  # carried out, and their signatures hold
    refused: int = 0  # refused when sent, as unproven (nothing applied)
    not_kept: int = 0  # outcomes from before commands were kept with them
    failures: list[Failure] = []
    signers: dict[str, int] = {}  # who signed the commands checked

    @property
    def ok(self) -> bool:
        return not self.failures


class CommandAudit:
    """Checks the command outcomes of a log read in order (:meth:`apply` each event)."""

    def __init__(self, secret: bytes = b"") -> None:
        """``secret``: the cluster secret, to check services' signatures (without it they are failures)."""
        self.secret = secret
        self.result = Verification(signers={})
        self._token_keys: dict[str, str] = {}  # token prefix -> public key, every token ever issued
        self._services: dict[str, Ed25519PublicKey] = {}

    def apply(self, event: RecordedEvent) -> None:
        p = event.payload
        if isinstance(p, P.TokenIssued) and p.signing_key:
            self._token_keys[p.prefix] = p.signing_key
        elif isinstance(p, CommandCompleted | CommandRejected):
            self._outcome(event, p)

    def _outcome(self, event: RecordedEvent, p: CommandCompleted | CommandRejected) -> None:
        if bytes(p.command) == b"null":
            self.result.not_kept += 1
            return
        if isinstance(p, CommandRejected) and p.code in REFUSED_AS_UNPROVEN:
            self.result.refused += 1
            return
        why = ""
        try:
            command = msgspec.json.decode(p.command, type=Command)
        except msgspec.DecodeError as exc:
            command, why = None, f"the kept command does not decode: {exc}"
        if command is not None:
            why = self._check(command)
        if why:
            self.result.failures.append(
                Failure(
                    command_id=command.id if command else "",
                    kind=p.kind,
                    requested_by=p.requested_by,
                    signer=p.signer,
                    why=why,
                    seq=event.seq,
                )
            )
            return
        self.result.checked += 1
        self.result.signers[p.signer] = self.result.signers.get(p.signer, 0) + 1

    def _check(self, command: Command) -> str:
        """Why ``command``'s signature does not hold ("" when it does)."""
        if command.signer.startswith(signing.TOKEN_SIGNER):
            text = self._token_keys.get(command.signer.removeprefix(signing.TOKEN_SIGNER))
            if text is None:
                return f"signed by {command.signer}, a token the log never issued"
            public = signing.load_public_key(text)
        elif command.signer.startswith(signing.SERVICE_SIGNER):
            service = command.signer.removeprefix(signing.SERVICE_SIGNER)
            public = self._services.get(service) or self._service(service)
            if public is None:
                return f"signed by {command.signer}, and no cluster secret was given to check a service's key"
        else:
            return f"signed by {command.signer!r}, not a kind of signer llmgw knows"
        if not signing.valid(public, command.signed_bytes(), command.signature):
            return "the signature does not match the kept command: the log was altered"
        return ""

    def _service(self, service: str) -> Ed25519PublicKey | None:
        if not self.secret:
            return None
        self._services[service] = signing.service_key(self.secret, service).public_key()
        return self._services[service]
