"""`llmgw up` when things die under it: kill -9 of `up` or of its nats-server, a bad data directory,
a projection database deleted while running. Real processes, the real CLI, real nats-server."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from llmgw.agent.supervisor import pid_alive
from llmgw.cli.natsd import pick_port, port_candidates, port_free
from llmgw.events.runtime.connection import NatsCredential
from llmgw.events.runtime.store import EventStore, NewEvent
from llmgw.events.schema import models as M
from llmgw.events.schema.catalog import default_registry
from llmgw.events.schema.subjects import event_subject
from llmgw.events.schema.tenancy import OrgCreated
from tests.fleet import Fleet
from tests.gguf_tiny import write_tiny_gguf
from tests.support import free_port, wait_until
from tests.up import DEADLINE_S, LLMGW, Up, nats_servers, wait_for


def append_orgs(nats_url: str, creds: NatsCredential, n: int) -> list[str]:
    """Append ``n`` events through the event store; the ids of those the server acknowledged."""

    async def go() -> list[str]:
        store = await EventStore.connect(nats_url, default_registry(), creds=creds)
        try:
            ids = []
            for i in range(n):
                event = NewEvent(payload=OrgCreated(org_id=f"crash-{i}", name=f"crash-{i}"), actor="user:test")
                await store.append(event_subject("tenancy", f"crash-{i}"), [event])
                ids.append(event.id)
            return ids
        finally:
            await store.close()

    return asyncio.run(go())


def stored_ids(nats_url: str, creds: NatsCredential, n: int) -> list[str]:
    async def go() -> list[str]:
        store = await EventStore.connect(nats_url, default_registry(), creds=creds)
        try:
            return [e.id for i in range(n) for e in await store.read(event_subject("tenancy", f"crash-{i}"))]
        finally:
            await store.close()

    return asyncio.run(go())


def test_a_killed_up_leaves_one_nats_server_on_its_store_on_the_same_port_with_every_acknowledged_event(
    tmp_path: Path, ups: list[Up]
) -> None:
    data = tmp_path / "data"
    first = Up(data)
    ups.append(first.start())
    port = first.nats_port()
    acknowledged = append_orgs(first.nats_url(), first.nats_creds(), 50)

    first.kill9()
    second = Up(data)
    ups.append(second.start())

    assert len(nats_servers(data)) == 1, "one nats-server per store: the killed up's server did not outlive it"
    assert second.nats_port() == port
    assert stored_ids(second.nats_url(), second.nats_creds(), 50) == acknowledged


def test_a_nats_server_still_running_from_a_killed_up_is_stopped_by_the_next_up(tmp_path: Path, ups: list[Up]) -> None:
    data = tmp_path / "data"
    first = Up(data)
    ups.append(first.start())
    port = first.nats_port()
    acknowledged = append_orgs(first.nats_url(), first.nats_creds(), 10)
    [old] = nats_servers(data)
    os.kill(old, signal.SIGSTOP)  # frozen: it cannot act on its parent's death by itself
    first.kill9()

    second = Up(data)
    ups.append(second.start())

    [new] = nats_servers(data)
    assert new != old
    assert second.nats_port() == port
    assert stored_ids(second.nats_url(), second.nats_creds(), 10) == acknowledged


def test_up_stops_with_the_reason_when_its_nats_server_is_killed_and_the_next_up_keeps_the_port(
    tmp_path: Path, ups: list[Up]
) -> None:
    data = tmp_path / "data"
    first = Up(data)
    ups.append(first.start())
    port = first.nats_port()
    acknowledged = append_orgs(first.nats_url(), first.nats_creds(), 10)
    [server] = nats_servers(data)

    os.kill(server, signal.SIGKILL)
    assert first.proc is not None
    wait_for(lambda: first.proc.poll() is not None, "llmgw up to exit after its nats-server was killed", 20.0)
    assert first.proc.returncode == 1
    assert "error: the embedded nats-server exited (killed by signal 9" in first.output()
    assert "Traceback" not in first.output()
    assert nats_servers(data) == []

    second = Up(data)
    ups.append(second.start())
    assert second.nats_port() == port, "the port everything was configured with still reaches the system"
    assert stored_ids(second.nats_url(), second.nats_creds(), 10) == acknowledged


def _read_only(data: Path, argv: list[str]) -> list[str]:
    """``argv`` run with ``data`` read-only: by its mode for a user, by a read-only bind mount in a
    mount namespace of its own for root (whom modes do not stop)."""
    data.chmod(0o555)
    if os.geteuid() != 0:
        return argv
    unshare = shutil.which("unshare")
    assert unshare, "unshare (util-linux) is needed to make a directory read-only for root"
    return [unshare, "--mount", "sh", "-c", 'mount --bind -o ro "$0" "$0" && exec "$@"', str(data), *argv]


def test_a_read_only_data_directory_is_refused_in_one_line_naming_it(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    done = subprocess.run(_read_only(data, Up(data).argv()), capture_output=True, text=True, timeout=60)
    data.chmod(0o755)

    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert f"the data directory {data}" in lines[0]
    assert "read-only" in lines[0] or "not writable" in lines[0]
    assert "--data-dir" in lines[0]
    assert nats_servers(data) == []


def test_a_data_directory_that_is_a_file_is_refused_in_one_line_naming_it(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.write_text("not a directory")
    done = subprocess.run(Up(data).argv(), capture_output=True, text=True, timeout=60)

    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"Error: the data directory {data} is not a directory: move what is there away, "
        "or choose another with --data-dir or LLMGW_DATA_DIR"
    ]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="mounts a full tmpfs: root only")
def test_a_data_directory_on_a_full_disk_is_refused_in_one_line_naming_it(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    fill = 'mount -t tmpfs -o size=64k tmpfs "$0" && (cat /dev/zero > "$0/fill" 2>/dev/null; exec "$@")'
    argv = ["unshare", "--mount", "sh", "-c", fill, str(data), *Up(data).argv()]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)

    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"Error: the data directory {data} has no space left (No space left on device): free space on its disk, "
        "or choose another with --data-dir or LLMGW_DATA_DIR"
    ]


def test_a_store_locked_by_another_process_is_refused_in_one_line(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "nats").mkdir(parents=True)
    hold = (
        "import fcntl, sys; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); "
        "input()"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", hold, str(data / "nats" / "store.lock")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        done = subprocess.run(Up(data).argv(), capture_output=True, text=True, timeout=60)
    finally:
        holder.kill()
        holder.wait()

    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert f"the NATS store {data / 'nats'} is locked by a process other than the nats-server" in lines[0]
    assert f"fuser {data / 'nats' / 'store.lock'}" in lines[0]
    assert nats_servers(data) == []


def test_the_nats_port_asked_for_comes_first_then_the_one_used_last_then_the_default() -> None:
    assert port_candidates(None, None) == [4222]
    assert port_candidates(None, 40001) == [40001, 4222]
    assert port_candidates(0, 40001) == [40001], "0: any port, but the store's own while it is free"
    assert port_candidates(0, None) == []
    assert port_candidates(5000, 40001) == [5000, 40001]


def test_the_nats_server_never_takes_a_port_up_serves_http_on_even_while_it_is_free() -> None:
    assert port_candidates(None, 40001, avoid=frozenset({40001})) == [4222], "the store's old port is now up's"
    assert port_candidates(None, None, avoid=frozenset({4222})) == []
    # The kernel's pick, with fifty ports it may well pick avoided: never one of them.
    avoid = frozenset(free_port() for _ in range(50))
    assert all(pick_port(0, None, avoid=avoid) not in avoid for _ in range(200))


def test_up_refuses_a_nats_port_that_is_also_its_gateway_port(tmp_path: Path) -> None:
    port = free_port()
    done = subprocess.run(
        [LLMGW, "up", "--data-dir", str(tmp_path / "data"), "--port", str(port), "--nats-port", str(port)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert f"--nats-port {port} is also one of this `up`'s HTTP ports (gateway {port}" in done.stderr
    assert nats_servers(tmp_path / "data") == [], "nothing was started"


def test_up_refuses_a_gateway_port_another_program_listens_on_before_starting_anything(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [LLMGW, "up", "--data-dir", str(tmp_path / "data"), "--port", str(port), "--no-demo"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode != 0
    assert (
        f"cannot listen on 127.0.0.1:{port}, the gateway's port (--port): another program listens there; "
        "choose another port" in done.stderr
    )
    assert "nats-server started" not in done.stderr + done.stdout, "refused before NATS started"


def test_a_port_is_free_or_taken_on_an_ipv6_host_as_on_an_ipv4_one() -> None:
    with socket.socket(socket.AF_INET6) as taken:
        try:
            taken.bind(("::", 0))
        except OSError:
            pytest.skip("no IPv6 on this machine")
        taken.listen()
        port = taken.getsockname()[1]
        assert not port_free(port, "::") and not port_free(port, "0.0.0.0")
    assert port_free(port, "::"), "free again once its listener is closed"


def test_up_refuses_one_port_given_for_both_the_gateway_and_the_admin_api(tmp_path: Path) -> None:
    port = free_port()
    argv = [LLMGW, "up", "--data-dir", str(tmp_path / "data"), "--port", str(port), "--admin-port", str(port)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert f"{port} is both the gateway's port (--port) and the admin port (--admin-port)" in done.stderr
    assert nats_servers(tmp_path / "data") == []


def test_a_projection_database_deleted_while_running_is_recreated_and_verifies_clean(
    tmp_path: Path, ups: list[Up]
) -> None:
    up = Up(tmp_path / "data")
    ups.append(up.start())
    assert up.cli("ctl", "org", "create", "acme").returncode == 0
    (up.data_dir / "projections.db").unlink()
    assert up.cli("ctl", "org", "create", "globex").returncode == 0

    done = up.cli("projections", "verify")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "tenancy: identical" in done.stdout
    assert "recreated it and rebuilt it from the log" in done.stderr
    assert (up.data_dir / "projections.db").exists()
    tree = json.loads(up.cli("ctl", "tree", "--json").stdout)
    assert {"acme", "globex"} <= {o["name"] for o in tree}
    again = up.cli("projections", "verify")
    assert again.returncode == 0 and "recreated" not in again.stderr


def _up_serving_tiny(tmp_path: Path, ups: list[Up]) -> tuple[Path, Up, dict[str, Any]]:
    """An `up` serving the tiny model: its data directory, the `up`, and its engine's state file."""
    data = tmp_path / "data"
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf")
    first = Up(data)
    ups.append(first.start())
    added = first.cli("ctl", "model", "add", "tiny", "--source", str(tiny), "--cpu-cores", "1", "--memory-gb", "0.1")
    assert added.returncode == 0, added.stderr
    return data, first, wait_for(lambda: _engine(data), "the tiny model's engine to be ready", 120.0)


