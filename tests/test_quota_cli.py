"""Capacity quotas (SCHED-8) and `ctl model class|owner` (CAT-4) end to end: the CLI's signed commands,
the tenancy and catalog services deciding them, the scheduler blocking at the limit and saying so in
`ctl explain`, over a real nats-server. The node is a heartbeat this test publishes (its replicas are
placed, never started: placed replicas hold their reservation, which is what quotas count)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner, Result

from llmgw.cli.main import main
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import models as M
from llmgw.events.schema import nodes as N
from llmgw.events.schema import scheduler as SCH
from llmgw.events.schema import subjects as S
from llmgw.events.schema import tenancy as T
from llmgw.events.schema.subjects import event_subject
from llmgw.services.scheduler.vocabulary import Config
from tests.fleet import Fleet
from tests.support import NatsServer, wait_until

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(180)]

GPU_NODE = "g1"


async def _heartbeats(store: EventStore) -> None:
    """An eight-GPU node reporting in, as an agent would, until cancelled."""
    at = datetime.now(UTC)
    hb = N.NodeHeartbeat(
        node_id=GPU_NODE,
        at=at,
        agent_version="test",
        agent_started_at=at,
        address="http://g1:9000",
        cpus=64,
        memory_total_bytes=512 * 1024**3,
        gpus=[N.GpuInfo(index=i, name=f"gpu{i}", memory_total_mb=80 * 1024) for i in range(8)],
        engines=["llamacpp", "vllm"],
    )
    while True:
        await store.nc.publish(f"{S.TELEMETRY_ROOT}.node.{GPU_NODE}", msgspec.json.encode(hb))
        await asyncio.sleep(0.5)


@pytest.fixture
async def quota_fleet(store: EventStore, nats: NatsServer, tmp_path: Path) -> AsyncIterator[Fleet]:
    f = await Fleet(store, nats.url, tmp_path).start(
        services=("tenancy", "catalog", "fleet", "scheduler", "projections", "api"),
        scheduler=Config(lost_after_s=3600.0, backoff_base_s=0.2, backoff_cap_s=2.0, stop_grace_s=5.0),
    )
    beats = asyncio.create_task(_heartbeats(store))
    try:
        yield f
    finally:
        beats.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beats
        await f.stop()


async def ctl(fleet: Fleet, *args: str) -> Result:
    """``llmgw ctl ARGS…`` in this process (on a thread of its own: the CLI runs its own event loop)."""
    argv = ["--nats", fleet.nats_url, "--api", fleet.admin_url, "ctl", *args]
    return await asyncio.to_thread(CliRunner().invoke, main, argv, env=fleet.cli_env())


async def _explain(fleet: Fleet, model: str) -> dict:
    msg = await fleet.store.nc.request(SCH.EXPLAIN_SUBJECT, model.encode(), timeout=10)
    return msgspec.json.decode(msg.data)


async def _placed(fleet: Fleet, model: str) -> int:
    return len(await fleet.active(model))


async def test_a_model_owned_by_a_team_at_its_limit_is_blocked_with_the_reason_in_explain(quota_fleet: Fleet) -> None:
    fleet = quota_fleet
    for kind, path in (("org", "acme"), ("team", "acme/ml"), ("org", "beta"), ("team", "beta/ml")):
        await fleet.command("create", T.CreateScope(kind=kind, path=path), service=T.SERVICE)

    done = await ctl(fleet, "quota", "set", "team:acme/ml", "--gpus", "1", "--limit-gpus", "2")
    assert done.exit_code == 0, done.output
    assert "quota of team:acme/ml set" in done.output

    ambiguous = await ctl(fleet, "quota", "set", "ml", "--limit-gpus", "1")
    assert ambiguous.exit_code != 0
    assert "'ml' names 2 scopes (team:acme/ml, team:beta/ml): say which" in ambiguous.output

    profile = M.Profile(
        engine="vllm", gpus=M.GpuRequest(count=1, min_memory_gb=40), cpu_cores=4, min_memory_gb=16, ctx_size=1024
    )
    # On demand (min 0) and never asked for: nothing placed until it is scaled, once its owner is set.
    spec = M.ModelSpec(name="chat", source="/models/chat.gguf", scaling=M.Scaling(min=0, max=4), profiles=[profile])
    await fleet.command("add", M.AddModel(spec=spec))
    owned = await ctl(fleet, "model", "owner", "chat", "acme/ml")
    assert owned.exit_code == 0 and "model chat now has owner acme/ml" in owned.output, owned.output
    klass = await ctl(fleet, "model", "class", "chat", "critical")
    assert klass.exit_code == 0 and "model chat is now of class critical" in klass.output, klass.output
    scaled = await ctl(fleet, "model", "scale", "chat", "--min", "4")
    assert scaled.exit_code == 0, scaled.output

    sentence = "team:acme/ml is at its capacity limit (2 GPUs of 2 GPUs held; a replica needs 1 GPU more)"

    async def blocked() -> dict | None:
        body = await _explain(fleet, "chat")
        return body if sentence in body["summary"] else None

    body = await wait_until(blocked, what="explain to say the team is at its limit")
    assert body["owner"] == "acme/ml" and body["capacity_class"] == "critical"
    assert await _placed(fleet, "chat") == 2
    log = await fleet.store.read(event_subject(M.AGGREGATE, "chat"))
    assert any(isinstance(e.payload, SCH.PlacementBlocked) and sentence in e.payload.reason for e in log)

    explained = await ctl(fleet, "explain", "chat")
    assert explained.exit_code == 0 and sentence in explained.output, explained.output
    listed = await ctl(fleet, "quota", "list")
    assert listed.exit_code == 0, listed.output
    [row] = [line for line in listed.output.splitlines() if line.startswith("team:acme/ml")]
    assert "1 GPUs" in row and "2 GPUs" in row  # the guarantee, the limit and what it holds
    assert row.split()[-2:] == ["1", "1"]  # one replica within the guarantee, one borrowed beyond it

    models = await ctl(fleet, "models")
    assert models.exit_code == 0, models.output
    [chat] = [line.split() for line in models.output.splitlines() if line.startswith("chat ")]
    assert chat[4:6] == ["critical", "acme/ml"]  # CLASS and OWNER, after MODEL READY STARTING NODES

    # Without an owner the model counts against no quota: the scheduler places the rest.
    freed = await ctl(fleet, "model", "owner", "chat", "--none")
    assert freed.exit_code == 0 and "model chat now has no owner" in freed.output, freed.output
    await wait_until(lambda: _four(fleet), what="the rest of chat placed once it has no owner")

    cleared = await ctl(fleet, "quota", "clear", "acme/ml")
    assert cleared.exit_code == 0 and "quota of team:acme/ml cleared" in cleared.output, cleared.output


async def _four(fleet: Fleet) -> bool:
    return await _placed(fleet, "chat") == 4


async def _person(store: EventStore, name: str, role: str, scope: str) -> str:
    """A person with ``role`` over ``scope`` and a personal token, written as the people service writes
    them; the token, which the CLI signs with."""
    from llmgw.events.runtime.store import NewEvent
    from llmgw.events.schema import people as P

    token, issue = P.issue(name, "personal", label="tests")
    payloads = [
        P.UserAdded(name=name),
        P.RoleGranted(name=name, role=role, scope=scope),
        P.TokenIssued(
            name=name,
            token_id=f"t-{issue.prefix}",
            prefix=issue.prefix,
            secret_sha256=issue.secret_sha256,
            kind="personal",
            label=issue.label,
            signing_key=issue.signing_key,
        ),
    ]
    await store.append(event_subject(P.AGGREGATE, name), [NewEvent(payload=p, actor="system:tests") for p in payloads])
    return token


async def test_an_org_admin_sets_its_teams_quota_but_not_its_orgs_and_a_team_admin_neither(
    quota_fleet: Fleet,
) -> None:
    fleet = quota_fleet
    ids = {}
    for kind, path in (("org", "acme"), ("team", "acme/ml")):
        done = await fleet.command("create", T.CreateScope(kind=kind, path=path), service=T.SERVICE)
        ids[path] = done.result["id"]
    ann = await _person(fleet.store, "ann", "org-admin", f"org:{ids['acme']}")
    bob = await _person(fleet.store, "bob", "team-admin", f"team:{ids['acme/ml']}")

    async def as_(token: str, *args: str) -> Result:
        argv = ["--nats", fleet.nats_url, "--api", fleet.admin_url, "ctl", *args]
        return await asyncio.to_thread(CliRunner().invoke, main, argv, env={**fleet.cli_env(), "LLMGW_TOKEN": token})

    team = await as_(ann, "quota", "set", "team:acme/ml", "--limit-gpus", "4")
    assert team.exit_code == 0 and "quota of team:acme/ml set" in team.output, team.output
    org = await as_(ann, "quota", "set", "org:acme", "--limit-gpus", "64")
    assert org.exit_code == 2 and "needs cluster-admin of the cluster" in org.output, org.output
    own = await as_(bob, "quota", "set", "team:acme/ml", "--limit-gpus", "64")
    assert own.exit_code == 2 and "needs org-admin of team:acme/ml" in own.output, own.output
