"""Prefix-aware routing on a "B2B" workload: llmgw's routing against round-robin and random, one run.

    .venv/bin/python -m tests.bench.b2b [--runs 3] [--tenants 8] [--users 4] [--seconds 60]
                                        [--rate-from 0.5] [--rate-to 2.5] [--cache-mib 24]

The workload is llm-d's B2B benchmark scaled to this machine: ``--tenants`` tenants, each with a long
shared prefix (a system prompt and a document of ``--prefix-words`` words of the tiny model's
vocabulary, about 3.5 tokens a word: some 500 tokens) and ``--users`` users asking short questions of it; requests
arrive as a Poisson process whose rate ramps linearly from ``--rate-from`` to ``--rate-to`` a second
over ``--seconds``, open loop (a slow answer does not slow the arrivals), each streamed with
``max_tokens`` ``--max-tokens``.

Starts a durable nats-server, the services and the gateway in this process and one agent as a process
serving three replicas of a random-weight llama GGUF (``--width`` × ``--layers``, big enough that a
prefix's prefill costs measurable time on a CPU) under llama.cpp (xllamacpp), two slots each, with
llama.cpp's prompt cache on: each slot keeps its last prompt's KV state, and ``--cache-ram`` MiB of
host memory keep earlier ones (``--cache-mib``; at the default, with the slots, about four tenants'
prefixes a replica: fewer than all tenants, more than a third of them — what a GPU's KV cache is to
llm-d's workload).

Each run sends the same arrivals (times, tenants, users, questions) once under each policy, the
router's ``routing_policy`` set between them — ``llmgw`` (least load with prefix affinity, what the
gateway does), ``round_robin`` and ``random`` — in an order rotated every run, so the machine's drift
falls on all three alike. Each policy's rounds get documents of their own (same lengths, new words),
so no round finds another's prefixes in a cache. It prints, by policy, the time to the first token
(p50 and p90), output tokens per second over the round (first request sent to last answer), the
share of prompt tokens llama.cpp served from its cache (``timings.cache_n`` over the prompt), the
requests whose prefix was prefilled again (under half the prompt from a cache; a tenant's first
request in a round is one under any policy), errors, and the ratios against llmgw. Figures only:
nothing passes or fails.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from llmgw.cli import logs
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import models as M
from llmgw.events.schema.catalog import default_registry
from llmgw.services.router.config import RouterConfig
from llmgw.services.router.routing import POLICIES
from tests.fleet import Fleet
from tests.gguf_tiny import _WORDS, write_tiny_gguf
from tests.support import nats_server, wait_until
from tests.test_gateway import GATEWAY, make_key, make_tenant

MODEL = "b2b"
REPLICAS = 3
SLOTS = 2
WORDS = [w for w in _WORDS if len(w) > 1]


class Workload(msgspec.Struct, frozen=True, kw_only=True):
    tenants: int = 8
    users: int = 4  # per tenant
    prefix_words: int = 140  # the document: about 500 tokens of the tiny model's vocabulary
    question_words: int = 12
    max_tokens: int = 16
    seconds: float = 60.0
    rate_from: float = 0.5  # requests a second at the start of a round ...
    rate_to: float = 2.5  # ... and at its end
    seed: int = 0


class Planned(msgspec.Struct, frozen=True, kw_only=True):
    at: float  # seconds after the round starts
    tenant: int
    user: int
    question: str


class Result(msgspec.Struct, kw_only=True):
    tenant: int
    sent: float  # perf_counter
    ttft: float = math.nan  # seconds to the first streamed chunk
    done: float = math.nan  # perf_counter at the last byte
    tokens: int = 0  # completion tokens (the engine's usage)
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, served from llama.cpp's cache (timings.cache_n)
    error: str = ""


# -- the workload (pure) ---------------------------------------------------------------------------


def arrivals(w: Workload, rng: random.Random) -> list[float]:
    """Arrival times of a Poisson process whose rate ramps linearly from ``rate_from`` to ``rate_to``
    over ``seconds`` (thinning: candidates at the peak rate, each kept with the rate then over the peak)."""
    peak = max(w.rate_from, w.rate_to)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= w.seconds:
            return out
        rate = w.rate_from + (w.rate_to - w.rate_from) * t / w.seconds
        if rng.random() * peak < rate:
            out.append(t)


def plan(w: Workload, run: int) -> list[Planned]:
    """One run's requests, the same for every policy: when each arrives, whose it is, what it asks."""
    rng = random.Random(f"{w.seed}/{run}")
    return [
        Planned(
            at=at,
            tenant=rng.randrange(w.tenants),
            user=rng.randrange(w.users),
            question=" ".join(rng.choice(WORDS) for _ in range(w.question_words)),
        )
        for at in arrivals(w, rng)
    ]


