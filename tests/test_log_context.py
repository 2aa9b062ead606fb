"""Every log line of a request or a command names it (OBS-4), and lines are readable on a terminal."""

from __future__ import annotations

import asyncio
import io
import json
from datetime import datetime
from typing import Any

import pytest
import structlog
from structlog.testing import LogCapture

from llmgw.cli import logs
from llmgw.events.commands.client import CommandClient
from llmgw.events.commands.shell import Decision
from llmgw.events.runtime import log_context
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import tenancy as T
from llmgw.services.tenancy.service import TenancyService
from tests.test_command_shell import running


def captured() -> LogCapture:
    capture = LogCapture()
    logs.configure("info", json_lines=True, extra=[capture])
    return capture


async def test_lines_logged_while_two_requests_run_at_once_each_carry_their_own_request_id() -> None:
    capture = captured()
    log = structlog.get_logger("test")

    async def request(rid: str) -> None:
        bound = log_context.bind(("request_id", rid), ("client_request_id", ""))
        try:
            log.info("start")
            await asyncio.sleep(0)  # the other request runs here
            await asyncio.create_task(asyncio.to_thread(lambda: None))
            log.warning("end")
        finally:
            log_context.unbind(bound)

    await asyncio.gather(request("r-1"), request("r-2"))
    log.info("after")
    lines = [(e["event"], e.get("request_id")) for e in capture.entries]
    assert sorted(lines[:4]) == [("end", "r-1"), ("end", "r-2"), ("start", "r-1"), ("start", "r-2")]
    assert lines[4] == ("after", None), "nothing stays bound once the request ends"
    assert all("client_request_id" not in e for e in capture.entries), "an empty id is left out"


async def test_a_line_that_names_its_own_request_id_keeps_it() -> None:
    capture = captured()
    bound = log_context.bind(("request_id", "r-outer"))
    try:
        structlog.get_logger("test").info("inner", request_id="r-own")
    finally:
        log_context.unbind(bound)
    assert capture.entries[0]["request_id"] == "r-own"


async def test_every_line_a_command_s_handling_logs_names_the_command_and_its_correlation(store: EventStore) -> None:
    capture = captured()
    service = TenancyService(store)
    decide = service.shell.decide

    def logging_decide(state: Any, payload: T.TenancyCommand, now: datetime) -> Decision:
        structlog.get_logger("test").info("deciding")
        return decide(state, payload, now)

    service.shell.decide = logging_decide
    async with running(service.processor()):
        await CommandClient.for_service(store, "tests").send(
            T.SERVICE, "create", T.CreateScope(kind="org", path="acme"), actor="user:alice", correlation="job-7"
        )
    [line] = [e for e in capture.entries if e["event"] == "deciding"]
    assert line["command"] == "tenancy.create" and line["correlation_id"] == "job-7" and line["command_id"]


@pytest.mark.parametrize(
    ("asked", "terminal", "json_lines"),
    [("auto", True, False), ("auto", False, True), ("json", True, True), ("console", False, False)],
)
def test_log_lines_are_readable_on_a_terminal_and_json_elsewhere_unless_asked(
    asked: str, terminal: bool, json_lines: bool
) -> None:
    class Stream(io.StringIO):
        def isatty(self) -> bool:
            return terminal

    assert logs.json_wanted(asked, Stream()) is json_lines


def test_a_json_line_is_one_object_with_the_bound_ids(capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure("info", json_lines=True)
    bound = log_context.bind(("request_id", "r-9"))
    try:
        structlog.get_logger("test").info("hello", model="chat")
    finally:
        log_context.unbind(bound)
    line = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert (line["event"], line["request_id"], line["model"], line["level"]) == ("hello", "r-9", "chat", "info")
