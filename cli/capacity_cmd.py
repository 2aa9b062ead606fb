"""`llmgw ctl bench MODEL` and `ctl model target MODEL` (SPEC SCHED-10, SCHED-11): measured capacity per replica.

The measuring and judging are :mod:`llmgw.bench.capacity`; here: pinning one replica, the gateway and
key to send with, the tables, and saving the answer as a signed catalog command (``model.measured``).
"""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click
import msgspec

from llmgw.bench import BenchError
from llmgw.bench import capacity as C
from llmgw.cli.client import Session, run
from llmgw.cli.context import default_data_dir, read_run_info
from llmgw.cli.ctl import ctl
from llmgw.cli.fleet_cmd import model
from llmgw.cli.from_services import DEMO_KEY_FILE
from llmgw.cli.scheduler_query import ask_scheduler
from llmgw.cli.table import table
from llmgw.events.commands.errors import CommandError, CommandRejectedError, Unreachable
from llmgw.events.schema import models as M
from llmgw.events.schema import scheduler as SCH

ONE_READY_WAIT_S = 300.0  # how long `--scale-to-one` waits for the model to stand at one ready replica
ACTIVE = ("placed", "starting", "ready")


async def _model_row(s: Session, name: str) -> dict[str, Any]:
    rows = (await s.api("GET", "/api/v1/models"))["models"]
    row = next((m for m in rows if m["name"] == name), None)
    if row is None:
        known = ", ".join(sorted(m["name"] for m in rows)) or "none"
        raise CommandRejectedError(f"there is no model {name!r} (models: {known})", "not_found")
    return row


async def _one_replica(s: Session, name: str, deadline: float) -> dict[str, Any]:
    """The model's only active replica once it is ready (waiting until ``deadline``, monotonic)."""
    while True:
        active = [r for r in (await ask_scheduler(s, SCH.EXPLAIN_SUBJECT, name))["replicas"] if r["state"] in ACTIVE]
        if len(active) == 1 and active[0]["state"] == "ready":
            return active[0]
        if time.monotonic() > deadline:
            states = ", ".join(f"{r['id']} {r['state']}" for r in active) or "none"
            raise CommandError(
                f"model {name} did not stand at one ready replica within {ONE_READY_WAIT_S:.0f} s (replicas: "
                f"{states}); see `llmgw ctl explain {name}`"
            )
        await asyncio.sleep(1.0)


def _gateway_and_key(ctx: click.Context, gateway: str | None, key: str | None) -> tuple[str, str]:
    """``--gateway``/``--key``, else what a running `llmgw up` in the data directory says (its demo key)."""
    data_dir = ctx.find_root().obj.get("data_dir") if ctx.find_root().obj else None
    where = Path(data_dir).expanduser() if data_dir else default_data_dir()
    info = read_run_info(where)
    gateway = gateway or (info.gateway_url if info else None)
    if not gateway:
        raise Unreachable("say which gateway to send through: --gateway URL (or LLMGW_GATEWAY_URL)")
    if not key and (where / DEMO_KEY_FILE).exists():
        key = (where / DEMO_KEY_FILE).read_text().strip()
    if not key:
        raise CommandRejectedError(
            "say which API key to send with: --key KEY (or LLMGW_API_KEY), a key of a project allowed the model "
            "(`llmgw ctl key create`)"
        )
    return gateway, key


