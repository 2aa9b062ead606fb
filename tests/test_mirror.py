"""The mirror (SPEC MIR-1, MIR-2) against a fake Hugging Face hub: fetch, verify, resume, refuse, serve."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import io
import json
import os
import random
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web
from huggingface_hub import HfApi, hf_hub_download
from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

from llmgw.cli.progress import Downloads
from llmgw.cli.runtime import serve
from llmgw.cli.server_config import ServerConfig
from llmgw.events.commands.client import CommandClient
from llmgw.events.commands.errors import CommandRejectedError
from llmgw.events.runtime.secrets import engine_key_secret, mirror_token
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import mirror as E
from llmgw.events.schema.envelope import RecordedEvent
from llmgw.events.schema.outcomes import CommandCompleted
from llmgw.events.schema.subjects import event_subject
from llmgw.modelfiles.outbound import OutboundResolver
from llmgw.services.mirror.download import DiskGuard
from llmgw.services.mirror.rules import should_report
from llmgw.services.mirror.service import MirrorConfig, MirrorService
from tests.fakehub import FakeHub
from tests.gguf_tiny import write_tiny_gguf
from tests.signin import person_on_log
from tests.support import NatsServer, free_port, wait_until

pytestmark = [pytest.mark.timeout(120)]  # asyncio_mode = auto marks the async tests

LLMGW = str(Path(sys.executable).parent / "llmgw")
REPO = "acme/tiny-GGUF"


def blob(n: int, seed: int = 1) -> bytes:
    return random.Random(seed).randbytes(n)


@pytest.fixture
async def hub() -> AsyncIterator[FakeHub]:
    h = await FakeHub().start()
    yield h
    await h.stop()


class Rig:
    """One mirror service in this process, with its file server, restartable on the same directory."""

    def __init__(self, store: EventStore, hub: FakeHub, base: Path, **config: Any) -> None:
        self.store = store
        self.hub = hub
        self.root = base / "mirror"
        self.config = MirrorConfig(
            dir=str(self.root),
            hub=hub.url,
            retry_backoff_s=0.01,
            chunk_bytes=64 * 1024,
            **{"hub_allow_private": True, **config},  # the fake hub is on loopback
        )
        self.client = CommandClient.for_service(store, "tests")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.svc: MirrorService | None = None
        self._task: asyncio.Task | None = None
        self._site: web.AppRunner | None = None

    async def start(self, guard: DiskGuard | None = None, resolver: OutboundResolver | None = None) -> Rig:
        self.svc = MirrorService(self.store, self.config, guard=guard, resolver=resolver)
        await self.svc.start()
        self._task = asyncio.create_task(self.svc.run())
        self._site = web.AppRunner(self.svc.app(), access_log=None)
        await self._site.setup()
        await web.TCPSite(self._site, "127.0.0.1", self.port).start()
        return self

    async def stop(self) -> None:
        if self.svc is None:
            return
        self.svc.stop()
        await self.svc.close()
        if self._task is not None:
            await asyncio.wait_for(self._task, 10)
        if self._site is not None:
            await self._site.cleanup()
        self.svc = None

    async def fetch(self, model: str = "tiny", repo: str = REPO, **kw: Any) -> CommandCompleted:
        return await self.client.send(
            E.SERVICE, "fetch", E.MirrorFetch(model=model, repo=repo, **kw), actor="user:test", timeout=30
        )

    async def remove(self, model: str, version: str | None = None) -> CommandCompleted:
        return await self.client.send(
            E.SERVICE, "remove", E.MirrorRemove(model=model, version=version), actor="user:test", timeout=30
        )

    async def events(self, model: str = "tiny") -> list[RecordedEvent]:
        return await self.store.read(event_subject(E.AGGREGATE, model))

    async def outcome(self, model: str = "tiny") -> RecordedEvent:
        """The fetch's end: completed or failed."""

        async def ended() -> RecordedEvent | None:
            done = [e for e in await self.events(model) if e.type in ("mirror.fetch_completed", "mirror.fetch_failed")]
            return done[-1] if done else None

        return await wait_until(ended, deadline_s=30, what=f"the fetch of {model} to end")

    async def token(self) -> str:
        return mirror_token(await engine_key_secret(self.store.js))


@pytest.fixture
async def rig(store: EventStore, hub: FakeHub, tmp_path: Path) -> AsyncIterator[Rig]:
    r = await Rig(store, hub, tmp_path).start()
    yield r
    await r.stop()


