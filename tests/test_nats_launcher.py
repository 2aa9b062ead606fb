"""The one nats-server launcher: what its configuration says, and that a real server does what it says."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from llmgw.cli.natsd import embedded_config
from llmgw.infra.natsd import ClusterConfig, NatsConfig, NatsProcess, NatsStartError, free_port, render_config


def test_a_server_flushes_before_acknowledging_unless_told_otherwise() -> None:
    durable = render_config(NatsConfig(port=4222, store_dir="/data/js"))
    fast = render_config(NatsConfig(port=4222, store_dir="/data/js", durable=False))

    assert "sync_interval: always" in durable
    assert "sync_interval" not in fast
    assert 'listen: "127.0.0.1:4222"' in durable
    assert 'store_dir: "/data/js"' in durable


def test_optional_settings_appear_only_when_asked_for() -> None:
    bare = render_config(NatsConfig(port=4222, store_dir="/js"))
    full = render_config(
        NatsConfig(
            port=4222,
            store_dir="/js",
            max_file_store="1G",
            monitor_port=8222,
            max_payload="8MB",
            ports_file_dir="/run/nats",
        )
    )

    for setting in ("max_file_store", "http:", "max_payload", "cluster", "server_name", "ports_file_dir"):
        assert setting not in bare
    assert "max_file_store: 1G" in full
    assert 'http: "127.0.0.1:8222"' in full
    assert "max_payload: 8MB" in full
    assert 'ports_file_dir: "/run/nats"' in full


def test_a_cluster_member_routes_to_every_member_on_its_own_host() -> None:
    text = render_config(
        NatsConfig(
            port=4222,
            store_dir="/js",
            server_name="n2",
            cluster=ClusterConfig(name="llmgw", port=6302, routes=(6301, 6302, 6303)),
        )
    )

    assert 'server_name: "n2"' in text
    assert 'listen: "127.0.0.1:6302"' in text
    for port in (6301, 6302, 6303):
        assert f"nats://127.0.0.1:{port}" in text


def test_up_s_server_is_named_durable_and_takes_large_messages() -> None:
    text = render_config(embedded_config(host="0.0.0.0", port=4300, store_dir=Path("/d/nats/jetstream"), durable=True))

    assert text.startswith("# Written by `llmgw up`")
    assert 'server_name: "llmgw-embedded"' in text
    assert 'listen: "0.0.0.0:4300"' in text
    assert "max_payload: 8MB" in text
    assert "sync_interval: always" in text


def test_a_launched_server_runs_with_the_settings_its_configuration_names(tmp_path: Path) -> None:
    config = NatsConfig(
        port=free_port(),
        monitor_port=free_port(),
        store_dir=str(tmp_path / "js"),
        max_file_store="1G",
        max_payload="8MB",
    )
    server = NatsProcess(config, tmp_path / "nats.conf", tmp_path / "nats.log").start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{config.monitor_port}/varz", timeout=5) as r:
            varz = json.loads(r.read())
    finally:
        code = server.stop()

    assert varz["max_payload"] == 8 * 1024 * 1024
    assert varz["jetstream"]["config"]["max_storage"] == 1_000_000_000
    assert varz["jetstream"]["config"]["sync_always"] is True
    assert code == 0, "SIGTERM stops the server cleanly"
    assert not server.alive()


def test_a_server_that_cannot_start_fails_with_its_own_last_words(tmp_path: Path) -> None:
    config = NatsConfig(port=free_port(), store_dir=str(tmp_path / "js"), max_payload="plenty")
    server = NatsProcess(config, tmp_path / "nats.conf", tmp_path / "nats.log")

    with pytest.raises(
        NatsStartError, match=r"nats-server exited with \d+ at start \(.*nats\.conf:\d+:\d+: .+\); see .*nats\.log"
    ):
        server.start()
    assert not server.alive()


def test_a_server_whose_port_another_server_holds_is_not_mistaken_for_that_one(tmp_path: Path) -> None:
    port = free_port()
    first = NatsProcess(
        NatsConfig(port=port, store_dir=str(tmp_path / "a" / "js")), tmp_path / "a" / "nats.conf", tmp_path / "a.log"
    )
    first.start()
    try:
        second = NatsProcess(
            NatsConfig(port=port, store_dir=str(tmp_path / "b" / "js")),
            tmp_path / "b" / "nats.conf",
            tmp_path / "b.log",
        )
        with pytest.raises(NatsStartError, match=r"exited with 1 at start .*address already in use"):
            second.start()
        assert first.alive(), "the server already there is left alone"
    finally:
        first.stop()
