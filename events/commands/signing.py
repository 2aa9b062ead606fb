"""Signed commands (issue "Trust", item 3): who sent a command is proven, not written.

Every command carries an Ed25519 signature over its bytes (:func:`signed_bytes`: its id, kind,
actor, time, expectation, correlation, signer and data) and the name of the key that made it:

- ``token:<prefix>`` — a person's key, derived from one of their tokens (a login's session or a
  personal access token). Whoever makes a token derives its public key (:func:`token_public_key`)
  and records it with the token (``user.token_issued``); the token itself never leaves its holder,
  so the log holds the key to check with and nothing to sign with. A person's command may only
  say it is from that person.
- ``svc:<name>`` — a service's key, derived from the command-signing secret
  (``llmgw_control_secrets``), which only the control plane's NATS user can read (routers and
  agents read the engine-key secret, never this one). A service acts for itself or, like the admin API, for a
  person it authenticated.

Key derivation is HKDF-SHA256 with a label per use, so neither a token's signing key nor a
service's reveals the token, the secret or each other. Everything here is pure.
"""

from __future__ import annotations

import base64
import binascii
from datetime import datetime

import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

VERSION = b"llmgw-command-v1"
TOKEN_SIGNER = "token:"
SERVICE_SIGNER = "svc:"


class SignedFields(msgspec.Struct, frozen=True, array_like=True):
    """What a signature covers besides the data, in a fixed order (array-like: no key reordering)."""

    id: str
    kind: str
    actor: str
    at: str
    expected: int | None
    correlation: str | None
    signer: str


def signed_bytes(
    *,
    id: str,
    kind: str,
    actor: str,
    at: datetime,
    expected: int | None,
    correlation: str | None,
    signer: str,
    data: bytes,
) -> bytes:
    """The bytes a command's signature is over: a version tag, the envelope's fields, then the data as sent."""
    head = msgspec.json.encode(SignedFields(id, kind, actor, at.isoformat(), expected, correlation, signer))
    return b"\n".join((VERSION, head, data))


def _derive(material: bytes, label: bytes) -> Ed25519PrivateKey:
    seed = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=label).derive(material)
    return Ed25519PrivateKey.from_private_bytes(seed)


def token_key(token: str) -> Ed25519PrivateKey:
    """The signing key of a person's token (session or personal)."""
    return _derive(token.encode(), b"llmgw command signing: token")


def service_key(secret: bytes, service: str) -> Ed25519PrivateKey:
    """The signing key of service ``service`` (``api``, ``jobs``…), from the command-signing secret."""
    return _derive(secret, b"llmgw command signing: service " + service.encode())


def public_key_text(key: Ed25519PrivateKey) -> str:
    """The public half of ``key`` as recorded on the log: 32 raw bytes, base64url without padding."""
    raw = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def token_public_key(token: str) -> str:
    """What ``user.token_issued`` records for ``token``: the public key its commands are checked with."""
    return public_key_text(token_key(token))


def load_public_key(text: str) -> Ed25519PublicKey:
    """A recorded public key; ``ValueError`` when it is not one."""
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"not a public key: {exc}") from exc
    return Ed25519PublicKey.from_public_bytes(raw)


def sign(key: Ed25519PrivateKey, message: bytes) -> str:
    return base64.urlsafe_b64encode(key.sign(message)).decode().rstrip("=")


def valid(public: Ed25519PublicKey, message: bytes, signature: str) -> bool:
    """Whether ``signature`` (as :func:`sign` writes it) is ``public``'s over ``message``."""
    try:
        raw = base64.urlsafe_b64decode(signature + "=" * (-len(signature) % 4))
        public.verify(raw, message)
    except (InvalidSignature, binascii.Error, ValueError):
        return False
    return True
