"""Tests for knorm_gen.models.gguf.

Synthetic GGUFs, written with the gguf package's writer the way llama.cpp's
converter writes them, must give the logits of an mlx_lm model built directly
with the same weights; the conversion cache must be reused, and rebuilt when
damaged. The real Gemma 3 270M tests live in test_gemma.py.
"""

import json
import shutil
import warnings

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from mlx_lm.models import gemma3_text, llama, qwen2
from mlx_lm.models.cache import make_prompt_cache

from knorm_gen.models import gguf as kgguf
from knorm_gen.models import load as models
from knorm_gen.models.load import ModelNotFoundError, load_model

# llama.cpp's tensor names, spelled out here rather than taken from the gguf
# package's table (which the loader asks), so the mapping is checked against
# an independent source.
_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
}
_POST = {  # the norms whose GGUF names differ between architectures
    "llama": {"post_attention_layernorm": "ffn_norm"},
    "qwen2": {"post_attention_layernorm": "ffn_norm"},
    "gemma3": {
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
    },
}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}

HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM = 64, 128, 4, 2, 16


def gguf_name(arch: str, name: str) -> str:
    module, _, kind = name.rpartition(".")
    if module in _TOP:
        return f"{_TOP[module]}.{kind}"
    _, _, layer, rest = module.split(".", 3)
    return f"blk.{layer}.{({**_LAYER, **_POST[arch]})[rest]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row order for interleaved RoPE (convert_hf_to_gguf's permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def byte_level_vocab():
    from tokenizers import pre_tokenizers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["Ġt", "he", "Ġthe"]
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    return dict(model="gpt2", tokens=tokens, types=types, merges=["Ġ t", "h e", "Ġt he"], bos=0, eos=2)


def sentencepiece_vocab():
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    pieces = ["▁", "a", "b", "▁a", "ab", "▁ab"]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [3, 3, 3, 2, 3, 3] + [6] * 256 + [1] * len(pieces)
    return dict(model="llama", tokens=tokens, types=types, scores=[-float(i) for i in range(len(tokens))],
                bos=2, eos=1)


def random_weights(model: nn.Module, arch: str, seed: int) -> dict[str, np.ndarray]:
    """Random float32 weights for every parameter, norms around their identity."""
    from mlx.utils import tree_flatten

    rng = np.random.default_rng(seed)
    out = {}
    for name, p in tree_flatten(model.parameters()):
        if "norm" in name:
            base = 0.0 if arch == "gemma3" else 1.0  # mlx_lm's Gemma norm adds 1 itself
            out[name] = (base + 0.2 * rng.standard_normal(p.shape)).astype(np.float32)
        elif name.endswith(".bias"):
            out[name] = (0.1 * rng.standard_normal(p.shape)).astype(np.float32)
        else:
            out[name] = (rng.standard_normal(p.shape) / np.sqrt(p.shape[-1])).astype(np.float32)
    return out


def write_gguf(path, arch: str, args, weights: dict[str, np.ndarray], qtypes: dict[str, Q], vocab: dict,
               extra_tensors: dict[str, np.ndarray] | None = None) -> None:
    """A GGUF as llama.cpp's converter writes one (names, Q/K permutation, Gemma norms + 1)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(args.num_hidden_layers)
    w.add_context_length(args.max_position_embeddings)
    w.add_embedding_length(args.hidden_size)
    w.add_feed_forward_length(args.intermediate_size)
    w.add_head_count(args.num_attention_heads)
    w.add_head_count_kv(args.num_key_value_heads)
    w.add_layer_norm_rms_eps(args.rms_norm_eps)
    w.add_rope_freq_base(args.rope_theta)
    if arch == "gemma3":
        w.add_key_length(args.head_dim)
        w.add_value_length(args.head_dim)
        w.add_sliding_window(args.sliding_window)
    else:
        w.add_rope_dimension_count(args.hidden_size // args.num_attention_heads)
    w.add_tokenizer_model(vocab["model"])
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["types"])
    if "merges" in vocab:
        w.add_token_merges(vocab["merges"])
    if "scores" in vocab:
        w.add_token_scores(vocab["scores"])
    w.add_bos_token_id(vocab["bos"])
    w.add_eos_token_id(vocab["eos"])
    for name, value in weights.items():
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = args.num_attention_heads if "q_proj" in name else args.num_key_value_heads
            value = llama_cpp_permute(value, heads)
        if arch == "gemma3" and "norm" in name:
            value = value + 1.0
        if name in qtypes:
            w.add_tensor(gguf_name(arch, name), quantize(value, qtypes[name]), raw_dtype=qtypes[name])
        else:
            w.add_tensor(gguf_name(arch, name), value)
    for name, value in (extra_tensors or {}).items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def stored(value: np.ndarray, qtype: Q | None) -> np.ndarray:
    """The values a GGUF holds after quantization, by the gguf package's own round trip."""
    if qtype is None:
        return value
    if qtype == Q.F16:
        return value.astype(np.float16).astype(np.float32)
    return dequantize(quantize(value, qtype), qtype)


