"""`llmgw bench signing`: what signed commands cost (issue "Trust": ≤ 1.2× the latency of a command
before signing; ≥ 5,000 signature checks a second on one core).

Two figures, each against a baseline measured in the same run:

- **Checks per second**: :func:`~llmgw.events.commands.auth.check_token_signature` (what a command
  service runs for a person's command: find the token, check the signature, the actor) over many
  signed commands, on this one thread; beside it the bare Ed25519 verification of the same bytes.
- **End to end**: a command sent by :class:`~llmgw.events.commands.client.CommandClient`, signed with a
  person's token, verified and authorized by the tenancy service, decided, appended, and its
  outcome read back — against the same service whose verifier accepts everything unchecked (what
  a command cost before signing), rounds alternating so that both see the same machine.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import msgspec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from llmgw.bench import BenchError
from llmgw.bench.backbone import nats_server
from llmgw.events.commands import roles as R
from llmgw.events.commands import signing
from llmgw.events.commands.auth import TokenSigner, Verified, check_token_signature
from llmgw.events.commands.client import CommandClient
from llmgw.events.commands.command import Command
from llmgw.events.folds.people import People
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import people as P
from llmgw.events.schema import tenancy as T
from llmgw.events.schema.catalog import default_registry
from llmgw.events.schema.envelope import Envelope, RecordedEvent, utc_now
from llmgw.events.schema.ids import new_id
from llmgw.services.people.service import PeopleService
from llmgw.services.tenancy.service import TenancyService

HASH = "$argon2id$v=19$m=19456,t=2,p=1$c2FsdHNhbHRzYWx0$aGFzaGhhc2hoYXNoaGFzaGhhc2hoYXNoaGFzaGhhc2g"


class SigningResult(msgspec.Struct, kw_only=True):
    checks: int
    checks_per_s: float  # check_token_signature, one thread
    bare_verify_per_s: float  # Ed25519 verification alone
    rounds: int
    signed_ms: list[float]  # median of each round, signed and checked
    unchecked_ms: list[float]  # median of each round, the verifier accepting everything

    @property
    def ratio(self) -> float:
        return statistics.median(self.signed_ms) / statistics.median(self.unchecked_ms)


def _people_with(token: str) -> People:
    people = People()
    registry = default_registry()
    _, issue = P.issue("bench", "personal", token=token)
    at = datetime.now(UTC)
    for seq, payload in enumerate(
        (
            P.UserAdded(name="bench"),
            P.TokenIssued(
                name="bench",
                token_id="t1",
                prefix=issue.prefix,
                secret_sha256=issue.secret_sha256,
                kind="personal",
                signing_key=issue.signing_key,
            ),
        ),
        start=1,
    ):
        env = Envelope(id=f"e{seq}", type=registry.type_of(payload).name, at=at, actor="system:bench")
        people.apply(RecordedEvent(subject="llmgw.evt.user.bench", seq=seq, envelope=env, payload=payload))
    return people


async def checks_per_second(n: int) -> tuple[float, float]:
    token = P.make_token("personal")[0]
    people = _people_with(token)
    key = signing.token_key(token)
    signer = TokenSigner(token)
    commands = []
    for i in range(n):
        c = Command(
            id=new_id(),
            kind="tenancy.create",
            actor="",
            at=utc_now(),
            signer=signer.name,
            data=msgspec.Raw(msgspec.json.encode(T.CreateScope(kind="org", path=f"org-{i}"))),
        )
        commands.append(msgspec.structs.replace(c, signature=signing.sign(key, c.signed_bytes())))
    keys: dict[str, Ed25519PublicKey] = {}

    def public(text: str) -> Ed25519PublicKey:
        if text not in keys:
            keys[text] = signing.load_public_key(text)
        return keys[text]

    now = datetime.now(UTC)
    t0 = time.perf_counter()
    for c in commands:
        check_token_signature(people, c, now, public)
    checked = n / (time.perf_counter() - t0)
    pub = key.public_key()
    blobs = [(c.signed_bytes(), c.signature) for c in commands]
    t0 = time.perf_counter()
    for message, signature in blobs:
        signing.valid(pub, message, signature)
    bare = n / (time.perf_counter() - t0)
    return checked, bare


class _Unchecked:
    """A verifier that accepts every command as its actor says: what a command service did before signing."""

    def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def verify(self, command: Command) -> Verified:
        return Verified(signer=command.signer, actor=command.actor or "user:bench")

    async def authorize(self, verified: Verified, need: R.Need | None) -> None:
        return None


async def end_to_end(rounds: int, per_round: int, base: Path) -> tuple[list[float], list[float]]:
    with nats_server(base / "nats", durable=True) as server:
        store = await EventStore.connect(server.url, default_registry())
        try:
            await store.ensure_streams()
            people = PeopleService(store)
            people_proc = people.processor()
            system = CommandClient.for_service(store, "bench")
            checked = TenancyService(store)
            unchecked = TenancyService(store)
            tasks = [asyncio.create_task(people_proc.run())]
            await system.send(P.SERVICE, "user.add", P.AddUser(name="bench", password_hash=HASH), actor="system:bench")
            grant = P.GrantRole(name="bench", role="cluster-admin", scope="cluster")
            await system.send(P.SERVICE, "role.grant", grant, actor="system:bench")
            token, issue = P.issue("bench", "personal")
            await system.send(P.SERVICE, "token.issue", issue, actor="system:bench")
            client = CommandClient(store, TokenSigner(token))
            signed_ms: list[float] = []
            unchecked_ms: list[float] = []
            n = 0
            for _ in range(rounds):
                for proc_of, into in ((checked, signed_ms), (unchecked, unchecked_ms)):
                    proc = proc_of.processor()
                    if proc_of is unchecked:
                        proc.verifier = _Unchecked()  # type: ignore[assignment]
                    task = asyncio.create_task(proc.run())
                    times = []
                    for _ in range(per_round):
                        n += 1
                        t0 = time.perf_counter()
                        await client.send(T.SERVICE, "create", T.CreateScope(kind="org", path=f"o{n}"), actor="")
                        times.append((time.perf_counter() - t0) * 1000)
                    into.append(statistics.median(times))
                    proc.stop()
                    await asyncio.wait_for(task, 10)
            people_proc.stop()
            await asyncio.wait_for(asyncio.gather(*tasks), 10)
            await checked.close()
            await unchecked.close()
            await people.close()
            return signed_ms, unchecked_ms
        finally:
            await store.close()


async def run_signing(checks: int, rounds: int, per_round: int) -> SigningResult:
    if checks < 1 or rounds < 1 or per_round < 1:
        raise BenchError("--checks, --rounds and --per-round must be 1 or more")
    checked, bare = await checks_per_second(checks)
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-signing-") as tmp:
        signed_ms, unchecked_ms = await end_to_end(rounds, per_round, Path(tmp))
    return SigningResult(
        checks=checks,
        checks_per_s=checked,
        bare_verify_per_s=bare,
        rounds=rounds,
        signed_ms=signed_ms,
        unchecked_ms=unchecked_ms,
    )


def signing_text(r: SigningResult) -> str:
    return "\n".join(
        [
            f"signature checks (a person's command, one thread): {r.checks_per_s:,.0f}/s "
            f"(bare Ed25519 verify: {r.bare_verify_per_s:,.0f}/s; {r.checks:,} commands)",
            f"command end to end, median of round medians: signed and checked {statistics.median(r.signed_ms):.2f} ms, "
            f"unchecked {statistics.median(r.unchecked_ms):.2f} ms: {r.ratio:.2f}x ({r.rounds} rounds)",
            "  signed:    " + " ".join(f"{x:.2f}" for x in r.signed_ms),
            "  unchecked: " + " ".join(f"{x:.2f}" for x in r.unchecked_ms),
        ]
    )