@ctl.command("bench")
@click.argument("name")
@click.option("--replica", help="Measure this replica; refused unless it is the one the model runs on.")
@click.option("--max-concurrency", default=16, show_default=True, help="The most concurrent requests tried.")
@click.option("--requests-per-step", default=32, show_default=True, help="Requests per step (at least the step's).")
@click.option("--linear", is_flag=True, help="Rise one request at a time, not 1, 2, 4, ….")
@click.option("--max-tokens", default=64, show_default=True, help="Tokens each request asks for.")
@click.option(
    "--stop-at-eos",
    is_flag=True,
    help="Let answers end where the model ends them (default: ignore_eos, every answer --max-tokens long).",
)
@click.option(
    "--scale-to-one",
    is_flag=True,
    help="Hold the model at one replica (min 1, max 1) for the run, then give it back its min and max.",
)
@click.option("--gateway", envvar="LLMGW_GATEWAY_URL", help="The gateway to send through (default: `up`'s).")
@click.option("--key", envvar="LLMGW_API_KEY", help="The API key to send with (default: `up`'s demo key).")
@click.option("--save", is_flag=True, help="Save the result (model.measured): autoscaling and headroom follow it.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def bench(
    ctx: click.Context,
    name: str,
    replica: str | None,
    max_concurrency: int,
    requests_per_step: int,
    linear: bool,
    max_tokens: int,
    stop_at_eos: bool,
    scale_to_one: bool,
    gateway: str | None,
    key: str | None,
    save: bool,
    as_json: bool,
) -> None:
    """Measure how many concurrent requests one replica of NAME serves within its SLO (SCHED-10).

    Streaming requests go through the gateway, as users' do, at rising concurrency; each step's time to
    first token (p95), each request's speed and the total tokens/s are measured. The answer is the
    most concurrent requests within the model's SLO (`ctl model slo`), or without one the knee: where the
    total tokens/s stops rising by 10 %. The model must serve from one replica (max 1) so the load is
    that replica's: else give --scale-to-one. Other traffic on the model is measured with it."""
    if max_concurrency < 1 or requests_per_step < 1 or max_tokens < 2:
        raise click.UsageError("--max-concurrency and --requests-per-step must be at least 1, --max-tokens 2")

    def say(line: str) -> None:
        click.echo(line, err=as_json)

    async def go(s: Session) -> int:
        gateway_url, api_key = _gateway_and_key(ctx, gateway, key)
        row = await _model_row(s, name)
        if row["stopped"]:
            raise CommandRejectedError(f"model {name} is stopped: `llmgw ctl model start {name}` first", "stopped")
        if row.get("route") == "embedding":
            raise CommandRejectedError(
                f"model {name} is an embedding model: ctl bench measures generation (time to first token, tokens/s)",
                "invalid_route",
            )
        explained = await ask_scheduler(s, SCH.EXPLAIN_SUBJECT, name)
        active = [r for r in explained["replicas"] if r["state"] in ACTIVE]
        before = (row["min_replicas"], row["max_replicas"])
        held = len(active) != 1 or before[1] > 1
        if held and not scale_to_one:
            raise CommandRejectedError(
                f"model {name} runs {len(active)} replicas (min {before[0]}, max {before[1]}): the gateway would "
                "spread the load over more than one, and a measurement is of one replica. Give --scale-to-one to "
                f"hold it at one for the run (its min {before[0]} and max {before[1]} come back after)",
                "not_one_replica",
            )
        if held:
            say(f"holding {name} at one replica for the run (min {before[0]}, max {before[1]} come back after)")
            await s.command(M.SERVICE, "scale", M.ScaleModel(name=name, min=1, max=1))
        try:
            one = await _one_replica(s, name, time.monotonic() + ONE_READY_WAIT_S)
            if replica is not None and one["id"] != replica:
                raise CommandRejectedError(
                    f"replica {replica} is not the one {name} runs on ({one['id']} on {one['node']})", "not_found"
                )
            node = await s.api("GET", f"/api/v1/nodes/{one['node']}")
            shape = M.node_shape(node.get("cpus"), [g["name"] for g in node.get("gpus") or []])
            slo = msgspec.convert(row["slo"], M.Slo) if row.get("slo") else None
            say(
                f"measuring {name}: replica {one['id']} (profile {one.get('profile', '?')}) on {one['node']} "
                f"({shape.words()}), through {gateway_url}; "
                + (f"against its SLO ({_slo_words(slo)})" if slo else "no SLO: looking for the knee")
            )
            headers_said = False

            def on_step(step: C.Step) -> None:
                nonlocal headers_said
                lines = table(C.STEP_HEADERS, C.step_rows([step]), right={0, 1, 2, 3, 4, 5})
                if not headers_said:
                    say(lines[0])
                    headers_said = True
                say(lines[1] + (f"   {step.why}" if step.why else ""))

            target = C.Target(
                gateway=gateway_url,
                key=api_key,
                model=name,
                route=row.get("route", "chat"),
                max_tokens=max_tokens,
                ignore_eos=not stop_at_eos,
            )
            try:
                steps, verdict, sent = await C.run_bench(
                    target,
                    slo=slo,
                    max_concurrency=max_concurrency,
                    requests_per_step=requests_per_step,
                    linear=linear,
                    on_step=on_step,
                )
            except BenchError as exc:
                raise CommandError(str(exc)) from exc
        finally:
            if held:
                await s.command(M.SERVICE, "scale", M.ScaleModel(name=name, min=before[0], max=before[1]))
                say(f"{name} is back at min {before[0]}, max {before[1]}")
        best = verdict.best
        result = C.Result(
            model=name,
            replica=one["id"],
            node=one["node"],
            profile=one.get("profile") or "default",
            shape=shape,
            slo=slo,
            basis="slo" if slo is not None else "knee",
            steps=steps,
            concurrency=best.concurrency if best else 0,
            tokens_per_s=best.tokens_per_s if best else 0.0,
            ttft_p95_s=(best.ttft_p95_s or 0.0) if best else 0.0,
            request_tokens_per_s=(best.request_tokens_per_s or 0.0) if best else 0.0,
            requests=sent,
            at=time.time(),
            note=verdict.note,
        )
        saved = None
        if save:
            if result.concurrency < 1:
                raise CommandRejectedError(
                    f"nothing to save: {C.result_line(result)}; loosen it with `llmgw ctl model slo {name}`",
                    "invalid_measurement",
                )
            out = await s.command(M.SERVICE, "measured", M.SaveMeasurement(name=name, measured=result.measured()))
            saved = out.message
        if as_json:
            click.echo(json.dumps({**msgspec.to_builtins(result), "saved": saved is not None}, indent=2))
            return 0
        click.echo(C.result_line(result))
        if result.note:
            click.echo(f"steps: {result.note}")
        click.echo(C.LEGEND)
        click.echo(f"saved: {saved}" if saved else "not saved: --save records it for autoscaling and headroom")
        return 0

    run(ctx, go)


