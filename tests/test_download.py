"""The one verified download (llmgw.modelfiles.download) that the mirror and the node agent share.

A real aiohttp server sends the bytes (``FileResponse``: ``Range`` answered as any file server
does); the cases here are the pipeline's own: resuming a partial file, a file that is not what was
expected, a full disk, a server that ignores ``Range``. The mirror's and the agent's policies
around it are tested in tests/test_mirror.py, tests/test_mirror_peers.py and tests/test_weights.py.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from llmgw.modelfiles.download import Digests, DiskFull, Expected, Mismatch, download, mismatch, mismatch_reason
from tests.support import free_port, wait_until

MiB = 1 << 20


class Files:
    """Serves bytes at a URL: ``/file`` answers ``Range`` like any file server, ``/whole`` ignores it,
    ``/stalls`` sends half and then hangs. ``asked`` is the ``Range`` header of each request, in order."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.asked: list[str] = []
        self.runners: list[web.AppRunner] = []
        self.release = asyncio.Event()  # ends the stalled responses

    async def __call__(self, data: bytes) -> str:
        src = self.tmp / f"src{len(self.runners)}.bin"
        src.write_bytes(data)

        async def file(request: web.Request) -> web.StreamResponse:
            self.asked.append(request.headers.get("Range", ""))
            return web.FileResponse(src)

        async def whole(request: web.Request) -> web.StreamResponse:
            self.asked.append(request.headers.get("Range", ""))
            return web.Response(body=data)

        async def stalls(request: web.Request) -> web.StreamResponse:
            """The first ``len(data) // 2`` bytes, then nothing more until the client goes."""
            self.asked.append(request.headers.get("Range", ""))
            resp = web.StreamResponse(headers={"Content-Length": str(len(data))})
            await resp.prepare(request)
            await resp.write(data[: len(data) // 2])
            await self.release.wait()
            return resp

        app = web.Application()
        app.router.add_get("/file", file)
        app.router.add_get("/whole", whole)
        app.router.add_get("/stalls", stalls)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        self.runners.append(runner)
        return f"http://127.0.0.1:{port}"


@pytest.fixture
async def serve(tmp_path: Path) -> AsyncIterator[Files]:
    files = Files(tmp_path)
    yield files
    files.release.set()
    for r in files.runners:
        await r.cleanup()


async def test_a_partial_file_is_resumed_with_range_and_the_digest_covers_every_byte(
    serve: Files, tmp_path: Path
) -> None:
    data = os.urandom(3 * MiB + 12345)
    base = await serve(data)
    part = tmp_path / "model.gguf.partial"
    part.write_bytes(data[: MiB + 7])  # what an earlier process left
    async with aiohttp.ClientSession() as http:
        got = await download(http, f"{base}/file", part, Expected(sha256=hashlib.sha256(data).hexdigest()))
    assert part.read_bytes() == data
    assert got.sha256 == hashlib.sha256(data).hexdigest() and got.size == len(data)
    assert got.resumed_from == MiB + 7 and got.downloaded == len(data) - (MiB + 7)
    assert serve.asked == [f"bytes={MiB + 7}-"]


async def test_a_partial_file_that_is_already_whole_is_verified_without_downloading_it_again(
    serve: Files, tmp_path: Path
) -> None:
    data = os.urandom(MiB // 2)
    base = await serve(data)
    part = tmp_path / "model.gguf.partial"
    part.write_bytes(data)  # stopped after its last byte, before the rename
    async with aiohttp.ClientSession() as http:
        got = await download(http, f"{base}/file", part, Expected(sha256=hashlib.sha256(data).hexdigest()))
    assert got.downloaded == 0 and got.size == len(data) and part.read_bytes() == data


async def test_a_file_that_is_not_what_was_expected_is_deleted(serve: Files, tmp_path: Path) -> None:
    data = os.urandom(2 * MiB)
    base = await serve(data)
    part = tmp_path / "model.gguf.partial"
    async with aiohttp.ClientSession() as http:
        with pytest.raises(Mismatch) as err:
            await download(http, f"{base}/file", part, Expected(sha256="ab" * 32))
    assert err.value.field == "sha256" and err.value.got.sha256 == hashlib.sha256(data).hexdigest()
    assert f"arrived with sha256 {hashlib.sha256(data).hexdigest()}" in err.value.reason
    assert not part.exists(), "a file that is not what was expected is never kept"


def test_a_mismatch_says_what_arrived_and_whose_word_it_failed() -> None:
    got = Digests(size=5, sha256="CD" * 32, blob_id="", resumed_from=0, downloaded=5)
    hub = Expected(size=5, sha256="AB" * 32, source="the hub published")
    assert mismatch(hub, got) == "sha256"
    assert (
        mismatch_reason("m.gguf", hub, got, "sha256")
        == f"m.gguf arrived with sha256 {'CD' * 32}, and the hub published {'ab' * 32}"
    )
    assert mismatch_reason("m.gguf", Expected(size=6), got, "size") == "m.gguf arrived with 5 bytes, not the expected 6"


async def test_bytes_past_the_published_size_fail_at_once_and_the_partial_file_is_deleted(
    serve: Files, tmp_path: Path
) -> None:
    base = await serve(os.urandom(3 * MiB))
    part = tmp_path / "model.gguf.partial"
    async with aiohttp.ClientSession() as http:
        with pytest.raises(Exception) as err:
            await download(http, f"{base}/file", part, Expected(size=MiB))
    assert getattr(err.value, "code", "") == "checksum" and f"longer than the {MiB} bytes" in str(err.value)
    assert not part.exists()


class _FullAfter:
    """A disk with room for ``room`` more bytes."""

    def __init__(self, room: int) -> None:
        self.room = room

    def claim(self, n: int) -> None:
        self.room -= n
        if self.room < 0:
            raise OSError(errno.ENOSPC, "No space left on device")


async def test_a_full_disk_fails_the_download_and_deletes_the_partial_file(serve: Files, tmp_path: Path) -> None:
    base = await serve(os.urandom(4 * MiB))
    part = tmp_path / "model.gguf.partial"
    async with aiohttp.ClientSession() as http:
        with pytest.raises(DiskFull) as err:
            await download(http, f"{base}/file", part, Expected(), guard=_FullAfter(MiB + 1))
    assert err.value.errno == errno.ENOSPC and "the partial file was deleted" in str(err.value)
    assert not part.exists(), "a partial file on a full disk only keeps it full"


async def test_a_server_that_ignores_range_sends_the_whole_file_into_an_emptied_partial(
    serve: Files, tmp_path: Path
) -> None:
    data = os.urandom(2 * MiB)
    base = await serve(data)
    part = tmp_path / "model.gguf.partial"
    part.write_bytes(data[:MiB])
    async with aiohttp.ClientSession() as http:
        got = await download(http, f"{base}/whole", part, Expected(sha256=hashlib.sha256(data).hexdigest()))
    assert part.read_bytes() == data and got.downloaded == len(data)


async def test_a_download_stopped_mid_file_keeps_a_clean_prefix_that_the_next_one_resumes(
    serve: Files, tmp_path: Path
) -> None:
    data = os.urandom(4 * MiB)
    base = await serve(data)
    part = tmp_path / "model.gguf.partial"
    sha = hashlib.sha256(data).hexdigest()
    async with aiohttp.ClientSession() as http:
        stopped = asyncio.create_task(download(http, f"{base}/stalls", part, Expected(size=len(data), sha256=sha)))
        await wait_until(
            lambda: part.exists() and part.stat().st_size >= MiB, what="the first MiB on disk before the stop"
        )
        stopped.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stopped
        kept = part.read_bytes()
        assert 0 < len(kept) <= len(data) // 2 and data.startswith(kept), "what is kept is a prefix of the file"
        got = await download(http, f"{base}/file", part, Expected(size=len(data), sha256=sha))
    assert got.resumed_from == len(kept) and got.sha256 == sha and part.read_bytes() == data
