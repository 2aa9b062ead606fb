"""A simulated engine: llama.cpp's HTTP surface as the router uses it, with no model behind it.

    .venv/bin/python -m tests.bench.simengine --port 9000 --key KEY [--ttft-ms 0] [--tokens 16] [--tokens-per-s 0]

``GET /health`` (public), ``GET /v1/models``, ``POST /v1/chat/completions`` and
``/v1/completions`` (a whole answer with ``usage``, or SSE ``data: {...}`` chunks — the role chunk
with the first token, one chunk per token, a ``finish_reason`` chunk, a usage chunk when
``stream_options.include_usage`` is set, then ``data: [DONE]``), ``POST /v1/embeddings``; every
``/v1`` route wants ``Authorization: Bearer KEY`` and answers llama.cpp's 401 otherwise. The
chunks have llama.cpp's shape and about its size.

Latency is configurable: ``--ttft-ms`` before the first token (``--jitter 0.5``: each answer's is
drawn from ±50% of it), ``--tokens-per-s`` after it (0: as fast as the socket takes them),
``--tokens`` per answer (fewer when ``max_tokens`` asks for fewer).
It stands in for the engine in benchmarks and scale simulations only, never in functional tests
(ARCHITECTURE §8). Run as its own process, so it never shares an event loop with what it serves.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import random
import signal
import time
from typing import Any

import msgspec
from aiohttp import web

_dec = msgspec.json.Decoder()
_enc = msgspec.json.Encoder()
_UNAUTHORIZED = b'{"error":{"code":401,"message":"Invalid API Key","type":"authentication_error"}}'
_DONE = b"data: [DONE]\n\n"
_WORDS = [f" w{i}".encode() for i in range(64)]
_FINGERPRINT = "b0-sim"


class SimConfig(msgspec.Struct, frozen=True, kw_only=True):
    key: str
    ttft_s: float = 0.0
    tokens: int = 16
    tokens_per_s: float = 0.0  # 0: no pacing
    jitter: float = 0.0  # each answer's time to first token is ttft_s × uniform(1 - jitter, 1 + jitter)
    embedding_dim: int = 64
    model: str = "sim"


class SimEngine:
    """The handlers; one instance per process."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self._auth = f"Bearer {cfg.key}"
        self._ids = itertools.count(1)
        self._rng = random.Random(0)
        self._embedding = _enc.encode([round(0.01 * (i % 97) - 0.48, 4) for i in range(cfg.embedding_dim)])
        self.served = 0

    def app(self) -> web.Application:
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/embeddings", self.embeddings)
        return app

    # -- helpers -----------------------------------------------------------------------------

    def _authorized(self, request: web.Request) -> bool:
        return request.headers.get("Authorization") == self._auth

    async def _body(self, request: web.Request) -> dict[str, Any] | None:
        try:
            body = _dec.decode(await request.read())
        except msgspec.DecodeError:
            return None
        return body if isinstance(body, dict) else None

    def _n_tokens(self, body: dict[str, Any]) -> int:
        n = self.cfg.tokens
        for field in ("max_tokens", "max_completion_tokens", "n_predict"):
            v = body.get(field)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                n = min(n, v)
        return max(n, 1)

    @staticmethod
    def _prompt_tokens(body: dict[str, Any]) -> int:
        chars = 0
        messages = body.get("messages")
        if isinstance(messages, list):
            for m in messages:
                c = m.get("content") if isinstance(m, dict) else None
                chars += len(c) if isinstance(c, str) else 0
            return max(1, chars // 4) + 5 * len(messages) + 3  # ChatML markers, as a template adds
        value = body.get("prompt", body.get("input"))
        if isinstance(value, str):
            return max(1, len(value) // 4)
        if isinstance(value, list):
            return max(1, sum(len(v) for v in value if isinstance(v, str)) // 4)
        return 1

    def _ttft(self) -> float:
        """This answer's time to first token."""
        if not self.cfg.jitter:
            return self.cfg.ttft_s
        return self.cfg.ttft_s * (1 + self.cfg.jitter * (2 * self._rng.random() - 1))

    async def _pace(self, started: float, ttft_s: float, token_index: int) -> None:
        """Sleep until token ``token_index`` (0-based) is due."""
        due = started + ttft_s
        if self.cfg.tokens_per_s > 0:
            due += token_index / self.cfg.tokens_per_s
        delay = due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)

    @staticmethod
    def _unauthorized() -> web.Response:
        return web.Response(body=_UNAUTHORIZED, status=401, content_type="application/json")

    @staticmethod
    def _bad(message: str) -> web.Response:
        body = _enc.encode({"error": {"code": 400, "message": message, "type": "invalid_request_error"}})
        return web.Response(body=body, status=400, content_type="application/json")

    # -- routes ------------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(body=b'{"status":"ok"}', content_type="application/json")

    async def models(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return self._unauthorized()
        body = {"object": "list", "data": [{"id": self.cfg.model, "object": "model", "owned_by": "llamacpp"}]}
        return web.Response(body=_enc.encode(body), content_type="application/json")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        started = time.monotonic()
        if not self._authorized(request):
            return self._unauthorized()
        body = await self._body(request)
        if body is None:
            return self._bad("the body is not a JSON object")
        if chat and not isinstance(body.get("messages"), list):
            return self._bad("'messages' is required")
        if not chat and "prompt" not in body:
            return self._bad("'prompt' is required")
        self.served += 1
        n = self._n_tokens(body)
        prompt = self._prompt_tokens(body)
        usage = {"completion_tokens": n, "prompt_tokens": prompt, "total_tokens": n + prompt}
        model = body.get("model") if isinstance(body.get("model"), str) else self.cfg.model
        created = int(time.time())
        rid = f"{'chatcmpl' if chat else 'cmpl'}-sim{next(self._ids):012d}"
        ttft = self._ttft()
        if body.get("stream") is True:
            opts = body.get("stream_options")
            with_usage = isinstance(opts, dict) and opts.get("include_usage") is True
            return await self._stream(
                request, started, ttft, chat, n, usage if with_usage else None, model, created, rid
            )
        await self._pace(started, ttft, n - 1)
        text = "".join(w.decode() for w in itertools.islice(itertools.cycle(_WORDS), n))
        if chat:
            choice: dict[str, Any] = {
                "finish_reason": "length",
                "index": 0,
                "message": {"role": "assistant", "content": text},
            }
            obj = "chat.completion"
        else:
            choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": "length"}
            obj = "text_completion"
        answer = {
            "choices": [choice],
            "created": created,
            "model": model,
            "system_fingerprint": _FINGERPRINT,
            "object": obj,
            "usage": usage,
            "id": rid,
        }
        return web.Response(body=_enc.encode(answer), content_type="application/json")

    async def _stream(
        self,
        request: web.Request,
        started: float,
        ttft: float,
        chat: bool,
        n: int,
        usage: dict[str, int] | None,
        model: str,
        created: int,
        rid: str,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-Accel-Buffering": "no"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"
        tail = (
            f'],"created":{created},"id":"{rid}","model":{_enc.encode(model).decode()},'
            f'"system_fingerprint":"{_FINGERPRINT}","object":"{obj}"'
        ).encode()

        def chunk(choice: bytes, extra: bytes = b"") -> bytes:
            return b'data: {"choices":[' + choice + tail + extra + b"}\n\n"

        await self._pace(started, ttft, 0)
        if chat:
            first = chunk(b'{"finish_reason":null,"index":0,"delta":{"role":"assistant","content":null}}')
        else:
            first = b""
        for i in range(n):
            if i:
                await self._pace(started, ttft, i)
            word = _WORDS[i % len(_WORDS)]
            if chat:
                piece = b'{"finish_reason":null,"index":0,"delta":{"content":"' + word + b'"}}'
            else:
                piece = b'{"text":"' + word + b'","index":0,"logprobs":null,"finish_reason":null}'
            await resp.write(first + chunk(piece))
            first = b""
        if chat:
            last = chunk(b'{"finish_reason":"length","index":0,"delta":{}}')
        else:
            last = chunk(b'{"text":"","index":0,"logprobs":null,"finish_reason":"length"}')
        if usage is not None:
            last += chunk(b"", b',"usage":' + _enc.encode(usage))
        await resp.write(last + _DONE)
        await resp.write_eof()
        return resp

    async def embeddings(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return self._unauthorized()
        body = await self._body(request)
        if body is None or "input" not in body:
            return self._bad("'input' is required")
        self.served += 1
        value = body["input"]
        inputs = value if isinstance(value, list) else [value]
        prompt = self._prompt_tokens(body)
        parts = [
            b'{"object":"embedding","index":' + str(i).encode() + b',"embedding":' + self._embedding + b"}"
            for i in range(len(inputs))
        ]
        model = body.get("model") if isinstance(body.get("model"), str) else self.cfg.model
        data = (
            b'{"object":"list","data":['
            + b",".join(parts)
            + b'],"model":'
            + _enc.encode(model)
            + b',"usage":{"prompt_tokens":'
            + str(prompt).encode()
            + b',"total_tokens":'
            + str(prompt).encode()
            + b"}}"
        )
        return web.Response(body=data, content_type="application/json")


async def serve(cfg: SimConfig, host: str, port: int, stop: asyncio.Event) -> None:
    """Serve until ``stop`` is set."""
    runner = web.AppRunner(SimEngine(cfg).app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    print(f"simengine listening on http://{host}:{port}", flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.simengine", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--key", required=True, help="the Bearer key every /v1 request must carry")
    parser.add_argument("--ttft-ms", type=float, default=0.0, help="milliseconds before the first token")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per answer (fewer if max_tokens asks)")
    parser.add_argument("--tokens-per-s", type=float, default=0.0, help="token rate after the first (0: unpaced)")
    parser.add_argument("--jitter", type=float, default=0.0, help="time to first token varies by ± this fraction")
    parser.add_argument("--model", default="sim", help="the model name /v1/models reports")
    args = parser.parse_args(argv)
    cfg = SimConfig(
        key=args.key,
        ttft_s=args.ttft_ms / 1000,
        tokens=args.tokens,
        tokens_per_s=args.tokens_per_s,
        jitter=args.jitter,
        model=args.model,
    )

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        await serve(cfg, args.host, args.port, stop)

    asyncio.run(run())


if __name__ == "__main__":
    main()
