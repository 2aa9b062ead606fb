"""Peer mirrors (SPEC MIR-4): a second mirror kept in step, removals carried over, failover."""

from __future__ import annotations

import errno
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import IO

import aiohttp
import pytest
from aiohttp import web

from llmgw.agent.weights.cache import WeightsCache, WeightsError
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import mirror as E
from llmgw.events.schema.envelope import RecordedEvent
from llmgw.events.schema.subjects import event_subject
from tests.fakehub import FakeHub
from tests.support import free_port, wait_until
from tests.test_mirror import REPO, Rig, blob, files_under

pytestmark = [pytest.mark.timeout(120)]


@pytest.fixture
async def hub() -> AsyncIterator[FakeHub]:
    h = await FakeHub().start()
    yield h
    await h.stop()


@pytest.fixture
async def pair(store: EventStore, hub: FakeHub, tmp_path: Path) -> AsyncIterator[tuple[Rig, Rig]]:
    primary = await Rig(store, hub, tmp_path / "a").start()
    peer = await Rig(store, hub, tmp_path / "b", peer_of=primary.url, peer_name="b").start()
    yield primary, peer
    await peer.stop()
    await primary.stop()


async def peer_events(store: EventStore, name: str = "b") -> list[RecordedEvent]:
    return await store.read(event_subject(E.PEER_AGGREGATE, name))


async def get(rig: Rig, path: str) -> tuple[int, bytes, str]:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {await rig.token()}"}) as s:
        async with s.get(f"{rig.url}{path}") as resp:
            return resp.status, await resp.read(), resp.headers.get("X-Llmgw-Sha256", "")


async def test_a_fetch_on_the_primary_appears_verified_on_the_peer(
    pair: tuple[Rig, Rig], hub: FakeHub, store: EventStore
) -> None:
    primary, peer = pair
    repo = hub.add_repo(REPO)
    data = blob(300_000)
    hub.add_file(REPO, "tiny-Q8_0.gguf", data)
    version = repo.commit[:8]
    await primary.fetch()
    assert (await primary.outcome()).type == "mirror.fetch_completed"

    ref = f"tiny/{version}/tiny-Q8_0.gguf"
    copied = await wait_until(
        lambda: _copied(store, ref), deadline_s=30, what="the peer to copy the file the primary fetched"
    )
    assert copied.payload.sha256 == hashlib.sha256(data).hexdigest() and copied.payload.source == primary.url
    assert files_under(peer.root) == [ref]
    status, body, sha = await get(peer, f"/files/{ref}")
    assert status == 200 and body == data and sha == hashlib.sha256(data).hexdigest()
    status, listing, _ = await get(peer, "/files/")
    assert status == 200 and b"tiny-Q8_0.gguf" in listing
    # The copy is not announced as a fetch: the primary's history has only its own events.
    assert all(e.envelope.actor == "svc:mirror" for e in (await primary.events())[1:])
    assert not any(e.type.startswith("mirror_peer.") for e in await primary.events())


async def _copied(store: EventStore, ref: str) -> RecordedEvent | None:
    for e in await peer_events(store):
        p = e.payload
        if isinstance(p, E.PeerFileCopied) and f"{p.model}/{p.version}/{p.file}" == ref:
            return e
    return None


async def test_a_removal_is_not_copied_back(pair: tuple[Rig, Rig], hub: FakeHub, store: EventStore) -> None:
    primary, peer = pair
    repo = hub.add_repo(REPO)
    hub.add_file(REPO, "tiny-Q8_0.gguf", blob(100_000))
    ref = f"tiny/{repo.commit[:8]}/tiny-Q8_0.gguf"
    await primary.fetch()
    await primary.outcome()
    await wait_until(lambda: _copied(store, ref), deadline_s=30, what="the copy")

    await peer.stop()
    await primary.remove("tiny")
    assert files_under(primary.root) == []
    await peer.start()  # catches up from the log: the tombstone wins over the earlier copy
    types = ["mirror_peer.file_copied", "mirror_peer.file_deleted"]

    async def deletion_recorded() -> bool:
        return [e.type for e in await peer_events(store)] == types

    await wait_until(deletion_recorded, deadline_s=15, what="the peer to record deleting its copy")
    assert files_under(peer.root) == []
    assert (await get(peer, f"/files/{ref}"))[0] == 404

    # A later restart does not bring it back, and nothing new is recorded.
    await peer.stop()
    await peer.start()
    assert peer.svc is not None and peer.svc.peer is not None
    await peer.svc.peer.reconcile()
    assert files_under(peer.root) == []
    assert [e.type for e in await peer_events(store)] == types


