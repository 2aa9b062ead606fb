"""A three-node JetStream cluster: services ride out a node's loss and a paused leader; nothing rescales.

Real nats-servers on loopback (tests/cluster.py), killed with SIGKILL and paused with SIGSTOP while
services run. Every wait is for a condition with a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats.errors
import nats.js.errors
import openai
import pytest
import structlog

from llmgw.cli.runtime import serve
from llmgw.cli.server_config import ServerConfig
from llmgw.events.commands.client import CommandClient
from llmgw.events.commands.errors import CommandError
from llmgw.events.runtime.connection import StoreError
from llmgw.events.runtime.retry import backoff_delay, is_transient
from llmgw.events.runtime.secrets import engine_key_secret
from llmgw.events.runtime.store import STREAMS, EventStore, NewEvent
from llmgw.events.schema import subjects as S
from llmgw.events.schema import tenancy as T
from llmgw.events.schema.catalog import default_registry
from llmgw.events.schema.envelope import RecordedEvent
from llmgw.events.schema.subjects import event_subject
from llmgw.events.schema.tenancy import OrgCreated
from llmgw.projections.usage import decode_usage
from llmgw.services.router.app import RouterConfig
from tests.cluster import NatsCluster, nats_cluster
from tests.fleet import FAST, Fleet
from tests.gguf_tiny import write_tiny_gguf
from tests.support import free_port, wait_until
from tests.test_gateway import make_key, make_tenant

pytestmark = pytest.mark.timeout(400)

STREAM_NAMES = {s.name for s in STREAMS}
LLMGW = str(Path(sys.executable).parent / "llmgw")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    with nats_cluster(tmp_path / "cluster") as c:
        yield c


@pytest.fixture
async def r3(cluster: NatsCluster) -> AsyncIterator[EventStore]:
    """A store on the whole cluster whose streams were made with three replicas."""
    store = await EventStore.connect(cluster.urls, default_registry(), replicas=3)
    await store.ensure_streams()
    yield store
    await store.close()


def probe(i: int) -> NewEvent:
    return NewEvent(payload=OrgCreated(org_id=f"p{i}", name=f"probe-{i}"), actor="user:test")


async def replicas(store: EventStore) -> dict[str, int]:
    return dict(await store.replica_counts())


async def all_at(store: EventStore, n: int) -> bool:
    try:
        counts = await replicas(store)
    except (StoreError, Exception):
        return False
    return bool(counts) and all(v == n for v in counts.values())


async def test_an_agent_with_one_replica_leaves_a_clusters_r3_streams_at_r3_and_says_so(
    cluster: NatsCluster, r3: EventStore
) -> None:
    await engine_key_secret(r3.js)  # the secrets bucket, made by the first process that needs it
    agent = await EventStore.connect(cluster.urls, default_registry(), replicas=1)
    try:
        with structlog.testing.capture_logs() as logs:
            as_agent = await agent.ensure_streams(update=False)
            as_server = await agent.ensure_streams()  # a server started with --replicas 1: the same
    finally:
        await agent.close()
    counts = await replicas(r3)
    assert STREAM_NAMES <= set(counts)
    assert "KV_llmgw_secrets" in counts
    assert set(counts.values()) == {3}
    for found in (as_agent, as_server):
        assert {(m.stream, m.configured, m.actual) for m in found} == {(name, 1, 3) for name in counts}
    warned = [e for e in logs if e.get("log_level") == "warning" and e.get("stream") == S.STREAM_EVENTS]
    assert warned and warned[0]["actual"] == 3 and warned[0]["configured"] == 1
    assert "llmgw streams replicas" in warned[0]["change_with"]


async def test_a_process_without_a_replica_count_creates_streams_and_buckets_at_the_clusters_size(
    cluster: NatsCluster,
) -> None:
    store = await EventStore.connect(cluster.urls, default_registry())
    try:
        await store.ensure_streams()
        await engine_key_secret(store.js)
        assert await all_at(store, 3), await replicas(store)
    finally:
        await store.close()


async def llmgw(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        LLMGW, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await proc.communicate()
    return proc.returncode or 0, out.decode()


async def test_the_streams_replicas_command_is_the_one_way_an_operator_changes_replicas(
    cluster: NatsCluster, r3: EventStore
) -> None:
    await engine_key_secret(r3.js)
    code, out = await llmgw("--nats", cluster.urls, "streams", "replicas", "1")
    assert code == 0, out
    assert f"{S.STREAM_EVENTS}: 3 -> 1 replicas" in out
    assert "KV_llmgw_secrets: 3 -> 1 replicas" in out
    assert await all_at(r3, 1)
    code, out = await llmgw("--nats", cluster.urls, "streams", "replicas", "3")
    assert code == 0, out
    await wait_until(lambda: all_at(r3, 3), deadline_s=30, what="every stream back at three replicas")
    code, out = await llmgw("--nats", cluster.urls, "streams", "replicas")
    assert code == 0 and "->" not in out
    assert {line.split()[0]: line.split()[1] for line in out.splitlines() if line.strip()}[S.STREAM_EVENTS] == "3"


async def test_more_replicas_than_nodes_is_refused_with_a_reason(cluster: NatsCluster, r3: EventStore) -> None:
    code, out = await llmgw("--nats", cluster.urls, "streams", "replicas", "5")
    assert code != 0
    assert "error: JetStream refused 5 replicas" in out and "Traceback" not in out
    assert await all_at(r3, 3)


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (nats.js.errors.ServiceUnavailableError(), True),
        (nats.errors.NoRespondersError(), True),
        (nats.errors.TimeoutError(), True),
        (nats.errors.ConnectionReconnectingError(), True),
        (nats.js.errors.APIError(code=500, description="JetStream system temporarily unavailable"), True),
        (nats.js.errors.APIError(code=400, err_code=10071, description="wrong last sequence: 4"), False),
        (nats.errors.ConnectionClosedError(), False),
        (ValueError("a bug"), False),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, Exception) else str(v),
)
def test_what_counts_as_nats_saying_not_now(error: Exception, transient: bool) -> None:
    assert is_transient(error) is transient
    wrapped = StoreError("no acknowledgement")
    wrapped.__cause__ = error
    assert is_transient(wrapped) is transient


def test_the_backoff_doubles_and_is_capped() -> None:
    assert [backoff_delay(n, 0.2, 5.0) for n in range(1, 8)] == [0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0]


async def test_a_store_given_several_urls_keeps_appending_when_its_node_is_killed(
    cluster: NatsCluster, r3: EventStore
) -> None:
    acked: list[str] = []
    subject = event_subject("probe", "killed")
    stop = asyncio.Event()

    async def load() -> None:
        i = 0
        while not stop.is_set():
            event = probe(i)
            with contextlib.suppress(StoreError):
                await r3.append(subject, [event])
                acked.append(event.id)
            i += 1

    writer = asyncio.create_task(load())
    try:
        await wait_until(lambda: len(acked) >= 20, deadline_s=30, what="appends before the kill")
        connected = next(n for n in cluster.nodes if str(n.port) in str(r3.nc.connected_url.port))
        cluster.kill(connected)
        before = len(acked)
        await wait_until(lambda: len(acked) >= before + 50, deadline_s=60, what="appends after the node was killed")
        assert r3.nc.connected_url.port != connected.port
        cluster.start_node(connected)
        cluster.wait_for_leader()
    finally:
        stop.set()
        await writer
    ids = [e.id for e in await r3.read(subject)]
    assert len(ids) == len(set(ids)), "an event was stored twice"
    lost = set(acked) - set(ids)
    assert not lost, (
        f"{len(lost)} of {len(acked)} acknowledged events not read back; {await r3.js.stream_info(S.STREAM_EVENTS)}"
    )


async def _serving(config: ServerConfig, stop: asyncio.Event, handles: dict) -> asyncio.Task:
    ready = asyncio.Event()
    task = asyncio.create_task(serve(config, stop, on_ready=ready.set, handles=handles))
    done, _ = await asyncio.wait([task, asyncio.create_task(ready.wait())], return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        task.result()
    return task


@pytest.mark.slow  # about a minute or two: three nodes killed and one paused, each waited back
async def test_two_servers_ride_out_each_node_killed_and_the_meta_leader_paused(
    cluster: NatsCluster, r3: EventStore, tmp_path: Path
) -> None:
    await engine_key_secret(r3.js)  # the secrets bucket, as a router or an agent would make it
    services = ("tenancy", "access", "catalog", "fleet", "scheduler", "projections", "api", "accountant")
    stop = asyncio.Event()
    servers = []
    for i in range(2):
        config = ServerConfig(
            nats_url=cluster.urls,
            db_dsn=f"sqlite:///{tmp_path / f'server{i}.db'}",
            services=services,
            admin_port=free_port(),
            port=free_port(),
        )
        servers.append(await _serving(config, stop, {}))

    client = CommandClient.for_service(r3, "tests")
    answered: list[str] = []
    acked: list[str] = []
    failed: list[str] = []  # attempts that got an error: the load felt the fault
    subject = event_subject("probe", "load")
    running = asyncio.Event()
    running.set()

    async def commands() -> None:
        i = 0
        while running.is_set():
            try:
                await client.send(
                    T.SERVICE, "create", T.CreateScope(kind="org", path=f"org{i}"), actor="user:t", timeout=5
                )
                answered.append(f"org{i}")
            except (CommandError, StoreError) as exc:
                failed.append(str(exc))
            i += 1

    async def appends() -> None:
        i = 0
        while running.is_set():
            event = probe(i)
            with contextlib.suppress(StoreError):
                await r3.append(subject, [event])
                acked.append(event.id)
            i += 1
            await asyncio.sleep(0.02)  # a steady load, not a flood: the two CPUs are shared

    async def answered_again() -> None:
        n = len(answered)
        await wait_until(lambda: len(answered) > n + 2, deadline_s=90, what="commands answered after the fault")
        m = len(acked)
        await wait_until(lambda: len(acked) > m + 5, deadline_s=90, what="appends acknowledged after the fault")

    load = [asyncio.create_task(commands()), asyncio.create_task(appends())]
    try:
        await answered_again()
        for node in list(cluster.nodes):
            cluster.kill(node)
            await answered_again()  # two of three nodes are a quorum
            cluster.start_node(node)
            cluster.wait_for_leader(60)
            await wait_until(lambda node=node: _current(cluster, node), deadline_s=90, what=f"{node.name} caught up")
            await answered_again()
        leader = cluster.wait_for_leader()
        cluster.pause(leader)
        try:
            # Paused until the load feels it (or shows it does not have to); then it comes back.
            n, f = len(answered), len(failed)
            await wait_until(
                lambda: len(failed) > f or len(answered) > n + 20, deadline_s=60, what="the pause felt by the load"
            )
        finally:
            cluster.resume(leader)
        cluster.wait_for_leader(60)
        await answered_again()
    finally:
        running.clear()
        await asyncio.gather(*load)
    assert not any(s.done() for s in servers), [s.exception() for s in servers if s.done()]
    ids = [e.id for e in await r3.read(subject)]
    assert len(ids) == len(set(ids)), "an event was stored twice"
    assert set(acked) <= set(ids), f"{len(set(acked) - set(ids))} acknowledged events lost"
    outcomes = [e for e in await r3.read(f"{S.EVENTS_ROOT}.command.>") if isinstance(e, RecordedEvent)]
    assert len({e.subject for e in outcomes}) == len(outcomes), "a command has two outcomes"
    counts = await replicas(r3)
    assert {"KV_llmgw_leases", "KV_llmgw_secrets"} <= set(counts)
    assert set(counts.values()) == {3}, counts
    stop.set()
    async with asyncio.timeout(90):  # a deadline: every shutdown step is bounded
        await asyncio.gather(*servers)


async def billed(store: EventStore, request_ids: list[str]) -> bool:
    """Whether every one of ``request_ids`` has its usage record in the usage stream (False while NATS heals)."""
    usage = store.on_stream(S.STREAM_USAGE)
    seen: set[str] = set()
    try:
        for seq in range(1, await usage.stream_last_seq() + 1):
            with contextlib.suppress(nats.js.errors.NotFoundError):
                seen.add(decode_usage((await store.js.get_msg(S.STREAM_USAGE, seq)).data or b"").client_request_id)
    except Exception as exc:
        if not is_transient(exc):
            raise
        return False
    return set(request_ids) <= seen


def _current(cluster: NatsCluster, node) -> bool:
    """The restarted node is back in the meta group and has every stream's replica caught up."""
    jsz = node.jsz()
    return bool(jsz and (jsz.get("meta_cluster") or {}).get("leader") and jsz.get("streams", 0) >= len(STREAMS))


