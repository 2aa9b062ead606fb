"""A gateway in front of llama.cpp on a tiny GGUF with a tool-capable chat template, for the tests of tool
calls through /v1/chat/completions and /v1/responses."""

from __future__ import annotations

from pathlib import Path

import gguf

from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import models as M
from tests.fleet import Fleet
from tests.gguf_tiny import TOOL_PIECES
from tests.test_gateway import FAST_ROUTER, GATEWAY

TOOL_MODEL = "tiny-tools"


def leaning_to_a_call(model: Path) -> dict[str, int]:
    """``logit_bias`` (the SDKs' extra_body) that makes the noise model open a call at once, keep its
    strings short and end after it (``</s>`` only counts once the grammar lets the answer end); whether the
    call is well formed is the engine's grammar's and the gateway's work, not the bias's."""
    tokens = list(gguf.GGUFReader(str(model)).fields["tokenizer.ggml.tokens"].contents())
    return {str(tokens.index("</s>")): 100, str(tokens.index(TOOL_PIECES[0])): 50, str(tokens.index("<0x22>")): 40}


async def tool_gateway(store: EventStore, nats_url: str, base: Path, tool_model: Path) -> Fleet:
    """A gateway, an agent and ``tiny-tools`` ready on it (the caller stops the fleet)."""
    f = await Fleet(store, nats_url, base).start(services=GATEWAY, router=FAST_ROUTER)
    f.agent("n1")
    # A longer context than Fleet.add_model gives: the tools' JSON costs about a token per character.
    profile = M.Profile(engine="llamacpp", cpu_cores=1, min_memory_gb=0.05, ctx_size=8192, parallel=2)
    spec = M.ModelSpec(name=TOOL_MODEL, source=str(tool_model), scaling=M.Scaling(min=1), profiles=[profile])
    await f.command("add", M.AddModel(spec=spec))
    await f.wait_ready(TOOL_MODEL, 1)
    await f.router_caught_up()
    return f
