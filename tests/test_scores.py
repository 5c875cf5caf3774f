"""Every rule in the scores table through the shared selection machinery: one
parametrised suite, so a rule added to SCORES is covered the day it is added."""

import mlx.core as mx
import numpy as np
import pytest

from knorm_gen import L2NormKVCache
from knorm_gen.question import LOCAL, PER_QUERY_LOCAL
from knorm_gen.scores import ANCHORED, PROBED, RUNNING, SCORES, pack_ranks, rank_positions

from .conftest import LeverageReference, numpy_anchored_score, numpy_running_kept
from .test_cache import distinct_norm_keys, feed_keys, kept_positions
from .test_question import reference_scores

T, BUDGET, N_SINK, RECENT = 48, 14, 3, 4


def question_probe(heads, dim, t, seed):
    """A probe for keep="question": unit queries (1, heads, 6, dim) and piece numbers of t positions."""
    rng = np.random.default_rng(100 + seed)
    q = rng.normal(size=(1, heads, 6, dim))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    return q.astype(np.float32), np.cumsum(rng.random(t) < 0.3)


def per_query_reference(keys, q, pieces, reach):
    """(1, H, N) float64 question_per_query scores (higher kept first): each query less its
    own mean within ``reach`` positions either side, then the best query, then the piece's best."""
    k, qq = keys[0].astype(np.float64), q[0].astype(np.float64)
    n = k.shape[1]
    s = np.empty((k.shape[0], n))
    for h in range(k.shape[0]):
        per = k[h] @ qq[h].T
        s[h] = [(per[i] - per[max(0, i - reach):i + reach + 1].mean(axis=0)).max() for i in range(n)]
    for g in set(pieces.tolist()):
        at = pieces == g
        s[:, at] = s[:, at].max(axis=-1, keepdims=True)
    return s[None]


def both_reference(keys, q, pieces):
    """(1, H, N) float64 question_both_carry scores of one block alone: the mean of the
    question rule's and the per-query rule's references."""
    return 0.5 * (reference_scores(keys, q, [list(pieces)], LOCAL)
                  + per_query_reference(keys, q, pieces, PER_QUERY_LOCAL))


def rule_cache(keep, keys, seed, budget=BUDGET, n_sink=N_SINK, recent=RECENT):
    """A cache for ``keep``; a probed rule gets :func:`question_probe` for these keys."""
    cache = L2NormKVCache(budget, n_sink, recent, keep)
    if keep in PROBED:
        q, pieces = question_probe(keys.shape[1], keys.shape[3], keys.shape[2], seed)
        cache.probe = (mx.array(q), mx.array(pieces)[None])
    return cache


def numpy_block_scores(keep, keys, seed):
    """float64 reference of each rule for one block of keys ``(1, H, N, D)`` (lower is
    kept first), written from the rules' definitions: ``low``/``high`` the squared key
    norm, ``recent`` minus the position, ``keydiff``/``blend`` the cosine to the block's
    mean unit key (plus ln|k| for blend), ``leverage`` minus the ridge leverage against the
    block's own centred keys (:class:`LeverageReference`); ``random`` the uniform draws mlx
    makes after ``mx.random.seed(seed)`` (its only input)."""
    keys = keys.astype(np.float64)
    squared = (keys ** 2).sum(axis=-1)
    if keep == "low":
        return squared
    if keep == "high":
        return -squared
    if keep == "recent":
        return np.broadcast_to(-np.arange(keys.shape[2], dtype=np.float64), squared.shape)
    if keep == "random":
        mx.random.seed(seed)
        return np.array(mx.random.uniform(shape=squared.shape))
    if keep == "leverage":
        ref = LeverageReference(keys)
        ref.feed(keys.shape[2])
        return ref.scores()[None]
    if keep in ANCHORED:
        anchor = (keys / np.linalg.norm(keys, axis=-1, keepdims=True)).mean(axis=2)[0]
        return numpy_anchored_score(keep, keys[0], anchor)[None]
    if keep in ("question", "question_carry"):  # alone (no earlier layer to carry from) question_carry is question
        q, pieces = question_probe(keys.shape[1], keys.shape[3], keys.shape[2], seed)
        return -reference_scores(keys, q, [list(pieces)], LOCAL)
    if keep in ("question_per_query", "question_per_query_carry"):
        q, pieces = question_probe(keys.shape[1], keys.shape[3], keys.shape[2], seed)
        return -per_query_reference(keys, q, pieces, PER_QUERY_LOCAL)
    if keep == "question_both_carry":  # alone, the mean of the two rules' scores
        q, pieces = question_probe(keys.shape[1], keys.shape[3], keys.shape[2], seed)
        return -both_reference(keys, q, pieces)
    raise AssertionError(f"no numpy reference for the rule {keep!r}: write one here")