def files_under(root: Path) -> list[str]:
    # os.walk, not rglob: a directory the service removes while we look is skipped, not an error.
    return sorted(str((Path(d) / f).relative_to(root)) for d, _, names in os.walk(root) for f in names)


# -- the fake hub is what huggingface_hub expects --------------------------------------------


async def test_the_fake_hub_answers_as_huggingface_hub_expects(hub: FakeHub, tmp_path: Path) -> None:
    hub.add_repo(REPO)
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    big = hub.add_file(REPO, "tiny-Q8_0.gguf", gguf)
    small = hub.add_file(REPO, "config.json", b'{"arch": "llama"}')
    hub.add_repo("acme/gated", gated="manual")
    hub.add_file("acme/gated", "w.gguf", blob(5000))

    api = HfApi(endpoint=hub.url, token=False)
    info = await asyncio.to_thread(api.model_info, REPO, revision="main", files_metadata=True)
    assert info.sha == hub.repos[REPO].commit
    siblings = {s.rfilename: s for s in info.siblings or []}
    assert siblings["tiny-Q8_0.gguf"].lfs is not None
    assert siblings["tiny-Q8_0.gguf"].lfs.sha256 == hashlib.sha256(gguf.read_bytes()).hexdigest()
    assert siblings["tiny-Q8_0.gguf"].size == gguf.stat().st_size
    assert siblings["config.json"].lfs is None and siblings["config.json"].blob_id == small.blob_id

    cache = tmp_path / "hf-cache"
    got = await asyncio.to_thread(
        hf_hub_download, REPO, "tiny-Q8_0.gguf", revision="main", endpoint=hub.url, cache_dir=cache, token=False
    )
    assert Path(got).read_bytes() == gguf.read_bytes()
    assert ("GET", f"/cdn/{big.sha256}") in hub.requests, "an LFS file comes from the CDN, after a 302"
    assert big.bytes_served == gguf.stat().st_size
    got = await asyncio.to_thread(
        hf_hub_download, REPO, "config.json", revision="main", endpoint=hub.url, cache_dir=cache, token=False
    )
    assert Path(got).read_bytes() == small.data

    # A cut download: huggingface_hub tries again within the call, but resumes only from whole 10 MiB
    # steps it wrote, so a cut this early costs the whole file again (resuming is the mirror's work).
    cut = hub.add_file(REPO, "cut.gguf", blob(300_000, seed=2))
    cut.cut_after, cut.cut_times = 100_000, 1
    got = await asyncio.to_thread(
        hf_hub_download, REPO, "cut.gguf", revision="main", endpoint=hub.url, cache_dir=cache, token=False
    )
    assert Path(got).read_bytes() == cut.data
    assert [(s.start, s.sent) for s in cut.served] == [(0, 100_000), (0, 300_000)]
    async with aiohttp.ClientSession() as s:  # and the hub honours Range, as the real one does
        async with s.get(f"{hub.url}/{REPO}/resolve/main/cut.gguf", headers={"Range": "bytes=299990-"}) as resp:
            assert resp.status == 206 and resp.headers["Content-Range"] == "bytes 299990-299999/300000"
            assert await resp.read() == cut.data[299_990:]

    # It checks sizes, never sha256: a hub that lies about the checksum is believed (the mirror's job).
    liar = hub.add_file(REPO, "liar.gguf", blob(4000, seed=3))
    liar.published_sha256 = "ab" * 32
    got = await asyncio.to_thread(
        hf_hub_download, REPO, "liar.gguf", revision="main", endpoint=hub.url, cache_dir=cache, token=False
    )
    assert Path(got).read_bytes() == liar.data
    assert Path(got).resolve().name == "ab" * 32, "the blob is named after the published sha256"

    gated = await asyncio.to_thread(api.model_info, "acme/gated", files_metadata=True)
    assert gated.gated == "manual", "a gated repository's info is readable"
    with pytest.raises(GatedRepoError):
        await asyncio.to_thread(hf_hub_download, "acme/gated", "w.gguf", endpoint=hub.url, cache_dir=cache, token=False)
    with pytest.raises(RepositoryNotFoundError):
        await asyncio.to_thread(api.model_info, "acme/nothing")
    with pytest.raises(RevisionNotFoundError):
        await asyncio.to_thread(api.model_info, REPO, revision="v9")


# -- MIR-1: fetch ----------------------------------------------------------------------------