def documents(w: Workload, run: int, policy: str) -> list[str]:
    """Each tenant's shared prefix for one policy's round: a system prompt and a document, words of its own."""
    rng = random.Random(f"{w.seed}/{run}/{policy}")
    return [
        f"You are the assistant of tenant {t} (run {run}, {policy}). Answer from this document only.\n"
        + " ".join(rng.choice(WORDS) for _ in range(w.prefix_words))
        for t in range(w.tenants)
    ]


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


class Summary(msgspec.Struct, frozen=True, kw_only=True):
    requests: int
    errors: int
    ttft_p50_ms: float
    ttft_p90_ms: float
    tokens_per_s: float
    cached_share: float  # of all prompt tokens answered, served from a cache
    misses: int  # requests that found under half their prompt in a cache: their prefix was prefilled again
    first_sight: int  # of those, a tenant's first request on any replica (no policy avoids these)
    prompt_tokens: float  # mean per request


def summarize(rounds: list[list[Result]]) -> Summary:
    """A policy's figures over its rounds: TTFT percentiles over every answered request, tokens/s summed
    over the rounds' spans (first request sent to last answer)."""
    answered = [r for rs in rounds for r in rs if not r.error]
    tokens = sum(r.tokens for r in answered)
    span = sum(
        max(r.done for r in rs if not r.error) - min(r.sent for r in rs)
        for rs in rounds
        if any(not r.error for r in rs)
    )
    prompt = sum(r.prompt_tokens for r in answered)
    missed = [r for r in answered if r.cached_tokens * 2 < r.prompt_tokens]
    seen: set[tuple[int, int]] = set()
    first = 0
    for i, rs in enumerate(rounds):
        for r in sorted((r for r in rs if not r.error), key=lambda r: r.sent):
            if (i, r.tenant) not in seen:
                seen.add((i, r.tenant))
                first += r.cached_tokens * 2 < r.prompt_tokens
    return Summary(
        requests=sum(len(rs) for rs in rounds),
        errors=sum(1 for rs in rounds for r in rs if r.error),
        ttft_p50_ms=1000 * pct([r.ttft for r in answered], 0.5),
        ttft_p90_ms=1000 * pct([r.ttft for r in answered], 0.9),
        tokens_per_s=tokens / span if span else math.nan,
        cached_share=sum(r.cached_tokens for r in answered) / prompt if prompt else math.nan,
        prompt_tokens=prompt / len(answered) if answered else math.nan,
        misses=len(missed),
        first_sight=first,
    )