async def test_a_corrupted_file_on_the_primary_is_not_copied(store: EventStore, hub: FakeHub, tmp_path: Path) -> None:
    primary = await Rig(store, hub, tmp_path / "a").start()
    try:
        repo = hub.add_repo(REPO)
        data = blob(200_000)
        hub.add_file(REPO, "tiny-Q8_0.gguf", data)
        ref = f"tiny/{repo.commit[:8]}/tiny-Q8_0.gguf"
        await primary.fetch()
        assert (await primary.outcome()).type == "mirror.fetch_completed"
        on_disk = primary.root / ref
        on_disk.write_bytes(bytes(b ^ 0xFF for b in data[:10]) + data[10:])  # same size, other bytes

        peer = await Rig(store, hub, tmp_path / "b", peer_of=primary.url, peer_name="b").start()
        try:

            async def failed() -> RecordedEvent | None:
                return next((e for e in await peer_events(store) if e.type == "mirror_peer.copy_failed"), None)

            end = await wait_until(failed, deadline_s=30, what="the peer to refuse the corrupted copy")
            assert end.payload.code == "checksum" and hashlib.sha256(data).hexdigest() in end.payload.reason
            assert "the primary verified" in end.payload.reason, "whose word the copy failed"
            assert files_under(peer.root) == [], "no copy, not even a partial one"
            assert (await get(peer, f"/files/{ref}"))[0] == 404
            assert not await _copied(store, ref)
        finally:
            await peer.stop()
    finally:
        await primary.stop()


# -- failover --------------------------------------------------------------------------------


async def test_the_weights_cache_fails_over_to_a_mirror_that_answers(tmp_path: Path) -> None:
    data = blob(50_000, seed=7)
    sha = hashlib.sha256(data).hexdigest()
    ref = "tiny/v1/w.gguf"
    hits: list[str] = []

    def server(status: int) -> web.Application:
        async def one(request: web.Request) -> web.StreamResponse:
            hits.append(f"{status}:{request.method}")
            if status != 200:
                return web.Response(status=status)
            return web.Response(body=data, headers={"X-Llmgw-Sha256": sha})

        app = web.Application()
        app.router.add_route("*", "/files/{tail:.*}", one)
        return app

    runners = []
    urls = []
    for status in (503, 200):
        runner = web.AppRunner(server(status), access_log=None)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{port}")
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens here
    try:
        cache = WeightsCache(tmp_path / "w", f"{down}, {urls[0]},{urls[1]}", lambda: "t")
        assert cache.mirror_urls == [down, urls[0], urls[1]] and cache.mirror_url == down
        path = await cache.ensure(ref)
        assert path.read_bytes() == data
        assert hits[0] == "503:HEAD" and "200:GET" in hits

        # Every mirror down: one error naming each.
        lone = WeightsCache(tmp_path / "x", [down, urls[0]], lambda: "t")
        with pytest.raises(WeightsError) as err:
            await lone.ensure(ref)
        assert down in str(err.value) and urls[0] in str(err.value) and "503" in str(err.value)
    finally:
        for r in runners:
            await r.cleanup()


async def test_a_node_whose_disk_fills_gets_a_clear_reason_and_keeps_no_partial_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from llmgw.modelfiles import download as pipeline

    data = blob(3 * 1024 * 1024, seed=9)  # several MiB: the disk fills after the first
    sha = hashlib.sha256(data).hexdigest()

    async def one(request: web.Request) -> web.StreamResponse:
        return web.Response(body=data, headers={"X-Llmgw-Sha256": sha})

    app = web.Application()
    app.router.add_route("*", "/files/{tail:.*}", one)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    written: list[int] = []
    real_write = pipeline._write

    def write_until_full(f: IO[bytes], chunk: bytes) -> int:
        if written:
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(len(chunk))
        return real_write(f, chunk)

    monkeypatch.setattr(pipeline, "_write", write_until_full)
    try:
        cache = WeightsCache(tmp_path / "w", f"http://127.0.0.1:{port}", lambda: "t")
        with pytest.raises(WeightsError) as err:
            await cache.ensure("tiny/v1/big.gguf")
        assert "disk is full" in str(err.value) and "ctl weights --collect" in str(err.value)
        assert written, "the first MiB was written before the disk filled"
        assert [p.name for p in (tmp_path / "w").rglob("*") if p.is_file()] == [], "no partial file is kept"
    finally:
        await runner.cleanup()
