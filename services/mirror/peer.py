"""A peer mirror (SPEC MIR-4): a second mirror kept in step with a primary, from the primary's events.

The primary's ``llmgw.evt.mirror.<model>`` events stay the source of truth for what should exist:
the peer folds them (the same :class:`MirrorState` the primary keeps) and, for every version whose
fetch completed, copies each verified file from the primary's file server (cluster token, ``Range``
resume into ``FILE.partial``, sha256 checked against the event's and the server's
``X-Llmgw-Sha256``; a mismatch is deleted). What the peer holds is recorded under its own aggregate,
``llmgw.evt.mirror_peer.<peer name>`` — never as ``mirror.*`` events — so a copy is not announced as
a fetch and two mirrors can follow each other without loops.

A ``mirror.removed`` tombstone drops the version from the fold: the peer deletes its copy and,
because it only copies what the fold says is present, never copies it back, however late it starts
(a later fetch of the same version is a new fetch, and is copied).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import structlog

from llmgw.events.folds.mirror import PRESENT, FileState, MirrorState
from llmgw.events.runtime.follower import Follower, FollowerRegistry
from llmgw.events.runtime.store import EventStore, NewEvent
from llmgw.events.runtime.tasks import cancel_and_wait
from llmgw.events.schema import mirror as E
from llmgw.events.schema.envelope import RecordedEvent
from llmgw.events.schema.subjects import EVENTS_ROOT, aggregate_of, event_subject
from llmgw.services.mirror.download import DiskGuard, DownloadError, download

log = structlog.get_logger("llmgw.services.mirror.peer")

ACTOR = f"svc:{E.SERVICE}-peer"


class Held(msgspec.Struct, frozen=True, kw_only=True):
    sha256: str
    size: int


class PeerState:
    """The peer's own record, folded from ``mirror_peer.<name>``: the files it holds, what failed."""

    def __init__(self) -> None:
        self.held: dict[str, Held] = {}  # MODEL/VERSION/FILE -> what was verified
        self.failed: dict[str, str] = {}  # ref -> the sha256 a checksum failure was for (not tried again)
        self.position = 0

    def apply(self, event: RecordedEvent) -> None:
        if event.seq <= self.position:
            return
        self.position = event.seq
        p = event.payload
        match p:
            case E.PeerFileCopied():
                ref = f"{p.model}/{p.version}/{p.file}"
                self.held[ref] = Held(sha256=p.sha256, size=p.size)
                self.failed.pop(ref, None)
            case E.PeerCopyFailed():
                ref = f"{p.model}/{p.version}/{p.file}"
                if p.code == "checksum":
                    self.failed[ref] = p.reason
            case E.PeerFileDeleted():
                ref = f"{p.model}/{p.version}/{p.file}"
                self.held.pop(ref, None)
                self.failed.pop(ref, None)


class PeerView:
    """What the peer's file server hands out: files the primary's log says are present and the
    peer holds with the same sha256 (the same interface :func:`file_server` reads from MirrorState)."""

    def __init__(self, primary: MirrorState, own: PeerState) -> None:
        self.primary = primary
        self.own = own

    def verified(self, model: str, version: str, name: str) -> FileState | None:
        f = self.primary.verified(model, version, name)
        held = self.own.held.get(f"{model}/{version}/{name}")
        return f if f is not None and held is not None and held.sha256 == f.sha256 else None

    def rows(self) -> list[dict[str, Any]]:
        out = []
        for row in self.primary.rows():
            files = [
                {**f, "verified": self.verified(row["model"], row["version"], f["name"]) is not None}
                for f in row["files"]
            ]
            out.append({**row, "files": files})
        return out


def wanted(state: MirrorState) -> dict[str, FileState]:
    """Every file of a version whose fetch completed on the primary, by ref."""
    out = {}
    for model, versions in state.models.items():
        for v in versions.values():
            if v.state != PRESENT:
                continue
            for f in v.files.values():
                if f.verified and f.sha256:
                    out[f"{model}/{v.version}/{f.name}"] = f
    return out


