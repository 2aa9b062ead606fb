"""A real Prometheus beside the cluster harness: it scrapes every `llmgw server`'s /metrics, evaluates
the project's alert rules (ops/prometheus/alerts.yml), and is read back through its HTTP API.

:func:`config` and :func:`shortened_rules` are pure (what Prometheus is given); :class:`Prometheus` starts
Debian's ``prometheus`` binary on a free loopback port with its data in a directory of its own, waits until
it is ready and scraping every target, and stops it. While it runs, :meth:`Prometheus.watch` polls
``/api/v1/alerts`` and keeps an :class:`AlertLog`: when each alert was first seen firing and when it was
seen to clear, in ``time.monotonic()`` like the fault suite's own clock.

Only the servers publish /metrics (their admin port); agents, engines and nats-server expose none
in Prometheus's format. Scrapes and rule evaluations run every second instead of a production
minute; each alert's ``for:`` is as in the rule file unless a caller shortens it in a copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import yaml

from tests.support import free_port, stop_process

RULES = Path(__file__).resolve().parents[2] / "ops" / "prometheus" / "alerts.yml"
NO_PROMETHEUS = (
    "no `prometheus` binary on PATH: install Debian's prometheus package (`sh ops/install-test-tools.sh` "
    "does, as root or with sudo) to check the alerts against a real Prometheus"
)
INTERVAL_S = 1.0  # scrape and rule evaluation
POLL_S = 0.5  # how often the watch reads /api/v1/alerts


def prometheus_binary() -> str | None:
    return shutil.which("prometheus")


def config(targets: dict[str, str], rules: Path, interval_s: float = INTERVAL_S) -> dict[str, Any]:
    """Prometheus's configuration: every target (``name → host:port``, scraped at /metrics and labelled
    ``server="name"``) every ``interval_s``, the rules evaluated as often."""
    every = f"{int(interval_s * 1000)}ms"
    return {
        "global": {"scrape_interval": every, "scrape_timeout": every, "evaluation_interval": every},
        "rule_files": [str(rules)],
        "scrape_configs": [
            {
                "job_name": "llmgw-server",
                "static_configs": [
                    {"targets": [hp], "labels": {"server": name}} for name, hp in sorted(targets.items())
                ],
            }
        ],
    }


def shortened_rules(src: Path, dst: Path, for_: dict[str, str]) -> Path:
    """A copy of the rule file ``src`` at ``dst`` in which each alert named in ``for_`` waits that long
    (a Prometheus duration, e.g. ``1s``) instead of its own ``for:``; every other rule as it is."""
    doc = yaml.safe_load(src.read_text())
    rules = [r for g in doc["groups"] for r in g["rules"]]
    unknown = set(for_) - {r.get("alert") for r in rules}
    if unknown:
        raise ValueError(f"{src} has no alert named {', '.join(sorted(unknown))}: check the names against it")
    for r in rules:
        if r.get("alert") in for_:
            r["for"] = for_[r["alert"]]
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True))
    return dst


class Span(msgspec.Struct):
    """One stretch of an alert firing, as the watch saw it (``time.monotonic()``); ``cleared`` is None
    while it still fires."""

    alert: str
    fired: float
    cleared: float | None = None


class AlertLog:
    """What fired when: fed the names firing at each poll, it keeps each alert's spans."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._open: dict[str, Span] = {}

    def saw(self, now: float, firing: set[str]) -> None:
        for name in firing - set(self._open):
            span = Span(name, now)
            self.spans.append(span)
            self._open[name] = span
        for name in set(self._open) - firing:
            self._open.pop(name).cleared = now

    def firing(self, alert: str) -> bool:
        return alert in self._open

    def since(self, t: float, alert: str | None = None) -> list[Span]:
        """The spans that fired at or after ``t``, or were still firing then (of ``alert`` only, if given)."""
        return [
            s
            for s in self.spans
            if (alert is None or s.alert == alert) and (s.fired >= t or s.cleared is None or s.cleared >= t)
        ]

    def summary(self, t0: float, t1: float | None = None) -> str:
        """Each alert firing at ``t0`` or fired since (until ``t1``, if given), with when it fired and cleared in
        seconds after ``t0``."""
        parts = []
        for s in self.since(t0):
            if t1 is not None and s.fired > t1:
                continue
            cleared = "still firing" if s.cleared is None else f"cleared at {max(s.cleared - t0, 0):.1f} s"
            parts.append(f"{s.alert} fired at {max(s.fired - t0, 0):.1f} s, {cleared}")
        return "; ".join(parts)


