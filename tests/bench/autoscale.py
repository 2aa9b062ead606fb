"""A simulated day of diurnal load on the autoscaling reconciler (SCHED-9).

    .venv/bin/python -m tests.bench.autoscale [--hours 24] [--seed 1] [--slots 4] [--service-s 20] \
        [--peak 40] [--trough 2] [--ttft-slo 10] [--measured N] [--down-below 0.7] [--json]

The pure reconcile pass over ``tests/scheduler_world.py`` (events folded into a ClusterState, each
pass committed as the events the shell would write), on an injected clock: a heartbeat and a pass
every 5 simulated seconds, the default windows (a minute up, ten minutes down). One model, min 1,
max 30, on a node with room for all of them; the day runs from 04:00, its trough, where the one
replica of the minimum meets the load.

The load: requests arrive as a Poisson process whose rate follows a day — ``trough`` concurrent
requests at 04:00, ``peak`` at 14:00, a cosine between — each needing ``service_s`` seconds of one
slot. The engine model: each ready replica serves ``slots`` requests at once; the rest wait, first
come first served (a fluid queue: the requests in the system gain the arrivals and lose what the
running ones finish). A replica is ready 30 s after it is placed, and holds its room from placement
until it has stopped (5 s after its stop request).

What it reports:

- **replica-minutes used**: every replica holding room (placed, starting, ready, draining), minute
  by minute; against the **minimum that would have met the load**: each minute, the fewest replicas
  with which no request of that minute would have waited for a slot (the requests that arrived in
  the last ``service_s``, at the minute's busiest moment, over ``slots``; at least min) — both summed
  over the day, and their ratio (the goal: within 20 %); and, for scale, against the **floor of the
  mean load** (``ceil(rate × service_s / slots)``: with that many replicas, requests wait about half
  the time);
- **minutes over the SLO**: minutes in which a request arriving would wait for a slot longer than
  ``ttft-slo`` seconds (its queue ahead of it over the rate the ready slots finish requests) — the
  goal: 0;
- the steps taken (up, down), and the replicas held at a static max for comparison.
"""

from __future__ import annotations

import argparse
import math
import random
import time

import msgspec

from llmgw.events.schema import models as M
from llmgw.events.schema import nodes as N
from llmgw.events.schema import replicas as R
from llmgw.services.scheduler.vocabulary import Config, Place, Stop
from tests.scheduler_world import T0, World, model, node

STEP_S = 5.0
START_S = 30.0  # placed → ready
STOP_S = 5.0  # stop requested → stopped
MAX_REPLICAS = 30
DAY_STARTS_S = 4 * 3600.0  # 04:00


def rate_at(t: float, peak: float, trough: float, service_s: float) -> float:
    """Arrivals per second at ``t`` (seconds since midnight): the offered concurrency over the service time."""
    hour = (t / 3600.0) % 24
    # A cosine with its low at 04:00 and its high at 14:00 (a ten-hour rise, a fourteen-hour fall).
    phase = (hour - 4) / 10 if 4 <= hour < 14 else 1 + ((hour - 14) % 24) / 14
    shape = (1 - math.cos(math.pi * phase)) / 2
    return (trough + (peak - trough) * shape) / service_s


