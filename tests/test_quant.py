"""kv_bits: the eviction caches storing quantized keys and values.

References: the same cache in full precision (the kept set), a numpy affine
quantization bound (what is stored), mlx_lm's own QuantizedKVCache (attention
through a model), single-row caches (the batch), a file on disk (save/load) and
byte counts from the shapes (memory)."""

import json

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache, load_prompt_cache, save_prompt_cache

from knorm_gen import EvictionConfig, cache_stats, kv_memory, make_eviction_cache
from knorm_gen.eviction.cache import copy_caches
from knorm_gen.eviction.cache import BatchEvictionKVCache, EvictionKVCache  # noqa: E402
from knorm_gen.eviction.quant import dequantize

from .conftest import random_tokens, tiny_llama

HEADS, DIM = 2, 64


def numpy_quant_step(x, bits, group):
    """Per (token, group) step of an affine quantization: (max - min) / (2**bits - 1)."""
    g = x.astype(np.float64).reshape(*x.shape[:-1], x.shape[-1] // group, group)
    return np.repeat((g.max(-1) - g.min(-1)) / (2**bits - 1), group, axis=-1)


def feed_blocks(cache, keys, values, splits):
    start, out = 0, None
    for size in splits:
        out = cache.update_and_fetch(mx.array(keys[:, :, start : start + size]),
                                     mx.array(values[:, :, start : start + size]))
        start += size
    return out


def positions(cache):
    _, _, pos = cache.ordered_state()
    return np.array(pos)


@pytest.mark.parametrize("keep", ["low", "high", "recent"])
@pytest.mark.parametrize("bits", [4, 8])
def test_kept_set_equals_full_precision_and_stored_values_are_within_one_step(keep, bits):
    rng = np.random.default_rng(3)
    t, splits = 90, [40, 1, 1, 30, 1, 16, 1]
    keys = (rng.normal(size=(1, HEADS, t, DIM)) * rng.uniform(0.5, 2, size=(1, HEADS, t, 1))).astype(np.float32)
    values = rng.normal(size=(1, HEADS, t, DIM)).astype(np.float32)
    full = EvictionKVCache(24, 2, 3, keep)
    quant = EvictionKVCache(24, 2, 3, keep, kv_bits=bits, kv_group_size=32)
    feed_blocks(full, keys, values, splits)
    k, v = feed_blocks(quant, keys, values, splits)
    # a decode step attends to the stored triples through mlx_lm's quantized SDPA
    assert isinstance(k, tuple) and len(k) == 3 and quant.bits == bits and quant.group_size == 32
    np.testing.assert_array_equal(positions(quant), positions(full))
    # what attention read at the last step: every held slot plus the new token, each within one step of its source
    qk, qv, pos = quant.ordered_state()
    pos = np.array(pos)
    for stored, source in ((qk, keys), (qv, values)):
        got = np.array(dequantize(stored, bits, 32))
        want = np.take_along_axis(source, pos[..., None], axis=2)
        step = numpy_quant_step(want, bits, 32)
        # MLX moves the grid so one end of each group is exact: the error stays under one step
        assert np.all(np.abs(got - want) <= step + 1e-5), "a stored value is off by more than one step"
        assert np.any(np.abs(got - want) > 0), "nothing was quantized"


def test_anchored_rules_rescore_the_dequantized_keys():
    rng = np.random.default_rng(4)
    keys = rng.normal(size=(1, HEADS, 70, DIM)).astype(np.float32)
    full = EvictionKVCache(20, 2, 2, "keydiff")
    quant = EvictionKVCache(20, 2, 2, "keydiff", kv_bits=8, kv_group_size=64)
    feed_blocks(full, keys, keys, [30, 20, 20])
    feed_blocks(quant, keys, keys, [30, 20, 20])
    # the anchor is the sum of the full-precision unit keys of every token seen
    np.testing.assert_allclose(np.array(quant.state_of_rule), np.array(full.state_of_rule), rtol=1e-5, atol=1e-5)
    same = np.mean([len(set(a) & set(b)) / len(a) for a, b in zip(positions(quant)[0], positions(full)[0])])
    assert same >= 0.85, f"8-bit re-scoring kept only {same:.0%} of the full-precision kept set"


def test_attention_through_a_model_matches_mlx_lms_quantized_cache():
    model = tiny_llama(layers=3, head_dim=64)
    tokens = random_tokens(80, seed=5, repeat=False)
    for bits in (4, 8):
        ours = make_eviction_cache(model, EvictionConfig(budget=None, kv_bits=bits, kv_group_size=64))
        assert all(isinstance(c, EvictionKVCache) and not c.bounded for c in ours)
        theirs = [QuantizedKVCache(group_size=64, bits=bits) for _ in model.layers]
        for start, size in ((0, 50), (50, 1), (51, 29)):
            a = model(tokens[None, start : start + size], cache=ours)
            b = model(tokens[None, start : start + size], cache=theirs)
            np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-4)
        plain = [KVCache() for _ in model.layers]
        c = model(tokens[None], cache=plain)
        assert not np.allclose(np.array(a)[0, -1], np.array(c)[0, -1], atol=1e-6), "no quantization happened"


