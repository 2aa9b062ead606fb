"""`llmgw up` as an operator runs it when its own output cannot be written: a pipe whose reader has
gone. Real processes, the real CLI, a real llama.cpp engine on the tiny GGUF."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO

import pytest

from tests.gguf_tiny import write_tiny_gguf
from tests.up import Up, nats_servers, wait_for


class PipedUp(Up):
    """An `up` whose stdout and stderr go to a pipe the test holds (and may close)."""

    pipe: IO[bytes] | None = None

    def start(self, *extra: str) -> PipedUp:
        self.proc = subprocess.Popen(self.argv(*extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.pipe = self.proc.stdout
        wait_for(lambda: self._up(), "llmgw up to become healthy", 60.0)
        return self

    def _up(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, "llmgw up exited early"
        info = self.run_info()
        return info is not None and info["pid"] == self.proc.pid and self.healthy()


@pytest.fixture
def ups() -> Iterator[list[Up]]:
    started: list[Up] = []
    yield started
    for u in started:
        if u.proc is not None and u.proc.poll() is None:
            u.proc.send_signal(signal.SIGTERM)
            try:
                u.proc.wait(60)
            except subprocess.TimeoutExpired:
                u.proc.kill()
        for pid in nats_servers(u.data_dir):
            os.kill(pid, signal.SIGKILL)


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
