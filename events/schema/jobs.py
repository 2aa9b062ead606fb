"""Jobs: long operations run as processes on the bus, one aggregate per job (SPEC MIR-3).

A job is ``llmgw.evt.job.<id>``: ``job.started`` (what was asked, and by whom), then for each
step a ``job.step`` as it starts and as it ends (``done`` or ``failed``, with a line a person
reads and the data later steps build on), then ``job.finished``. The jobs service folds a job
from these events alone, so whichever instance runs next resumes an unfinished job from its last
completed step; `llmgw ctl job ID` replays and follows the same events from anywhere.
"""

from __future__ import annotations

from typing import Any

import msgspec

from llmgw.events.schema.registry import EventType

AGGREGATE = "job"
DEFAULT_CTX_POOL = 16384  # tokens of KV cache one replica holds, shared by its parallel slots
SERVICE = "jobs"

STARTED, DONE, FAILED = "started", "done", "failed"
STEP_STATUSES = (STARTED, DONE, FAILED)


class JobStarted(msgspec.Struct, frozen=True, kw_only=True):
    """A job was accepted; for ``kind="serve"`` the fields are `ctl model serve`'s arguments."""

    kind: str = "serve"
    repo: str
    quant: str | None = None
    file: str | None = None
    name: str | None = None
    on_demand: bool = False
    ctx_pool: int = DEFAULT_CTX_POOL
    cores: int | None = None
    requested_by: str = ""


class JobStep(msgspec.Struct, frozen=True, kw_only=True):
    step: str  # validate, pick, fetch, inspect, size, add, wait_ready, smoke
    status: str  # started | done | failed
    message: str  # one line for a person
    data: dict[str, Any] = {}  # what the step decided, for the steps after it


class JobFinished(msgspec.Struct, frozen=True, kw_only=True):
    ok: bool
    summary: str


EVENTS = (
    EventType("job.started", 1, JobStarted, "A job was accepted: its kind and what was asked, by whom."),
    EventType(
        "job.step",
        1,
        JobStep,
        "A step of a job started, was done or failed, with a line a person reads and the data it decided.",
    ),
    EventType("job.finished", 1, JobFinished, "A job ended: whether it succeeded, and a summary."),
)


# -- commands ----------------------------------------------------------------------------------


class ServeModel(msgspec.Struct, frozen=True, kw_only=True, tag="serve", forbid_unknown_fields=True):
    """`ctl model serve OWNER/REPO`: fetch a GGUF set from the hub and serve it (SPEC MIR-3)."""

    repo: str
    quant: str | None = None
    file: str | None = None
    name: str | None = None
    on_demand: bool = False
    ctx_pool: int = DEFAULT_CTX_POOL
    cores: int | None = None


JobCommand = ServeModel
