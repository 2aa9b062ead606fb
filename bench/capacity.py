"""`llmgw ctl bench MODEL` (SPEC SCHED-10): what one replica of a model serves, measured through the gateway.

The load rises step by step (1, 2, 4, … concurrent streaming requests, or one more each step); each
step measures, from the client's side, the time to first token (its 95th percentile), each request's
own generation speed (the speed 95 % of requests saw at least) and the tokens generated per second by
all requests together. The answer is the most concurrent requests served within the model's SLO, or,
without one, the knee: the last step whose total tokens/s rose by at least 10 % over the step before
(past it, more concurrency only makes each request slower). A step with a failed request is outside.

The judging is pure (:func:`summarize`, :func:`judge`, :func:`replicas_for`); :func:`run_bench` is the
thin driver over HTTP. The measured replica is pinned by the caller: the CLI refuses a model that
could spread the load over more than one replica.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Awaitable, Callable

import aiohttp
import msgspec

from llmgw.bench import BenchError
from llmgw.events.schema import models as M

KNEE_RISE = 1.10  # a step's total tokens/s must rise by this over the step before to be worth its concurrency
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


class Sample(msgspec.Struct, frozen=True, kw_only=True):
    """One request of a step, as the client saw it."""

    ttft_s: float | None  # from sending to the first generated text; None when it failed before any
    tokens: int  # completion tokens (the usage's, else the chunks that carried text)
    generating_s: float  # from the first token to the last
    error: str = ""  # why it failed; "" when it answered

    @property
    def speed(self) -> float | None:
        """Its own generation speed (tokens/s after the first); None when it generated under two tokens."""
        if self.error or self.tokens < 2 or self.generating_s <= 0:
            return None
        return (self.tokens - 1) / self.generating_s


class Step(msgspec.Struct, frozen=True, kw_only=True):
    """What one step measured, and whether it is within the SLO (None without an SLO)."""

    concurrency: int
    requests: int
    failed: int
    ttft_p95_s: float | None  # 95th percentile time to first token of the requests that answered
    request_tokens_per_s: float | None  # the generation speed 95 % of the requests saw at least
    tokens_per_s: float  # tokens generated per second in the step, all requests together
    within_slo: bool | None = None
    why: str = ""  # what missed the SLO, or stopped the steps


class Result(msgspec.Struct, kw_only=True):
    """The steps and the answer: ``concurrency`` 0 when even one request missed the SLO."""

    model: str
    replica: str
    node: str
    profile: str
    shape: M.NodeShape
    slo: M.Slo | None
    basis: str  # "slo" or "knee"
    steps: list[Step]
    concurrency: int
    tokens_per_s: float
    ttft_p95_s: float
    request_tokens_per_s: float
    requests: int
    at: float
    note: str = ""

    def measured(self) -> M.ModelMeasured:
        return M.ModelMeasured(
            profile=self.profile,
            shape=self.shape,
            node_id=self.node,
            replica_id=self.replica,
            concurrency=self.concurrency,
            tokens_per_s=round(self.tokens_per_s, 2),
            ttft_p95_s=round(self.ttft_p95_s, 4),
            request_tokens_per_s=round(self.request_tokens_per_s, 2),
            basis=self.basis,
            slo=self.slo,
            requests=self.requests,
            at=self.at,
        )


def percentile(values: list[float], p: float) -> float | None:
    """The nearest-rank ``p``-th percentile (0 < p ≤ 100); None of nothing."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def concurrency_steps(max_concurrency: int, linear: bool = False) -> list[int]:
    """1, 2, 4, … up to ``max_concurrency`` (ending on it), or 1, 2, 3, … with ``linear``."""
    if linear:
        return list(range(1, max_concurrency + 1))
    steps, c = [], 1
    while c < max_concurrency:
        steps.append(c)
        c *= 2
    return [*steps, max_concurrency]


def summarize(concurrency: int, samples: list[Sample], wall_s: float, slo: M.Slo | None) -> Step:
    """A step's figures from its requests, judged against ``slo``."""
    ok = [s for s in samples if not s.error]
    failed = [s for s in samples if s.error]
    ttft = percentile([s.ttft_s for s in ok if s.ttft_s is not None], 95)
    speed = percentile([v for s in ok if (v := s.speed) is not None], 5)
    total = sum(s.tokens for s in ok) / wall_s if wall_s > 0 else 0.0
    within: bool | None = None
    why = ""
    if failed:
        why = f"{len(failed)} of {len(samples)} requests failed (first: {failed[0].error})"
    if slo is not None:
        misses = [why] if why else []
        if slo.ttft_p95_s is not None and (ttft is None or ttft > slo.ttft_p95_s):
            misses.append(f"time to first token p95 {_s(ttft)} is over the SLO's {slo.ttft_p95_s:g} s")
        if slo.tokens_per_s is not None and (speed is None or speed < slo.tokens_per_s):
            seen = "no request generated two tokens" if speed is None else f"{speed:.1f} tokens/s"
            misses.append(f"requests' speed {seen} is under the SLO's {slo.tokens_per_s:g} tokens/s")
        within, why = not misses, "; ".join(misses)
    return Step(
        concurrency=concurrency,
        requests=len(samples),
        failed=len(failed),
        ttft_p95_s=ttft,
        request_tokens_per_s=speed,
        tokens_per_s=total,
        within_slo=within,
        why=why,
    )


