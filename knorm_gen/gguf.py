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
import hashlib
import importlib
import json
import os
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

__all__ = [
    "CONVERTER_VERSION",
    "SUPPORTED_ARCHITECTURES",
    "UnsupportedGGUFError",
    "GGUFContents",
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
    "remove_stale",
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


@dataclass
class GGUFContents:
    """A GGUF's metadata (plain Python values) and tensors (GGUF names).

    ``reader`` is "mlx" (quantized types kept as ``.weight/.scales/.biases``
    triples) or "gguf" (every quantized type dequantized to float32).
    """

    metadata: dict[str, Any]
    tensors: dict[str, mx.array]
    reader: str

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")


# ------------------------------------------------------------------- reading


def _plain(value: Any) -> Any:
    if isinstance(value, mx.array):
        return value.item() if value.ndim == 0 else value.tolist()
    return value


def read_gguf(path: str | Path) -> GGUFContents:
    """Read every tensor and metadata value of a GGUF file."""
    try:
        tensors, metadata = mx.load(str(path), return_metadata=True)
        return GGUFContents({k: _plain(v) for k, v in metadata.items()}, tensors, "mlx")
    except (RuntimeError, ValueError):
        pass  # a tensor type MLX cannot represent: let the gguf package dequantize it

    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError) as e:
        raise UnsupportedGGUFError(f"{path} is not a readable GGUF file: {e}") from e
    metadata = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = {}
    for t in reader.tensors:
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            data = np.array(t.data)  # copy out of the memory map, in the stored precision
        else:
            try:
                data = dequantize(t.data, t.tensor_type)
            except NotImplementedError as e:
                raise UnsupportedGGUFError(f"{path}: tensor {t.name}: {e}") from e
        tensors[t.name] = mx.array(data)
    return GGUFContents(metadata, tensors, "gguf")


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


class _Meta:
    """Metadata lookups by the gguf package's key templates ("{arch}.block_count")."""

    def __init__(self, metadata: dict[str, Any], arch: str):
        self.md, self.arch = metadata, arch

    def get(self, template: str, default: Any = _MISSING) -> Any:
        key = template.format(arch=self.arch)
        if key in self.md:
            return self.md[key]
        if default is _MISSING:
            raise UnsupportedGGUFError(f"GGUF metadata lacks {key!r}")
        return default


def _window_pattern(value: Any) -> int:
    """mlx_lm's sliding_window_pattern from an int, or from llama.cpp's per-layer
    list of booleans (True = sliding)."""
    if isinstance(value, int):
        return value
    flags = [bool(v) for v in value]
    period = flags.index(False) + 1 if False in flags else len(flags) + 1
    if flags != [(i + 1) % period != 0 for i in range(len(flags))]:
        raise UnsupportedGGUFError(f"sliding-window layer pattern {flags} is not periodic")
    return period


def _rope_scaling(meta: _Meta) -> dict | None:
    import gguf

    kind = meta.get(gguf.Keys.Rope.SCALING_TYPE, None)
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"type": "linear", "factor": float(meta.get(gguf.Keys.Rope.SCALING_FACTOR))}
    raise UnsupportedGGUFError(f"RoPE scaling {kind!r} is not supported (only 'linear')")


