"""The admin API listens on loopback unless the operator says --insecure (it has no TLS or login yet)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from structlog.testing import capture_logs

from llmgw.cli.runtime import serve
from llmgw.cli.server_config import ServerConfig
from llmgw.events.runtime.store import EventStore
from llmgw.services.api.exposure import exposure_refusal, is_loopback
from tests.fleet import Fleet
from tests.support import NatsServer, free_port

LLMGW = str(Path(sys.executable).with_name("llmgw"))


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost", "LOCALHOST"])
def test_loopback_addresses_are_recognised(host: str) -> None:
    assert is_loopback(host)
    assert exposure_refusal(host, 8081, serves_api=True) is None


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "192.168.0.7", "gateway.example.com", ""])
def test_an_admin_api_beyond_loopback_is_refused_with_what_to_do(host: str) -> None:
    assert not is_loopback(host)
    message = exposure_refusal(host, 8081, serves_api=True)
    assert message is not None
    assert f"{host}:8081" in message and "with no TLS" in message and "--tls-cert" in message
    assert "--admin-host 127.0.0.1" in message and "--insecure" in message
    assert exposure_refusal(host, 8081, serves_api=True, tls=True) is None, "served over TLS it may listen anywhere"


def test_a_process_that_serves_only_health_and_metrics_may_listen_anywhere() -> None:
    assert exposure_refusal("0.0.0.0", 8081, serves_api=False) is None


def test_llmgw_server_refuses_an_exposed_admin_api_before_it_connects_to_anything() -> None:
    # Nothing listens on this NATS port: the refusal must come first, in one line, not a connection error.
    out = subprocess.run(
        [
            *(LLMGW, "server", "--nats", f"nats://127.0.0.1:{free_port()}", "--db", "sqlite:///unused.db"),
            *("--admin-host", "0.0.0.0", "--admin-port", str(free_port())),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0
    assert "the admin API would listen on 0.0.0.0:" in out.stderr and "--insecure" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_llmgw_server_refuses_an_admin_port_another_program_listens_on_before_it_connects(tmp_path: Path) -> None:
    # Nothing listens on this NATS port either: the port's refusal comes first, not a connection error.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run(
            [
                *(LLMGW, "server", "--nats", f"nats://127.0.0.1:{free_port()}", "--db", "sqlite:///unused.db"),
                *("--admin-port", str(port)),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=tmp_path,
        )
    assert out.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}, the admin port (--admin-port): another program listens" in out.stderr
    assert "Traceback" not in out.stderr


def test_llmgw_up_refuses_an_exposed_admin_api_before_it_starts_nats(tmp_path: Path) -> None:
    out = subprocess.run(
        [LLMGW, "up", "--data-dir", str(tmp_path), "--admin-host", "0.0.0.0", "--no-demo", "--no-agent"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and "the admin API would listen on 0.0.0.0:" in out.stderr, out.stderr
    assert not (tmp_path / "nats").exists(), "nothing was started"


async def test_with_insecure_the_admin_api_listens_beyond_loopback_and_says_so(
    store: EventStore, nats: NatsServer, tmp_path: Path
) -> None:
    with capture_logs() as logs:
        fleet = await Fleet(store, nats.url, tmp_path).start(
            services=("catalog", "projections", "api"), admin_host="0.0.0.0", insecure=True
        )
    try:
        warned = [e for e in logs if e["event"].startswith("the admin API listens beyond loopback")]
        assert warned and warned[0]["log_level"] == "warning" and warned[0]["admin_host"] == "0.0.0.0"
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{fleet.admin_port}/healthz") as r:
            assert r.status == 200
    finally:
        await fleet.stop()


async def test_without_insecure_a_server_with_the_api_beyond_loopback_does_not_start(
    store: EventStore, nats: NatsServer, tmp_path: Path
) -> None:
    config = ServerConfig(
        nats_url=nats.url,
        db_dsn=f"sqlite:///{tmp_path / 'projections.db'}",
        services=("catalog", "projections", "api"),
        admin_host="0.0.0.0",
        admin_port=free_port(),
    )
    with pytest.raises(SystemExit, match=r"the admin API would listen on 0\.0\.0\.0"):
        await serve(config, asyncio.Event())
    assert not (tmp_path / "projections.db").exists(), "refused before anything was opened"