async def test_a_fetch_keeps_model_version_file_with_every_checksum_checked(
    rig: Rig, hub: FakeHub, tmp_path: Path
) -> None:
    repo = hub.add_repo(REPO)
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    hub.add_file(REPO, "tiny-Q8_0.gguf", gguf)
    hub.add_file(REPO, "README.md", b"# tiny\n")  # a small file: the hub publishes its git blob id, no sha256
    version = repo.commit[:8]

    out = await rig.fetch()
    assert out.result["version"] == version and out.result["state"] == "fetching"
    assert f"into tiny/{version}" in out.message
    end = await rig.outcome()
    assert end.type == "mirror.fetch_completed", end.payload

    assert files_under(rig.root) == [f"tiny/{version}/README.md", f"tiny/{version}/tiny-Q8_0.gguf"]
    assert (rig.root / "tiny" / version / "tiny-Q8_0.gguf").read_bytes() == gguf.read_bytes()
    assert (rig.root / "tiny" / version / "README.md").read_bytes() == b"# tiny\n"

    events = await rig.events()
    types = [e.type for e in events]
    assert types == [
        "mirror.fetch_started",
        "mirror.file_verified",
        "mirror.file_verified",
        "mirror.fetch_completed",
    ]
    started = events[0].payload
    assert isinstance(started, E.FetchStarted)
    assert (started.repo, started.revision, started.commit) == (REPO, "main", repo.commit)
    published = {f.name: f for f in started.files}
    assert published["tiny-Q8_0.gguf"].sha256 == hashlib.sha256(gguf.read_bytes()).hexdigest()
    assert published["tiny-Q8_0.gguf"].size == gguf.stat().st_size
    assert published["README.md"].sha256 is None and published["README.md"].blob_id
    verified = {e.payload.file: e.payload for e in events if isinstance(e.payload, E.FileVerified)}
    assert verified["tiny-Q8_0.gguf"].sha256 == hashlib.sha256(gguf.read_bytes()).hexdigest()
    # Progress is telemetry for whoever watches (tested below), never a durable event.
    assert events[0].envelope.actor == "user:test", "who asked for the fetch"
    assert all(e.envelope.actor == "svc:mirror" for e in events[1:])
    assert {e.envelope.causation for e in events} == {events[0].envelope.causation}, "all caused by the command"

    # The same commit again: nothing to do, nothing downloaded.
    served = hub.file(REPO, "tiny-Q8_0.gguf").bytes_served
    again = await rig.fetch()
    assert "already held" in again.message and again.result["state"] == "present"
    assert hub.file(REPO, "tiny-Q8_0.gguf").bytes_served == served


async def test_a_file_whose_checksum_differs_is_deleted_and_never_served(rig: Rig, hub: FakeHub) -> None:
    repo = hub.add_repo(REPO)
    f = hub.add_file(REPO, "tiny-Q8_0.gguf", blob(200_000))
    f.published_sha256 = "ab" * 32
    await rig.fetch()
    end = await rig.outcome()
    assert isinstance(end.payload, E.FetchFailed) and end.payload.code == "checksum"
    assert f"sha256 {f.sha256}" in end.payload.reason and f"the hub published {'ab' * 32}" in end.payload.reason
    assert "deleted and is not served" in end.payload.reason
    assert files_under(rig.root) == [], "no file, not even a partial one"
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {await rig.token()}"}) as s:
        async with s.get(f"{rig.url}/files/tiny/{repo.commit[:8]}/tiny-Q8_0.gguf") as resp:
            assert resp.status == 404
        async with s.get(f"{rig.url}/files/") as resp:
            assert (await resp.json())["files"] == []


async def test_a_gated_repository_is_refused_before_any_download(rig: Rig, hub: FakeHub) -> None:
    hub.add_repo("meta/gated-GGUF", gated="manual")
    hub.add_file("meta/gated-GGUF", "w.gguf", blob(10_000))
    with pytest.raises(CommandRejectedError) as caught:
        await rig.fetch(repo="meta/gated-GGUF")
    assert caught.value.code == "gated"
    assert "meta/gated-GGUF is gated on the hub" in caught.value.reason
    assert "accept its terms and configure a token" in caught.value.reason
    assert hub.resolve_requests() == [], "refused from the info alone"
    assert await rig.events() == [] and files_under(rig.root) == []