def model_config(contents: GGUFContents) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(config, assumed)``: the mlx_lm ``config.json`` for this GGUF, and the
    values the file does not state that were taken from mlx_lm's defaults."""
    import gguf

    K = gguf.Keys
    arch = contents.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedGGUFError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    meta = _Meta(contents.metadata, arch)
    names = contents.tensors
    if "token_embd.weight" not in names:
        raise UnsupportedGGUFError("GGUF has no token_embd.weight tensor")
    hidden = int(meta.get(K.LLM.EMBEDDING_LENGTH))
    heads = int(meta.get(K.Attention.HEAD_COUNT))
    head_dim = int(meta.get(K.Attention.KEY_LENGTH, 0) or meta.get(K.Rope.DIMENSION_COUNT, 0) or hidden // heads)
    rotary = int(meta.get(K.Rope.DIMENSION_COUNT, head_dim))
    if rotary != head_dim:
        raise UnsupportedGGUFError(f"partial rotary embeddings ({rotary} of {head_dim} dims) are not supported")
    tied = "output.weight" not in names
    config: dict[str, Any] = {
        "model_type": _MODEL_TYPES[arch],
        "hidden_size": hidden,
        "num_hidden_layers": int(meta.get(K.LLM.BLOCK_COUNT)),
        "intermediate_size": int(meta.get(K.LLM.FEED_FORWARD_LENGTH)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(K.Attention.HEAD_COUNT_KV, heads)),
        "rms_norm_eps": float(meta.get(K.Attention.LAYERNORM_RMS_EPS)),
        # the embedding's rows, not the tokenizer's length: they may differ (padding rows)
        "vocab_size": int(names["token_embd.weight"].shape[0]),
        "max_position_embeddings": int(meta.get(K.LLM.CONTEXT_LENGTH)),
        "tie_word_embeddings": tied,
    }
    theta = meta.get(K.Rope.FREQ_BASE, None)
    if theta is not None:
        config["rope_theta"] = float(theta)
    if scaling := _rope_scaling(meta):
        config["rope_scaling"] = scaling
    assumed: dict[str, Any] = {}

    if arch == "llama":
        config.update(
            head_dim=head_dim,
            # llama.cpp permutes Q/K rows for interleaved (GPT-J style) RoPE;
            # rotating adjacent pairs on those rows is the same attention.
            rope_traditional=True,
            attention_bias="blk.0.attn_q.bias" in names,
            mlp_bias="blk.0.ffn_up.bias" in names,
        )
    elif arch == "qwen2":
        if head_dim != hidden // heads:
            raise UnsupportedGGUFError(f"qwen2 with head_dim {head_dim} != hidden/heads is not supported")
    elif arch == "gemma3":
        from mlx_lm.models import gemma3_text

        defaults = {f.name: f.default for f in dataclasses.fields(gemma3_text.ModelArgs)}
        config["head_dim"] = head_dim
        # Gemma 3 GGUFs from llama.cpp's converter do not state these; llama.cpp hard-codes them.
        for name, key, convert in (
            ("sliding_window", K.Attention.SLIDING_WINDOW, int),
            ("sliding_window_pattern", K.Attention.SLIDING_WINDOW_PATTERN, _window_pattern),
            ("rope_local_base_freq", K.Rope.FREQ_BASE_SWA, float),
            ("query_pre_attn_scalar", K.Attention.SCALE, lambda s: float(s) ** -2),
        ):
            value = meta.get(key, None)
            if value is None:
                config[name] = assumed[name] = defaults[name]
            else:
                config[name] = convert(value)
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


def cache_root() -> Path:
    """Where converted models live: ``$KNORM_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/knorm_gen``, else ``~/.cache/knorm_gen``."""
    if env := os.environ.get("KNORM_CACHE_DIR"):
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "knorm_gen"


def converted_dir(sha256: str) -> Path:
    """The cache folder of the GGUF with this sha256 (it may not exist yet)."""
    return cache_root() / "converted" / f"{sha256}-v{CONVERTER_VERSION}"


def convert_gguf(path: str | Path, out_dir: str | Path, *, sha256: str | None = None) -> dict[str, Any]:
    """Write the GGUF as an mlx_lm model folder; returns what ``knorm.json`` holds.

    ``knorm.json`` is written last and lists every file with its size, so a
    folder without a matching one is incomplete.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    contents = read_gguf(path)
    config, assumed = model_config(contents)
    weights = map_weights(contents, config)
    tokenizer = build_tokenizer(contents.metadata)
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
    del contents

    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    del weights
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    tokenizer.save_pretrained(str(out_dir))
    info["files"] = {p.name: p.stat().st_size for p in sorted(out_dir.iterdir()) if p.is_file()}
    (out_dir / _INFO_FILE).write_text(json.dumps(info, indent=2))
    return info


def cached_conversion(sha256: str) -> tuple[Path, dict[str, Any]] | None:
    """``(folder, info)`` of a complete cached conversion, or None.

    Complete means: ``knorm.json`` names this sha256 and converter version,
    and every file it lists is there with its recorded size.
    """
    folder = converted_dir(sha256)
    try:
        info = json.loads((folder / _INFO_FILE).read_text())
    except (OSError, ValueError):
        return None
    if info.get("gguf_sha256") != sha256 or info.get("converter_version") != CONVERTER_VERSION:
        return None
    for name, size in (info.get("files") or {}).items():
        file = folder / name
        if not file.is_file() or file.stat().st_size != size:
            return None
    return folder, info


def remove_stale(folder: Path, pattern: str, max_age_s: float = 3600.0) -> None:
    """Remove what a killed process left under ``folder`` (temporary names
    matching ``pattern``), once it is older than any conversion takes."""
    now = time.time()
    for p in folder.glob(pattern):
        try:
            if now - p.stat().st_mtime > max_age_s:
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        except OSError:
            pass  # another process removed or is using it


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        return os.access(folder, os.W_OK)
    except OSError:
        return False


def ensure_converted(path: str | Path, sha256: str | None = None) -> tuple[Path, dict[str, Any]]:
    """``(folder, info)`` of the GGUF's cached conversion, converting it first if needed.

    The conversion is written to a temporary folder beside the cache entry and
    renamed into place, so a killed conversion never leaves a half entry; an
    incomplete or corrupted entry is removed and rebuilt. ``sha256`` may be
    given when already known (it is then trusted).
    """
    sha256 = sha256 or file_sha256(path)
    if found := cached_conversion(sha256):
        return found
    folder = converted_dir(sha256)
    if not _writable(folder.parent):
        raise PermissionError(f"cannot write the conversion cache {folder.parent}")
    if folder.exists():
        shutil.rmtree(folder, ignore_errors=True)
    remove_stale(folder.parent, f".{folder.name}.*")
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        info = convert_gguf(path, tmp, sha256=sha256)
        try:
            os.rename(tmp, folder)
        except OSError:
            # Another process finished the same conversion first: use theirs.
            if (found := cached_conversion(sha256)) is None:
                raise
            return found
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder, info


def load_converted(folder: str | Path):
    """``(model, tokenizer)`` from a converted folder, by ``mlx_lm.load``."""
    _quiet_transformers()
    import mlx_lm

    return mlx_lm.load(str(folder))


def load_gguf(path: str | Path, *, sha256: str | None = None):
    """``(model, tokenizer, info)`` for a GGUF file, through the conversion cache.

    Where the cache cannot be written, the conversion goes to a temporary
    folder that is removed after loading. A cached entry that fails to load
    is converted again once.
    """
    sha256 = sha256 or file_sha256(path)
    try:
        folder, info = ensure_converted(path, sha256)
    except PermissionError as e:
        warnings.warn(f"knorm_gen: {e}; converting {path} without caching it", RuntimeWarning, stacklevel=2)
        with tempfile.TemporaryDirectory() as tmp:
            info = convert_gguf(path, tmp, sha256=sha256)
            model, tokenizer = load_converted(tmp)
        return model, tokenizer, info
    try:
        model, tokenizer = load_converted(folder)
    except Exception as e:  # a damaged file that kept its size: rebuild from the GGUF
        warnings.warn(
            f"knorm_gen: cached conversion {folder} failed to load ({type(e).__name__}: {e}); converting again",
            RuntimeWarning,
            stacklevel=2,
        )
        shutil.rmtree(folder, ignore_errors=True)
        folder, info = ensure_converted(path, sha256)
        model, tokenizer = load_converted(folder)
    return model, tokenizer, info