def _qtypes(names, arch):
    """A mix of tensor types: MLX-readable ones for llama, gguf-only ones for the others."""
    out = {}
    for name in names:
        if "norm" in name or name.endswith(".bias"):
            continue
        if arch == "llama":
            out[name] = Q.Q8_0 if "embed_tokens" in name else Q.Q4_1
        elif arch == "qwen2":
            out[name] = Q.Q5_0 if "mlp" in name else Q.F16
        else:
            out[name] = Q.Q8_0 if "embed_tokens" in name else (Q.Q5_1 if "self_attn" in name else Q.Q4_0)
    return out


def reference_and_gguf(tmp_path, arch: str, seed: int = 0):
    """(reference mlx_lm model, path of the GGUF holding the same weights)."""
    vocab = sentencepiece_vocab() if arch == "gemma3" else byte_level_vocab()
    n_vocab = len(vocab["tokens"])
    common = dict(hidden_size=HIDDEN, intermediate_size=FFN, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, vocab_size=n_vocab, max_position_embeddings=512)
    if arch == "llama":
        module = llama
        args = llama.ModelArgs(model_type="llama", num_hidden_layers=2, rms_norm_eps=1e-5, head_dim=HEAD_DIM,
                               rope_theta=10000.0, tie_word_embeddings=False, **common)
    elif arch == "qwen2":
        module = qwen2
        args = qwen2.ModelArgs(model_type="qwen2", num_hidden_layers=2, rms_norm_eps=1e-6, rope_theta=1e6,
                               tie_word_embeddings=True, **common)
    else:
        module = gemma3_text
        # six layers with a window of 8: layers 0-4 slide, layer 5 is global (mlx_lm's default pattern)
        args = gemma3_text.ModelArgs(model_type="gemma3_text", num_hidden_layers=6, head_dim=HEAD_DIM,
                                     rms_norm_eps=1e-6, sliding_window=8, rope_theta=1e6, **common)
    model = module.Model(args)
    weights = random_weights(model, arch, seed)
    if arch == "gemma3":
        weights.pop("lm_head.weight")  # Gemma ties its output to the embedding
    qtypes = _qtypes(weights, arch)
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(path, arch, args, weights, qtypes, vocab)
    ref = {k: mx.array(stored(v, qtypes.get(k))) for k, v in weights.items()}
    if arch == "gemma3":
        model.sanitize(ref)  # drops lm_head, as mlx_lm does for a checkpoint without one
    model.load_weights(list(ref.items()), strict=True)
    mx.eval(model.parameters())
    return model, path


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "knorm-cache"
    monkeypatch.setenv("KNORM_CACHE_DIR", str(d))
    return d


TOKENS = mx.array([[5, 17, 200, 3, 44, 250, 9, 9, 130, 77, 61, 2, 180, 99, 140, 33, 21, 8, 240, 111, 6, 150]])


def close(a: mx.array, b: mx.array, rel: float = 1e-4) -> bool:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return mx.max(mx.abs(a - b)).item() <= rel * max(1.0, mx.max(mx.abs(b)).item())


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_synthetic_gguf_matches_mlx_lm_model(tmp_path, cache_dir, arch):
    ref, path = reference_and_gguf(tmp_path, arch)
    model, tok = load_model(str(path), float32=True)
    assert model.knorm_info["architecture"] == arch
    assert model.knorm_info["format"] == "gguf"
    assert close(model(TOKENS), ref(TOKENS))
    # the window matters here: a cached, token-by-token run gives the same last logits
    cache = make_prompt_cache(model)
    for i in range(TOKENS.shape[1]):
        last = model(TOKENS[:, i:i + 1], cache=cache)
    assert close(last[0, -1], ref(TOKENS)[0, -1], rel=1e-3)