async def test_a_token_opens_a_gated_repository_and_never_leaves_the_hub(
    store: EventStore, hub: FakeHub, tmp_path: Path
) -> None:
    repo = hub.add_repo("meta/gated-GGUF", gated="auto")
    f = hub.add_file("meta/gated-GGUF", "w.gguf", blob(50_000))
    r = await Rig(store, hub, tmp_path, token="hf_not_accepted").start()
    try:
        with pytest.raises(CommandRejectedError) as caught:
            await r.fetch(repo="meta/gated-GGUF")
        assert caught.value.code == "gated" and "may not read it" in caught.value.reason
        assert f.bytes_served == 0
    finally:
        await r.stop()
    repo.granted_tokens.add("hf_accepted")
    r = await Rig(store, hub, tmp_path, token="hf_accepted").start()
    try:
        await r.fetch(repo="meta/gated-GGUF")
        assert (await r.outcome()).type == "mirror.fetch_completed"
    finally:
        await r.stop()
    sent = dict(zip(hub.requests, hub.auth_seen, strict=True))
    assert sent[("GET", f"/meta/gated-GGUF/resolve/{repo.commit}/w.gguf")] == "Bearer hf_accepted"
    assert sent[("GET", f"/cdn/{f.sha256}")] is None, "the token is not sent to the CDN"


async def test_pickled_weights_are_refused_unless_allowed(rig: Rig, hub: FakeHub) -> None:
    hub.add_repo("acme/old-style")
    hub.add_file("acme/old-style", "pytorch_model.bin", blob(20_000))
    hub.add_file("acme/old-style", "config.json", b"{}")
    with pytest.raises(CommandRejectedError) as caught:
        await rig.fetch(model="old", repo="acme/old-style")
    assert caught.value.code == "pickle"
    assert "pickled weights (pytorch_model.bin)" in caught.value.reason and "--allow-pickle" in caught.value.reason
    assert hub.resolve_requests() == []

    await rig.fetch(model="old", repo="acme/old-style", files=["config.json"])
    assert (await rig.outcome("old")).type == "mirror.fetch_completed"
    await rig.fetch(model="old", repo="acme/old-style", allow_pickle=True)
    await wait_until(
        lambda: len([p for p in (rig.root / "old").rglob("*") if p.is_file()]) == 2,
        what="the pickled file, allowed, to arrive",
    )
    assert (await rig.outcome("old")).type == "mirror.fetch_completed"


async def test_a_download_cut_off_resumes_where_it_stopped(rig: Rig, hub: FakeHub) -> None:
    repo = hub.add_repo(REPO)
    f = hub.add_file(REPO, "big.gguf", blob(3_000_000))
    f.cut_after, f.cut_times = 1_200_000, 1
    await rig.fetch()
    end = await rig.outcome()
    assert end.type == "mirror.fetch_completed", end.payload
    first, second = f.served
    assert first.sent == 1_200_000
    # The second request asks for the rest only: from what reached the disk, which is the cut minus
    # what was still in buffers when the connection broke (aiohttp drops its buffer on the error).
    assert 1_200_000 - 256 * 1024 <= second.start <= 1_200_000
    assert second.sent == len(f.data) - second.start
    assert (rig.root / "tiny" / repo.commit[:8] / "big.gguf").read_bytes() == f.data


async def test_a_fetch_stopped_mid_file_resumes_from_its_partial_after_a_restart(rig: Rig, hub: FakeHub) -> None:
    repo = hub.add_repo(REPO)
    f = hub.add_file(REPO, "big.gguf", blob(3_000_000))
    at = 16 * 64 * 1024  # a whole number of the rig's write chunks
    f.stall_after, f.stall_times = at, 1
    await rig.fetch()
    partial = rig.root / "tiny" / repo.commit[:8] / "big.gguf.partial"
    await wait_until(f.stalled.is_set, what="the hub to stall mid-file")
    await wait_until(lambda: partial.exists() and partial.stat().st_size == at, what="the partial to hold it all")
    await rig.stop()  # the service goes away mid-file
    f.release.set()
    assert partial.stat().st_size == at

    await rig.start()  # a new service on the same directory picks the fetch up
    end = await rig.outcome()
    assert end.type == "mirror.fetch_completed", end.payload
    assert [s.start for s in f.served] == [0, at]
    assert f.served[1].sent == len(f.data) - at, "only the remainder crossed the network again"
    assert (rig.root / "tiny" / repo.commit[:8] / "big.gguf").read_bytes() == f.data
    assert not partial.exists()
    [verified] = [e.payload for e in await rig.events() if isinstance(e.payload, E.FileVerified)]
    assert verified.resumed_from == at and verified.sha256 == f.sha256
    assert isinstance(end.payload, E.FetchCompleted) and end.payload.downloaded == len(f.data) - at


