"""`llmgw ctl bench MODEL --save` end to end (SCHED-10, SCHED-11): a real agent as a process, a real llama.cpp
engine with two slots on the tiny GGUF, streaming requests through the gateway as users send them. The
measurement is a ``model.measured`` event that `ctl models`, the scheduler's autoscaler, headroom and
`ctl model target` read. Small steps keep it short; the figures themselves are the engine's, not asserted."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import models as M
from llmgw.services.scheduler import autoscale as AS
from tests.fleet import Fleet
from tests.gguf_tiny import write_tiny_gguf
from tests.support import NatsServer, wait_until
from tests.test_gateway import FAST_ROUTER, GATEWAY, make_key, make_tenant

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(240)]


@pytest.fixture
async def gw(store: EventStore, nats: NatsServer, tmp_path: Path) -> AsyncIterator[Fleet]:
    f = await Fleet(store, nats.url, tmp_path).start(services=GATEWAY, router=FAST_ROUTER)
    f.agent("n1")
    yield f
    await f.stop()


async def ctl(fleet: Fleet, *args: str, timeout_s: float = 150.0) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).parent / "llmgw"), "--nats", fleet.nats_url,
        "--api", fleet.admin_url, "ctl", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=fleet.cli_env(),
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_ctl_bench_save_measures_one_replica_and_the_scheduler_headroom_and_ctl_models_use_it(
    gw: Fleet, tmp_path: Path
) -> None:
    key, _ = await make_key(gw.store, await make_tenant(gw.store))
    await gw.add_model("tiny", write_tiny_gguf(tmp_path / "tiny.gguf"), min_=1, max_=2)  # parallel=2
    [replica] = await gw.wait_ready("tiny", 1)
    await gw.router_caught_up()
    send = ("--gateway", f"http://127.0.0.1:{gw.port}", "--key", key)
    small = ("--max-concurrency", "4", "--requests-per-step", "4", "--max-tokens", "16")

    # Max 2: the autoscaler could spread the load over two replicas, so the bench refuses to guess…
    code, _, err = await ctl(gw, "bench", "tiny", *send, *small)
    assert code == 2 and "--scale-to-one" in err, err

    # …unless told to hold the model at one replica for the run, and give back its min and max after.
    code, out, err = await ctl(gw, "bench", "tiny", *send, *small, "--scale-to-one", "--save", "--json")
    assert code == 0, err
    scaled = [
        (e.payload.min, e.payload.max)
        for e in await gw.store.read("llmgw.evt.model.tiny")
        if isinstance(e.payload, M.ModelScaled)
    ]
    assert scaled == [(1, 1), (1, 2)]
    assert "holding tiny at one replica for the run" in err and "tiny is back at min 1, max 2" in err
    result = json.loads(out)
    assert result["saved"] is True
    assert result["basis"] == "knee", "no SLO: the knee of the total tokens/s"
    assert result["concurrency"] >= 1 and result["tokens_per_s"] > 0
    assert (result["replica"], result["node"]) == (replica["id"], "n1")
    assert [s["concurrency"] for s in result["steps"]][:1] == [1]
    assert "CONCURRENT" in err and "measuring tiny: replica" in err, "the steps' table, as they run"

    [saved] = [e.payload for e in await gw.store.read("llmgw.evt.model.tiny") if isinstance(e.payload, M.ModelMeasured)]
    assert (saved.concurrency, saved.profile, saved.node_id) == (result["concurrency"], "default", "n1")
    assert saved.shape.cpus == 8 and saved.shape.gpus == 0, "the agent offers eight CPUs (tests/fleet.py)"

    code, out, err = await ctl(gw, "models", "--json")
    assert code == 0, err
    [row] = [m for m in json.loads(out) if m["name"] == "tiny"]
    assert row["measured"][0]["concurrency"] == saved.concurrency
    assert row["measured"][0]["stale"] is False
    code, out, _ = await ctl(gw, "models")
    assert f"{saved.concurrency} req, {saved.tokens_per_s:.0f} tok/s" in out

    # The autoscaler's pass reads it for the replica's profile on its node's shape.
    sched = gw.handles["scheduler"]

    def followed() -> AS.Measurement | None:
        m = sched.state.models["tiny"]
        live = [r for r in sched.state.replicas_of("tiny") if r.active]
        return AS.measurement_of(m, live, [sched.state.nodes[r.node_id].capacity for r in live])

    found = await wait_until(followed, what="the scheduler to fold model.measured")
    assert found.concurrency == saved.concurrency and found.shape == saved.shape

    code, out, err = await ctl(gw, "model", "headroom", "tiny")
    assert code == 0, err
    assert f"one more replica serves ~{saved.concurrency} concurrent" in out

    wanted = saved.tokens_per_s * 2.5
    code, out, err = await ctl(gw, "model", "target", "tiny", "--tokens-per-sec", f"{wanted}", "--json")
    assert code == 0, err
    assert json.loads(out)["replicas"] == 3
    code, out, err = await ctl(
        gw, "model", "target", "tiny", "--tokens-per-sec", f"{saved.tokens_per_s / 2}", "--apply"
    )
    assert code == 0, err
    assert "needs 1 replica of tiny" in out and "model tiny scaled to min 1, max 2" in out, out

    # An SLO set after the measurement makes it stale: nothing the autoscaler follows.
    await gw.command("slo", M.SetSlo(name="tiny", ttft_p95_s=30.0))
    await wait_until(lambda: followed() is None, what="the scheduler to drop a measurement of another SLO")
    code, _, err = await ctl(gw, "model", "target", "tiny", "--tokens-per-sec", "10")
    assert code == 2 and "ctl bench tiny --save" in err
