"""An engine's own load signals (SCHED-9): ``GET /metrics`` (Prometheus text), and ``GET /slots`` where
the engine has it, with the replica's key, on the heartbeat's cadence and a short timeout.

llama.cpp's server (with ``--metrics``; ``tools/server``) names them ``llamacpp:requests_processing``,
``llamacpp:requests_deferred`` (requests waiting for a slot), ``llamacpp:prompt_tokens_total`` and
``llamacpp:tokens_predicted_total``; ``/slots`` lists its slots (``--parallel``). vLLM names them
``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (before
v0.10 ``vllm:gpu_cache_usage_perc``), ``vllm:prompt_tokens_total`` and ``vllm:generation_tokens_total``,
one series per engine and model label: the series are summed. Tokens/s are the counters' change
between two scrapes, over the time between them; the first scrape of an engine has none.

Parsing is pure (:func:`parse_text`, :func:`signals_of`, :func:`rates`); :func:`scrape` is the I/O.
"""

from __future__ import annotations

import math

import aiohttp
import msgspec

SCRAPE_TIMEOUT_S = 1.0  # a heartbeat must not wait on a stuck engine
UNREACHABLE_AFTER = 3  # scrapes failed in a row before the replica is reported unreachable

# (llama.cpp name, vLLM names) for each signal: the first present wins.
_RUNNING = ("llamacpp:requests_processing", "vllm:num_requests_running")
_WAITING = ("llamacpp:requests_deferred", "vllm:num_requests_waiting")
_KV = ("llamacpp:kv_cache_usage_ratio", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_PROMPT = ("llamacpp:prompt_tokens_total", "vllm:prompt_tokens_total")
_GENERATED = ("llamacpp:tokens_predicted_total", "vllm:generation_tokens_total")


class NoMetrics(ValueError):
    """The engine answered, but not with metrics (an engine started without them): it is reachable."""


class Signals(msgspec.Struct, frozen=True, kw_only=True):
    """One scrape of one engine; None where it does not say."""

    at: float  # monotonic seconds of the scrape
    requests_running: int | None = None
    requests_waiting: int | None = None
    slots: int | None = None
    kv_cache_usage: float | None = None  # 0..1
    prompt_tokens: float | None = None  # counters, since the engine started
    generated_tokens: float | None = None


def parse_text(text: str) -> dict[str, float]:
    """Prometheus text exposition → metric name → value, summed over its label sets (comments, blank
    lines, NaN and lines that do not parse are skipped: a signal is then simply absent)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "}" in line:
            head, _, rest = line.rpartition("}")
            name = head.split("{", 1)[0]
        else:
            name, _, rest = line.partition(" ")
        fields = rest.split()
        if not name or not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if math.isnan(value):
            continue
        out[name] = out.get(name, 0.0) + value
    return out


def _first(metrics: dict[str, float], names: tuple[str, ...]) -> float | None:
    for n in names:
        if n in metrics:
            return metrics[n]
    return None


def signals_of(metrics: dict[str, float], slots: object, at: float) -> Signals:
    """The signals in a parsed ``/metrics`` and a decoded ``/slots`` (a list of slots, or None)."""
    running = _first(metrics, _RUNNING)
    waiting = _first(metrics, _WAITING)
    kv = _first(metrics, _KV)
    n_slots = len(slots) if isinstance(slots, list) and slots else None
    if running is None and n_slots is not None:  # llama.cpp without --metrics: its slots still say who works
        running = sum(1 for s in slots if isinstance(s, dict) and s.get("is_processing"))  # type: ignore[union-attr]
    return Signals(
        at=at,
        requests_running=None if running is None else int(running),
        requests_waiting=None if waiting is None else int(waiting),
        slots=n_slots,
        kv_cache_usage=None if kv is None else min(max(kv, 0.0), 1.0),
        prompt_tokens=_first(metrics, _PROMPT),
        generated_tokens=_first(metrics, _GENERATED),
    )


def rates(prev: Signals | None, now: Signals) -> tuple[float | None, float | None]:
    """(prompt, generation) tokens/s between two scrapes; None without an earlier one, or after a
    counter went back (the engine restarted)."""

    def rate(a: float | None, b: float | None) -> float | None:
        if prev is None or a is None or b is None or b < a or now.at <= prev.at:
            return None
        return round((b - a) / (now.at - prev.at), 1)

    if prev is None:
        return None, None
    return rate(prev.prompt_tokens, now.prompt_tokens), rate(prev.generated_tokens, now.generated_tokens)


async def scrape(
    session: aiohttp.ClientSession, base_url: str, key: str, at: float, timeout_s: float = SCRAPE_TIMEOUT_S
) -> Signals:
    """One engine's signals. Raises ``aiohttp.ClientError``, ``TimeoutError`` or ``OSError`` when its
    ``/metrics`` does not answer, :class:`NoMetrics` when it answers otherwise; ``/slots`` is optional."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    base = base_url.rstrip("/")
    async with session.get(f"{base}/metrics", headers=headers, timeout=timeout) as resp:
        if resp.status != 200:
            raise NoMetrics(f"/metrics answered HTTP {resp.status} (is the engine started with --metrics?)")
        metrics = parse_text(await resp.text())
    slots: object = None
    if "llamacpp:requests_processing" in metrics or not metrics:  # vLLM has no /slots
        try:
            async with session.get(f"{base}/slots", headers=headers, timeout=timeout) as resp:
                if resp.status == 200:
                    slots = msgspec.json.decode(await resp.read())
        except (aiohttp.ClientError, TimeoutError, OSError, msgspec.DecodeError):
            slots = None
    return signals_of(metrics, slots, at)
