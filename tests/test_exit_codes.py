"""The CLI's exit codes are what docs/cli.md says: 0 done, 1 failed, 2 refused (the reason says what to do),
3 timed out, 4 the system could not be reached — tried on the refusals of each kind of command."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from llmgw.events.runtime.store import EventStore
from tests.fleet import Fleet
from tests.support import NatsServer, free_port

pytestmark = pytest.mark.asyncio

LLMGW = str(Path(sys.executable).parent / "llmgw")


@pytest.fixture
async def fleet(store: EventStore, nats: NatsServer, tmp_path: Path) -> AsyncIterator[Fleet]:
    f = await Fleet(store, nats.url, tmp_path).start(
        services=("tenancy", "catalog", "scheduler", "jobs", "projections", "api")
    )
    yield f
    await f.stop()


async def llmgw(fleet: Fleet, *args: str, token: bool = True, nats: str | None = None) -> tuple[int, str]:
    env = fleet.cli_env() if token else {k: v for k, v in os.environ.items() if k != "LLMGW_TOKEN"}
    env = {**env, "LLMGW_DATA_DIR": str(fleet.base / "no-up"), "XDG_CONFIG_HOME": str(fleet.base / "no-config")}
    proc = await asyncio.create_subprocess_exec(
        LLMGW, "--nats", nats or fleet.nats_url, "--api", f"http://127.0.0.1:{fleet.admin_port}", *args,
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, err.decode()


@pytest.mark.parametrize(
    ("args", "token", "says"),
    [
        # A command the owning service refuses.
        (("ctl", "team", "create", "nowhere/ml"), True, "`llmgw ctl org create nowhere` first"),
        # Nobody signed in: nothing can be signed, nothing can be read.
        (("ctl", "org", "create", "acme"), False, "sign in first"),
        (("ctl", "models"), False, "sign in first"),
        # The admin API refuses (404, 400): the request was understood and refused.
        (("ctl", "request", "no-such-request"), True, "no usage record for request no-such-request"),
        (("ctl", "usage", "--scope", "galaxy:far"), True, "KIND:ID-OR-PATH"),
        # Something named that does not exist, asked of a service over the bus.
        (("ctl", "explain", "no-such-model"), True, "no model named 'no-such-model'"),
        (("ctl", "job", "no-such-job"), True, "there is no job no-such-job"),
        (("events", "show", "999999999"), True, "there is no event at sequence 999999999"),
    ],
)
async def test_a_refusal_exits_2_with_its_reason(fleet: Fleet, args: tuple[str, ...], token: bool, says: str) -> None:
    code, err = await llmgw(fleet, *args, token=token)
    assert (code, says in err) == (2, True), err


async def test_a_system_that_cannot_be_reached_exits_4(fleet: Fleet) -> None:
    code, err = await llmgw(fleet, "ctl", "org", "create", "acme", nats=f"nats://127.0.0.1:{free_port()}")
    assert code == 4, err
