"""`ctl model serve` and `ctl job ID` follow a job through the jobs service's own fold (``JobState``,
``events/folds/jobs.py``): the mirror's progress they show is for the model the job's done steps decided."""

from __future__ import annotations

from typing import Any

import pytest

from llmgw.cli import jobs_cmd
from llmgw.cli.progress import Downloads
from llmgw.events.runtime.store import EventStore, NewEvent
from llmgw.events.schema import jobs as J
from llmgw.events.schema.subjects import event_subject


class Subscription:
    async def unsubscribe(self) -> None:
        pass


async def test_a_followed_job_shows_the_mirror_progress_of_the_model_its_done_steps_decided(
    store: EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    watched: list[str] = []

    async def watch(store: EventStore, model: str, bars: Downloads) -> Any:
        watched.append(model)
        return Subscription()

    monkeypatch.setattr(jobs_cmd, "watch_any_version", watch)
    steps = [
        J.JobStarted(repo="owner/repo", requested_by="user:alice"),
        J.JobStep(step="validate", status=J.STARTED, message="checking the request"),
        J.JobStep(step="validate", status=J.DONE, message="ok", data={"repo": "owner/repo"}),
        J.JobStep(step="pick", status=J.DONE, message="Q4_K_M", data={"model": "repo-q4", "version": "v1"}),
        J.JobStep(step="fetch", status=J.STARTED, message="fetching"),
        J.JobStep(step="fetch", status=J.DONE, message="fetched"),
        J.JobFinished(ok=True, summary="repo-q4 is served"),
    ]
    await store.append(event_subject(J.AGGREGATE, "j1"), [NewEvent(payload=p, actor="svc:jobs") for p in steps])

    assert await jobs_cmd.follow_job(store, "j1") == 0
    assert watched == ["repo-q4"]


async def test_a_failed_job_ends_its_follower_with_an_error(store: EventStore) -> None:
    steps = [
        J.JobStarted(repo="owner/repo"),
        J.JobStep(step="validate", status=J.FAILED, message="no such repository"),
        J.JobFinished(ok=False, summary="validate: no such repository"),
    ]
    await store.append(event_subject(J.AGGREGATE, "j2"), [NewEvent(payload=p, actor="svc:jobs") for p in steps])

    assert await jobs_cmd.follow_job(store, "j2") == 1
