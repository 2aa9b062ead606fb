"""llama.cpp's own HTTP server, from the ``xllamacpp`` wheel, as an engine process (ARCHITECTURE §8).

    LLMGW_ENGINE_KEY=… python -m llmgw.agent.engines.xllama_server --model PATH --host 127.0.0.1 \
        --port N --threads N --parallel 4 --ctx-size N [--embeddings] [--alias NAME] [-- EXTRA…]

For nodes without a ``llama-server`` binary. ``xllamacpp.Server(params)`` runs llama.cpp's server
(``tools/server``: the same routes, the same API-key middleware) on C++ threads inside this
process: it binds the HTTP port first (``/health`` answers 503 while loading), loads the model,
and returns once it is ready, raising if either fails. The process then only waits for SIGTERM or
SIGINT; dropping the ``Server`` terminates its loop and joins its threads.

The key comes from ``LLMGW_ENGINE_KEY`` (never argv, which every local user can read) and becomes
llama.cpp's API key: requests without ``Authorization: Bearer <key>`` get 401. llama.cpp leaves
``/health`` and ``/v1/health`` public (so probes need no key); every other route (completions,
chat, embeddings, ``/v1/models``, ``/props``, ``/metrics``, ``/slots``, tokenize…) needs the key.
The web UI is turned off: an engine is an API.

``EXTRA`` are llama.cpp server flags. ``xllamacpp`` exposes llama.cpp's parameters but not its
argument parser, so the flags below are mapped onto ``CommonParams`` here; anything else is refused
at start (exit 2) rather than silently ignored.

Exit status: 0 after a signal-requested stop, 1 when the model or the port fails (the last stderr
lines say why), 2 for bad arguments. A stop requested while the model loads ends the process at
once (the default signal action): loading holds the interpreter, so no handler could run anyway.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

KEY_ENV = "LLMGW_ENGINE_KEY"
# llama.cpp registers these without the API-key check (tools/server: "public endpoint").
PUBLIC_PATHS: tuple[str, ...] = ("/health", "/v1/health")

_PREFIX = "xllama_server:"
# How long a requested stop waits for llama.cpp to wind down before the process ends itself.
STOP_GRACE_S = 5.0


class ServerArgs(msgspec.Struct, frozen=True, kw_only=True):
    """What the command line asked for."""

    model: str
    host: str
    port: int
    threads: int
    parallel: int
    ctx_size: int
    embeddings: bool = False
    alias: str | None = None
    extra: list[str] = []


def parse_args(argv: Sequence[str]) -> ServerArgs:
    """Parse the command line; everything after ``--`` is llama.cpp flags (``extra``)."""
    argv = list(argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(
        prog="python -m llmgw.agent.engines.xllama_server",
        description="llama.cpp's HTTP server from the xllamacpp wheel. The API key is read from "
        f"${KEY_ENV}, never from the command line.",
        epilog="After --, llama.cpp server flags; supported: " + " ".join(SUPPORTED_EXTRA_FLAGS),
    )
    parser.add_argument("--model", "-m", required=True, help="GGUF file")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--threads", "-t", type=int, required=True)
    parser.add_argument("--parallel", "-np", type=int, default=4, help="slots (concurrent sequences)")
    parser.add_argument(
        "--ctx-size", "-c", type=int, required=True, help="KV cache tokens, shared by all slots (llama.cpp -c)"
    )
    parser.add_argument("--embeddings", action="store_true", help="serve /v1/embeddings")
    parser.add_argument("--alias", default=None, help="model name the engine reports")
    ns = parser.parse_args(argv)
    return ServerArgs(
        model=ns.model,
        host=ns.host,
        port=ns.port,
        threads=ns.threads,
        parallel=ns.parallel,
        ctx_size=ns.ctx_size,
        embeddings=ns.embeddings,
        alias=ns.alias,
        extra=extra,
    )


# --- llama.cpp flags after "--" ---------------------------------------------------------------


def _enum(enum_type: Any, prefix: str, value: str) -> Any:
    name = prefix + value.upper().replace("-", "_")
    try:
        return getattr(enum_type, name)
    except AttributeError:
        choices = sorted(m.name.removeprefix(prefix).lower() for m in enum_type)
        raise ValueError(f"{value!r} is not one of {', '.join(choices)}") from None


def _flash_attn(value: str) -> Any:
    import xllamacpp

    names = {"on": "ENABLED", "off": "DISABLED", "auto": "AUTO", "1": "ENABLED", "0": "DISABLED"}
    if value.lower() not in names:
        raise ValueError(f"{value!r} is not one of on, off, auto")
    return getattr(xllamacpp.llama_flash_attn_type, "LLAMA_FLASH_ATTN_TYPE_" + names[value.lower()])


def _ggml_type(value: str) -> Any:
    import xllamacpp

    return _enum(xllamacpp.ggml_type, "GGML_TYPE_", value)


def _pooling(value: str) -> Any:
    import xllamacpp

    return _enum(xllamacpp.llama_pooling_type, "LLAMA_POOLING_TYPE_", value)


def _set(path: str, convert: Callable[[str], Any]) -> Callable[[Any, str], None]:
    """A setter for a (dotted) CommonParams attribute."""

    def setter(params: Any, value: str) -> None:
        *parents, leaf = path.split(".")
        target = params
        for name in parents:
            target = getattr(target, name)
        setattr(target, leaf, convert(value))

    return setter


def _timeouts(params: Any, value: str) -> None:
    params.timeout_read = params.timeout_write = int(value)


# Flags that take a value, by every spelling llama-server accepts.
_VALUED: dict[str, Callable[[Any, str], None]] = {}
for _names, _setter in [
    (("-ngl", "--gpu-layers", "--n-gpu-layers"), _set("n_gpu_layers", int)),
    (("-b", "--batch-size"), _set("n_batch", int)),
    (("-ub", "--ubatch-size"), _set("n_ubatch", int)),
    (("-n", "--predict", "--n-predict"), _set("n_predict", int)),
    (("--keep",), _set("n_keep", int)),
    (("-tb", "--threads-batch"), _set("cpuparams_batch.n_threads", int)),
    (("--threads-http",), _set("n_threads_http", int)),
    (("-to", "--timeout"), _timeouts),
    (("--pooling",), _set("pooling_type", _pooling)),
    (("--embd-normalize",), _set("embd_normalize", int)),
    (("--chat-template",), _set("chat_template", str)),
    (("-fa", "--flash-attn"), _set("flash_attn_type", _flash_attn)),
    (("-ctk", "--cache-type-k"), _set("cache_type_k", _ggml_type)),
    (("-ctv", "--cache-type-v"), _set("cache_type_v", _ggml_type)),
    (("-s", "--seed"), _set("sampling.seed", int)),
    (("--temp",), _set("sampling.temp", float)),
    (("--top-k",), _set("sampling.top_k", int)),
    (("--top-p",), _set("sampling.top_p", float)),
    (("--min-p",), _set("sampling.min_p", float)),
    (("--rope-freq-base",), _set("rope_freq_base", float)),
    (("--rope-freq-scale",), _set("rope_freq_scale", float)),
    (("--cache-reuse",), _set("n_cache_reuse", int)),
    (("-cram", "--cache-ram"), _set("cache_ram_mib", int)),  # MiB of host memory for the prompt cache
    (("-lv", "--verbosity", "--log-verbosity"), _set("verbosity", int)),
    (("--sleep-idle-seconds",), _set("sleep_idle_seconds", int)),
]:
    for _name in _names:
        _VALUED[_name] = _setter

# Switches: flag -> (attribute, value).
_SWITCHES: dict[str, tuple[str, bool]] = {
    "--jinja": ("use_jinja", True),
    "--no-jinja": ("use_jinja", False),
    "-cb": ("cont_batching", True),
    "--cont-batching": ("cont_batching", True),
    "-nocb": ("cont_batching", False),
    "--no-cont-batching": ("cont_batching", False),
    "--no-warmup": ("warmup", False),
    "--metrics": ("endpoint_metrics", True),
    "--slots": ("endpoint_slots", True),
    "--no-slots": ("endpoint_slots", False),
    "--props": ("endpoint_props", True),
    "--context-shift": ("ctx_shift", True),
    "--no-context-shift": ("ctx_shift", False),
    "-kvu": ("kv_unified", True),
    "--kv-unified": ("kv_unified", True),
    "--no-kv-unified": ("kv_unified", False),
    "-nkvo": ("no_kv_offload", True),
    "--no-kv-offload": ("no_kv_offload", True),
    "--swa-full": ("swa_full", True),
    "--no-cache-prompt": ("cache_prompt", False),
}

SUPPORTED_EXTRA_FLAGS: tuple[str, ...] = tuple(sorted([*_VALUED, *_SWITCHES]))


def apply_extra_args(params: Any, extra: Sequence[str]) -> None:
    """Apply llama.cpp server flags to ``params``; ``ValueError`` names the first it cannot take."""
    i = 0
    while i < len(extra):
        flag, value = extra[i], None
        if flag.startswith("--") and "=" in flag:
            flag, value = flag.split("=", 1)
        if flag in _SWITCHES and value is None:
            name, on = _SWITCHES[flag]
            setattr(params, name, on)
            i += 1
            continue
        if flag not in _VALUED:
            raise ValueError(
                f"unsupported llama.cpp argument for the xllamacpp engine: {extra[i]!r} "
                f"(supported: {' '.join(SUPPORTED_EXTRA_FLAGS)})"
            )
        if value is None:
            if i + 1 >= len(extra):
                raise ValueError(f"llama.cpp argument {flag} needs a value")
            value = extra[i + 1]
            i += 1
        try:
            _VALUED[flag](params, value)
        except ValueError as e:
            raise ValueError(f"bad value for {flag}: {e}") from None
        i += 1


def declares_pooling(model_path: str) -> bool:
    """Whether the GGUF's metadata names a pooling type (embedding models do; chat models do not)."""
    try:
        from gguf import GGUFReader

        reader = GGUFReader(model_path)
        arch_field = reader.get_field("general.architecture")
        if arch_field is None:
            return False
        arch = arch_field.contents()
        return reader.get_field(f"{arch}.pooling_type") is not None
    except Exception:
        # Unreadable here (no gguf package, odd file): pool by mean; llama.cpp reports a bad file itself.
        return False