class FillingDisk(DiskGuard):
    """A disk that fills up, from another writer, once ``room`` more bytes are written."""

    def __init__(self, root: Path, room: int) -> None:
        super().__init__(root)
        self.room = room

    def claim(self, n: int) -> None:
        self.room -= n
        if self.room < 0:
            raise OSError(errno.ENOSPC, "No space left on device")


async def test_a_full_disk_fails_the_fetch_cleanly_and_leaves_no_partial_file(
    store: EventStore, hub: FakeHub, tmp_path: Path
) -> None:
    hub.add_repo(REPO)
    f = hub.add_file(REPO, "big.gguf", blob(2_000_000))
    # Refused before any download when it cannot fit at all.
    small = await Rig(store, hub, tmp_path, max_bytes=1_000_000).start()
    try:
        with pytest.raises(CommandRejectedError) as caught:
            await small.fetch()
        assert caught.value.code == "disk_full" and "needs 2.0 MB" in caught.value.reason
        assert f.bytes_served == 0
    finally:
        await small.stop()
    # The disk fills while the file arrives.
    r = await Rig(store, hub, tmp_path).start(guard=FillingDisk(tmp_path / "mirror", room=700_000))
    try:
        await r.fetch()
        end = await r.outcome()
        assert isinstance(end.payload, E.FetchFailed) and end.payload.code == "disk_full"
        assert "disk is full" in end.payload.reason and "llmgw mirror remove" in end.payload.reason
        assert files_under(r.root) == [], "no partial file left behind"
    finally:
        await r.stop()


@pytest.mark.parametrize("bad", ["../x", "a/b/c", "noslash", "", "../../etc/passwd", "a/..", "a b/c", "a/b..c"])
async def test_a_name_that_is_not_owner_slash_name_is_refused(rig: Rig, hub: FakeHub, bad: str) -> None:
    with pytest.raises(CommandRejectedError) as caught:
        await rig.fetch(repo=bad)
    assert caught.value.code == "invalid_repo"
    assert "is not a repository; it looks like owner/name" in caught.value.reason
    assert hub.requests == [], "the hub is never asked"


async def test_what_the_hub_does_not_have_is_refused_with_what_it_has(rig: Rig, hub: FakeHub) -> None:
    hub.add_repo(REPO)
    hub.add_file(REPO, "tiny-Q8_0.gguf", blob(5000))
    hub.add_file(REPO, "tiny-Q4_K_M.gguf", blob(3000))
    cases = [
        (dict(repo="acme/nothing"), "not_found", "there is no repository acme/nothing"),
        (dict(revision="v9"), "no_revision", "has no revision 'v9'"),
        (
            dict(files=["tiny-Q2_K.gguf"]),
            "no_such_file",
            "has no tiny-Q2_K.gguf; it has: tiny-Q4_K_M.gguf, tiny-Q8_0.gguf",
        ),
    ]
    for kw, code, said in cases:
        with pytest.raises(CommandRejectedError) as caught:
            await rig.fetch(**kw)
        assert caught.value.code == code and said in caught.value.reason, caught.value.reason
    assert hub.resolve_requests() == [] and await rig.events() == []


async def test_a_download_s_progress_is_telemetry_a_watcher_sees_rising_not_events_on_the_log(
    store: EventStore, hub: FakeHub, tmp_path: Path
) -> None:
    hub.add_repo(REPO)
    size = 24 * 1024 * 1024  # past what the writer holds ahead (writes overlap the download), so bytes land mid-file
    hub.add_file(REPO, "big.gguf", b"x" * size)
    seen: list[E.DownloadProgress] = []
    decoder = msgspec.json.Decoder(E.DownloadProgress)

    async def on_msg(msg: Any) -> None:
        seen.append(decoder.decode(msg.data))

    watching = await store.nc.subscribe(E.progress_subject("tiny"), cb=on_msg)
    rig = await Rig(store, hub, tmp_path, progress_interval_s=0.0).start()  # every chunk, to be seen here
    try:
        out = await rig.fetch()
        end = await rig.outcome()
        assert end.type == "mirror.fetch_completed", end.payload
        await wait_until(lambda: len(seen) >= 1, what="progress samples")
        assert {(p.model, p.version, p.file, p.size) for p in seen} == {
            ("tiny", out.result["version"], "big.gguf", size)
        }
        dones = [p.done for p in seen]
        assert dones == sorted(dones) and 0 < dones[-1] < size, "rising, the end said by file_verified"
        assert not [e for e in await rig.events() if e.type == "mirror.file_progress"], "no progress on the log"
    finally:
        await watching.unsubscribe()
        await rig.stop()


