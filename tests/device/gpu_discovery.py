"""A check for a machine with NVIDIA GPUs; not part of the suite, which runs without one.

NVML discovery (agent/discovery.py) must report each GPU with its memory and sensors, the node
series (services/scheduler/metrics.py) must carry them, and placement must put a vLLM model that
needs one GPU onto a GPU it found, and refuse one that needs more memory than the GPU has, saying
so. Needs only msgspec, prometheus-client and nvidia-ml-py beside the llmgw folders:

    python -m tests.device.gpu_discovery [OUT_DIR]

Exits non-zero, naming what failed; writes the node's series in Prometheus text to OUT_DIR.
"""

from __future__ import annotations

import sys
from datetime import UTC, datetime
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from llmgw.agent import discovery
from llmgw.events.schema import models as M
from llmgw.events.schema import nodes as N
from llmgw.services.scheduler.metrics import FleetCollector, node_samples
from llmgw.services.scheduler.state import capacity_of
from llmgw.services.scheduler.vocabulary import Blocked, Config, Place
from tests.scheduler_world import World, spec


def main(out_dir: Path | None) -> int:
    problems: list[str] = []
    gpus = discovery.gpus()
    for g in gpus:
        print(
            f"gpu {g.index}: {g.name}, {g.memory_total_mb} MiB ({g.memory_used_mb} used), {g.temperature_c} °C, "
            f"memory {g.memory_temperature_c} °C, {g.power_w} W of {g.power_limit_w} W, throttle {g.throttle}, {g.uuid}"
        )
    if not gpus:
        return fail(["NVML found no GPU on a machine that has one"])
    for g in gpus:
        if g.memory_total_mb <= 0 or g.memory_used_mb is None:
            problems.append(f"gpu {g.index}: memory not read ({g.memory_total_mb}, {g.memory_used_mb})")
        for field in ("temperature_c", "power_w", "power_limit_w", "uuid"):
            if getattr(g, field) is None:
                problems.append(f"gpu {g.index}: {field} not read")
    sensors = discovery.SensorReader().read()
    print(f"sensors: {sensors}")
    print(f"engines: {discovery.engines(has_gpus=True)}")

    now = datetime.now(UTC)
    hb = N.NodeHeartbeat(
        node_id="dev",
        at=now,
        agent_version="check",
        agent_started_at=now,
        address="http://dev:9000",
        cpus=16,
        memory_total_bytes=128 * 2**30,
        memory_available_bytes=100 * 2**30,
        gpus=gpus,
        engines=["vllm", "llamacpp"],
        sensors=sensors,
    )
    w = World()
    w.emit(N.AGGREGATE, "dev", N.NodeRegistered(node_id="dev", capacity=capacity_of(hb)))
    w.state.observe(hb, w.t)
    samples = {(name, labels): v for name, labels, v in node_samples(w.state)}
    for name, labels in sorted(samples):
        print(f"series {name}{labels} = {samples[(name, labels)]}")
    if ("llmgw_gpu_memory_total_bytes", ("dev", "0")) not in samples:
        problems.append("no llmgw_gpu_memory_total_bytes series for gpu 0")
    if ("llmgw_gpu_temperature_celsius", ("dev", "0")) not in samples:
        problems.append("no llmgw_gpu_temperature_celsius series for gpu 0")

    gib = gpus[0].memory_total_mb / 1024
    fits = spec("fits", engine="vllm", gpus=1, gpu_mem=round(gib * 0.5), mem=8.0)
    too_big = spec("too-big", engine="vllm", gpus=1, gpu_mem=round(gib * 2), mem=8.0)
    w.emit(M.AGGREGATE, "fits", M.ModelAdded(spec=fits))
    w.emit(M.AGGREGATE, "too-big", M.ModelAdded(spec=too_big))
    decisions = w.run()
    placed = [d for d in decisions if isinstance(d, Place)]
    blocked = [d for d in decisions if isinstance(d, Blocked)]
    print(f"placed: {[(d.model, d.node_id, d.gpus, d.why) for d in placed]}")
    print(f"blocked: {[(d.model, d.reason) for d in blocked]}")
    if [(d.model, d.node_id, d.gpus) for d in placed] != [("fits", "dev", [0])]:
        problems.append(f"the model that fits one GPU was not placed on gpu 0: {placed}")
    if [d.model for d in blocked] != ["too-big"] or "GPU" not in blocked[0].reason.upper():
        problems.append(f"the model needing {round(gib * 2)} GB of GPU memory was not refused by GPU: {blocked}")

    if out_dir is not None:
        registry = CollectorRegistry()
        registry.register(FleetCollector("dev", lambda: w.state, lambda: True, list, Config()))
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "node-series.prom").write_bytes(generate_latest(registry))
    return fail(problems)


def fail(problems: list[str]) -> int:
    for p in problems:
        print(f"FAILED: {p}")
    print("ok" if not problems else f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]) if len(sys.argv) > 1 else None))
