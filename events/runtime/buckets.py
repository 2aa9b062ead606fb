"""JetStream key-value buckets (the scheduler's lease, cluster secrets, budgets) and object stores (the
services' snapshots), created at the cluster's replicas.

A bucket is a stream underneath (``KV_<bucket>``): one made with a single replica on a three-node
cluster loses the lease or the secret with its node. So a missing bucket is created at the
configured replica count — by default the cluster's size, at most 3 — and an existing one is
opened as it is: only `llmgw streams replicas N` changes its replicas.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, ObjectStoreConfig
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from llmgw.events.runtime.connection import cluster_replicas, connect_urls
from llmgw.events.runtime.retry import is_transient, retrying

T = TypeVar("T")


async def open_bucket(js: JetStreamContext, config: KeyValueConfig, replicas: int | None = None) -> KeyValue:
    """The bucket ``config.bucket``, created with ``config`` at ``replicas`` (None: the cluster's size) if missing."""
    name = config.bucket
    return await _open_or_create(
        js,
        f"bucket {name}",
        lambda: js.key_value(name),
        lambda n: js.create_key_value(dataclasses.replace(config, replicas=n)),
        replicas,
    )


async def open_object_store(
    js: JetStreamContext, config: ObjectStoreConfig, replicas: int | None = None
) -> ObjectStore:
    """The object store ``config.bucket``, created with ``config`` at ``replicas`` (None: the cluster's size)."""
    name = config.bucket
    return await _open_or_create(
        js,
        f"object store {name}",
        lambda: js.object_store(name),
        lambda n: js.create_object_store(name, config=dataclasses.replace(config, replicas=n)),
        replicas,
    )


async def _open_or_create(
    js: JetStreamContext,
    what: str,
    open_existing: Callable[[], Awaitable[T]],
    create: Callable[[int], Awaitable[T]],
    replicas: int | None,
) -> T:
    """``open_existing()``, else ``create`` at ``replicas`` (None: the cluster's size) if it is missing.

    Each try opens first: a process whose NATS user may not create it (a router, an agent: the server
    never answers a refused request) finds it once a process that may has made it."""
    n = replicas if replicas is not None else cluster_replicas(connect_urls(js._nc))

    async def once() -> T:
        try:
            return await open_existing()
        except nats.js.errors.BucketNotFoundError:
            pass
        try:
            return await create(n)
        except nats.js.errors.APIError as exc:
            if is_transient(exc):
                raise
            return await open_existing()  # created by another process meanwhile

    return await retrying(what, once)
