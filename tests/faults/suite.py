"""One fault under load, measured: what was answered, what failed, how long until steady, and the books.

:func:`run_fault` applies a fault to a :class:`~tests.cluster_harness.ClusterHarness` while a
:class:`~tests.faults.load.Load` runs, waits until the load is steady again (every answer a 200,
through every router, for ``STEADY_S`` seconds), then checks the usage stream against the load:
every request answered 200 must have exactly one usage record (0 lost, 0 doubled), and
`llmgw projections verify` must find the live tables identical to a rebuild from the log.

"Seconds to recover" is from the moment the fault began to the end of the last answer that was not
a 200 (0 when every request succeeded); the load is called steady ``STEADY_S`` seconds after that.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
from nats.js.api import DeliverPolicy

from llmgw.events.schema import subjects as S
from llmgw.projections.usage import decode_usage
from tests.cluster_harness import LLMGW, MODEL, ClusterHarness
from tests.faults.load import Answer, Load
from tests.support import wait_until

STEADY_S = 5.0
PAUSE_S = float(os.environ.get("LLMGW_FAULTS_PAUSE_S", "30"))  # how long a NATS node is SIGSTOPped
RECOVER_DEADLINE_S = 240.0
DISK_MB = 64  # the small disk a NATS node is given (a tmpfs)
DISK_FULL_S = 20.0
LOST_HOLD_S = 10.0  # how long an agent's node stays lost before the agent is started again
LOST_DEADLINE_S = 120.0  # the harness calls a node lost after 20 s without a heartbeat
IN_FLIGHT_S = 2.0  # a usage record waits in a router's memory at most about this long while the bus acknowledges


class FaultResult(msgspec.Struct):
    fault: str
    answered: int  # requests sent from the fault's start until steady again
    ok: int
    errors: int
    statuses: dict[str, int]  # non-200 answers by status ("0": no HTTP answer)
    recover_s: float
    lost: int  # answered 200, no usage record
    lost_at_kill: int  # of those, answered by a router killed -9 within IN_FLIGHT_S after answering
    doubled: int  # answered 200, more than one usage record
    verify_clean: bool
    note: str = ""
    began: float = 0.0  # time.monotonic() when the fault began
    ended: float = 0.0  # … and when its books were checked
    alerts: str = ""  # what a Prometheus watching the cluster fired, and when it cleared (tests/faults/prometheus.py)


async def usage_counts(h: ClusterHarness) -> collections.Counter[str]:
    """How many usage records each gateway request id has in the usage stream."""
    assert h.store is not None
    js = h.store.js
    last = (await js.stream_info(S.STREAM_USAGE)).state.last_seq
    counts: collections.Counter[str] = collections.Counter()
    if last == 0:
        return counts
    sub = await js.subscribe(
        "llmgw.usage.>", stream=S.STREAM_USAGE, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL
    )
    try:
        while True:
            msg = await sub.next_msg(timeout=10)
            counts[decode_usage(msg.data).request_id] += 1
            if msg.metadata.sequence.stream >= last:
                return counts
    finally:
        await sub.unsubscribe()


async def books(h: ClusterHarness, answers: list[Answer], deadline_s: float = 90.0) -> tuple[list[Answer], int]:
    """(the 200s without a record, how many have two or more) among ``answers``, once every one has its record
    or the deadline passed."""
    ids = [a.request_id for a in answers if a.status == 200 and a.request_id]
    counts: collections.Counter[str] = collections.Counter()

    async def all_there() -> bool:
        nonlocal counts
        try:
            counts = await usage_counts(h)
        except Exception:  # NATS still healing: look again
            return False
        return all(counts[i] >= 1 for i in ids)

    try:
        await wait_until(all_there, deadline_s=deadline_s, what="a usage record for every 200")
    except AssertionError:
        pass  # counted as lost below
    lost = [a for a in answers if a.status == 200 and a.request_id and counts[a.request_id] == 0]
    doubled = sum(1 for i in ids if counts[i] > 1)
    return lost, doubled


def at_a_kill(h: ClusterHarness, a: Answer) -> bool:
    """Whether ``a``'s router was killed -9 within IN_FLIGHT_S after it answered: a record still held in its
    memory is lost with it, by design (docs/decisions.md, "Usage records: a spill journal …")."""
    return any(a.ended <= t <= a.ended + IN_FLIGHT_S for t in h.servers[a.router].killed_at)


def _cli(h: ClusterHarness, *args: str, server: int = 0, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [LLMGW, *args], env=h.cli_env(server), capture_output=True, text=True, timeout=timeout, check=False
    )


async def verify_clean(h: ClusterHarness) -> tuple[bool, str]:
    """`llmgw projections verify --json` against a live server (it folds the live tables' position itself, under
    load too)."""
    server = next(i for i, s in enumerate(h.servers) if s.alive())
    out = await asyncio.to_thread(_cli, h, "projections", "verify", "--json", server=server)
    try:
        body: dict[str, Any] = json.loads(out.stdout)
    except ValueError:
        return False, f"verify exited {out.returncode}: {out.stdout[-500:]} {out.stderr[-500:]}"
    (h.base / f"verify-{time.strftime('%H%M%S')}.json").write_text(out.stdout)  # every row that differs
    differs = []
    for r in body.get("verified", []):
        for table, diff in (r.get("differences") or {}).items():
            live, rebuilt = diff.get("only_live", []), diff.get("only_rebuilt", [])
            first = (live or rebuilt or [None])[0]
            differs.append(f"{r['name']}.{table}: {len(live)} only live, {len(rebuilt)} only rebuilt, e.g. {first}")
        if not r.get("identical") and not r.get("differences"):
            differs.append(r["name"])
    return bool(body.get("identical")), "; ".join(differs)


async def run_fault(h: ClusterHarness, load: Load, name: str) -> FaultResult:
    """Apply the fault ``name`` of :data:`FAULTS` (which brings the part back, as systemd would) and measure
    the load through it."""
    await wait_until(lambda: load.steady_since(STEADY_S), deadline_s=RECOVER_DEADLINE_S, what="steady before the fault")
    t0 = time.monotonic()
    note = await FAULTS[name](h, load)
    _say(f"{name}: {note}")

    def steady() -> bool:
        return time.monotonic() - STEADY_S >= t0 and load.steady_since(STEADY_S)

    await wait_until(steady, deadline_s=RECOVER_DEADLINE_S, what=f"the load steady again after {name}")
    t1 = time.monotonic()
    answers = load.between(t0, t1)
    failed = [a for a in answers if a.status != 200]
    # Requests sent before the fault but answered after it belong to it too.
    failed += [a for a in load.answers if a.started < t0 and a.ended >= t0 and a.status != 200]
    recover_s = max((a.ended - t0 for a in failed), default=0.0)
    statuses = collections.Counter(str(a.status) for a in failed)
    _say(f"{name}: steady {t1 - t0:.1f} s after it began; counting usage records")
    # Each 200 is counted once, with the fault during or before which it was answered.
    lost, doubled = await books(h, [a for a in load.answers if load.accounted_until <= a.ended < t1])
    load.accounted_until = t1
    _say(f"{name}: {len(lost)} lost, {doubled} doubled; verifying the projections")
    if lost:
        note = f"{note}; lost: {', '.join(a.request_id or '' for a in lost[:5])}"
    # Quiet while verifying: it pauses its own server's projection runner, not the other server's, and
    # gives up on a projection that keeps moving (docs/reliability.md).
    async with load.paused():
        clean, differs = await verify_clean(h)
    if differs:
        note = f"{note}; verify differs: {differs}".strip("; ")
    return FaultResult(
        fault=name,
        answered=len(answers),
        ok=sum(1 for a in answers if a.status == 200),
        errors=len(failed),
        statuses=dict(statuses),
        recover_s=round(recover_s, 1),
        lost=len(lost),
        lost_at_kill=sum(1 for a in lost if at_a_kill(h, a)),
        doubled=doubled,
        verify_clean=clean,
        note=note,
        began=t0,
        ended=time.monotonic(),
    )


def _say(line: str) -> None:
    print(f"[faults {time.strftime('%H:%M:%S')}] {line}", flush=True)


# -- the faults ------------------------------------------------------------------------------------


async def kill_router(h: ClusterHarness, load: Load) -> str:
    """kill -9 the second server (a router, and every other service), then start it again (systemd would)."""
    h.kill9("server2")
    await h.restart("server2")
    return "server2 killed -9 and started again at once"


async def kill_scheduler_leader(h: ClusterHarness, load: Load) -> str:
    leader = await wait_until(h.leader, deadline_s=60, what="one scheduler leading")
    t = time.monotonic()
    h.kill9(leader.name)
    other = await wait_until(
        lambda: (s := h.leader()) is not None and s is not leader and s, deadline_s=120, what="a new scheduler leader"
    )
    took = time.monotonic() - t
    await h.restart(leader.name)
    return f"{leader.name} led; {other.name} led {took:.1f} s after the kill"


async def kill_nats_node(h: ClusterHarness, load: Load) -> str:
    """kill -9 the JetStream meta leader; bring it back once both routers have answered without it."""
    node = await asyncio.to_thread(h.nats.wait_for_leader, 60.0)
    h.kill9(f"nats:{node.name}")
    t = time.monotonic()
    # Down until both routers have answered without it (at least 5 s: reconnects are not instant).
    await wait_until(
        lambda: time.monotonic() > t + 5 and answered_by_all(h, load, t + 5),
        deadline_s=120,
        what="both routers answering without it",
    )
    await h.restart(f"nats:{node.name}")
    return f"{node.name} (the meta leader) killed -9, started again once both routers answered"


def answered_by_all(h: ClusterHarness, load: Load, since: float) -> bool:
    """Whether every router answered 200 to a request sent after ``since``."""
    return {a.router for a in load.answers if a.status == 200 and a.started > since} == set(range(len(h.servers)))


async def pause_nats_node(h: ClusterHarness, load: Load) -> str:
    node = await asyncio.to_thread(h.nats.wait_for_leader, 60.0)
    h.pause_nats(node.name)
    try:
        await asyncio.sleep(PAUSE_S)  # the fault itself is a duration, not a wait for a condition
    finally:
        h.resume_nats(node.name)
    return f"{node.name} (the meta leader) SIGSTOPped for {PAUSE_S:.0f} s"


def _fill(directory: Path) -> int:
    """Write a junk file in ``directory`` until its disk is full; the bytes left free (a few, or none)."""
    with contextlib.suppress(OSError), open(directory / "junk", "wb") as f:
        while True:
            f.write(b"\0" * (1 << 20))
            f.flush()
    return shutil.disk_usage(directory).free


async def fill_nats_disk(h: ClusterHarness, load: Load) -> str:
    """The meta leader comes back (after a kill -9) on a disk of DISK_MB that its catch-up and a junk file
    fill; DISK_FULL_S later it is stopped and started again on its own disk. Needs root (a tmpfs mount)."""
    node = await asyncio.to_thread(h.nats.wait_for_leader, 60.0)
    h.kill9(f"nats:{node.name}")
    store = node.store_dir
    mount = ["mount", "-t", "tmpfs", "-o", f"size={DISK_MB}m", "tmpfs", str(store)]
    await asyncio.to_thread(subprocess.run, mount, check=True)
    try:
        node.max_file_store = "4G"  # above the disk: writes fail with ENOSPC, not a limit of JetStream's own
        await h.restart(f"nats:{node.name}")
        free = await asyncio.to_thread(_fill, store)
        await asyncio.sleep(DISK_FULL_S)  # the fault is a duration: the cluster runs with one node's disk full
    finally:
        h.kill9(f"nats:{node.name}")
        await asyncio.to_thread(subprocess.run, ["umount", str(store)], check=False)
        node.max_file_store = None
    await h.restart(f"nats:{node.name}")
    return f"{node.name} (the meta leader) on a full {DISK_MB} MB disk ({free} bytes free) for {DISK_FULL_S:.0f} s"


async def kill_agent(h: ClusterHarness, load: Load) -> str:
    assert h.fleet is not None
    ready = await h.fleet.ready(MODEL)
    node = ready[0]["node"]
    h.kill9(f"agent:{node}")
    await h.restart(f"agent:{node}")
    return f"agent {node} (serving {sum(1 for r in ready if r['node'] == node)} replica(s)) killed -9, started again"


async def kill_agent_until_lost(h: ClusterHarness, load: Load) -> str:
    """kill -9 the agent serving the first ready replica and keep it down until the leading scheduler has called
    its node lost, and LOST_HOLD_S longer; then start it again."""
    assert h.fleet is not None
    ready = await h.fleet.ready(MODEL)
    node = ready[0]["node"]
    h.kill9(f"agent:{node}")
    t = time.monotonic()
    await wait_until(
        lambda: asyncio.to_thread(h.lost_nodes), deadline_s=LOST_DEADLINE_S, what=f"node {node} called lost"
    )
    lost_after = time.monotonic() - t
    await asyncio.sleep(LOST_HOLD_S)  # the fault is a duration: the node stays lost this long
    await h.restart(f"agent:{node}")
    return (
        f"agent {node} (serving {sum(1 for r in ready if r['node'] == node)} replica(s)) killed -9; its node called "
        f"lost {lost_after:.1f} s after, the agent started again {LOST_HOLD_S:.0f} s later"
    )


async def kill_engine(h: ClusterHarness, load: Load) -> str:
    assert h.fleet is not None
    fleet = h.fleet
    replica = h.kill_engine()
    t = time.monotonic()

    async def gone() -> bool:
        return (await fleet.replicas())[replica]["state"] != "ready"

    await wait_until(gone, deadline_s=120, what=f"{replica} known to have failed")
    noticed = time.monotonic() - t
    await fleet.wait_ready(MODEL, h.n_replicas, deadline_s=180)
    return (
        f"engine of {replica} killed -9; known failed after {noticed:.1f} s, "
        f"{h.n_replicas} replicas ready again after {time.monotonic() - t:.1f} s"
    )


async def restart_everything(h: ClusterHarness, load: Load) -> str:
    await h.kill_everything_and_restart()
    return "every NATS node, server and agent killed -9 at once, then started (NATS first)"


NODE_LOST = "kill -9 an agent, back once its node is lost"
FAULTS: dict[str, Callable[[ClusterHarness, Load], Awaitable[str]]] = {
    "kill -9 a router": kill_router,
    "kill -9 one NATS node, bring it back": kill_nats_node,
    "kill -9 the scheduler leader": kill_scheduler_leader,
    "kill -9 an agent": kill_agent,
    NODE_LOST: kill_agent_until_lost,
    "kill -9 an engine": kill_engine,
    f"SIGSTOP a NATS node {PAUSE_S:.0f} s": pause_nats_node,
    f"a NATS node's disk full {DISK_FULL_S:.0f} s": fill_nats_disk,
    "restart everything at once": restart_everything,
}

# The alert (ops/prometheus/alerts.yml) each of these faults must fire, and clear once the cluster is whole again.
ALERTS_EXPECTED: dict[str, str] = {
    "kill -9 the scheduler leader": "ControlPlaneLeadership",
    NODE_LOST: "NodeLost",
}
# A failover takes the lease's TTL (6 s): under ControlPlaneLeadership's own `for: 1m` it would never fire here.
SHORTENED_FOR = {"ControlPlaneLeadership": "1s"}


def markdown(results: list[FaultResult]) -> str:
    rows = [
        "| fault | requests | answered 200 | errors (by status) | seconds to recover | usage lost | usage doubled "
        "| verify |",
        "|---|---:|---:|---|---:|---:|---:|---|",
    ]
    for r in results:
        by = ", ".join(f"{n}× {'no answer' if s == '0' else s}" for s, n in sorted(r.statuses.items())) or "—"
        rows.append(
            f"| {r.fault} | {r.answered} | {r.ok} | {r.errors} ({by}) | {r.recover_s} | {r.lost} | {r.doubled} | "
            f"{'clean' if r.verify_clean else 'DIFFERS'} |"
        )
    notes = [f"- {r.fault}: {r.note}" for r in results if r.note]
    notes += [f"- {r.fault}: alerts: {r.alerts}" for r in results if r.alerts]
    return "\n".join([*rows, "", *notes]) + "\n"