class Prometheus:
    """A ``prometheus`` process scraping ``targets`` with the rules in ``rules``; its data under ``base``."""

    def __init__(self, base: Path, targets: dict[str, str], rules: Path = RULES, *, binary: str | None = None) -> None:
        self.base = base
        self.targets = targets
        self.rules = rules
        self.binary = binary or prometheus_binary()
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = AlertLog()
        self._watch: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, deadline_s: float = 60.0) -> Prometheus:
        """Start it and return once it is ready and has scraped every target up."""
        if self.binary is None:
            raise RuntimeError(NO_PROMETHEUS)
        self.base.mkdir(parents=True, exist_ok=True)
        cfg = self.base / "prometheus.yml"
        cfg.write_text(yaml.safe_dump(config(self.targets, self.rules), sort_keys=False))
        argv = [
            self.binary,
            f"--config.file={cfg}",
            f"--storage.tsdb.path={self.base / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
        ]
        with open(self.base / "prometheus.log", "ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        end = time.monotonic() + deadline_s
        while not self._up():
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}:\n{self.tail()}")
            if time.monotonic() > end:
                self.stop()
                raise TimeoutError(
                    f"prometheus not scraping all of {sorted(self.targets)} after {deadline_s}s:\n{self.tail()}"
                )
            time.sleep(0.2)
        return self

    def _up(self) -> bool:
        """Ready, with its rules loaded and every target scraped up."""
        try:
            up = self.query("up")
            groups = self._get("/api/v1/rules")["data"]["groups"]
        except (OSError, ValueError, KeyError):
            return False
        return bool(groups) and sum(1 for r in up if r["value"][1] == "1") == len(self.targets)

    def stop(self) -> None:
        stop_process(self.proc)

    def tail(self) -> str:
        with contextlib.suppress(OSError):
            return (self.base / "prometheus.log").read_text(errors="replace")[-3000:]
        return ""

    def _get(self, path: str) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=2) as r:
            return json.loads(r.read())

    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query's result vector."""
        return self._get(f"/api/v1/query?query={urllib.parse.quote(promql)}")["data"]["result"]

    def alerts(self) -> list[dict[str, Any]]:
        """``/api/v1/alerts``: every pending or firing alert, with its labels, state and activeAt."""
        return self._get("/api/v1/alerts")["data"]["alerts"]

    def firing(self) -> set[str]:
        return {a["labels"]["alertname"] for a in self.alerts() if a["state"] == "firing"}

    # -- watching, for tests -------------------------------------------------------------------

    async def _poll(self) -> None:
        while True:
            with contextlib.suppress(OSError, ValueError, KeyError):
                firing = await asyncio.to_thread(self.firing)
                self.log.saw(time.monotonic(), firing)
            await asyncio.sleep(POLL_S)

    @contextlib.asynccontextmanager
    async def watch(self) -> AsyncIterator[AlertLog]:
        """Poll ``/api/v1/alerts`` into :attr:`log` while inside."""
        self._watch = asyncio.create_task(self._poll())
        try:
            yield self.log
        finally:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch


@contextlib.asynccontextmanager
async def running(base: Path, targets: dict[str, str], rules: Path = RULES) -> AsyncIterator[Prometheus]:
    """A started, watching :class:`Prometheus`, stopped on the way out."""
    prom = Prometheus(base, targets, rules)
    await asyncio.to_thread(prom.start)
    try:
        async with prom.watch():
            yield prom
    finally:
        await asyncio.to_thread(prom.stop)
