"""How much memory a llama.cpp replica of a GGUF model needs (SPEC MIR-3), from its header. Pure.

The rule: the weights, plus the f16 KV cache for the context pool, plus 1 GiB and 5 % of the
weights for the engine itself (compute buffers, the CUDA/CPU runtime, fragmentation). The context
pool is llama.cpp's ``--ctx-size``, which ``--parallel`` divides among its slots rather than
multiplies. The KV cache is what varies most between models of one file size: grouped-query
attention keeps 8 KV heads where a model has 40 (a factor of five), and wide heads (Gemma-2's 256)
double it again; a flat "weights × 1.5 + 2 GB" over-counts small models (refusing placements that
fit) and under-counts wide ones (engines killed for memory).

That flat rule remains the fallback when the header gives no shape, or when the set is sharded
(the shards' headers are not read for it). "GB" here is what ``min_memory_gb`` holds: 2**30 bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import msgspec

from llmgw.modelfiles.gguf_header import GGUFHeader

GiB = 1024**3
F16_BYTES = 2  # llama.cpp's default KV cache type (--cache-type-k/-v f16)
ENGINE_BASE_BYTES = GiB
ENGINE_PERCENT = 5  # of the weights
FALLBACK_FACTOR = 1.5
FALLBACK_EXTRA_BYTES = 2 * GiB


class Estimate(msgspec.Struct, frozen=True, kw_only=True):
    """A replica's memory, by which rule, and its parts (GB = GiB, as ``min_memory_gb``)."""

    rule: Literal["kv-cache", "fallback"]
    total_bytes: int
    total_gb: float  # rounded up to 0.01, so a reservation made from it is never short
    weights_gb: float
    kv_cache_gb: float  # 0 under the fallback rule
    engine_gb: float  # 1 GiB + 5 % of the weights; under the fallback, the 0.5 × weights + 2 GB on top
    kv_bytes_per_token: int | None
    ctx_pool_tokens: int
    why_fallback: str = ""
    explanation: str  # one line a person reads


def kv_bytes_per_token(header: GGUFHeader) -> int | None:
    """Bytes of f16 KV cache per token of context, over all layers; None when the shape is unknown.

    Per layer: K is kv_heads × key_length values, V is kv_heads × value_length values, each value
    2 bytes. So layers × kv_heads × (key_length + value_length) × 2; with per-layer KV head counts
    (hybrid models whose recurrent layers keep none) the per-layer sum, as llama.cpp allocates.
    """
    if not header.has_shape:
        return None
    assert header.block_count and header.head_count_kv and header.key_length and header.value_length
    layers = header.block_count
    per_layer = header.head_count_kv_per_layer
    if per_layer and len(per_layer) >= layers:
        kv_heads_total = sum(per_layer[:layers])
    else:
        kv_heads_total = layers * header.head_count_kv  # one count for every layer (or a short list: its max)
    k_bytes = kv_heads_total * header.key_length * F16_BYTES
    v_bytes = kv_heads_total * header.value_length * F16_BYTES
    return k_bytes + v_bytes


def _gb(n: float) -> float:
    return round(n / GiB, 3)


def _first_header(headers: GGUFHeader | Sequence[GGUFHeader] | None) -> tuple[GGUFHeader | None, bool]:
    """The header that carries the model's metadata (the first shard's), and whether any says it is split."""
    if headers is None:
        return None, False
    if isinstance(headers, GGUFHeader):
        return headers, headers.is_split
    if not headers:
        return None, False
    first = next((h for h in headers if not h.split_no), headers[0])
    return first, len(headers) > 1 or any(h.is_split for h in headers)


def estimate_memory(
    header: GGUFHeader | Sequence[GGUFHeader] | None,
    weights_bytes: int,
    ctx_pool_tokens: int,
    sharded: bool = False,
) -> Estimate:
    """Memory for one replica: weights + f16 KV cache for ``ctx_pool_tokens`` + 1 GiB + 5 % of the
    weights; or weights × 1.5 + 2 GB when the shape is missing or the set is sharded.

    ``weights_bytes``: the GGUF set's size on disk (what llama.cpp maps). A header cut short still
    serves if its shape came before the cut.
    """
    if weights_bytes <= 0:
        raise ValueError(f"weights_bytes must be positive, not {weights_bytes}")
    if ctx_pool_tokens < 0:
        raise ValueError(f"ctx_pool_tokens must be >= 0, not {ctx_pool_tokens}")
    first, split = _first_header(header)
    per_token = kv_bytes_per_token(first) if first is not None else None
    why = ""
    if sharded or split:
        why = "the set is sharded"
    elif first is None:
        why = "no GGUF header was read"
    elif per_token is None:
        missing = [
            name
            for name, value in (
                ("block_count", first.block_count),
                ("head_count", first.head_count),
                ("embedding_length", first.embedding_length),
            )
            if not value
        ]
        where = f" ({first.stopped_at})" if not first.complete else ""
        why = f"the header gives no {', '.join(missing) or 'KV shape'}{where}"
    if why:
        total = int(weights_bytes * FALLBACK_FACTOR) + FALLBACK_EXTRA_BYTES
        return Estimate(
            rule="fallback",
            total_bytes=total,
            total_gb=_ceil_gb(total),
            weights_gb=_gb(weights_bytes),
            kv_cache_gb=0.0,
            engine_gb=_gb(total - weights_bytes),
            kv_bytes_per_token=per_token,
            ctx_pool_tokens=ctx_pool_tokens,
            why_fallback=why,
            explanation=(
                f"{_ceil_gb(total):.2f} GB = {_gb(weights_bytes):.2f} GB weights × 1.5 + 2 GB (the rough rule: {why})"
            ),
        )
    assert first is not None and per_token is not None
    kv = ctx_pool_tokens * per_token
    engine = ENGINE_BASE_BYTES + weights_bytes * ENGINE_PERCENT // 100
    total = weights_bytes + kv + engine
    return Estimate(
        rule="kv-cache",
        total_bytes=total,
        total_gb=_ceil_gb(total),
        weights_gb=_gb(weights_bytes),
        kv_cache_gb=_gb(kv),
        engine_gb=_gb(engine),
        kv_bytes_per_token=per_token,
        ctx_pool_tokens=ctx_pool_tokens,
        explanation=(
            f"{_ceil_gb(total):.2f} GB = {_gb(weights_bytes):.2f} GB weights + {_gb(kv):.2f} GB f16 KV cache "
            f"({ctx_pool_tokens} tokens × {per_token} B: {_heads_text(first)} × ({first.key_length} + "
            f"{first.value_length}) × 2 B) + 1 GB + 5 % of the weights for the engine"
        ),
    )


def _ceil_gb(n: int) -> float:
    return -(-n * 100 // GiB) / 100


def _heads_text(h: GGUFHeader) -> str:
    per_layer = h.head_count_kv_per_layer
    if per_layer and h.block_count and len(per_layer) >= h.block_count and len(set(per_layer[: h.block_count])) > 1:
        return f"{sum(per_layer[: h.block_count])} KV heads over {h.block_count} layers"
    return f"{h.block_count} layers × {h.head_count_kv} KV heads"
