"""EvictionKVCache against independent references: plain KVCache runs, numpy
rankings of recorded keys, and explicit-mask attention. Then BatchEvictionKVCache on
identical key tensors: each row alone in a single-row cache, a numpy ranking, and
attention computed per row with an explicit causal mask."""

import copy
import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache, load_prompt_cache, save_prompt_cache

from knorm_gen import EvictionConfig, EvictionKVCache, cache_stats, make_eviction_cache
from knorm_gen.eviction.cache import BatchEvictionKVCache
from knorm_gen.platform.mlx_compat import own_layer_masks
from knorm_gen.eviction.rules import RULES
from knorm_gen.eviction.selection import PAD

RUNNING = {name for name, rule in RULES.items() if rule.keeps_state()}

from .conftest import numpy_running_kept, random_tokens, tiny_llama


class RecordingCache(EvictionKVCache):
    """Records every key block offered to the cache (post-RoPE), in arrival order."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen_keys = []

    def update_and_fetch(self, keys, values):
        self.seen_keys.append(np.array(keys))
        return super().update_and_fetch(keys, values)


def recording_caches(model, budget, n_sink=4, recent=0, keep="low", skip=()):
    n = len(model.layers)
    return [KVCache() if i in skip else RecordingCache(budget, n_sink, recent, keep) for i in range(n)]


def feed(model, caches, tokens, splits):
    """Feed ``tokens`` in blocks of the given sizes; return the last logits."""
    start = 0
    logits = None
    for size in splits:
        logits = model(tokens[None, start : start + size], cache=caches)
        mx.eval(logits, [c.state for c in caches])
        start += size
    assert start == tokens.size
    return logits


def random_splits(total, rng, max_block=24):
    splits = []
    while sum(splits) < total:
        splits.append(int(min(rng.integers(1, max_block + 1), total - sum(splits))))
    return splits


def check_kept(all_keys, got, budget, n_sink, recent, keep, rel=1e-5):
    """Independent check of one cache's kept positions against the recorded keys.

    RoPE is a rotation, so two copies of a key differ in norm only by float
    rounding (~1e-7); near-ties may fall either way, so the ranking is checked
    as an inequality with a small relative tolerance, and exact otherwise.
    """
    b, h, t, _ = all_keys.shape
    norms = np.linalg.norm(all_keys.astype(np.float64), axis=-1)
    for bi in range(b):
        for hi in range(h):
            kept = set(int(p) for p in got[bi, hi])
            assert len(kept) == min(t, budget), "kept count"
            if t <= budget:
                assert kept == set(range(t))
                continue
            protected = {p for p in range(t) if p < n_sink or p >= t - recent}
            assert protected <= kept, f"protected tokens evicted in head {hi}"
            rest_kept = sorted(kept - protected)
            evicted = sorted(set(range(t)) - kept)
            if keep == "recent":
                assert max(evicted) < min(rest_kept)
                continue
            score = norms[bi, hi] if keep == "low" else -norms[bi, hi]
            worst_kept = max(score[p] for p in rest_kept)
            best_evicted = min(score[p] for p in evicted)
            assert worst_kept <= best_evicted + rel * abs(best_evicted), (
                f"head {hi}: kept score {worst_kept} > evicted score {best_evicted}"
            )


def kept_positions(cache):
    _, _, pos = cache.ordered_state()
    return np.array(pos)


def test_budget_above_tokens_matches_plain_kvcache(tiny_model):
    tokens = random_tokens(40, seed=1)
    ours = make_eviction_cache(tiny_model, EvictionConfig(keep="low", budget=64, skip_layers=()))
    ref = [KVCache() for _ in tiny_model.layers]
    splits = [7, 16, 1, 1, 9, 1, 5]
    la = feed(tiny_model, ours, tokens, splits)
    lb = feed(tiny_model, ref, tokens, splits)
    np.testing.assert_allclose(np.array(la), np.array(lb), rtol=1e-5, atol=1e-5)
    # then decode a few steps
    for t in [3, 5, 8]:
        x = mx.array([[t]])
        np.testing.assert_allclose(np.array(tiny_model(x, cache=ours)), np.array(tiny_model(x, cache=ref)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "budget,n_sink,recent,keep,seed",
    [
        (16, 4, 0, "low", 0),
        (16, 4, 0, "low", 1),
        (20, 2, 5, "low", 2),
        (16, 0, 0, "low", 3),
        (16, 4, 0, "high", 4),
        (12, 4, 0, "recent", 5),
    ],
)
def test_kept_set_matches_numpy_ranking(budget, n_sink, recent, keep, seed):
    model = tiny_llama(layers=3, seed=seed)
    rng = np.random.default_rng(seed)
    tokens = random_tokens(70, seed=seed)
    caches = recording_caches(model, budget, n_sink, recent, keep)
    feed(model, caches, tokens, random_splits(tokens.size, rng))
    for layer, c in enumerate(caches):
        all_keys = np.concatenate(c.seen_keys, axis=2)
        got = kept_positions(c)
        assert c.tokens_kept == budget and got.shape[-1] == budget
        check_kept(all_keys, got, budget, n_sink, recent, keep)


def test_exact_norm_ties_break_by_position():
    # Keys fed straight to the cache (no RoPE), so duplicates tie exactly;
    # the earlier position must win, independent of the block split.
    rng = np.random.default_rng(0)
    base = rng.normal(size=(3, 8)).astype(np.float32)
    ids = np.array([0, 1, 0, 2, 1, 0, 0, 2, 1, 1, 0, 2, 2, 0])
    keys = mx.array(base[ids][None, None])  # (1, 1, 14, 8)
    for splits in ([14], [1] * 14, [3, 4, 1, 6]):
        cache = EvictionKVCache(budget=6, n_sink=1, keep="low")
        start = 0
        for size in splits:
            cache.update_and_fetch(keys[:, :, start : start + size], keys[:, :, start : start + size])
            start += size
        norms = np.linalg.norm(base.astype(np.float64), axis=-1)[ids]
        ranked = sorted(range(1, 14), key=lambda p: (norms[p], p))
        assert list(kept_positions(cache)[0, 0]) == sorted([0] + ranked[:5]), splits


def distinct_norm_keys(t, rng, heads=2, dim=8, alphabet=5):
    """Keys whose L2 norms are either exactly equal (repeats of a small alphabet,
    so ties occur) or at least 1% apart, so a float64 numpy ranking is exact."""
    n_distinct = alphabet + t
    norms = 1.0 + 0.01 * rng.permutation(n_distinct * 4)[:n_distinct] * 1.05
    dirs = rng.normal(size=(heads, n_distinct, dim))
    base = (dirs / np.linalg.norm(dirs, axis=-1, keepdims=True) * norms[None, :, None]).astype(np.float32)
    ids = np.where(rng.random(t) < 0.4, rng.integers(0, alphabet, t), alphabet + np.arange(t))
    return base[:, ids][None]  # (1, heads, t, dim)


def feed_keys(cache, keys, splits):
    start = 0
    for size in splits:
        block = mx.array(keys[:, :, start : start + size])
        cache.update_and_fetch(block, block)
        start += size
    assert start == keys.shape[2]


@pytest.mark.parametrize("budget,n_sink,recent,keep", [
    (12, 3, 0, "low"), (12, 0, 0, "low"), (16, 2, 4, "low"), (10, 2, 0, "high"), (9, 4, 3, "recent"),
])
def test_path_independence_on_identical_keys(budget, n_sink, recent, keep):
    # The cache's own property, free of BLAS: the same key tensors fed as one
    # block, token by token, and in random splits keep the same positions,
    # and those are the independent numpy ranking.
    rng = np.random.default_rng(budget + n_sink + recent)
    t = 60
    keys = distinct_norm_keys(t, rng)
    split_sets = [[t], [1] * t] + [random_splits(t, rng, max_block=20) for _ in range(4)]
    split_sets.append([budget + 1, 1, 1, 5, 1, t - budget - 10, 1])  # decode slots, then a block
    kept = []
    for splits in split_sets:
        cache = EvictionKVCache(budget, n_sink, recent, keep)
        feed_keys(cache, keys, splits)
        assert cache.offset == t and cache.tokens_kept == budget
        kept.append(kept_positions(cache))
    for splits, got in zip(split_sets[1:], kept[1:]):
        np.testing.assert_array_equal(got, kept[0], err_msg=f"splits {splits}")
    norms = np.linalg.norm(keys.astype(np.float64), axis=-1)
    for h in range(keys.shape[1]):
        protected = {p for p in range(t) if p < n_sink or p >= t - recent}
        rest = [p for p in range(t) if p not in protected]
        if keep == "recent":
            ranked = sorted(rest, key=lambda p: -p)
        else:
            sign = 1 if keep == "low" else -1
            ranked = sorted(rest, key=lambda p: (sign * norms[0, h, p], p))
        want = sorted(protected | set(ranked[: budget - len(protected)]))
        assert list(kept[0][0, h]) == want


# Different matmul shapes (one 50-token block vs 50 single tokens) take different
# BLAS kernels, so the same token's key may differ in its last bits (seen on AMD
# EPYC with OpenBLAS). A relative norm difference of 1e-5 is ~100x float32
# rounding of a 16-wide dot product and far below any real gap between tokens.
NEAR_TIE_REL = 1e-5


def test_path_independence_through_a_model_up_to_near_ties():
    model = tiny_llama(layers=1, seed=3)
    tokens = random_tokens(50, seed=3, repeat=False)
    block = recording_caches(model, budget=16)
    single = recording_caches(model, budget=16)
    feed(model, block, tokens, [50])
    feed(model, single, tokens, [1] * 50)
    assert block[0].offset == single[0].offset == 50
    keys_block = np.concatenate(block[0].seen_keys, axis=2)
    keys_single = np.concatenate(single[0].seen_keys, axis=2)
    np.testing.assert_allclose(keys_block, keys_single, rtol=1e-4, atol=1e-5)
    for keys, cache in ((keys_block, block[0]), (keys_single, single[0])):
        check_kept(keys, kept_positions(cache), 16, 4, 0, "low", rel=NEAR_TIE_REL)
    norms = np.linalg.norm(keys_block.astype(np.float64), axis=-1)
    a, b = kept_positions(block[0]), kept_positions(single[0])
    for h in range(a.shape[1]):
        differ = set(a[0, h]) ^ set(b[0, h])
        if not differ:
            continue
        boundary = max(norms[0, h, p] for p in a[0, h] if p >= 4)
        for p in differ:
            assert abs(norms[0, h, p] - boundary) <= NEAR_TIE_REL * boundary, (
                f"head {h}: position {p} kept on one path only, norm {norms[0, h, p]} vs boundary {boundary}")


class FrozenRowsCache:
    """Reference: given kept rows, attend over (rows + block) with an explicit causal mask."""

    def __init__(self, keys, values, offset):
        self.keys, self.values, self.offset = keys, values, offset

    def make_mask(self, N, **_):
        c = self.keys.shape[2]
        q = np.arange(N)[:, None]
        k = np.arange(c + N)[None, :]
        return mx.array((k < c) | (k - c <= q))

    def update_and_fetch(self, keys, values):
        self.offset += keys.shape[2]
        return mx.concatenate([self.keys, keys], axis=2), mx.concatenate([self.values, values], axis=2)


def test_block_over_budget_attends_to_kept_rows_and_whole_block(tiny_model):
    tokens = random_tokens(60, seed=11, repeat=False)
    ours = make_eviction_cache(tiny_model, EvictionConfig(keep="low", budget=12, n_sink=2, skip_layers=()))
    feed(tiny_model, ours, tokens[:30], [10, 20])
    for c in ours:
        assert c.tokens_kept == 12
    # a decode step leaves an evicted slot, so the block path starts from it
    feed(tiny_model, ours, tokens[30:31], [1])
    ref = []
    for c in ours:
        k, v, _ = c.ordered_state()
        ref.append(FrozenRowsCache(k, v, c.offset))
    block = tokens[None, 31:55]  # 24 tokens: more than the budget by itself
    want = tiny_model(block, cache=ref)
    got = tiny_model(block, cache=ours)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)
    assert all(c.offset == 55 and c.tokens_kept == 12 for c in ours)


def test_offset_and_rope_positions_never_change():
    model = tiny_llama(layers=2, seed=5)
    tokens = random_tokens(66, seed=5)
    caches = recording_caches(model, budget=10, n_sink=2, recent=3)
    seen = 0
    for size in [5, 1, 1, 9, 1, 20, 1, 1, 26]:
        feed(model, caches, tokens[seen : seen + size], [size])
        seen += size
        for c in caches:
            assert c.offset == seen
            all_keys = np.concatenate(c.seen_keys, axis=2)
            keys, _, pos = c.ordered_state()
            keys, pos = np.array(keys), np.array(pos)
            for hi in range(pos.shape[1]):
                np.testing.assert_array_equal(keys[0, hi], all_keys[0, hi, pos[0, hi]])


@pytest.mark.parametrize("keep", ["low", "keydiff", "leverage"])
def test_save_load_round_trip_continues_identically(tmp_path, tiny_model, keep):
    tokens = random_tokens(40, seed=2)
    caches = make_eviction_cache(tiny_model, EvictionConfig(budget=10, skip_layers=(0,), keep=keep))
    feed(tiny_model, caches, tokens[:35], [20, 15])
    feed(tiny_model, caches, tokens[35:], [1] * 5)  # leaves evicted slots in place
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path)
    assert [type(c).__name__ for c in loaded] == [type(c).__name__ for c in caches]
    for c, l in zip(caches, loaded):
        if keep != "low" and isinstance(c, EvictionKVCache):  # the running state travels with the cache
            np.testing.assert_array_equal(np.array(l.state_of_rule), np.array(c.state_of_rule))
    for step in [4, 9, 1, 7]:
        x = mx.array([[step]])
        a, b = tiny_model(x, cache=caches), tiny_model(x, cache=loaded)
        np.testing.assert_array_equal(np.array(a), np.array(b))
    a = tiny_model(tokens[None, :6], cache=caches)
    b = tiny_model(tokens[None, :6], cache=loaded)
    np.testing.assert_array_equal(np.array(a), np.array(b))


def test_a_prompt_cache_saved_in_the_older_positional_form_under_the_old_class_name_still_loads(tmp_path, tiny_model):
    # Before the saved state named its settings, a single-row cache saved 20 positional slots under its
    # old class name; written here by hand, as mlx_lm's save_prompt_cache wrote it then.
    from knorm_gen.eviction.legacy import OLD_CACHE_CLASSES

    OLD_NAME = next(old for old, new in OLD_CACHE_CLASSES.items() if new == "EvictionKVCache")
    tokens = random_tokens(40, seed=2)
    caches = make_eviction_cache(tiny_model, EvictionConfig(budget=10, skip_layers=(0,), keep="keydiff"))
    feed(tiny_model, caches, tokens[:35], [20, 15])
    old = []
    for c in caches:
        if isinstance(c, EvictionKVCache):
            old.append((OLD_NAME, [c.keys, c.values, c.rank, c.free, c.count, c.offset, c.budget, c.n_sink,
                                          c.recent, "keydiff", 0, c.state_of_rule, json.dumps(c.row_spans),
                                          0.0, 0, c.kv_group_size, "mean", 0.0, 0.0, c.salt]))
        else:
            old.append((type(c).__name__, c.state))

    path = str(tmp_path / "old.safetensors")
    save_prompt_cache(path, [type(name, (), {"state": state})() for name, state in old])  # named as saved then
    loaded = load_prompt_cache(path)
    assert [type(c) for c in loaded] == [type(c) for c in caches]
    for step in [4, 9, 1]:
        x = mx.array([[step]])
        np.testing.assert_array_equal(np.array(tiny_model(x, cache=caches)), np.array(tiny_model(x, cache=loaded)))


def test_make_eviction_cache_keeps_sliding_window_layers_and_skips():
    types = ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]
    model = tiny_llama(layers=4, layer_types=types, sliding_window=8)
    caches = make_eviction_cache(model, EvictionConfig(keep="low", budget=16, skip_layers=(2,)))
    assert isinstance(caches[0], EvictionKVCache)
    assert isinstance(caches[1], RotatingKVCache) and caches[1].max_size == 8
    assert type(caches[2]) is KVCache
    assert isinstance(caches[3], RotatingKVCache)
    again = make_eviction_cache(model, EvictionConfig(keep="low", budget=16, skip_layers=(2,)))
    assert all(a is not b for a, b in zip(caches, again))
    # the mixed model runs through the eviction cache
    tokens = random_tokens(40, seed=4)
    feed(model, caches, tokens, [30, 1, 1, 8])
    assert caches[0].tokens_kept == 16 and caches[0].offset == 40


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(budget=0), "budget"),
        (dict(budget=8, n_sink=4, recent=4), "n_sink + recent"),
        (dict(budget=8, keep="middle"), "keep"),
        (dict(budget=8, n_sink=-1), "n_sink"),
        (dict(budget=8, recent=-2), "recent"),
        (dict(budget=2.5), "budget"),
    ],
)
def test_invalid_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace("+", r"\+")):
        EvictionConfig(**kwargs)
    with pytest.raises(ValueError, match=field.replace("+", r"\+")):
        EvictionKVCache(**kwargs)


def test_skip_layer_out_of_range(tiny_model):
    with pytest.raises(ValueError, match="skip_layers"):
        make_eviction_cache(tiny_model, EvictionConfig(budget=8, skip_layers=(9,)))


def test_stats_match_independent_byte_count(tiny_model):
    tokens = random_tokens(50, seed=6)
    caches = make_eviction_cache(tiny_model, EvictionConfig(keep="low", budget=16, skip_layers=(0,)))
    feed(tiny_model, caches, tokens, [32, 1, 1, 16])
    b, h, d, itemsize = 1, 2, 16, 4
    row = b * h * d * 2 * itemsize
    n_layers = len(tiny_model.layers)
    full = n_layers * 50 * row
    kept = 50 * row + (n_layers - 1) * 16 * row
    s = cache_stats(caches)
    assert (s.tokens_seen, s.tokens_kept) == (50, 16)
    assert (s.full_bytes, s.kept_bytes) == (full, kept)
    assert s.compression_ratio == pytest.approx(full / kept)
    assert caches[1].evictions == 50 - 16


def test_copy_is_independent_and_pin_stops_eviction(tiny_model):
    tokens = random_tokens(30, seed=8)
    caches = make_eviction_cache(tiny_model, EvictionConfig(keep="low", budget=8, skip_layers=()))
    feed(tiny_model, caches, tokens[:20], [19, 1])
    copies = [c.copy() for c in caches]
    before = [kept_positions(c) for c in caches]
    for c in copies:
        c.pin()
    feed(tiny_model, copies, tokens[20:], [4, 1, 5])
    for c, b in zip(caches, before):
        np.testing.assert_array_equal(kept_positions(c), b)
        assert c.offset == 20
    for c, b in zip(copies, before):
        pos = kept_positions(c)
        assert c.tokens_kept == 8 + 10
        np.testing.assert_array_equal(pos[..., :8], b)
        np.testing.assert_array_equal(pos[0, 0, 8:], np.arange(20, 30))


def test_trim_only_before_eviction(tiny_model):
    c = EvictionKVCache(budget=8, n_sink=1)
    k = mx.random.normal((1, 2, 6, 16))
    c.update_and_fetch(k, k)
    assert c.is_trimmable() and c.trim(2) == 2 and c.offset == 4 and c.size() == 4
    c.update_and_fetch(mx.random.normal((1, 2, 9, 16)), mx.random.normal((1, 2, 9, 16)))
    assert not c.is_trimmable() and c.trim(3) == 0 and c.offset == 13


def test_layer_budgets_override_single_layers(tiny_model):
    config = EvictionConfig(budget=8, keep="low", skip_layers=(0,), layer_budgets={-1: 20})
    caches = make_eviction_cache(tiny_model, config)
    assert [getattr(c, "budget", None) for c in caches] == [None, 8, 20]
    assert caches[2].recent == 20 // 4 and caches[1].recent == 8 // 4  # the default quarter of each layer's own
    feed(tiny_model, caches, random_tokens(40, seed=9), [30, 1, 9])
    assert [c.offset for c in caches] == [40, 40, 40]
    assert (caches[1].tokens_kept, caches[2].tokens_kept) == (8, 20)
    row = 1 * 2 * 16 * 2 * 4
    assert cache_stats(caches).kept_bytes == (40 + 8 + 20) * row
    with pytest.raises(ValueError, match=r"layer_budgets\[1\]"):
        EvictionConfig(budget=8, layer_budgets={1: 0})
    with pytest.raises(ValueError, match="layer_budgets index 5"):
        make_eviction_cache(tiny_model, EvictionConfig(budget=8, layer_budgets={5: 16}))


def test_layer_keep_sets_the_rule_of_single_layers(tiny_model, tmp_path):
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    from knorm_gen.eviction.config import parse_layer_keep

    config = EvictionConfig(budget=8, keep="blend", early_keep="blend", layer_keep=parse_layer_keep("0:low,-1:leverage"))
    caches = make_eviction_cache(tiny_model, config)
    assert [c.keep for c in caches] == ["low", "blend", "leverage"]
    assert config.to_dict()["layer_keep"] == {"0": "low", "-1": "leverage"}
    assert config.for_model(tiny_model).to_dict()["layer_keep"] == {"0": "low", "2": "leverage"}
    assert "layer_keep" not in EvictionConfig(budget=8).to_dict()  # older records keep their fingerprints
    # a saved tuning's table (string keys) reads back as the same layout
    assert EvictionConfig(budget=8, keep="blend", layer_keep={"0": "low", "2": "leverage"}).for_model(
        tiny_model).layer_keep == {0: "low", 1: "leverage", 2: "leverage"}  # layer 1: the blend's early rule (0-1 of 3)
    feed(tiny_model, caches, random_tokens(40, seed=9), [30, 1, 9])
    save_prompt_cache(str(tmp_path / "c.safetensors"), caches)
    assert [c.keep for c in load_prompt_cache(str(tmp_path / "c.safetensors"))] == ["low", "blend", "leverage"]
    with pytest.raises(ValueError, match=r"layer_keep\[1\] must be one of"):
        EvictionConfig(budget=8, layer_keep={1: "median"})
    with pytest.raises(ValueError, match="layer_keep must look like"):
        parse_layer_keep("0-3")
    with pytest.raises(ValueError, match="layer_keep index 5"):
        make_eviction_cache(tiny_model, EvictionConfig(budget=8, layer_keep={5: "low"}))


def test_the_default_bounds_every_layer_with_the_question_rule_and_the_blend_pairs_with_early_leverage():
    from knorm_gen.eviction.memory import kv_memory
    from knorm_gen.eviction.rules.keydiff import Blend
    from knorm_gen.eviction.rules.leverage import Leverage
    from knorm_gen.eviction.rules.question import Question
    from knorm_gen.eviction.rules.variants import Coverage, Stratify

    config = EvictionConfig(budget=8)
    assert (config.keep, config.question_score, config.carry, config.stratify, config.early_keep, config.coverage,
            config.skip_layers) == ("question", "mean", 0.25, 0.7, "auto", 0.0, ())
    model = tiny_llama(layers=10)
    caches = make_eviction_cache(model, config)
    # every layer the question rule stratified, no coverage, a quarter of the budget recent: int(0.25 * 8)
    assert all(isinstance(c, EvictionKVCache) and c.rule == Stratify(Question(reading="mean", carry=0.25), 0.7)
               and c.recent == 2 for c in caches)
    # --preset intrinsic: 30% of 10 layers, counted by hand, take leverage, the other seven the blend
    intrinsic = make_eviction_cache(model, EvictionConfig(budget=8, keep="blend", coverage=0.25))
    assert [c.keep for c in intrinsic] == ["leverage"] * 3 + ["blend"] * 7
    assert intrinsic[0].rule == Coverage(Leverage(), 0.25) and intrinsic[9].rule == Coverage(Blend(), 0.25)
    # another rule given: that rule everywhere ("auto" pairs leverage with the blend alone)
    assert [c.keep for c in make_eviction_cache(model, EvictionConfig(budget=8, keep="low"))] == ["low"] * 10
    assert [c.keep for c in make_eviction_cache(model, EvictionConfig(budget=8, keep="blend", early_keep="blend"))] \
        == ["blend"] * 10
    assert [c.keep for c in make_eviction_cache(model, EvictionConfig(budget=8, keep="random", early_keep="low"))] \
        == ["low"] * 3 + ["random"] * 7
    # a ceiling: 10 layers of 8 positions (an independent count from the shapes)
    attn = model.layers[0].self_attn
    per_slot = attn.n_kv_heads * attn.head_dim * 4 * 2  # keys + values, float32
    assert kv_memory(model, config).ceiling_bytes == 10 * 8 * per_slot


def test_skip_layers_none_is_the_first_30_percent(tiny_model):
    from knorm_gen.eviction.config import early_layers
    from knorm_gen.eviction.memory import kv_memory

    assert early_layers(30) == tuple(range(9))
    assert early_layers(3) == (0, 1) and early_layers(1) == (0,)
    config = EvictionConfig(budget=8, skip_layers=None, keep="low")
    assert config.skip_layers is None and config.to_dict()["skip_layers"] is None
    assert "early_factor" not in config.to_dict()  # records written before the field keep their fingerprints
    assert config.resolved(30).skip_layers == tuple(range(9)) and config.resolved(30).recent == 2  # a quarter of 8
    model = tiny_llama(layers=10)
    caches = make_eviction_cache(model, config)
    assert [type(c) is KVCache for c in caches] == [True] * 3 + [False] * 7
    assert kv_memory(model, config).ceiling_bytes is None  # the skipped layers grow with the input
    # counted among the full-attention layers: sliding-window layers are never compressed anyway
    types = ["sliding_attention"] * 3 + ["full_attention", "sliding_attention", "full_attention"] * 2
    hybrid = tiny_llama(layers=9, layer_types=types, sliding_window=8)
    assert EvictionConfig(budget=8, skip_layers=None).for_model(hybrid).skip_layers == (3, 5)
    caches = make_eviction_cache(hybrid, EvictionConfig(budget=8, skip_layers=None))
    assert [i for i, c in enumerate(caches) if isinstance(c, EvictionKVCache)] == [6, 8]


def test_early_factor_bounds_every_layer():
    from knorm_gen.eviction.memory import kv_memory

    config = EvictionConfig(keep="low", budget=8, early_factor=8)
    resolved = config.resolved(30)
    assert resolved.skip_layers == () and resolved.layer_budgets == {i: 64 for i in range(9)}
    model = tiny_llama(layers=10)
    caches = make_eviction_cache(model, config)
    assert all(isinstance(c, EvictionKVCache) for c in caches)
    assert [c.budget for c in caches] == [64] * 3 + [8] * 7
    # the ceiling from the caches' own arrays: bytes per position x the positions each layer can hold
    model(mx.array([[0]]), cache=caches)
    row = (caches[0].keys.nbytes + caches[0].values.nbytes) // caches[0].keys.shape[2]
    memory = kv_memory(model, config)
    assert memory.ceiling_bytes == row * (3 * 64 + 7 * 8) and memory.growth_bytes_per_token == 0
    assert config.to_dict()["early_factor"] == 8 and config != EvictionConfig(keep="low", budget=8)
    for bad in (dict(early_factor=0), dict(early_factor=2.5), dict(early_factor=8, skip_layers=(0, 1)),
                dict(early_factor=8, layer_budgets={0: 64})):
        with pytest.raises(ValueError, match="early_factor"):
            EvictionConfig(budget=8, **bad)
    assert EvictionConfig(budget=None, early_factor=8).resolved(10).layer_budgets is None
    for alone in (dict(early_factor=8), dict(layer_budgets={0: 64})):  # no budget stated: nothing to multiply
        with pytest.raises(ValueError, match="give budget=N"):
            EvictionConfig(**alone)


def test_keep_random_size_protection_and_seed():
    t, budget, n_sink, recent = 64, 16, 3, 4
    keys = distinct_norm_keys(t, np.random.default_rng(0), heads=3)

    def run(seed, splits):
        mx.random.seed(seed)
        cache = EvictionKVCache(budget, n_sink, recent, "random")
        feed_keys(cache, keys, splits)
        return kept_positions(cache)

    a = run(1, [40, 1, 1, 22])
    np.testing.assert_array_equal(a, run(1, [40, 1, 1, 22]))  # reproducible with a seed
    assert a.shape == (1, 3, budget)
    protected = set(range(n_sink)) | set(range(t - recent, t))
    chosen = []
    for seed in range(40):
        got = run(seed, [40, 1, 1, 22]) if seed else a
        for h in range(3):
            kept = set(int(p) for p in got[0, h])
            assert len(kept) == budget and protected <= kept
            chosen.append(sorted(kept - protected))
    assert len({tuple(c) for c in chosen}) > 100  # seeds and heads draw different sets
    # Random means blind to the key: the kept keys' norms look like all keys' norms,
    # unlike keep="low" on the same keys.
    norms = np.linalg.norm(keys.astype(np.float64), axis=-1)
    evictable = [p for p in range(t) if p not in protected]
    mean_all = np.mean([norms[0, h, p] for h in range(3) for p in evictable])
    mean_random = np.mean([norms[0, i % 3, p] for i, c in enumerate(chosen) for p in c])
    low = EvictionKVCache(budget, n_sink, recent, "low")
    feed_keys(low, keys, [t])
    mean_low = np.mean([norms[0, h, p] for h in range(3) for p in kept_positions(low)[0, h] if p not in protected])
    spread = np.std([norms[0, h, p] for h in range(3) for p in evictable])
    assert abs(mean_random - mean_all) < 0.15 * spread
    assert mean_all - mean_low > 0.8 * spread


def test_mlx_lm_cache_protocol_is_complete():
    from knorm_gen.platform.mlx_compat import missing_mlx_lm_protocol

    missing = missing_mlx_lm_protocol()
    assert not missing, "the installed mlx_lm lacks: " + "; ".join(missing)


def test_kv_memory_ceiling_against_an_independent_count():
    from knorm_gen import kv_memory

    types = ["full_attention", "sliding_attention", "full_attention", "full_attention"]
    model = tiny_llama(layers=4, layer_types=types, sliding_window=8)
    row = 2 * 16 * 2 * 4  # KV heads x head_dim x (keys + values) x float32
    bounded = kv_memory(model, EvictionConfig(keep="low", budget=16, skip_layers=(), layer_budgets={3: 32}))
    assert bounded.ceiling_bytes == (16 + 8 + 16 + 32) * row and bounded.growth_bytes_per_token == 0
    assert bounded.bytes_at(10) == (10 + 8 + 10 + 10) * row and bounded.bytes_at(1000) == bounded.ceiling_bytes
    grows = kv_memory(model, EvictionConfig(keep="low", budget=16, skip_layers=(2,)))
    assert grows.ceiling_bytes is None and grows.growth_bytes_per_token == row
    assert grows.bytes_at(1000) == (16 + 8 + 1000 + 16) * row and "1 of 4 layers keep every token" in grows.describe()
    # cache_stats reports the same ceiling after a real run
    caches = make_eviction_cache(model, EvictionConfig(keep="low", budget=16, skip_layers=(), layer_budgets={3: 32}))
    feed(model, caches, random_tokens(40, seed=1), [30, 1, 9])
    assert cache_stats(caches).ceiling_bytes == bounded.ceiling_bytes
    caches = make_eviction_cache(model, EvictionConfig(keep="low", budget=16, skip_layers=(2,)))
    feed(model, caches, random_tokens(40, seed=1), [40])
    assert cache_stats(caches).ceiling_bytes is None


# ---- BatchEvictionKVCache: several rows in one cache ----------------------------------------


HEADS, DIM = 2, 8


def numpy_kept(keys, budget, n_sink, recent, keep):
    """Independent ranking of one row: (1, H, T, D) keys -> sorted kept positions per head."""
    t = keys.shape[2]
    norms = np.linalg.norm(keys.astype(np.float64), axis=-1)[0]
    protected = {p for p in range(t) if p < n_sink or p >= t - recent}
    out = []
    for h in range(keys.shape[1]):
        rest = [p for p in range(t) if p not in protected]
        if keep == "recent":
            rest.sort(key=lambda p: -p)
        else:
            rest.sort(key=lambda p: ((1 if keep == "low" else -1) * norms[h, p], p))
        out.append(sorted(protected | set(rest[: max(budget - len(protected), 0)])) if t > budget
                   else list(range(t)))
    return out


def attend(q, k, v, mask):
    """Reference attention with an explicit boolean mask (True = may attend)."""
    s = (q.astype(np.float64) @ np.swapaxes(k.astype(np.float64), -1, -2)) / np.sqrt(q.shape[-1])
    s = np.where(mask, s, -np.inf)
    s -= s.max(-1, keepdims=True)
    w = np.exp(s)
    w /= w.sum(-1, keepdims=True)
    return w @ v.astype(np.float64)


NEAR_TIE = 1e-4
"""A relative gap between the worst score kept and the best evicted below which
float32 paths may disagree (tests/conftest.py numpy_running_kept's margins)."""


class Feeder:
    """Feeds rows of keys to a batch cache and to one single-row cache per row,
    checking every returned attention against the single rows'."""

    def __init__(self, lengths, budget, n_sink, recent, keep, rng):
        self.rng = rng
        self.settings = (budget, n_sink, recent, keep)
        self.keys = [distinct_norm_keys(t, rng, heads=HEADS, dim=DIM) for t in lengths]
        self.values = [rng.normal(size=k.shape).astype(np.float32) for k in self.keys]
        self.fed = [0] * len(lengths)
        self.splits = [[] for _ in lengths]
        self.singles = [EvictionKVCache(*self.settings) for _ in lengths]
        self.batch = EvictionKVCache.merge(self.singles_empty(len(lengths)))

    def singles_empty(self, n):
        return [EvictionKVCache(*self.settings) for _ in range(n)]

    def chunk(self, sizes):
        """One call: row b gets its next sizes[b] tokens, right-padded to the widest."""
        n = max(sizes)
        tied = [self.tied(b) for b in range(len(sizes))]  # before this block, which may break a tie either way
        # padding holds garbage (as a model's padded positions do): it must never count
        blk_k = self.rng.normal(size=(len(sizes), HEADS, n, DIM)).astype(np.float32) * 3.0
        blk_v = np.zeros_like(blk_k)
        q = self.rng.normal(size=(len(sizes), HEADS, n, DIM)).astype(np.float32)
        for b, size in enumerate(sizes):
            s = slice(self.fed[b], self.fed[b] + size)
            blk_k[b, :, :size], blk_v[b, :, :size] = self.keys[b][0, :, s], self.values[b][0, :, s]
        padded = any(size < n for size in sizes)
        if padded:
            self.batch.prepare(lengths=list(sizes), right_padding=[n - size for size in sizes])
        mask = np.array(self.batch.make_mask(n))
        k, v = self.batch.update_and_fetch(mx.array(blk_k), mx.array(blk_v))
        if padded:
            self.batch.finalize()
        got = attend(q, np.array(k), np.array(v), mask)
        for b, size in enumerate(sizes):
            if not size:
                continue
            s = slice(self.fed[b], self.fed[b] + size)
            sk, sv = self.singles[b].update_and_fetch(mx.array(self.keys[b][:, :, s]),
                                                      mx.array(self.values[b][:, :, s]))
            sk, sv = np.array(sk), np.array(sv)
            c = sk.shape[2] - size
            causal = np.concatenate([np.ones((size, c), bool), np.tril(np.ones((size, size), bool))], axis=1)
            want = attend(q[b : b + 1, :, :size], sk, sv, causal)
            if not tied[b]:
                np.testing.assert_allclose(got[b : b + 1, :, :size], want, rtol=1e-5, atol=1e-5)
            self.fed[b] += size
            self.splits[b].append(size)

    def tied(self, b) -> bool:
        """Whether row ``b`` of the batch holds other tokens than its single-row twin;
        allowed only where the float64 reference met a near-tie (then they may differ
        for ever after), else a failure."""
        if self.fed[b] == 0 or self.settings[3] not in RUNNING:
            return False
        same = np.array_equal(kept_positions(self.batch.extract(b)), kept_positions(self.singles[b]))
        if same:
            return False
        margins: list = []
        numpy_running_kept(self.keys[b][:, :, : self.fed[b]], self.splits[b], *self.settings, margins=margins)
        assert margins and min(margins) < NEAR_TIE, "batch and single rows differ with no tie to explain it"
        return True

    def check(self):
        budget, n_sink, recent, keep = self.settings
        for b in range(len(self.fed)):
            row = self.batch.extract(b)
            assert row.offset == self.fed[b] == self.batch.seen[b]
            got = kept_positions(row)
            assert got.max(initial=-1) < self.fed[b]  # padding is never kept
            margins: list = []
            if keep in RUNNING:
                want = numpy_running_kept(self.keys[b][:, :, : self.fed[b]], self.splits[b], *self.settings,
                                          margins=margins)
            else:
                want = numpy_kept(self.keys[b][:, :, : self.fed[b]], *self.settings)
            if margins and min(margins) < NEAR_TIE:
                # the float64 reference itself met a (near-)tie at some eviction: float32 may break it
                # either way, differently at another batch shape or BLAS path, and what is held after
                # it differs. What must hold whatever the tie: the budget, and the sinks and recent
                # window kept.
                seen = self.fed[b]
                must = set(range(min(n_sink, seen))) | set(range(max(seen - recent, 0), seen))
                for heads in (got[0], kept_positions(self.singles[b])[0]):
                    for h in heads:
                        assert len(h) == min(budget, seen) and must <= set(int(p) for p in h)
                continue
            np.testing.assert_array_equal(got, kept_positions(self.singles[b]))
            assert [list(g) for g in got[0]] == want
        assert [int(x) for x in np.array(self.batch.offset)] == self.fed


SETTINGS = [(12, 3, 0, "low"), (12, 0, 2, "low"), (10, 2, 3, "high"), (9, 4, 2, "recent"), (16, 4, 2, "low"),
            (12, 3, 2, "keydiff"), (10, 2, 1, "blend"), (12, 3, 2, "leverage")]


@pytest.mark.parametrize("budget,n_sink,recent,keep", SETTINGS)
@pytest.mark.parametrize("seed", [0, 1])
def test_each_row_keeps_what_it_keeps_alone(budget, n_sink, recent, keep, seed):
    rng = np.random.default_rng(seed)
    # under budget, exactly at it, one over, and far over
    lengths = [5, budget, budget + 1, 6 * budget]
    f = Feeder(lengths, budget, n_sink, recent, keep, rng)
    prefill = [t - 4 for t in lengths]
    while any(a < p for a, p in zip(f.fed, prefill)):
        f.chunk([min(int(rng.integers(1, 17)), p - a) for a, p in zip(f.fed, prefill)])
        f.check()
    for _ in range(4):  # decode steps: every row one token
        f.chunk([1] * len(lengths))
        f.check()


@pytest.mark.parametrize("keep", ["low", "keydiff", "leverage"])
def test_rows_leave_and_join_mid_run(keep):
    rng = np.random.default_rng(5)
    settings = (10, 2, 2, keep)
    f = Feeder([30, 8, 44], *settings, rng)
    f.chunk([20, 6, 30])
    f.chunk([1, 1, 1])
    f.chunk([1, 1, 1])  # now every over-budget row holds a decode hole
    # row 1 finishes: filter it out, as mlx_lm does
    f.batch.filter([0, 2])
    for name in ("keys", "values", "fed", "splits", "singles"):
        items = getattr(f, name)
        setattr(f, name, [items[0], items[2]])
    f.check()
    # a new row joins: prefilled in its own batch, then extended in
    g = Feeder([25], *settings, rng)
    g.chunk([20])
    f.batch.extend(g.batch)
    for name in ("keys", "values", "fed", "splits", "singles"):
        setattr(f, name, getattr(f, name) + getattr(g, name))
    for _ in range(3):
        f.chunk([1, 1, 1])
        f.check()
    f.chunk([3, 5, 2])  # a block after decode holes: compacted first
    f.check()


@pytest.mark.parametrize("keep", ["low", "blend", "leverage"])
def test_merge_of_used_single_caches_and_deepcopy(keep):
    rng = np.random.default_rng(9)
    settings = (8, 2, 1, keep)
    singles, keys = [], []
    for t, splits in ((20, [15, 1, 1, 1, 1, 1]), (5, [5]), (0, [])):
        k = distinct_norm_keys(max(t, 1), rng, heads=HEADS, dim=DIM)[:, :, :t]
        c = EvictionKVCache(*settings)
        start = 0
        for size in splits:
            c.update_and_fetch(mx.array(k[:, :, start : start + size]), mx.array(k[:, :, start : start + size]))
            start += size
        singles.append(c)
        keys.append(k)
    batch = EvictionKVCache.merge(singles)
    assert type(batch) is BatchEvictionKVCache  # never mlx_lm's plain BatchKVCache
    assert batch.seen == [20, 5, 0] and batch.counts == [8, 5, 0]
    for b, c in enumerate(singles[:2]):
        np.testing.assert_array_equal(kept_positions(batch.extract(b)), kept_positions(c))
    assert batch.extract(2).empty() and batch.extract(2).offset == 0
    clone = copy.deepcopy(batch)
    clone.filter([0])
    assert batch.batch_size == 3 and clone.batch_size == 1
    assert int(np.array(batch.rank).max()) == PAD  # padded slots carry PAD rank


def batch_chunk(batch, rows, fed, sizes):
    """Feed row b of ``batch`` its keys ``rows[b]`` from ``fed[b]`` on, ``sizes[b]`` of them, right-padded."""
    n = max(sizes)
    blk = np.full((len(sizes), HEADS, n, DIM), 7.0, np.float32)  # padding: garbage that must not count
    for b, size in enumerate(sizes):
        blk[b, :, :size] = rows[b][0, :, fed[b] : fed[b] + size]
    padded = any(size < n for size in sizes)
    if padded:
        batch.prepare(lengths=list(sizes), right_padding=[n - size for size in sizes])
    batch.update_and_fetch(mx.array(blk), mx.array(blk))
    if padded:
        batch.finalize()
    for b, size in enumerate(sizes):
        fed[b] += size


@pytest.mark.parametrize("keep", sorted(RUNNING))
def test_running_state_survives_save_load_and_copy_of_a_batch(tmp_path, keep):
    # Saved mid-run (decode holes in place, rows of different lengths) and loaded, or
    # copied: each continues exactly as the original, and the original is untouched
    # by what its copy is fed.
    from knorm_gen.eviction.cache import copy_caches

    rng = np.random.default_rng(21)
    rows = [distinct_norm_keys(60, rng, heads=HEADS, dim=DIM) for _ in range(2)]
    batch, fed = EvictionKVCache.merge([EvictionKVCache(10, 2, 1, keep) for _ in rows]), [0, 0]
    for sizes in ([20, 12], [1, 1], [1, 1]):
        batch_chunk(batch, rows, fed, sizes)
    path = str(tmp_path / "batch.safetensors")
    save_prompt_cache(path, [batch])
    (loaded,) = load_prompt_cache(path)
    (clone,) = copy_caches([batch])
    assert type(loaded) is BatchEvictionKVCache and loaded.state_of_rule.shape == batch.state_of_rule.shape
    before = np.array(batch.state_of_rule)
    batch_chunk(clone, rows, list(fed), [7, 2])
    np.testing.assert_array_equal(np.array(batch.state_of_rule), before)
    for sizes in ([1, 1], [6, 3], [1, 1], [1, 1]):
        for c in (batch, loaded):
            batch_chunk(c, rows, list(fed), sizes)
        fed = [a + s for a, s in zip(fed, sizes)]
        np.testing.assert_array_equal(np.array(loaded.state_of_rule), np.array(batch.state_of_rule))
        for b in range(2):
            np.testing.assert_array_equal(kept_positions(loaded.extract(b)), kept_positions(batch.extract(b)))


@pytest.mark.parametrize("keep", sorted(RUNNING))
def test_trim_takes_the_trimmed_keys_out_of_the_running_state(keep):
    keys = distinct_norm_keys(30, np.random.default_rng(6), heads=HEADS, dim=DIM)
    trimmed, fresh = EvictionKVCache(12, 2, 1, keep), EvictionKVCache(12, 2, 1, keep)
    feed_keys(trimmed, keys[:, :, :9], [6, 1, 1, 1])
    assert trimmed.trim(3) == 3
    feed_keys(fresh, keys[:, :, :6], [6])
    np.testing.assert_allclose(np.array(trimmed.state_of_rule), np.array(fresh.state_of_rule), rtol=1e-5, atol=1e-6)
    for c in (trimmed, fresh):
        feed_keys(c, keys[:, :, 6:], [14, 1, 1, 8])
    np.testing.assert_array_equal(kept_positions(trimmed), kept_positions(fresh))


def test_left_padding_is_refused_with_a_clear_message():
    batch = BatchEvictionKVCache(8, 2, 0, "low", batch_size=2)
    with pytest.raises(ValueError, match="right-padded"):
        batch.prepare(left_padding=[1, 0])


def test_own_layer_masks_is_scoped_and_reversible():
    model = tiny_llama(layers=3, seed=2)
    tokens = mx.array([[5, 7, 9, 11, 2, 3]])
    before = np.array(model(tokens))
    layers = model.layers
    originals = list(layers)
    with own_layer_masks(model):
        assert all(a is not b for a, b in zip(model.layers, originals))
        inside = np.array(model(tokens))  # no batch caches: the shared mask is used as before
    assert model.layers is layers and all(a is b for a, b in zip(model.layers, originals))
    np.testing.assert_array_equal(np.array(model(tokens)), before)
    np.testing.assert_allclose(inside, before, rtol=1e-6, atol=1e-6)
    with pytest.raises(RuntimeError):
        with own_layer_masks(model):
            raise RuntimeError("boom")
    assert all(a is b for a, b in zip(model.layers, originals))


def test_the_shared_mask_trap_is_real_and_fixed():
    # Layer 0 uncompressed (BatchKVCache, full history) beside compressed layers:
    # without per-layer masks one mask cannot fit both once rows differ in length.
    model = tiny_llama(layers=3, seed=4)
    rows = [list(range(3, 40)), list(range(5, 14))]

    def caches():
        return [KVCache(), EvictionKVCache(8, 2, 1), EvictionKVCache(8, 2, 1)]

    def batched(use_own_masks):
        per = [caches() for _ in rows]
        merged = [type(per[0][i]).merge([p[i] for p in per]) for i in range(3)]
        n = max(len(r) for r in rows)
        x = mx.array([r + [0] * (n - len(r)) for r in rows])
        for c in merged:
            c.prepare(lengths=[len(r) for r in rows], right_padding=[n - len(r) for r in rows])
        if use_own_masks:
            with own_layer_masks(model):
                out = model(x, cache=merged)
        else:
            out = model(x, cache=merged)
        for c in merged:
            c.finalize()
        step = mx.array([[1], [2]])
        if use_own_masks:
            with own_layer_masks(model):
                nxt = model(step, cache=merged)
        else:
            nxt = model(step, cache=merged)
        return np.array(out), np.array(nxt)

    alone = []
    for r, t in zip(rows, (1, 2)):
        c = caches()
        a = np.array(model(mx.array([r]), cache=c))
        b = np.array(model(mx.array([[t]]), cache=c))
        alone.append((a, b))
    out, nxt = batched(True)
    for i, (a, b) in enumerate(alone):
        np.testing.assert_allclose(out[i, : len(rows[i])], a[0], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(nxt[i], b[0], rtol=1e-4, atol=1e-4)
    # The negative control: with the model's one shared mask, the compressed layers
    # (holding fewer keys than the uncompressed layer the mask is built from) cannot
    # even attend: MLX refuses the mask's shape for their keys.
    with pytest.raises(ValueError, match=r"[Ss]hape|broadcast"):
        batched(False)