def test_a_watcher_s_bar_shows_share_rate_and_time_left_and_plain_lines_without_a_terminal() -> None:
    out = io.StringIO()
    bars = Downloads(out, terminal=True)
    bars.update("big.gguf", 0, 100 * 1024 * 1024, at=0.0)
    bars.update("big.gguf", 25 * 1024 * 1024, 100 * 1024 * 1024, at=1.0)
    text = out.getvalue().split("\r")[-1]
    assert "[######..................]" in text and " 25%" in text and "26.2 MB/s" in text and "0:03 left" in text
    plain = io.StringIO()
    lines = Downloads(plain, terminal=False)
    for i in range(0, 101, 5):
        lines.update("big.gguf", i * 1024, 100 * 1024, at=i / 10)
    assert len(plain.getvalue().splitlines()) == 11, "a line every 10 %, no carriage returns"
    assert "\r" not in plain.getvalue()


def test_progress_is_reported_once_a_second_or_every_five_percent() -> None:
    size = 1000
    assert not should_report(10, size, 0, 0.0, 0.1), "not per chunk"
    assert should_report(50, size, 0, 0.0, 0.1), "5 % more"
    assert should_report(10, size, 0, 0.0, 1.0), "a second later"
    assert not should_report(size, size, 0, 0.0, 5.0), "the end is file_verified"


async def test_a_model_name_that_is_not_one_is_refused(rig: Rig, hub: FakeHub) -> None:
    with pytest.raises(CommandRejectedError) as caught:
        await rig.fetch(model="../etc")
    assert caught.value.code == "invalid_name" and hub.requests == []


async def test_removing_a_model_mid_fetch_stops_it_and_deletes_its_files(rig: Rig, hub: FakeHub) -> None:
    hub.add_repo(REPO)
    f = hub.add_file(REPO, "big.gguf", blob(1_000_000))
    f.stall_after, f.stall_times = 300_000, 1
    await rig.fetch()
    await wait_until(f.stalled.is_set, what="the hub to stall mid-file")
    out = await rig.remove("tiny")
    assert "removed tiny" in out.message
    f.release.set()
    assert files_under(rig.root) == []
    types = [e.type for e in await rig.events()]
    assert types[-1] == "mirror.removed" and "mirror.fetch_failed" not in types
    with pytest.raises(CommandRejectedError) as caught:
        await rig.remove("tiny")
    assert caught.value.code == "not_found" and "holds no model 'tiny'" in caught.value.reason


# -- MIR-2: serving --------------------------------------------------------------------------