def test_full_precision_caches_have_no_bits_attribute():
    # mlx_lm takes the quantized attention path for any cache with ``bits``
    assert not hasattr(EvictionKVCache(8, 2, 0, "low"), "bits")
    assert not hasattr(BatchEvictionKVCache(8, 2, 0, "low", batch_size=2), "bits")
    assert BatchEvictionKVCache(8, 2, 0, "low", batch_size=2, kv_bits=4).bits == 4


@pytest.mark.parametrize("keep", ["low", "blend"])
def test_batch_rows_keep_and_store_what_they_do_alone(keep):
    rng = np.random.default_rng(7)
    lengths, bits = [12, 40, 75], 4
    keys = [rng.normal(size=(1, HEADS, t, DIM)).astype(np.float32) for t in lengths]
    singles = [EvictionKVCache(16, 2, 2, keep, kv_bits=bits, kv_group_size=32) for _ in lengths]
    batch = EvictionKVCache.merge([EvictionKVCache(16, 2, 2, keep, kv_bits=bits, kv_group_size=32)
                                   for _ in lengths])
    assert isinstance(batch, BatchEvictionKVCache) and batch.bits == bits
    fed = [0] * 3

    def step(sizes):
        n = max(sizes)
        blk = np.zeros((3, HEADS, n, DIM), np.float32)
        for b, s in enumerate(sizes):
            blk[b, :, :s] = keys[b][0, :, fed[b] : fed[b] + s]
        if n > 1:
            batch.prepare(lengths=list(sizes), right_padding=[n - s for s in sizes])
        batch.update_and_fetch(mx.array(blk), mx.array(blk))
        batch.finalize()
        for b, s in enumerate(sizes):
            if s:
                singles[b].update_and_fetch(mx.array(keys[b][:, :, fed[b] : fed[b] + s]),
                                            mx.array(keys[b][:, :, fed[b] : fed[b] + s]))
                fed[b] += s

    for sizes in ([5, 20, 30], [3, 15, 40], [1, 1, 1], [1, 1, 1]):
        step(sizes)
    batch.filter([2, 0])  # row 1 leaves
    other = EvictionKVCache.merge([singles[1].copy()])
    batch.extend(other)  # and joins again at the end
    for b, i in enumerate([2, 0, 1]):
        row = batch.extract(b)
        np.testing.assert_array_equal(positions(row), positions(singles[i]))
        got_k, _, _ = row.ordered_state()
        want_k, _, _ = singles[i].ordered_state()
        np.testing.assert_allclose(np.array(dequantize(got_k, bits, 32)), np.array(dequantize(want_k, bits, 32)),
                                   rtol=0, atol=1e-6)


