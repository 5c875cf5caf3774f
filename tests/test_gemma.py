"""Gemma 3 270M base (the optional ``gemma`` extra, installed for tests by
scripts/setup.sh), loaded from its Q4_K_M GGUF: perplexity, greedy text, the
tokenizer against ids from an independent route, the conversion cache, and
which layers the eviction cache compresses.

The model is converted once per module into a temporary cache, then loaded a
second time from that cache.
"""

import math
import warnings

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from knorm_gen import EvictionConfig, EvictionKVCache, generate_with_eviction, make_eviction_cache
from knorm_gen.models import gguf as kgguf
from knorm_gen.tuning.corpus import text_of_tokens
from knorm_gen.models.load import GEMMA_270M, load_model

BOS = 2
GLOBAL_LAYERS = [5, 11, 17]  # every sixth layer attends globally; the other 15 slide over 512 tokens




@pytest.fixture(scope="module")
def gemma(cache_root):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model(GEMMA_270M, float32=True)


# ---------------------------------------------------------------- the model


def test_config_from_gguf_and_mlx_lm_defaults(gemma):
    model, _ = gemma
    info = model.knorm_info
    assert (info["architecture"], info["format"], info["source"]) == ("gemma3", "gguf", GEMMA_270M)
    assert info["context_length"] == 32768 and info["dtype"] == "float32"
    # not in this GGUF: taken from mlx_lm's gemma3_text defaults, and reported
    assert info["assumed"] == {"sliding_window_pattern": 6, "rope_local_base_freq": 10000.0,
                               "query_pre_attn_scalar": 256}
    args = model.args
    assert (args.num_hidden_layers, args.hidden_size, args.num_attention_heads, args.num_key_value_heads,
            args.head_dim, args.sliding_window, args.vocab_size) == (18, 640, 4, 1, 256, 512, 262144)
    assert model.tie_word_embeddings  # no output.weight in the file


def test_perplexity_on_prose_and_rotating_prefill(gemma):
    """Perplexity on pydoc prose past the 512-token window (a wrong norm convention gives
    over 10^8), and the same 768 tokens prefilled in 256-token blocks through the
    model's own rotating caches agree with the cacheless pass: hidden states
    everywhere, per-token loss past the window. (Only the last 256 positions are
    projected onto the 262k-token vocabulary: the rest would be most of the test's time.)"""
    model, tok = gemma
    ids = mx.array([[BOS] + text_of_tokens(tok, 768)])
    inputs, targets = ids[:, :-1], ids[:, 1:]
    hidden = model.model(inputs)
    logits = model.model.embed_tokens.as_linear(hidden[:, -256:])
    full = nn.losses.cross_entropy(logits, targets[:, -256:], reduction="none")[0]
    ppl = math.exp(full.mean().item())
    assert ppl < 20, ppl

    cache = make_prompt_cache(model)
    blocked = mx.concatenate([model.model(inputs[:, i:i + 256], cache=cache)
                              for i in range(0, inputs.shape[1], 256)], axis=1)
    assert mx.max(mx.abs(blocked - hidden)).item() < 1e-3 * mx.max(mx.abs(hidden)).item()
    tail = model.model.embed_tokens.as_linear(blocked[:, -256:])
    tail_loss = nn.losses.cross_entropy(tail, targets[:, -256:], reduction="none")[0]
    assert mx.max(mx.abs(tail_loss - full)).item() < 1e-3


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ("The capital of France is Paris. The capital of Germany is", "Berlin"),
        ("The Eiffel Tower is located in the city of", "Paris"),
        ("Paris is the capital of", "France"),
    ],
)
def test_greedy_completion(gemma, prompt, expected):
    model, tok = gemma
    out = mlx_lm.generate(model, tok, tok.encode(prompt), max_tokens=8)
    assert expected in out, out


# ---------------------------------------------------------------- tokenizer

# Ids from an independent route: a SentencePiece BPE model built with the
# sentencepiece library from the GGUF's tokens, scores and token types (space
# runs spelled with U+2581, control tokens split off first). It matched this
# tokenizer on 290k characters of pydoc prose, the Zen of Python and emoji; each
# id below was also looked up by hand in the GGUF vocabulary.
KNOWN_IDS = {
    "Hello world!": [9259, 1902, 236888],  # "Hello" "▁world" "!"
    "The capital of France is": [818, 5279, 529, 7001, 563],
    "The year 2024 had 366 days.": [818, 1051, 236743, 236778, 236771, 236778, 236812, 1053, 236743, 236800,
                                    236825, 236825, 2668, 236761],  # digits one per token
    "  two spaces": [138, 13498, 9952],  # "  " is a token of its own
    "héllo 🙂": [236754, 7869, 844, 57235],
    "<start_of_turn>user\nhi<end_of_turn>": [105, 2364, 107, 2202, 106],
}


@pytest.mark.parametrize("text", list(KNOWN_IDS))
def test_known_ids(gemma, text):
    _, tok = gemma
    assert tok.encode(text, add_special_tokens=False) == KNOWN_IDS[text]
    assert tok.encode(text) == [BOS] + KNOWN_IDS[text]  # llama.cpp adds BOS for this file


