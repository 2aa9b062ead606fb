"""The deployment files of a cluster (ops/cluster/, ops/systemd/) name only what exists.

Docker does not run here, so the compose file is checked for its shape: it parses, it has three
NATS servers clustered with JetStream, PostgreSQL, two `llmgw server`s and agents, and every flag
each `llmgw` command in it (and in the systemd units) uses is one `llmgw <command> --help` lists.
"""

from __future__ import annotations

import functools
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.fleet import LLMGW

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "ops" / "cluster" / "compose.yaml"


@functools.cache
def flags_of(command: str) -> frozenset[str]:
    """The flags `llmgw COMMAND --help` lists."""
    out = subprocess.run([LLMGW, command, "--help"], capture_output=True, text=True, check=True, timeout=60)
    return frozenset(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", out.stdout))


def used_flags(argv: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in argv if a.startswith("--")]


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def llmgw_services(kind: str) -> dict[str, list[str]]:
    return {
        name: [str(a) for a in svc["command"]]
        for name, svc in compose()["services"].items()
        if isinstance(svc.get("command"), list) and svc["command"][:2] == ["llmgw", kind]
    }


def test_the_compose_file_has_three_clustered_nats_servers_postgres_two_servers_and_agents() -> None:
    services = compose()["services"]
    nats = [n for n, s in services.items() if str(s.get("image", "")).startswith("nats:")]
    assert len(nats) == 3
    conf = (COMPOSE.parent / "nats.conf").read_text()
    assert "sync_interval: always" in conf
    for name in nats:
        assert f"nats://{name}:6222" in conf, f"{name} is not among the cluster's routes"
    assert any(str(s.get("image", "")).startswith("postgres:") for s in services.values())
    assert len(llmgw_services("server")) == 2
    assert len(llmgw_services("agent")) >= 1


@pytest.mark.parametrize("kind", ["server", "agent"])
def test_every_flag_the_compose_file_gives_llmgw_is_one_it_has(kind: str) -> None:
    for name, argv in llmgw_services(kind).items():
        unknown = set(used_flags(argv)) - flags_of(kind)
        assert not unknown, f"{name}: `llmgw {kind}` has no {sorted(unknown)}"


def test_both_servers_reach_every_nats_node_and_one_database_with_streams_at_three_replicas() -> None:
    servers = llmgw_services("server")
    for name, argv in servers.items():
        nats = argv[argv.index("--nats") + 1].split(",")
        assert len(nats) == 3, name
        assert argv[argv.index("--replicas") + 1] == "3", name
    assert len({argv[argv.index("--db") + 1] for argv in servers.values()}) == 1, "the servers share one database"


@pytest.mark.parametrize("unit", sorted((ROOT / "ops" / "systemd").glob("llmgw-*.service")), ids=lambda p: p.name)
def test_every_flag_a_systemd_unit_gives_llmgw_is_one_it_has(unit: Path) -> None:
    exec_start = next(line for line in unit.read_text().splitlines() if line.startswith("ExecStart="))
    argv = shlex.split(exec_start.removeprefix("ExecStart="))
    kind = argv[1]
    unknown = set(used_flags(argv)) - flags_of(kind)
    assert not unknown, f"{unit.name}: `llmgw {kind}` has no {sorted(unknown)}"


@pytest.mark.parametrize("env", sorted((ROOT / "ops" / "cluster").glob("*.env")), ids=lambda p: p.name)
def test_every_setting_an_env_file_names_is_a_documented_one(env: Path) -> None:
    documented = (ROOT / "docs" / "operations.md").read_text()
    for line in env.read_text().splitlines():
        line = line.lstrip("# ")
        if m := re.match(r"(LLMGW_[A-Z_]+)=", line):
            assert f"`{m.group(1)}`" in documented, f"{env.name}: {m.group(1)} is no setting docs/operations.md lists"