@pytest.mark.parametrize("keep", list(SCORES))
@pytest.mark.parametrize("seed", [0, 1])
def test_kept_set_is_the_rule_ranking(keep, seed):
    # Independent reference: the rule's scores for the block computed in numpy from its
    # definition, ranked by (score, position) with sinks and the recent window protected.
    keys = distinct_norm_keys(T, np.random.default_rng(seed), heads=2)
    scores = numpy_block_scores(keep, keys, seed)
    mx.random.seed(seed)
    cache = rule_cache(keep, keys, seed)
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
    cache = rule_cache(keep, keys, 3)
    feed_keys(cache, keys, [20, 1, 1, 1, 25])
    got = kept_positions(cache)
    assert cache.offset == T and got.shape == (1, 3, BUDGET)
    for h in range(3):
        assert set(range(N_SINK)) | set(range(T - RECENT, T)) <= set(got[0, h])


# question measures a key against the mean score of its block's neighbours: path dependent, like RUNNING
@pytest.mark.parametrize("keep", [k for k in SCORES if k != "random" and k not in RUNNING | PROBED])
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


@pytest.mark.parametrize("keep", sorted(ANCHORED))
@pytest.mark.parametrize("splits", [[T], [1] * T, [5, 17, 1, 1, 24], [20, 1, 1, 1, 25]])
def test_anchored_rules_follow_a_running_mean_reference(keep, splits):
    keys = distinct_norm_keys(T, np.random.default_rng(13), heads=2)
    cache = L2NormKVCache(BUDGET, N_SINK, RECENT, keep)
    feed_keys(cache, keys, splits)
    got = kept_positions(cache)
    assert [list(g) for g in got[0]] == numpy_running_kept(keys, splits, BUDGET, N_SINK, RECENT, keep)


@pytest.mark.parametrize("keep", sorted(RUNNING))
def test_anchored_rules_depend_on_the_block_size(keep):
    # The control that makes the reference above able to fail: scored against the
    # anchor of their own time, the same keys are kept differently in other blocks.
    keys = distinct_norm_keys(T, np.random.default_rng(13), heads=2)
    kept = [numpy_running_kept(keys, s, BUDGET, N_SINK, RECENT, keep) for s in ([T], [1] * T)]
    assert kept[0] != kept[1]


NEAR_TIE = 1e-4  # float32 leverage is within ~1e-5 of float64 (benchmarks/bench_rules.py); ties closer may flip


def assert_best_up_to_near_ties(got, scored, protected, limit, what):
    """``got`` (positions) holds the ``protected`` ones and the best of the other
    ``scored`` positions (dict: position -> float64 score) by (score, position), up to
    ``limit`` in all; it may differ from that only by swapping two positions whose
    scores lie within NEAR_TIE of each other (relative)."""
    rest = sorted((p for p in scored if p not in protected), key=lambda p: (scored[p], p))
    want = set(protected) | set(rest[: max(limit - len(protected), 0)]) if len(scored) > limit else set(scored)
    got = set(got)
    assert len(got) == len(want), what
    for p in got - want:
        for q in want - got:
            gap = abs(scored[p] - scored[q])
            assert gap <= NEAR_TIE * max(abs(scored[p]), abs(scored[q])), (what, p, q, scored[p], scored[q])


@pytest.mark.parametrize("splits", [[T], [1] * T, [5, 17, 1, 1, 24], [20, 1, 1, 1, 25], [9, 1, 14, 1, 1, 22]])
@pytest.mark.parametrize("seed", [13, 14])
def test_leverage_follows_a_float64_reference_block_by_block(splits, seed):
    # After every block the cache's kept set is the float64 ranking of what it held
    # plus the block (the held keys re-scored when the block has more than one token),
    # with the scores of LeverageReference; it follows the cache's own choice only
    # where two scores were within NEAR_TIE.
    keys = distinct_norm_keys(T, np.random.default_rng(seed), heads=2)
    ref = LeverageReference(keys)
    cache = L2NormKVCache(BUDGET, N_SINK, RECENT, "leverage")
    held, seen = [{}, {}], 0
    for size in splits:
        block = mx.array(keys[:, :, seen : seen + size])
        cache.update_and_fetch(block, block)
        ref.feed(size)
        every = ref.scores()
        seen += size
        got = kept_positions(cache)
        for h in range(2):
            if size > 1:
                held[h] = {p: every[h, p] for p in held[h]}
            held[h].update({p: every[h, p] for p in range(seen - size, seen)})
            protected = {p for p in held[h] if p < N_SINK or p >= seen - RECENT}
            assert_best_up_to_near_ties(got[0, h], held[h], protected, BUDGET, (splits, seen, h))
            held[h] = {p: held[h][p] for p in got[0, h]}


