"""GGUF headers, memory sizing and GGUF set picking (SPEC MIR-3): llmgw.modelfiles.

Files are written by gguf-py's GGUFWriter (llama.cpp's own writer), so what is read back is what
llama.cpp would load; a few are written byte by byte where the writer cannot (empty arrays, wrong
types, a 128 MB array). Remote reads go to a local aiohttp server that honours Range and counts
what it serves.
"""

from __future__ import annotations

import contextlib
import os
import re
import struct
import tempfile
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import gguf
import msgspec
import numpy as np
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw.modelfiles.gguf_header import (
    FILE_TYPES,
    GGML_TYPES,
    ArrayInfo,
    GGUFError,
    GGUFHeader,
    read_header_async,
    read_header_bytes,
    read_header_file,
    tensor_nbytes,
)
from llmgw.modelfiles.http import HttpRangeSource, read_header_url
from llmgw.modelfiles.picking import (
    PickError,
    RepoFile,
    gguf_sets,
    pick_gguf,
    quant_of,
    validate_repo_id,
)
from llmgw.modelfiles.sizing import GiB, estimate_memory, kv_bytes_per_token
from tests.gguf_tiny import corrupt_gguf, write_tiny_gguf

T = gguf.GGUFValueType
MiB = 1 << 20


# --- writing files ----------------------------------------------------------------------------


