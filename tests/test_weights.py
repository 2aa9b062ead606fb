"""Weights on nodes (SPEC FLEET-8, CAT-4 purge): agents fetch `mirror:` sources from the mirror, verified.

A fake hub feeds the mirror; a fleet (services in this process, the mirror among them) places
models whose source is ``mirror:MODEL/VERSION/FILE`` on agents started with ``--mirror URL``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from llmgw.events.commands.client import CommandClient
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import mirror as E
from llmgw.events.schema import models as M
from llmgw.events.schema import nodes as N
from llmgw.events.schema.subjects import event_subject
from tests.fakehub import FakeHub
from tests.fleet import Fleet
from tests.gguf_tiny import write_tiny_gguf
from tests.support import NatsServer, wait_until
from tests.test_fleet import _last_heartbeat, chat

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(240)]

LLMGW = str(Path(sys.executable).parent / "llmgw")
SERVICES = ("catalog", "fleet", "scheduler", "projections", "api", "mirror")
COMMIT_A = "a1b2c3d4" + "0" * 32
COMMIT_B = "b1b2c3d4" + "0" * 32


class Rig:
    def __init__(self, fleet: Fleet, hub: FakeHub, tmp: Path) -> None:
        self.fleet = fleet
        self.hub = hub
        self.tmp = tmp
        self.client = CommandClient.for_service(fleet.store, "tests")

    async def mirror(self, model: str, repo: str) -> None:
        """Fetch ``repo`` into the mirror as ``model`` and wait until it is verified."""
        await self.client.send(E.SERVICE, "fetch", E.MirrorFetch(model=model, repo=repo), actor="user:test", timeout=30)

        async def done() -> bool:
            events = await self.fleet.store.read(event_subject(E.AGGREGATE, model))
            ends = [e for e in events if e.type in ("mirror.fetch_completed", "mirror.fetch_failed")]
            if ends:
                assert ends[-1].type == "mirror.fetch_completed", ends[-1].payload
            return bool(ends)

        await wait_until(done, deadline_s=30, what=f"the mirror to fetch {model}")

    def agent(self, node: str) -> Path:
        a = self.fleet.agent(node, ["--mirror", self.fleet.mirror_url])
        return a.dir / "weights"

    async def cli(self, *args: str) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(
            LLMGW,
            "--nats",
            self.fleet.nats_url,
            "--api",
            f"http://127.0.0.1:{self.fleet.admin_port}",
            *args,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=self.fleet.cli_env(),
        )
        out, err = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode is not None
        return proc.returncode, out.decode(), err.decode()

    async def holds(self, node: str, refs: set[str]) -> N.NodeHeartbeat:
        async def reported() -> N.NodeHeartbeat | None:
            hb = await _last_heartbeat(self.fleet.store, node)
            return hb if set(hb.weights) == refs else None

        return await wait_until(reported, deadline_s=20, what=f"{node} to report weights {sorted(refs)}")


@pytest.fixture
async def rig(store: EventStore, nats: NatsServer, tmp_path: Path) -> AsyncIterator[Rig]:
    hub = await FakeHub().start()
    hub.add_repo("acme/tiny-GGUF", commit=COMMIT_A)
    hub.add_file("acme/tiny-GGUF", "tiny.gguf", write_tiny_gguf(tmp_path / "a.gguf"))
    hub.add_repo("acme/other-GGUF", commit=COMMIT_B)
    hub.add_file("acme/other-GGUF", "other.gguf", write_tiny_gguf(tmp_path / "b.gguf", seed=1))
    fleet = await Fleet(store, nats.url, tmp_path).start(
        services=SERVICES, hub_endpoint=hub.url, hub_allow_private=True
    )
    try:
        yield Rig(fleet, hub, tmp_path)
    finally:
        await fleet.stop()
        await hub.stop()


TINY = "tiny/a1b2c3d4/tiny.gguf"
OTHER = "other/b1b2c3d4/other.gguf"


async def test_a_mirror_source_is_fetched_verified_served_and_reported(rig: Rig) -> None:
    await rig.mirror("tiny", "acme/tiny-GGUF")
    cache = rig.agent("n1")
    await rig.fleet.add_model("tiny", f"mirror:{TINY}")
    [replica] = await rig.fleet.wait_ready("tiny", 1)
    body = await chat(replica["url"], await rig.fleet.key(replica["id"]))
    assert body["usage"]["completion_tokens"] > 0
    held = cache / TINY
    assert hashlib.sha256(held.read_bytes()).hexdigest() == rig.hub.file("acme/tiny-GGUF", "tiny.gguf").sha256
    assert not list(cache.rglob("*.partial"))
    await rig.holds("n1", {TINY})
    code, out, err = await rig.cli("ctl", "weights", "--json")
    assert code == 0, err
    assert json.loads(out) == [{"node": "n1", "weights": [TINY], "removed": [], "error": ""}]


async def test_a_malformed_mirror_source_is_refused(rig: Rig) -> None:
    code, _, err = await rig.cli("ctl", "model", "add", "bad", "--source", "mirror:tiny/../x")
    assert code == 2
    assert "mirror:MODEL/VERSION/FILE" in err


async def test_a_corrupted_cached_file_is_never_used(rig: Rig) -> None:
    await rig.mirror("tiny", "acme/tiny-GGUF")
    cache = rig.fleet.base / "n1" / "weights"
    bad = cache / TINY
    bad.parent.mkdir(parents=True)
    good = rig.hub.file("acme/tiny-GGUF", "tiny.gguf").data
    bad.write_bytes(good[:-16] + b"\0" * 16)  # same size, other bytes
    rig.agent("n1")
    await rig.fleet.add_model("tiny", f"mirror:{TINY}")
    [replica] = await rig.fleet.wait_ready("tiny", 1)
    history = await rig.fleet.replicas()
    failed = [r for r in history.values() if r["state"] == "failed"]
    assert failed, "the corrupted copy must fail a start"
    first = failed[0]
    assert first["history"] == ["replica.placed", "replica.failed"], "no engine was started on it"
    assert "sha256" in first["reason"] and "deleted and not used" in first["reason"]
    assert hashlib.sha256(bad.read_bytes()).digest() == hashlib.sha256(good).digest()  # fetched again, whole
    assert replica["id"] != first["id"]


async def test_collect_removes_only_files_no_model_uses(rig: Rig) -> None:
    await rig.mirror("tiny", "acme/tiny-GGUF")
    cache = rig.agent("n1")
    await rig.fleet.add_model("tiny", f"mirror:{TINY}")
    await rig.fleet.wait_ready("tiny", 1)
    stray = cache / "old" / "deadbeef" / "old.gguf"
    stray.parent.mkdir(parents=True)
    stray.write_bytes(b"old weights")
    (cache / "old" / "deadbeef" / "half.gguf.partial").write_bytes(b"half")
    await rig.holds("n1", {TINY, "old/deadbeef/old.gguf"})
    code, out, err = await rig.cli("ctl", "weights", "--collect")
    assert code == 0, err
    assert "n1: removed old/deadbeef/half.gguf.partial, old/deadbeef/old.gguf" in out
    assert f"n1: holds {TINY}" in out
    assert (cache / TINY).exists()
    assert not (cache / "old").exists()
    await rig.holds("n1", {TINY})
    [replica] = await rig.fleet.wait_ready("tiny", 1)  # still serving
    assert (await chat(replica["url"], await rig.fleet.key(replica["id"])))["usage"]["completion_tokens"] > 0


async def test_remove_purge_deletes_mirror_files_and_node_copies_but_keeps_shared_ones(rig: Rig) -> None:
    await rig.mirror("tiny", "acme/tiny-GGUF")
    await rig.mirror("other", "acme/other-GGUF")
    cache = rig.agent("n1")
    await rig.fleet.add_model("tiny", f"mirror:{TINY}")
    await rig.fleet.add_model("tiny-too", f"mirror:{TINY}")
    await rig.fleet.add_model("other", f"mirror:{OTHER}")
    for name in ("tiny", "tiny-too", "other"):
        await rig.fleet.wait_ready(name, 1)
    await rig.holds("n1", {TINY, OTHER})
    mirror_root = rig.fleet.base / "mirror"

    code, out, err = await rig.cli("ctl", "model", "remove", "other", "--purge")
    assert code == 0, err
    assert "model other removed" in out
    assert f"removed {OTHER} from the mirror" in out
    assert f"removed {OTHER} from node n1" in out
    assert "purge finished: 2 file(s) removed" in out
    assert not (mirror_root / "other").exists()
    assert not (cache / OTHER).exists()
    await rig.holds("n1", {TINY})
    removed = [e for e in await rig.fleet.store.read(event_subject(M.AGGREGATE, "other")) if e.type == "model.removed"]
    assert removed[-1].payload.purge is True

    code, out, err = await rig.cli("ctl", "model", "remove", "tiny", "--purge")
    assert code == 0, err
    assert f"kept {TINY}: tiny-too use(s) it" in out
    assert "purge finished: 0 file(s) removed" in out
    assert (mirror_root / TINY).exists()
    assert (cache / TINY).exists()
    await rig.fleet.wait_ready("tiny-too", 1)
