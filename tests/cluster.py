"""A three-node JetStream cluster on loopback, for tests that take nodes away while services run.

Each node has its own client port, cluster (route) port, monitoring port and store directory;
:meth:`NatsCluster.start` returns once a meta leader is elected (``/jsz`` says so), with a
deadline. Nodes are killed (``kill -9``), paused (SIGSTOP) and brought back one at a time.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from llmgw.infra.natsd import ClusterConfig, NatsConfig, NatsProcess
from tests.support import free_ports


class ClusterNode:
    def __init__(self, name: str, store_dir: Path) -> None:
        self.name = name
        self.store_dir = store_dir
        self.port, self.cluster_port, self.monitor_port = free_ports(3)
        self.url = f"nats://127.0.0.1:{self.port}"
        self.server: NatsProcess | None = None
        self.max_file_store: str | None = None  # a fixed store limit (a disk smaller than it fails with ENOSPC)

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        return self.server.proc if self.server is not None else None

    def jsz(self) -> dict[str, Any] | None:
        """The node's JetStream view (``/jsz``), or None when it does not answer."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.monitor_port}/jsz", timeout=1.0) as r:
                return json.loads(r.read())
        except (OSError, ValueError):
            return None


class NatsCluster:
    """Three nats-servers clustered with JetStream; ``urls`` is the comma-separated list clients take."""

    def __init__(self, base: Path, size: int = 3) -> None:
        self.base = base
        self.nodes = [ClusterNode(f"n{i + 1}", base / f"n{i + 1}" / "js") for i in range(size)]
        self.urls = ",".join(n.url for n in self.nodes)

    def config(self, node: ClusterNode) -> NatsConfig:
        return NatsConfig(
            server_name=node.name,
            port=node.port,
            monitor_port=node.monitor_port,
            store_dir=str(node.store_dir),
            max_file_store=node.max_file_store,
            cluster=ClusterConfig(
                name="llmgw", port=node.cluster_port, routes=tuple(n.cluster_port for n in self.nodes)
            ),
        )

    def start_node(self, node: ClusterNode) -> None:
        node.server = NatsProcess(
            self.config(node), node.store_dir.parent / "nats.conf", node.store_dir.parent / "nats.log"
        ).start(deadline_s=10.0)

    def start(self, deadline_s: float = 30.0) -> NatsCluster:
        for node in self.nodes:
            self.start_node(node)
        self.wait_for_leader(deadline_s)
        return self

    def meta_leader(self, exclude: ClusterNode | None = None) -> ClusterNode | None:
        """The node every running node (but ``exclude``, e.g. a paused one) names as the JetStream meta
        leader, when they agree on one."""
        named = set()
        for node in self.running():
            if node is exclude:
                continue
            jsz = node.jsz()
            leader = ((jsz or {}).get("meta_cluster") or {}).get("leader")
            if not leader:
                return None
            named.add(leader)
        if len(named) != 1:
            return None
        return next((n for n in self.nodes if n.name in named), None)

    def wait_for_leader(self, deadline_s: float = 30.0) -> ClusterNode:
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            leader = self.meta_leader()
            if leader is not None:
                return leader
            time.sleep(0.1)
        raise TimeoutError(f"no JetStream meta leader among {[n.name for n in self.running()]} after {deadline_s}s")

    def running(self) -> list[ClusterNode]:
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    def kill(self, node: ClusterNode) -> None:
        assert node.server is not None
        node.server.kill()

    def pause(self, node: ClusterNode) -> None:
        assert node.server is not None
        node.server.pause()

    def resume(self, node: ClusterNode) -> None:
        assert node.server is not None
        node.server.resume()

    def stop(self) -> None:
        for node in self.nodes:
            if node.server is not None:
                node.server.stop(grace_s=10.0)


@contextlib.contextmanager
def nats_cluster(base: Path, size: int = 3):
    cluster = NatsCluster(base, size)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


if __name__ == "__main__":
    # `python -m tests.cluster up|down|status [--dir D]`: the whole cluster shape (tests/cluster_harness.py).
    import sys

    from tests.cluster_harness import main

    sys.exit(main())
