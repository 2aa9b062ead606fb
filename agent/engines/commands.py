"""How to start an engine: pure builders of argv and environment, no I/O (FLEET-5, GW-7).

The engine key travels only in the environment: argv is world-readable (``ps``, /proc/PID/cmdline)
while /proc/PID/environ is readable by the owner alone. Each builder refuses a key that would end
up in argv. ``EngineLaunch.env`` holds only what to add to the agent's environment.

- llama.cpp, ``llama-server`` binary: reads ``LLAMA_API_KEY`` (llama.cpp ``common/arg.cpp``:
  ``--api-key`` is declared with ``set_env("LLAMA_API_KEY")``).
- llama.cpp, no binary: ``python -m llmgw.agent.engines.xllama_server`` reads ``LLMGW_ENGINE_KEY``.
- vLLM: ``vllm serve`` reads ``VLLM_API_KEY`` (vLLM docs: "--api-key or environment variable
  VLLM_API_KEY"). vLLM checks it only under ``/v1`` (and a few other prefixes); its other routes
  stay open, so a vLLM engine must listen on an address only the router reaches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec

XLLAMA_MODULE = "llmgw.agent.engines.xllama_server"
XLLAMA_KEY_ENV = "LLMGW_ENGINE_KEY"
LLAMA_SERVER_KEY_ENV = "LLAMA_API_KEY"
VLLM_KEY_ENV = "VLLM_API_KEY"
DEFAULT_PARALLEL = 4  # llama.cpp slots per replica (FLEET-5)
# llama.cpp keeps the KV state of earlier prompts in host memory to reuse them (its prompt cache);
# it grows to --cache-ram MiB, 8192 unless told. The agent bounds it by the replica's reservation.
PROMPT_CACHE_DEFAULT_MIB = 1024  # for a replica that reserves no memory
PROMPT_CACHE_MIN_MIB = 64
PROMPT_CACHE_MAX_MIB = 8192
PROMPT_CACHE_FLAGS = ("--cache-ram", "-cram")
# Jinja chat templates: the GGUF's own template rendered as the model was trained, tools included,
# and the grammar that holds a call to the template's syntax (tool_choice "required"). A profile
# that names either flag keeps its choice.
JINJA_FLAGS = ("--jinja", "--no-jinja")


class EngineLaunch(msgspec.Struct, frozen=True, kw_only=True):
    """A process to start: its argv, and the variables to add to the agent's environment."""

    argv: list[str]
    env: dict[str, str]