class Verdict(msgspec.Struct, frozen=True, kw_only=True):
    """The answer so far: the step that is it (None: none yet, or none within the SLO), and whether to go on."""

    best: Step | None
    more: bool
    note: str = ""


def judge(steps: list[Step], slo: M.Slo | None, last_step: bool = False) -> Verdict:
    """The most concurrent step within ``slo``, or without one the knee; ``more``: another step could change it.

    Steps are in rising concurrency. With an SLO the steps stop at the first outside it (more concurrency
    does not bring a slower replica back within it). Without one, at the first whose total tokens/s did
    not rise by 10 % over the step before (or that failed): the knee is the step before it."""
    if not steps:
        return Verdict(best=None, more=True)
    if slo is not None:
        within = [s for s in steps if s.within_slo]
        last = steps[-1]
        if not last.within_slo:
            if not within:
                return Verdict(best=None, more=False, note=f"even {last.concurrency} concurrent: {last.why}")
            return Verdict(best=within[-1], more=False, note=f"at {last.concurrency} concurrent: {last.why}")
        note = (
            f"still within the SLO at {last.concurrency}, the last step (--max-concurrency): more could be"
            if last_step
            else ""
        )
        return Verdict(best=last, more=not last_step, note=note)
    best = None
    for k, s in enumerate(steps):
        if s.failed:
            return Verdict(best=best, more=False, note=f"at {s.concurrency} concurrent: {s.why}")
        if k and s.tokens_per_s < KNEE_RISE * steps[k - 1].tokens_per_s:
            rise = s.tokens_per_s / steps[k - 1].tokens_per_s - 1 if steps[k - 1].tokens_per_s > 0 else 0.0
            return Verdict(
                best=best,
                more=False,
                note=f"at {s.concurrency} concurrent the total tokens/s rose {rise:+.0%}, under 10 %",
            )
        best = s
    note = (
        f"total tokens/s still rising at {steps[-1].concurrency}, the last step (--max-concurrency): the knee is higher"
        if last_step
        else ""
    )
    return Verdict(best=best, more=not last_step, note=note)


def replicas_for(tokens_per_s: float, per_replica: float) -> int:
    """Replicas that serve ``tokens_per_s`` when one serves ``per_replica`` (at least one)."""
    if per_replica <= 0:
        raise ValueError("a measurement of 0 tokens/s per replica cannot size anything: measure again")
    return max(1, math.ceil(tokens_per_s / per_replica - 1e-9))


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f} s"


# -- the driver ---------------------------------------------------------------------------------


class Target(msgspec.Struct, frozen=True, kw_only=True):
    """Where the requests go: the gateway, a key, the model and how it is asked."""

    gateway: str
    key: str
    model: str
    route: str = "chat"
    max_tokens: int = 64
    ignore_eos: bool = True