def _engine(data: Path) -> dict[str, Any] | None:
    for state in (data / "agent" / "replicas").glob("*/state.json"):
        with_state = json.loads(state.read_text())
        if with_state.get("state") == "ready":
            return with_state
    return None


def test_an_engine_is_adopted_after_up_is_killed_and_stopped_by_an_up_without_an_agent(
    tmp_path: Path, ups: list[Up]
) -> None:
    data, first, engine = _up_serving_tiny(tmp_path, ups)

    first.kill9()
    second = Up(data)
    ups.append(second.start())
    wait_for(lambda: "engine adopted" in (data / "agent" / "agent.log").read_text(), "the new agent to adopt")
    assert _engine(data) == engine, "the same engine process, adopted"
    assert pid_alive(engine["pid"], engine["proc_start"])

    second.kill9()
    third = Up(data)
    ups.append(third.start("--no-agent"))
    assert not pid_alive(engine["pid"], engine["proc_start"]), "no agent will adopt it: stopped"
    assert f"stopped engine {engine['replica_id']} (tiny, pid {engine['pid']})" in third.output()


def test_a_clean_stop_of_up_stops_its_engines_and_records_them_stopped_not_failed(
    tmp_path: Path, ups: list[Up]
) -> None:
    data, first, engine = _up_serving_tiny(tmp_path, ups)
    assert first.stop() == 0
    assert not pid_alive(engine["pid"], engine["proc_start"]), "the engine stopped with up"

    second = Up(data)
    ups.append(second.start())

    def replica_events() -> list[dict] | None:
        done = second.cli("events", "tail", "-n", "50", "--json", "--aggregate", "replica")
        events = [json.loads(x) for x in done.stdout.splitlines()]
        mine = [e for e in events if e["data"].get("replica_id") == engine["replica_id"]]
        return mine or None

    mine = wait_for(replica_events, "the replica's events")
    types = [e["type"] for e in mine]
    assert types[-1] == "replica.stopped" and "replica.failed" not in types, types
    assert mine[-1]["data"]["reason"] == "stopped with llmgw up"


async def test_an_engine_whose_model_was_stopped_while_its_agent_was_away_is_stopped_when_the_agent_returns(
    fleet: Fleet, tmp_path: Path
) -> None:
    agent = fleet.agent("n1")
    await fleet.add_model("tiny", write_tiny_gguf(tmp_path / "tiny.gguf"))
    [replica] = await fleet.wait_ready("tiny", 1)
    agent.kill9()
    await fleet.command("stop", M.StopModel(name="tiny"))

    async def unwanted() -> bool:
        return (await fleet.replicas())[replica["id"]]["state"] in ("draining", "stopped", "failed")

    await wait_until(unwanted, what="the stopped model's replica to be unwanted in the log")
    os.kill(replica["pid"], 0)  # nobody has stopped the engine yet: its agent is away
    agent.start()

    def engine_gone() -> bool:
        try:
            os.kill(replica["pid"], 0)
        except ProcessLookupError:
            return True
        return not Path(f"/proc/{replica['pid']}/cmdline").read_bytes()  # a zombie waiting to be reaped

    await wait_until(engine_gone, deadline_s=DEADLINE_S, what="the returning agent to stop the unwanted engine")
