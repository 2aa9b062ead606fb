"""The serve job's decisions (SPEC MIR-3): pure functions over the folded job and what was read.

The service (:mod:`.service`) does the I/O around them: asking the hub, sending commands, reading
the log, reading a GGUF header, one HTTP request to the replica.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any

import msgspec

from llmgw.events.commands.shell import Decision
from llmgw.events.schema import jobs as J
from llmgw.events.schema import models as M
from llmgw.events.schema.outcomes import Rejected
from llmgw.events.schema.subjects import event_subject
from llmgw.modelfiles.picking import PickError, RepoFile, pick_gguf, validate_repo_id
from llmgw.modelfiles.sizing import Estimate

STEPS = ("validate", "pick", "fetch", "inspect", "size", "add", "wait_ready", "smoke")

# Architectures (GGUF `general.architecture`) the llama.cpp the nodes run loads; others are refused.
LLAMACPP_ARCHITECTURES = frozenset(
    {
        "llama",
        "llama4",
        "mistral3",
        "qwen2",
        "qwen2moe",
        "qwen2vl",
        "qwen3",
        "qwen3moe",
        "gemma",
        "gemma2",
        "gemma3",
        "gemma3n",
        "phi2",
        "phi3",
        "phimoe",
        "mistral",
        "mixtral",
        "falcon",
        "starcoder2",
        "deepseek",
        "deepseek2",
        "command-r",
        "cohere2",
        "olmo",
        "olmo2",
        "granite",
        "granitemoe",
        "internlm2",
        "minicpm",
        "minicpm3",
        "stablelm",
        "gpt2",
        "gptneox",
        "bloom",
        "mpt",
        "baichuan",
        "chatglm",
        "glm4",
        "exaone",
        "nemotron",
        "smollm3",
        "gpt-oss",
        "bert",
        "nomic-bert",
        "jina-bert-v2",
        "t5",
    }
)

_NAME_OK = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")


class StepFailed(Exception):
    """A step cannot go on; the message says why and what to do."""

    def __init__(self, message: str, data: dict[str, Any] | None = None) -> None:
        self.message = message
        self.data = data or {}
        super().__init__(message)


class StepResult(msgspec.Struct, frozen=True, kw_only=True):
    message: str
    data: dict[str, Any] = {}


class NewJob(msgspec.Struct, frozen=True, kw_only=True):
    """What a serve command's decision needs from the command itself: the job is named by the command's
    id (so a redelivered command finds the job it started) and is requested by its verified actor."""

    id: str
    requested_by: str


def decide(job: NewJob, payload: J.ServeModel, now: datetime) -> Decision:
    """Pure: a serve command → the job it starts (checked first, so a bad request is refused at once)."""
    check_request(payload)
    started = J.JobStarted(
        kind="serve",
        repo=payload.repo,
        quant=payload.quant,
        file=payload.file,
        name=payload.name,
        on_demand=payload.on_demand,
        ctx_pool=payload.ctx_pool,
        cores=payload.cores,
        requested_by=job.requested_by,
    )
    return Decision(
        subject=event_subject(J.AGGREGATE, job.id),
        payloads=[started],
        message=f"job {job.id}: serving {payload.repo}",
        result={"job": job.id},
    )


def check_request(req: J.ServeModel) -> None:
    """Refused at once, before a job exists: a bad repository name or nonsensical numbers."""
    try:
        validate_repo_id(req.repo)
    except PickError as exc:
        raise Rejected(str(exc), "invalid_repo") from exc
    if req.name is not None and not _NAME_OK.match(req.name):
        raise Rejected(
            f"model name {req.name!r} is not allowed: lower-case letters, digits, '.', '_' and '-', "
            "starting with a letter or digit, at most 64 characters",
            "invalid_name",
        )
    if req.ctx_pool < 0:
        raise Rejected(f"--ctx-pool must be 0 or more tokens, not {req.ctx_pool}", "invalid")
    if req.cores is not None and req.cores < 1:
        raise Rejected(f"--cores must be 1 or more, not {req.cores}", "invalid")


def next_step(done: dict[str, Any]) -> str | None:
    """The first step not done yet; None once all are."""
    return next((s for s in STEPS if s not in done), None)


def model_name(req: J.JobStarted, quant: str | None) -> str:
    """The catalog (and mirror) name: ``--name``, else the repository's name and quant, lower-cased."""
    if req.name:
        return req.name
    base = req.repo.split("/", 1)[1].lower()
    base = re.sub(r"[-_.]?gguf$", "", base)
    if quant and quant.lower() not in base:
        base = f"{base}-{quant.lower()}"
    base = re.sub(r"[^a-z0-9._-]+", "-", base).strip("-._") or "model"
    return base[:64].rstrip("-._")


