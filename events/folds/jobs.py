"""A job folded from its events: what was asked, which steps are done and what they decided.

The jobs service runs a job on from it; `ctl model serve` and `ctl job ID` follow one with it.
"""

from __future__ import annotations

from typing import Any

from llmgw.events.schema import jobs as J
from llmgw.events.schema.envelope import RecordedEvent


class JobState:
    """One job as its events tell it."""

    def __init__(self, job_id: str) -> None:
        self.id = job_id
        self.request: J.JobStarted | None = None
        self.seq = 0  # the last event's sequence: the next append expects it
        self.done: dict[str, dict[str, Any]] = {}  # step -> its data, in order
        self.running: str | None = None  # a step started and not ended
        self.finished: J.JobFinished | None = None

    @property
    def data(self) -> dict[str, Any]:
        """Everything the done steps decided, later steps' keys winning."""
        out: dict[str, Any] = {}
        for d in self.done.values():
            out.update(d)
        return out

    def apply(self, event: RecordedEvent) -> None:
        self.seq = event.seq
        p = event.payload
        if isinstance(p, J.JobStarted):
            self.request = p
        elif isinstance(p, J.JobStep):
            if p.status == J.STARTED:
                self.running = p.step
            elif p.status == J.DONE:
                self.done[p.step] = dict(p.data)
                self.running = None
            else:
                self.running = None
        elif isinstance(p, J.JobFinished):
            self.finished = p