def poisson(rng: random.Random, lam: float) -> int:
    if lam <= 0:
        return 0
    if lam > 30:  # a normal approximation: Knuth's loop is slow and underflows for large means
        return max(0, round(rng.gauss(lam, math.sqrt(lam))))
    limit, k, p = math.exp(-lam), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def simulate(
    *,
    hours: float,
    seed: int,
    slots: int,
    service_s: float,
    peak: float,
    trough: float,
    ttft_slo_s: float,
    measured: int | None = None,
    cfg: Config = Config(),
) -> dict[str, float]:
    """``measured``: the concurrency of a saved measurement (SCHED-10: a ``model.measured`` in the log, as
    `ctl bench --save` writes it); None: the rules without one."""
    rng = random.Random(seed)
    w = World().add(node("a", cpus=256, mem_gb=1024), model("m", min=1, max=MAX_REPLICAS, cores=1, mem=1))
    if measured is not None:
        saved = M.ModelMeasured(
            profile="default",
            shape=M.node_shape(256, []),
            node_id="a",
            replica_id="bench",
            concurrency=measured,
            tokens_per_s=0.0,
            ttft_p95_s=0.0,
            request_tokens_per_s=0.0,
            basis="slo",
            requests=1,
            at=T0,
        )
        w.emit(M.AGGREGATE, "m", saved)
    placed_at: dict[str, float] = {}
    stop_at: dict[str, float] = {}
    in_system = 0.0
    used_s = needed_s = over_slo_minutes = no_wait_minutes = 0.0
    minute_over = False
    minute_need = 0
    recent: list[int] = []  # arrivals of the last service_s: the requests in flight had no one waited
    ups = downs = 0
    pass_s = 0.0
    steps = int(hours * 3600 / STEP_S)
    for i in range(steps):
        t = i * STEP_S
        day_t = DAY_STARTS_S + t  # the day starts at its trough, where the minimum meets the load
        # The agent: replicas placed START_S ago are ready, those asked to stop STOP_S ago have stopped.
        for r in w.state.replicas_of("m"):
            if r.state in ("placed", "starting") and t - placed_at.setdefault(r.id, t) >= START_S:
                w.emit(R.AGGREGATE, r.id, R.ReplicaReady(replica_id=r.id, node_id="a", pid=1, port=1, url="x"))
            elif r.state == "draining" and t - stop_at.setdefault(r.id, t) >= STOP_S:
                w.emit(R.AGGREGATE, r.id, R.ReplicaStopped(replica_id=r.id, node_id="a"))
        ready = sorted(r.id for r in w.state.replicas_of("m") if r.state == "ready")
        holding = sum(1 for r in w.state.replicas_of("m") if r.active or r.state == "draining")
        # The engines over the last step: arrivals join, the running requests finish at 1/service_s each.
        lam = rate_at(day_t, peak, trough, service_s)
        capacity = len(ready) * slots
        running = min(in_system, capacity)
        arrived = poisson(rng, lam * STEP_S)
        recent = [*recent, arrived][-max(1, round(service_s / STEP_S)) :]
        minute_need = max(minute_need, max(1, math.ceil(sum(recent) / slots)))
        in_system = max(in_system + arrived - running * STEP_S / service_s, 0.0)
        running = min(in_system, capacity)
        waiting = in_system - running
        wait_s = waiting / (capacity / service_s) if capacity else (math.inf if waiting else 0.0)
        minute_over = minute_over or wait_s > ttft_slo_s
        used_s += holding * STEP_S
        needed_s += max(1, math.ceil(lam * service_s / slots)) * STEP_S
        if (i + 1) % int(60 / STEP_S) == 0:
            over_slo_minutes += minute_over
            no_wait_minutes += minute_need
            minute_over, minute_need = False, 0
        # The heartbeat: each ready replica's share of the running and waiting requests.
        n = len(ready)
        run_i, wait_i = round(running), round(waiting)
        reps = [
            N.ReplicaReport(
                replica_id=rid,
                model="m",
                pid=1,
                port=1,
                state="ready",
                requests_running=run_i // n + (k < run_i % n),
                requests_waiting=wait_i // n + (k < wait_i % n),
                slots=slots,
            )
            for k, rid in enumerate(ready)
        ]
        w.beats["a"] = msgspec.structs.replace(w.beats["a"], replicas=reps)
        w.t = t
        w.beat("a")
        started = time.perf_counter()
        decisions = w.run(cfg)
        pass_s += time.perf_counter() - started
        w.commit(decisions)
        ups += sum(1 for d in decisions if isinstance(d, Place))
        downs += sum(1 for d in decisions if isinstance(d, Stop))
    day_peak = max(1, math.ceil(peak / slots))
    return {
        "replica_minutes_used": used_s / 60,
        "replica_minutes_needed": needed_s / 60,
        "ratio": used_s / needed_s,
        "replica_minutes_no_wait": no_wait_minutes,
        "ratio_no_wait": used_s / 60 / no_wait_minutes,
        "minutes_over_slo": over_slo_minutes,
        "replicas_added": ups - 1,  # the first is the minimum's
        "replicas_removed": downs,
        "static_at_peak_replica_minutes": day_peak * hours * 60,
        "pass_ms_mean": pass_s / steps * 1000,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hours", type=float, default=24.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--slots", type=int, default=4, help="requests one replica serves at once")
    ap.add_argument("--service-s", type=float, default=20.0, help="seconds one request holds a slot")
    ap.add_argument("--peak", type=float, default=40.0, help="concurrent requests offered at 14:00")
    ap.add_argument("--trough", type=float, default=2.0, help="concurrent requests offered at 04:00")
    ap.add_argument("--ttft-slo", type=float, default=10.0, help="seconds a request may wait for a slot")
    ap.add_argument(
        "--measured", type=int, default=None, help="scale on a saved measurement of this concurrency (SCHED-10)"
    )
    ap.add_argument(
        "--down-below", type=float, default=Config().scale_down_below, help="scale_down_below (1e9: no slots rule)"
    )
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    started = time.perf_counter()
    out = simulate(
        hours=a.hours,
        seed=a.seed,
        slots=a.slots,
        service_s=a.service_s,
        peak=a.peak,
        trough=a.trough,
        ttft_slo_s=a.ttft_slo,
        measured=a.measured,
        cfg=Config(scale_down_below=a.down_below),
    )
    out["wall_s"] = time.perf_counter() - started
    if a.json:
        print(msgspec.json.encode(out).decode())
        return
    rules = f"a measured concurrency of {a.measured}" if a.measured else "no measurement"
    print(f"a day of diurnal load ({a.trough:g} → {a.peak:g} concurrent requests, {a.slots} slots a replica, {rules})")
    print(f"  replica-minutes used      {out['replica_minutes_used']:9.0f}")
    print(f"  minimum, nothing waiting  {out['replica_minutes_no_wait']:9.0f}   ratio {out['ratio_no_wait']:.3f}")
    print(f"  floor, the mean load      {out['replica_minutes_needed']:9.0f}   ratio {out['ratio']:.3f}")
    print(f"  static at peak            {out['static_at_peak_replica_minutes']:9.0f}")
    print(f"  minutes over the SLO      {out['minutes_over_slo']:9.0f}   (waiting > {a.ttft_slo:g} s for a slot)")
    print(f"  replicas added / removed  {out['replicas_added']:4.0f} / {out['replicas_removed']:.0f}")
    print(f"  pass {out['pass_ms_mean']:.2f} ms mean; simulation {out['wall_s']:.1f} s")


if __name__ == "__main__":
    main()
