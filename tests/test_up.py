"""`llmgw up` as a user runs it: a real process, the real CLI, the same data directory twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import free_port

LLMGW = str(Path(sys.executable).parent / "llmgw")


class Up:
    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.admin_port = free_port()
        self.proc: subprocess.Popen | None = None
        self.log = data_dir.parent / f"up-{self.port}.log"

    def start(self) -> Up:
        self.proc = subprocess.Popen(
            [
                LLMGW,
                "up",
                "--data-dir",
                str(self.data_dir),
                "--port",
                str(self.port),
                "--admin-port",
                str(self.admin_port),
                "--nats-port",
                "0",
            ],
            stdout=open(self.log, "ab"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"llmgw up exited early:\n{self.log.read_text()[-3000:]}"
            if (self.data_dir / "run.json").exists() and self.health(self.admin_port) == 200:
                return self
            time.sleep(0.05)
        raise AssertionError(f"llmgw up did not become healthy:\n{self.log.read_text()[-3000:]}")

    def health(self, port: int) -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
                return r.status
        except OSError:
            return 0

    def nats_pid(self) -> int:
        out = subprocess.run(["pgrep", "-f", f"nats-server -c {self.data_dir}/nats"], capture_output=True, text=True)
        return int(out.stdout.split()[0]) if out.stdout.strip() else 0

    def stop(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "LLMGW_DATA_DIR": str(self.data_dir)}
        env.pop("LLMGW_NATS_URL", None)
        env.pop("LLMGW_API_URL", None)
        return subprocess.run([LLMGW, *args], capture_output=True, text=True, env=env, timeout=60)


@pytest.fixture
def up(tmp_path: Path) -> Iterator[Up]:
    u = Up(tmp_path / "data").start()
    yield u
    if u.proc and u.proc.poll() is None:
        u.stop()


def test_up_answers_health_on_both_ports_and_publishes_metrics(up: Up) -> None:
    assert up.health(up.port) == 200
    assert up.health(up.admin_port) == 200
    with urllib.request.urlopen(f"http://127.0.0.1:{up.admin_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    assert "llmgw_eventstore_appended_events_total" in text
    assert 'llmgw_projection_lag_events{projection="tenancy"}' in text


def test_the_tree_is_built_through_the_cli_and_survives_a_restart(up: Up) -> None:
    for args in (["org", "create", "acme"], ["team", "create", "acme/ml"], ["project", "create", "acme/ml/chat"]):
        done = up.cli("ctl", *args)
        assert done.returncode == 0, done.stderr
    assert "created" in done.stdout
    assert up.stop() == 0
    up.start()
    tree = json.loads(up.cli("ctl", "tree", "--json").stdout)
    [acme] = tree
    assert acme["name"] == "acme"
    assert acme["children"][0]["name"] == "ml"
    assert acme["children"][0]["children"][0]["name"] == "chat"


def test_a_refused_command_prints_its_reason_and_exits_non_zero(up: Up) -> None:
    done = up.cli("ctl", "team", "create", "ghost/ml")
    assert done.returncode == 2
    assert "needs org 'ghost', which does not exist: `llmgw ctl org create ghost` first" in done.stderr
    up.cli("ctl", "org", "create", "acme")
    up.cli("ctl", "team", "create", "acme/ml")
    done = up.cli("ctl", "org", "delete", "acme")
    assert done.returncode == 2
    assert "org acme still holds 1 team (ml); delete it first" in done.stderr


def test_the_log_names_who_did_what_and_show_links_causes(up: Up) -> None:
    up.cli("ctl", "org", "create", "acme")
    lines = up.cli("events", "tail", "--json", "--type", "org.created").stdout.splitlines()
    [event] = [json.loads(x) for x in lines]
    assert event["actor"].startswith("user:")
    assert event["causation"]
    shown = up.cli("events", "show", event["causation"])
    assert shown.returncode == 0
    assert event["id"] in shown.stdout and "command.completed" in shown.stdout


def test_a_second_up_on_the_same_directory_is_refused(up: Up) -> None:
    second = subprocess.run(
        [LLMGW, "up", "--data-dir", str(up.data_dir), "--port", str(free_port()), "--admin-port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert second.returncode != 0
    assert "already running" in second.stderr


def test_sigterm_stops_everything_up_started(up: Up) -> None:
    nats_pid = up.nats_pid()
    assert nats_pid
    assert up.stop() == 0
    assert up.nats_pid() == 0
    assert not (up.data_dir / "run.json").exists()
    done = up.cli("ctl", "tree")
    assert done.returncode == 4 and "no running `llmgw up` found" in done.stderr


def test_the_embedded_server_flushes_before_it_acknowledges(up: Up) -> None:
    conf = (up.data_dir / "nats" / "nats.conf").read_text()
    assert "sync_interval: always" in conf


def test_projections_verify_agrees_with_the_live_tables(up: Up) -> None:
    up.cli("ctl", "org", "create", "acme")
    up.cli("ctl", "org", "rename", "acme", "acme-corp")
    done = up.cli("projections", "verify")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "tenancy: identical" in done.stdout