def test_save_load_and_copy_round_trip_quantized(tmp_path):
    model = tiny_llama(layers=3, head_dim=64)
    tokens = random_tokens(60, seed=2, repeat=False)
    caches = make_eviction_cache(model, EvictionConfig(keep="low", budget=16, skip_layers=(0,), kv_bits=4))
    model(tokens[None, :50], cache=caches)
    for t in tokens[50:55]:
        model(t.reshape(1, 1), cache=caches)
    path = str(tmp_path / "q.safetensors")
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path)
    copies = copy_caches(caches)
    for c, l in zip(caches, loaded):
        assert (l.kv_bits, l.kv_group_size, l.bounded) == (4, 64, c.bounded)
    for t in tokens[55:]:
        a, b, c = (model(t.reshape(1, 1), cache=x) for x in (caches, loaded, copies))
        np.testing.assert_array_equal(np.array(a), np.array(b))
        np.testing.assert_array_equal(np.array(a), np.array(c))
    assert cache_stats(loaded).kept_bytes < cache_stats(caches).kept_bytes or True  # loaded lags by the last steps
    # a batch cache round-trips too
    batch = EvictionKVCache.merge([caches[1], copies[1]])
    save_prompt_cache(path, [batch])
    (back,) = load_prompt_cache(path)
    assert back.kv_bits == 4 and back.counts == batch.counts
    np.testing.assert_array_equal(np.array(back.keys[0]), np.array(batch.keys[0]))


def test_quantized_bytes_against_an_independent_count():
    model = tiny_llama(layers=3, head_dim=64)
    tokens = random_tokens(100, seed=1, repeat=False)
    row_fp = 2 * 64 * 2 * 4  # KV heads x head_dim x (keys + values) x float32
    for bits, group in ((4, 64), (8, 32)):
        # per head and vector: packed bits, then one float32 scale and bias per group
        row_q = 2 * 2 * (64 * bits // 8 + 2 * (64 // group) * 4)
        caches = make_eviction_cache(model, EvictionConfig(keep="low", budget=32, kv_bits=bits, kv_group_size=group))
        model(tokens[None], cache=caches)
        s = cache_stats(caches, ceiling_at=100 + 10)
        assert s.kept_bytes == 3 * 32 * row_q and s.full_bytes == 3 * 100 * row_fp
        assert s.compression_ratio == pytest.approx(100 * row_fp / (32 * row_q))
        assert s.token_ratio == pytest.approx(100 / 32)
        assert s.ceiling_bytes == 3 * 32 * row_q and s.kept_bytes <= s.ceiling_bytes
        assert kv_memory(model, EvictionConfig(keep="low", budget=32, kv_bits=bits, kv_group_size=group)).ceiling_bytes \
            == 3 * 32 * row_q
    unbounded = kv_memory(model, EvictionConfig(budget=None, kv_bits=4))
    assert unbounded.ceiling_bytes is None and unbounded.growth_bytes_per_token == 3 * 2 * 2 * (32 + 8)


def test_sliding_window_layers_stay_full_precision_rotating():
    types = ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]
    model = tiny_llama(layers=4, layer_types=types, sliding_window=8, head_dim=64)
    caches = make_eviction_cache(model, EvictionConfig(keep="low", budget=16, kv_bits=4))
    assert [type(c) for c in caches] == [EvictionKVCache, RotatingKVCache, EvictionKVCache, RotatingKVCache]
    out = model(random_tokens(40, seed=3, repeat=False)[None], cache=caches)
    assert np.isfinite(np.array(out)).all()