def write_gguf(
    path: Path,
    arch: str = "llama",
    *,
    kv: dict[str, tuple[Any, gguf.GGUFValueType, gguf.GGUFValueType | None]] | None = None,
    tokens: int = 0,
    tensors: Sequence[tuple[str, tuple[int, ...], gguf.GGMLQuantizationType]] = (),
) -> Path:
    """Write a GGUF with the writer; tensor data is a sparse hole (only the header is ever read)."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, (value, vtype, sub) in (kv or {}).items():
        w.add_key_value(key, value, vtype, sub)
    if tokens:
        w.add_tokenizer_model("llama")
        w.add_token_list([f"tok{i}" for i in range(tokens)])
        w.add_token_scores([0.0] * tokens)
    total = 0
    for name, shape, qtype in tensors:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(shape[:-1])) * (shape[-1] // block) * size
        w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=qtype)
        total += gguf.GGUFWriter.ggml_pad(nbytes, 32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    if tensors:
        end = gguf.GGUFWriter.ggml_pad(path.stat().st_size, 32)
        with open(path, "r+b") as f:
            f.truncate(end + total)
    return path


def shape_kv(
    arch: str,
    *,
    layers: int,
    heads: int | list[int],
    kv_heads: int | list[int] | None,
    width: int,
    key_length: int | None = None,
    value_length: int | None = None,
    context: int = 4096,
) -> dict[str, tuple[Any, gguf.GGUFValueType, gguf.GGUFValueType | None]]:
    def count(v: int | list[int]) -> tuple[Any, gguf.GGUFValueType, gguf.GGUFValueType | None]:
        return (v, T.ARRAY, T.INT32) if isinstance(v, list) else (v, T.UINT32, None)

    out = {
        "general.name": ("test", T.STRING, None),
        f"{arch}.block_count": (layers, T.UINT32, None),
        f"{arch}.context_length": (context, T.UINT32, None),
        f"{arch}.embedding_length": (width, T.UINT32, None),
        f"{arch}.attention.head_count": count(heads),
    }
    if kv_heads is not None:
        out[f"{arch}.attention.head_count_kv"] = count(kv_heads)
    if key_length is not None:
        out[f"{arch}.attention.key_length"] = (key_length, T.UINT32, None)
    if value_length is not None:
        out[f"{arch}.attention.value_length"] = (value_length, T.UINT32, None)
    return out


# Byte-level pieces, for what the writer refuses to write.
def _s(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def kv_u32(key: str, v: int) -> bytes:
    return _s(key) + struct.pack("<II", 4, v)


def kv_str(key: str, v: str) -> bytes:
    return _s(key) + struct.pack("<I", 8) + _s(v)


def raw_gguf(*kvs: bytes, version: int = 3, tensors: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, tensors, len(kvs)) + b"".join(kvs)


# --- an HTTP server that honours Range and counts ----------------------------------------------


class RangeServer:
    """Serves one file at /model.gguf: 206 for a Range (416 past the end), or 200 for all of it."""

    def __init__(self, path: Path, *, honour_range: bool = True) -> None:
        self.path = path
        self.honour_range = honour_range
        self.bytes_served = 0
        self.requests = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        size = self.path.stat().st_size
        m = re.fullmatch(r"bytes=(\d+)-(\d+)", request.headers.get("Range", ""))
        if not self.honour_range or not m:
            body = self.path.read_bytes()
            self.bytes_served += len(body)
            return web.Response(body=body)
        start, end = int(m[1]), min(int(m[2]), size - 1)
        if start >= size:
            return web.Response(status=416, headers={"Content-Range": f"bytes */{size}"})
        fd = os.open(self.path, os.O_RDONLY)
        try:
            body = os.pread(fd, end - start + 1, start)
        finally:
            os.close(fd)
        self.bytes_served += len(body)
        return web.Response(status=206, body=body, headers={"Content-Range": f"bytes {start}-{end}/{size}"})


@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[tuple[aiohttp.ClientSession, Callable[[str], str]]]:
    server = TestServer(app)
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as session:
            yield session, lambda p: str(server.make_url(p))
    finally:
        await server.close()


async def _not_found(request: web.Request) -> web.Response:
    return web.Response(status=404, text="no such file")


def range_app(server: RangeServer) -> web.Application:
    app = web.Application()
    app.router.add_get("/model.gguf", server.handle)
    app.router.add_get("/missing.gguf", _not_found)
    return app


# --- reading files ----------------------------------------------------------------------------


def test_the_tiny_llama_reads_back_its_architecture_and_shape(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf", layers=3, width=64, heads=4, context_length=512)
    h = read_header_file(path)
    assert (h.version, h.architecture, h.name) == (3, "llama", "llmgw-tiny")
    assert (h.block_count, h.head_count, h.head_count_kv, h.embedding_length) == (3, 4, 4, 64)
    assert (h.key_length, h.value_length) == (16, 16)  # derived: 64 / 4
    assert (h.context_length, h.vocab_size) == (512, 320)
    assert (h.file_type, h.quantization) == (0, "F32")
    assert h.complete and h.stopped_at == ""
    assert h.split_count is None and h.head_count_kv_per_layer is None
    # The tokenizer was walked, not kept; its scalars and the chat template were.
    assert h.metadata["tokenizer.ggml.tokens"] == ArrayInfo("string", 320)
    assert h.metadata["tokenizer.ggml.scores"] == ArrayInfo("float32", 320)
    assert h.metadata["tokenizer.ggml.bos_token_id"] == 1
    assert h.metadata["tokenizer.chat_template"].startswith("{% for message in messages %}")


def test_the_tensor_infos_agree_with_gguf_pys_reader(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    h = read_header_file(path, keep_tensors=True)
    theirs = gguf.GGUFReader(path)
    assert h.tensor_count == h.tensors_read == len(theirs.tensors) == 21
    assert h.data_offset == theirs.data_offset
    for ours, t in zip(h.tensors, theirs.tensors, strict=True):
        assert ours.name == t.name
        assert ours.dims == tuple(int(d) for d in t.shape)
        assert ours.type == int(t.tensor_type) and ours.type_name == t.tensor_type.name
        assert ours.nbytes == t.n_bytes
        assert h.data_offset + ours.offset == t.data_offset
    assert h.tensor_bytes == sum(t.n_bytes for t in theirs.tensors)
    assert h.tensor_types == {"F32": 21}


def test_quantised_tensor_sizes_agree_with_gguf_py_for_every_type_it_knows(tmp_path: Path) -> None:
    Q = gguf.GGMLQuantizationType
    kinds = [q for q in gguf.GGML_QUANT_SIZES if q not in (Q.F32,)]
    tensors = [(f"t{i}.{q.name}", (3, 512), q) for i, q in enumerate(kinds)]
    path = write_gguf(tmp_path / "quants.gguf", "llama", tensors=tensors)
    h = read_header_file(path, keep_tensors=True)
    theirs = {t.name: t for t in gguf.GGUFReader(path).tensors}
    for t in h.tensors:
        assert t.nbytes == theirs[t.name].n_bytes, t.name
        assert t.type_name == theirs[t.name].tensor_type.name
    assert h.tensor_bytes == sum(t.n_bytes for t in theirs.values())
    assert sum(h.tensor_types.values()) == len(kinds)


def test_the_ggml_type_table_is_gguf_pys_and_file_types_are_llama_cpps() -> None:
    for q, (block, size) in gguf.GGML_QUANT_SIZES.items():
        assert GGML_TYPES[int(q)].name == q.name
        assert (GGML_TYPES[int(q)].block_size, GGML_TYPES[int(q)].type_size) == (block, size), q.name
    for ft in gguf.LlamaFileType:
        if ft != gguf.LlamaFileType.GUESSED:
            assert FILE_TYPES[int(ft)] == ft.name.removeprefix("MOSTLY_").removeprefix("ALL_")
    assert tensor_nbytes((4096, 4096), 12) == 4096 * 4096 // 256 * 144  # Q4_K
    assert tensor_nbytes((10,), 999) is None


def test_per_layer_kv_head_arrays_give_the_largest_and_keep_each_layer(tmp_path: Path) -> None:
    kv = shape_kv("lfm2", layers=4, heads=[16, 16, 16, 16], kv_heads=[8, 0, 8, 2], width=2048)
    h = read_header_file(write_gguf(tmp_path / "m.gguf", "lfm2", kv=kv), array_limit=0)
    assert (h.block_count, h.head_count, h.head_count_kv) == (4, 16, 8)
    assert h.head_count_kv_per_layer == (8, 0, 8, 2)
    assert (h.key_length, h.value_length) == (128, 128)
    # kept even with array_limit 0: they size the KV cache
    assert h.metadata["lfm2.attention.head_count_kv"] == [8, 0, 8, 2]


def test_key_and_value_lengths_given_are_used_rather_than_derived(tmp_path: Path) -> None:
    kv = shape_kv("deepseek2", layers=27, heads=16, kv_heads=16, width=2048, key_length=192, value_length=128)
    h = read_header_file(write_gguf(tmp_path / "m.gguf", "deepseek2", kv=kv))
    assert (h.key_length, h.value_length) == (192, 128)


def test_missing_kv_heads_default_to_the_head_count_as_llama_cpp_does(tmp_path: Path) -> None:
    kv = shape_kv("gpt2", layers=12, heads=12, kv_heads=None, width=768)
    h = read_header_file(write_gguf(tmp_path / "m.gguf", "gpt2", kv=kv))
    assert (h.head_count, h.head_count_kv, h.key_length, h.value_length) == (12, 12, 64, 64)


def test_a_file_without_a_tokenizer_reads_complete(tmp_path: Path) -> None:
    kv = shape_kv("qwen2", layers=2, heads=4, kv_heads=2, width=64)
    h = read_header_file(write_gguf(tmp_path / "m.gguf", "qwen2", kv=kv))
    assert h.complete and h.vocab_size is None and h.tensor_count == 0 and h.tensor_bytes == 0
    assert h.has_shape


def test_version_2_reads_like_version_3(tmp_path: Path) -> None:
    data = bytearray(write_tiny_gguf(tmp_path / "tiny.gguf").read_bytes())
    data[4:8] = struct.pack("<I", 2)
    h = read_header_bytes(bytes(data))
    assert h.version == 2 and h.complete and h.block_count == 2


def test_split_info_is_read(tmp_path: Path) -> None:
    kv = shape_kv("llama", layers=2, heads=4, kv_heads=4, width=64)
    kv |= {"split.no": (0, T.UINT16, None), "split.count": (3, T.UINT16, None)}
    kv |= {"split.tensors.count": (300, T.INT32, None), "general.file_type": (15, T.UINT32, None)}
    h = read_header_file(write_gguf(tmp_path / "m-00001-of-00003.gguf", kv=kv))
    assert (h.split_no, h.split_count, h.split_tensors_count, h.is_split) == (0, 3, 300, True)
    assert h.quantization == "Q4_K_M"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "not a GGUF file: it is only 0 bytes long"),
        (b"GG", "not a GGUF file: it is only 2 bytes long"),
        (b"<!DOCTYPE html><html>", "not a GGUF file (magic b'<!DO', expected b'GGUF')"),
        (b"tjgg" + bytes(100), "not a GGUF file (magic b'tjgg'"),
        (b"GGUF" + struct.pack("<I", 1) + bytes(16), "unsupported GGUF version 1 (versions 2, 3 are read)"),
        (b"GGUF" + struct.pack(">I", 3) + bytes(16), "a big-endian GGUF file (version 3)"),
        (b"GGUF" + struct.pack("<I", 3) + bytes(6), "cut short at byte 14, before its tensor and metadata counts"),
        (raw_gguf(_s("x.y") + struct.pack("<I", 99)), "metadata 'x.y' has unknown value type 99"),
        (raw_gguf(_s("x.y") + struct.pack("<IIQ", 9, 42, 1)), "metadata 'x.y' is an array of unknown value type 42"),
        (raw_gguf(_s("x") + struct.pack("<IQ", 8, 1 << 40)), "claims a string of 1099511627776 bytes"),
        (raw_gguf(kv_u32("general.alignment", 24)), "general.alignment 24 is not a power of two"),
        (raw_gguf(tensors=1) + _s("t") + struct.pack("<I", 7), "tensor 't' has 7 dimensions (at most 4)"),
    ],
)
def test_what_is_not_a_readable_header_is_named(data: bytes, message: str) -> None:
    with pytest.raises(GGUFError) as e:
        read_header_bytes(data)
    assert message in str(e.value)


def test_the_corrupt_fixture_is_refused_by_its_version(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match=r"unsupported GGUF version 4294967295"):
        read_header_file(corrupt_gguf(tmp_path / "bad.gguf"))


def test_empty_and_nested_arrays_read_back(tmp_path: Path) -> None:
    empty = raw_gguf(_s("x.empty") + struct.pack("<IIQ", 9, 4, 0), kv_str("general.architecture", "x"))
    h = read_header_bytes(empty)
    assert h.metadata == {"x.empty": [], "general.architecture": "x"} and h.complete
    kv = {
        "x.ints": ([[1, 2, 3], [4]], T.ARRAY, None),
        "x.words": ([["a", "bc"], ["d"]], T.ARRAY, None),
        "x.deep": ([[[1.5], [2.5, 3.5]], [[True]]], T.ARRAY, None),
    }
    h = read_header_file(write_gguf(tmp_path / "m.gguf", "x", kv=kv))
    assert h.metadata["x.ints"] == [[1, 2, 3], [4]]
    assert h.metadata["x.words"] == [["a", "bc"], ["d"]]
    assert h.metadata["x.deep"] == [[[1.5], [2.5, 3.5]], [[True]]]


def test_long_arrays_are_summarised_unless_asked_for(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    h = read_header_file(path)
    assert h.metadata["tokenizer.ggml.token_type"] == ArrayInfo("int32", 320)
    h = read_header_file(path, want={"tokenizer.ggml.tokens", "tokenizer.ggml.scores"})
    tokens = h.metadata["tokenizer.ggml.tokens"]
    assert tokens[:4] == ["<unk>", "<s>", "</s>", "<0x00>"] and len(tokens) == 320
    assert len(h.metadata["tokenizer.ggml.scores"]) == 320
    h = read_header_file(path, array_limit=1000)
    assert len(h.metadata["tokenizer.ggml.token_type"]) == 320


def test_metadata_alone_is_read_when_tensors_are_not_wanted(tmp_path: Path) -> None:
    h = read_header_file(write_tiny_gguf(tmp_path / "tiny.gguf"), tensors=False)
    assert h.complete and h.tensors_read == 0 and h.tensor_bytes is None and h.data_offset is None
    assert h.tensor_count == 21 and h.block_count == 2


def _offset_of(data: bytes, key: str) -> int:
    at = data.find(_s(key))
    assert at > 0, key
    return at + len(_s(key))


def test_a_header_cut_inside_the_tokenizer_still_has_architecture_and_shape(tmp_path: Path) -> None:
    data = write_tiny_gguf(tmp_path / "tiny.gguf").read_bytes()
    cut = _offset_of(data, "tokenizer.ggml.tokens") + 500
    h = read_header_bytes(data[:cut])
    assert not h.complete
    assert h.stopped_at == f"metadata 'tokenizer.ggml.tokens' (key 15 of 23): the data ends at byte {cut}"
    assert (h.architecture, h.block_count, h.head_count_kv, h.embedding_length, h.key_length) == ("llama", 2, 4, 64, 16)
    assert "tokenizer.ggml.tokens" not in h.metadata and h.metadata_read == 14
    assert h.tensor_bytes is None and h.data_offset is None and h.tensors_read == 0


def test_a_cut_inside_a_skipped_numeric_array_is_reported_there(tmp_path: Path) -> None:
    data = write_tiny_gguf(tmp_path / "tiny.gguf").read_bytes()
    cut = _offset_of(data, "tokenizer.ggml.scores") + 100
    h = read_header_bytes(data[:cut])
    assert not h.complete and "'tokenizer.ggml.scores'" in h.stopped_at
    assert "the data ends before byte" in h.stopped_at and h.bytes_read < cut  # the hole was not fetched
    assert h.metadata["tokenizer.ggml.tokens"] == ArrayInfo("string", 320)


def test_a_cut_inside_the_tensor_infos_keeps_all_the_metadata(tmp_path: Path) -> None:
    data = write_tiny_gguf(tmp_path / "tiny.gguf").read_bytes()
    cut = _offset_of(data, "blk.1.attn_q.weight")
    h = read_header_bytes(data[:cut])
    assert not h.complete and h.stopped_at.startswith("tensor info 'blk.1.attn_q.weight' (12 of 21)")
    assert h.metadata_read == 23 and h.tensors_read == 11 and h.tensor_bytes is None


def test_a_read_limit_stops_the_reader_like_a_cut(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    h = read_header_file(path, limit=4000, first_chunk=512)
    assert not h.complete and h.bytes_read <= 4000
    assert h.stopped_at.endswith("(the reader's limit of 4000 bytes)")
    assert h.block_count == 2


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(min_value=24, max_value=9279), chunk=st.sampled_from([1, 7, 64, 4096]))
def test_wherever_the_header_is_cut_what_was_read_is_right(tmp_path: Path, cut: int, chunk: int) -> None:
    path = tmp_path / "tiny.gguf"
    if not path.exists():
        write_tiny_gguf(path)
    data = path.read_bytes()
    full = read_header_bytes(data, keep_tensors=True)
    assert full.data_offset == 9280  # the tiny file's header at the defaults; keeps `cut` inside it
    h = read_header_bytes(data[:cut], keep_tensors=True, first_chunk=chunk, max_chunk=chunk)
    assert h.complete == (cut >= full.bytes_read)
    assert all(full.metadata[k] == v for k, v in h.metadata.items())
    assert h.tensors == full.tensors[: len(h.tensors)]
    if h.architecture:
        assert h.architecture == "llama"


# --- property: any metadata the writer writes reads back equal ---------------------------------

_INT_RANGES = {
    T.UINT8: (0, 2**8 - 1),
    T.INT8: (-(2**7), 2**7 - 1),
    T.UINT16: (0, 2**16 - 1),
    T.INT16: (-(2**15), 2**15 - 1),
    T.UINT32: (0, 2**32 - 1),
    T.INT32: (-(2**31), 2**31 - 1),
    T.UINT64: (0, 2**64 - 1),
    T.INT64: (-(2**63), 2**63 - 1),
}


def _scalars(vtype: gguf.GGUFValueType) -> st.SearchStrategy[Any]:
    if vtype in _INT_RANGES:
        lo, hi = _INT_RANGES[vtype]
        return st.integers(lo, hi)
    if vtype == T.FLOAT32:
        return st.floats(width=32, allow_nan=False)
    if vtype == T.FLOAT64:
        return st.floats(allow_nan=False)
    if vtype == T.BOOL:
        return st.booleans()
    return st.text(max_size=24)


_SCALAR_TYPES = [*_INT_RANGES, T.FLOAT32, T.FLOAT64, T.BOOL, T.STRING]
_scalar = st.sampled_from(_SCALAR_TYPES).flatmap(lambda t: _scalars(t).map(lambda v: (v, t, None)))
_typed_array = st.sampled_from(_SCALAR_TYPES).flatmap(
    lambda t: st.lists(_scalars(t), min_size=1, max_size=6).map(lambda v: (v, T.ARRAY, t))
)
# Nested arrays: the writer types each inner list by its first item (int32, float32, bool, string).
_inner = st.one_of(
    st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=4),
    st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=4),
    st.lists(st.booleans(), min_size=1, max_size=4),
    st.lists(st.text(max_size=8), min_size=1, max_size=4),
)
_nested = st.lists(_inner, min_size=1, max_size=4).map(lambda v: (v, T.ARRAY, None))
_keys = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789._", min_size=1, max_size=24).filter(
    lambda k: k not in ("general.architecture", "general.alignment")
)
_metadata = st.dictionaries(_keys, st.one_of(_scalar, _typed_array, _nested), max_size=12)


@settings(max_examples=80, deadline=None)
@given(kv=_metadata, cut_at=st.floats(0, 1))
def test_any_metadata_the_writer_writes_reads_back_equal(kv: dict[str, Any], cut_at: float) -> None:
    with tempfile.TemporaryDirectory() as d:
        data = write_gguf(Path(d) / "m.gguf", "prop", kv=kv).read_bytes()
    h = read_header_bytes(data, array_limit=10**6)
    assert h.complete and h.architecture == "prop"
    assert h.metadata == {"general.architecture": "prop", **{k: v for k, (v, _, _) in kv.items()}}
    # Summarised instead: every array is its item type and length (head-count keys aside).
    short = read_header_bytes(data, array_limit=0)
    for k, (v, vtype, sub) in kv.items():
        if vtype == T.ARRAY and not k.endswith((".attention.head_count", ".attention.head_count_kv")):
            item = sub if sub is not None else T.ARRAY
            assert short.metadata[k] == ArrayInfo(item.name.lower(), len(v))
    # Cut anywhere after the counts: no error, and every key it returns is whole.
    cut = 24 + int(cut_at * (len(data) - 24))
    part = read_header_bytes(data[:cut], array_limit=10**6, first_chunk=16, max_chunk=64)
    assert part.complete == (cut == len(data))
    assert all(h.metadata[k] == v for k, v in part.metadata.items())


# --- over HTTP ranges -------------------------------------------------------------------------


def big_model(path: Path, tokens: int = 100_000) -> Path:
    """A llama with a 100k-token tokenizer (~2 MB of header) and ~730 MB of (sparse) weights."""
    kv = shape_kv("llama", layers=32, heads=32, kv_heads=8, width=4096, context=8192)
    Q = gguf.GGMLQuantizationType
    tensors = [(f"blk.{i}.ffn_up.weight", (14336, 4096), Q.Q4_K) for i in range(12)]
    tensors += [("token_embd.weight", (tokens, 4096), Q.Q6_K)]
    return write_gguf(path, "llama", kv=kv, tokens=tokens, tensors=tensors)


async def test_reading_over_http_ranges_fetches_far_less_than_the_file(tmp_path: Path) -> None:
    path = big_model(tmp_path / "big.gguf")
    size = path.stat().st_size
    server = RangeServer(path)
    async with serving(range_app(server)) as (session, url):
        source = HttpRangeSource(session, url("/model.gguf"))
        h = await read_header_async(source)
    assert h == read_header_file(path)
    assert h.complete and h.block_count == 32 and h.head_count_kv == 8 and h.vocab_size == 100_000
    assert h.tensor_bytes == 12 * 14336 * 4096 // 256 * 144 + 100_000 * 4096 // 256 * 210
    assert size > 300 * MiB
    # 1 MiB, then 2 MiB: the header (~1.6 MB) in two requests, a hundredth of the file.
    assert source.requests == server.requests == 2
    assert source.bytes_fetched == server.bytes_served == 3 * MiB < size / 100
    assert source.size == size


def write_with_a_hole(path: Path, count: int) -> Path:
    """Shape keys, then a float32 array of ``count`` items (a sparse hole), then one more key."""
    head = raw_gguf(
        kv_str("general.architecture", "llama"),
        kv_u32("llama.block_count", 40),
        _s("llama.big") + struct.pack("<IIQ", 9, 6, count),
    )
    head = head[:16] + struct.pack("<Q", 4) + head[24:]  # four keys: one more after the hole
    with open(path, "wb") as f:
        f.write(head)
        f.seek(count * 4, os.SEEK_CUR)
        f.write(kv_str("general.name", "after the hole"))
    return path


async def test_a_long_numeric_array_is_skipped_without_being_fetched(tmp_path: Path) -> None:
    count = 32 * MiB  # 128 MB of float32 between the shape and the rest
    path = write_with_a_hole(tmp_path / "m.gguf", count)
    server = RangeServer(path)
    async with serving(range_app(server)) as (session, url):
        source = HttpRangeSource(session, url("/model.gguf"))
        h = await read_header_async(source, first_chunk=64 * 1024)
    assert h.complete and h.name == "after the hole" and h.block_count == 40
    assert h.metadata["llama.big"] == ArrayInfo("float32", count)
    assert server.bytes_served < 256 * 1024 < path.stat().st_size / 500


async def test_a_remote_file_cut_short_yields_what_was_read(tmp_path: Path) -> None:
    data = write_tiny_gguf(tmp_path / "tiny.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: _offset_of(data, "tokenizer.ggml.tokens") + 100])
    async with serving(range_app(RangeServer(cut))) as (session, url):
        h = await read_header_url(session, url("/model.gguf"), first_chunk=256)
    assert not h.complete and "'tokenizer.ggml.tokens'" in h.stopped_at
    assert (h.architecture, h.block_count, h.embedding_length) == ("llama", 2, 64)


async def test_aiohttps_own_file_serving_is_read_by_ranges(tmp_path: Path) -> None:
    path = big_model(tmp_path / "big.gguf", tokens=1000)
    app = web.Application()
    app.router.add_static("/files", tmp_path)
    async with serving(app) as (session, url):
        source = HttpRangeSource(session, url("/files/big.gguf"))
        h = await read_header_async(source, first_chunk=4096)
    assert h == read_header_file(path)
    assert source.bytes_fetched < 64 * 1024


async def test_a_server_that_ignores_range_or_has_no_file_is_refused_by_name(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    async with serving(range_app(RangeServer(path, honour_range=False))) as (session, url):
        with pytest.raises(GGUFError, match="does not honour Range requests"):
            await read_header_url(session, url("/model.gguf"))
        with pytest.raises(GGUFError, match=r"HTTP 404"):
            await read_header_url(session, url("/missing.gguf"))


# --- sizing -----------------------------------------------------------------------------------


def shaped(
    layers: int, heads: int, kv_heads: int | list[int], width: int, k: int | None = None, v: int | None = None
) -> GGUFHeader:
    """A header as the reader makes one (through the writer), for the sizing tables."""
    kv = shape_kv("x", layers=layers, heads=heads, kv_heads=kv_heads, width=width, key_length=k, value_length=v)
    with tempfile.TemporaryDirectory() as d:
        return read_header_file(write_gguf(Path(d) / "m.gguf", "x", kv=kv))


# (sentence, header, weights, ctx pool, B/token, KV GiB, total GB rounded up to 0.01)
SIZING = [
    (
        "Qwen2.5-14B: 48 layers of 8 of 40 KV heads, 128 wide: 3 GiB at 16k",
        shaped(48, 40, 8, 5120),
        9 * GiB,
        16384,
        48 * 8 * (128 + 128) * 2,
        3.0,
        13.45,
    ),  # 9 + 3 + 1 + 0.45
    (
        "Qwen2.5-1.5B: two KV heads, 0.44 GB of cache at 16k",
        shaped(28, 12, 2, 1536),
        1 * GiB,
        16384,
        28 * 2 * 256 * 2,
        0.4375,
        2.49,
    ),  # 1 + 0.4375 + 1 + 0.05 = 2.4875
    (
        "Gemma-2-9B: 256-wide heads given, 5.25 GB of cache at 16k",
        shaped(42, 16, 8, 3584, 256, 256),
        5 * GiB,
        16384,
        42 * 8 * 512 * 2,
        5.25,
        11.5,
    ),  # 5 + 5.25 + 1 + 0.25
    (
        "K uses key_length and V value_length (192 and 128)",
        shaped(27, 16, 16, 2048, 192, 128),
        10 * GiB,
        8192,
        27 * 16 * 192 * 2 + 27 * 16 * 128 * 2,
        8192 * 276480 / GiB,
        13.61,
    ),  # 10+2.109375+1+0.5
    (
        "per-layer KV heads are summed over the layers",
        shaped(4, 16, [8, 0, 8, 0], 2048),
        2 * GiB,
        131072,
        (8 + 0 + 8 + 0) * 256 * 2,
        1.0,
        4.1,
    ),  # 2 + 1 + 1 + 0.1
    (
        "a context pool of zero costs no cache",
        shaped(48, 40, 8, 5120),
        20 * GiB,
        0,
        196608,
        0.0,
        22.0,
    ),  # 20 + 0 + 1 + 1
]


@pytest.mark.parametrize(("sentence", "header", "weights", "ctx", "per_token", "kv_gib", "total_gb"), SIZING)
def test_memory_is_weights_plus_the_kv_cache_plus_a_gigabyte_and_five_percent(
    sentence: str, header: GGUFHeader, weights: int, ctx: int, per_token: int, kv_gib: float, total_gb: float
) -> None:
    assert kv_bytes_per_token(header) == per_token
    e = estimate_memory(header, weights, ctx, sharded=False)
    assert e.rule == "kv-cache" and e.why_fallback == ""
    assert e.kv_bytes_per_token == per_token
    assert e.total_bytes == weights + ctx * per_token + GiB + weights * 5 // 100
    assert e.kv_cache_gb == round(kv_gib, 3)
    assert e.total_gb == total_gb
    assert e.explanation.startswith(f"{total_gb:.2f} GB = {weights / GiB:.2f} GB weights + ")


def test_the_qwen_example_reads_its_shape_from_a_header_cut_in_the_tokenizer(tmp_path: Path) -> None:
    # The original test's file: qwen2, 48 layers, 40 heads, 8 KV heads, 5120 wide, a 2**20-entry
    # tokenizer of which only the first megabyte was fetched.
    kv = shape_kv("qwen2", layers=48, heads=40, kv_heads=8, width=5120, context=32768)
    data = write_gguf(tmp_path / "q.gguf", "qwen2", kv=kv, tokens=2**20).read_bytes()
    h = read_header_bytes(data[:MiB])
    assert not h.complete and "tokenizer.ggml.tokens" in h.stopped_at
    e = estimate_memory(h, 9 * GiB, 16384, sharded=False)
    assert (e.rule, e.kv_bytes_per_token, e.kv_cache_gb, e.total_gb) == ("kv-cache", 196608, 3.0, 13.45)
    assert e.explanation == (
        "13.45 GB = 9.00 GB weights + 3.00 GB f16 KV cache (16384 tokens × 196608 B: 48 layers × 8 KV heads "
        "× (128 + 128) × 2 B) + 1 GB + 5 % of the weights for the engine"
    )


def _no_shape() -> GGUFHeader:
    return read_header_bytes(raw_gguf(kv_str("general.architecture", "x"), kv_u32("x.block_count", 4)))


# (sentence, headers, sharded, why)
FALLBACK = [
    ("a sharded set takes the rough rule even with a shape", shaped(48, 40, 8, 5120), True, "the set is sharded"),
    ("a header saying it is one of several splits is sharded", None, False, "the set is sharded"),
    ("several headers are a sharded set", [shaped(2, 4, 4, 64), shaped(2, 4, 4, 64)], False, "the set is sharded"),
    ("no header at all", None, False, "no GGUF header was read"),
    ("a header without heads or width", _no_shape(), False, "the header gives no head_count, embedding_length"),
]


@pytest.mark.parametrize(("sentence", "header", "sharded", "why"), FALLBACK)
def test_without_a_shape_or_for_a_sharded_set_memory_is_weights_and_a_half_plus_two_gigabytes(
    sentence: str, header: Any, sharded: bool, why: str, tmp_path: Path
) -> None:
    if sentence.startswith("a header saying"):
        kv = shape_kv("x", layers=2, heads=4, kv_heads=4, width=64) | {"split.count": (2, T.UINT16, None)}
        header = read_header_file(write_gguf(tmp_path / "m.gguf", "x", kv=kv))
    e = estimate_memory(header, 10 * GiB, 16384, sharded=sharded)
    assert e.rule == "fallback" and e.why_fallback == why
    assert e.total_bytes == 17 * GiB and e.total_gb == 17.0 and e.kv_cache_gb == 0.0
    assert e.explanation == f"17.00 GB = 10.00 GB weights × 1.5 + 2 GB (the rough rule: {why})"


def test_a_cut_header_without_its_shape_says_where_it_stopped(tmp_path: Path) -> None:
    data = write_tiny_gguf(tmp_path / "tiny.gguf").read_bytes()
    h = read_header_bytes(data[: _offset_of(data, "llama.embedding_length")])
    e = estimate_memory(h, GiB, 4096)
    assert e.rule == "fallback"
    assert e.why_fallback.startswith(
        "the header gives no block_count, head_count, embedding_length (metadata 'llama.embedding_length' (key 4"
    )


def test_the_first_shards_header_carries_the_shape_of_a_list() -> None:
    one = shaped(28, 12, 2, 1536)
    assert estimate_memory([one], GiB, 16384).rule == "kv-cache"
    with pytest.raises(ValueError, match="weights_bytes must be positive"):
        estimate_memory(one, 0, 16384)
    with pytest.raises(ValueError, match="ctx_pool_tokens must be >= 0"):
        estimate_memory(one, GiB, -1)


def test_an_estimate_is_a_msgspec_struct_that_encodes() -> None:
    e = estimate_memory(shaped(28, 12, 2, 1536), GiB, 16384)
    assert msgspec.json.decode(msgspec.json.encode(e))["rule"] == "kv-cache"


# --- picking ----------------------------------------------------------------------------------


def repo(*entries: str | tuple[str, int]) -> list[RepoFile]:
    return [RepoFile(e, 1000) if isinstance(e, str) else RepoFile(*e) for e in entries]


SPLIT3 = ("Q4_K_M/m-Q4_K_M-00001-of-00003.gguf", "Q4_K_M/m-Q4_K_M-00002-of-00003.gguf")
SPLIT3 += ("Q4_K_M/m-Q4_K_M-00003-of-00003.gguf",)

# (sentence, files, quant, file, picked set name, files in the set)
PICKS = [
    (
        "Q4_K_M by default; the projector and the others are left",
        repo(("m-Q8_0.gguf", 2 * GiB), ("m-Q4_K_M.gguf", GiB), ("mmproj-Q4_K_M.gguf", 10), "README.md"),
        None,
        None,
        "m-Q4_K_M.gguf",
        1,
    ),
    (
        "a quant matches case-insensitively",
        repo("llama-2-7b.q4_k_m.gguf", "llama-2-7b.Q8_0.gguf"),
        "Q4_K_M",
        None,
        "llama-2-7b.q4_k_m.gguf",
        1,
    ),
    ("a quant asked in lower case matches", repo("m-Q4_K_M.gguf", "m-Q8_0.gguf"), "q8_0", None, "m-Q8_0.gguf", 1),
    ("a split set is picked whole, in order", repo(*reversed(SPLIT3), "m-Q8_0.gguf"), "Q4_K_M", None, SPLIT3[0], 3),
    (
        "the joined copy beats the split one: fewest shards",
        repo(*SPLIT3, "m-Q4_K_M.gguf"),
        "Q4_K_M",
        None,
        "m-Q4_K_M.gguf",
        1,
    ),
    (
        "a quant folder names the quant",
        repo("Q5_K_M/model-00001-of-00002.gguf", "Q5_K_M/model-00002-of-00002.gguf", "model-Q8_0.gguf"),
        "Q5_K_M",
        None,
        "Q5_K_M/model-00001-of-00002.gguf",
        2,
    ),
    (
        "an imatrix is never a model",
        repo("m.imatrix.gguf", "imatrix-Q4_K_M.gguf", "m-Q4_K_M.gguf"),
        "Q4_K_M",
        None,
        "m-Q4_K_M.gguf",
        1,
    ),
    (
        "Q4_K_S when there is no Q4_K_M",
        repo("m-Q8_0.gguf", "m-Q4_K_S.gguf", "m-Q5_K_M.gguf"),
        None,
        None,
        "m-Q4_K_S.gguf",
        1,
    ),
    ("Q8_0 before F16 by default", repo(("m-F16.gguf", 10), ("m-Q8_0.gguf", 20)), None, None, "m-Q8_0.gguf", 1),
    (
        "else the smallest set, and never the (smaller) projector",
        repo(("m-F16.gguf", 16), ("m-BF16.gguf", 15), ("mmproj-m-f16.gguf", 1), ("m-IQ2_XXS.gguf", 3)),
        None,
        None,
        "m-IQ2_XXS.gguf",
        1,
    ),
    (
        "the smallest prefers a single file to a split set",
        repo(("a-F16.gguf", 100), ("b-00001-of-00002.gguf", 1), ("b-00002-of-00002.gguf", 1)),
        None,
        None,
        "a-F16.gguf",
        1,
    ),
    (
        "an exact quant beats a longer name holding it",
        repo("m-UD-Q4_K_XL.gguf", "m-Q4_K_XL.gguf"),
        "Q4_K_XL",
        None,
        "m-Q4_K_XL.gguf",
        1,
    ),
    (
        "UD- quants match by their plain name",
        repo("m-UD-Q4_K_XL.gguf", "m-Q8_0.gguf"),
        "Q4_K_XL",
        None,
        "m-UD-Q4_K_XL.gguf",
        1,
    ),
    ("--file picks that file", repo("m-Q4_K_M.gguf", "m-Q8_0.gguf"), None, "m-Q8_0.gguf", "m-Q8_0.gguf", 1),
    ("--file of a shard picks its whole set", repo(*SPLIT3, "m-Q8_0.gguf"), None, SPLIT3[1], SPLIT3[0], 3),
    (
        "--file by its bare name in a quant folder",
        repo("Q8_0/m-Q8_0.gguf", "m-Q4_K_M.gguf"),
        None,
        "m-Q8_0.gguf",
        "Q8_0/m-Q8_0.gguf",
        1,
    ),
    ("--file with the quant it is", repo("m-Q4_K_M.gguf", "m-Q8_0.gguf"), "Q8_0", "m-Q8_0.gguf", "m-Q8_0.gguf", 1),
]


@pytest.mark.parametrize(("sentence", "files", "quant", "file", "name", "count"), PICKS)
def test_the_gguf_set_is_picked(
    sentence: str, files: list[RepoFile], quant: str | None, file: str | None, name: str, count: int
) -> None:
    p = pick_gguf("owner/m-GGUF", files, quant=quant, file=file)
    assert p.set.name == name and len(p.set.files) == count and p.set.complete
    assert [f.path for f in p.set.files] == sorted(f.path for f in p.set.files)
    assert p.set.size == sum(f.size for f in p.set.files)
    assert all("mmproj" not in a and "imatrix" not in a for a in p.available)


# (sentence, files, quant, file, words the refusal has)
REFUSALS = [
    (
        "a quant the repository lacks is named with what it has",
        repo("m-Q8_0.gguf"),
        "Q4_K_M",
        None,
        ["owner/m-GGUF has no Q4_K_M GGUF", "it has: Q8_0 (m-Q8_0.gguf)"],
    ),
    (
        "Q4_K is not Q4_K_M",
        repo("m-Q4_K_M.gguf", "m-Q4_K_S.gguf"),
        "Q4_K",
        None,
        ["has no Q4_K GGUF", "Q4_K_M (m-Q4_K_M.gguf), Q4_K_S (m-Q4_K_S.gguf)"],
    ),
    ("Q4_0 is not Q4_0_4_4", repo("m-Q4_0_4_4.gguf"), "Q4_0", None, ["has no Q4_0 GGUF", "Q4_0_4_4"]),
    ("a split set is listed with its shards", repo(*SPLIT3), "Q8_0", None, [f"Q4_K_M ({SPLIT3[0]}, 3 shards)"]),
    (
        "a repository of safetensors has no GGUF",
        repo("config.json", "model.safetensors"),
        None,
        None,
        ["has no GGUF files; the nodes run llama.cpp, which needs one (found: config.json, model.safetensors)"],
    ),
    (
        "projectors alone are not a model",
        repo("mmproj-f16.gguf", "README.md"),
        None,
        None,
        ["only vision projectors or importance matrices: mmproj-f16.gguf"],
    ),
    (
        "an incomplete split set is not served",
        repo(*SPLIT3[:2]),
        "Q4_K_M",
        None,
        ["only here as an incomplete split set", "lacks shard(s) 00003 of 00003"],
    ),
    (
        "a shard of an incomplete set is not served",
        repo(*SPLIT3[:2]),
        None,
        SPLIT3[0],
        ["is a shard of", "lacks shard(s) 00003 of 00003"],
    ),
    (
        "two equal matches are not guessed between",
        repo("a/m-Q4_K_M.gguf", "b/m-Q4_K_M.gguf"),
        "Q4_K_M",
        None,
        ["several GGUF sets match Q4_K_M", "choose one with --file"],
    ),
    (
        "--file that is not there lists the sets",
        repo("m-Q4_K_M.gguf"),
        None,
        "m-Q2_K.gguf",
        ["has no file m-Q2_K.gguf; its GGUF sets: Q4_K_M (m-Q4_K_M.gguf)"],
    ),
    (
        "--file of a projector is refused",
        repo("m-Q4_K_M.gguf", "mmproj-m.gguf"),
        None,
        "mmproj-m.gguf",
        ["mmproj-m.gguf is a vision projector or importance matrix, not a model"],
    ),
    (
        "--file of something else is refused",
        repo("m-Q4_K_M.gguf", "config.json"),
        None,
        "config.json",
        ["config.json is not a GGUF file"],
    ),
    (
        "--file and --quant that disagree",
        repo("m-Q4_K_M.gguf", "m-Q8_0.gguf"),
        "Q4_K_M",
        "m-Q8_0.gguf",
        ["--file m-Q8_0.gguf is Q8_0, not the Q4_K_M asked for"],
    ),
]


@pytest.mark.parametrize(("sentence", "files", "quant", "file", "words"), REFUSALS)
def test_what_cannot_be_picked_is_refused_with_what_there_is(
    sentence: str, files: list[RepoFile], quant: str | None, file: str | None, words: list[str]
) -> None:
    with pytest.raises(PickError) as e:
        pick_gguf("owner/m-GGUF", files, quant=quant, file=file)
    for w in words:
        assert w in str(e.value)


@pytest.mark.parametrize(
    "name",
    ["bartowski/Qwen2.5-3B-Instruct-GGUF", "Qwen/Qwen2.5-7B-Instruct-GGUF", "a/b", "a.b/c_d-e", "A1/x.y.gguf"],
)
def test_a_repository_is_owner_slash_name(name: str) -> None:
    assert validate_repo_id(name) == name


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("../x", "'..' starts with '.'"),
        ("x/..", "'..' starts with '.'"),
        ("a/b/c", "has 3 parts"),
        ("qwen", "has 1 parts"),
        ("", "no repository named"),
        ("/b", "has an empty part"),
        ("a/", "has an empty part"),
        ("a b/c", "contains ' '"),
        ("a/b?x=1", "contains '=', '?'"),
        ("a/é", "contains 'é'"),
        (".a/b", "'.a' starts with '.'"),
        ("-a/b", "'-a' starts with '-'"),
        ("a/.b", "'.b' starts with '.'"),
        ("a/b..c", "'b..c' contains '..'"),
        ("a/" + "x" * 97, "is 97 characters"),
    ],
)
def test_a_repository_name_outside_the_rule_is_refused_with_the_rule(name: str, why: str) -> None:
    with pytest.raises(PickError) as e:
        validate_repo_id(name)
    assert why in str(e.value)
    assert "OWNER/NAME: two parts, each of letters, digits, '.', '_' and '-'" in str(e.value)
    with pytest.raises(PickError):
        pick_gguf(name, repo("m-Q4_K_M.gguf"))


@pytest.mark.parametrize(
    ("path", "quant"),
    [
        ("Qwen2.5-7B-Instruct-Q4_K_M.gguf", "Q4_K_M"),
        ("llama-2-7b.Q5_K_S.gguf", "Q5_K_S"),
        ("gemma-2-9b-it-IQ4_XS.gguf", "IQ4_XS"),
        ("m-UD-Q4_K_XL-00001-of-00002.gguf", "UD-Q4_K_XL"),
        ("Q8_0/m-00001-of-00002.gguf", "Q8_0"),
        ("phi-4-f16.gguf", "F16"),
        ("phi-4-bf16.gguf", "BF16"),
        ("gpt-oss-20b-MXFP4.gguf", "MXFP4"),
        ("Qwen2-7B.gguf", None),
    ],
)
def test_the_quant_a_path_names(path: str, quant: str | None) -> None:
    assert quant_of(path) == quant


def test_sets_group_shards_and_leave_projectors_out() -> None:
    sets = gguf_sets(repo(*SPLIT3, ("m-Q8_0.gguf", 5), "mmproj-x.gguf", "x.imatrix.gguf", "b-00002-of-00002.gguf"))
    assert [(s.name, s.shards, s.missing) for s in sets] == [
        (SPLIT3[0], 3, ()),
        ("b-00001-of-00002.gguf", 2, (1,)),
        ("m-Q8_0.gguf", 1, ()),
    ]
