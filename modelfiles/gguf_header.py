"""Our own reader of a GGUF file's header (SPEC MIR-3): the metadata and tensor infos, never the weights.

The header says what the model is (``general.architecture``) and its shape (layers, heads, KV heads,
embedding width, key/value lengths), which is what sizing needs (:mod:`llmgw.modelfiles.sizing`).
It is read from any "bytes at offset" source: a local file, bytes already in memory, or a remote
file over HTTP ``Range`` requests in growing chunks (:mod:`llmgw.modelfiles.http`, the adapter at
the edge), so a 40 GB file costs a few MB of transfer. This module does no network I/O.

The parser is sans-IO: a generator that asks for byte ranges and is sent what the source returned,
so one parser serves both the blocking and the async drivers. Tokenizer arrays (hundreds of
thousands of strings) are walked but not kept unless asked; numeric arrays past the buffer are
skipped without being fetched at all. A header that ends early (a cut file, or a prefix fetched
for a quick check) still yields what was read, with ``complete=False`` and ``stopped_at`` saying
where: the architecture and shape usually come before the tokenizer.

Only little-endian GGUF versions 2 and 3 are read (version 1 used 32-bit lengths; big-endian files
are rare and are refused by name). The layout: magic ``GGUF``, u32 version, u64 tensor count, u64
metadata count, then each metadata key (u64 length + UTF-8) with a u32 value type and its value,
then each tensor info (name, u32 dims count, u64 dims, u32 ggml type, u64 offset), then padding to
``general.alignment`` and the tensor data.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Collection, Generator, Mapping
from typing import Any, Protocol

import msgspec

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_KEY_BYTES = 65_535  # the GGUF spec's limit on a key
MAX_STRING_BYTES = 64 << 20  # a metadata string past this is a corrupt length, not a chat template
DEFAULT_ARRAY_LIMIT = 256  # arrays longer than this are summarised (ArrayInfo) unless wanted

# Keys (any architecture prefix) whose arrays are always kept: per-layer head counts size the KV cache.
_ALWAYS_KEEP_SUFFIXES = (".attention.head_count", ".attention.head_count_kv")


class GGUFError(ValueError):
    """The data is not a GGUF header this reader can read; the message names what was wrong."""


# --- value and tensor types --------------------------------------------------------------------

# GGUF metadata value types: id -> (name, struct format); STRING and ARRAY have no fixed format.
VALUE_TYPES: Mapping[int, tuple[str, str]] = {
    0: ("uint8", "B"),
    1: ("int8", "b"),
    2: ("uint16", "H"),
    3: ("int16", "h"),
    4: ("uint32", "I"),
    5: ("int32", "i"),
    6: ("float32", "f"),
    7: ("bool", "?"),
    8: ("string", ""),
    9: ("array", ""),
    10: ("uint64", "Q"),
    11: ("int64", "q"),
    12: ("float64", "d"),
}
_STRING, _ARRAY = 8, 9


class GGMLType(msgspec.Struct, frozen=True):
    """A ggml tensor type: ``block_size`` elements are stored in ``type_size`` bytes."""

    name: str
    block_size: int
    type_size: int


_QK_K = 256  # elements per super-block of the k-quants and i-quants

# ggml's enum ggml_type with its block and type sizes (ggml.c type_traits; gguf-py GGML_QUANT_SIZES).
GGML_TYPES: Mapping[int, GGMLType] = {
    0: GGMLType("F32", 1, 4),
    1: GGMLType("F16", 1, 2),
    2: GGMLType("Q4_0", 32, 2 + 16),
    3: GGMLType("Q4_1", 32, 2 + 2 + 16),
    6: GGMLType("Q5_0", 32, 2 + 4 + 16),
    7: GGMLType("Q5_1", 32, 2 + 2 + 4 + 16),
    8: GGMLType("Q8_0", 32, 2 + 32),
    9: GGMLType("Q8_1", 32, 4 + 4 + 32),
    10: GGMLType("Q2_K", _QK_K, 2 + 2 + _QK_K // 16 + _QK_K // 4),
    11: GGMLType("Q3_K", _QK_K, 2 + _QK_K // 4 + _QK_K // 8 + 12),
    12: GGMLType("Q4_K", _QK_K, 2 + 2 + _QK_K // 2 + 12),
    13: GGMLType("Q5_K", _QK_K, 2 + 2 + _QK_K // 2 + _QK_K // 8 + 12),
    14: GGMLType("Q6_K", _QK_K, 2 + _QK_K // 2 + _QK_K // 4 + _QK_K // 16),
    15: GGMLType("Q8_K", _QK_K, 4 + _QK_K + _QK_K // 8),
    16: GGMLType("IQ2_XXS", _QK_K, 2 + _QK_K // 4),
    17: GGMLType("IQ2_XS", _QK_K, 2 + _QK_K // 4 + _QK_K // 32),
    18: GGMLType("IQ3_XXS", _QK_K, 2 + _QK_K // 4 + _QK_K // 8),
    19: GGMLType("IQ1_S", _QK_K, 2 + _QK_K // 8 + _QK_K // 16),
    20: GGMLType("IQ4_NL", 32, 2 + 16),
    21: GGMLType("IQ3_S", _QK_K, 2 + _QK_K // 4 + _QK_K // 8 + _QK_K // 32 + 4),
    22: GGMLType("IQ2_S", _QK_K, 2 + _QK_K // 4 + _QK_K // 16),
    23: GGMLType("IQ4_XS", _QK_K, 2 + 2 + _QK_K // 2 + _QK_K // 64),
    24: GGMLType("I8", 1, 1),
    25: GGMLType("I16", 1, 2),
    26: GGMLType("I32", 1, 4),
    27: GGMLType("I64", 1, 8),
    28: GGMLType("F64", 1, 8),
    29: GGMLType("IQ1_M", _QK_K, _QK_K // 8 + _QK_K // 16 + _QK_K // 32),
    30: GGMLType("BF16", 1, 2),
    # 31-33 and 36-38 were interleaved Q4_0/IQ4_NL repacks, since removed from files but still met.
    31: GGMLType("Q4_0_4_4", 32, 2 + 16),
    32: GGMLType("Q4_0_4_8", 32, 2 + 16),
    33: GGMLType("Q4_0_8_8", 32, 2 + 16),
    34: GGMLType("TQ1_0", _QK_K, 2 + 4 * 13),
    35: GGMLType("TQ2_0", _QK_K, 2 + 64),
    36: GGMLType("IQ4_NL_4_4", 32, 2 + 16),
    37: GGMLType("IQ4_NL_4_8", 32, 2 + 16),
    38: GGMLType("IQ4_NL_8_8", 32, 2 + 16),
    39: GGMLType("MXFP4", 32, 1 + 16),
    40: GGMLType("NVFP4", 64, 4 + 32),
    41: GGMLType("Q1_0", 128, 2 + 16),
}

# llama.cpp's enum llama_ftype (general.file_type): what the file as a whole was quantised to.
FILE_TYPES: Mapping[int, str] = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    4: "Q4_1_SOME_F16",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    11: "Q3_K_S",
    12: "Q3_K_M",
    13: "Q3_K_L",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    19: "IQ2_XXS",
    20: "IQ2_XS",
    21: "Q2_K_S",
    22: "IQ3_XS",
    23: "IQ3_XXS",
    24: "IQ1_S",
    25: "IQ4_NL",
    26: "IQ3_S",
    27: "IQ3_M",
    28: "IQ2_S",
    29: "IQ2_M",
    30: "IQ4_XS",
    31: "IQ1_M",
    32: "BF16",
    33: "Q4_0_4_4",
    34: "Q4_0_4_8",
    35: "Q4_0_8_8",
    36: "TQ1_0",
    37: "TQ2_0",
    38: "MXFP4_MOE",
    39: "NVFP4",
    40: "Q1_0",
}


def tensor_nbytes(dims: tuple[int, ...], ggml_type: int) -> int | None:
    """Bytes of a tensor's data from its dims (ggml order, ``dims[0]`` the row) and type; None if unknown."""
    t = GGML_TYPES.get(ggml_type)
    if t is None:
        return None
    n = 1
    for d in dims:
        n *= d
    if not dims or n == 0:
        return 0
    # ggml_row_size: rows are whole blocks; a row that is not is a malformed tensor, rounded up here.
    row = -(-dims[0] // t.block_size) * t.type_size
    return row * (n // dims[0])


# --- the result -------------------------------------------------------------------------------


class ArrayInfo(msgspec.Struct, frozen=True):
    """An array that was walked but not kept (too long and not asked for): its item type and length."""

    item_type: str
    count: int


class TensorInfo(msgspec.Struct, frozen=True):
    name: str
    dims: tuple[int, ...]  # ggml order: dims[0] is the row length (numpy's last axis)
    type: int
    type_name: str  # "Q4_K", or "type 99" for a type this reader does not know
    offset: int  # from the start of the tensor data
    nbytes: int | None  # None for an unknown type


class GGUFHeader(msgspec.Struct, frozen=True, kw_only=True):
    """What a GGUF header says. Shape fields are llama.cpp's effective values (its defaults applied):
    ``head_count_kv`` is ``head_count`` when absent, key/value lengths ``embedding_length /
    head_count``; per-layer arrays give their largest entry. None means the header did not say
    (or ended before saying). The raw key/values are in ``metadata``."""

    version: int
    tensor_count: int  # as declared in the header
    metadata_count: int  # as declared in the header
    metadata_read: int  # how many of them were read
    architecture: str | None = None
    name: str | None = None
    block_count: int | None = None  # layers
    head_count: int | None = None
    head_count_kv: int | None = None
    head_count_kv_per_layer: tuple[int, ...] | None = None  # when the file gives one per layer
    embedding_length: int | None = None
    key_length: int | None = None
    value_length: int | None = None
    context_length: int | None = None
    vocab_size: int | None = None
    file_type: int | None = None
    quantization: str | None = None  # file_type's name, e.g. "Q4_K_M"
    quantization_version: int | None = None
    split_count: int | None = None
    split_no: int | None = None
    split_tensors_count: int | None = None
    alignment: int = DEFAULT_ALIGNMENT
    tensors_read: int = 0
    tensor_bytes: int | None = None  # sum of the tensors' sizes, when every tensor info was read and known
    tensor_types: dict[str, int] = {}  # tensors per ggml type name
    data_offset: int | None = None  # where the tensor data starts, when the tensor infos were all read
    bytes_read: int = 0  # how far into the file the reader got
    complete: bool = True
    stopped_at: str = ""  # where the data ended, when complete is False
    metadata: dict[str, Any] = {}
    tensors: tuple[TensorInfo, ...] = ()  # only with keep_tensors=True

    @property
    def has_shape(self) -> bool:
        """Enough of the shape to size the KV cache."""
        return bool(self.block_count and self.head_count_kv and self.key_length and self.value_length)

    @property
    def is_split(self) -> bool:
        return (self.split_count or 0) > 1


# --- the sans-IO parser -----------------------------------------------------------------------

# The parser yields (offset, at_least) and is sent bytes read at that offset ("" at the end).
_Ask = tuple[int, int]
_Gen = Generator[_Ask, bytes, Any]

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_ARRAY_HEAD = struct.Struct("<IQ")
_COUNTS = struct.Struct("<QQ")


class _Ended(Exception):
    """The source had no more bytes where the parser needed them."""

    def __init__(self, at: int, *, before: bool = False) -> None:
        super().__init__(at)
        self.at = at
        self.before = before  # a skip found no byte at ``at - 1``: the data ends somewhere before ``at``


class _Cursor:
    """A window of the source: ``buf`` holds bytes from absolute offset ``base``; ``i`` is the read point."""

    __slots__ = ("base", "buf", "i")

    def __init__(self) -> None:
        self.buf = bytearray()
        self.base = 0
        self.i = 0

    @property
    def pos(self) -> int:
        return self.base + self.i

    def fill(self, n: int) -> _Gen:
        """Make ``n`` bytes available at the read point, asking the driver for more."""
        while len(self.buf) - self.i < n:
            # Drop what was consumed, so walking megabytes of vocabulary keeps memory flat.
            if self.i:
                del self.buf[: self.i]
                self.base += self.i
                self.i = 0
            end = self.base + len(self.buf)
            data = yield (end, n - len(self.buf))
            if not data:
                raise _Ended(end)
            self.buf += data

    def skip(self, n: int) -> _Gen:
        """Move past ``n`` bytes; those beyond the buffer are not fetched, only the last one (to
        learn that the data reaches that far, so a cut inside a skipped array is reported there)."""
        if n <= len(self.buf) - self.i:
            self.i += n
            return
        start = self.pos
        target = start + n
        self.buf = bytearray()
        self.base = target - 1
        self.i = 0
        try:
            yield from self.fill(1)
        except _Ended:
            self.base = start  # what was read reaches the skipped run's start, no further
            raise _Ended(target, before=True) from None
        self.i = 1

    def u32(self) -> _Gen:
        if len(self.buf) - self.i < 4:
            yield from self.fill(4)
        (v,) = _U32.unpack_from(self.buf, self.i)
        self.i += 4
        return v

    def u64(self) -> _Gen:
        if len(self.buf) - self.i < 8:
            yield from self.fill(8)
        (v,) = _U64.unpack_from(self.buf, self.i)
        self.i += 8
        return v

    def string(self, limit: int, what: str) -> _Gen:
        n = yield from self.u64()
        if n > limit:
            raise GGUFError(f"{what} claims a string of {n} bytes (at most {limit} are read): the file is corrupt")
        if len(self.buf) - self.i < n:
            yield from self.fill(n)
        s = self.buf[self.i : self.i + n].decode("utf-8", "replace")
        self.i += n
        return s


class _Options(msgspec.Struct, frozen=True, kw_only=True):
    tensors: bool = True
    keep_tensors: bool = False
    array_limit: int = DEFAULT_ARRAY_LIMIT
    want: frozenset[str] = frozenset()


class _Partial:
    """What has been read so far, kept outside the parse so an early end still returns it."""

    def __init__(self) -> None:
        self.version = 0
        self.tensor_count = 0
        self.metadata_count = 0
        self.metadata: dict[str, Any] = {}
        self.alignment = DEFAULT_ALIGNMENT
        self.tensors: list[TensorInfo] = []
        self.tensor_bytes: int | None = 0
        self.tensor_types: dict[str, int] = {}
        self.data_offset: int | None = None
        self.where = "the start"


def _value(cur: _Cursor, vtype: int, key: str, keep: bool, opts: _Options) -> _Gen:
    """Read (or, for a long array not kept, walk) one value of type ``vtype``."""
    if vtype == _STRING:
        return (yield from cur.string(MAX_STRING_BYTES, f"metadata {key!r}"))
    if vtype == _ARRAY:
        if len(cur.buf) - cur.i < 12:
            yield from cur.fill(12)
        item_type, count = _ARRAY_HEAD.unpack_from(cur.buf, cur.i)
        cur.i += 12
        return (yield from _array(cur, item_type, count, key, keep or count <= opts.array_limit, opts))
    spec = VALUE_TYPES.get(vtype)
    if spec is None:
        raise GGUFError(
            f"metadata {key!r} has unknown value type {vtype} at byte {cur.pos - 4}: "
            "the file is corrupt or newer than this reader"
        )
    fmt = "<" + spec[1]
    size = struct.calcsize(fmt)
    if len(cur.buf) - cur.i < size:
        yield from cur.fill(size)
    (v,) = struct.unpack_from(fmt, cur.buf, cur.i)
    cur.i += size
    return v


def _array(cur: _Cursor, item_type: int, count: int, key: str, keep: bool, opts: _Options) -> _Gen:
    spec = VALUE_TYPES.get(item_type)
    if spec is None:
        raise GGUFError(
            f"metadata {key!r} is an array of unknown value type {item_type} at byte {cur.pos - 12}: "
            "the file is corrupt or newer than this reader"
        )
    name, fmt = spec
    if fmt:
        size = struct.calcsize("<" + fmt) * count
        if not keep:
            # Fixed-size items: no need to see them at all, over HTTP not even to fetch them.
            yield from cur.skip(size)
            return ArrayInfo(name, count)
        if len(cur.buf) - cur.i < size:
            yield from cur.fill(size)
        items = list(struct.unpack_from(f"<{count}{fmt}", cur.buf, cur.i))
        cur.i += size
        return items
    if item_type == _STRING and not keep:
        # Walk the strings (their lengths are inline, so every byte passes by) without decoding them.
        for _ in range(count):
            if len(cur.buf) - cur.i < 8:
                yield from cur.fill(8)
            (n,) = _U64.unpack_from(cur.buf, cur.i)
            cur.i += 8
            yield from cur.skip(n)
        return ArrayInfo(name, count)
    out: list[Any] = []
    for _ in range(count):
        if item_type == _STRING:
            out.append((yield from cur.string(MAX_STRING_BYTES, f"metadata {key!r}")))
        else:  # nested array: each item carries its own item type and length
            if len(cur.buf) - cur.i < 12:
                yield from cur.fill(12)
            inner_type, inner_count = _ARRAY_HEAD.unpack_from(cur.buf, cur.i)
            cur.i += 12
            inner_keep = keep and (key in opts.want or inner_count <= opts.array_limit)
            out.append((yield from _array(cur, inner_type, inner_count, key, inner_keep, opts)))
    return out if keep else ArrayInfo(name, count)


def _parse(opts: _Options, st: _Partial) -> _Gen:
    cur = _Cursor()
    try:
        yield from cur.fill(4)
    except _Ended as e:
        raise GGUFError(f"not a GGUF file: it is only {e.at} bytes long") from None
    magic = bytes(cur.buf[:4])
    if magic != MAGIC:
        raise GGUFError(f"not a GGUF file (magic {magic!r}, expected {MAGIC!r})")
    cur.i = 4
    try:
        version = yield from cur.u32()
        if version not in SUPPORTED_VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            if swapped in SUPPORTED_VERSIONS:
                raise GGUFError(
                    f"unsupported GGUF version {version}: a big-endian GGUF file (version {swapped}); "
                    "only little-endian files are read"
                )
            raise GGUFError(
                f"unsupported GGUF version {version} (versions {', '.join(map(str, SUPPORTED_VERSIONS))} are read)"
            )
        if len(cur.buf) - cur.i < 16:
            yield from cur.fill(16)
    except _Ended as e:
        raise GGUFError(f"GGUF header cut short at byte {e.at}, before its tensor and metadata counts") from None
    st.version = version
    st.tensor_count, st.metadata_count = _COUNTS.unpack_from(cur.buf, cur.i)
    cur.i += 16
    try:
        yield from _metadata(cur, opts, st)
        if opts.tensors:
            yield from _tensor_infos(cur, opts, st)
    except _Ended as e:
        return cur.pos, f"{st.where}: the data ends {'before' if e.before else 'at'} byte {e.at}"
    return cur.pos, ""


def _metadata(cur: _Cursor, opts: _Options, st: _Partial) -> _Gen:
    total = st.metadata_count
    for k in range(total):
        st.where = f"metadata key {k + 1} of {total}"
        key = yield from cur.string(MAX_KEY_BYTES, st.where)
        st.where = f"metadata {key!r} (key {k + 1} of {total})"
        vtype = yield from cur.u32()
        keep = key in opts.want or key.endswith(_ALWAYS_KEEP_SUFFIXES)
        st.metadata[key] = yield from _value(cur, vtype, key, keep, opts)
        if key == "general.alignment":
            a = st.metadata[key]
            if not isinstance(a, int) or isinstance(a, bool) or a <= 0 or a & (a - 1):
                raise GGUFError(f"general.alignment {a!r} is not a power of two")
            st.alignment = a


def _tensor_infos(cur: _Cursor, opts: _Options, st: _Partial) -> _Gen:
    total = st.tensor_count
    for t in range(total):
        st.where = f"tensor info {t + 1} of {total}"
        name = yield from cur.string(MAX_KEY_BYTES, st.where)
        st.where = f"tensor info {name!r} ({t + 1} of {total})"
        n_dims = yield from cur.u32()
        if n_dims > MAX_DIMS:
            raise GGUFError(f"tensor {name!r} has {n_dims} dimensions (at most {MAX_DIMS}): the file is corrupt")
        size = 8 * n_dims + 12
        if len(cur.buf) - cur.i < size:
            yield from cur.fill(size)
        dims = struct.unpack_from(f"<{n_dims}Q", cur.buf, cur.i)
        ggml_type, offset = struct.unpack_from("<IQ", cur.buf, cur.i + 8 * n_dims)
        cur.i += size
        known = GGML_TYPES.get(ggml_type)
        nbytes = tensor_nbytes(dims, ggml_type)
        info = TensorInfo(name, dims, ggml_type, known.name if known else f"type {ggml_type}", offset, nbytes)
        st.tensor_types[info.type_name] = st.tensor_types.get(info.type_name, 0) + 1
        st.tensor_bytes = None if nbytes is None or st.tensor_bytes is None else st.tensor_bytes + nbytes
        if opts.keep_tensors:
            st.tensors.append(info)
    st.data_offset = -(-cur.pos // st.alignment) * st.alignment


# --- deriving the shape -----------------------------------------------------------------------


def _count(v: Any) -> int | None:
    """A non-negative int, or the largest of a per-layer list of them; None for anything else."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v if v >= 0 else None
    if isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return max(v)
    return None


def _per_layer(v: Any) -> tuple[int, ...] | None:
    if isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return tuple(v)
    return None


def _str(v: Any) -> str | None:
    return v if isinstance(v, str) else None


def _header(st: _Partial, opts: _Options, bytes_read: int, stopped_at: str) -> GGUFHeader:
    md = st.metadata
    arch = _str(md.get("general.architecture"))
    shape: dict[str, Any] = {}
    if arch:
        p = arch + "."
        heads_raw = md.get(p + "attention.head_count")
        kv_raw = md.get(p + "attention.head_count_kv", heads_raw)  # llama.cpp: n_head_kv defaults to n_head
        heads = _count(heads_raw)
        embd = _count(md.get(p + "embedding_length"))
        per_head = embd // heads if embd and heads else None  # llama.cpp's default key/value length
        key_length = _count(md.get(p + "attention.key_length"))
        value_length = _count(md.get(p + "attention.value_length"))
        shape = {
            "block_count": _count(md.get(p + "block_count")),
            "head_count": heads,
            "head_count_kv": _count(kv_raw),
            "head_count_kv_per_layer": _per_layer(kv_raw),
            "embedding_length": embd,
            "key_length": key_length or per_head,
            "value_length": value_length or per_head,
            "context_length": _count(md.get(p + "context_length")),
            "vocab_size": _count(md.get(p + "vocab_size")),
        }
    if not shape.get("vocab_size"):
        tokens = md.get("tokenizer.ggml.tokens")
        shape["vocab_size"] = (
            tokens.count if isinstance(tokens, ArrayInfo) else len(tokens) if isinstance(tokens, list) else None
        )
    file_type = _count(md.get("general.file_type"))
    all_read = opts.tensors and not stopped_at
    return GGUFHeader(
        version=st.version,
        tensor_count=st.tensor_count,
        metadata_count=st.metadata_count,
        metadata_read=len(md),
        architecture=arch,
        name=_str(md.get("general.name")),
        file_type=file_type,
        quantization=FILE_TYPES.get(file_type) if file_type is not None else None,
        quantization_version=_count(md.get("general.quantization_version")),
        split_count=_count(md.get("split.count")),
        split_no=_count(md.get("split.no")),
        split_tensors_count=_count(md.get("split.tensors.count")),
        alignment=st.alignment,
        tensors_read=sum(st.tensor_types.values()),
        tensor_bytes=st.tensor_bytes if all_read else None,
        tensor_types=dict(st.tensor_types),
        data_offset=st.data_offset if all_read else None,
        bytes_read=bytes_read,
        complete=not stopped_at,
        stopped_at=stopped_at,
        metadata=md,
        tensors=tuple(st.tensors) if opts.keep_tensors else (),
        **shape,
    )


# --- sources and drivers ----------------------------------------------------------------------


class ByteSource(Protocol):
    def read_at(self, offset: int, size: int) -> bytes:
        """Up to ``size`` bytes at ``offset``; fewer only where the data ends, b"" past it."""
        ...


class AsyncByteSource(Protocol):
    async def read_at(self, offset: int, size: int) -> bytes:
        """Up to ``size`` bytes at ``offset``; fewer only where the data ends, b"" past it."""
        ...


class BytesSource:
    """Bytes already in memory, e.g. a prefix fetched earlier for another check."""

    def __init__(self, data: bytes) -> None:
        self._data = memoryview(data)

    def read_at(self, offset: int, size: int) -> bytes:
        return bytes(self._data[offset : offset + size])


class FileSource:
    """A local file, read where the parser asks; use as a context manager to close it."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._fd = os.open(path, os.O_RDONLY)
        self._closed = False

    def read_at(self, offset: int, size: int) -> bytes:
        return os.pread(self._fd, size, offset)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            os.close(self._fd)

    def __enter__(self) -> FileSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Chunks:
    """How much to read per ask: at least what the parser needs, else a chunk that doubles each
    time (few round trips for a big tokenizer, little waste for a small header), never past ``limit``."""

    def __init__(self, first: int, most: int, limit: int | None) -> None:
        self.next = max(1, first)
        self.most = max(self.next, most)
        self.limit = limit
        self.limit_hit = False

    def size(self, offset: int, need: int) -> int:
        n = max(need, self.next)
        self.next = min(self.next * 2, self.most)
        if self.limit is not None and offset + n > self.limit:
            n = max(0, self.limit - offset)
            self.limit_hit = self.limit_hit or n < need
        return n


def _options(tensors: bool, keep_tensors: bool, array_limit: int, want: Collection[str]) -> _Options:
    if array_limit < 0:
        raise ValueError(f"array_limit must be >= 0, not {array_limit}")
    return _Options(tensors=tensors, keep_tensors=keep_tensors, array_limit=array_limit, want=frozenset(want))


def _finish(st: _Partial, opts: _Options, chunks: _Chunks, done: tuple[int, str]) -> GGUFHeader:
    bytes_read, stopped_at = done
    if stopped_at and chunks.limit_hit:
        stopped_at += f" (the reader's limit of {chunks.limit} bytes)"
    return _header(st, opts, bytes_read, stopped_at)


def read_header(
    source: ByteSource,
    *,
    tensors: bool = True,
    keep_tensors: bool = False,
    array_limit: int = DEFAULT_ARRAY_LIMIT,
    want: Collection[str] = (),
    limit: int | None = None,
    first_chunk: int = 1 << 20,
    max_chunk: int = 16 << 20,
) -> GGUFHeader:
    """Read a GGUF header from ``source``.

    ``tensors``: also read the tensor infos (count, types, total bytes); ``keep_tensors``: keep each
    one in ``tensors``. Arrays longer than ``array_limit`` are walked but kept only as
    :class:`ArrayInfo`, unless their key is in ``want``. ``limit``: never read past this byte (the
    header then ends there, ``complete=False``). Raises :class:`GGUFError` for data that is not a
    GGUF header; data that merely ends early is not an error.
    """
    opts = _options(tensors, keep_tensors, array_limit, want)
    chunks = _Chunks(first_chunk, max_chunk, limit)
    st = _Partial()
    gen = _parse(opts, st)
    try:
        offset, need = next(gen)
        while True:
            n = chunks.size(offset, need)
            offset, need = gen.send(source.read_at(offset, n) if n > 0 else b"")
    except StopIteration as stop:
        return _finish(st, opts, chunks, stop.value)


async def read_header_async(
    source: AsyncByteSource,
    *,
    tensors: bool = True,
    keep_tensors: bool = False,
    array_limit: int = DEFAULT_ARRAY_LIMIT,
    want: Collection[str] = (),
    limit: int | None = None,
    first_chunk: int = 1 << 20,
    max_chunk: int = 64 << 20,
) -> GGUFHeader:
    """:func:`read_header` for an async source, e.g. :class:`llmgw.modelfiles.http.HttpRangeSource`."""
    opts = _options(tensors, keep_tensors, array_limit, want)
    chunks = _Chunks(first_chunk, max_chunk, limit)
    st = _Partial()
    gen = _parse(opts, st)
    try:
        offset, need = next(gen)
        while True:
            n = chunks.size(offset, need)
            offset, need = gen.send(await source.read_at(offset, n) if n > 0 else b"")
    except StopIteration as stop:
        return _finish(st, opts, chunks, stop.value)


def read_header_file(path: str | os.PathLike[str], **options: Any) -> GGUFHeader:
    """The header of a local file; ``options`` as for :func:`read_header`."""
    with FileSource(path) as source:
        return read_header(source, **options)


def read_header_bytes(data: bytes, **options: Any) -> GGUFHeader:
    """The header in ``data`` (a whole file or a prefix of one); ``options`` as for :func:`read_header`."""
    return read_header(BytesSource(data), **options)