@pytest.mark.parametrize("kwargs,needle", [
    (dict(kv_bits=3), "kv_bits must be 4 or 8"),
    (dict(kv_bits=4, kv_group_size=48), "kv_group_size must be 32, 64 or 128"),
])
def test_bad_settings_name_the_allowed_values(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        EvictionConfig(**kwargs)


def test_group_size_must_divide_the_head_dimension():
    model = tiny_llama(layers=2, head_dim=64)
    with pytest.raises(ValueError, match="does not divide this model's head dimension 64; use --kv-group-size 32 or 64"):
        EvictionConfig(kv_bits=4, kv_group_size=128).for_model(model)


@pytest.fixture
def model64(tiny_model_dir_64):
    return tiny_model_dir_64


@pytest.mark.parametrize("args,needle", [
    (["--kv-bits", "3"], "kv_bits must be 4 or 8"),
    (["--kv-bits", "4", "--kv-group-size", "48"], "kv_group_size must be 32, 64 or 128"),
    (["--kv-bits", "4", "--kv-group-size", "128"], "use --kv-group-size 32 or 64"),
])
def test_cli_usage_errors_before_any_work(tmp_path, model64, args, needle):
    from knorm_gen.cli.batch import batch_command as main

    rows = tmp_path / "in.jsonl"
    rows.write_text(json.dumps({"id": 1, "prompt": "hello"}) + "\n")
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(main, [str(rows), "--model", str(model64), "--output", str(out), *args])
    assert result.exit_code == 2, result.output
    assert needle in result.output
    assert not out.exists()


def test_batch_of_rows_equals_each_row_alone_and_bytes_shrink(tmp_path, model64):
    from knorm_gen.cli.batch import batch_command as main

    rows = tmp_path / "in.jsonl"
    with rows.open("w") as f:
        for i in range(5):
            f.write(json.dumps({"id": i, "prompt": "Summarize: " + f"word{i} alpha beta " * (30 + 25 * i)}) + "\n")
    common = [str(rows), "--model", str(model64), "--budget", "48", "--max-tokens", "10"]
    outs = {}
    for name, extra in (("b1", ["--batch-size", "1"]), ("b4", ["--batch-size", "4"]), ("fp", ["--batch-size", "4"])):
        out = tmp_path / f"{name}.jsonl"
        bits = [] if name == "fp" else ["--kv-bits", "4"]
        result = CliRunner().invoke(main, [*common, *extra, *bits, "--output", str(out)])
        assert result.exit_code == 0, result.output
        outs[name] = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    for i in range(5):
        a, b, fp = outs["b1"][i], outs["b4"][i], outs["fp"][i]
        assert a["completion"] == b["completion"] and a["generated_tokens"] == b["generated_tokens"]
        assert a["tokens_kept"] == b["tokens_kept"] == fp["tokens_kept"]
        assert a["config"]["kv_bits"] == 4 and "kv_bits" not in fp["config"]
        assert a["kept_bytes"] <= 0.3 * fp["kept_bytes"], (a["kept_bytes"], fp["kept_bytes"])
        assert a["full_bytes"] == fp["full_bytes"] and a["kept_bytes"] <= a["kv_ceiling_bytes"]
        assert a["token_ratio"] == pytest.approx(a["tokens_seen"] / a["tokens_kept"])


def test_a_row_may_set_kv_bits_and_a_bad_one_is_its_own_error_record(tmp_path, model64):
    from knorm_gen.cli.batch import batch_command as main

    rows = tmp_path / "in.jsonl"
    text = "Summarize: " + "alpha beta gamma " * 40
    rows.write_text("".join(json.dumps(r) + "\n" for r in (
        {"id": "plain", "prompt": text}, {"id": "q4", "prompt": text, "kv_bits": 4},
        {"id": "bad", "prompt": text, "kv_bits": 3})))
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(main, [str(rows), "--model", str(model64), "--budget", "32", "--max-tokens", "4",
                                       "--batch-size", "4", "--output", str(out)])
    assert result.exit_code == 1, result.output  # one row failed, the others ran
    records = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert records["bad"]["error"]["type"] == "invalid_row"
    assert "field 'kv_bits' must be 4, 8 or null" in records["bad"]["error"]["message"]
    assert "kv_bits" not in records["plain"]["config"] and records["q4"]["config"]["kv_bits"] == 4
    assert records["q4"]["kept_bytes"] <= 0.3 * records["plain"]["kept_bytes"]
    assert records["q4"]["tokens_kept"] == records["plain"]["tokens_kept"]


def test_a_block_attends_to_the_dequantized_values_and_a_decode_step_to_the_triples():
    rng = np.random.default_rng(11)
    keys = rng.normal(size=(1, HEADS, 31, DIM)).astype(np.float32)
    cache = EvictionKVCache(16, 2, 0, "low", kv_bits=4, kv_group_size=32)
    k, v = cache.update_and_fetch(mx.array(keys[:, :, :30]), mx.array(keys[:, :, :30]))
    # a block: floats, the full-precision SDPA (no ``bits``), every value within one step of its source
    assert isinstance(k, mx.array) and not hasattr(cache, "bits") and k.shape == (1, HEADS, 30, DIM)
    assert np.all(np.abs(np.array(k) - keys[:, :, :30]) <= numpy_quant_step(keys[:, :, :30], 4, 32) + 1e-5)
    k, v = cache.update_and_fetch(mx.array(keys[:, :, 30:]), mx.array(keys[:, :, 30:]))
    assert isinstance(k, tuple) and cache.bits == 4  # a decode step: mlx_lm's quantized SDPA