async def test_the_file_server_answers_ranges_and_only_to_token_holders(rig: Rig, hub: FakeHub) -> None:
    repo = hub.add_repo(REPO)
    f = hub.add_file(REPO, "tiny-Q8_0.gguf", blob(100_000))
    await rig.fetch()
    assert (await rig.outcome()).type == "mirror.fetch_completed"
    version = repo.commit[:8]
    url = f"{rig.url}/files/tiny/{version}/tiny-Q8_0.gguf"
    (rig.root / "tiny" / version / "stray.gguf").write_bytes(b"not verified")
    await wait_until(lambda: rig.svc is not None and rig.svc.state.verified("tiny", version, "tiny-Q8_0.gguf"))

    async with aiohttp.ClientSession() as s:
        async with s.get(f"{rig.url}/healthz") as resp:
            assert resp.status == 200
        for headers in ({}, {"Authorization": "Bearer llmgw-mirror-wrong"}, {"Authorization": "Basic eDp5"}):
            async with s.get(url, headers=headers) as resp:
                assert resp.status == 401 and resp.headers["WWW-Authenticate"].startswith("Bearer")
            async with s.get(f"{rig.url}/files/", headers=headers) as resp:
                assert resp.status == 401
        auth = {"Authorization": f"Bearer {await rig.token()}"}
        async with s.get(url, headers={**auth, "Range": "bytes=10-19"}) as resp:
            assert resp.status == 206
            assert resp.headers["Content-Range"] == f"bytes 10-19/{len(f.data)}"
            assert await resp.read() == f.data[10:20]
        async with s.get(url, headers={**auth, "Range": f"bytes={len(f.data) - 5}-"}) as resp:
            assert resp.status == 206 and await resp.read() == f.data[-5:]
        async with s.head(url, headers=auth) as resp:
            assert resp.status == 200 and int(resp.headers["Content-Length"]) == len(f.data)
            assert resp.headers["X-Llmgw-Sha256"] == f.sha256
        async with s.get(url, headers=auth) as resp:
            assert resp.status == 200 and await resp.read() == f.data
        async with s.get(f"{rig.url}/files/", headers=auth) as resp:
            listing = (await resp.json())["files"]
        assert [(x["model"], x["version"], x["file"], x["sha256"]) for x in listing] == [
            ("tiny", version, "tiny-Q8_0.gguf", f.sha256)
        ]
        for path in (f"tiny/{version}/stray.gguf", "tiny/..%2F..%2Fetc/passwd", f"tiny/{version}/..%2Fx"):
            async with s.get(f"{rig.url}/files/{path}", headers=auth) as resp:
                assert resp.status == 404, path


# -- the CLI, through the composition root ---------------------------------------------------


async def cli(nats_url: str, base: Path, *args: str, token: str = "") -> tuple[int, str, str]:
    env = {**os.environ, "LLMGW_DATA_DIR": str(base / "no-up"), "LLMGW_TOKEN": token}
    env.pop("LLMGW_API_URL", None)
    proc = await asyncio.create_subprocess_exec(
        LLMGW, "--nats", nats_url, *args, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode(), err.decode()


async def test_mirror_fetch_list_and_remove_through_the_cli(
    store: EventStore, nats: NatsServer, hub: FakeHub, tmp_path: Path
) -> None:
    repo = hub.add_repo(REPO)
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    hub.add_file(REPO, "tiny-Q8_0.gguf", gguf)
    version = repo.commit[:8]
    config = ServerConfig(
        nats_url=nats.url,
        db_dsn=f"sqlite:///{tmp_path / 'projections.db'}",
        services=("mirror",),
        mirror_dir=str(tmp_path / "mirror"),
        mirror_port=free_port(),
        hub_endpoint=hub.url,
        hub_allow_private=True,  # the fake hub is on loopback
    )
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(serve(config, stop, on_ready=ready.set))
    try:
        await asyncio.wait_for(ready.wait(), 30)
        token = await person_on_log(store)
        code, out, err = await cli(nats.url, tmp_path, "mirror", "fetch", "tiny", REPO, token=token)
        assert code == 0, err
        assert f"into tiny/{version}" in out and "verified" in out and f"tiny/{version} is on the mirror" in out

        code, out, err = await cli(nats.url, tmp_path, "mirror", "list", "--json")
        assert code == 0, err
        [row] = json.loads(out)
        assert (row["model"], row["version"], row["state"], row["repo"]) == ("tiny", version, "present", REPO)
        assert row["files"][0]["sha256"] == hashlib.sha256(gguf.read_bytes()).hexdigest()
        code, out, _ = await cli(nats.url, tmp_path, "mirror", "list")
        assert "tiny" in out and "present" in out and version in out

        code, out, err = await cli(nats.url, tmp_path, "mirror", "remove", f"tiny/{version}", token=token)
        assert code == 0, err
        assert f"removed tiny/{version}" in out
        assert files_under(tmp_path / "mirror") == []
        code, out, _ = await cli(nats.url, tmp_path, "mirror", "list")
        assert "holds nothing" in out
        code, _, err = await cli(nats.url, tmp_path, "mirror", "remove", "tiny", token=token)
        assert code == 2 and "holds no model 'tiny'" in err
        code, _, err = await cli(nats.url, tmp_path, "mirror", "fetch", "tiny", "../etc", token=token)
        assert code == 2 and "looks like owner/name" in err
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
    removed = [e for e in await store.read(event_subject(E.AGGREGATE, "tiny")) if e.type == "mirror.removed"]
    assert [e.payload for e in removed] == [E.MirrorRemoved(version=version)]
    assert removed[0].envelope.actor.startswith("user:"), "the tombstone names who removed it"
