"""A three-node JetStream cluster on loopback, for tests that take nodes away while services run.

Each node has its own client port, cluster (route) port, monitoring port and store directory;
:meth:`NatsCluster.start` returns once a meta leader is elected (``/jsz`` says so), with a
deadline. Nodes are killed (``kill -9``), paused (SIGSTOP) and brought back one at a time.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.support import free_port, nats_server_binary, wait_for_port


class ClusterNode:
    def __init__(self, name: str, store_dir: Path) -> None:
        self.name = name
        self.store_dir = store_dir
        self.port = free_port()
        self.cluster_port = free_port()
        self.monitor_port = free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

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

    def _conf(self, node: ClusterNode) -> Path:
        routes = "\n".join(f"    nats://127.0.0.1:{n.cluster_port}" for n in self.nodes)
        conf = node.store_dir.parent / "nats.conf"
        conf.write_text(
            f"server_name: {node.name}\n"
            f'listen: "127.0.0.1:{node.port}"\n'
            f'http: "127.0.0.1:{node.monitor_port}"\n'
            f'jetstream {{\n  store_dir: "{node.store_dir}"\n  sync_interval: always\n}}\n'
            f'cluster {{\n  name: llmgw\n  listen: "127.0.0.1:{node.cluster_port}"\n  routes: [\n{routes}\n  ]\n}}\n'
        )
        return conf

    def start_node(self, node: ClusterNode) -> None:
        node.store_dir.mkdir(parents=True, exist_ok=True)
        conf = self._conf(node)
        log = open(node.store_dir.parent / "nats.log", "ab")
        node.proc = subprocess.Popen([nats_server_binary(), "-c", str(conf)], stdout=log, stderr=log)
        wait_for_port(node.port, proc=node.proc)

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
        assert node.proc is not None
        node.proc.kill()
        node.proc.wait()

    def pause(self, node: ClusterNode) -> None:
        assert node.proc is not None
        node.proc.send_signal(signal.SIGSTOP)

    def resume(self, node: ClusterNode) -> None:
        assert node.proc is not None
        node.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        for node in self.nodes:
            if node.proc is None or node.proc.poll() is not None:
                continue
            with contextlib.suppress(ProcessLookupError):
                node.proc.send_signal(signal.SIGCONT)
            node.proc.terminate()
            try:
                node.proc.wait(10)
            except subprocess.TimeoutExpired:
                node.proc.kill()
                node.proc.wait()


@contextlib.contextmanager
def nats_cluster(base: Path, size: int = 3):
    cluster = NatsCluster(base, size)
    try:
        yield cluster.start()
    finally:
        cluster.stop()