def table(summaries: dict[str, Summary]) -> str:
    """The figures by policy, then each baseline's ratio to llmgw's."""
    lines = [
        "| policy | requests | errors | TTFT p50 (ms) | TTFT p90 (ms) | tokens/s | prompt from cache "
        "| prefix prefilled |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p, s in summaries.items():
        lines.append(
            f"| {p} | {s.requests} | {s.errors} | {s.ttft_p50_ms:.0f} | {s.ttft_p90_ms:.0f} | "
            f"{s.tokens_per_s:.1f} | {100 * s.cached_share:.0f}% | {s.misses} ({s.first_sight} first) |"
        )
    ours = summaries.get("llmgw")
    if ours:
        lines.append("")
        for p, s in summaries.items():
            if p != "llmgw":
                lines.append(
                    f"{p} / llmgw: TTFT p90 {s.ttft_p90_ms / ours.ttft_p90_ms:.2f}×, "
                    f"p50 {s.ttft_p50_ms / ours.ttft_p50_ms:.2f}×, tokens/s {s.tokens_per_s / ours.tokens_per_s:.2f}×"
                )
    return "\n".join(lines)


# -- sending ---------------------------------------------------------------------------------------


async def send(session: aiohttp.ClientSession, url: str, key: str, body: dict[str, Any], result: Result) -> None:
    """One streamed request through the gateway; fills ``result`` (an error's text when not answered)."""
    headers = {"Authorization": f"Bearer {key}"}
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                result.error = f"{resp.status} {(await resp.text())[:200]}"
                return
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                if math.isnan(result.ttft):
                    result.ttft = time.perf_counter() - result.sent
                chunk = msgspec.json.decode(line[6:])
                if usage := chunk.get("usage"):
                    result.tokens = usage.get("completion_tokens", 0)
                    result.prompt_tokens = usage.get("prompt_tokens", 0)
                if timings := chunk.get("timings"):
                    result.cached_tokens = timings.get("cache_n", 0)
        result.done = time.perf_counter()
        if math.isnan(result.ttft):
            result.error = "no chunk streamed"
    except (aiohttp.ClientError, TimeoutError) as exc:
        result.error = repr(exc)


async def run_round(
    fleet: Fleet, key: str, w: Workload, planned: list[Planned], docs: list[str], policy: str
) -> list[Result]:
    """Send ``planned`` under ``policy`` at their arrival times and wait for every answer."""
    fleet.handles["router"].routing_policy = policy
    url = f"http://127.0.0.1:{fleet.port}/v1/chat/completions"
    results: list[Result] = []
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=300)
    ) as session:
        t0 = time.perf_counter()
        tasks = []
        for p in planned:
            if (wait := t0 + p.at - time.perf_counter()) > 0:
                await asyncio.sleep(wait)
            body = {
                "model": MODEL,
                "messages": [
                    {"role": "system", "content": docs[p.tenant]},
                    {"role": "user", "content": f"user {p.user}: {p.question}"},
                ],
                "max_tokens": w.max_tokens,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            r = Result(tenant=p.tenant, sent=time.perf_counter())
            results.append(r)
            tasks.append(asyncio.create_task(send(session, url, key, body, r)))
        await asyncio.gather(*tasks)
    return results


# -- the fleet -------------------------------------------------------------------------------------


async def bench(
    base: Path,
    runs: int,
    w: Workload,
    *,
    cache_mib: int = 24,
    width: int = 512,
    layers: int = 8,
    on_round: Any = None,
) -> dict[str, list[list[Result]]]:
    """Every policy's rounds: ``runs`` of each, interleaved. ``on_round(run, policy, results)`` is told
    of each as it ends."""
    with nats_server(base) as nats:
        store = await EventStore.connect(nats.url, default_registry())
        await store.ensure_streams()
        router = RouterConfig(activation_s=60.0, first_token_s=120.0, idle_s=60.0, total_s=300.0, queue_wait_s=120.0)
        fleet = await Fleet(store, nats.url, base).start(services=GATEWAY, router=router)
        try:
            fleet.agent("n1")
            key, _ = await make_key(store, await make_tenant(store))
            # A slot holds a prefix, the question and the answer; the GGUF's context is a slot's.
            slot_ctx = 2 * (3 * w.prefix_words + 4 * w.question_words + w.max_tokens + 64)
            gguf = write_tiny_gguf(
                base / "b2b.gguf",
                width=width,
                layers=layers,
                heads=8 if width % 8 == 0 else 4,
                vocab_size=512,
                context_length=max(512, slot_ctx),
            )
            profile = M.Profile(
                engine="llamacpp",
                cpu_cores=1,
                min_memory_gb=0.25,
                ctx_size=SLOTS * max(512, slot_ctx),
                parallel=SLOTS,
                args=["--cache-ram", str(cache_mib)],
            )
            spec = M.ModelSpec(name=MODEL, source=str(gguf), scaling=M.Scaling(min=REPLICAS), profiles=[profile])
            await fleet.command("add", M.AddModel(spec=spec))
            await fleet.wait_ready(MODEL, REPLICAS, deadline_s=120)
            await fleet.router_caught_up()
            router_obj = fleet.handles["router"]
            await wait_until(
                lambda: len(router_obj.state.ready(MODEL)) == REPLICAS, deadline_s=30, what="the router's replicas"
            )
            # Warm-up, not counted: every replica has loaded and answered once.
            warm = Workload(
                tenants=REPLICAS, users=1, prefix_words=8, seconds=2.0, rate_from=REPLICAS, rate_to=REPLICAS
            )
            await run_round(fleet, key, warm, plan(warm, -1), documents(warm, -1, "warm-up"), "round_robin")
            out: dict[str, list[list[Result]]] = {p: [] for p in POLICIES}
            for run in range(runs):
                planned = plan(w, run)
                k = run % len(POLICIES)
                for policy in POLICIES[k:] + POLICIES[:k]:
                    results = await run_round(fleet, key, w, planned, documents(w, run, policy), policy)
                    out[policy].append(results)
                    if on_round:
                        on_round(run, policy, results)
            return out
        finally:
            await fleet.stop()
            await store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Workload()
    ap.add_argument("--runs", type=int, default=3, help="rounds of each policy, interleaved")
    ap.add_argument("--tenants", type=int, default=d.tenants)
    ap.add_argument("--users", type=int, default=d.users, help="per tenant")
    ap.add_argument("--prefix-words", type=int, default=d.prefix_words, help="a tenant's document (~3 tokens a word)")
    ap.add_argument("--question-words", type=int, default=d.question_words)
    ap.add_argument("--max-tokens", type=int, default=d.max_tokens)
    ap.add_argument("--seconds", type=float, default=d.seconds, help="a round's arrivals span")
    ap.add_argument("--rate-from", type=float, default=d.rate_from, help="requests/s at a round's start")
    ap.add_argument("--rate-to", type=float, default=d.rate_to, help="requests/s at a round's end")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--cache-mib", type=int, default=24, help="llama.cpp's --cache-ram per replica")
    ap.add_argument("--width", type=int, default=512, help="the model's embedding width")
    ap.add_argument("--layers", type=int, default=8)
    a = ap.parse_args()
    w = Workload(
        tenants=a.tenants,
        users=a.users,
        prefix_words=a.prefix_words,
        question_words=a.question_words,
        max_tokens=a.max_tokens,
        seconds=a.seconds,
        rate_from=a.rate_from,
        rate_to=a.rate_to,
        seed=a.seed,
    )

    def said(run: int, policy: str, results: list[Result]) -> None:
        s = summarize([results])
        print(
            f"run {run + 1} {policy:>11}: {s.requests} requests, {s.errors} errors, TTFT p50 {s.ttft_p50_ms:.0f} ms "
            f"p90 {s.ttft_p90_ms:.0f} ms, {s.tokens_per_s:.1f} tokens/s, {100 * s.cached_share:.0f}% of prompt cached, "
            f"{s.misses} prefixes prefilled ({s.first_sight} a tenant's first)",
            flush=True,
        )

    logs.configure("warning")  # the services' request lines would bury the figures
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-b2b-") as tmp:
        out = asyncio.run(
            bench(Path(tmp), a.runs, w, cache_mib=a.cache_mib, width=a.width, layers=a.layers, on_round=said)
        )
    summaries = {p: summarize(rounds) for p, rounds in out.items()}
    print()
    print(table(summaries))
    prompt = summaries["llmgw"].prompt_tokens
    print(
        f"\nmachine: {os.cpu_count()} CPUs, load average before {load0[0]:.2f}, after {os.getloadavg()[0]:.2f}; "
        f"{REPLICAS} replicas × {SLOTS} slots, model {a.width}×{a.layers}, --cache-ram {a.cache_mib} MiB; "
        f"{w.tenants} tenants × {w.users} users, prompts {prompt:.0f} tokens on average, "
        f"{w.rate_from:g}→{w.rate_to:g} requests/s over {w.seconds:g} s, {a.runs} run(s)"
    )


if __name__ == "__main__":
    main()
