"""`llmgw up` heals its own nats-server after a full disk (issue 23): a real `up` on a small tmpfs, the
disk filled until writes fail, space freed, and `up` restarting its server by itself; plus the pure
decision it takes (`heal_decision`).

The end-to-end case mounts a tmpfs (we run as root); where mounting is not permitted it is skipped
with the reason.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import nats
import nats.js.errors
import pytest

from llmgw.cli.nats_healer import (
    Action,
    HealInputs,
    HealPolicy,
    cooldown,
    heal_decision,
    healed_line,
    store_room,
)
from llmgw.events.runtime.connection import NatsCredential
from llmgw.events.schema.subjects import STREAM_EVENTS, STREAM_USAGE
from tests.gguf_tiny import write_tiny_gguf
from tests.test_usage_journal import fill, tmpfs
from tests.up import Up, wait_for

POLICY = HealPolicy(failures_needed=3, free_margin=64 << 20, cooldown_s=20.0, max_cooldown_s=600.0)


def inputs(**changes: Any) -> HealInputs:
    """A store failing for long enough, on a disk with room, never restarted: the case that restarts."""
    base = HealInputs(
        probe_failures=3,
        acked_ever=True,
        free_bytes=1 << 30,
        writable=True,
        restarted_at=None,
        unhealed_restarts=0,
        now=1000.0,
    )
    return msgspec.structs.replace(base, **changes)


# -- the decision ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("description", "changes", "expected"),
    [
        ("a store failing long enough on a disk with room is restarted", {}, Action.RESTART),
        ("probes acknowledged are healthy", {"probe_failures": 0}, Action.HEALTHY),
        ("fewer failures than needed are not yet a failing store", {"probe_failures": 2}, Action.HEALTHY),
        (
            "a disk with less free than the margin waits for space",
            {"free_bytes": (64 << 20) - 1},
            Action.WAIT_FOR_SPACE,
        ),
        ("a disk where a test write fails waits for space", {"writable": False}, Action.WAIT_FOR_SPACE),
        ("a disk not looked at waits for space", {"free_bytes": None}, Action.WAIT_FOR_SPACE),
        ("a probe never acknowledged says nothing about the store", {"acked_ever": False}, Action.HOLD),
        (
            "a disk seen full is restarted once it has room, though the probes got through",
            {"probe_failures": 0, "disk_full_seen": True},
            Action.RESTART,
        ),
        (
            "a disk seen full with less free than the margin waits for space",
            {"probe_failures": 0, "disk_full_seen": True, "free_bytes": (64 << 20) - 1},
            Action.WAIT_FOR_SPACE,
        ),
        (
            "a restart too recent is not repeated",
            {"restarted_at": 990.0, "unhealed_restarts": 1},
            Action.HOLD,
        ),
        (
            "a restart past its cooldown that did not heal is tried again",
            {"restarted_at": 979.0, "unhealed_restarts": 1},
            Action.RESTART,
        ),
        (
            "a second restart that did not heal waits twice as long",
            {"restarted_at": 965.0, "unhealed_restarts": 2},
            Action.HOLD,
        ),
    ],
)
def test_the_heal_decision(description: str, changes: dict[str, Any], expected: Action) -> None:
    assert heal_decision(inputs(**changes), POLICY) is expected, description


def test_the_wait_between_restarts_that_do_not_heal_doubles_up_to_its_cap() -> None:
    assert [cooldown(POLICY, n) for n in range(7)] == [20.0, 20.0, 40.0, 80.0, 160.0, 320.0, 600.0]


def test_a_full_disk_has_no_room_and_a_disk_with_space_has_room(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "disk", "1m") as disk:
        filler = fill(disk)
        full = store_room(disk)
        assert not full.writable and full.error == "No space left on device"
        assert not list(disk.glob(".llmgw-room-check")), "a failed check leaves nothing behind"
        filler.unlink()
        room = store_room(disk)
        assert room.writable and room.free_bytes > 512 * 1024


def test_the_healed_line_says_what_happened_and_what_follows() -> None:
    assert healed_line(True, "no acknowledgement within 5s") == (
        "the embedded nats-server could not write its store (disk full); space is back, so it was restarted "
        "on the same port; routers now publish the usage records they kept"
    )
    assert healed_line(False, "no acknowledgement within 5s") == (
        "the embedded nats-server stopped storing writes (no acknowledgement within 5s) though its disk has room, "
        "so it was restarted on the same port; routers now publish the usage records they kept"
    )


# -- end to end --------------------------------------------------------------------------------


def get_json(url: str, body: dict | None = None, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **(headers or {})}
    data = json.dumps(body).encode() if body is not None else None
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def stream_messages(url: str, creds: NatsCredential, stream: str) -> dict[int, bytes]:
    """Every message of ``stream`` by sequence, read with the operator's credential."""

    async def go() -> dict[int, bytes]:
        nc = await nats.connect(url, user=creds.user, password=creds.password, inbox_prefix=creds.inbox_prefix)
        try:
            js = nc.jetstream(timeout=10)
            state = (await js.stream_info(stream)).state
            out = {}
            for seq in range(max(1, state.first_seq), state.last_seq + 1):
                try:
                    out[seq] = (await js.get_msg(stream, seq)).data or b""
                except nats.js.errors.NotFoundError:
                    continue
            return out
        finally:
            await nc.close()

    return asyncio.run(go())