def _body(t: Target) -> tuple[str, dict]:
    common = {"model": t.model, "max_tokens": t.max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    if t.ignore_eos:  # every answer as long as asked: steps compare like with like (llama.cpp and vLLM take it)
        common["ignore_eos"] = True
    if t.route == "completion":
        return "/v1/completions", {**common, "prompt": PROMPT}
    return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": PROMPT}]}


async def one_request(http: aiohttp.ClientSession, t: Target) -> Sample:
    """One streaming request, timed from its send to its first text and to its end."""
    path, body = _body(t)
    sent = time.monotonic()
    first: float | None = None
    chunks = 0
    usage: int | None = None
    try:
        async with http.post(
            t.gateway.rstrip("/") + path, json=body, headers={"Authorization": f"Bearer {t.key}"}
        ) as resp:
            if resp.status != 200:
                text = (await resp.text())[:300]
                try:
                    text = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    pass
                return Sample(ttft_s=None, tokens=0, generating_s=0.0, error=f"HTTP {resp.status}: {text}")
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if event.get("usage"):
                    usage = event["usage"].get("completion_tokens")
                for choice in event.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                    if text:
                        chunks += 1
                        if first is None:
                            first = time.monotonic()
        end = time.monotonic()
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return Sample(ttft_s=None, tokens=0, generating_s=0.0, error=f"{type(exc).__name__}: {exc}"[:300])
    if first is None:  # answered, but the model ended at once (an end-of-text first): no token to time
        return Sample(ttft_s=None, tokens=usage or 0, generating_s=0.0)
    return Sample(ttft_s=first - sent, tokens=usage if usage is not None else chunks, generating_s=end - first)


async def run_step(
    http: aiohttp.ClientSession, t: Target, concurrency: int, requests: int
) -> tuple[list[Sample], float]:
    """``requests`` requests, ``concurrency`` in flight at once; their samples and the step's wall time."""
    left = requests
    samples: list[Sample] = []

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            samples.append(await one_request(http, t))

    started = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return samples, time.monotonic() - started


async def run_bench(
    t: Target,
    *,
    slo: M.Slo | None,
    max_concurrency: int,
    requests_per_step: int,
    linear: bool,
    on_step: Callable[[Step], None],
    request_timeout_s: float = 300.0,
) -> tuple[list[Step], Verdict, int]:
    """Steps of rising concurrency until :func:`judge` has its answer: the steps, the verdict, requests sent."""
    sent = 0
    timeout = aiohttp.ClientTimeout(total=request_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        warm = await one_request(http, t)  # the engine's first request pays for warming up: not counted
        sent += 1
        if warm.error:
            raise BenchError(f"model {t.model} did not answer through the gateway at {t.gateway}: {warm.error}")

        async def measure(c: int) -> Step:
            nonlocal sent
            samples, wall = await run_step(http, t, c, max(requests_per_step, c))
            sent += len(samples)
            step = summarize(c, samples, wall, slo)
            on_step(step)
            return step

        steps, verdict = await climb(measure, slo, concurrency_steps(max_concurrency, linear))
    return steps, verdict, sent


async def climb(
    measure: Callable[[int], Awaitable[Step]], slo: M.Slo | None, plan: list[int]
) -> tuple[list[Step], Verdict]:
    """The steps of ``plan`` until :func:`judge` has its answer; with an SLO, the gap between the last
    step within it and the first outside is then halved until it is one request wide (doubling alone
    would answer 4 where 7 are served). The steps come back in rising concurrency."""
    steps: list[Step] = []
    verdict = Verdict(best=None, more=True)
    for k, c in enumerate(plan):
        steps.append(await measure(c))
        verdict = judge(steps, slo, last_step=k == len(plan) - 1)
        if not verdict.more:
            break
    if slo is not None and verdict.best is not None and not steps[-1].within_slo:
        best, outside = verdict.best, steps[-1]
        while outside.concurrency - best.concurrency > 1:
            step = await measure((best.concurrency + outside.concurrency) // 2)
            steps.append(step)
            if step.within_slo:
                best = step
            else:
                outside = step
        verdict = Verdict(best=best, more=False, note=f"at {outside.concurrency} concurrent: {outside.why}")
        steps.sort(key=lambda s: s.concurrency)
    return steps, verdict


# -- words ----------------------------------------------------------------------------------------


def step_rows(steps: list[Step]) -> list[list[str]]:
    return [
        [
            str(s.concurrency),
            str(s.requests),
            str(s.failed),
            _s(s.ttft_p95_s),
            "-" if s.request_tokens_per_s is None else f"{s.request_tokens_per_s:.1f}",
            f"{s.tokens_per_s:.1f}",
            "-" if s.within_slo is None else ("within" if s.within_slo else "outside"),
        ]
        for s in steps
    ]


STEP_HEADERS = ["CONCURRENT", "REQUESTS", "FAILED", "TTFT P95", "REQ TOK/S", "TOTAL TOK/S", "SLO"]

LEGEND = (
    "CONCURRENT: requests kept in flight at once; TTFT P95: time to first token, 95th percentile, as the "
    "client saw it through the gateway; REQ TOK/S: the generation speed 95 % of requests saw at least; "
    "TOTAL TOK/S: tokens generated per second by all requests of the step together."
)


def result_line(r: Result) -> str:
    what = "within its SLO" if r.basis == "slo" else "at its knee (total tokens/s stopped rising by 10 %)"
    if r.concurrency == 0:
        return f"{r.model}: one replica misses its SLO even at one request ({r.note})"
    requests = "request" if r.concurrency == 1 else "requests"
    return (
        f"{r.model}: one replica ({r.profile} on {r.shape.words()}) serves {r.concurrency} concurrent {requests} "
        f"{what}, {r.tokens_per_s:.1f} tokens/s in all, time to first token p95 {r.ttft_p95_s:.3f} s, each "
        f"request at least {r.request_tokens_per_s:.1f} tokens/s (95 %)"
    )