async def test_a_server_told_to_stop_while_every_nats_node_is_gone_exits(
    cluster: NatsCluster, r3: EventStore, tmp_path: Path
) -> None:
    stop = asyncio.Event()
    config = ServerConfig(
        nats_url=cluster.urls,
        db_dsn=f"sqlite:///{tmp_path / 'server.db'}",
        services=("tenancy", "access", "catalog", "fleet", "scheduler", "projections", "api", "accountant"),
        admin_port=free_port(),
        port=free_port(),
    )
    handles: dict = {}
    server = await _serving(config, stop, handles)
    for node in cluster.nodes:
        cluster.kill(node)
    await wait_until(lambda: not handles["store"].nc.is_connected, deadline_s=30, what="the server to lose NATS")
    stop.set()
    # A deadline, not a measurement: it used to close its ports and hang, alive and unlistening.
    async with asyncio.timeout(120):
        await server
    assert server.done() and server.exception() is None


@pytest.mark.slow  # an engine on the tiny GGUF behind two routers, each NATS node killed in turn
async def test_two_routers_keep_answering_while_each_nats_node_is_killed_and_brought_back(
    cluster: NatsCluster, r3: EventStore, tmp_path: Path
) -> None:
    await engine_key_secret(r3.js)
    services = ("tenancy", "access", "catalog", "fleet", "scheduler", "projections", "api", "accountant", "router")
    stop = asyncio.Event()
    servers, ports = [], []
    for i in range(2):
        port = free_port()
        config = ServerConfig(
            nats_url=cluster.urls,
            db_dsn=f"sqlite:///{tmp_path / f'server{i}.db'}",
            services=services,
            admin_port=free_port(),
            port=port,
            scheduler=FAST,
            router=RouterConfig(
                activation_s=30.0,
                first_token_s=20.0,
                idle_s=20.0,
                total_s=60.0,
                usage_journal=str(tmp_path / f"journal{i}"),
            ),
        )
        servers.append(await _serving(config, stop, {}))
        ports.append(port)
    fleet = Fleet(r3, cluster.urls, tmp_path / "fleet")
    fleet.agent("n1")
    answered: list[str] = []
    refused: list[str] = []  # a router that did not take the connection
    failed: list[int] = []
    running = asyncio.Event()
    running.set()
    try:
        tenant = await make_tenant(r3)
        key, _ = await make_key(r3, tenant)
        await fleet.add_model("tiny", write_tiny_gguf(tmp_path / "tiny.gguf"))
        await fleet.wait_ready("tiny", 1, deadline_s=120)
        clients = [
            openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{p}/v1", api_key=key, max_retries=0, timeout=30)
            for p in ports
        ]

        async def ask(c: openai.AsyncOpenAI) -> bool:
            rid = f"req-{len(answered) + len(failed) + len(refused)}-{id(c)}"
            try:
                await c.chat.completions.create(
                    model="tiny",
                    messages=[{"role": "user", "content": "hi"}],
                    max_tokens=2,
                    extra_headers={"x-request-id": rid},
                )
            except openai.APIConnectionError as exc:
                refused.append(str(exc))
                return False
            except openai.APIStatusError as exc:
                failed.append(exc.status_code)
                return False
            answered.append(rid)
            return True

        for c in clients:
            await wait_until(lambda c=c: ask(c), deadline_s=60, what="a router answering")
        refused.clear()
        failed.clear()

        async def load() -> None:
            i = 0
            while running.is_set():
                await ask(clients[i % 2])
                i += 1

        async def answered_again() -> None:
            for c in clients:
                await wait_until(lambda c=c: ask(c), deadline_s=90, what="both routers answering after the fault")

        loader = asyncio.create_task(load())
        try:
            for node in list(cluster.nodes):
                cluster.kill(node)
                await answered_again()
                cluster.start_node(node)
                cluster.wait_for_leader(60)
                await wait_until(lambda node=node: _current(cluster, node), deadline_s=90, what=f"{node.name} back")
                await answered_again()
            leader = cluster.wait_for_leader()
            cluster.pause(leader)
            try:
                n, f = len(answered), len(failed) + len(refused)
                await wait_until(
                    lambda: len(failed) + len(refused) > f or len(answered) > n + 20,
                    deadline_s=60,
                    what="the pause felt by the load",
                )
            finally:
                cluster.resume(leader)
            cluster.wait_for_leader(60)
            await answered_again()
        finally:
            running.clear()
            await loader
        # Every answered request is billed: its usage record reaches the usage stream.
        await wait_until(lambda: billed(r3, answered), deadline_s=90, what="a usage record for every answered request")
    finally:
        await fleet.stop()
        stop.set()
        async with asyncio.timeout(120):
            await asyncio.gather(*servers, return_exceptions=True)
    assert not refused, refused[:3]
    assert 500 not in failed, failed
    assert set((await replicas(r3)).values()) == {3}


async def test_an_append_whose_acknowledgement_was_lost_is_not_mistaken_for_a_conflict_when_retried(
    store: EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The one thing a real cluster cannot do on cue: store the event, then lose the answer (its
    # leader killed between the two). The server checks the expected sequence before duplicates.
    publish = store.js.publish
    calls = 0

    async def stored_then_lost(*args, **kwargs):
        nonlocal calls
        calls += 1
        ack = await publish(*args, **kwargs)
        if calls == 1:
            raise nats.errors.TimeoutError
        return ack

    monkeypatch.setattr(store.js, "publish", stored_then_lost)
    subject = event_subject("probe", "lost-ack")
    result = await store.append(subject, [probe(1)], expected=0)
    assert calls == 2 and result.duplicate
    assert [e.payload.org_id for e in await store.read(subject)] == ["p1"]
