"""Every rule in the scores table through the shared selection machinery: one
parametrised suite, so a rule added to SCORES is covered the day it is added."""

import mlx.core as mx
import numpy as np
import pytest

from knorm_gen import L2NormKVCache
from knorm_gen.scores import SCORES, pack_ranks, rank_positions

from .test_cache import distinct_norm_keys, feed_keys, kept_positions

T, BUDGET, N_SINK, RECENT = 48, 14, 3, 4


@pytest.mark.parametrize("keep", list(SCORES))
@pytest.mark.parametrize("seed", [0, 1])
def test_kept_set_is_the_rule_ranking(keep, seed):
    # Independent reference: the rule's own scores for the block, ranked in numpy by
    # (score, position) with sinks and the recent window protected.
    keys = distinct_norm_keys(T, np.random.default_rng(seed), heads=2)
    positions = mx.arange(T)[None, None]
    mx.random.seed(seed)
    scores = np.array(SCORES[keep](mx.array(keys), positions))
    mx.random.seed(seed)
    cache = L2NormKVCache(BUDGET, N_SINK, RECENT, keep)
    feed_keys(cache, keys, [T])
    got = kept_positions(cache)
    protected = set(range(N_SINK)) | set(range(T - RECENT, T))
    for h in range(2):
        rest = sorted((p for p in range(T) if p not in protected), key=lambda p: (scores[0, h, p], p))
        assert list(got[0, h]) == sorted(protected | set(rest[: BUDGET - len(protected)])), (keep, h)


@pytest.mark.parametrize("keep", list(SCORES))
def test_every_rule_keeps_budget_and_protects(keep):
    keys = distinct_norm_keys(T, np.random.default_rng(7), heads=3)
    mx.random.seed(3)
    cache = L2NormKVCache(BUDGET, N_SINK, RECENT, keep)
    feed_keys(cache, keys, [20, 1, 1, 1, 25])
    got = kept_positions(cache)
    assert cache.offset == T and got.shape == (1, 3, BUDGET)
    for h in range(3):
        assert set(range(N_SINK)) | set(range(T - RECENT, T)) <= set(got[0, h])


@pytest.mark.parametrize("keep", [k for k in SCORES if k != "random"])
def test_deterministic_rules_are_path_independent(keep):
    keys = distinct_norm_keys(T, np.random.default_rng(11), heads=2)
    kept = []
    for splits in ([T], [1] * T, [5, 17, 1, 1, 24]):
        cache = L2NormKVCache(BUDGET, N_SINK, RECENT, keep)
        feed_keys(cache, keys, splits)
        kept.append(kept_positions(cache))
    np.testing.assert_array_equal(kept[0], kept[1])
    np.testing.assert_array_equal(kept[0], kept[2])


def test_rank_packing_orders_like_the_floats():
    rng = np.random.default_rng(0)
    scores = np.concatenate([(rng.normal(size=200) * 10.0 ** rng.integers(-8, 8, 200)).astype(np.float32),
                             np.array([0.0, -0.0, 1e-45, -1e-45, 3.4e38, -3.4e38], np.float32)])
    pos = rng.permutation(len(scores))
    ranks = np.array(pack_ranks(mx.array(scores)[None, None], mx.array(pos)[None, None], n_sink=0))[0, 0]
    by_rank = np.argsort(ranks, kind="stable")
    by_float = sorted(range(len(scores)), key=lambda i: (float(scores[i]) if scores[i] != 0 else 0.0, pos[i]))
    assert [float(scores[i]) for i in by_rank] == [float(scores[i]) for i in by_float]
    np.testing.assert_array_equal(np.array(rank_positions(mx.array(ranks))), pos)