ROUND_TRIP = [
    "Hello world!",
    "héllo wörld — 日本語 🙂 ñ 👩‍👩‍👧",
    "  leading spaces,\ttabs\n\nand newlines  ",
    "def f(x):\n    return x ** 2\n",
    "\x00\x7f control bytes",
]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip(gemma, text):
    _, tok = gemma
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    detok = tok.detokenizer
    detok.reset()
    for i in ids:
        detok.add_token(i)
    detok.finalize()
    assert detok.text == text


def test_stop_tokens(gemma):
    _, tok = gemma
    assert set(tok.eos_token_ids) == {1, 106}  # <eos>, <end_of_turn>; not the ordinary "</s>" (212)
    assert tok.convert_ids_to_tokens(212) == "</s>"


# ---------------------------------------------------------------- the cache


def test_second_load_comes_from_the_cache(gemma, cache_root, monkeypatch):
    model, tok = gemma
    sha = kgguf.file_sha256(cache_root / "gguf" / "gemma-3-270m-q4_k_m.gguf")
    folder, info = kgguf.cached_conversion(sha)
    assert folder.parent == cache_root / "converted" and info["architecture"] == "gemma3"

    def no_reading(*a, **k):
        raise AssertionError("the GGUF was read again")

    monkeypatch.setenv("KNORM_CACHE_DIR", str(cache_root))
    monkeypatch.setattr(kgguf, "read_gguf", no_reading)
    again, tok2 = load_model(GEMMA_270M, float32=True)
    ids = mx.array([[BOS] + KNOWN_IDS["The capital of France is"]])
    assert mx.allclose(again(ids), model(ids), atol=1e-4).item()
    assert tok2.encode("Hello world!") == tok.encode("Hello world!")


# ------------------------------------------------------- eviction on Gemma


def test_eviction_compresses_only_global_layers(gemma):
    model, _ = gemma
    own = make_prompt_cache(model)
    # the default compresses every global layer (KeyDiff); skip_layers=None (--preset retrieval) skips the
    # first 30% (at least two) of the full-attention layers: 5 and 11, as knorm-probe advises for keep-low
    default = make_eviction_cache(model, EvictionConfig(budget=256))
    assert [i for i, c in enumerate(default) if isinstance(c, EvictionKVCache)] == GLOBAL_LAYERS
    retrieval = make_eviction_cache(model, EvictionConfig(budget=256, skip_layers=None))
    assert [i for i, c in enumerate(retrieval) if isinstance(c, EvictionKVCache)] == GLOBAL_LAYERS[2:]
    assert EvictionConfig(budget=256, skip_layers=None).for_model(model).skip_layers == tuple(GLOBAL_LAYERS[:2])
    bounded = EvictionConfig(budget=256, early_factor=8).for_model(model)
    assert bounded.skip_layers == () and bounded.layer_budgets == {i: 2048 for i in GLOBAL_LAYERS[:2]}
    for config in (EvictionConfig(budget=256, skip_layers=()),):
        caches = make_eviction_cache(model, config)
        assert [i for i, c in enumerate(caches) if isinstance(c, EvictionKVCache)] == GLOBAL_LAYERS
        for i, (c, mine) in enumerate(zip(caches, own)):
            if i not in GLOBAL_LAYERS:
                assert type(c) is RotatingKVCache and c.max_size == 512 and type(mine) is RotatingKVCache
            else:
                assert type(mine) is KVCache
    skipped = make_eviction_cache(model, EvictionConfig(budget=256, skip_layers=(5,)))
    assert [i for i, c in enumerate(skipped) if isinstance(c, EvictionKVCache)] == [11, 17]


def test_budget_at_least_the_prompt_equals_the_full_cache(gemma):
    model, tok = gemma
    prompt = [BOS] + text_of_tokens(tok, 200)
    full = generate_with_eviction(model, tok, prompt, budget=None, chat=False, max_tokens=6)
    big = generate_with_eviction(model, tok, prompt, budget=len(prompt) + 16, chat=False, max_tokens=6)
    # a plain greedy loop on mlx_lm's own caches is the reference; its top-2
    # margins guard against a near-tie that two code paths could break differently
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[0, -1]
    greedy, margins = [], []
    for _ in range(6):
        top2 = mx.sort(logits)[-2:]
        margins.append((top2[1] - top2[0]).item())
        greedy.append(mx.argmax(logits).item())
        logits = model(mx.array([[greedy[-1]]]), cache=cache)[0, -1]
    assert min(margins) > 1e-2, margins
    assert full.text == tok.decode(greedy)
    assert big.text == full.text
    assert big.tokens_seen == full.tokens_seen


def test_text_prompt_gets_bos(gemma):
    """Gemma needs its BOS: without it this prompt continues with " Paris"."""
    model, tok = gemma
    prompt = "The capital of France is Paris. The capital of Germany is"
    out = generate_with_eviction(model, tok, prompt, budget=None, chat=False, max_tokens=4)
    assert out.prompt_tokens == len(tok.encode(prompt, add_special_tokens=False)) + 1
    assert "Berlin" in out.text, out.text


def test_the_default_keeps_what_it_kept_as_a_rule_name_on_gemma3(gemma):
    from .test_default_layout import assert_same_as_saved, kept_by_the_default

    assert_same_as_saved(kept_by_the_default(*gemma), "gemma3")
