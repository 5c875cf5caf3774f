"""Savings on sliding-window models are counted against the model's own cache.

mlx_lm's own cache (``make_prompt_cache``) gives a sliding-window layer a ``RotatingKVCache``
that never holds more than its window. A record's ``full_bytes`` is what that cache holds
after the same tokens (checked here against mlx_lm run on the same ids, within 2%),
``saved_bytes`` the difference from ``kept_bytes``, and ``compression_ratio`` the document's
compression against it: a sliding-window layer counts the same on both sides.
"""

import json

import mlx.core as mx
import pytest
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

from knorm_gen import answer_questions, generate_with_eviction, kv_memory
from knorm_gen.eviction.config import EvictionConfig, GenerationConfig
from knorm_gen.batch.job import BatchOptions, run_batch

from . import zoo

SLIDING = ["gemma3_text", "cohere2", "gpt_oss"]
TEXT = ("Ada keeps her bicycle in the blue shed. Ben keeps his kayak in the red barn. The pass key is 48213. "
        "Cleo waters the garden on Sundays. Dan reads the paper at noon. ") * 2


@pytest.fixture(scope="module")
def tok():
    return zoo.tiny_tokenizer()


def own_cache_bytes(model, ids):
    """What mlx_lm's own cache holds after ``ids`` (the prompt in one block, then each
    generated token one at a time, as a generation feeds them): each layer's keys and values
    at the positions it holds (``size()``; mlx_lm preallocates its buffer in steps of 256)."""
    caches = make_prompt_cache(model)
    model(mx.array(ids[0])[None], cache=caches)
    for token in ids[1]:
        model(mx.array([[token]]), cache=caches)
    mx.eval([c.state for c in caches])
    total = 0
    for c in caches:
        n = c.size()
        total += c.keys[..., :n, :].nbytes + c.values[..., :n, :].nbytes
        assert c.offset == len(ids[0]) + len(ids[1])
    assert any(isinstance(c, RotatingKVCache) for c in caches)
    return total


@pytest.mark.parametrize("arch", SLIDING)
def test_full_bytes_is_the_model_s_own_cache(arch, tok):
    model = zoo.tiny_model(arch)
    ids = tok.encode(TEXT, add_special_tokens=False)
    r = generate_with_eviction(model, tok, ids, ratio=4, max_tokens=3)
    assert r.tokens_seen == len(ids) + len(r.tokens)
    want = own_cache_bytes(model, (ids, r.tokens))
    assert r.full_bytes == pytest.approx(want, rel=0.02)
    assert r.saved_bytes == r.full_bytes - r.kept_bytes > 0
    assert r.kept_bytes <= r.kv_ceiling_bytes
    # the document's compression counts the windows on both sides: at most the ratio
    assert 1.0 < r.compression_ratio <= 4.0 + 1e-6
    assert r.to_dict()["saved_bytes"] == r.saved_bytes


def test_gemma3_record_states_the_model_s_own_cache(tok, tmp_path):
    """The batch runner's record: ``full_bytes`` the model's own cache, ``saved_bytes`` what
    eviction saves of it, ``kv_ceiling_bytes >= kept_bytes``; a question row likewise."""
    model = zoo.tiny_model("gemma3_text")
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": "p", "prompt": TEXT}) + "\n"
                    + json.dumps({"id": "q", "context": TEXT, "questions": ["What is the pass key?"]}) + "\n")
    out = tmp_path / "out.jsonl"
    options = BatchOptions(eviction=EvictionConfig(ratio=4), generation=GenerationConfig(max_tokens=3))
    summary = run_batch(str(rows), str(out), options, model=model, tokenizer=tok, progress=False, log=lambda m: None)
    assert summary.exit_code == 0
    for record in map(json.loads, out.read_text().splitlines()):
        assert record["error"] is None
        seen = record["tokens_seen"]
        # two global layers at every position, two sliding layers at their window of 8
        row = record["full_bytes"] // (2 * seen + 2 * zoo.SLIDING_WINDOW)
        assert record["full_bytes"] == row * (2 * seen + 2 * zoo.SLIDING_WINDOW)
        assert record["saved_bytes"] == record["full_bytes"] - record["kept_bytes"] > 0
        assert record["kept_bytes"] <= record["kv_ceiling_bytes"]
        assert record["compression_ratio"] <= 4.0 + 1e-6


def test_a_llama_keeps_its_ratio(tok):
    """No sliding window: the model's own cache holds every position, and the document's
    compression is the ratio."""
    model = zoo.tiny_model("llama")
    ids = tok.encode(TEXT, add_special_tokens=False)
    r = generate_with_eviction(model, tok, ids, ratio=4, max_tokens=3)
    caches = make_prompt_cache(model)
    model(mx.array(ids + r.tokens)[None], cache=caches)
    row = sum(c.keys.nbytes + c.values.nbytes for c in caches) // caches[0].keys.shape[2]
    assert r.full_bytes == row * r.tokens_seen
    assert r.compression_ratio == pytest.approx(4.0, rel=0.03)
    (a,) = answer_questions(model, tok, TEXT, ["What is the pass key?"], ratio=4, max_tokens=3)
    assert a.compression_ratio == pytest.approx(4.0, rel=0.03)


def test_the_startup_line_states_the_model_s_own_cache_and_the_cap(tok):
    model = zoo.tiny_model("gemma3_text")
    memory = kv_memory(model, EvictionConfig(ratio=4, budget=64))
    assert memory.own_bytes_at(100) == memory.own[0][0] * (2 * 100 + 2 * zoo.SLIDING_WINDOW)
    line = memory.describe()
    assert "at most 64 tokens (--budget caps it)" in line
    assert "2 of its 4 layers are sliding windows" in line
