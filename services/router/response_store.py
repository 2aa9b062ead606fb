"""Stored responses of the Responses API (``store``, ``previous_response_id``, ``GET``/``DELETE
/v1/responses/{id}``): one entry per response in the NATS key-value bucket ``llmgw_responses``, so any
router finds what another stored (docs/decisions.md, "Stored responses").

An entry holds its project, its expiry, the items before it (its previous responses' inputs and
outputs), its own input items and the response object. A response of another project is not found,
as one that never was: its id tells a stranger nothing. Each entry carries its own expiry, checked on
read, so a shorter ``response_ttl_s`` holds at once; the bucket's own age limit (set when it is
created) only clears what has expired. :func:`encode_entry`, :func:`readable` and :func:`page` are
pure; :class:`ResponseStore` is the thin I/O.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import Any, Literal

import msgspec
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from llmgw.events.runtime.buckets import open_bucket

BUCKET = "llmgw_responses"
_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")  # what a response id may be; anything else is no stored response


class StoredResponse(msgspec.Struct, kw_only=True):
    project_id: str
    expires_at: float  # epoch seconds
    history: list[dict[str, Any]]  # the items before this response's input (its previous responses')
    input: list[dict[str, Any]]  # this response's own input items, each with an id
    response: dict[str, Any]  # the response object as it was answered


class StoreUnavailable(Exception):
    """The bucket cannot be reached (NATS down or slow): reads answer 503, creates answer unstored."""


def encode_entry(entry: StoredResponse, max_bytes: int) -> bytes | str:
    """The entry's bytes, or why it is not stored: larger than ``max_bytes``."""
    data = msgspec.json.encode(entry)
    if len(data) > max_bytes:
        return (
            f"the response with the conversation before it is {len(data)} bytes; this gateway stores at most "
            f"{max_bytes} (router setting response_max_bytes): send the earlier turns in input instead of "
            "previous_response_id"
        )
    return data


def readable(entry: StoredResponse | None, project_id: str, now: float) -> StoredResponse | None:
    """The entry as ``project_id`` may see it at ``now``: None when it is another project's or expired."""
    if entry is None or entry.project_id != project_id or entry.expires_at <= now:
        return None
    return entry


def page(items: list[dict[str, Any]], order: Literal["asc", "desc"], limit: int, after: str | None) -> dict[str, Any]:
    """A page of ``GET /v1/responses/{id}/input_items`` in OpenAI's list shape."""
    ordered = items if order == "asc" else items[::-1]
    if after is not None:
        ids = [i.get("id") for i in ordered]
        ordered = ordered[ids.index(after) + 1 :] if after in ids else []
    data = ordered[:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0].get("id") if data else None,
        "last_id": data[-1].get("id") if data else None,
        "has_more": len(ordered) > limit,
    }


class ResponseStore:
    """The bucket, opened on first use; every call bounded by ``timeout_s`` and raising
    :class:`StoreUnavailable` past it or when NATS refuses."""

    def __init__(
        self, js: JetStreamContext, ttl_s: float, max_bytes: int, timeout_s: float, clock: Callable[[], float]
    ) -> None:
        self.js, self.ttl_s, self.max_bytes, self.timeout_s, self.clock = js, ttl_s, max_bytes, timeout_s, clock
        self._kv: KeyValue | None = None

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            config = KeyValueConfig(bucket=BUCKET, history=1, ttl=self.ttl_s, storage=StorageType.FILE)
            self._kv = await open_bucket(self.js, config)
        return self._kv

    async def _call(self, what: str, op: Callable[[KeyValue], Any]) -> Any:
        try:
            async with asyncio.timeout(self.timeout_s):
                return await op(await self._bucket())
        except (TimeoutError, nats.errors.Error, OSError) as exc:
            raise StoreUnavailable(
                f"the stored responses (NATS bucket {BUCKET}) could not be {what} within {self.timeout_s:g}s "
                f"({type(exc).__name__}); try again when the gateway's NATS is reachable"
            ) from exc

    async def put(self, response_id: str, entry: StoredResponse) -> str | None:
        """Store ``entry``; None when stored, else why not (too large, or the store unreachable)."""
        data = encode_entry(entry, self.max_bytes)
        if isinstance(data, str):
            return data
        try:
            await self._call("written", lambda kv: kv.put(response_id, data))
        except StoreUnavailable as exc:
            return str(exc)
        return None

    async def get(self, project_id: str, response_id: str) -> StoredResponse | None:
        """The project's response ``response_id``, or None (none, expired, deleted or another project's)."""
        if not _ID.match(response_id):
            return None

        async def read(kv: KeyValue) -> bytes | None:
            try:
                return (await kv.get(response_id)).value
            except nats.js.errors.KeyNotFoundError:
                return None

        data = await self._call("read", read)
        if not data:
            return None
        try:
            entry = msgspec.json.decode(data, type=StoredResponse)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None  # an entry of another version's shape: as good as gone
        return readable(entry, project_id, self.clock())

    async def delete(self, project_id: str, response_id: str) -> bool:
        """Delete the project's response; False when it has none of that id."""
        if await self.get(project_id, response_id) is None:
            return False
        await self._call("deleted", lambda kv: kv.delete(response_id))
        return True