def test_wrong_conventions_would_be_caught(tmp_path, cache_dir):
    """The comparison is sensitive to the conventions the loader undoes."""
    ref, path = reference_and_gguf(tmp_path, "gemma3")
    model, _ = load_model(str(path), float32=True)
    model.model.layers[0].input_layernorm.weight += 1.0  # the norm + 1 left in place
    assert not close(model(TOKENS), ref(TOKENS))
    ref, path = reference_and_gguf(tmp_path, "llama")
    model, _ = load_model(str(path), float32=True)
    for layer in model.layers:
        layer.self_attn.rope.traditional = False  # the llama.cpp Q/K permutation ignored
    assert not close(model(TOKENS), ref(TOKENS))


def test_gemma3_assumes_mlx_lm_defaults_and_says_so(tmp_path, cache_dir):
    _, path = reference_and_gguf(tmp_path, "gemma3")
    model, tok = load_model(str(path))
    assumed = model.knorm_info["assumed"]
    defaults = gemma3_text.ModelArgs(model_type="gemma3_text")
    assert assumed == {
        "sliding_window_pattern": defaults.sliding_window_pattern,
        "rope_local_base_freq": defaults.rope_local_base_freq,
        "query_pre_attn_scalar": defaults.query_pre_attn_scalar,
    }
    assert model.args.sliding_window == 8  # stated in the file
    assert model.args.head_dim == HEAD_DIM
    assert tok.encode("ab a", add_special_tokens=True)[0] == 2  # BOS, as llama.cpp adds for this vocabulary
    assert tok.decode(tok.encode("ab a", add_special_tokens=False)) == "ab a"


def test_llama_mx_load_path_keeps_quantized_weights(tmp_path, cache_dir):
    ref, path = reference_and_gguf(tmp_path, "llama")
    model, _ = load_model(str(path), float32=False)
    qlin = [m for m in model.modules() if isinstance(m, nn.QuantizedLinear)]
    qemb = [m for m in model.modules() if isinstance(m, nn.QuantizedEmbedding)]
    assert len(qlin) == 2 * 7 + 1 and {m.bits for m in qlin} == {4}  # every Q4_1 linear, lm_head included
    assert len(qemb) == 1 and qemb[0].bits == 8  # Q8_0 embedding
    out, want = model(TOKENS), ref(TOKENS)
    assert mx.max(mx.abs(out.astype(mx.float32) - want)).item() < 0.02 * mx.max(mx.abs(want)).item()
    info = json.loads((mx_dir := kgguf.converted_dir(kgguf.file_sha256(path))).joinpath("knorm.json").read_text())
    assert info["reader"] == "mlx" and mx_dir.is_dir()


def test_qwen2_and_gemma3_read_by_gguf_package(tmp_path, cache_dir):
    for arch in ("qwen2", "gemma3"):
        _, path = reference_and_gguf(tmp_path, arch)
        folder, info = kgguf.ensure_converted(path)
        assert info["reader"] == "gguf"  # Q5_0 / Q5_1 / Q4_0 + F16: mx.load refuses these files
        config = json.loads((folder / "config.json").read_text())
        assert "quantization" not in config


