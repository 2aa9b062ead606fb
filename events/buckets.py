"""JetStream key-value buckets (the scheduler's lease, cluster secrets, budgets) and object stores (the
services' snapshots), created at the cluster's replicas.

A bucket is a stream underneath (``KV_<bucket>``): one made with a single replica on a three-node
cluster loses the lease or the secret with its node. So a missing bucket is created at the
configured replica count — by default the cluster's size, at most 3 — and an existing one is
opened as it is: only `llmgw streams replicas N` changes its replicas.
"""

from __future__ import annotations

import dataclasses

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, ObjectStoreConfig
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from llmgw.events.retry import retrying
from llmgw.events.store import _connect_urls, cluster_replicas


async def open_bucket(js: JetStreamContext, config: KeyValueConfig, replicas: int | None = None) -> KeyValue:
    """The bucket ``config.bucket``, created with ``config`` at ``replicas`` (None: the cluster's size) if missing."""
    name = config.bucket
    try:
        return await retrying(f"bucket {name}", lambda: js.key_value(name))
    except nats.js.errors.BucketNotFoundError:
        pass
    n = replicas if replicas is not None else cluster_replicas(_connect_urls(js._nc))
    try:
        return await retrying(
            f"create bucket {name}", lambda: js.create_key_value(dataclasses.replace(config, replicas=n))
        )
    except nats.js.errors.APIError:
        return await retrying(f"bucket {name}", lambda: js.key_value(name))  # created by another process meanwhile


async def open_object_store(
    js: JetStreamContext, config: ObjectStoreConfig, replicas: int | None = None
) -> ObjectStore:
    """The object store ``config.bucket``, created with ``config`` at ``replicas`` (None: the cluster's size)."""
    name = config.bucket
    try:
        return await retrying(f"object store {name}", lambda: js.object_store(name))
    except nats.js.errors.BucketNotFoundError:
        pass
    n = replicas if replicas is not None else cluster_replicas(_connect_urls(js._nc))
    try:
        return await retrying(
            f"create object store {name}",
            lambda: js.create_object_store(name, config=dataclasses.replace(config, replicas=n)),
        )
    except nats.js.errors.APIError:
        return await retrying(f"object store {name}", lambda: js.object_store(name))  # made by another process
