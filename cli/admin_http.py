"""One call to the admin API over the standard library's HTTP client.

The CLI's reads are a handful of small JSON requests; aiohttp's client cost `llmgw ctl …` more to
import (it builds two TLS contexts as it loads) than the requests took (docs/benchmarks.md, "The CLI's
start"). Each call runs in a daemon thread, so a person's Ctrl-C is never held up by one in flight.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import ssl
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

import msgspec


class Answer(msgspec.Struct, frozen=True):
    """The admin API's answer: its status and its body read as JSON (None when the body is empty)."""

    status: int
    body: Any


def call(
    method: str,
    url: str,
    *,
    params: dict[str, Any] | None,
    body: Any,
    headers: dict[str, str],
    context: ssl.SSLContext | None,  # used for https only
    timeout: float,
) -> Answer:
    """``method url`` with ``params`` in the query and ``body`` as JSON; blocks. Raises what the socket
    raises: :class:`ssl.SSLCertVerificationError`, :class:`TimeoutError`, another :class:`OSError`, or
    :class:`http.client.HTTPException` for an answer that is not HTTP."""
    parts = urlsplit(url)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    if params:
        target += ("&" if "?" in target else "?") + urlencode(params, quote_via=quote)
    connection: http.client.HTTPConnection
    if parts.scheme == "https":
        connection = http.client.HTTPSConnection(parts.hostname or "", parts.port, timeout=timeout, context=context)
    else:
        connection = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeout)
    sent = dict(headers)
    payload = None
    if body is not None:
        payload = json.dumps(body).encode()
        sent["Content-Type"] = "application/json"
    try:
        connection.request(method, target, body=payload, headers=sent)
        response = connection.getresponse()
        raw = response.read().strip()
        return Answer(response.status, json.loads(raw) if raw else None)
    finally:
        connection.close()


async def in_thread(fn: Callable[[], Answer]) -> Answer:
    """``fn()`` in a daemon thread, awaited: unlike the loop's executor, nothing waits for it at exit."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Answer] = loop.create_future()

    def settle(outcome: Callable[[], None]) -> None:
        if not done.done():
            outcome()

    def work() -> None:
        try:
            answer = fn()
        except BaseException as exc:  # handed to the awaiting task, which raises it
            failure = exc
            _post(loop, lambda: settle(lambda: done.set_exception(failure)))
        else:
            _post(loop, lambda: settle(lambda: done.set_result(answer)))

    threading.Thread(target=work, name="admin-api", daemon=True).start()
    return await done


def _post(loop: asyncio.AbstractEventLoop, fn: Callable[[], None]) -> None:
    try:
        loop.call_soon_threadsafe(fn)
    except RuntimeError:  # the loop closed while the call was out: nobody waits for it any more
        pass