class PeerMirror:
    """Follows the primary's events and keeps ``root`` in step; see the module's doc."""

    def __init__(
        self,
        store: EventStore,
        root: Path,
        primary_url: str,
        name: str,
        token: Any,
        guard: DiskGuard,
        *,
        chunk_bytes: int,
        retries: int,
        backoff_s: float,
        folds: FollowerRegistry | None = None,
    ) -> None:
        self.store = store
        self.folds = folds if folds is not None else FollowerRegistry()
        self.root = root
        self.primary_url = primary_url.rstrip("/")
        self.name = name
        self.token = token  # () -> str | None
        self.guard = guard
        self.chunk_bytes = chunk_bytes
        self.retries = retries
        self.backoff_s = backoff_s
        self.state = MirrorState()
        self.own = PeerState()
        self.view = PeerView(self.state, self.own)
        self._wake = asyncio.Event()
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []
        self._follower: Follower | None = None

    @property
    def subject(self) -> str:
        return event_subject(E.PEER_AGGREGATE, self.name)

    async def start(self, session: aiohttp.ClientSession) -> None:
        self._session = session
        await self._catch_up()
        await asyncio.to_thread(self.sweep)
        self._wake.set()
        # The primary's events, followed by the supervised fold; each batch wakes the copier.
        self._follower = Follower(
            self.store,
            f"{EVENTS_ROOT}.{E.AGGREGATE}.>",
            lambda event: self._apply([event]),
            name="mirror-peer",
            after=self.state.position,
            registry=self.folds,
            on_batch=self._wake.set,
        ).start()
        self._tasks = [asyncio.create_task(self._reconcile_forever(), name="mirror-peer-sync")]

    async def close(self) -> None:
        if self._follower is not None:
            await self._follower.close()
        await cancel_and_wait(self._tasks)

    async def _catch_up(self) -> None:
        async for batch in self.store.subscribe(self.subject, after=self.own.position, follow=False):
            for e in batch:
                if hasattr(e, "envelope"):
                    self.own.apply(e)
        async for batch in self.store.subscribe(
            f"{EVENTS_ROOT}.{E.AGGREGATE}.>", after=self.state.position, follow=False
        ):
            self._apply(batch)

    def _apply(self, batch: list) -> None:
        for e in batch:
            if hasattr(e, "envelope"):
                _, model = aggregate_of(e.subject)
                self.state.apply(model, e)

    async def _record(self, payload: msgspec.Struct) -> None:
        result = await self.store.append(self.subject, [NewEvent(payload=payload, actor=ACTOR)])
        async for batch in self.store.subscribe(self.subject, after=self.own.position, follow=False):
            for e in batch:
                if hasattr(e, "envelope") and e.seq <= result.last_seq:
                    self.own.apply(e)

    async def _reconcile_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self.reconcile()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("peer sync failed; trying again", peer=self.name)
                await asyncio.sleep(self.backoff_s)
                self._wake.set()

    async def reconcile(self) -> None:
        """Delete what the primary's log removed; copy what it holds and this peer does not."""
        for ref in sorted(self.own.held):
            if ref not in wanted(self.state) and self._removed(ref):
                await self._delete(ref)
        retry = False
        for ref, f in sorted(wanted(self.state).items()):
            held = self.own.held.get(ref)
            if held is not None and held.sha256 == f.sha256:
                continue
            if self.own.failed.get(ref) == f.sha256:
                continue  # its bytes did not match this checksum; a new fetch on the primary tries again
            if not await self._copy(ref, f):
                retry = True
            if ref not in wanted(self.state):  # removed while it was copied
                await self._delete(ref)
        if retry:
            await asyncio.sleep(self.backoff_s)
            self._wake.set()

    def _removed(self, ref: str) -> bool:
        model, version, _ = ref.split("/")
        stones = self.state.tombstones.get(model, {})
        return None in stones or version in stones

    async def _delete(self, ref: str) -> None:
        model, version, name = ref.split("/")
        folder = self.root / model / version

        def rm() -> None:
            for p in (folder / name, folder / f"{name}.partial"):
                p.unlink(missing_ok=True)
            for d in (folder, folder.parent):
                with contextlib.suppress(OSError):
                    d.rmdir()
            self.guard.refresh()

        await asyncio.to_thread(rm)
        if ref in self.own.held:
            await self._record(E.PeerFileDeleted(model=model, version=version, file=name))
        log.info("peer deleted a removed file", peer=self.name, ref=ref)

    def _auth(self, url: str) -> dict[str, str]:
        token = self.token()
        return {"Authorization": f"Bearer {token}"} if token and url.startswith(self.primary_url + "/") else {}

    async def _fail(self, ref: str, reason: str, code: str) -> None:
        model, version, name = ref.split("/")
        log.warning("peer copy failed", peer=self.name, ref=ref, reason=reason, code=code)
        await self._record(E.PeerCopyFailed(model=model, version=version, file=name, reason=reason, code=code))

    async def _copy(self, ref: str, f: FileState) -> bool:
        """True when done (copied, or failed for good); False when worth trying again later."""
        assert self._session is not None and f.sha256 is not None
        model, version, name = ref.split("/")
        url = f"{self.primary_url}/files/{ref}"
        try:
            async with self._session.head(url, headers=self._auth(url)) as resp:
                if resp.status != 200:
                    # 404: the primary no longer serves it (removed, or its copy is gone): the log decides.
                    log.info("primary did not serve a file", peer=self.name, ref=ref, status=resp.status)
                    return resp.status not in (429,) and resp.status < 500
                served = resp.headers.get("X-Llmgw-Sha256", "").lower()
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.info("primary did not answer", peer=self.name, ref=ref, error=str(exc))
            return False
        if served != f.sha256:
            await self._fail(
                ref, f"the primary serves {ref} with sha256 {served!r}, and its log verified {f.sha256}", "checksum"
            )
            return True
        folder = self.root / model / version
        folder.mkdir(parents=True, exist_ok=True)
        final, part = folder / name, folder / f"{name}.partial"
        spec = E.MirrorFile(path=ref, name=name, size=f.size, sha256=f.sha256)

        async def progress(done: int) -> None:
            return None

        self.guard.refresh()
        try:
            got = await download(
                self._session,
                url,
                part,
                spec,
                auth=self._auth,
                guard=self.guard,
                progress=progress,
                chunk_bytes=self.chunk_bytes,
                retries=self.retries,
                backoff_s=self.backoff_s,
                source="the primary verified",
            )
        except DownloadError as exc:
            if exc.code == "checksum":
                # The pipeline compared what arrived with what the primary verified, and deleted it.
                self.guard.refresh()
                await self._fail(ref, f"{exc.reason}: the copy was deleted and is not served", "checksum")
                return True
            log.info("peer copy interrupted", peer=self.name, ref=ref, reason=exc.reason)
            return exc.code != "network"
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            part.unlink(missing_ok=True)
            await self._fail(ref, f"the peer's disk is full ({self.root}): {name} needs {f.size} bytes", "disk_full")
            return True
        os.replace(part, final)
        await self._record(
            E.PeerFileCopied(
                model=model,
                version=version,
                file=name,
                size=got.size,
                sha256=got.sha256,
                source=self.primary_url,
                resumed_from=got.resumed_from,
            )
        )
        log.info("peer copied a file", peer=self.name, ref=ref, bytes=got.downloaded)
        return True

    def sweep(self) -> None:
        """Delete folders of versions the log removed (a stop between the tombstone and the delete)."""
        for model, stones in self.state.tombstones.items():
            base = self.root / model
            if not base.is_dir():
                continue
            present = self.state.models.get(model, {})
            for child in base.iterdir():
                if child.is_dir() and child.name not in present and (None in stones or child.name in stones):
                    shutil.rmtree(child, ignore_errors=True)
