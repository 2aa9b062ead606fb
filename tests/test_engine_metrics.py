"""An engine's own load signals (SCHED-9): llama.cpp's and vLLM's /metrics read the same way, and a
real llama.cpp engine with one slot says how many requests run and how many wait."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from llmgw.agent.engines import metrics as EM
from llmgw.agent.engines.commands import llamacpp_launch
from tests.gguf_tiny import write_tiny_gguf
from tests.support import free_port, wait_until
from tests.test_engines import KEY, EngineProcess

# As llama.cpp's server (xllamacpp's build) answers /metrics with one slot busy and three queued.
LLAMACPP = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached tokens
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 3
# HELP llamacpp:prompt_tokens_cached_total Number of prompt tokens reused from the cache
# TYPE llamacpp:prompt_tokens_cached_total counter
llamacpp:prompt_tokens_cached_total 0
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 400
# HELP llamacpp:prompt_tokens_seconds Average prompt throughput in tokens/s
# TYPE llamacpp:prompt_tokens_seconds gauge
llamacpp:prompt_tokens_seconds 3978.78
# HELP llamacpp:requests_processing Number of requests processing
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 1
# HELP llamacpp:requests_deferred Number of requests deferred
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 3
"""

# vLLM v0 (one series per model label) and v1 (engine and model labels, kv_cache_usage_perc).
VLLM_V0 = """\
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.42
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 12345.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 6789.0
vllm:time_to_first_token_seconds_bucket{le="0.001",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
"""

VLLM_V1 = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-0.6B"} 3.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen3-0.6B"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-0.6B"} 1.0
vllm:num_requests_waiting{engine="1",model_name="Qwen/Qwen3-0.6B"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-0.6B"} 0.25
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 100.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="Qwen/Qwen3-0.6B"} 50.0
"""


@pytest.mark.parametrize(
    ("text", "slots", "running", "waiting", "kv", "n_slots"),
    [
        (LLAMACPP, [{"id": 0, "is_processing": True}], 1, 3, None, 1),
        (VLLM_V0, None, 7, 2, 0.42, None),
        (VLLM_V1, None, 5, 1, 0.25, None),
        # llama.cpp before its first request: HELP and TYPE lines only; its slots still say who works.
        (
            "# HELP llamacpp:requests_processing x\n# TYPE llamacpp:requests_processing gauge\n",
            [{"id": 0}, {"id": 1}],
            0,
            None,
            None,
            2,
        ),
        ("", None, None, None, None, None),
    ],
    ids=["llama.cpp", "vllm-v0", "vllm-v1-two-engines-summed", "llama.cpp-before-traffic", "nothing"],
)
def test_llamacpp_and_vllm_metrics_read_as_the_same_signals(
    text: str, slots: object, running: int | None, waiting: int | None, kv: float | None, n_slots: int | None
) -> None:
    s = EM.signals_of(EM.parse_text(text), slots, at=10.0)
    assert (s.requests_running, s.requests_waiting, s.kv_cache_usage, s.slots) == (running, waiting, kv, n_slots)


def test_tokens_per_second_are_the_counters_change_between_two_scrapes() -> None:
    first = EM.signals_of(EM.parse_text(VLLM_V0), None, at=100.0)
    later = EM.signals_of(
        EM.parse_text(VLLM_V0.replace("12345.0", "12845.0").replace("6789.0", "7789.0")), None, at=110.0
    )
    assert EM.rates(None, first) == (None, None), "the first scrape has nothing to compare with"
    assert EM.rates(first, later) == (50.0, 100.0)
    assert EM.rates(later, first) == (None, None), "a counter that went back: the engine restarted"


def test_lines_that_do_not_parse_leave_the_signal_absent() -> None:
    got = EM.parse_text('vllm:num_requests_waiting{x="a b"} NaN\nllamacpp:requests_deferred oops\nbare\n')
    assert got == {}


@pytest.fixture
async def one_slot_engine(tmp_path: Path) -> AsyncIterator[EngineProcess]:
    port = free_port()
    launch = llamacpp_launch(
        str(write_tiny_gguf(tmp_path / "tiny.gguf")),
        host="127.0.0.1",
        port=port,
        threads=1,
        parallel=1,
        ctx_size=1024,
        key=KEY,
        llama_server_binary=None,
        python=sys.executable,
    )
    proc = EngineProcess(launch, port, tmp_path / "engine.log")
    try:
        yield await proc.wait_healthy()
    finally:
        proc.stop()


async def test_a_one_slot_engine_says_one_request_runs_and_the_rest_wait(one_slot_engine: EngineProcess) -> None:
    url = one_slot_engine.base_url
    async with aiohttp.ClientSession() as session:

        async def long_request() -> None:
            body = {"prompt": "hi", "max_tokens": 1000, "ignore_eos": True}
            headers = {"Authorization": f"Bearer {KEY}"}
            async with session.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
                assert resp.status == 200
                await resp.read()

        load = [asyncio.create_task(long_request()) for _ in range(4)]
        try:

            async def queued() -> EM.Signals | None:
                s = await EM.scrape(session, url, KEY, at=0.0)
                return s if s.requests_waiting else None

            s = await wait_until(queued, deadline_s=30, what="the engine to report waiting requests")
            assert s.requests_running == 1 and s.slots == 1
            assert 1 <= s.requests_waiting <= 3
        finally:
            await asyncio.gather(*load, return_exceptions=True)
        with pytest.raises(EM.NoMetrics):
            await EM.scrape(session, url, "not-the-key", at=0.0)