def test_leverage_keeps_the_keys_off_the_heads_subspace():
    # 40 keys spanning 3 of 8 dimensions (and a common offset), 6 others each
    # reaching out along one of the other 5: leverage keeps the 6, where the
    # highest-norm rule keeps others.
    rng = np.random.default_rng(4)
    cluster = np.zeros((40, 8))
    cluster[:, :3] = rng.normal(size=(40, 3)) * 3.0
    cluster += 0.01 * rng.normal(size=(40, 8))
    odd = np.zeros((6, 8))
    odd[np.arange(6), 3 + np.arange(6) % 5] = [1.5, 1.5, 1.5, 1.5, 1.5, -1.5]
    order = rng.permutation(46)
    keys = (np.concatenate([cluster, odd])[order] + 2.0)[None, None].astype(np.float32)
    cache = L2NormKVCache(6, 0, 0, "leverage")
    feed_keys(cache, keys, [46])
    assert sorted(kept_positions(cache)[0, 0]) == sorted(np.flatnonzero(order >= 40))
    high = L2NormKVCache(6, 0, 0, "high")
    feed_keys(high, keys, [46])
    assert sorted(kept_positions(high)[0, 0]) != sorted(np.flatnonzero(order >= 40))


def test_keydiff_keeps_the_outliers_of_a_cluster():
    # 40 keys near one direction, 6 pointing elsewhere: KeyDiff keeps the 6, whatever their norms.
    rng = np.random.default_rng(2)
    base = np.tile(np.eye(8)[0], (40, 1)) + 0.05 * rng.normal(size=(40, 8))
    odd = rng.normal(size=(6, 8)) * 3.0
    odd[:, 0] = -np.abs(odd[:, 0])
    order = rng.permutation(46)
    keys = np.concatenate([base, odd])[order][None, None].astype(np.float32)
    cache = L2NormKVCache(6, 0, 0, "keydiff")
    feed_keys(cache, keys, [46])
    assert sorted(kept_positions(cache)[0, 0]) == sorted(np.flatnonzero(order >= 40))


def test_presets_are_layouts_the_fields_override():
    from knorm_gen.config import PRESETS, EvictionConfig, make_configs

    paper, _ = make_configs(preset="paper", budget=64)
    assert (paper.keep, paper.skip_layers, paper.budget) == ("low", (0, 1), 64)
    assert paper.resolved(30).skip_layers == (0, 1)
    retrieval, _ = make_configs(preset="retrieval")
    assert retrieval.resolved(30).skip_layers == tuple(range(9))  # the first 30% of 30 layers
    mixed, _ = make_configs(EvictionConfig(early_factor=4), preset="summarize", keep="blend")
    assert (mixed.keep, mixed.skip_layers, mixed.early_factor) == ("blend", (), None)
    assert mixed.resolved(30).layers == tuple((512, 64) for _ in range(30))  # every layer bounded
    assert paper.coverage == retrieval.coverage == mixed.coverage == 0.0  # a preset is its rule alone
    with pytest.raises(ValueError, match="preset must be one of paper, retrieval, summarize, question, intrinsic, auto; got 'x'"):
        make_configs(preset="x")
    question, _ = make_configs(preset="question", budget=64)
    assert (question.keep, question.coverage, question.recent_share) == ("question", 0.0, 0.125)
    assert question.resolved(30).layers == tuple((64, 8) for _ in range(30))  # every layer bounded, the eighth recent
    intrinsic, _ = make_configs(preset="intrinsic", budget=64)  # 0.6's default: the keys alone, no probe
    assert (intrinsic.keep, intrinsic.early_rule(), intrinsic.coverage) == ("blend", "leverage", 0.25)
    assert intrinsic.resolved(30).layers == tuple((64, 32) for _ in range(30))  # every layer bounded, the recent half
    assert set(PRESETS) == {"paper", "retrieval", "summarize", "question", "intrinsic", "auto"}


def test_question_per_query_takes_out_the_mean_within_its_own_reach():
    # The suite's blocks are shorter than either reach; here a prompt of 600 positions tells
    # PER_QUERY_LOCAL apart from the question rule's LOCAL.
    n = 600
    keys = np.random.default_rng(7).normal(size=(1, 2, n, 16)).astype(np.float32)
    q, pieces = question_probe(2, 16, n, 0)
    positions = mx.broadcast_to(mx.arange(n)[None, None], (1, 2, n))
    got = -np.array(SCORES["question_per_query"](mx.array(keys), positions, (mx.array(q), mx.array(pieces)[None])))
    want = per_query_reference(keys, q, pieces, PER_QUERY_LOCAL)
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert PER_QUERY_LOCAL != LOCAL and np.abs(per_query_reference(keys, q, pieces, LOCAL) - want).max() > 1e-2
