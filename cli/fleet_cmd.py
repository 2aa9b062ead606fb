"""`llmgw ctl` for the fleet: models, nodes, replicas, explain, logs (SPEC CAT, FLEET, SCHED)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import msgspec

from llmgw.cli.client import Session, run
from llmgw.cli.ctl import ctl
from llmgw.cli.scheduler_query import ask_scheduler
from llmgw.cli.table import table
from llmgw.events.commands.errors import CommandRejectedError, Unreachable
from llmgw.events.schema import jobs as J
from llmgw.events.schema import models as M
from llmgw.events.schema import nodes as N
from llmgw.events.schema import replicas as R
from llmgw.events.schema import scheduler as SCH
from llmgw.events.schema.agent_rpc import (
    LogsReply,
    LogsRequest,
    WeightsReply,
    WeightsRequest,
    logs_subject,
    weights_subject,
)
from llmgw.events.schema.envelope import RecordedEvent
from llmgw.events.schema.subjects import event_subject
from llmgw.modelfiles.gguf_header import read_header_file
from llmgw.modelfiles.sizing import estimate_memory

if TYPE_CHECKING:
    from llmgw.events.runtime.store import EventStore  # the store comes from the Session, NATS with it


def load_model_file(path: str) -> list[M.ModelSpec]:
    """One model, or ``models: [...]``, from YAML; errors name the field."""
    import yaml  # only when a model file is read

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise click.BadParameter(f"cannot read {path}: {exc}") from exc
    items = data.get("models", [data]) if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise click.BadParameter(f"{path}: expected a model, or `models:` with a list of models")
    try:
        return [msgspec.convert(item, M.ModelSpec) for item in items]
    except msgspec.ValidationError as exc:
        raise click.BadParameter(f"{path}: {exc}") from exc


@ctl.group()
def model() -> None:
    """Add, scale, stop, start and remove models (the catalog)."""


@model.command("add")
@click.argument("name", required=False)
@click.option("-f", "--file", "file", help="A model definition in YAML (one model, or `models:` with a list).")
@click.option("--source", help="The model's GGUF file.")
@click.option("--min", "min_", type=int, default=1, show_default=True)
@click.option("--max", "max_", type=int)
@click.option("--cpu-cores", type=int, help="Cores one replica reserves (its --threads).")
@click.option("--memory-gb", type=float, help="Host memory one replica reserves.")
@click.option("--engine", default="llamacpp", show_default=True, type=click.Choice(M.ENGINES))
@click.option("--ctx-size", type=int, help="Context (KV cache tokens) one replica holds.")
@click.option("--alias", "aliases", multiple=True)
@click.option(
    "--external",
    metavar="URL",
    help="Served by an OpenAI-compatible API outside the cluster at this base URL (https://api.example.com/v1): "
    "nothing is placed; the routers send its requests there. Several providers: -f with `external:` as a list.",
)
@click.option(
    "--key-env",
    "key_env",
    multiple=True,
    metavar="VAR",
    help="The routers' environment variable holding the provider's API key (repeat for several keys, used in "
    "turn). The key itself never goes into the catalog.",
)
@click.option("--upstream-model", help="The model's name at the provider (default: NAME).")
@click.option("--price-in", type=float, help="The provider's price per million prompt tokens (USD).")
@click.option("--price-out", type=float, help="The provider's price per million generated tokens (USD).")
@click.option("--fallback", "fallbacks", multiple=True, help="A model tried when this one cannot answer.")
@click.pass_context
def model_add(
    ctx: click.Context,
    name: str | None,
    file: str | None,
    source: str | None,
    min_: int,
    max_: int | None,
    cpu_cores: int | None,
    memory_gb: float | None,
    engine: str,
    ctx_size: int | None,
    aliases: tuple[str, ...],
    external: str | None,
    key_env: tuple[str, ...],
    upstream_model: str | None,
    price_in: float | None,
    price_out: float | None,
    fallbacks: tuple[str, ...],
) -> None:
    """Add a model: `-f model.yaml`, or NAME --source PATH [--min N] [--cpu-cores N] [--memory-gb N], or
    NAME --external URL --key-env VAR [--price-in X --price-out Y] (served outside the cluster)."""
    if file:
        specs = load_model_file(file)
    elif external or key_env:
        if not name or not external or not key_env or source:
            raise click.UsageError("an external model is NAME --external URL --key-env VAR (and no --source)")
        provider = M.ExternalProvider(
            url=external,
            key_env=list(key_env),
            model=upstream_model,
            input_usd_per_m=price_in,
            output_usd_per_m=price_out,
        )
        specs = [M.ModelSpec(name=name, aliases=list(aliases), fallbacks=list(fallbacks), external=[provider])]
    else:
        if not name or not source:
            raise click.UsageError("give NAME and --source PATH, or -f model.yaml")
        local = Path(source).expanduser()
        source_path = str(local.resolve()) if local.exists() else source
        if memory_gb is None and engine == "llamacpp":
            memory_gb = _estimated_memory_gb(local, ctx_size)
        profile = M.Profile(engine=engine, cpu_cores=cpu_cores, min_memory_gb=memory_gb, ctx_size=ctx_size)
        specs = [
            M.ModelSpec(
                name=name,
                source=source_path,
                aliases=list(aliases),
                fallbacks=list(fallbacks),
                scaling=M.Scaling(min=min_, max=max_),
                profiles=[profile],
            )
        ]

    for spec in specs:  # checked here too: a key pasted as --key-env must never reach the bus
        for i, p in enumerate(spec.external, 1):
            if (why := M.provider_problem(p)) is not None:
                raise click.BadParameter(f"model {spec.name}, provider #{i}: {why}")

    async def go(s: Session) -> None:
        for spec in specs:
            out = await s.command(M.SERVICE, "add", M.AddModel(spec=spec))
            click.echo(out.message)

    run(ctx, go)


def _estimated_memory_gb(path: Path, ctx_size: int | None) -> float | None:
    """What one replica of a local GGUF reserves when --memory-gb is not given: the sizing rule of
    `ctl model serve` over its header (weights + KV cache for its context + the engine). None, said
    on stderr, when the file is not here to read (a path on the nodes): the catalog then asks for it."""
    if not path.is_file():
        click.echo(
            f"note: {path} is not on this machine, so it cannot be sized here: give --memory-gb",
            err=True,
        )
        return None
    try:
        header = read_header_file(path)
        est = estimate_memory(header, path.stat().st_size, ctx_size or J.DEFAULT_CTX_POOL)
    except (OSError, ValueError) as exc:
        click.echo(f"note: could not size {path} ({exc}): give --memory-gb", err=True)
        return None
    click.echo(f"each replica reserves {est.total_gb:.2f} GB ({est.explanation}); --memory-gb sets it", err=True)
    return est.total_gb


def _simple(verb: str, payload_of: Any, help_: str) -> None:
    @model.command(verb, help=help_)
    @click.argument("name")
    @click.pass_context
    def cmd(ctx: click.Context, name: str) -> None:
        async def go(s: Session) -> None:
            out = await s.command(M.SERVICE, verb, payload_of(name))
            click.echo(out.message)

        run(ctx, go)


_simple("stop", lambda n: M.StopModel(name=n), "Stop a model: it keeps its definition and files, and runs nothing.")
_simple("start", lambda n: M.StartModel(name=n), "Start a stopped model with its saved scaling.")


PURGE_START_WAIT_S = 30.0  # how long the CLI waits for the mirror service to take a purge on


def _ref(source: str | None) -> str | None:
    try:
        return M.mirror_ref(source or "")
    except ValueError:
        return None


async def _sources_in_use(s: Session) -> dict[str, str]:
    """Model name -> the mirror file (MODEL/VERSION/FILE) its source names, for every model in the catalog."""
    rows = (await s.api("GET", "/api/v1/models"))["models"]
    return {m["name"]: ref for m in rows if (ref := _ref(m.get("source")))}


async def _ask_agent(s: Session, node: str, req: WeightsRequest) -> WeightsReply | None:
    store = await s.store()
    import nats.errors  # loaded with the store

    try:
        msg = await store.nc.request(weights_subject(node), msgspec.json.encode(req), timeout=10)
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
        return None
    return msgspec.json.decode(msg.data, type=WeightsReply)


async def _node_ids(s: Session) -> list[str]:
    return [n["id"] for n in (await s.api("GET", "/api/v1/nodes"))["nodes"]]


def purge_line(p: msgspec.Struct) -> str | None:
    """How `model remove --purge` shows one of the model's purge events; None for other events."""
    match p:
        case M.PurgeStarted():
            lines = [f"purge: {len(p.mirror)} mirror file(s), the nodes' copies of {', '.join(p.nodes) or 'nothing'}"]
            lines += [f"kept {f}: {why}" for f, why in sorted(p.kept.items())]
            if p.waiting_for:
                lines.append(f"waiting for {len(p.waiting_for)} replica(s) to stop: {', '.join(p.waiting_for)}")
            return "\n".join(lines)
        case M.PurgeFileRemoved():
            return f"removed {p.file} from {'the mirror' if p.where == 'mirror' else 'node ' + p.where}"
        case M.PurgeFinished():
            lines = [p.note] if p.note else []
            lines += [
                f"node {n}: did not answer; `llmgw ctl weights --collect` removes its copy later" for n in p.unreached
            ]
            lines.append(f"purge finished: {p.removed} file(s) removed")
            return "\n".join(lines)
        case M.PurgeFailed():
            return f"purge failed: {p.reason}"
    return None