def test_numpy_reading_equals_the_gguf_packages_reader(tmp_path):
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize

    for arch in ("qwen2", "gemma3"):
        _, path = reference_and_gguf(tmp_path, arch)
        ours = kgguf.read_gguf(path)
        assert ours.reader == "gguf"
        reader = GGUFReader(str(path))
        assert ours.metadata == {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
        assert set(ours.tensors) == {t.name for t in reader.tensors}
        for t in reader.tensors:
            plain = t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
            want = np.array(t.data) if plain else dequantize(t.data, t.tensor_type)
            got = np.array(ours.tensors[t.name])
            assert got.dtype == want.dtype and np.array_equal(got, want), t.name  # the same bytes, decoded once


# ---------------------------------------------------------------- the cache


def test_cache_layout_and_second_load_reads_no_tensors(tmp_path, cache_dir, monkeypatch):
    ref, path = reference_and_gguf(tmp_path, "qwen2")
    model, _ = load_model(str(path))
    folder = kgguf.converted_dir(kgguf.file_sha256(path))
    assert folder.parent == cache_dir / "converted"
    assert folder.name.endswith(f"-v{kgguf.CONVERTER_VERSION}")
    files = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "knorm.json"} <= files
    assert json.loads((folder / "config.json").read_text())["model_type"] == "qwen2"
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no temp folder left

    def no_reading(*a, **k):
        raise AssertionError("the GGUF was read again")

    monkeypatch.setattr(kgguf, "read_gguf", no_reading)
    again, _ = load_model(str(path))
    assert close(again(TOKENS), ref(TOKENS))


def _count_reads(monkeypatch) -> list:
    calls = []
    real = kgguf.read_gguf

    def counting(path):
        calls.append(path)
        return real(path)

    monkeypatch.setattr(kgguf, "read_gguf", counting)
    return calls


@pytest.mark.parametrize("damage", ["truncate", "delete_info", "garble_same_size", "stale_version"])
def test_damaged_cache_is_rebuilt(tmp_path, cache_dir, monkeypatch, damage):
    ref, path = reference_and_gguf(tmp_path, "llama")
    load_model(str(path))
    folder = kgguf.converted_dir(kgguf.file_sha256(path))
    weights = folder / "model.safetensors"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "delete_info":
        (folder / "knorm.json").unlink()
    elif damage == "garble_same_size":
        weights.write_bytes(b"\xff" * weights.stat().st_size)
    else:
        info = json.loads((folder / "knorm.json").read_text())
        info["converter_version"] = kgguf.CONVERTER_VERSION - 1
        (folder / "knorm.json").write_text(json.dumps(info))
    calls = _count_reads(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, _ = load_model(str(path))
    assert len(calls) == 1
    assert close(model(TOKENS), ref(TOKENS))
    assert kgguf.cached_conversion(kgguf.file_sha256(path)) is not None


def test_killed_conversion_leaves_no_entry(tmp_path, cache_dir, monkeypatch):
    _, path = reference_and_gguf(tmp_path, "llama")

    def killed(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(kgguf, "build_tokenizer", killed)
    with pytest.raises(KeyboardInterrupt):
        load_model(str(path))
    converted = cache_dir / "converted"
    assert not converted.exists() or not any(converted.iterdir())
    monkeypatch.undo()
    monkeypatch.setenv("KNORM_CACHE_DIR", str(cache_dir))
    model, _ = load_model(str(path))
    assert model.knorm_info["architecture"] == "llama"


def test_leftovers_of_a_killed_conversion_are_removed_later(tmp_path, cache_dir):
    import os
    import time

    _, path = reference_and_gguf(tmp_path, "llama")
    folder = kgguf.converted_dir(kgguf.file_sha256(path))
    folder.parent.mkdir(parents=True)
    old, fresh = folder.parent / f".{folder.name}.old", folder.parent / f".{folder.name}.fresh"
    for d in (old, fresh):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"half")
    hours_ago = time.time() - 2 * 3600
    os.utime(old, (hours_ago, hours_ago))
    load_model(str(path))
    assert not old.exists()  # a kill -9 left it: removed
    assert fresh.exists()  # could be another process converting right now: kept


def test_unwritable_cache_still_loads(tmp_path, monkeypatch):
    ref, path = reference_and_gguf(tmp_path, "llama")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("KNORM_CACHE_DIR", str(blocker / "cache"))
    with pytest.warns(RuntimeWarning, match="without caching"):
        model, _ = load_model(str(path))
    assert close(model(TOKENS), ref(TOKENS))


def test_cache_root_follows_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("KNORM_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kgguf.cache_root() == tmp_path / "xdg" / "knorm_gen"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert kgguf.cache_root() == tmp_path / "home" / ".cache" / "knorm_gen"
    monkeypatch.setenv("KNORM_CACHE_DIR", str(tmp_path / "mine"))
    assert kgguf.cache_root() == tmp_path / "mine"


# ---------------------------------------------------------------- errors


def test_missing_paths_say_they_do_not_exist(tmp_path):
    for spec in (str(tmp_path / "nope.gguf"), str(tmp_path / "no-such-folder"), "./no/such/model"):
        with pytest.raises(ModelNotFoundError, match="does not exist"):
            load_model(spec)


def test_unsupported_architecture_names_the_supported_ones(tmp_path, cache_dir):
    path = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(path), "phi2")
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="'phi2'.*llama, qwen2, gemma3"):
        load_model(str(path))


