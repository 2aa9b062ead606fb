"""What a node has (SPEC FLEET-1 to FLEET-3): CPUs, memory, GPUs via NVML, sensors, engines.

Facts only: anything the machine does not expose is None or absent, never zero, so the
scheduler never rules a node out on data it does not have.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import time
from pathlib import Path

import msgspec

from llmgw.events.schema.nodes import GpuInfo

THROTTLE_BITS = {
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "power_brake",
}


def cpu_count() -> int | None:
    """The CPUs this process may run on (its affinity), not the machine's total."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


class Memory(msgspec.Struct, frozen=True):
    total: int | None
    available: int | None
    used: int | None


def memory(meminfo: Path = Path("/proc/meminfo")) -> Memory:
    """Re-read every heartbeat: a node that grows is seen to grow."""
    try:
        fields = {}
        for line in meminfo.read_text().splitlines():
            key, _, rest = line.partition(":")
            fields[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return Memory(None, None, None)
    total, avail = fields.get("MemTotal"), fields.get("MemAvailable")
    return Memory(total, avail, (total - avail) if total is not None and avail is not None else None)


def disk_free(path: Path) -> int | None:
    with contextlib.suppress(OSError):
        return shutil.disk_usage(path).free
    return None


def gpus() -> list[GpuInfo]:
    """GPUs through NVML when a driver is present; an empty list otherwise."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver, no devices: a CPU node
        return []
    out: list[GpuInfo] = []
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            name = pynvml.nvmlDeviceGetName(h)
            out.append(
                GpuInfo(
                    index=i,
                    name=name.decode() if isinstance(name, bytes) else str(name),
                    memory_total_mb=int(mem.total // 2**20),
                    memory_used_mb=int(mem.used // 2**20),
                    uuid=_try(lambda h=h: _text(pynvml.nvmlDeviceGetUUID(h))),
                    temperature_c=_try(lambda h=h: float(pynvml.nvmlDeviceGetTemperature(h, 0))),
                    memory_temperature_c=_try(
                        lambda h=h: float(pynvml.nvmlDeviceGetFieldValues(h, [82])[0].value.uiVal) or None
                    ),
                    power_w=_try(lambda h=h: pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0),
                    power_limit_w=_try(lambda h=h: pynvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0),
                    throttle=_throttle(_try(lambda h=h: pynvml.nvmlDeviceGetCurrentClocksEventReasons(h))),
                )
            )
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    return out


def _text(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _try(fn):
    try:
        return fn()
    except Exception:
        return None


def _throttle(mask: int | None) -> list[str]:
    if not mask:
        return []
    return [name for bit, name in THROTTLE_BITS.items() if mask & bit]


class SensorReader:
    """hwmon temperatures and RAPL package power, sampled at most every ``min_interval_s``."""

    def __init__(self, root: Path = Path("/sys/class"), min_interval_s: float = 10.0) -> None:
        self.root = root
        self.min_interval_s = min_interval_s
        self._last: tuple[float, dict[str, float]] | None = None
        self._rapl: dict[str, tuple[float, int, int]] = {}  # zone -> (time, energy_uj, max_range)

    def read(self) -> dict[str, float]:
        now = time.monotonic()
        if self._last and now - self._last[0] < self.min_interval_s:
            return self._last[1]
        out = self._hwmon() | self._power(now)
        self._last = (now, out)
        return out

    def _hwmon(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for hw in sorted((self.root / "hwmon").glob("hwmon*")):
            name = _read(hw / "name") or hw.name
            for temp in sorted(hw.glob("temp*_input")):
                label = _read(temp.with_name(temp.name.replace("_input", "_label"))) or temp.name[:-6]
                value = _read(temp)
                if value and value.lstrip("-").isdigit():
                    key = f"temp.{name}.{label}".lower().replace(" ", "_")
                    out[key] = int(value) / 1000.0
        return out

    def _power(self, now: float) -> dict[str, float]:
        out: dict[str, float] = {}
        for zone in sorted((self.root / "powercap").glob("intel-rapl:*")):
            if zone.name.count(":") != 1:
                continue  # packages only, not subzones
            energy, max_range = _read(zone / "energy_uj"), _read(zone / "max_energy_range_uj")
            if not (energy and energy.isdigit()):
                continue
            e, rng = int(energy), int(max_range) if max_range and max_range.isdigit() else 0
            prev = self._rapl.get(zone.name)
            self._rapl[zone.name] = (now, e, rng)
            if prev is None or now <= prev[0]:
                continue
            delta = e - prev[1]
            if delta < 0 and rng:
                delta += rng  # the counter wrapped
            if delta >= 0:
                out[f"power.{_read(zone / 'name') or zone.name}_w"] = delta / 1e6 / (now - prev[0])
        return out


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def engines(*, has_gpus: bool) -> list[str]:
    """Engines this node can actually run: probed, not assumed."""
    out = []
    if shutil.which("llama-server") or importlib.util.find_spec("xllamacpp") is not None:
        out.append("llamacpp")
    if has_gpus and shutil.which("vllm"):
        out.append("vllm")
    return out