def build_params(args: ServerArgs, key: str) -> Any:
    """``xllamacpp.CommonParams`` for ``args``; ``ValueError`` for extra flags it cannot take."""
    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = args.model
    params.hostnames = [args.host]
    params.port = args.port
    params.api_keys = [key]
    params.n_parallel = args.parallel
    params.n_ctx = args.ctx_size
    params.cpuparams.n_threads = args.threads
    params.cpuparams_batch.n_threads = args.threads
    params.ui = False  # an engine is an API: no web UI on the port
    params.endpoint_metrics = True  # the agent reads the engine's load from /metrics (SCHED-9)
    if args.alias:
        params.model_alias = {args.alias}
    if args.embeddings:
        params.embedding = True
        if not declares_pooling(args.model):
            # A generative GGUF declares no pooling, so llama.cpp pools "none", which /v1/embeddings
            # refuses; mean pooling gives one vector per input. An embedding model keeps its own,
            # and an explicit --pooling in the extra flags wins over both.
            params.pooling_type = xllamacpp.llama_pooling_type.LLAMA_POOLING_TYPE_MEAN
    apply_extra_args(params, args.extra)
    return params


def _bind_error(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound now, or None: so a taken port is not reported as a bad model."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as llama.cpp's listener does
            s.bind((host, port))
    except OSError as e:
        return e.strerror or str(e)
    return None


def _say(message: str) -> None:
    # Its log is a file on the node's disk: a full disk must not stop the engine that serves.
    try:
        print(f"{_PREFIX} {message}", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    key = os.environ.pop(KEY_ENV, "")  # popped: nothing this process might spawn inherits it
    if not key:
        _say(f"refusing to start: ${KEY_ENV} is not set (the engine key never comes from argv)")
        return 2
    if not Path(args.model).is_file():
        _say(f"failed to load model {args.model}: no such file")
        return 1
    if (why := _bind_error(args.host, args.port)) is not None:
        _say(f"cannot listen on {args.host}:{args.port}: {why}")
        return 1
    # ggml's assertion handler would attach gdb for a backtrace: slow, and it buries the one line
    # that says what went wrong under pages the agent's log tail then shows instead.
    os.environ.setdefault("GGML_NO_BACKTRACE", "1")
    try:
        params = build_params(args, key)
    except ValueError as e:
        _say(str(e))
        return 2

    # While loading, a stop should end the process at once: the default action does that.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)

    import xllamacpp

    _say(f"loading {args.model} on {args.host}:{args.port}")
    try:
        server = xllamacpp.Server(params)
    except Exception as e:  # xllamacpp raises RuntimeError for any init failure; llama.cpp's log says why
        _say(f"failed to load model {args.model}: {e} (llama.cpp's log above says why)")
        return 1

    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    _say(f"ready on {server.listening_address}")
    # A timed wait: the signal may land on one of llama.cpp's threads, which would not interrupt an
    # untimed wait here; the Python handler still runs on this thread at the next check.
    while not stop.wait(0.2):
        pass

    # A second signal while llama.cpp winds down kills at once.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    _say("stopping")
    # ~Server joins llama.cpp's HTTP workers, and a worker blocked reading a client's idle
    # keep-alive connection only returns at the read timeout (minutes): a requested stop must not
    # wait on a client, so past a short grace the process ends itself, still with status 0.
    watchdog = threading.Timer(STOP_GRACE_S, _end_after_grace)
    watchdog.daemon = True
    watchdog.start()
    del server  # ~Server terminates the serving loop and joins its threads
    watchdog.cancel()
    _say("stopped")
    return 0


def _end_after_grace() -> None:
    _say(f"stopped: llama.cpp had not wound down after {STOP_GRACE_S:.0f} s (a client holding a connection open?)")
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