def test_unknown_tensor_and_rope_factors_rejected(tmp_path, cache_dir):
    ref, path = reference_and_gguf(tmp_path, "qwen2")
    contents = kgguf.read_gguf(path)
    config, _ = kgguf.model_config(contents)
    contents.tensors["blk.0.mystery.weight"] = mx.zeros((4,))
    with pytest.raises(kgguf.UnsupportedGGUFError, match="mystery"):
        kgguf.map_weights(contents, config)
    del contents.tensors["blk.0.mystery.weight"]
    contents.tensors["rope_freqs.weight"] = mx.ones((8,))
    kgguf.map_weights(contents, config)  # all-ones factors are plain RoPE
    contents.tensors["rope_freqs.weight"] = mx.array([1.0, 2.0])
    with pytest.raises(kgguf.UnsupportedGGUFError, match="rope_freqs"):
        kgguf.map_weights(contents, config)


def test_gemma_short_name_without_package_names_the_extra(monkeypatch):
    import importlib

    real = importlib.import_module

    def no_gemma(name, *a, **k):
        if name == models._GEMMA_PACKAGE:
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(importlib, "import_module", no_gemma)
    with pytest.raises(ModelNotFoundError, match=r"\.\[gemma\]\" in the knorm_gen checkout.*Gemma terms"):
        load_model(models.GEMMA_270M)


def test_copied_gguf_shares_the_cache_entry(tmp_path, cache_dir, monkeypatch):
    _, path = reference_and_gguf(tmp_path, "llama")
    load_model(str(path))
    copy = tmp_path / "elsewhere.gguf"
    shutil.copy(path, copy)
    calls = _count_reads(monkeypatch)
    load_model(str(copy))
    assert calls == []  # keyed by content, not by path


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_the_main_job_runs_on_each_gguf_architecture(tmp_path, cache_dir, arch):
    # Every architecture load_model reads from a GGUF runs the main job end to end: knorm-batch question
    # rows at batch 1 and 3 with eviction, answer_questions and generate_with_eviction; every record ok and
    # within its ceiling.
    from click.testing import CliRunner

    from knorm_gen import answer_questions, generate_with_eviction
    from knorm_gen.cli.batch import batch_command

    _, path = reference_and_gguf(tmp_path, arch)
    doc = "the cat sat on the mat and the dog sat on the log. " * 4
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"id": i, "text": doc[i:]}) + "\n" for i in range(3)))
    for batch in (1, 3):
        out = tmp_path / f"out{batch}.jsonl"
        result = CliRunner().invoke(batch_command, [str(rows), "--model", str(path), "--context-field", "text", "--question",
                                           "Summarize the text above.", "--budget", "24", "--max-tokens", "3",
                                           "--batch-size", str(batch), "-o", str(out), "-q"])
        assert result.exit_code == 0, result.output
        records = [json.loads(line) for line in out.read_text().splitlines()]
        assert [r["error"] for r in records] == [None] * 3
        assert all(r["kept_bytes"] <= r["kv_ceiling_bytes"] and r["tokens_kept"] < r["tokens_seen"] for r in records)
    model, tok = load_model(str(path), float32=True)
    for r in answer_questions(model, tok, doc, ["Who sat?", "Where?"], budget=24, max_tokens=3):
        assert r.kept_bytes <= r.kv_ceiling_bytes and r.tokens_kept < r.tokens_seen
    r = generate_with_eviction(model, tok, doc + "\n\nWho sat?", budget=24, max_tokens=3)
    assert r.kept_bytes <= r.kv_ceiling_bytes and r.tokens_kept < r.tokens_seen
