"""The jobs service: runs `ctl model serve` jobs as steps on the bus (SPEC MIR-3).

A job is accepted by its command (the request is checked there, so a bad repository name is
refused at once), then carried out by a task: each step writes ``job.step`` started, does its
work (a decision from :mod:`.rules` with thin I/O around it) and writes ``job.step`` done with what
it decided. Every append expects the job's last sequence, so only one runner writes a job. When
the service starts it folds every job from the log and resumes the unfinished ones from their
last completed step: a restart loses nothing, and no completed step runs again. A step that was
interrupted runs again, so every step is idempotent (the mirror's fetch and the catalog's add
recognise work already done).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import structlog

from llmgw.events.commands.auth import CommandVerifier
from llmgw.events.commands.client import CommandClient
from llmgw.events.commands.command import Command
from llmgw.events.commands.errors import CommandError, CommandRejectedError
from llmgw.events.commands.processor import CommandProcessor
from llmgw.events.commands.shell import CommandShell, Decision
from llmgw.events.folds.jobs import JobState
from llmgw.events.runtime.follower import FollowerRegistry
from llmgw.events.runtime.followers import Followers
from llmgw.events.runtime.retry import backoff_delay, is_transient
from llmgw.events.runtime.secrets import engine_key, engine_key_secret, mirror_token
from llmgw.events.runtime.store import AppendConflict, AppendResult, EventStore, NewEvent
from llmgw.events.runtime.tasks import cancel_and_wait
from llmgw.events.runtime.waiter import EventWaiter
from llmgw.events.schema import jobs as J
from llmgw.events.schema import mirror as MI
from llmgw.events.schema import models as M
from llmgw.events.schema import replicas as R
from llmgw.events.schema import scheduler as SCH
from llmgw.events.schema.envelope import RecordedEvent
from llmgw.events.schema.subjects import EVENTS_ROOT, aggregate_of, event_subject
from llmgw.modelfiles.gguf_header import GGUFHeader, read_header_file
from llmgw.modelfiles.http import read_header_url
from llmgw.modelfiles.outbound import OutboundResolver
from llmgw.modelfiles.picking import RepoFile, validate_repo_id
from llmgw.modelfiles.sizing import estimate_memory
from llmgw.services.jobs import rules
from llmgw.services.jobs.rules import StepFailed, StepResult
from llmgw.services.mirror.hub import DEFAULT_HUB, HubClient, HubError

log = structlog.get_logger("llmgw.services.jobs")

ACTOR = f"svc:{J.SERVICE}"
SMOKE_PROMPT = "Say hello in one short sentence."


class JobsConfig(msgspec.Struct, frozen=True, kw_only=True):
    hub: str = DEFAULT_HUB  # HF_ENDPOINT: where the file list is read
    token: str | None = None  # HF_TOKEN
    hub_allow_private: bool = False  # the hub may be at a private address (modelfiles/outbound.py)
    source: str = "mirror"  # "mirror": sources are mirror:MODEL/VERSION/FILE; "local": the mirror's own path
    mirror_dir: str | None = None  # the mirror's directory when it is on this machine (headers read there)
    mirror_url: str | None = None  # else its file server(s), comma-separated, for the header over Range requests
    unplaceable_s: float = 60.0  # a model unplaceable (or not ready after being blocked) this long fails the job
    wait_ready_s: float = 3600.0  # the most a replica may take to become ready
    fetch_s: float = 24 * 3600.0  # the most a fetch may take
    smoke_tokens: int = 16
    smoke_timeout_s: float = 120.0


class JobsService:
    def __init__(
        self,
        store: EventStore,
        config: JobsConfig,
        *,
        folds: FollowerRegistry | None = None,
        verifier: CommandVerifier | None = None,
    ) -> None:
        self.store = store
        self.config = config
        self.folds = folds if folds is not None else FollowerRegistry()
        self.hub = HubClient(config.hub, config.token, resolver=OutboundResolver(config.hub_allow_private))
        self.client = CommandClient.for_service(store, "jobs")
        self.tasks: dict[str, asyncio.Task] = {}
        self._processor: CommandProcessor | None = None
        # Only which commands started a job is folded: a redelivered serve command starts none.
        self.fold = Followers(store, {f"{EVENTS_ROOT}.{J.AGGREGATE}.>": "jobs-commands"}, _nothing, registry=self.folds)
        self.shell = CommandShell(
            store,
            service=J.SERVICE,
            what="the job",
            fold=self.fold,
            # The command names the job and who asked: gathered from it, then decided purely.
            gather=lambda command, payload: rules.NewJob(id=command.id, requested_by=command.actor),
            decide=rules.decide,
            payload_type=J.JobCommand,
            after_append=self._started,
            applied_result=lambda command, payload: {"job": command.id},
            verifier=verifier,
        )

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Fold every job from the log and resume the unfinished ones."""
        self.fold.start()
        for job in (await self._jobs()).values():
            if job.request is not None and job.finished is None:
                log.info("resuming a job", job=job.id, done=list(job.done))
                self._spawn(job.id)

    def processor(self) -> CommandProcessor:
        if self._processor is None:
            self._processor = self.shell.processor()
        return self._processor

    async def run(self) -> None:
        await self.processor().run()

    def stop(self) -> None:
        self.processor().stop()

    async def close(self) -> None:
        """Stop the runners where they are; the next start resumes them."""
        self.stop()
        await cancel_and_wait(self.tasks.values())
        await self.fold.close()

    # -- the log -----------------------------------------------------------------------------

    async def _jobs(self) -> dict[str, JobState]:
        jobs: dict[str, JobState] = {}
        for e in await self.store.read(f"{EVENTS_ROOT}.{J.AGGREGATE}.>"):
            _, job_id = aggregate_of(e.subject)
            jobs.setdefault(job_id, JobState(job_id)).apply(e)
        return jobs

    async def load(self, job_id: str) -> JobState:
        job = JobState(job_id)
        for e in await self.store.read(event_subject(J.AGGREGATE, job_id)):
            job.apply(e)
        return job

    async def _append(self, job: JobState, payload: msgspec.Struct) -> None:
        event = NewEvent(payload=payload, actor=ACTOR, correlation=job.id)
        result = await self.store.append(event_subject(J.AGGREGATE, job.id), [event], expected=job.seq)
        job.seq = result.last_seq

    # -- commands ----------------------------------------------------------------------------

    async def _started(
        self, command: Command, payload: J.ServeModel, decision: Decision, appended: AppendResult
    ) -> None:
        self._spawn(command.id)

    # -- running a job -----------------------------------------------------------------------

    def _spawn(self, job_id: str) -> None:
        if job_id in self.tasks and not self.tasks[job_id].done():
            return
        self.tasks[job_id] = asyncio.create_task(self._run(job_id), name=f"job-{job_id}")

    async def _run(self, job_id: str) -> None:
        # NATS away for a while (an election, a lost node) pauses the job; it resumes from its log.
        attempt = 0
        while not await self._run_once(job_id):
            attempt += 1
            await asyncio.sleep(backoff_delay(attempt))

    async def _run_once(self, job_id: str) -> bool:
        """Run the job on; False when NATS trouble interrupted it and it should resume."""
        try:
            job = await self.load(job_id)
            while job.finished is None:
                step = rules.next_step(job.done)
                if step is None:
                    d = job.data
                    summary = f"{d.get('model')} is served"
                    if d.get("tokens_per_s") is not None:
                        summary += f"; it answered {d.get('answer', '')[:80]!r} at {d['tokens_per_s']} tokens/s"
                    await self._append(job, J.JobFinished(ok=True, summary=summary))
                    return True
                if job.running != step:  # resumed mid-step: it runs again, announced once
                    await self._append(job, J.JobStep(step=step, status=J.STARTED, message=_STARTING.get(step, step)))
                    job.running = step
                try:
                    result = await self._do(step, job)
                except StepFailed as exc:
                    await self._append(job, J.JobStep(step=step, status=J.FAILED, message=exc.message, data=exc.data))
                    await self._append(job, J.JobFinished(ok=False, summary=f"{step}: {exc.message}"))
                    return True
                await self._append(job, J.JobStep(step=step, status=J.DONE, message=result.message, data=result.data))
                job.done[step] = dict(result.data)
                job.running = None
        except AppendConflict:
            log.warning("another runner wrote this job; leaving it to that one", job=job_id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if is_transient(exc):
                log.warning("job paused: NATS is not answering; resuming", job=job_id, error=str(exc))
                return False
            log.exception("job runner failed; it resumes when the service starts again", job=job_id)
        return True

    async def _do(self, step: str, job: JobState) -> StepResult:
        req = job.request
        assert req is not None
        d = job.data
        try:
            match step:
                case "validate":
                    validate_repo_id(req.repo)
                    return StepResult(message=f"{req.repo} is a repository name (owner/name)")
                case "pick":
                    return await self._pick(req)
                case "fetch":
                    return await self._fetch(job, req, d)
                case "inspect":
                    header = await self._header(d)
                    return rules.check_architecture(header.architecture)
                case "size":
                    header = await self._header(d)
                    est = estimate_memory(header, d["bytes"], req.ctx_pool, sharded=d["shards"] > 1)
                    return rules.sized(est)
                case "add":
                    return await self._add(job, req, d)
                case "wait_ready":
                    return await self._wait_ready(job, req, d)
                case "smoke":
                    return await self._smoke(req, d)
        except CommandRejectedError as exc:
            raise StepFailed(exc.reason) from exc
        except CommandError as exc:
            raise StepFailed(str(exc)) from exc
        raise StepFailed(f"unknown step {step}")

    async def _pick(self, req: J.JobStarted) -> StepResult:
        try:
            info = await self.hub.info(req.repo, "main")
        except HubError as exc:
            raise StepFailed(exc.message) from exc
        files = [RepoFile(path=f.path, size=f.size or 0, sha256=f.sha256) for f in info.files]
        result = rules.pick(req, files)
        return StepResult(message=result.message, data={**result.data, "commit": info.commit})

    async def _fetch(self, job: JobState, req: J.JobStarted, d: dict[str, Any]) -> StepResult:
        model = d["model"]
        cmd = MI.MirrorFetch(model=model, repo=req.repo, revision=d["commit"], files=list(d["files"]))
        out = await self.client.send(MI.SERVICE, "fetch", cmd, actor=ACTOR, correlation=job.id, timeout=60)
        version = out.result["version"]
        subject = event_subject(MI.AGGREGATE, model)
        deadline = time.monotonic() + self.config.fetch_s
        # The version's latest start or end so far (a fetch done before an interruption, or already
        # held, has ended), then what follows: one read and one follower, never a poll.
        status: msgspec.Struct | None = None
        after = 0
        for e in await self.store.read(subject):
            after, status = e.seq, _fetch_status(e, version) or status
        # The follower's folds report in a registry of their own: a wait that begins is briefly catching
        # up, and the process's /healthz must not flap with every job; a wait that ends empty-handed says why.
        async with EventWaiter(self.store, {subject: after}, name=f"job-{job.id}") as events:
            while True:
                if isinstance(status, MI.FetchCompleted):
                    return StepResult(
                        message=f"{model}/{version}: {status.files} file(s), {rules._size(status.bytes)} verified",
                        data={"version": version},
                    )
                if isinstance(status, MI.FetchFailed):
                    raise StepFailed(f"the mirror could not fetch {req.repo}: {status.reason}")
                e = await events.next(deadline - time.monotonic())
                if e is None:
                    raise StepFailed(
                        f"the mirror did not finish fetching {model}/{version} within {self.config.fetch_s:.0f}s"
                        + _trouble(events)
                    )
                status = _fetch_status(e, version) or status

    async def _header(self, d: dict[str, Any]) -> GGUFHeader:
        name = d["first"].rsplit("/", 1)[-1]
        if self.config.mirror_dir:
            path = Path(self.config.mirror_dir) / d["model"] / d["version"] / name
            return await asyncio.to_thread(read_header_file, path)
        if not self.config.mirror_url:
            raise StepFailed("the jobs service knows neither the mirror's directory nor its address")
        token = mirror_token(await engine_key_secret(self.store.js))
        # Several mirrors (comma-separated): the first that answers (MIR-4: fail over to a mirror that answers).
        errors = []
        async with aiohttp.ClientSession() as session:
            for base in [u.strip() for u in self.config.mirror_url.split(",") if u.strip()]:
                url = f"{base.rstrip('/')}/files/{d['model']}/{d['version']}/{name}"
                try:
                    return await read_header_url(session, url, headers={"Authorization": f"Bearer {token}"})
                except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
                    errors.append(f"{base}: {exc}")
        raise StepFailed("no mirror answered for the GGUF header: " + "; ".join(errors))

    async def _add(self, job: JobState, req: J.JobStarted, d: dict[str, Any]) -> StepResult:
        model = d["model"]
        source = rules.source_of(self.config.source, self.config.mirror_dir, model, d["version"], d["first"])
        spec = rules.spec_for(req, model, source, d["memory_gb"])
        existing: M.ModelSpec | None = None
        added_seq = 0
        for e in await self.store.read(event_subject(M.AGGREGATE, model)):
            if isinstance(e.payload, M.ModelAdded | M.ModelChanged):
                existing, added_seq = e.payload.spec, e.seq
            elif isinstance(e.payload, M.ModelRemoved):
                existing = None
        if existing is not None:
            if existing.source == source:  # added by this job before an interruption, or the same already
                return StepResult(message=f"{model} is in the catalog already", data={"added_seq": added_seq})
            raise StepFailed(
                f"a model named {model} exists with another source ({existing.source}): choose another --name"
            )
        out = await self.client.send(M.SERVICE, "add", M.AddModel(spec=spec), actor=ACTOR, correlation=job.id)
        profile = spec.profiles[0]
        return StepResult(
            message=(
                f"added {model}: {profile.min_memory_gb} GB, {profile.cpu_cores or 'default'} core(s), "
                f"context {profile.ctx_size}, min {spec.scaling.min}"
            ),
            data={"added_seq": out.last_seq, "source": source},
        )

    async def _wait_ready(self, job: JobState, req: J.JobStarted, d: dict[str, Any]) -> StepResult:
        if req.on_demand:
            return StepResult(message="on demand: a replica starts with the first request", data={})
        model, after = d["model"], d["added_seq"] - 1
        w = rules.Watch()
        start = time.monotonic()
        subjects = {event_subject(M.AGGREGATE, model): after, f"{EVENTS_ROOT}.{R.AGGREGATE}.>": after}
        async with EventWaiter(self.store, subjects, name=f"job-{job.id}") as events:
            while True:
                now = time.monotonic()
                v = rules.verdict(w, now, self.config.unplaceable_s)
                if v is not None:
                    kind, what = v
                    if kind == "failed":
                        raise StepFailed(what)
                    return StepResult(
                        message=f"replica {what} is ready at {w.ready[what]}",
                        data={"replica": what, "url": w.ready[what]},
                    )
                if now - start >= self.config.wait_ready_s:
                    raise StepFailed(
                        f"no replica of {model} was ready within {self.config.wait_ready_s:.0f}s" + _trouble(events)
                    )
                # Wake for the next event, or when being blocked would become too long, or at the end.
                wake = start + self.config.wait_ready_s
                if w.blocked_since is not None:
                    wake = min(wake, w.blocked_since + self.config.unplaceable_s)
                e = await events.next(wake - now)
                if e is not None:
                    if e.subject.startswith(f"{EVENTS_ROOT}.{R.AGGREGATE}."):
                        _watch_replica(w, model, e)
                    else:
                        _watch_model(w, e)

    async def _smoke(self, req: J.JobStarted, d: dict[str, Any]) -> StepResult:
        if req.on_demand:
            return StepResult(message="skipped: the model runs on demand", data={})
        key = engine_key(await engine_key_secret(self.store.js), d["replica"])
        body = {
            "model": d["model"],
            "messages": [{"role": "user", "content": SMOKE_PROMPT}],
            "max_tokens": self.config.smoke_tokens,
        }
        t0 = time.monotonic()
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.config.smoke_timeout_s)) as s:
                async with s.post(
                    f"{d['url'].rstrip('/')}/v1/chat/completions",
                    json=body,
                    headers={"Authorization": f"Bearer {key}"},
                ) as resp:
                    text = await resp.text()
                    if resp.status != 200:
                        raise StepFailed(f"the replica answered {resp.status}: {text[:300]}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise StepFailed(f"the replica at {d['url']} did not answer: {exc}") from exc
        try:
            answer = msgspec.json.decode(text)
        except msgspec.DecodeError as exc:
            raise StepFailed(f"the replica's answer is not JSON: {text[:200]}") from exc
        return rules.smoke_result(answer, time.monotonic() - t0)


_STARTING = {
    "validate": "checking the repository name",
    "pick": "reading the repository's files and choosing the GGUF set",
    "fetch": "fetching into the mirror and verifying checksums",
    "inspect": "reading the GGUF header",
    "size": "estimating the memory one replica needs",
    "add": "adding the model to the catalog",
    "wait_ready": "waiting for a ready replica",
    "smoke": "sending one short chat request to the replica",
}


def _nothing(event: RecordedEvent) -> None:
    """The jobs' command fold keeps nothing of its own: which commands caused events is the shell's."""


def _trouble(events: EventWaiter) -> str:
    """Why a wait may have heard nothing, when its folds were not live: for the job's failure message."""
    reasons = events.not_live()
    return f" (and the log was not heard in full: {'; '.join(reasons)})" if reasons else ""


def _fetch_status(e: RecordedEvent, version: str) -> msgspec.Struct | None:
    """The event when it starts or ends a fetch of ``version``."""
    p = e.payload
    if isinstance(p, MI.FetchStarted | MI.FetchCompleted | MI.FetchFailed) and p.version == version:
        return p
    return None


def _watch_model(w: rules.Watch, e: RecordedEvent) -> None:
    p = e.payload
    if isinstance(p, M.ModelParked):
        w.parked = p.reason
    elif isinstance(p, M.ModelRetried):
        w.parked, w.blocked_since = None, None
    elif isinstance(p, SCH.PlacementBlocked):
        if w.blocked_since is None:
            w.blocked_since = time.monotonic()
        w.blocked_reason = p.reason


def _watch_replica(w: rules.Watch, model: str, e: RecordedEvent) -> None:
    p = e.payload
    if isinstance(p, R.ReplicaPlaced):
        if p.model == model:
            w.models_replicas.add(p.replica_id)
            w.blocked_since = None  # placed: no longer unplaceable
        return
    rid = getattr(p, "replica_id", None)
    if rid not in w.models_replicas:
        return
    if isinstance(p, R.ReplicaReady):
        w.ready[rid] = p.url
    elif isinstance(p, R.ReplicaStopRequested | R.ReplicaStopped | R.ReplicaFailed):
        w.ready.pop(rid, None)