async def follow_purge(store: EventStore, name: str, after: int, start_wait_s: float = PURGE_START_WAIT_S) -> int:
    """Print the purge of ``name`` that follows its removal (the removal is after sequence ``after``), each
    file as it goes, until it finishes; its exit code. Stopping here does not stop the purge."""
    subject = event_subject(M.AGGREGATE, name)
    stream = store.subscribe(subject, after=after).__aiter__()
    removed, started = False, False
    loop = asyncio.get_running_loop()
    end = loop.time() + start_wait_s
    while True:
        try:
            batch = await (asyncio.wait_for(anext(stream), end - loop.time()) if not started else anext(stream))
        except (TimeoutError, StopAsyncIteration):
            click.echo(
                f"the mirror service has not taken up the purge of {name} yet; it is recorded, and the mirror "
                "carries it out when it runs (follow it with `llmgw events tail`)"
            )
            return 0
        for e in batch:
            if not isinstance(e, RecordedEvent):
                continue
            p = e.payload
            if isinstance(p, M.ModelRemoved):
                removed = p.purge
                continue
            if not removed or (line := purge_line(p)) is None:
                continue
            started = True
            click.echo(line, err=isinstance(p, M.PurgeFailed))
            if isinstance(p, M.PurgeFinished):
                return 0
            if isinstance(p, M.PurgeFailed):
                return 1


