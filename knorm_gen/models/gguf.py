"""GGUF files as mlx_lm models: reading, architecture mapping, tokenizers, conversion cache.

A GGUF is converted once into mlx_lm's own layout (``config.json``,
``model.safetensors``, ``tokenizer.json``) under :func:`cache_root`, keyed by
the file's sha256 and :data:`CONVERTER_VERSION`; every load, the first one
included, then goes through ``mlx_lm.load`` on that folder.

Who does what:
- Tensors: MLX's own GGUF reader (``mx.load``) where it can read the file. It
  reads SmolLM2's Q4_1 file in 0.11 s (0.4 s more to dequantize in MLX) and
  keeps Q4_0/Q4_1/Q8_0 as MLX affine-quantized triples; llama.cpp's ``gguf``
  package took 2.4 s to parse the same file and 0.8 s to dequantize it
  (benchmarks/bench_load.py). ``mx.load`` refuses files holding other types
  (Q4_K, Q5_0, Q6_K, ...): those are read and dequantized to float32 by the
  ``gguf`` package.
- Names and metadata keys: the ``gguf`` package's tables (``TensorNameMap``,
  ``Keys``), asked with mlx_lm's own parameter names.
- Tokenizers: transformers' GGUF tokenizer converter (no PyTorch needed).
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import importlib
import json
import math
import mmap
import os
import re
import shutil
import stat
import struct
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..platform.files import fsync_folder, replacing
from ..platform.runtime import cache_root

__all__ = [
    "CONVERTER_VERSION",
    "SUPPORTED_ARCHITECTURES",
    "UnsupportedGGUFError",
    "InvalidGGUFError",
    "CacheWriteError",
    "GGUFContents",
    "GGUFHeader",
    "build_tokenizer",
    "cache_root",
    "cached_conversion",
    "convert_gguf",
    "converted_dir",
    "ensure_converted",
    "file_sha256",
    "load_converted",
    "load_gguf",
    "map_weights",
    "model_config",
    "read_gguf",
    "read_header",
    "remove_dead_conversions",
]

# Bump whenever the files written by convert_gguf would change: old caches are then ignored.
CONVERTER_VERSION = 1
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "gemma3")
_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "gemma3": "gemma3_text"}
_INFO_FILE = "knorm.json"
# End-of-turn markers of common chat templates: generation stops at them too.
_EOS_MARKERS = ("<|im_end|>", "<|endoftext|>", "</s>", "<end_of_turn>", "<|eot_id|>")
_CONTROL_TOKEN = 3  # GGUF token_type of control/special tokens
_MISSING = object()


class UnsupportedGGUFError(ValueError):
    """The GGUF's architecture, tokenizer or tensors are not ones we can convert."""


class InvalidGGUFError(UnsupportedGGUFError):
    """The file is not a well-formed GGUF, or its metadata contradicts itself or
    its tensors. The message is one line that names the field."""


class CacheWriteError(OSError):
    """The conversion cache could not be written (full disk, read-only, ...);
    the message names the path and the cause."""


@dataclass
class GGUFContents:
    """A GGUF's metadata (plain Python values) and tensors (GGUF names).

    ``reader`` is "mlx" (quantized types kept as ``.weight/.scales/.biases``
    triples) or "gguf" (every quantized type dequantized to float32).
    """

    metadata: dict[str, Any]
    tensors: dict[str, mx.array]
    reader: str
    # tensor name -> logical shape (numpy order), from the header; MLX's
    # quantized triples do not show it. Empty: the tensors' own shapes.
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def shape(self, name: str) -> tuple[int, ...] | None:
        if name in self.shapes:
            return self.shapes[name]
        return tuple(self.tensors[name].shape) if name in self.tensors else None

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")


# ------------------------------------------------------------ the header
#
# A GGUF is untrusted input. Its header is walked here, every count and length
# checked against the bytes the file has left, before mx.load or the gguf
# package allocates anything for it: crafted counts made mx.load crash the
# process (SIGSEGV, abort) and made the gguf package grow without bound.

_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_MIN_VALUE_SIZE = {**_SCALAR_SIZES, _STRING: 8, _ARRAY: 12}  # a string's length, an array's type + count
_MIN_KV_SIZE = 8 + 4 + 1  # key length, value type, smallest value
_MIN_TENSOR_SIZE = 8 + 4 + 4 + 8  # name length, n_dims, type, offset
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_NESTING = 8


@dataclass
class GGUFHeader:
    """What the header of a GGUF says, every count and length checked against the file."""

    version: int
    file_size: int
    alignment: int
    data_offset: int
    # tensor name -> (shape in numpy order, i.e. the GGUF dims reversed; GGML type id)
    tensors: dict[str, tuple[tuple[int, ...], int]]
    keys: list[str]
    # key -> plain Python value; read only when asked (:func:`_walk` with ``values``)
    metadata: dict[str, Any] = field(default_factory=dict)
    # tensor name -> its offset from ``data_offset``
    offsets: dict[str, int] = field(default_factory=dict)