def pick(req: J.JobStarted, files: list[RepoFile]) -> StepResult:
    try:
        chosen = pick_gguf(req.repo, files, quant=req.quant, file=req.file)
    except PickError as exc:
        raise StepFailed(str(exc)) from exc
    s = chosen.set
    name = model_name(req, s.quant)
    return StepResult(
        message=f"{chosen.reason}, {_size(s.size)} (as model {name})",
        data={
            "model": name,
            "files": [f.path for f in s.files],
            "first": s.name,
            "bytes": s.size,
            "shards": s.shards,
            "quant": s.quant,
        },
    )


def check_architecture(architecture: str | None) -> StepResult:
    if not architecture:
        raise StepFailed("the GGUF header names no architecture (general.architecture); llama.cpp cannot load it")
    if architecture not in LLAMACPP_ARCHITECTURES:
        raise StepFailed(
            f"architecture {architecture!r} is not one the nodes' llama.cpp loads; it loads: "
            f"{', '.join(sorted(LLAMACPP_ARCHITECTURES))}"
        )
    return StepResult(message=f"architecture {architecture}: llama.cpp loads it", data={"architecture": architecture})


def sized(estimate: Estimate) -> StepResult:
    return StepResult(message=estimate.explanation, data={"memory_gb": estimate.total_gb, "rule": estimate.rule})


def source_of(mode: str, mirror_dir: str | None, model: str, version: str, first: str) -> str:
    """What agents are given: ``mirror:MODEL/VERSION/FILE``, or the mirror's own path when it is local."""
    name = first.rsplit("/", 1)[-1]
    if mode == "local":
        if not mirror_dir:
            raise StepFailed("the jobs service is set to give local paths but knows no mirror directory")
        return f"{mirror_dir.rstrip('/')}/{model}/{version}/{name}"
    return f"mirror:{model}/{version}/{name}"


def spec_for(req: J.JobStarted, model: str, source: str, memory_gb: float) -> M.ModelSpec:
    profile = M.Profile(
        engine="llamacpp",
        cpu_cores=req.cores,
        min_memory_gb=memory_gb,
        ctx_size=req.ctx_pool or None,
    )
    minimum = 0 if req.on_demand else 1
    return M.ModelSpec(
        name=model,
        source=source,
        description=f"{req.repo} ({req.quant or 'default quant'}), served by `ctl model serve`",
        scaling=M.Scaling(min=minimum, max=1),
        profiles=[profile],
    )


class Watch(msgspec.Struct, kw_only=True):
    """The model's replicas and blocks, folded from its events after it was added."""

    ready: dict[str, str] = {}  # replica id -> url
    models_replicas: set[str] = set()
    parked: str | None = None
    blocked_since: float | None = None  # monotonic seconds when the first unplaceable was seen
    blocked_reason: str = ""


def verdict(w: Watch, now: float, unplaceable_s: float) -> tuple[str, str] | None:
    """("ready", replica id) | ("failed", why) | None to keep waiting."""
    if w.ready:
        rid = sorted(w.ready)[0]
        return "ready", rid
    if w.parked is not None:
        return "failed", f"the model was parked: {w.parked}; fix the cause, then `llmgw ctl retry MODEL`"
    if w.blocked_since is not None and now - w.blocked_since >= unplaceable_s:
        return "failed", f"no node can take the model ({w.blocked_reason}) for {unplaceable_s:.0f}s"
    return None


def smoke_result(body: dict[str, Any], seconds: float) -> StepResult:
    try:
        answer = body["choices"][0]["message"]["content"] or ""
    except (KeyError, IndexError, TypeError) as exc:
        raise StepFailed(f"the replica's answer has no message: {str(body)[:200]}") from exc
    usage = body.get("usage") or {}
    tokens = int(usage.get("completion_tokens") or 0)
    timings = body.get("timings") or {}
    rate = float(timings.get("predicted_per_second") or (tokens / seconds if seconds > 0 else 0.0))
    shown = " ".join(answer.split())[:200]
    return StepResult(
        message=f"answered {shown!r} ({tokens} tokens, {rate:.1f} tokens/s)",
        data={"answer": answer, "tokens": tokens, "tokens_per_s": round(rate, 2)},
    )


def _size(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
