"""`llmgw up` as an operator runs it when what it writes cannot be written: its output on a pipe whose
reader has gone, its data directory and its output on a disk that fills under load. Real processes,
the real CLI, a real nats-server, a real llama.cpp engine on the tiny GGUF, a real full tmpfs."""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO

import pytest

from llmgw.events.runtime.store import EventStore
from llmgw.events.schema.catalog import default_registry
from tests.gguf_tiny import write_tiny_gguf
from tests.test_usage_journal import fill, tmpfs, usage_in_stream
from tests.up import Up, wait_for


class PipedUp(Up):
    """An `up` whose stdout and stderr go to a pipe the test holds (and may close)."""

    pipe: IO[bytes] | None = None

    def spawn(self, argv: list[str]) -> subprocess.Popen:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.pipe = proc.stdout
        return proc


def serve_tiny(up: Up, tmp_path: Path) -> str:
    """Add the tiny model to ``up`` and wait until it answers; the demo key to call it with."""
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf")
    added = up.cli("ctl", "model", "add", "tiny", "--source", str(tiny), "--cpu-cores", "1", "--memory-gb", "0.1")
    assert added.returncode == 0, added.stderr
    key = (up.data_dir / "demo-key").read_text().strip()
    wait_for(lambda: chat(up, key, "ready?")[0] == 200, "the tiny model to answer", 120.0)
    return key


def chat(up: Up, key: str, request_id: str) -> tuple[int, str]:
    """One chat request: its status and body."""
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{up.port}/v1/chat/completions",
        data=body,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json", "X-Request-Id": request_id},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except OSError as e:
        return 0, str(e)


def metric(up: Up, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{up.admin_port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} is not in /metrics")


@pytest.mark.timeout(420)
def test_up_whose_output_pipe_was_closed_answers_every_request_and_command_and_counts_the_lost_lines(
    tmp_path: Path, ups: list[Up]
) -> None:
    up = PipedUp(tmp_path / "data")
    ups.append(up.start())
    key = serve_tiny(up, tmp_path)
    assert up.pipe is not None
    up.pipe.close()  # `llmgw up | head`: head has read its lines and gone

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: chat(up, key, f"piped-{i}"), range(200)))
    assert [status for status, _ in answers] == [200] * 200, {s for s, _ in answers}
    made = up.cli("ctl", "org", "create", "piped")
    assert made.returncode == 0, f"a command is carried out as before: {made.stderr}"
    assert "piped" in up.cli("ctl", "tree").stdout
    assert up.proc is not None and up.proc.poll() is None, "up goes on"
    assert metric(up, "llmgw_log_lines_dropped_total") >= 200, "each request's access line was counted as lost"


def recorded(up: Up) -> set[str]:
    """The request ids whose usage records the bus holds."""

    async def go() -> set[str]:
        store = await EventStore.connect(up.nats_url(), default_registry(), creds=up.nats_creds())
        try:
            return set(await usage_in_stream(store.js))
        finally:
            await store.close()

    return asyncio.run(go())


def usage_health(up: Up) -> dict:
    """The router's /healthz ``usage`` (what it holds that the bus has not acknowledged); {} if it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{up.port}/healthz", timeout=5) as r:
            return json.loads(r.read())["usage"]
    except urllib.error.HTTPError as e:
        return json.loads(e.read())["usage"]
    except (OSError, ValueError, KeyError):
        return {}


class Load:
    """Clients asking ``up`` one request after another until stopped; every answer kept."""

    def __init__(self, up: Up, key: str, clients: int = 4) -> None:
        self.answers: list[tuple[str, int, str]] = []  # request id, status, body
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._ask, args=(up, key, n), daemon=True) for n in range(clients)]
        for t in self._threads:
            t.start()

    def _ask(self, up: Up, key: str, n: int) -> None:
        i = 0
        while not self._stop.is_set():
            rid = f"load-{n}-{i}"
            i += 1
            status, body = chat(up, key, rid)
            self.answers.append((rid, status, body))

    def since(self, start: int) -> list[tuple[str, int, str]]:
        return self.answers[start:]

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(90)


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("mode", "full_for"),
    [("strict", "a while"), ("available", "a while"), ("strict", "a moment")],
    ids=["strict", "available", "strict-for-a-moment"],
)
def test_a_full_disk_under_load_answers_200_or_503_never_a_500_and_every_200_keeps_its_usage_record(
    tmp_path: Path, ups: list[Up], monkeypatch: pytest.MonkeyPatch, mode: str, full_for: str
) -> None:
    monkeypatch.setenv("LLMGW_ROUTER_USAGE_MODE", mode)
    monkeypatch.setenv("LLMGW_ROUTER_USAGE_ACK_TIMEOUT_S", "1")
    # Large enough for `up` to restart its nats-server once the filler goes (it waits for 64 MiB free).
    with tmpfs(tmp_path / "disk", "160m") as disk:
        up = Up(disk / "data")  # its output is appended to a file beside the data directory: on this disk too
        ups.append(up.start())
        key = serve_tiny(up, tmp_path)  # the model's file is elsewhere; everything `up` writes is here
        load = Load(up, key)
        try:
            wait_for(lambda: len(load.answers) >= 40, "requests under load", 60.0)
            full_from = len(load.answers)
            filler = fill(disk)
            if mode == "strict":
                wait_for(
                    lambda: any(status == 503 for _, status, _ in load.since(full_from)),
                    "strict refusals once neither the bus nor the disk can keep a record",
                    90.0,
                )
            else:
                wait_for(
                    lambda: usage_health(up).get("memory_only", 0) > 0,
                    "records held in memory only, said in /healthz",
                    90.0,
                )
            if full_for == "a while":
                more_from = len(load.answers)
                wait_for(lambda: len(load.answers) >= more_from + 40, "load going on while the disk is full", 90.0)
            # "a moment": freed at the first refusal, before `up`'s probes could fail three in a row; the
            # streams that failed meanwhile fail until nats-server restarts all the same.
            filler.unlink()  # space returns; nobody restarts `up`
            try:
                wait_for(lambda: usage_health(up).get("records") == 0, "the usage records held to reach the bus", 120.0)
            except AssertionError as exc:
                holds = usage_health(up)
                raise AssertionError(f"{exc}; the router holds {holds}; up said:\n{up.output()[-4000:]}") from exc
            back_from = len(load.answers)
            wait_for(
                lambda: any(status == 200 for _, status, _ in load.since(back_from)), "answers once space is back", 60.0
            )
        finally:
            load.stop()
        statuses = sorted({status for _, status, _ in load.answers})
        assert set(statuses) <= {200, 503}, (
            f"answered {statuses}: {[b for _, s, b in load.answers if s not in (200, 503)][:3]}"
        )
        for _, status, body in load.answers:
            if status == 503:
                error = json.loads(body)["error"]  # OpenAI's error shape, never aiohttp's plain text
                assert error["code"] == "usage_unavailable", error
        served = {rid for rid, status, _ in load.answers if status == 200}
        wait_for(lambda: served <= recorded(up), "every answered request's usage record on the bus", 60.0)
        assert "Server got itself in trouble" not in up.output()
