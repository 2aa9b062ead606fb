"""Cluster secrets kept in the store (JetStream KV), and what is derived from them.

Engine keys (ARCHITECTURE §9, GW-7): each replica's engine accepts only its own key, derived with
HMAC from the replica id and a cluster secret, so the agent that starts the engine and every
router that calls it compute the same key without ever sending it over the bus. The mirror's
file server token is derived from the same secret with another label (:func:`mirror_token`).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType

from llmgw.events.runtime.buckets import open_bucket
from llmgw.events.runtime.retry import is_transient, retrying

BUCKET = "llmgw_secrets"
ENGINE_KEY_SECRET = "engine-key-secret"
# Read by the control plane only (routers and agents read BUCKET): what services sign commands with.
CONTROL_BUCKET = "llmgw_control_secrets"
SIGNING_SECRET = "command-signing-secret"


async def engine_key_secret(js: JetStreamContext) -> bytes:
    """The cluster's engine-key secret, made once by whichever process first needs it.

    A process whose NATS user may only read it (a router, an agent) waits until one that may write it
    (the control plane) has made it: its own attempt is refused, which it hears as no answer."""
    return await _secret(js, BUCKET, ENGINE_KEY_SECRET, "the cluster secret")


async def signing_secret(js: JetStreamContext) -> bytes:
    """The secret services derive their command-signing keys from (events/commands/signing.py), in a bucket only
    the control plane's NATS user may read: a router's or an agent's credential cannot sign commands."""
    return await _secret(js, CONTROL_BUCKET, SIGNING_SECRET, "the command-signing secret")


async def _secret(js: JetStreamContext, bucket: str, key: str, what: str) -> bytes:
    kv = await open_bucket(js, KeyValueConfig(bucket=bucket, history=1, storage=StorageType.FILE))

    async def once() -> bytes:
        try:
            entry = await kv.get(key)
            if entry.value:
                return base64.b64decode(entry.value)
        except nats.js.errors.KeyNotFoundError:
            pass
        secret = os.urandom(32)
        try:
            await kv.create(key, base64.b64encode(secret))
            return secret
        except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.APIError) as exc:
            if is_transient(exc):
                raise
            entry = await kv.get(key)  # another process won the race: use theirs
            return base64.b64decode(entry.value or b"")

    return await retrying(what, once)


def engine_key(secret: bytes, replica_id: str) -> str:
    """The key replica ``replica_id``'s engine accepts."""
    digest = hmac.new(secret, f"engine:{replica_id}".encode(), hashlib.sha256).digest()
    return "llmgw-engine-" + base64.urlsafe_b64encode(digest).decode().rstrip("=")


def mirror_token(secret: bytes) -> str:
    """The bearer token the mirror's file server accepts (MIR-2): every holder of the cluster secret
    (agents, control planes) computes it; another label than engine keys, so neither reveals the other."""
    digest = hmac.new(secret, b"mirror:files", hashlib.sha256).digest()
    return "llmgw-mirror-" + base64.urlsafe_b64encode(digest).decode().rstrip("=")
