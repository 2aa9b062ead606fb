"""GGUF headers over HTTP: the ``Range``-request adapter at the edge of :mod:`llmgw.modelfiles.gguf_header`.

The parser is pure over "bytes at offset"; this is the one place it meets the network.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import aiohttp

from llmgw.modelfiles.gguf_header import GGUFError, GGUFHeader, read_header_async

_CONTENT_RANGE = re.compile(r"bytes\s+(?:(\d+)-(\d+)|\*)/(\d+|\*)")


class HttpRangeSource:
    """A remote file read with HTTP ``Range`` requests, never the whole body. Counts what it fetched
    (``bytes_fetched``, ``requests``) and learns the file's ``size`` from ``Content-Range``."""

    def __init__(self, session: aiohttp.ClientSession, url: str, *, headers: Mapping[str, str] | None = None) -> None:
        self._session = session
        self.url = url
        self._headers = dict(headers or {})
        self.bytes_fetched = 0
        self.requests = 0
        self.size: int | None = None

    async def read_at(self, offset: int, size: int) -> bytes:
        if size <= 0 or (self.size is not None and offset >= self.size):
            return b""
        span = f"bytes={offset}-{offset + size - 1}"
        # identity: byte offsets must be of the file itself, not of a compressed transfer.
        headers = {**self._headers, "Range": span, "Accept-Encoding": "identity"}
        async with self._session.get(self.url, headers=headers) as resp:
            self.requests += 1
            m = _CONTENT_RANGE.match(resp.headers.get("Content-Range", ""))
            if m and m.group(3) != "*":
                self.size = int(m.group(3))
            if resp.status == 416:  # the range starts past the end
                return b""
            if resp.status == 200:
                raise GGUFError(
                    f"{self.url} does not honour Range requests (HTTP 200 for {span}); "
                    "the header is not read by downloading the whole file"
                )
            if resp.status != 206:
                raise GGUFError(f"GET {self.url} ({span}): HTTP {resp.status} {resp.reason or ''}".rstrip())
            if not m or m.group(1) is None or int(m.group(1)) != offset:
                raise GGUFError(f"{self.url} answered {span} with Content-Range {resp.headers.get('Content-Range')!r}")
            parts: list[bytes] = []
            got = 0
            while got < size:  # a server sending more than asked is cut off at what was asked
                part = await resp.content.read(size - got)
                if not part:
                    break
                parts.append(part)
                got += len(part)
            self.bytes_fetched += got
            return b"".join(parts)


async def read_header_url(
    session: aiohttp.ClientSession, url: str, *, headers: Mapping[str, str] | None = None, **options: Any
) -> GGUFHeader:
    """The header of a remote file over HTTP ``Range`` requests; ``options`` as for :func:`read_header_async`."""
    return await read_header_async(HttpRangeSource(session, url, headers=headers), **options)