def _slo_words(slo: M.Slo) -> str:
    parts = [
        f"time to first token p95 {slo.ttft_p95_s:g} s" if slo.ttft_p95_s is not None else "",
        f"{slo.tokens_per_s:g} tokens/s per request" if slo.tokens_per_s is not None else "",
    ]
    return ", ".join(p for p in parts if p)


@model.command("target")
@click.argument("name")
@click.option("--tokens-per-sec", "tokens_per_s", type=float, required=True, help="The tokens/s NAME must serve.")
@click.option("--apply", is_flag=True, help="Scale NAME's min to that many replicas (its max at least as high).")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def model_target(ctx: click.Context, name: str, tokens_per_s: float, apply: bool, as_json: bool) -> None:
    """How many replicas of NAME serve --tokens-per-sec N, by its saved measurement (`ctl bench --save`)."""
    if not tokens_per_s > 0:
        raise click.UsageError("--tokens-per-sec must be above 0")

    async def go(s: Session) -> int:
        one = (await ask_scheduler(s, SCH.HEADROOM_SUBJECT, name)).get("one_more")
        if not one:
            raise CommandRejectedError(
                f"model {name} has no measurement that counts (none saved, or taken against another SLO): "
                f"`llmgw ctl bench {name} --save` first",
                "not_measured",
            )
        try:
            n = C.replicas_for(tokens_per_s, one["tokens_per_s"])
        except ValueError as exc:
            raise CommandRejectedError(f"model {name}: {exc}", "invalid_measurement") from exc
        row = await _model_row(s, name)
        when = datetime.fromtimestamp(one["measured_at"], UTC).strftime("%Y-%m-%d %H:%M UTC")
        line = (
            f"{tokens_per_s:g} tokens/s needs {n} {'replica' if n == 1 else 'replicas'} of {name}: one serves "
            f"~{one['tokens_per_s']:.0f} tokens/s (~{one['concurrency']} concurrent) by the measurement of {when}; "
            f"it holds min {row['min_replicas']}, max {row['max_replicas']} now"
        )
        applied = None
        if apply:
            hi = max(n, row["max_replicas"] or 0)
            applied = (await s.command(M.SERVICE, "scale", M.ScaleModel(name=name, min=n, max=hi))).message
        if as_json:
            body = {
                "model": name,
                "tokens_per_s": tokens_per_s,
                "replicas": n,
                "per_replica_tokens_per_s": one["tokens_per_s"],
                "per_replica_concurrency": one["concurrency"],
                "measured_at": one["measured_at"],
                "min": row["min_replicas"],
                "max": row["max_replicas"],
                "applied": applied,
            }
            click.echo(json.dumps(body, indent=2))
            return 0
        click.echo(line)
        click.echo(applied or f"`--apply` scales its min to {n}")
        return 0

    run(ctx, go)
