"""A tiny random-weight llama GGUF that llama.cpp loads in milliseconds (ARCHITECTURE §8).

Written with ``gguf.GGUFWriter`` (llama.cpp's own writer), so the file is what llama.cpp expects
rather than what we think it expects. The weights are noise: tests assert on structure (token
counts, finish reasons, SSE framing, usage), never on text.

The vocabulary is SentencePiece-style (``tokenizer.ggml.model = "llama"``): special tokens, the
256 byte-fallback tokens ``<0x00>``..``<0xFF>`` (so any text tokenizes), ChatML markers, then
``▁``-prefixed word pieces up to ``vocab_size``. Embeddings need no different file: the engine is
started with its embedding flag instead.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

# ChatML, the shape most chat models use; enough for /v1/chat/completions to render messages.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# A Hermes-style template with tool support (what Qwen 2.5 and Hermes models ship): tools listed in a
# system turn, calls as <tool_call>{"name": …, "arguments": …}</tool_call>, results in a user turn as
# <tool_response>. llama.cpp reads the call syntax off the template itself and builds the grammar that
# holds the model to it, so a tool-capable GGUF needs nothing but this in tokenizer.chat_template.
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + tool_call.name + \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Word pieces a tool-capable GGUF adds, so a test can lean its noise weights towards opening a call
# (logit_bias on one token); as plain pieces, text never tokenizes into them.
TOOL_PIECES = ("<tool_call>\n", "</tool_call>")

UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
_SPECIALS = ["<unk>", "<s>", "</s>"]
_CHATML = ["<|im_start|>", "<|im_end|>"]
_WORDS = (
    "the an and of to in is it that for on with as was be by this are or at from you he she we they "
    "hello world model token test reply user assistant system yes no one two three cat dog sky blue why "
    "what how when where who can will would should could do does did have has had not but if then so"
).split()


def _vocab(vocab_size: int, extra_pieces: tuple[str, ...] = ()) -> tuple[list[str], list[float], list[int]]:
    tokens: list[str] = list(_SPECIALS)
    types: list[int] = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    tokens += _CHATML
    types += [gguf.TokenType.CONTROL] * len(_CHATML)
    # Word pieces: the space marker, lowercase letters with and without it, then whole words.
    pieces = [*extra_pieces, "▁"] + [f"▁{c}" for c in "abcdefghijklmnopqrstuvwxyz"] + list("abcdefghijklmnopqrstuvwxyz")
    pieces += [f"▁{w}" for w in _WORDS if len(w) > 1]  # one-letter words are already there
    minimum = len(tokens) + len(extra_pieces) + 1
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be at least {minimum} (specials + 256 byte tokens + ChatML + '▁')")
    n = 0
    while len(tokens) < vocab_size:
        piece = pieces[n] if n < len(pieces) else f"▁x{n}"  # filler; llama.cpp demands unique pieces
        tokens.append(piece)
        types.append(gguf.TokenType.NORMAL)
        n += 1
    # SentencePiece scores: higher merges first; byte and control tokens score 0.
    scores = [0.0 if t != gguf.TokenType.NORMAL else -float(i) for i, t in enumerate(types)]
    return tokens, scores, [int(t) for t in types]


def write_tiny_gguf(
    path: Path,
    *,
    seed: int = 0,
    layers: int = 2,
    width: int = 64,
    vocab_size: int = 320,
    context_length: int = 512,
    heads: int = 4,
    ffn: int | None = None,
    chat_template: str = CHAT_TEMPLATE,
    add_space_prefix: bool | None = None,
    extra_pieces: tuple[str, ...] = (),
) -> Path:
    """Write a random-weight llama GGUF to ``path`` and return it (about 0.5 MB at the defaults).

    ``add_space_prefix=False`` stops the tokenizer putting "▁" before text that follows a special
    token: llama.cpp replays the generation prompt (``<|im_start|>assistant\\n``) through a tool
    grammar, which a leading space would break. ``None`` leaves the key out (llama.cpp's default)."""
    if width % heads:
        raise ValueError(f"width {width} must be a multiple of heads {heads}")
    ffn = ffn or 2 * width
    head_dim = width // heads
    tokens, scores, types = _vocab(vocab_size, tuple(extra_pieces))
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        # numpy shape is GGUF's reversed: (rows = output features, cols = input features).
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("llmgw-tiny")
    writer.add_context_length(context_length)
    writer.add_embedding_length(width)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(UNK_ID)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    if add_space_prefix is not None:
        writer.add_add_space_prefix(add_space_prefix)
    writer.add_chat_template(chat_template)

    writer.add_tensor("token_embd.weight", w(len(tokens), width))
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", ones(width))
        writer.add_tensor(f"blk.{i}.attn_q.weight", w(heads * head_dim, width))
        writer.add_tensor(f"blk.{i}.attn_k.weight", w(heads * head_dim, width))
        writer.add_tensor(f"blk.{i}.attn_v.weight", w(heads * head_dim, width))
        writer.add_tensor(f"blk.{i}.attn_output.weight", w(width, heads * head_dim))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", ones(width))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", w(ffn, width))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", w(ffn, width))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", w(width, ffn))
    writer.add_tensor("output_norm.weight", ones(width))
    writer.add_tensor("output.weight", w(len(tokens), width))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_tool_gguf(path: Path, *, seed: int = 0) -> Path:
    """A tiny GGUF whose chat template supports tools (:data:`TOOL_CHAT_TEMPLATE`), with the
    :data:`TOOL_PIECES` in its vocabulary and a context long enough for tool definitions (the
    byte-level vocabulary spends about a token per character of their JSON)."""
    return write_tiny_gguf(
        path,
        seed=seed,
        context_length=4096,
        chat_template=TOOL_CHAT_TEMPLATE,
        add_space_prefix=False,
        extra_pieces=TOOL_PIECES,
    )


def corrupt_gguf(path: Path) -> Path:
    """Overwrite ``path`` with bytes llama.cpp refuses: a GGUF magic, an impossible version, garbage."""
    path = Path(path)
    path.write_bytes(b"GGUF" + (0xFFFF_FFFF).to_bytes(4, "little") + bytes(range(256)) * 4)
    return path