class _Cursor:
    def __init__(self, buf, path: str):
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def fail(self, message: str) -> InvalidGGUFError:
        return InvalidGGUFError(f"{self.path}: {message}")

    @property
    def left(self) -> int:
        return self.size - self.pos

    def unpack(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        if n > self.left:
            raise self.fail(f"{what} runs past the end of the {self.size}-byte file")
        value = struct.unpack_from("<" + fmt, self.buf, self.pos)[0]
        self.pos += n
        return value

    def count(self, what: str, each: int, noun: str) -> int:
        """A u64 count of items of at least ``each`` bytes, checked against what is left."""
        n = self.unpack("Q", what)
        if n * each > self.left:
            raise self.fail(f"{what} claims {n} {noun}, more than the {self.left} bytes left in "
                            f"the {self.size}-byte file can hold")
        return n

    def skip_string(self, what: str) -> None:
        n = self.unpack("Q", f"{what} length")
        if n > self.left:
            raise self.fail(f"{what} claims {n} bytes, more than the {self.left} left in the {self.size}-byte file")
        self.pos += n

    def string(self, what: str) -> str:
        start = self.pos + 8
        self.skip_string(what)
        try:
            return self.buf[start:self.pos].decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8 text") from None

    def array_header(self, what: str, depth: int) -> tuple[int, int]:
        """An array's element type and count, each checked (nesting, known type, bytes left)."""
        if depth >= _MAX_NESTING:
            raise self.fail(f"{what} nests arrays more than {_MAX_NESTING} deep")
        etype = self.unpack("I", f"{what} element type")
        if etype not in _MIN_VALUE_SIZE:
            raise self.fail(f"{what} has unknown element type {etype}")
        return etype, self.count(what, _MIN_VALUE_SIZE[etype], "elements")

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        """Read one metadata value as a plain Python value (an array as a list)."""
        if vtype in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[vtype], what)
        if vtype == _STRING:
            return self.string(what)
        if vtype != _ARRAY:
            raise self.fail(f"{what} has unknown value type {vtype}")
        etype, n = self.array_header(what, depth)
        if etype in _SCALAR_SIZES:
            import numpy as np

            # numpy reads a vocabulary's 262,144 scores at once; element by element took seconds
            items = np.frombuffer(self.buf, dtype="<" + _SCALAR_FORMATS[etype].replace("?", "b1"), count=n,
                                  offset=self.pos)
            self.pos += n * _SCALAR_SIZES[etype]
            return items.tolist()
        return [self.value(etype, what, depth + 1) for _ in range(n)]

    def skip_value(self, vtype: int, what: str, depth: int = 0) -> Any:
        """Skip one value (returning it when it is a scalar)."""
        if vtype in _SCALAR_FORMATS:
            return self.unpack(_SCALAR_FORMATS[vtype], what)
        if vtype == _STRING:
            self.skip_string(what)
        elif vtype == _ARRAY:
            etype, n = self.array_header(what, depth)
            if etype in _SCALAR_SIZES:
                self.pos += n * _SCALAR_SIZES[etype]
            else:
                for _ in range(n):
                    self.skip_value(etype, what, depth + 1)
        else:
            raise self.fail(f"{what} has unknown value type {vtype}")
        return None


def _tensor_nbytes(shape: tuple[int, ...], ggml_type: int, what: str, cur: _Cursor) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise cur.fail(f"{what} has unknown tensor type {ggml_type}") from None
    if shape[-1] % block:
        raise cur.fail(f"{what}: its row of {shape[-1]} values is not a whole number of {block}-value blocks")
    return math.prod(shape) // block * size


