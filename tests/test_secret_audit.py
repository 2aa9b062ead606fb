"""No secret in argv, logs or events (issue "Trust", item 8).

A small running fleet — the control plane with the router and the mirror in this process, an agent
and its llama.cpp engine as real processes — serves a request with an API key and fetches a gated
repository with a hub token. Then every ``/proc/PID/cmdline`` of this test's process tree, every log
line (captured here, and the agent's and engines' log files) and every message of every stream is
searched for the engine key, the cluster secret, the mirror token, the API key and the hub token:
none is found. The secrets live where they should: the key-value bucket, process environments
(readable by their owner only), the demo key file (0600).
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import psutil
import pytest
from structlog.testing import capture_logs

from llmgw.events.runtime.secrets import engine_key_secret, mirror_token
from llmgw.events.runtime.store import STREAMS, EventStore
from llmgw.events.schema import mirror as E
from tests.fakehub import FakeHub
from tests.fleet import Fleet
from tests.gguf_tiny import write_tiny_gguf
from tests.support import NatsServer, wait_until
from tests.test_gateway import FAST_ROUTER, GATEWAY, make_key, make_tenant

pytestmark = [pytest.mark.timeout(180)]

HUB_TOKEN = "hf_auditTOKENthatMustNeverLeak0123456789"
REPO = "acme/gated-GGUF"


@pytest.fixture
async def hub() -> AsyncIterator[FakeHub]:
    h = await FakeHub().start()
    yield h
    await h.stop()


def forms(secret: bytes) -> list[bytes]:
    """The ways a binary secret could show up in text: raw, hex, base64 (standard and URL-safe)."""
    out = [secret, secret.hex().encode(), base64.b64encode(secret), base64.urlsafe_b64encode(secret)]
    return out + [f.rstrip(b"=") for f in out[2:]]


def cmdlines() -> dict[int, bytes]:
    """``/proc/PID/cmdline`` of this process and every process it started, as the kernel shows them."""
    me = psutil.Process()
    out: dict[int, bytes] = {}
    for p in [me, *me.children(recursive=True)]:
        try:
            out[p.pid] = Path(f"/proc/{p.pid}/cmdline").read_bytes()
        except OSError:
            continue  # gone meanwhile
    return out


async def stream_messages(store: EventStore) -> list[bytes]:
    """Every message still held by every stream, raw: what any NATS tool could read."""
    out: list[bytes] = []
    for stream in STREAMS:
        info = await store.js.stream_info(stream.name)
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            try:
                msg = await store.js.get_msg(stream.name, seq)
            except Exception:
                continue  # deleted (a work queue's acknowledged command, a telemetry message aged out)
            out.append((msg.subject or "").encode() + b" " + (msg.data or b""))
    return out


def leaks(secrets: dict[str, list[bytes]], where: dict[str, bytes]) -> list[str]:
    return [
        f"{name} in {place}"
        for place, data in where.items()
        for name, fs in secrets.items()
        if any(f in data for f in fs)
    ]


async def test_a_running_fleet_shows_no_secret_in_argv_logs_or_events(
    store: EventStore, nats: NatsServer, hub: FakeHub, tmp_path: Path
) -> None:
    hub.add_repo(REPO, gated="manual").granted_tokens.add(HUB_TOKEN)
    hub.add_file(REPO, "w.gguf", b"x" * 5000)
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf")
    with capture_logs() as logs:
        fleet = await Fleet(store, nats.url, tmp_path).start(
            services=(*GATEWAY, "mirror"),
            router=FAST_ROUTER,
            hub_endpoint=hub.url,
            hub_allow_private=True,  # the fake hub is on loopback
            hub_token=HUB_TOKEN,
        )
        try:
            fleet.agent("n1")
            await fleet.add_model("tiny", tiny)
            (replica,) = await fleet.wait_ready("tiny", 1)
            tenant = await make_tenant(store)
            api_key, _ = await make_key(store, tenant)
            await fleet.router_caught_up()
            c = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{fleet.port}/v1", api_key=api_key, max_retries=0)
            chat = await c.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
            assert chat.choices
            await fleet.command("fetch", E.MirrorFetch(model="gated", repo=REPO), service=E.SERVICE)

            async def fetched() -> bool:
                events = await store.read("llmgw.evt.mirror.>")
                return any(e.type == "mirror.fetch_completed" for e in events)

            await wait_until(fetched, deadline_s=30, what="the gated fetch to complete")
            assert HUB_TOKEN in {a.removeprefix("Bearer ") for a in hub.auth_seen if a}, "the token was used"

            cluster = await engine_key_secret(store.js)
            engine = await fleet.key(replica["id"])
            secrets = {
                "the engine key": [engine.encode()],
                "the cluster secret": forms(cluster),
                "the mirror token": [mirror_token(cluster).encode()],
                # The key, and its 43-character secret alone (which may itself hold a "-": split after the prefix).
                "the API key": [api_key.encode(), api_key.split("-", 2)[2].encode()],
                "the hub token": [HUB_TOKEN.encode()],
            }
            assert leaks(secrets, {"a planted line": b"key=" + engine.encode()}) == ["the engine key in a planted line"]
            procs = cmdlines()
            assert replica["pid"] in procs, "the engine is among the processes looked at"
            where: dict[str, bytes] = {f"/proc/{pid}/cmdline": data for pid, data in procs.items()}
            where |= {f"stream message {i}": m for i, m in enumerate(await stream_messages(store))}
            files = [p for p in tmp_path.rglob("*.log") if p.is_file()]
            assert any(p.name == "engine.log" for p in files) and any(p.name == "agent.log" for p in files)
            where |= {str(p.relative_to(tmp_path)): p.read_bytes() for p in files}
            where["captured log lines"] = "\n".join(repr(line) for line in logs).encode()
            assert logs, "the services logged something to look at"
            assert leaks(secrets, where) == []
        finally:
            await fleet.stop()