@model.command("remove")
@click.argument("name")
@click.option(
    "--purge", is_flag=True, help="Also delete its mirror files and the nodes' copies (files others use stay)."
)
@click.pass_context
def model_remove(ctx: click.Context, name: str, purge: bool) -> None:
    """Remove a model from the catalog; its replicas stop. --purge: the mirror service deletes its files
    once they stopped, and this follows it (stopping here does not stop the purge)."""

    async def go(s: Session) -> int:
        store = await s.store()
        before = await store.last_seq(event_subject(M.AGGREGATE, name)) if purge else 0
        out = await s.command(M.SERVICE, "remove", M.RemoveModel(name=name, purge=purge))
        click.echo(out.message)
        if not purge:
            return 0
        return await follow_purge(store, name, before)

    run(ctx, go)


@ctl.command("weights")
@click.option("--collect", is_flag=True, help="Delete, on every node, cached files no model in the catalog uses.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def weights(ctx: click.Context, collect: bool, as_json: bool) -> None:
    """What each node holds: its weights cache and model directories (latest heartbeat); --collect removes
    cached files no model uses (never files in model directories)."""

    async def go(s: Session) -> int:
        nodes = await _node_ids(s)
        rows: list[dict[str, Any]] = []
        if collect:
            keep = sorted(set((await _sources_in_use(s)).values()))
            for node in nodes:
                reply = await _ask_agent(s, node, WeightsRequest(action="collect", keep=keep))
                if reply is None:
                    rows.append({"node": node, "weights": None, "removed": [], "error": "did not answer"})
                else:
                    rows.append({"node": node, "weights": reply.held, "removed": reply.removed, "error": reply.error})
        else:
            for node in nodes:
                hb = (await s.api("GET", f"/api/v1/nodes/{node}")).get("heartbeat") or {}
                rows.append({"node": node, "weights": hb.get("weights"), "removed": [], "error": ""})
        if as_json:
            click.echo(json.dumps(rows, indent=2))
            return 0
        if not rows:
            click.echo("no nodes yet: start an agent (`llmgw agent --nats URL --node-id ID`)")
            return 0
        for r in rows:
            if r["error"]:
                click.echo(f"{r['node']}: {r['error']}")
                continue
            if collect:
                click.echo(f"{r['node']}: removed {', '.join(r['removed']) or 'nothing'}")
            held = r["weights"]
            if held is None:
                click.echo(f"{r['node']}: no heartbeat yet")
            else:
                click.echo(f"{r['node']}: holds {', '.join(held) or 'nothing'}")
        return 0

    run(ctx, go)


@model.command("scale")
@click.argument("name")
@click.option("--min", "min_", type=int, required=True)
@click.option("--max", "max_", type=int)
@click.pass_context
def model_scale(ctx: click.Context, name: str, min_: int, max_: int | None) -> None:
    """Set how many replicas a model runs (max follows min when left out)."""

    async def go(s: Session) -> None:
        out = await s.command(M.SERVICE, "scale", M.ScaleModel(name=name, min=min_, max=max_))
        click.echo(out.message)

    run(ctx, go)


@model.command("resources")
@click.argument("name")
@click.option("--memory", "memory_gb", type=float, help="Host memory (GB) one replica reserves.")
@click.option("--cores", type=int, help="Cores one replica reserves.")
@click.pass_context
def model_resources(ctx: click.Context, name: str, memory_gb: float | None, cores: int | None) -> None:
    """Change what one replica reserves; running replicas show `stale profile` until restarted."""

    async def go(s: Session) -> None:
        out = await s.command(M.SERVICE, "resources", M.SetResources(name=name, memory_gb=memory_gb, cores=cores))
        click.echo(out.message)

    run(ctx, go)


@model.command("class")
@click.argument("name")
@click.argument("capacity_class", metavar="CLASS", type=click.Choice([*M.CLASSES, "default"]))
@click.pass_context
def model_class(ctx: click.Context, name: str, capacity_class: str) -> None:
    """Set NAME's capacity class: critical, standard, opportunistic, or default (CAT-4)."""

    async def go(s: Session) -> None:
        out = await s.command(M.SERVICE, "class", M.SetClass(name=name, capacity_class=capacity_class))
        click.echo(out.message)

    run(ctx, go)


@model.command("slo")
@click.argument("name")
@click.option("--ttft-p95", "ttft_p95_s", type=float, help="Time to first token, 95th percentile, in seconds.")
@click.option("--tokens-per-sec", "tokens_per_s", type=float, help="Generation speed each request should see.")
@click.option("--none", "no_slo", is_flag=True, help="No SLO.")
@click.pass_context
def model_slo(
    ctx: click.Context, name: str, ttft_p95_s: float | None, tokens_per_s: float | None, no_slo: bool
) -> None:
    """Set what each request of NAME should get (CAT-1): a measurement finds how many concurrent
    requests one replica serves within it, and autoscaling follows that (SCHED-9, SCHED-10)."""
    if no_slo == (ttft_p95_s is not None or tokens_per_s is not None):
        raise click.UsageError("give --ttft-p95 S and/or --tokens-per-sec N, or --none")

    async def go(s: Session) -> None:
        out = await s.command(M.SERVICE, "slo", M.SetSlo(name=name, ttft_p95_s=ttft_p95_s, tokens_per_s=tokens_per_s))
        click.echo(out.message)

    run(ctx, go)


@model.command("owner")
@click.argument("name")
@click.argument("scope", required=False)
@click.option("--none", "no_owner", is_flag=True, help="No owner: the model counts against no quota.")
@click.pass_context
def model_owner(ctx: click.Context, name: str, scope: str | None, no_owner: bool) -> None:
    """Set the scope whose capacity quota NAME's replicas count against (acme, acme/ml, team:acme/ml…)."""
    if (scope is None) == (not no_owner):
        raise click.UsageError("give a SCOPE (e.g. team:acme/ml), or --none")

    async def go(s: Session) -> None:
        out = await s.command(M.SERVICE, "owner", M.SetOwner(name=name, owner=scope))
        click.echo(out.message)

    run(ctx, go)


@ctl.command("retry")
@click.argument("name")
@click.pass_context
def retry(ctx: click.Context, name: str) -> None:
    """Place a parked model again (after fixing what made its starts fail)."""

    async def go(s: Session) -> None:
        out = await s.command(M.SERVICE, "retry", M.RetryModel(name=name))
        click.echo(out.message)

    run(ctx, go)


@ctl.command("restart")
@click.argument("replica_ids", metavar="[REPLICA]...", nargs=-1)
@click.option("--model", help="Every running replica of this model.")
@click.option("--all", "every", is_flag=True, help="Every running replica.")
@click.option("--reason", default="", help="Why, for the log.")
@click.pass_context
def restart(ctx: click.Context, replica_ids: tuple[str, ...], model: str | None, every: bool, reason: str) -> None:
    """Restart replicas with surge: each gets a new copy first, then stops once that one is ready (one at a
    time per model; where no second copy fits, the old one stops first and the model is short meanwhile)."""
    if sum((bool(replica_ids), model is not None, every)) != 1:
        raise click.UsageError("name the replicas, or give --model MODEL, or --all")

    async def go(s: Session) -> None:
        ids = list(replica_ids) or await _running_replicas(s, model)
        for rid in ids:
            out = await s.command(N.SERVICE, "restart", R.RestartReplica(replica_id=rid, reason=reason))
            click.echo(out.message)

    run(ctx, go)


async def _running_replicas(s: Session, model: str | None) -> list[str]:
    """The running replicas of ``model`` (of every model: None); refused, naming what exists, when there are none."""
    rows = (await s.api("GET", "/api/v1/replicas", params={"model": model or "", "all": ""}))["replicas"]
    ids = [r["id"] for r in rows if r["state"] in R.ACTIVE]
    if ids:
        return ids
    if model is None:
        raise CommandRejectedError("no replica is running: nothing to restart", "not_found")
    names = sorted(m["name"] for m in (await s.api("GET", "/api/v1/models"))["models"])
    if model not in names:
        raise CommandRejectedError(
            f"there is no model {model!r} (models: {', '.join(names) or 'none'}): `llmgw ctl models` lists them",
            "not_found",
        )
    raise CommandRejectedError(f"model {model} has no running replica: nothing to restart", "not_found")


def _node_command(verb: str, help_: str) -> None:
    @ctl.command(verb, help=help_)
    @click.argument("node")
    @click.option("--reason", default="", help="Why (cordon only).")
    @click.option("--grace", type=float, default=300.0, show_default=True, help="Seconds to drain (drain only).")
    @click.pass_context
    def cmd(ctx: click.Context, node: str, reason: str, grace: float) -> None:
        payload = {
            "cordon": lambda: N.CordonNode(node_id=node, reason=reason),
            "uncordon": lambda: N.UncordonNode(node_id=node),
            "drain": lambda: N.DrainNode(node_id=node, grace_s=grace),
        }[verb]()

        async def go(s: Session) -> None:
            out = await s.command(N.SERVICE, verb, payload)
            click.echo(out.message)

        run(ctx, go)


_node_command("cordon", "Place no new replicas on NODE.")
_node_command("uncordon", "Let NODE take new replicas again.")
_node_command("drain", "Move NODE's replicas elsewhere (replacement first), then stop them.")


def _gb(n: int | None) -> str:
    return "?" if n is None else f"{n / 1024**3:.1f}G"


@ctl.command("nodes")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def nodes(ctx: click.Context, as_json: bool) -> None:
    """Nodes, their capacity and state."""

    async def go(s: Session) -> None:
        rows = (await s.api("GET", "/api/v1/nodes"))["nodes"]
        if as_json:
            click.echo(json.dumps(rows, indent=2))
            return
        if not rows:
            click.echo("no nodes yet: start an agent (`llmgw agent --nats URL --node-id ID`)")
            return
        lines = table(
            ["NODE", "STATE", "CPUS", "MEMORY", "AVAIL", "GPUS", "REPLICAS", "ENGINES"],
            [
                [
                    n["id"],
                    n["state"] + (" draining" if n["draining"] else " cordoned" if n["cordoned"] else ""),
                    n["cpus"] or "?",
                    _gb(n["memory_total_bytes"]),
                    _gb(n["memory_available_bytes"]),
                    len(n["gpus"]),
                    n["replicas"],
                    ",".join(n["engines"]),
                ]
                for n in rows
            ],
            right={2, 3, 4, 5, 6},
        )
        for line in lines:
            click.echo(line)

    run(ctx, go)


@ctl.command("node")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def node(ctx: click.Context, name: str, as_json: bool) -> None:
    """One node: capacity, labels, sensors, replicas."""

    async def go(s: Session) -> None:
        n = await s.api("GET", f"/api/v1/nodes/{name}")
        if as_json:
            click.echo(json.dumps(n, indent=2))
            return
        hb = n.get("heartbeat") or {}
        click.echo(
            f"node        {n['id']} ({n['state']}{', cordoned: ' + n['cordon_reason'] if n['cordoned'] else ''})"
        )
        click.echo(f"address     {n['address']}   agent {n['agent_version']}")
        click.echo(
            f"cpus        {n['cpus'] or '?'}   memory {_gb(n['memory_total_bytes'])} "
            f"(available {_gb(hb.get('memory_available_bytes'))})"
        )
        click.echo(f"engines     {', '.join(n['engines']) or 'none'}")
        click.echo(f"labels      {', '.join(f'{k}={v}' for k, v in n['labels'].items()) or 'none'}")
        for g in n["gpus"]:
            click.echo(f"gpu {g['index']}       {g['name']} {g['memory_total_mb']} MB")
        for k, v in sorted((hb.get("sensors") or {}).items()):
            click.echo(f"sensor      {k} = {v:.1f}")
        for r in n["replicas"]:
            click.echo(f"replica     {r['id']} {r['model']} {r['state']} port {r['port'] or '-'}")

    run(ctx, go)


@ctl.command("models")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def models(ctx: click.Context, as_json: bool) -> None:
    """Models: ready of desired, starting, where, and why not when not serving."""

    async def go(s: Session) -> None:
        rows = (await s.api("GET", "/api/v1/models"))["models"]
        if as_json:
            click.echo(json.dumps(rows, indent=2))
            return
        if not rows:
            click.echo("no models yet: `llmgw ctl model add NAME --source FILE --memory-gb N`")
            return
        lines = table(
            ["MODEL", "READY", "STARTING", "NODES", "CLASS", "OWNER", "MEASURED", "STATUS"],
            [
                [
                    m["name"],
                    "external" if m.get("external") else f"{m['ready']}/{m['min_replicas']}",
                    m["starting"],
                    ",".join(m["nodes"]),
                    m.get("capacity_class") or "default",
                    m.get("owner") or "-",
                    _measured_cell(m.get("measured") or []),
                    m["status"],
                ]
                for m in rows
            ],
            right={1, 2},
        )
        for line in lines:
            click.echo(line)

    run(ctx, go)


def _measured_cell(measured: list[dict[str, Any]]) -> str:
    """The newest measurement that counts (SCHED-10): "4 req, 120 tok/s" per replica; "-" without one."""
    usable = [x for x in measured if not x.get("stale")]
    if not usable:
        return "stale (SLO changed)" if measured else "-"
    x = usable[-1]
    return f"{x['concurrency']} req, {x['tokens_per_s']:.0f} tok/s"


@ctl.command("replicas")
@click.option("--model", help="Only this model's replicas.")
@click.option("--all", "show_all", is_flag=True, help="Stopped and failed ones too.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def replicas(ctx: click.Context, model: str | None, show_all: bool, as_json: bool) -> None:
    """Replicas and their lifecycle state."""

    async def go(s: Session) -> None:
        params = {"model": model or "", "all": "1" if show_all else ""}
        rows = (await s.api("GET", "/api/v1/replicas", params=params))["replicas"]
        if as_json:
            click.echo(json.dumps(rows, indent=2))
            return
        lines = table(
            ["REPLICA", "MODEL", "NODE", "STATE", "PORT", "REASON"],
            [
                [
                    r["id"],
                    r["model"],
                    r["node_id"],
                    r["state"]
                    + (" (stale profile)" if r["stale"] else "")
                    + (f" (restart {r['restart']})" if r.get("restart") and r["state"] in R.ACTIVE else ""),
                    r["port"],
                    r["reason"] or "",
                ]
                for r in rows
            ],
            right={4},
        )
        for line in lines:
            click.echo(line)

    run(ctx, go)


@ctl.command("explain")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def explain(ctx: click.Context, name: str, as_json: bool) -> None:
    """Why MODEL runs where it does, or node by node what each lacks."""

    async def go(s: Session) -> int:
        body = await ask_scheduler(s, SCH.EXPLAIN_SUBJECT, name)
        if as_json:
            click.echo(json.dumps(body, indent=2))
            return 0
        click.echo(f"model {name}: min {body['min']}, max {body['max']}; {body['summary']}")
        if body.get("owner"):
            click.echo(f"owner {body['owner']}, class {body.get('capacity_class', 'default')}")
        if body.get("owner_note"):
            click.echo(f"note: {body['owner_note']}")
        if (auto := body.get("autoscaling")) is not None:  # SCHED-9
            load = auto["load"]
            now = (
                "no engine has said its load yet"
                if load is None
                else f"{load['waiting']} waiting, {load['running']} running on {load['ready']} ready"
            )
            click.echo(f"autoscaling: {auto['added']} replica(s) added by load; now {now}")
        tried = body.get("profiles") or []
        for t in tried[:-1]:  # preferred profiles that fit nowhere now
            click.echo(f"profile {t['profile']} ({t['engine']}) fits no node now")
        if body.get("needs"):
            nd = body["needs"]
            cores = nd["cores"] if isinstance(nd["cores"], str) else f"{nd['cores']} cores"
            click.echo(
                f"one replica ({'profile ' + nd['profile'] + ', ' if len(tried) > 1 else ''}{nd['engine']}) needs: "
                f"{cores}, {nd['memory_gb']} GB memory, "
                f"{nd['gpus']} GPUs" + (f", labels {nd['node_selector']}" if nd["node_selector"] else "")
            )
        if body.get("last_error"):
            click.echo(f"last error: {body['last_error']} ({body['failures']} failed starts in a row)")
        for r in body["replicas"]:
            click.echo(f"  replica {r['id']} on {r['node']}: {r['state']}")
        for n in body["nodes"]:
            verdict = "fits" if n["fits"] else "; ".join(n["lacks"])
            click.echo(f"  {n['node']:<20} {verdict}")
        return 0

    run(ctx, go)


@ctl.command("logs")
@click.argument("node")
@click.option("--replica", help="An engine's log instead of the agent's.")
@click.option("--lines", "-n", default=100, show_default=True)
@click.pass_context
def logs(ctx: click.Context, node: str, replica: str | None, lines: int) -> None:
    """The recent log lines of NODE's agent, or of one of its engines."""

    async def go(s: Session) -> None:
        store = await s.store()
        import nats.errors  # loaded with the store

        req = msgspec.json.encode(LogsRequest(replica=replica, lines=lines))
        try:
            msg = await store.nc.request(logs_subject(node), req, timeout=5)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as exc:
            raise Unreachable(f"node {node}'s agent did not answer: is it running and connected?") from exc
        reply = msgspec.json.decode(msg.data, type=LogsReply)
        if reply.error:
            raise CommandRejectedError(reply.error, "not_found")
        for line in reply.lines:
            click.echo(line)

    run(ctx, go)


@model.command("headroom")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def model_headroom(ctx: click.Context, name: str, as_json: bool) -> None:
    """How many more replicas of NAME fit now, on which nodes, and why not more (SCHED-11)."""

    async def go(s: Session) -> None:
        body = await ask_scheduler(s, SCH.HEADROOM_SUBJECT, name)
        if as_json:
            click.echo(json.dumps(body, indent=2))
            return
        more = f"at least {body['more']}" if body["at_least"] else str(body["more"])
        click.echo(f"{name}: {body['current']} running; {more} more would fit now")
        for node, count in body["where"].items():
            click.echo(f"  {node:<20} {count}")
        if body.get("one_more"):
            click.echo(body["one_more"]["line"])
        if body["why_not_more"]:
            click.echo(f"not more: {body['why_not_more']}")
        for note in body["notes"]:
            click.echo(f"note: {note}")

    run(ctx, go)
