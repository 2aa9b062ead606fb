"""Engines (ARCHITECTURE §8, FLEET-5, GW-7): launch builders, and the real llama.cpp engine.

The integration tests run llama.cpp's own server (the xllamacpp wheel) as a child process, in its
own process group, on a tiny random-weight GGUF the suite writes itself. They assert on structure
(token counts, finish reasons, SSE framing, status codes), never on the text noise weights produce.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import gguf
import numpy as np
import pytest

from llmgw.agent.engines.commands import (
    LLAMA_SERVER_KEY_ENV,
    VLLM_KEY_ENV,
    XLLAMA_KEY_ENV,
    XLLAMA_MODULE,
    EngineLaunch,
    choose_threads,
    llamacpp_launch,
    vllm_launch,
)
from llmgw.agent.engines.health import EngineExited, EngineStartTimeout, probe, wait_healthy
from tests.gguf_tiny import corrupt_gguf, write_tiny_gguf
from tests.support import free_port, wait_until

KEY = "llmgw-test-engine-key-3f9c1a7e"
WIDTH = 64
STARTUP_DEADLINE_S = 60.0


# --- builders (pure) ------------------------------------------------------------------------------


def _all_launches(key: str) -> list[EngineLaunch]:
    return [
        llamacpp_launch(
            "/m/a.gguf",
            host="127.0.0.1",
            port=20001,
            threads=4,
            ctx_size=4096,
            key=key,
            extra_args=("-ngl", "0"),
            embeddings=True,
            alias="a",
            llama_server_binary="/usr/bin/llama-server",
            python="/usr/bin/python3",
        ),
        llamacpp_launch(
            "/m/a.gguf",
            host="127.0.0.1",
            port=20002,
            threads=4,
            ctx_size=4096,
            key=key,
            extra_args=("--temp", "0"),
            llama_server_binary=None,
            python="/usr/bin/python3",
        ),
        vllm_launch(
            "/m/llama-70b",
            host="127.0.0.1",
            port=20003,
            gpus=[2, 3],
            tensor_parallel=2,
            key=key,
            served_name="llama-70b",
            max_model_len=8192,
        ),
    ]


def test_key_is_never_in_argv_and_always_in_env() -> None:
    launches = _all_launches(KEY)
    for launch in launches:
        assert not any(KEY in arg for arg in launch.argv), launch.argv
        assert KEY in launch.env.values()
    binary, xllama, vllm = launches
    assert binary.env == {LLAMA_SERVER_KEY_ENV: KEY}
    assert xllama.env == {XLLAMA_KEY_ENV: KEY}
    assert vllm.env[VLLM_KEY_ENV] == KEY


def test_a_key_smuggled_into_argv_or_an_empty_key_is_refused() -> None:
    with pytest.raises(ValueError, match="argv"):
        llamacpp_launch(
            "/m/a.gguf",
            host="h",
            port=1,
            threads=1,
            ctx_size=0,
            key=KEY,
            extra_args=("--api-key", KEY),
            llama_server_binary="llama-server",
            python="python",
        )
    with pytest.raises(ValueError, match="argv"):
        vllm_launch(
            "/m", host="h", port=1, gpus=[0], tensor_parallel=1, key=KEY, served_name="m", extra_args=[f"--x={KEY}"]
        )
    with pytest.raises(ValueError, match="key"):
        llamacpp_launch(
            "/m/a.gguf", host="h", port=1, threads=1, ctx_size=0, key="", llama_server_binary=None, python="python"
        )


def test_a_short_key_is_only_refused_as_a_whole_argument() -> None:
    # "k" is inside "/srv/k.gguf" and the python's path; that is a coincidence, not the key on the command line.
    launch = llamacpp_launch(
        "/srv/k.gguf", host="h", port=1, threads=1, ctx_size=0, key="k", llama_server_binary=None, python="/srv/pkgs/py"
    )
    assert launch.env == {XLLAMA_KEY_ENV: "k"}
    for extra in (["k"], ["--api-key=k"]):
        with pytest.raises(ValueError, match="argv"):
            llamacpp_launch(
                "/m",
                host="h",
                port=1,
                threads=1,
                ctx_size=0,
                key="k",
                extra_args=extra,
                llama_server_binary="ls",
                python="p",
            )


def test_llama_server_binary_argv() -> None:
    launch = _all_launches(KEY)[0]
    assert launch.argv == [
        "/usr/bin/llama-server",
        "-m",
        "/m/a.gguf",
        "--host",
        "127.0.0.1",
        "--port",
        "20001",
        "--threads",
        "4",
        "--parallel",
        "4",
        "--ctx-size",
        "4096",
        "--embeddings",
        "--alias",
        "a",
        "--metrics",
        "-ngl",
        "0",
    ]


def test_xllamacpp_argv_runs_the_module_with_extra_args_after_a_separator() -> None:
    launch = _all_launches(KEY)[1]
    assert launch.argv[:3] == ["/usr/bin/python3", "-m", XLLAMA_MODULE]
    assert launch.argv[3:5] == ["--model", "/m/a.gguf"]
    assert launch.argv[-3:] == ["--", "--temp", "0"]
    assert "--embeddings" not in launch.argv and "--alias" not in launch.argv


def test_vllm_tensor_parallel_and_visible_devices() -> None:
    launch = _all_launches(KEY)[2]
    assert launch.argv[:3] == ["vllm", "serve", "/m/llama-70b"]
    argv = launch.argv
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert argv[argv.index("--served-model-name") + 1] == "llama-70b"
    assert argv[argv.index("--max-model-len") + 1] == "8192"
    assert argv[argv.index("--port") + 1] == "20003"
    assert launch.env["CUDA_VISIBLE_DEVICES"] == "2,3"

    single = vllm_launch("/m", host="h", port=1, gpus=[5], tensor_parallel=1, key=KEY, served_name="m")
    assert single.env["CUDA_VISIBLE_DEVICES"] == "5"
    assert "--max-model-len" not in single.argv
    with pytest.raises(ValueError, match="GPUs"):
        vllm_launch("/m", host="h", port=1, gpus=[0], tensor_parallel=2, key=KEY, served_name="m")
    with pytest.raises(ValueError):
        vllm_launch("/m", host="h", port=1, gpus=[0, 0], tensor_parallel=2, key=KEY, served_name="m")


@pytest.mark.parametrize(
    ("reserved", "configured", "cpus", "expected"),
    [
        (4, 8, 64, 4),  # reserved cores win
        (2.5, None, 64, 2),  # never more threads than reserved cores
        (0.5, None, 64, 1),  # but at least one
        (None, 6, 64, 6),  # else the agent's llamacpp.threads
        (0, 6, 64, 6),  # a zero reservation is no reservation
        (None, None, 64, 32),  # else half the CPUs
        (None, 0, 7, 3),
        (None, None, 1, 1),  # at least 1
        (None, None, None, 1),  # an agent that cannot count CPUs
    ],
)
def test_choose_threads(reserved: float | None, configured: int | None, cpus: int | None, expected: int) -> None:
    assert choose_threads(reserved, configured, cpus) == expected


# --- the xllamacpp server's own rules -------------------------------------------------------------


def test_extra_llama_flags_are_mapped_or_refused() -> None:
    import xllamacpp

    from llmgw.agent.engines.xllama_server import apply_extra_args

    params = xllamacpp.CommonParams()
    apply_extra_args(params, ["-ngl", "0", "--temp=0.5", "--pooling", "cls", "--no-warmup", "--metrics", "-ub", "64"])
    assert params.n_gpu_layers == 0
    assert params.sampling.temp == pytest.approx(0.5)
    assert params.pooling_type == xllamacpp.llama_pooling_type.LLAMA_POOLING_TYPE_CLS
    assert params.warmup is False and params.endpoint_metrics is True
    assert params.n_ubatch == 64
    with pytest.raises(ValueError, match="unsupported"):
        apply_extra_args(params, ["--rpc", "host:1"])
    with pytest.raises(ValueError, match="needs a value"):
        apply_extra_args(params, ["--temp"])
    with pytest.raises(ValueError, match="--pooling"):
        apply_extra_args(params, ["--pooling", "median"])


def test_pooling_is_read_from_the_gguf(tmp_path: Path) -> None:
    from llmgw.agent.engines.xllama_server import declares_pooling

    assert declares_pooling(str(write_tiny_gguf(tmp_path / "chat.gguf"))) is False
    assert declares_pooling(str(corrupt_gguf(tmp_path / "bad.gguf"))) is False
    writer = gguf.GGUFWriter(str(tmp_path / "embed.gguf"), "bert")
    writer.add_pooling_type(gguf.PoolingType.CLS)
    writer.add_tensor("x", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert declares_pooling(str(tmp_path / "embed.gguf")) is True


def test_tiny_gguf_is_small_and_deterministic(tmp_path: Path) -> None:
    a = write_tiny_gguf(tmp_path / "a.gguf", seed=1)
    b = write_tiny_gguf(tmp_path / "b.gguf", seed=1)
    assert a.stat().st_size < 1_000_000
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != write_tiny_gguf(tmp_path / "c.gguf", seed=2).read_bytes()


def test_the_server_refuses_to_start_without_a_key(tiny_model: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != XLLAMA_KEY_ENV}
    launch = llamacpp_launch(
        str(tiny_model),
        host="127.0.0.1",
        port=free_port(),
        threads=1,
        ctx_size=1024,
        key=KEY,
        llama_server_binary=None,
        python=sys.executable,
    )
    done = subprocess.run(launch.argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert XLLAMA_KEY_ENV in done.stderr


# --- the real engine ------------------------------------------------------------------------------


class EngineProcess:
    """An engine child in its own process group, its output in a log file."""

    def __init__(self, launch: EngineLaunch, port: int, log_path: Path) -> None:
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")  # closed in stop()
        self.spawned_at = time.monotonic()
        self.proc = subprocess.Popen(
            launch.argv,
            env={**os.environ, **launch.env},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group: the agent may die, the engine lives on (FLEET-5)
        )
        self.healthy_after_s: float | None = None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    async def wait_healthy(self) -> EngineProcess:
        try:
            await wait_healthy(self.base_url, key=KEY, deadline_s=STARTUP_DEADLINE_S, proc_alive=self.alive)
        except Exception as e:
            raise AssertionError(f"{e}\n--- engine log ---\n{self.log_tail()}") from e
        self.healthy_after_s = time.monotonic() - self.spawned_at
        print(f"engine on :{self.port} healthy {self.healthy_after_s * 1000:.0f} ms after spawn")
        return self

    def stop(self, grace_s: float = 15.0) -> int:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):  # it may end between the check and the signal
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def _start(model: Path, log_dir: Path, *, embeddings: bool = False, alias: str | None = "tiny") -> EngineProcess:
    port = free_port()
    launch = llamacpp_launch(
        str(model),
        host="127.0.0.1",
        port=port,
        threads=2,
        parallel=4,
        ctx_size=1024,
        key=KEY,
        embeddings=embeddings,
        alias=alias,
        llama_server_binary=None,
        python=sys.executable,
    )
    return EngineProcess(launch, port, log_dir / f"engine-{port}.log")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("models") / "tiny.gguf")


@pytest.fixture(scope="module")
async def engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[EngineProcess]:
    proc = _start(tiny_model, tmp_path_factory.mktemp("engine"))
    try:
        yield await proc.wait_healthy()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
async def embedding_engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[EngineProcess]:
    proc = _start(tiny_model, tmp_path_factory.mktemp("engine"), embeddings=True)
    try:
        yield await proc.wait_healthy()
    finally:
        proc.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


def _auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Why is the sky blue?"}], "max_tokens": 8}


async def test_chat_completion_reports_usage_and_finish_reason(
    engine: EngineProcess, http: aiohttp.ClientSession
) -> None:
    async with http.post(f"{engine.base_url}/v1/chat/completions", json=CHAT, headers=_auth()) as resp:
        assert resp.status == 200, await resp.text()
        body = await resp.json()
    assert body["object"] == "chat.completion"
    usage = body["usage"]
    assert usage["prompt_tokens"] > 0
    assert 0 < usage["completion_tokens"] <= CHAT["max_tokens"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    (choice,) = body["choices"]
    assert choice["finish_reason"] in {"length", "stop"}
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)


async def _sse_events(resp: aiohttp.ClientResponse) -> list[str]:
    """The ``data:`` payloads of an SSE body, checking the framing on the way."""
    events: list[str] = []
    buffer = b""
    async for chunk in resp.content.iter_any():
        buffer += chunk
    for block in buffer.decode().split("\n\n"):
        if not block.strip():
            continue
        for line in block.splitlines():
            assert line.startswith("data: "), f"not an SSE data line: {line!r}"
            events.append(line.removeprefix("data: "))
    return events


async def test_streaming_chat_is_sse_with_a_usage_chunk_and_done(
    engine: EngineProcess, http: aiohttp.ClientSession
) -> None:
    request = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    async with http.post(f"{engine.base_url}/v1/chat/completions", json=request, headers=_auth()) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = await _sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks and all(c["object"] == "chat.completion.chunk" for c in chunks)
    finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch.get("finish_reason")]
    assert finishes and finishes[-1] in {"length", "stop"}
    usages = [c["usage"] for c in chunks if c.get("usage")]
    assert usages, "no usage chunk although include_usage was asked for"
    assert usages[-1]["prompt_tokens"] > 0 and usages[-1]["completion_tokens"] > 0
    # The usage chunk is the last one, with no choices (OpenAI's shape).
    assert chunks[-1].get("usage") and chunks[-1]["choices"] == []


async def test_text_completion(engine: EngineProcess, http: aiohttp.ClientSession) -> None:
    request = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 5}
    async with http.post(f"{engine.base_url}/v1/completions", json=request, headers=_auth()) as resp:
        assert resp.status == 200, await resp.text()
        body = await resp.json()
    assert body["object"] == "text_completion"
    (choice,) = body["choices"]
    assert isinstance(choice["text"], str)
    assert choice["finish_reason"] in {"length", "stop"}
    assert body["usage"]["prompt_tokens"] > 0 and 0 < body["usage"]["completion_tokens"] <= 5


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/embeddings"),
        ("GET", "/v1/models"),
        ("GET", "/props"),
        ("GET", "/slots"),
    ],
)
async def test_requests_without_the_key_are_refused(
    engine: EngineProcess, http: aiohttp.ClientSession, method: str, path: str
) -> None:
    for headers in ({}, _auth("not-the-key")):
        async with http.request(method, f"{engine.base_url}{path}", json=CHAT, headers=headers) as resp:
            assert resp.status == 401, f"{method} {path} with {headers}: {resp.status}"


async def test_health_is_public(engine: EngineProcess, http: aiohttp.ClientSession) -> None:
    for path in ("/health", "/v1/health"):
        async with http.get(f"{engine.base_url}{path}") as resp:
            assert resp.status == 200
    assert await probe(engine.base_url, KEY)
    assert await probe(engine.base_url, "")


async def test_models_reports_the_alias(engine: EngineProcess, http: aiohttp.ClientSession) -> None:
    async with http.get(f"{engine.base_url}/v1/models", headers=_auth()) as resp:
        assert resp.status == 200
        body = await resp.json()
    assert [m["id"] for m in body["data"]] == ["tiny"]


async def test_embeddings_engine_returns_a_vector(embedding_engine: EngineProcess, http: aiohttp.ClientSession) -> None:
    request = {"model": "tiny", "input": ["hello world", "the sky is blue"]}
    async with http.post(f"{embedding_engine.base_url}/v1/embeddings", json=request, headers=_auth()) as resp:
        assert resp.status == 200, await resp.text()
        body = await resp.json()
    assert [d["index"] for d in body["data"]] == [0, 1]
    for item in body["data"]:
        vector = item["embedding"]
        assert len(vector) == WIDTH and all(isinstance(x, float) for x in vector)
        assert any(x != 0.0 for x in vector)
    assert body["usage"]["prompt_tokens"] > 0


async def test_a_corrupt_gguf_exits_non_zero_saying_it_failed_to_load(tmp_path: Path) -> None:
    proc = _start(corrupt_gguf(tmp_path / "corrupt.gguf"), tmp_path)
    try:
        with pytest.raises(EngineExited):
            await wait_healthy(proc.base_url, key=KEY, deadline_s=STARTUP_DEADLINE_S, proc_alive=proc.alive)
        assert proc.proc.wait(30) != 0
        assert "failed to load model" in proc.log_tail()
    finally:
        proc.stop()


def test_a_taken_port_is_reported_as_such(tiny_model: Path, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        launch = llamacpp_launch(
            str(tiny_model),
            host="127.0.0.1",
            port=port,
            threads=1,
            ctx_size=1024,
            key=KEY,
            llama_server_binary=None,
            python=sys.executable,
        )
        done = subprocess.run(launch.argv, env={**os.environ, **launch.env}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr


async def test_sigterm_stops_the_engine_cleanly(tiny_model: Path, tmp_path: Path) -> None:
    proc = await _start(tiny_model, tmp_path).wait_healthy()
    try:
        # /health answers as soon as llama.cpp has loaded; the clean-stop handler is installed just
        # after, and the process says "ready" then (before it, a stop ends it at once, by design).
        await wait_until(lambda: "ready on" in proc.log_tail(), what="the engine to say it is ready")
        os.killpg(proc.proc.pid, signal.SIGTERM)
        assert proc.proc.wait(30) == 0, proc.log_tail()
        assert "stopped" in proc.log_tail()
        assert not await probe(proc.base_url, KEY)
    finally:
        proc.stop()


async def test_a_client_holding_a_connection_open_does_not_keep_a_stopped_engine_alive(
    tiny_model: Path, tmp_path: Path
) -> None:
    proc = await _start(tiny_model, tmp_path).wait_healthy()
    try:
        await wait_until(lambda: "ready on" in proc.log_tail(), what="the engine to say it is ready")
        port = int(proc.base_url.rsplit(":", 1)[1])
        # A keep-alive connection after one answered request, and one that never sent a byte.
        with socket.create_connection(("127.0.0.1", port)) as kept, socket.create_connection(("127.0.0.1", port)):
            kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\n\r\n")
            assert kept.recv(4096).startswith(b"HTTP/1.1 200")
            os.killpg(proc.proc.pid, signal.SIGTERM)
            assert proc.proc.wait(30) == 0, proc.log_tail()
        assert "stopped" in proc.log_tail()
    finally:
        proc.stop()


async def test_wait_healthy_gives_up_at_the_deadline() -> None:
    port = free_port()  # nothing listens there
    started = time.monotonic()
    with pytest.raises(EngineStartTimeout, match="not healthy"):
        await wait_healthy(f"http://127.0.0.1:{port}", key=KEY, deadline_s=0.5, proc_alive=lambda: True)
    assert time.monotonic() - started < 5