def read_header(path: str | Path) -> GGUFHeader:
    """Walk a GGUF's header and check it against the file's size; raises
    :class:`InvalidGGUFError` naming the first field that cannot be right.

    Nothing is allocated from a count the file could not hold: 2^63 tensors
    in a 182-byte file is refused before anything reads them.
    """
    path = str(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise InvalidGGUFError(f"{path}: {size} bytes is too short for a GGUF header (24 bytes)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _walk(_Cursor(buf, path))
    except OSError as e:
        raise UnsupportedGGUFError(f"{path} is not a readable GGUF file: {e}") from e


def _walk(cur: _Cursor, values: bool = False) -> GGUFHeader:
    if cur.buf[:4] != b"GGUF":
        raise cur.fail(f"not a GGUF file (it starts with {cur.buf[:4]!r}, not b'GGUF')")
    cur.pos = 4
    version = cur.unpack("I", "version")
    if version not in (2, 3):
        raise cur.fail(f"GGUF version {version} is not supported (2 or 3)")
    n_tensors = cur.unpack("Q", "tensor count")
    n_kv = cur.unpack("Q", "metadata count")
    if n_tensors * _MIN_TENSOR_SIZE > cur.left:
        raise cur.fail(f"GGUF header claims {n_tensors} tensors, more than a {cur.size}-byte file can hold")
    if n_kv * _MIN_KV_SIZE > cur.left:
        raise cur.fail(f"GGUF header claims {n_kv} metadata entries, more than a {cur.size}-byte file can hold")
    keys, alignment = [], 32
    seen = set()
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = cur.string(f"key of metadata entry {i}")
        if key in seen:
            raise cur.fail(f"metadata key {key!r} appears twice")
        seen.add(key)
        keys.append(key)
        vtype = cur.unpack("I", f"type of metadata {key!r}")
        if values:
            value = metadata[key] = cur.value(vtype, f"metadata {key!r}")
        else:
            value = cur.skip_value(vtype, f"metadata {key!r}")
        if key == "general.alignment":
            if vtype != 4 or value <= 0 or value & (value - 1):
                raise cur.fail(f"metadata 'general.alignment' must be a power of two (uint32), got {value!r}")
            alignment = value
    tensors: dict[str, tuple[tuple[int, ...], int]] = {}
    offsets: dict[str, int] = {}
    placed = []
    for i in range(n_tensors):
        name = cur.string(f"name of tensor {i}")
        what = f"tensor {name!r}"
        if name in tensors:
            raise cur.fail(f"{what} appears twice")
        n_dims = cur.unpack("I", f"{what} dimension count")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise cur.fail(f"{what} claims {n_dims} dimensions (GGUF allows 1 to {_MAX_DIMS})")
        dims = [cur.unpack("Q", f"{what} dimensions") for _ in range(n_dims)]
        if 0 in dims:
            raise cur.fail(f"{what} has an empty dimension: {dims}")
        ggml_type = cur.unpack("I", f"{what} type")
        offset = cur.unpack("Q", f"{what} offset")
        shape = tuple(reversed(dims))
        placed.append((what, offset, _tensor_nbytes(shape, ggml_type, what, cur)))
        tensors[name] = (shape, ggml_type)
        offsets[name] = offset
    data_offset = cur.pos + (-cur.pos % alignment)
    for what, offset, nbytes in placed:
        if offset % alignment:
            raise cur.fail(f"{what} offset {offset} is not a multiple of the alignment {alignment}")
        if data_offset + offset + nbytes > cur.size:
            raise cur.fail(f"{what} claims {nbytes} bytes at offset {offset}, past the end of the "
                           f"{cur.size}-byte file")
    return GGUFHeader(version=version, file_size=cur.size, alignment=alignment,
                      data_offset=data_offset, tensors=tensors, keys=keys, metadata=metadata, offsets=offsets)


# ------------------------------------------------------------------- reading


def _plain(value: Any) -> Any:
    if isinstance(value, mx.array):
        return value.item() if value.ndim == 0 else value.tolist()
    return value


def read_gguf(path: str | Path) -> GGUFContents:
    """Read every tensor and metadata value of a GGUF file, once its header
    has passed :func:`read_header` (which raises :class:`InvalidGGUFError`)."""
    header = read_header(path)
    shapes = {name: shape for name, (shape, _) in header.tensors.items()}
    try:
        tensors, metadata = mx.load(str(path), return_metadata=True)
        return GGUFContents({k: _plain(v) for k, v in metadata.items()}, tensors, "mlx", shapes)
    except (RuntimeError, ValueError):
        pass  # a tensor type MLX cannot represent: let the gguf package dequantize it

    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            header = _walk(_Cursor(buf, str(path)), values=True)
            tensors = {name: mx.array(_dequantized(buf, header, name, path)) for name in header.tensors}
    except OSError as e:
        raise UnsupportedGGUFError(f"{path} is not a readable GGUF file: {e}") from e
    return GGUFContents({k: v for k, v in header.metadata.items() if not k.startswith("GGUF.")}, tensors, "gguf",
                        shapes)


_PLAIN_TYPES = {0: "<f4", 1: "<f2", 24: "i1", 25: "<i2", 26: "<i4", 27: "<i8", 28: "<f8"}
"""GGML types stored as plain numbers (F32, F16, I8, I16, I32, I64, F64): copied, not dequantized."""


def _dequantized(buf, header: GGUFHeader, name: str, path: str | Path):
    """Tensor ``name`` of a walked GGUF as numpy: plain types copied in their stored
    precision, quantized ones dequantized to float32 by the gguf package."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quant_shape_to_byte_shape

    shape, ggml_type = header.tensors[name]
    start = header.data_offset + header.offsets[name]
    if ggml_type in _PLAIN_TYPES:
        dtype = np.dtype(_PLAIN_TYPES[ggml_type])
        return np.frombuffer(buf, dtype=dtype, count=math.prod(shape), offset=start).reshape(shape).copy()
    qtype = GGMLQuantizationType(ggml_type)  # known: the header walk checked it
    byte_shape = quant_shape_to_byte_shape(shape, qtype)
    data = np.frombuffer(buf, dtype=np.uint8, count=math.prod(byte_shape), offset=start).reshape(byte_shape)
    try:
        return dequantize(data, qtype)
    except NotImplementedError as e:
        raise UnsupportedGGUFError(f"{path}: tensor {name}: {e}") from e


_SHA256: dict[tuple[str, int, int], str] = {}


def file_sha256(path: str | Path) -> str:
    """sha256 of a file, remembered per (path, size, mtime) for this process."""
    path = Path(path).resolve()
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _SHA256:
        digest = hashlib.sha256()
        with path.open("rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
        _SHA256[key] = digest.hexdigest()
    return _SHA256[key]


# ------------------------------------------------------ architecture mapping


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _Meta:
    """Metadata lookups by the gguf package's key templates ("{arch}.block_count"),
    with the checks a value must pass before anything is sized by it."""

    def __init__(self, metadata: dict[str, Any], arch: str):
        self.md, self.arch = metadata, arch

    def key(self, template: str) -> str:
        return template.format(arch=self.arch)

    def get(self, template: str, default: Any = _MISSING) -> Any:
        key = self.key(template)
        if key in self.md:
            return self.md[key]
        if default is _MISSING:
            raise UnsupportedGGUFError(f"GGUF metadata lacks {key!r}")
        return default

    def count(self, template: str, default: Any = _MISSING) -> int:
        """A positive whole number (a layer count, a width, a number of heads)."""
        value = self.get(template, default)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            what = "per-layer values are not supported" if isinstance(value, list) else "not a whole number"
            raise InvalidGGUFError(f"GGUF metadata {self.key(template)!r} is {_short(value)}: {what}")
        if value <= 0:
            raise InvalidGGUFError(f"GGUF metadata {self.key(template)!r} is {value}; it must be at least 1")
        return value

    def positive(self, template: str, default: Any = _MISSING) -> float | None:
        """A positive finite number, or None where absent and the default is None."""
        value = self.get(template, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise InvalidGGUFError(
                f"GGUF metadata {self.key(template)!r} is {_short(value)}; it must be a positive number"
            )
        return float(value)


def _window_pattern(value: Any) -> int:
    """mlx_lm's sliding_window_pattern from an int, or from llama.cpp's per-layer
    list of booleans (True = sliding)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise InvalidGGUFError(f"sliding-window layer pattern {value} must be at least 1")
        return value
    if not isinstance(value, list):
        raise InvalidGGUFError(f"sliding-window layer pattern {_short(value)} is neither a period nor a list")
    flags = [bool(v) for v in value]
    period = flags.index(False) + 1 if False in flags else len(flags) + 1
    if flags != [(i + 1) % period != 0 for i in range(len(flags))]:
        raise UnsupportedGGUFError(f"sliding-window layer pattern {_short(flags)} is not periodic")
    return period


def _rope_scaling(meta: _Meta) -> dict | None:
    import gguf

    kind = meta.get(gguf.Keys.Rope.SCALING_TYPE, None)
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"type": "linear", "factor": meta.positive(gguf.Keys.Rope.SCALING_FACTOR)}
    raise UnsupportedGGUFError(f"RoPE scaling {_short(kind)} is not supported (only 'linear')")


def _architecture(contents: GGUFContents) -> str:
    arch = contents.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedGGUFError(
            f"GGUF architecture {_short(arch)} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if contents.shape("token_embd.weight") is None:
        raise UnsupportedGGUFError("GGUF has no token_embd.weight tensor")
    return arch


def _head_dim(meta: _Meta, hidden: int, heads: int) -> int:
    """Per-head width: key_length, else the RoPE dimension count, else hidden / heads."""
    import gguf

    K = gguf.Keys
    for template in (K.Attention.KEY_LENGTH, K.Rope.DIMENSION_COUNT):
        if meta.get(template, None) is not None:
            head_dim = meta.count(template)
            break
    else:
        if hidden % heads:
            raise InvalidGGUFError(
                f"GGUF metadata {meta.key(K.LLM.EMBEDDING_LENGTH)!r} ({hidden}) is not a multiple of "
                f"{meta.key(K.Attention.HEAD_COUNT)!r} ({heads})"
            )
        head_dim = hidden // heads
    rotary = meta.count(K.Rope.DIMENSION_COUNT, head_dim)
    if rotary != head_dim:
        raise UnsupportedGGUFError(f"partial rotary embeddings ({rotary} of {head_dim} dims) are not supported")
    return head_dim


def _common_config(contents: GGUFContents, meta: _Meta) -> tuple[dict[str, Any], int]:
    """The config entries every architecture shares, and the head width."""
    import gguf

    K = gguf.Keys
    hidden = meta.count(K.LLM.EMBEDDING_LENGTH)
    heads = meta.count(K.Attention.HEAD_COUNT)
    kv_heads = meta.count(K.Attention.HEAD_COUNT_KV, heads)
    if heads % kv_heads:
        raise InvalidGGUFError(
            f"GGUF metadata {meta.key(K.Attention.HEAD_COUNT)!r} ({heads}) is not a multiple of "
            f"{meta.key(K.Attention.HEAD_COUNT_KV)!r} ({kv_heads})"
        )
    config: dict[str, Any] = {
        "model_type": _MODEL_TYPES[meta.arch],
        "hidden_size": hidden,
        "num_hidden_layers": meta.count(K.LLM.BLOCK_COUNT),
        "intermediate_size": meta.count(K.LLM.FEED_FORWARD_LENGTH),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": meta.positive(K.Attention.LAYERNORM_RMS_EPS),
        # the embedding's rows, not the tokenizer's length: they may differ (padding rows)
        "vocab_size": contents.shape("token_embd.weight")[0],
        "max_position_embeddings": meta.count(K.LLM.CONTEXT_LENGTH),
        "tie_word_embeddings": contents.shape("output.weight") is None,
    }
    if (theta := meta.positive(K.Rope.FREQ_BASE, None)) is not None:
        config["rope_theta"] = theta
    if scaling := _rope_scaling(meta):
        config["rope_scaling"] = scaling
    return config, _head_dim(meta, hidden, heads)


def _tensor_names(contents: GGUFContents) -> list[str]:
    return list(contents.shapes or contents.tensors)


def _check_blocks(contents: GGUFContents, meta: _Meta, n_blocks: int) -> None:
    """The block count must be the number of blocks the tensors are for: a
    count of 10^7 would otherwise size name tables and models by it."""
    import gguf

    found = set()
    for name in _tensor_names(contents):
        head, _, rest = name.partition(".")
        if head == "blk" and (index := rest.partition(".")[0]).isdigit():
            found.add(int(index))
    contiguous = bool(found) and min(found) == 0 and max(found) == len(found) - 1
    if not (contiguous and len(found) == n_blocks):  # never sized by n_blocks: it may be 2^32-1
        holds = f"blocks blk.0 to blk.{max(found)}" if contiguous else (
            f"{len(found)} blocks" + (f" (blk.{min(found)} to blk.{max(found)}, with gaps)" if found else ""))
        raise InvalidGGUFError(
            f"GGUF metadata {meta.key(gguf.Keys.LLM.BLOCK_COUNT)!r} is {n_blocks} but the file's tensors are "
            f"for {holds}"
        )


def _check_shapes(contents: GGUFContents, meta: _Meta, config: dict[str, Any], head_dim: int) -> None:
    """Every attention, feed-forward and embedding tensor must have the shape
    the metadata implies, else the message names the metadata that disagrees."""
    import gguf

    K = gguf.Keys
    hidden, ffn = config["hidden_size"], config["intermediate_size"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    emb = f"{meta.key(K.LLM.EMBEDDING_LENGTH)}={hidden}"
    q_why = f"{meta.key(K.Attention.HEAD_COUNT)}={config['num_attention_heads']} heads of {head_dim} dims, {emb}"
    kv_why = f"{meta.key(K.Attention.HEAD_COUNT_KV)}={config['num_key_value_heads']} heads of {head_dim} dims, {emb}"
    ffn_why = f"{meta.key(K.LLM.FEED_FORWARD_LENGTH)}={ffn}, {emb}"
    expected = {  # GGUF module name -> (shape in numpy order, None = any; the metadata behind it)
        "token_embd": ((None, hidden), emb),
        "output": ((None, hidden), emb),
        "attn_q": ((q, hidden), q_why),
        "attn_output": ((hidden, q), q_why),
        "attn_k": ((kv, hidden), kv_why),
        "attn_v": ((kv, hidden), kv_why),
        "ffn_gate": ((ffn, hidden), ffn_why),
        "ffn_up": ((ffn, hidden), ffn_why),
        "ffn_down": ((hidden, ffn), ffn_why),
        "attn_q_norm": ((head_dim,), q_why),
        "attn_k_norm": ((head_dim,), kv_why),
    }
    for name in _tensor_names(contents):
        base, _, kind = name.rpartition(".")
        if kind != "weight":
            continue
        if (want := expected.get(base.split(".")[-1] if base.startswith("blk.") else base)) is None:
            continue
        shape, why = want
        got = contents.shape(name)
        if len(got) != len(shape) or any(w is not None and g != w for g, w in zip(got, shape)):
            implied = tuple("any" if w is None else w for w in shape)
            raise InvalidGGUFError(
                f"tensor {name!r} has shape {tuple(got)} but the metadata ({why}) imply {implied}"
            )
    n_tokens = len(contents.metadata.get("tokenizer.ggml.tokens") or ())
    if n_tokens > config["vocab_size"]:
        raise InvalidGGUFError(
            f"GGUF metadata 'tokenizer.ggml.tokens' has {n_tokens} tokens but token_embd.weight only "
            f"{config['vocab_size']} rows"
        )


def _llama_config(contents: GGUFContents, meta: _Meta, head_dim: int) -> tuple[dict, dict]:
    names = _tensor_names(contents)
    return {
        "head_dim": head_dim,
        # llama.cpp permutes Q/K rows for interleaved (GPT-J style) RoPE;
        # rotating adjacent pairs on those rows is the same attention.
        "rope_traditional": True,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": "blk.0.ffn_up.bias" in names,
    }, {}


def _qwen2_config(contents: GGUFContents, meta: _Meta, head_dim: int) -> tuple[dict, dict]:
    import gguf

    hidden, heads = meta.count(gguf.Keys.LLM.EMBEDDING_LENGTH), meta.count(gguf.Keys.Attention.HEAD_COUNT)
    if head_dim * heads != hidden:
        raise UnsupportedGGUFError(f"qwen2 with head_dim {head_dim} != hidden/heads is not supported")
    return {}, {}


def _gemma3_config(contents: GGUFContents, meta: _Meta, head_dim: int) -> tuple[dict, dict]:
    """Gemma 3 GGUFs from llama.cpp's converter do not state the sliding-window
    settings; llama.cpp hard-codes them, and so do mlx_lm's defaults."""
    import gguf
    from mlx_lm.models import gemma3_text

    K = gguf.Keys
    defaults = {f.name: f.default for f in dataclasses.fields(gemma3_text.ModelArgs)}
    config: dict[str, Any] = {"head_dim": head_dim}
    assumed: dict[str, Any] = {}
    for name, template, convert in (
        ("sliding_window", K.Attention.SLIDING_WINDOW, meta.count),
        ("sliding_window_pattern", K.Attention.SLIDING_WINDOW_PATTERN,
         lambda t: _window_pattern(meta.get(t))),
        ("rope_local_base_freq", K.Rope.FREQ_BASE_SWA, meta.positive),
        ("query_pre_attn_scalar", K.Attention.SCALE, lambda t: meta.positive(t) ** -2),
    ):
        if meta.get(template, None) is None:
            config[name] = assumed[name] = defaults[name]
        else:
            config[name] = convert(template)
    return config, assumed


_ARCH_CONFIG = {"llama": _llama_config, "qwen2": _qwen2_config, "gemma3": _gemma3_config}


def model_config(contents: GGUFContents) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(config, assumed)``: the mlx_lm ``config.json`` for this GGUF, and the
    values the file does not state that were taken from mlx_lm's defaults.

    Every count and width is checked first (positive, consistent with the
    others and with the tensors' shapes): :class:`InvalidGGUFError` names the
    metadata key that is wrong.
    """
    arch = _architecture(contents)
    meta = _Meta(contents.metadata, arch)
    config, head_dim = _common_config(contents, meta)
    _check_blocks(contents, meta, config["num_hidden_layers"])
    _check_shapes(contents, meta, config, head_dim)
    extra, assumed = _ARCH_CONFIG[arch](contents, meta, head_dim)
    config.update(extra)
    return config, assumed


def _build_model(config: dict[str, Any]) -> tuple[Any, nn.Module]:
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    return module, module.Model(module.ModelArgs.from_dict(config))


def map_weights(contents: GGUFContents, config: dict[str, Any]) -> dict[str, mx.array]:
    """GGUF tensors under mlx_lm parameter names, in mlx_lm's conventions.

    The name table is the gguf package's, asked with each parameter of a
    freshly built mlx_lm model. Raises for any tensor it cannot place and for
    any parameter left without a tensor.
    """
    import gguf

    arch = contents.architecture
    module, model = _build_model(config)
    params = dict(tree_flatten(model.parameters()))
    arch_id = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]
    table = gguf.get_tensor_name_map(arch_id, config["num_hidden_layers"])
    places = {}  # GGUF module name ("blk.0.attn_q") -> mlx_lm module path
    for name in params:
        if found := table.get_name(name, try_suffixes=(".weight", ".bias")):
            places[found.rpartition(".")[0]] = name.rpartition(".")[0]

    out = {}
    for name, value in contents.tensors.items():
        base, _, kind = name.rpartition(".")
        if base == "rope_freqs":
            # Llama 3.1-style per-dimension RoPE factors; all ones means plain RoPE.
            if not mx.all(value.astype(mx.float32) == 1).item():
                raise UnsupportedGGUFError("per-dimension RoPE frequency factors (rope_freqs) are not supported")
            continue
        if base not in places:
            raise UnsupportedGGUFError(f"unexpected tensor {name!r} for GGUF architecture {arch!r}")
        out[f"{places[base]}.{kind}"] = value

    # A tied model has no output.weight; mlx_lm's Gemma drops its lm_head in sanitize.
    tied_head = "lm_head.weight" if config["tie_word_embeddings"] else None
    missing = sorted(p for p in params if p not in out and p != tied_head)
    if missing:
        raise UnsupportedGGUFError(f"GGUF lacks tensors for {missing[:5]}{' ...' if len(missing) > 5 else ''}")

    if arch == "gemma3":
        # llama.cpp stores Gemma norm weights with 1 already added; mlx_lm's
        # Gemma RMSNorm multiplies by (1 + weight) itself.
        for path, m in model.named_modules():
            if isinstance(m, module.RMSNorm):
                out[f"{path}.weight"] = out[f"{path}.weight"].astype(mx.float32) - 1.0
    return out


def _quantization(weights: dict[str, mx.array], config: dict[str, Any]) -> dict | None:
    """mlx_lm's ``quantization`` config entry for MLX-quantized triples, if any.

    mlx_lm infers each layer's bits and group size from the saved shapes; the
    top-level values only need to be those of one real layer.
    """
    from mlx_lm.utils import infer_quant_config

    scaled = [k[: -len(".scales")] for k in weights if k.endswith(".scales")]
    if not scaled:
        return None
    _, model = _build_model(config)
    modules = dict(model.named_modules())
    return infer_quant_config(scaled[0], modules[scaled[0]], weights)


# ---------------------------------------------------------------- tokenizer


def _quiet_transformers():
    """Import transformers without its "PyTorch was not found" notice."""
    import transformers.utils.logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        import transformers
    finally:
        hf_logging.set_verbosity(verbosity)
    return transformers


def build_tokenizer(metadata: dict[str, Any]):
    """A transformers fast tokenizer from GGUF tokenizer metadata.

    transformers' converter covers byte-level BPE (``tokenizer.ggml.model =
    gpt2``) and SentencePiece (``llama``, with Gemma's no-merges vocabulary).
    One gap is filled here: llama.cpp's "smollm" pre-tokenizer splits every
    digit before the GPT-2 split, which transformers' table does not know.
    """
    transformers = _quiet_transformers()
    from tokenizers import pre_tokenizers
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    md = metadata
    fields = {
        name: md[f"tokenizer.{key}"]
        for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
        if f"tokenizer.{key}" in md
    }
    if "tokens" not in fields:
        raise UnsupportedGGUFError("GGUF has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    try:
        backend, _ = convert_gguf_tokenizer(md.get("general.architecture"), fields)
    except ValueError as e:
        raise UnsupportedGGUFError(str(e)) from e
    if fields.get("pre_tokenizer_type") == "smollm":
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), backend.pre_tokenizer]
        )

    tokens = fields["tokens"]

    def token(key: str) -> str | None:
        idx = md.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

    specials = {
        f"{name}_token": value
        for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))
        if (value := token(key)) is not None
    }
    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
    add_bos = md.get("tokenizer.ggml.add_bos_token", fields.get("tokenizer_type") == "llama")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        chat_template=md.get("tokenizer.chat_template"),
        add_bos_token=bool(add_bos),
        add_eos_token=bool(md.get("tokenizer.ggml.add_eos_token", False)),
        **specials,
    )


def _eos_ids(tokenizer, metadata: dict[str, Any]) -> list[int]:
    """The GGUF's eos, plus the end-of-turn markers that the file marks as
    control tokens (Gemma's vocabulary has an ordinary "</s>", for one)."""
    vocab = tokenizer.get_vocab()
    types = metadata.get("tokenizer.ggml.token_type") or []
    ids = {
        vocab[t] for t in _EOS_MARKERS
        if t in vocab and vocab[t] < len(types) and types[vocab[t]] == _CONTROL_TOKEN
    }
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


# --------------------------------------------------------------- conversion


def converted_dir(sha256: str) -> Path:
    """The cache folder of the GGUF with this sha256 (it may not exist yet)."""
    return cache_root() / "converted" / f"{sha256}-v{CONVERTER_VERSION}"


@dataclass
class _Conversion:
    """A GGUF read, checked and mapped to mlx_lm's layout; nothing written yet."""

    config: dict[str, Any]
    weights: dict[str, mx.array]
    tokenizer: Any
    info: dict[str, Any]


def _prepare(path: str | Path, sha256: str | None = None) -> _Conversion:
    """Read and check the GGUF (header, metadata, tensors, tokenizer). Raises
    :class:`UnsupportedGGUFError` (or :class:`InvalidGGUFError`) naming the
    file and the field before anything is written."""
    try:
        contents = read_gguf(path)
        config, assumed = model_config(contents)
        weights = map_weights(contents, config)
        tokenizer = build_tokenizer(contents.metadata)
    except UnsupportedGGUFError as e:
        if str(path) in str(e):
            raise
        raise type(e)(f"{path}: {e}") from e
    config["eos_token_id"] = _eos_ids(tokenizer, contents.metadata)
    if quant := _quantization(weights, config):
        config["quantization"] = quant
    info = {
        "converter_version": CONVERTER_VERSION,
        "gguf_sha256": sha256 or file_sha256(path),
        "gguf_path": str(path),
        "reader": contents.reader,
        "name": contents.metadata.get("general.name"),
        "architecture": contents.architecture,
        "context_length": config["max_position_embeddings"],
        "assumed": assumed,
    }
    return _Conversion(config, weights, tokenizer, info)


def _stamp(st: os.stat_result) -> list[int]:
    """What any write to a file changes: its ctime, which no user call can set back."""
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _sha256_of(file: Path, *, fsync: bool = False) -> str:
    digest = hashlib.sha256()
    with file.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
        if fsync:
            os.fsync(f.fileno())
    return digest.hexdigest()


def _write_json(file: Path, data: dict[str, Any]) -> None:
    """Write a JSON file whole (temporary name, fsync, rename; the caller syncs the folder)."""
    with replacing(file, sync_folder=False) as tmp, tmp.open("w") as f:
        f.write(json.dumps(data, indent=2))
        f.flush()
        os.fsync(f.fileno())


def _write_error(folder: Path, e: BaseException) -> BaseException:
    """The error to raise for a failed write into ``folder``: a
    :class:`CacheWriteError` naming the path and the cause, when it is one."""
    if isinstance(e, OSError):
        cause = e.strerror or str(e)
    elif isinstance(e, RuntimeError) and any(w in str(e).lower() for w in ("write", "open", "file")):
        cause = str(e).strip()  # MLX's "[write] Unable to write N bytes to file." names neither
    else:
        return e
    try:
        free = shutil.disk_usage(folder if folder.exists() else folder.parent).free
        cause += f" (the disk is full: {free} bytes free)" if free < (1 << 20) else f" ({free} bytes free there)"
    except OSError:
        pass
    return CacheWriteError(
        f"cannot write {folder}: {cause}; free some space, or set KNORM_CACHE_DIR to a folder on another disk"
    )


def _write(conv: _Conversion, out_dir: Path) -> dict[str, Any]:
    """Write a prepared conversion into ``out_dir``; every file is fsynced and
    its sha256 and stamp recorded in ``knorm.json``, written last."""
    info = dict(conv.info)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        mx.save_safetensors(str(out_dir / "model.safetensors"), conv.weights, metadata={"format": "mlx"})
        (out_dir / "config.json").write_text(json.dumps(conv.config, indent=2, sort_keys=True))
        conv.tokenizer.save_pretrained(str(out_dir))
        files = sorted(p for p in out_dir.iterdir() if p.is_file())
        info["sha256"] = {p.name: _sha256_of(p, fsync=True) for p in files}
        stats = {p.name: p.stat() for p in files}
        info["files"] = {name: st.st_size for name, st in stats.items()}
        info["stamps"] = {name: _stamp(st) for name, st in stats.items()}
        _write_json(out_dir / _INFO_FILE, info)
        fsync_folder(out_dir, quiet=True)
    except (OSError, RuntimeError) as e:
        if (error := _write_error(out_dir, e)) is e:
            raise
        raise error from e
    return info


def convert_gguf(path: str | Path, out_dir: str | Path, *, sha256: str | None = None) -> dict[str, Any]:
    """Write the GGUF as an mlx_lm model folder; returns what ``knorm.json`` holds.

    The GGUF is checked whole before anything is written. ``knorm.json`` is
    written last and lists every file with its size, sha256 and stamp, so a
    folder without a matching one is incomplete. Raises
    :class:`CacheWriteError` (path and cause) where ``out_dir`` cannot be written.
    """
    return _write(_prepare(path, sha256), Path(out_dir))


def cached_conversion(sha256: str) -> tuple[Path, dict[str, Any]] | None:
    """``(folder, info)`` of a complete, verified cached conversion, or None.

    Complete means: ``knorm.json`` names this sha256 and converter version,
    and every file it lists is there with its recorded size. Verified means:
    each file's stamp (inode, size, mtime, ctime) is the one recorded when its
    sha256 was last checked, or else its sha256 is computed again and must
    match. Any write to a file changes its ctime, so the full hash runs only
    after a change (or a copy of the cache); a match records the new stamp.
    """
    folder = converted_dir(sha256)
    try:
        info = json.loads((folder / _INFO_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict):
        return None
    if info.get("gguf_sha256") != sha256 or info.get("converter_version") != CONVERTER_VERSION:
        return None
    files, digests = info.get("files"), info.get("sha256")
    if not isinstance(files, dict) or not files or not isinstance(digests, dict) or set(digests) != set(files):
        return None  # written before digests were recorded: converted again
    stamps = info.get("stamps") if isinstance(info.get("stamps"), dict) else {}
    changed = {}
    for name, size in files.items():
        try:
            st = (folder / name).stat()
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            return None
        if stamps.get(name) != _stamp(st):
            changed[name] = st
    for name in changed:
        try:
            ok = _sha256_of(folder / name) == digests[name]
        except OSError:
            ok = False
        if not ok:
            warnings.warn(
                f"knorm_gen: cached conversion {folder}: {name} does not match the sha256 recorded when it "
                "was written; converting again",
                RuntimeWarning,
                stacklevel=3,
            )
            return None
    if changed:
        info["stamps"] = {**stamps, **{name: _stamp(st) for name, st in changed.items()}}
        try:
            _write_json(folder / _INFO_FILE, info)
        except OSError:
            pass  # a read-only cache: verified in full on every load
    return folder, info


# A conversion's temporary folder: ".<entry>.<pid>.<random>", flock()ed by its
# converter for as long as it runs. Older versions named it ".<entry>.<random>".
_TEMP_NAME = re.compile(r"\.[0-9a-f]{64}-v\d+\.(?:(\d+)\.)?[^.]+")
_OLD_TEMP_AGE_S = 3600.0  # longer than any conversion takes


def remove_dead_conversions(root: Path | None = None) -> None:
    """Remove the temporary folders of conversions that are over (a kill -9,
    a power cut): a live conversion holds an exclusive lock on its folder, which
    the kernel releases when its process ends. Folders of older versions, which
    took no lock, are removed once an hour old."""
    root = root if root is not None else cache_root() / "converted"
    try:
        entries = list(root.iterdir())
    except OSError:
        return
    for p in entries:
        if not (m := _TEMP_NAME.fullmatch(p.name)):
            continue
        if m.group(1) is None:
            try:
                if time.time() - p.stat().st_mtime > _OLD_TEMP_AGE_S:
                    shutil.rmtree(p) if p.is_dir() else p.unlink()
            except OSError:
                pass  # another process removed or is using it
            continue
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its conversion is running
        else:
            shutil.rmtree(p, ignore_errors=True)
        finally:
            os.close(fd)


def _locked_tempdir(root: Path, entry: str) -> tuple[Path, int]:
    """A new temporary folder for ``entry`` and the descriptor holding its lock."""
    for _ in range(10):
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry}.{os.getpid()}.", dir=root))
        fd = os.open(tmp, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.stat(tmp).st_ino == os.fstat(fd).st_ino:
                return tmp, fd  # not removed by a cleaner between mkdtemp and the lock
        except OSError:
            pass
        os.close(fd)
    raise CacheWriteError(f"cannot keep a temporary folder in {root}: something removes them")


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        return os.access(folder, os.W_OK)
    except OSError:
        return False


def _load_check(folder: Path, path: str | Path):
    """``(model, tokenizer)`` from a converted folder, run on one token; a
    conversion that fails here is refused rather than cached."""
    try:
        model, tokenizer = load_converted(folder)
        mx.eval(model(mx.array([[0]])))
    except Exception as e:  # noqa: BLE001 - whatever mlx_lm raises, the GGUF is at fault
        message = str(e).strip().replace("\n", " ")
        raise UnsupportedGGUFError(
            f"{path}: the converted model does not load ({type(e).__name__}: {message[:200]})"
        ) from e
    return model, tokenizer


def _ensure(path: str | Path, sha256: str) -> tuple[Path, dict[str, Any], tuple | None]:
    """``ensure_converted``, plus the ``(model, tokenizer)`` already loaded
    from a fresh conversion (None when the entry came from the cache)."""
    folder = converted_dir(sha256)
    remove_dead_conversions(folder.parent)
    if found := cached_conversion(sha256):
        return *found, None
    if not _writable(folder.parent):
        raise PermissionError(f"cannot write the conversion cache {folder.parent}")
    conv = _prepare(path, sha256)  # a bad GGUF is refused before the cache is touched
    if folder.exists():
        shutil.rmtree(folder, ignore_errors=True)  # incomplete or damaged
    try:
        tmp, lock = _locked_tempdir(folder.parent, folder.name)
    except OSError as e:
        raise _write_error(folder.parent, e) from e
    try:
        info = _write(conv, tmp)
        del conv
        loaded = _load_check(tmp, path)
        try:
            os.rename(tmp, folder)
            fsync_folder(folder.parent, quiet=True)
        except OSError:
            # Another process finished the same conversion first: use theirs.
            if (found := cached_conversion(sha256)) is None:
                raise
            return *found, loaded
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        os.close(lock)
    return folder, info, loaded


def ensure_converted(path: str | Path, sha256: str | None = None) -> tuple[Path, dict[str, Any]]:
    """``(folder, info)`` of the GGUF's cached conversion, converting it first if needed.

    The conversion is written to a locked temporary folder beside the cache
    entry, fsynced, loaded and run once from there, and only then renamed into
    place: a killed conversion never leaves a half entry, and one that does
    not load is never cached. Temporary folders of dead conversions are
    removed; an incomplete or corrupted entry is removed and rebuilt.
    ``sha256`` may be given when already known (it is then trusted).
    """
    folder, info, _ = _ensure(path, sha256 or file_sha256(path))
    return folder, info


def load_converted(folder: str | Path):
    """``(model, tokenizer)`` from a converted folder, by ``mlx_lm.load``."""
    _quiet_transformers()
    import mlx_lm

    return mlx_lm.load(str(folder))


def load_gguf(path: str | Path, *, sha256: str | None = None):
    """``(model, tokenizer, info)`` for a GGUF file, through the conversion cache.

    Where the cache cannot be written (read-only, full disk), the conversion
    goes to a temporary folder that is removed after loading, with a warning
    naming the path and the cause. A cached entry that fails to load is
    converted again once.
    """
    sha256 = sha256 or file_sha256(path)
    try:
        folder, info, loaded = _ensure(path, sha256)
    except (PermissionError, CacheWriteError) as e:
        warnings.warn(f"knorm_gen: {e}; converting {path} without caching it", RuntimeWarning, stacklevel=2)
        with tempfile.TemporaryDirectory(prefix="knorm-convert-") as tmp:
            info = convert_gguf(path, tmp, sha256=sha256)
            model, tokenizer = _load_check(Path(tmp), path)
        return model, tokenizer, info
    if loaded is not None:
        return *loaded, info
    try:
        model, tokenizer = load_converted(folder)
    except Exception as e:  # e.g. an mlx_lm that reads the files differently: rebuild from the GGUF
        warnings.warn(
            f"knorm_gen: cached conversion {folder} failed to load ({type(e).__name__}: {e}); converting again",
            RuntimeWarning,
            stacklevel=2,
        )
        shutil.rmtree(folder, ignore_errors=True)
        folder, info, loaded = _ensure(path, sha256)
        model, tokenizer = loaded or load_converted(folder)
    return model, tokenizer, info
