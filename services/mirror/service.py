"""The mirror service: handles `mirror fetch|remove`, downloads in the background, serves files.

A fetch is decided when its command arrives (the hub is asked about the repository, and whatever
would be refused is refused then, before any download) and carried out by a task per model
version, one file at a time, into ``MIRROR_DIR/MODEL/VERSION/FILE.partial``; a file takes its name
only once its checksum matched. Tasks survive nothing: a fetch the log says is still running when
the service starts is picked up again, resuming each file from its partial.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import math
import os
import shutil
import time
from pathlib import Path

import aiohttp
import msgspec
import structlog
from aiohttp import web

from llmgw.events.commands.auth import CommandVerifier
from llmgw.events.commands.command import Command
from llmgw.events.commands.processor import CommandProcessor
from llmgw.events.commands.shell import Cause, CommandShell, Decision
from llmgw.events.folds.mirror import MirrorState, VersionState
from llmgw.events.runtime.follower import FollowerRegistry
from llmgw.events.runtime.followers import Followers
from llmgw.events.runtime.secrets import engine_key_secret, mirror_token
from llmgw.events.runtime.store import AppendResult, EventStore, NewEvent
from llmgw.events.runtime.tasks import cancel_and_wait
from llmgw.events.schema import mirror as E
from llmgw.events.schema.outcomes import Rejected
from llmgw.events.schema.subjects import EVENTS_ROOT, aggregate_of, event_subject
from llmgw.modelfiles import outbound
from llmgw.services.mirror import rules
from llmgw.services.mirror.download import DiskGuard, DownloadError, Mismatch, download
from llmgw.services.mirror.files import file_server
from llmgw.services.mirror.hub import DEFAULT_HUB, HubClient, HubError
from llmgw.services.mirror.peer import PeerMirror
from llmgw.services.mirror.purge import Purger
from llmgw.services.mirror.rules import check_model, check_repo, human, should_report

log = structlog.get_logger("llmgw.services.mirror")
_progress_encoder = msgspec.json.Encoder()

ACTOR = f"svc:{E.SERVICE}"


class MirrorConfig(msgspec.Struct, frozen=True, kw_only=True):
    dir: str
    hub: str = DEFAULT_HUB  # HF_ENDPOINT, resolved by the caller
    token: str | None = None  # a hub token (HF_TOKEN); sent to the hub only
    max_bytes: int | None = None  # the most the mirror directory may hold
    chunk_bytes: int = 1 << 20  # written (and hashed) in pieces this large
    retries: int = 5  # attempts in a row without progress before a fetch fails
    retry_backoff_s: float = 1.0
    progress_interval_s: float = 0.5  # a download's progress telemetry at most this often
    progress_step: float = 1.0  # …or every this share of the file (1: time only)
    hub_timeout_s: float = 20.0
    # connect to a hub (or where it redirects) at private, loopback or link-local addresses (modelfiles/outbound.py)
    hub_allow_private: bool = False
    peer_of: str | None = None  # a primary's file server: this mirror only copies from it (MIR-4)
    peer_name: str = "peer"  # the peer's own aggregate, llmgw.evt.mirror_peer.<peer_name>
    purge_replica_wait_s: float = 600.0  # a purge fails when the model's replicas still run after this long


class MirrorService:
    def __init__(
        self,
        store: EventStore,
        config: MirrorConfig,
        *,
        guard: DiskGuard | None = None,
        folds: FollowerRegistry | None = None,
        resolver: outbound.OutboundResolver | None = None,
        verifier: CommandVerifier | None = None,
    ) -> None:
        """``resolver``: where the hub's session may connect; by default ``config.hub_allow_private``'s rule."""
        self.store = store
        self.folds = folds if folds is not None else FollowerRegistry()
        self.config = config
        self.root = Path(config.dir)
        self.state = MirrorState()
        self.resolver = resolver or outbound.OutboundResolver(config.hub_allow_private)
        self.hub = HubClient(config.hub, config.token, config.hub_timeout_s, resolver=self.resolver)
        self.guard = guard or DiskGuard(self.root, config.max_bytes)
        self.tasks: dict[tuple[str, str], asyncio.Task] = {}
        self.token: str | None = None  # what the file server accepts, derived from the cluster secret
        self._session: aiohttp.ClientSession | None = None
        self.purger: Purger | None = None  # purges of removed models' files (CAT-4), primary only
        self._processor: CommandProcessor | None = None
        self.peer: PeerMirror | None = None
        self._stopped = asyncio.Event()
        subjects = {f"{EVENTS_ROOT}.{E.AGGREGATE}.>": "mirror"}
        self.fold = Followers(store, subjects, lambda event: self._apply([event]), registry=self.folds)
        self.shell = CommandShell(
            store,
            service=E.SERVICE,
            what="the mirror",
            fold=self.fold,
            gather=self.gather,
            decide=rules.decide,
            payload_type=E.MirrorCommand,
            before_append=self._before_append,
            after_append=self._after_append,
            verifier=verifier,
        )

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Read the log, finish removals, pick up fetches that were running; then follow the log."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.token = mirror_token(await engine_key_secret(self.store.js))
        # No total timeout: a file can take hours. A stalled connection is caught by the read timeout.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=120)
        if self.config.peer_of:
            # A peer talks to its primary only: an address the operator gave, on their own network.
            self._session = aiohttp.ClientSession(timeout=timeout, auto_decompress=False)
        else:
            # Every connection to the hub, and every redirect hop, under the outbound rule.
            self._session = outbound.session(self.resolver, timeout=timeout, auto_decompress=False)
        if self.config.peer_of:
            # A peer takes no commands and writes no mirror.* events: it copies what the primary holds.
            self.peer = PeerMirror(
                self.store,
                self.root,
                self.config.peer_of,
                self.config.peer_name,
                lambda: self.token,
                self.guard,
                chunk_bytes=self.config.chunk_bytes,
                retries=self.config.retries,
                backoff_s=self.config.retry_backoff_s,
                folds=self.folds,
            )
            self.state = self.peer.state
            await self.peer.start(self._session)
            return
        await self.fold.catch_up(math.inf)  # at start: as long as reading the log takes
        await asyncio.to_thread(self._sweep_removed)
        for v in self.state.fetching():
            log.info("resuming a fetch", model=v.model, version=v.version)
            self._spawn(v)
        # From here the command fold, which goes on following the log, keeps the state (and so the file
        # server) current with what the tasks write: one supervised fold of the mirror's events, not two.
        # Purges the log shows open are taken up again once the purger's folds caught up.
        self.purger = Purger(
            self.store,
            self.root,
            lambda: self.state,
            cancel_fetch=self._cancel,
            forget_version=self._forget_version,
            folds=self.folds,
            replica_wait_s=self.config.purge_replica_wait_s,
        )
        await self.purger.start()

    def processor(self) -> CommandProcessor:
        if self._processor is None:
            self._processor = self.shell.processor()
        return self._processor

    async def run(self) -> None:
        if self.config.peer_of:
            await self._stopped.wait()
            return
        await self.processor().run()

    def stop(self) -> None:
        self._stopped.set()
        if not self.config.peer_of:
            self.processor().stop()

    async def close(self) -> None:
        """Stop downloads (their partial files stay for the next start) and the fold."""
        self.stop()
        if self.peer is not None:
            await self.peer.close()
        if self.purger is not None:
            await self.purger.close()
        await self.fold.close()
        await cancel_and_wait(self.tasks.values())
        if self._session is not None:
            await self._session.close()

    def app(self) -> web.Application:
        view = self.peer.view if self.peer is not None else self.state
        return file_server(view, self.root, lambda: self.token)

    # -- the log -----------------------------------------------------------------------------

    async def catch_up(self) -> None:
        await self.fold.catch_up()

    def _apply(self, batch: list) -> None:
        for e in batch:
            if hasattr(e, "envelope"):
                _, model = aggregate_of(e.subject)
                self.state.apply(model, e)

    async def _append(self, model: str, payload: msgspec.Struct, cause: Cause) -> int:
        # A fetch's later events are on behalf of the command that started it, in its thread.
        event = NewEvent(payload=payload, actor=ACTOR, causation=cause.causation, correlation=cause.correlation)
        result = await self.store.append(event_subject(E.AGGREGATE, model), [event])
        return result.last_seq

    # -- commands ----------------------------------------------------------------------------

    async def gather(self, command: Command, payload: E.MirrorCommand) -> rules.Facts:
        """What the rules (:mod:`.rules`) decide on: the folded state, and for a fetch what the hub says
        about the repository and how much room the disk has. A name that is not one is refused before
        it reaches a URL."""
        if not isinstance(payload, E.MirrorFetch):
            return rules.Facts(state=self.state)
        check_model(payload.model)
        repo = check_repo(payload.repo)
        revision = payload.revision.strip() or "main"
        if len(revision) > 256 or any(c.isspace() for c in revision):
            raise Rejected(f"{revision!r} is not a revision: a branch, tag or commit", "invalid_revision")
        try:
            info = await self.hub.info(repo, revision)
        except HubError as exc:
            raise Rejected(exc.message, exc.code) from exc
        free = await asyncio.to_thread(self.guard.free)
        asked = rules.Asked(
            fetch=msgspec.structs.replace(payload, repo=repo, revision=revision),
            info=info,
            free_bytes=free,
            has_token=bool(self.config.token),
            hub=self.hub.shown,
        )
        return rules.Facts(state=self.state, asked=asked)

    async def _before_append(self, command: Command, payload: E.MirrorCommand, decision: Decision) -> None:
        if isinstance(decision.confirm, rules.Preflight):
            await self._preflight(decision.confirm)  # a gated repository: may the token read it?
        # A removal stops the downloads it removes before it is written, so none writes after it.
        if isinstance(payload, E.MirrorRemove):
            for v in rules.targets(self.state, payload):
                await self._cancel(payload.model, v.version)

    async def _after_append(
        self, command: Command, payload: E.MirrorCommand, decision: Decision, appended: AppendResult
    ) -> None:
        if isinstance(payload, E.MirrorRemove):
            await asyncio.to_thread(self._delete, payload.model, payload.version)
            log.info("removed", model=payload.model, version=payload.version)
            return
        await self.catch_up()  # in order: the fold must never skip past events it has not seen
        model, version = decision.result["model"], decision.result["version"]
        held = self.state.version(model, version)
        assert held is not None
        self._spawn(held)
        log.info("fetch started", model=model, version=version, repo=held.repo, files=len(held.fetch_files))

    async def _preflight(self, ask: rules.Preflight) -> None:
        assert self._session is not None
        repo = ask.repo
        url = self.hub.file_url(repo, ask.commit, ask.path)
        headers = {"Accept-Encoding": "identity", **self.hub.auth_for(url)}
        try:
            async with self._session.head(url, headers=headers, allow_redirects=False) as resp:
                if resp.status in (401, 403):
                    raise Rejected(
                        f"{repo} is gated on the hub and the configured token may not read it: accept its terms "
                        "with that account, or choose another repository",
                        "gated",
                    )
        except outbound.DestinationRefused as exc:
            raise Rejected(f"{repo}: {exc.reason}", "refused_destination") from exc
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise Rejected(
                f"the hub did not answer for {repo} ({exc}); send the fetch again", "hub_unreachable"
            ) from exc

    # -- files on disk -----------------------------------------------------------------------

    def _delete(self, model: str, version: str | None) -> None:
        target = self.root / model if version is None else self.root / model / version
        shutil.rmtree(target, ignore_errors=True)
        if version is not None:
            with contextlib.suppress(OSError):
                (self.root / model).rmdir()  # only when it held nothing else
        self.guard.refresh()

    async def _forget_version(self, model: str, version: str, causation: str | None, correlation: str | None) -> None:
        """A purge deleted every file of a version: the tombstone tells the fold and peers, and its folder goes."""
        await self._append(model, E.MirrorRemoved(version=version), Cause(causation, correlation))
        await asyncio.to_thread(self._delete, model, version)

    def _sweep_removed(self) -> None:
        """Finish removals a stop interrupted: the tombstone was written, the files may not be gone."""
        for model, stones in self.state.tombstones.items():
            held = self.state.models.get(model, {})
            base = self.root / model
            if not base.is_dir():
                continue
            for child in base.iterdir():
                if child.is_dir() and child.name not in held and (None in stones or child.name in stones):
                    shutil.rmtree(child, ignore_errors=True)
            with contextlib.suppress(OSError):
                base.rmdir()

    # -- fetching ----------------------------------------------------------------------------

    def _spawn(self, v: VersionState) -> None:
        files = [
            E.MirrorFile(path=f.path, name=f.name, size=f.size, sha256=f.published_sha256, blob_id=f.blob_id)
            for name in v.fetch_files
            if (f := v.files.get(name)) is not None and not f.verified
        ]
        key = (v.model, v.version)
        cause = Cause(v.causation, v.correlation)
        self.tasks[key] = asyncio.create_task(
            self._run_fetch(v.model, v.version, v.repo, v.commit, files, cause), name=f"mirror-{v.model}"
        )

    async def _cancel(self, model: str, version: str) -> None:
        task = self.tasks.pop((model, version), None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _run_fetch(
        self, model: str, version: str, repo: str, commit: str, files: list[E.MirrorFile], cause: Cause
    ) -> None:
        loop = asyncio.get_running_loop()
        began = loop.time()
        downloaded = 0
        try:
            for f in files:
                reason, code, got = await self._fetch_file(model, version, repo, commit, f, cause)
                if reason is not None:
                    await self._append(
                        model, E.FetchFailed(version=version, reason=reason, file=f.name, code=code), cause
                    )
                    log.warning("fetch failed", model=model, version=version, file=f.name, reason=reason)
                    return
                downloaded += got
            held = self.state.version(model, version)
            total = {f.name: f.size for f in files} | ({n: x.size for n, x in held.files.items()} if held else {})
            await self._append(
                model,
                E.FetchCompleted(
                    version=version,
                    files=len(total),
                    bytes=sum(total.values()),
                    downloaded=downloaded,
                    seconds=round(loop.time() - began, 3),
                ),
                cause,
            )
            log.info("fetch completed", model=model, version=version, downloaded=downloaded)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("fetch task failed", model=model, version=version)
            with contextlib.suppress(Exception):
                await self._append(
                    model,
                    E.FetchFailed(
                        version=version,
                        reason=f"the mirror failed on {model}/{version} ({type(exc).__name__}: {exc}); "
                        "see its log, then fetch again",
                        code="internal",
                    ),
                    cause,
                )
        finally:
            if self.tasks.get((model, version)) is asyncio.current_task():
                self.tasks.pop((model, version), None)

    async def _fetch_file(
        self, model: str, version: str, repo: str, commit: str, f: E.MirrorFile, cause: Cause
    ) -> tuple[str | None, str, int]:
        """(why it failed or None, failure code, bytes downloaded)."""
        assert self._session is not None
        folder = self.root / model / version
        folder.mkdir(parents=True, exist_ok=True)
        final, part = folder / f.name, folder / f"{f.name}.partial"
        if final.exists() and not part.exists():
            os.replace(final, part)  # renamed before a stop, never recorded: verify it again
        loop = asyncio.get_running_loop()
        last = [part.stat().st_size if part.exists() else 0, loop.time()]

        async def progress(done: int) -> None:
            now = loop.time()
            if should_report(
                done,
                f.size,
                last[0],
                last[1],
                now,
                interval_s=self.config.progress_interval_s,
                step=self.config.progress_step,
            ):
                last[0], last[1] = done, now
                # Telemetry for whoever watches, not an event: the log keeps the verified file, not each step to it.
                tick = E.DownloadProgress(
                    model=model, version=version, file=f.name, done=done, size=f.size, at=time.time()
                )
                with contextlib.suppress(Exception):  # a watcher's bar is never worth a failed download
                    await self.store.nc.publish(E.progress_subject(model), _progress_encoder.encode(tick))

        self.guard.refresh()
        try:
            got = await download(
                self._session,
                self.hub.file_url(repo, commit, f.path),
                part,
                f,
                auth=self.hub.auth_for,
                guard=self.guard,
                progress=progress,
                chunk_bytes=self.config.chunk_bytes,
                retries=self.config.retries,
                backoff_s=self.config.retry_backoff_s,
            )
        except DownloadError as exc:
            if exc.code != "checksum":
                return exc.reason, exc.code, 0
            # The pipeline compared what arrived with what the hub published, and deleted it.
            self.guard.refresh()
            return (
                f"{exc.reason}: it was deleted and is not served. Fetch it again; if this repeats, the hub's copy "
                "is damaged",
                exc.code,
                exc.got.downloaded if isinstance(exc, Mismatch) else 0,
            )
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            part.unlink(missing_ok=True)  # a full disk keeps no half file
            self.guard.refresh()
            return (
                f"the mirror's disk is full ({self.root}): {f.name} needs {human(f.size)}; remove what is no longer "
                "used (`llmgw mirror remove MODEL[/VERSION]`) or give the mirror more room, then fetch again",
                "disk_full",
                0,
            )
        os.replace(part, final)
        await asyncio.to_thread(_sync_dir, folder)
        await self._append(
            model,
            E.FileVerified(
                version=version, file=f.name, size=got.size, sha256=got.sha256, resumed_from=got.resumed_from
            ),
            cause,
        )
        return None, "", got.downloaded


def _sync_dir(path: Path) -> None:
    """The rename is durable once the directory is flushed."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