@pytest.mark.timeout(600)
def test_up_restarts_its_nats_server_once_a_full_disk_has_room_again_and_loses_nothing(
    tmp_path: Path, ups: list[Up], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The journal on another file system (as docs/usage.md advises): requests are answered while the bus's disk is full.
    journal = tmp_path / "usage-journal"
    monkeypatch.setenv("LLMGW_ROUTER_USAGE_JOURNAL", str(journal))
    monkeypatch.setenv("LLMGW_ROUTER_USAGE_ACK_TIMEOUT_S", "1")
    with tmpfs(tmp_path / "disk", "256m") as disk:
        up = Up(disk / "data")
        up.log = tmp_path / "up.log"  # off the disk that fills: what `up` says then is the point
        ups.append(up.start("--no-demo"))
        tiny = write_tiny_gguf(tmp_path / "tiny.gguf")
        for args in (
            ["model", "add", "tiny", "--source", str(tiny), "--cpu-cores", "1", "--memory-gb", "0.1"],
            ["org", "create", "acme"],
            ["team", "create", "acme/ml"],
            ["project", "create", "acme/ml/chat"],
        ):
            done = up.cli("ctl", *args)
            assert done.returncode == 0, done.stderr
        made = up.cli("ctl", "key", "create", "--project", "acme/ml/chat", "--name", "heal")
        assert made.returncode == 0, made.stderr
        key = made.stdout.strip()
        gateway = f"http://127.0.0.1:{up.port}"

        def ask(rid: str) -> int:
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 1}
            headers = {"Authorization": f"Bearer {key}", "X-Request-Id": rid}
            status, _ = get_json(f"{gateway}/v1/completions", body, headers)
            return status

        wait_for(lambda: ask("warm-up") == 200, "the tiny model to answer", 180.0)
        creds, url, nats_pid = up.nats_creds(), up.nats_url(), up.nats_pid()
        events_before = stream_messages(url, creds, STREAM_EVENTS)

        filler = fill(disk)
        served: list[str] = []

        def usage() -> dict:
            return get_json(f"{gateway}/healthz")[1]["usage"]

        def journaling() -> bool:
            rid = f"full-{len(served)}"
            if ask(rid) == 200:
                served.append(rid)
            return usage()["journaled"] >= 3

        wait_for(journaling, "the router to journal usage records the bus does not acknowledge", 120.0)
        wait_for(lambda: "free space on that disk" in up.output(), "up to say its nats-server cannot write", 60.0)
        assert "restarted on the same port" not in up.output(), "no restart while the disk is full"

        filler.unlink()
        wait_for(lambda: "so it was restarted on the same port" in up.output(), "up to restart its nats-server", 60.0)
        wait_for(lambda: usage()["records"] == 0, "the router to publish the records it kept", 60.0)

        assert up.proc is not None and up.proc.poll() is None, "up kept running"
        assert up.nats_pid() not in (0, nats_pid), "a new nats-server process"
        assert up.nats_url() == url, "on the same port"
        lines = [line for line in up.output().splitlines() if "so it was restarted" in line]
        assert lines == [
            "the embedded nats-server could not write its store (disk full); space is back, so it was restarted on "
            "the same port; routers now publish the usage records they kept"
        ]
        assert "the embedded nats-server exited" not in up.output()
        events_after = stream_messages(url, creds, STREAM_EVENTS)
        assert {seq: events_after.get(seq) for seq in events_before} == events_before, "every acknowledged event kept"
        in_usage = Counter(
            msgspec.json.decode(data).get("client_request_id")
            for data in stream_messages(url, creds, STREAM_USAGE).values()
        )
        assert {rid: in_usage[rid] for rid in served} == dict.fromkeys(served, 1), "each served request billed once"
        assert ask("after") == 200
        # The local agent (a process of its own) is back on the bus by itself too.
        agent_log = up.data_dir / "agent" / "agent.log"
        wait_for(lambda: "NATS reconnected" in agent_log.read_text(errors="replace"), "the agent to reconnect", 60.0)