def choose_threads(reserved_cores: float | None, configured: int | None, cpus: int | None) -> int:
    """``--threads`` for a llama.cpp engine (FLEET-5), always at least 1.

    The replica's reserved cores (rounded down: more threads than reserved cores would take
    cores another replica holds), else the agent's configured ``llamacpp.threads``, else half
    the node's CPUs. Missing or non-positive values count as absent.
    """
    if reserved_cores is not None and reserved_cores > 0:
        return max(1, math.floor(reserved_cores))
    if configured is not None and configured > 0:
        return configured
    if cpus is not None and cpus > 0:
        return max(1, cpus // 2)
    return 1


def _check_key(key: str, argv: Sequence[str]) -> None:
    if not key:
        raise ValueError("an engine needs a key (GW-7): refusing to start one that accepts anyone")
    # Whole arguments and "--flag=KEY" always; substrings once the key is long enough that a match
    # is the key itself rather than a coincidence (a test's "k" is in "/work").
    if any(arg == key or arg.endswith("=" + key) or (len(key) >= 8 and key in arg) for arg in argv):
        raise ValueError("the engine key must not appear in argv (it is world-readable); pass it in the environment")


def prompt_cache_mib(min_memory_gb: float | None) -> int:
    """The bound on llama.cpp's prompt cache for a replica reserving ``min_memory_gb`` of host memory:
    a quarter of the reservation (the rest is for the weights and the slots' own KV cache), within
    64 MiB..8 GiB; 1 GiB when the replica reserves nothing."""
    if not min_memory_gb or min_memory_gb <= 0:
        return PROMPT_CACHE_DEFAULT_MIB
    return max(PROMPT_CACHE_MIN_MIB, min(PROMPT_CACHE_MAX_MIB, int(min_memory_gb * 1024 / 4)))


def with_prompt_cache_bound(extra_args: Sequence[str], min_memory_gb: float | None) -> list[str]:
    """``extra_args`` with ``--cache-ram`` added, unless the profile sets it itself (it wins)."""
    extra = list(extra_args)
    if any(a in PROMPT_CACHE_FLAGS or a.startswith("--cache-ram=") for a in extra):
        return extra
    return [*extra, "--cache-ram", str(prompt_cache_mib(min_memory_gb))]


def with_chat_templates(extra_args: Sequence[str]) -> list[str]:
    """``extra_args`` with ``--jinja`` added, unless the profile says ``--jinja`` or ``--no-jinja``."""
    extra = list(extra_args)
    if any(a in JINJA_FLAGS for a in extra):
        return extra
    return [*extra, "--jinja"]


def vllm_tool_args(tool_parser: str | None, extra_args: Sequence[str]) -> list[str]:
    """vLLM's flags for tool calls with ``tool_parser`` (``hermes``, ``llama3_json``, ``mistral``…):
    ``--enable-auto-tool-choice --tool-call-parser NAME``; none without a parser, and none when the
    profile's own args already name a parser (they win)."""
    if not tool_parser or any(a == "--tool-call-parser" or a.startswith("--tool-call-parser=") for a in extra_args):
        return []
    flags = [] if "--enable-auto-tool-choice" in extra_args else ["--enable-auto-tool-choice"]
    return [*flags, "--tool-call-parser", tool_parser]


def llamacpp_launch(
    model_path: str,
    *,
    host: str,
    port: int,
    threads: int,
    parallel: int = DEFAULT_PARALLEL,
    ctx_size: int,
    key: str,
    extra_args: Sequence[str] = (),
    embeddings: bool = False,
    alias: str | None = None,
    llama_server_binary: str | None,
    python: str,
) -> EngineLaunch:
    """A llama.cpp engine: ``llama_server_binary`` when the node has one, else the xllamacpp server.

    ``ctx_size`` is llama.cpp's ``--ctx-size``: KV-cache tokens shared by all ``parallel`` slots.
    ``extra_args`` are llama.cpp server flags, appended as they are (after ``--`` for the
    xllamacpp server, which accepts the subset it can map). With ``embeddings``, the xllamacpp
    server pools by mean when the GGUF declares no pooling; ``llama-server`` does not, so a chat
    model behind the binary needs ``("--pooling", "mean")`` in ``extra_args`` for ``/v1/embeddings``.
    """
    if threads < 1 or parallel < 1 or ctx_size < 0:
        raise ValueError(f"threads ({threads}) and parallel ({parallel}) must be >= 1, ctx_size >= 0")
    common = [
        "--host",
        host,
        "--port",
        str(port),
        "--threads",
        str(threads),
        "--parallel",
        str(parallel),
        "--ctx-size",
        str(ctx_size),
    ]
    if embeddings:
        common.append("--embeddings")
    if alias:
        common += ["--alias", alias]
    if llama_server_binary:
        # --metrics: the agent reads the engine's load from /metrics (SCHED-9); the xllamacpp server has it on.
        argv = [llama_server_binary, "-m", model_path, *common, "--metrics", *extra_args]
        env = {LLAMA_SERVER_KEY_ENV: key}
    else:
        argv = [python, "-m", XLLAMA_MODULE, "--model", model_path, *common]
        if extra_args:
            argv += ["--", *extra_args]
        env = {XLLAMA_KEY_ENV: key}
    _check_key(key, argv)
    return EngineLaunch(argv=argv, env=env)


def vllm_launch(
    model_path: str,
    *,
    host: str,
    port: int,
    gpus: list[int],
    tensor_parallel: int,
    key: str,
    served_name: str,
    extra_args: Sequence[str] = (),
    max_model_len: int | None = None,
    vllm_binary: str = "vllm",
    tool_parser: str | None = None,
) -> EngineLaunch:
    """A vLLM engine on the assigned GPUs: ``vllm serve PATH … --tensor-parallel-size N``.

    ``tool_parser`` (the profile's) turns on tool calls: vLLM reads calls out of the model's text
    with that parser (:func:`vllm_tool_args`).

    ``CUDA_VISIBLE_DEVICES`` names the assigned GPUs (node indices), so vLLM's device 0 is the
    first of them and it cannot touch another replica's GPUs.
    """
    if tensor_parallel < 1:
        raise ValueError(f"tensor_parallel must be >= 1, got {tensor_parallel}")
    if len(gpus) < tensor_parallel:
        raise ValueError(f"tensor_parallel {tensor_parallel} needs that many GPUs; assigned {gpus}")
    if len(set(gpus)) != len(gpus) or any(g < 0 for g in gpus):
        raise ValueError(f"GPU indices must be distinct and non-negative: {gpus}")
    argv = [
        vllm_binary,
        "serve",
        model_path,
        "--host",
        host,
        "--port",
        str(port),
        "--tensor-parallel-size",
        str(tensor_parallel),
        "--served-model-name",
        served_name,
    ]
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    argv += [*vllm_tool_args(tool_parser, extra_args), *extra_args]
    _check_key(key, argv)
    env = {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpus), VLLM_KEY_ENV: key}
    return EngineLaunch(argv=argv, env=env)
