"""Every rule of :data:`knorm_gen.eviction.rules.RULES` through the shared selection machinery, and
carry: one parametrised suite over every rule and setting (:func:`rule_cases`), so a rule
added to the registry is covered the day it is added."""

import mlx.core as mx
import numpy as np
import pytest

from knorm_gen import EvictionConfig
from knorm_gen.eviction.legacy import OLD_RULE_NAMES
from knorm_gen.eviction.cache import EvictionKVCache, make_eviction_cache, pin_caches, set_probe
from knorm_gen.eviction.rules import RULES
from knorm_gen.eviction.rules.question import BEST_REACH, PER_QUERY_REACH, READINGS, Probe, ProbeBatch, Question
from knorm_gen.eviction.selection import pack_ranks, rank_positions

from .conftest import LeverageReference, numpy_anchored_score, numpy_running_kept, random_tokens
from .test_cache import distinct_norm_keys, feed_keys, kept_positions
from .test_question import reference_scores

T, BUDGET, N_SINK, RECENT = 48, 14, 3, 4
RUNNING = sorted(name for name, rule in RULES.items() if rule.keeps_state())
ANCHORED = ("keydiff", "blend")


def rule_cases() -> list[tuple[str, dict]]:
    """``(keep, settings)`` for every rule, and for the question rule every reading."""
    cases = []
    for name, rule in RULES.items():
        if rule.reads_probe:
            cases += [(name, {"question_score": r}) for r in READINGS]
        else:
            cases.append((name, {}))
    return cases


CASES = rule_cases()
IDS = [f"{k}-{s.get('question_score', '')}".rstrip("-") for k, s in CASES]


def question_probe(heads, dim, t, seed):
    """A probe for keep="question": unit queries (1, heads, 6, dim) and piece numbers of t positions."""
    rng = np.random.default_rng(100 + seed)
    q = rng.normal(size=(1, heads, 6, dim))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    return q.astype(np.float32), np.cumsum(rng.random(t) < 0.3)


def as_probe(q, pieces) -> Probe:
    return Probe(mx.array(q), mx.array(pieces)[None], mx.zeros((1, len(pieces)), dtype=mx.bool_))


def per_query_reference(keys, q, pieces, reach):
    """(1, H, N) float64 per-query scores (higher kept first): each query less its own mean
    within ``reach`` positions either side, then the best query, then the piece's best."""
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


def question_reference(reading, keys, q, pieces):
    """(1, H, N) float64 question-rule scores of one block alone (higher kept first)."""
    best = reference_scores(keys, q, [list(pieces)], BEST_REACH)
    per_query = per_query_reference(keys, q, pieces, PER_QUERY_REACH)
    return {"best": best, "per_query": per_query, "mean": 0.5 * (best + per_query)}[reading]


def rule_cache(keep, settings, keys, seed, budget=BUDGET, n_sink=N_SINK, recent=RECENT):
    """A cache for ``keep``; a probed rule gets :func:`question_probe` for these keys."""
    cache = EvictionKVCache(budget, n_sink, recent, keep, **settings)
    if RULES[keep].reads_probe:
        cache.set_probe([as_probe(*question_probe(keys.shape[1], keys.shape[3], keys.shape[2], seed))])
    return cache


def numpy_block_scores(keep, settings, keys, seed):
    """float64 reference of each rule for one block of keys ``(1, H, N, D)`` (lower is
    kept first), written from the rules' definitions: ``low``/``high`` the squared key
    norm, ``recent`` minus the position, ``keydiff``/``blend`` the cosine to the block's
    mean unit key (plus ln|k| for blend), ``leverage`` minus the ridge leverage against the
    block's own centred keys (:class:`LeverageReference`), ``question`` minus its reading of
    the probe; ``random`` the uniform draws mlx makes after ``mx.random.seed(seed)`` (its only input)."""
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
    if keep == "question":
        q, pieces = question_probe(keys.shape[1], keys.shape[3], keys.shape[2], seed)
        return -question_reference(settings["question_score"], keys, q, pieces)
    raise AssertionError(f"no numpy reference for the rule {keep!r}: write one here")


@pytest.mark.parametrize("keep,settings", CASES, ids=IDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_kept_set_is_the_rule_ranking(keep, settings, seed):
    # Independent reference: the rule's scores for the block computed in numpy from its
    # definition, ranked by (score, position) with sinks and the recent window protected.
    keys = distinct_norm_keys(T, np.random.default_rng(seed), heads=2)
    scores = numpy_block_scores(keep, settings, keys, seed)
    mx.random.seed(seed)
    cache = rule_cache(keep, settings, keys, seed)
    feed_keys(cache, keys, [T])
    got = kept_positions(cache)
    protected = set(range(N_SINK)) | set(range(T - RECENT, T))
    for h in range(2):
        rest = sorted((p for p in range(T) if p not in protected), key=lambda p: (scores[0, h, p], p))
        assert list(got[0, h]) == sorted(protected | set(rest[: BUDGET - len(protected)])), (keep, h)


@pytest.mark.parametrize("keep,settings", CASES, ids=IDS)
def test_every_rule_keeps_budget_and_protects(keep, settings):
    assert RULES[keep].summary and RULES[keep].name == keep  # the command line's help lists it from here
    keys = distinct_norm_keys(T, np.random.default_rng(7), heads=3)
    mx.random.seed(3)
    cache = rule_cache(keep, settings, keys, 3)
    feed_keys(cache, keys, [20, 1, 1, 1, 25])
    got = kept_positions(cache)
    assert cache.offset == T and got.shape == (1, 3, BUDGET)
    for h in range(3):
        assert set(range(N_SINK)) | set(range(T - RECENT, T)) <= set(got[0, h])


@pytest.mark.parametrize("keep,settings", CASES, ids=IDS)
def test_a_batch_row_keeps_what_the_row_keeps_alone(keep, settings):
    # The one implementation, row by row: three rows of different lengths fed together (right
    # padding) keep, each, what the same row fed alone keeps. Integer-valued keys and queries make
    # every score exact in float32 whatever the batch shape, so the sets must be equal.
    rng = np.random.default_rng(5)
    lengths = [T, 30, 17]
    rows = [rng.integers(-4, 5, size=(1, 2, n, 8)).astype(np.float32) for n in lengths]
    probes = [as_probe(rng.integers(-2, 3, size=(1, 2, 6, 8)).astype(np.float32), np.arange(n) // 3)
              for n in lengths]
    singles = [EvictionKVCache(BUDGET, N_SINK, RECENT, keep, **settings) for _ in lengths]
    batch = EvictionKVCache.merge([EvictionKVCache(BUDGET, N_SINK, RECENT, keep, **settings) for _ in lengths])
    if RULES[keep].reads_probe:
        batch.set_probe(probes)
        for c, p in zip(singles, probes):
            c.set_probe([p])
    for start, size in ((0, 20), (20, 9), (29, 1), (30, 18)):
        real = [max(0, min(size, n - start)) for n in lengths]
        block = np.zeros((3, 2, size, 8), np.float32)
        for b, (k, r) in enumerate(zip(rows, real)):
            block[b, :, :r] = k[0, :, start : start + r]
        mx.random.seed(start)
        if any(r < size for r in real):
            batch.prepare(lengths=real, right_padding=[size - r for r in real])
        batch.update_and_fetch(mx.array(block), mx.array(block))
        batch.finalize()
        for b, (c, k, r) in enumerate(zip(singles, rows, real)):
            if r:
                mx.random.seed(start)
                c.update_and_fetch(mx.array(k[:, :, start : start + r]), mx.array(k[:, :, start : start + r]))
    for b, c in enumerate(singles):
        if keep == "random":  # one stream for the batch: a row's draws differ from its own alone
            assert kept_positions(batch.extract(b)).shape == kept_positions(c).shape
        else:
            np.testing.assert_array_equal(kept_positions(batch.extract(b)), kept_positions(c))


# question measures a key against the mean score of its block's neighbours: path dependent, like the running rules
@pytest.mark.parametrize("keep", [k for k, r in RULES.items() if k != "random" and not r.reads_probe and not r.keeps_state()])
def test_deterministic_rules_are_path_independent(keep):
    keys = distinct_norm_keys(T, np.random.default_rng(11), heads=2)
    kept = []
    for splits in ([T], [1] * T, [5, 17, 1, 1, 24]):
        cache = EvictionKVCache(BUDGET, N_SINK, RECENT, keep)
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


@pytest.mark.parametrize("keep", ANCHORED)
@pytest.mark.parametrize("splits", [[T], [1] * T, [5, 17, 1, 1, 24], [20, 1, 1, 1, 25]])
def test_anchored_rules_follow_a_running_mean_reference(keep, splits):
    keys = distinct_norm_keys(T, np.random.default_rng(13), heads=2)
    cache = EvictionKVCache(BUDGET, N_SINK, RECENT, keep)
    feed_keys(cache, keys, splits)
    got = kept_positions(cache)
    assert [list(g) for g in got[0]] == numpy_running_kept(keys, splits, BUDGET, N_SINK, RECENT, keep)


@pytest.mark.parametrize("keep", RUNNING)
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
    cache = EvictionKVCache(BUDGET, N_SINK, RECENT, "leverage")
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
    cache = EvictionKVCache(6, 0, 0, "leverage")
    feed_keys(cache, keys, [46])
    assert sorted(kept_positions(cache)[0, 0]) == sorted(np.flatnonzero(order >= 40))
    high = EvictionKVCache(6, 0, 0, "high")
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
    cache = EvictionKVCache(6, 0, 0, "keydiff")
    feed_keys(cache, keys, [46])
    assert sorted(kept_positions(cache)[0, 0]) == sorted(np.flatnonzero(order >= 40))


def test_presets_are_layouts_the_fields_override():
    from knorm_gen.eviction.config import PRESETS, make_configs

    paper, _ = make_configs(preset="paper", budget=64)
    assert (paper.keep, paper.skip_layers, paper.budget) == ("low", (0, 1), 64)
    assert paper.resolved(30).skip_layers == (0, 1)
    retrieval, _ = make_configs(preset="retrieval")
    assert retrieval.resolved(30).skip_layers == tuple(range(9))  # the first 30% of 30 layers
    mixed, _ = make_configs(EvictionConfig(budget=512, early_factor=4), preset="summarize", keep="blend")
    assert (mixed.keep, mixed.skip_layers, mixed.early_factor) == ("blend", (), None)
    assert mixed.resolved(30).layers == tuple((512, 64) for _ in range(30))  # every layer bounded
    assert paper.coverage == retrieval.coverage == mixed.coverage == 0.0  # a preset is its rule alone
    with pytest.raises(ValueError, match="preset must be one of default, paper, retrieval, summarize, question, "
                                         "intrinsic, auto; got 'x'"):
        make_configs(preset="x")
    question, _ = make_configs(preset="question", budget=64)
    assert (question.keep, question.question_score, question.carry, question.coverage,
            question.recent_share) == ("question", "best", 0.0, 0.0, 0.125)
    assert question.resolved(30).layers == tuple((64, 8) for _ in range(30))  # every layer bounded, the eighth recent
    intrinsic, _ = make_configs(preset="intrinsic", budget=64)  # the keys alone, no probe
    assert (intrinsic.keep, intrinsic.early_rule(), intrinsic.coverage) == ("blend", "leverage", 0.25)
    assert intrinsic.resolved(30).layers == tuple((64, 32) for _ in range(30))  # every layer bounded, the recent half
    default, _ = make_configs(preset="default", budget=64)
    assert default == EvictionConfig(budget=64)
    assert set(PRESETS) == {"default", "paper", "retrieval", "summarize", "question", "intrinsic", "auto"}


@pytest.mark.parametrize("old,fields", [(name, (f["question_score"], f["carry"])) for name, f in OLD_RULE_NAMES.items()])
def test_the_old_rule_names_are_read_where_saved_settings_are_and_refused_by_the_api(old, fields, tmp_path):
    from knorm_gen.cli.job_file import load_job
    from knorm_gen.eviction.legacy import current_settings

    config = EvictionConfig(budget=64, **current_settings({"keep": old}))
    assert (config.keep, config.question_score, config.carry) == ("question", *fields)
    assert config.to_dict()["keep"] == "question"
    assert current_settings({"layer_keep": {3: old}}) == {"layer_keep": {3: "question"}}
    job = tmp_path / "job.toml"  # a job file written in the old spelling runs as today's settings
    job.write_text(f'input = "in.jsonl"\n[eviction]\nkeep = "{old}"\nlayer_keep = "0-1:{old}"\n')
    flat = load_job(str(job))
    assert (flat["keep"], flat["question_score"], flat["carry"]) == ("question", *fields)
    assert flat["layer_keep"] == {0: "question", 1: "question"}
    with pytest.raises(ValueError, match="keep must be one of"):  # the API takes today's names only
        EvictionConfig(keep=old)
    with pytest.raises(ValueError, match="layer_keep"):
        EvictionConfig(keep="low", layer_keep={3: old})


def test_the_question_rules_settings_reach_the_config_only_where_a_layer_runs_it():
    assert {"question_score", "carry"} <= set(EvictionConfig().to_dict())
    assert not {"question_score", "carry"} & set(EvictionConfig(keep="low").to_dict())
    assert {"question_score", "carry"} <= set(EvictionConfig(keep="low", layer_keep={2: "question"}).to_dict())
    with pytest.raises(ValueError, match="question_score must be one of best, per_query, mean"):
        EvictionConfig(question_score="max")
    with pytest.raises(ValueError, match="carry must be a share"):
        EvictionConfig(carry=1.5)


def test_the_per_query_reading_takes_out_the_mean_within_its_own_reach():
    # The suite's blocks are shorter than either reach; here a prompt of 600 positions tells
    # PER_QUERY_REACH apart from the best reading's BEST_REACH.
    n = 600
    keys = np.random.default_rng(7).normal(size=(1, 2, n, 16)).astype(np.float32)
    q, pieces = question_probe(2, 16, n, 0)
    positions = mx.broadcast_to(mx.arange(n)[None, None], (1, 2, n))
    got = -np.array(Question("per_query").score(mx.array(keys), positions, ProbeBatch.stack([as_probe(q, pieces)])))
    want = per_query_reference(keys, q, pieces, PER_QUERY_REACH)
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert PER_QUERY_REACH != BEST_REACH and np.abs(per_query_reference(keys, q, pieces, BEST_REACH) - want).max() > 1e-2


# ---- carry: later layers keep a share of their slots for what the earlier ones scored best ----------

CT, CBUDGET = 64, 24


def carry_probe(heads, dim, seed):
    rng = np.random.default_rng(200 + seed)
    q = rng.normal(size=(1, heads, 6, dim))
    return (q / np.linalg.norm(q, axis=-1, keepdims=True)).astype(np.float32)


def numpy_carry_run(layers, pieces, splits, share, reading):
    """Kept positions per layer and head of carrying question layers ``layers`` (each
    ``(keys (1, H, T, D), queries)``), fed block by block as a forward pass feeds them:
    each block scored by the float64 reference of ``reading``, each layer's best
    standardised score per position (over its heads; the mean and spread of every scored
    position so far, the sinks left out) on a board, and each layer after the first
    keeping ``share`` of its rule slots for the best of the earlier layers' boards."""
    heads = layers[0][0].shape[1]
    held = [[set() for _ in range(heads)] for _ in layers]
    own = [np.full((heads, CT), np.nan) for _ in layers]
    boards = [np.full(CT, -np.inf) for _ in layers]
    stats = [np.zeros((heads, 3)) for _ in layers]
    slots = int(share * (CBUDGET - N_SINK - RECENT))
    start = 0
    for size in splits:
        block = np.arange(start, start + size)
        seen = start + size
        for li, (keys, q) in enumerate(layers):
            s = question_reference(reading, keys[:, :, block], q, pieces[block])[0]
            own[li][:, block] = s
            ok = block >= N_SINK
            stats[li] += np.stack([ok.sum() * np.ones(heads), s[:, ok].sum(-1), (s[:, ok] ** 2).sum(-1)], -1)
            mean = stats[li][:, 1] / stats[li][:, 0]
            sd = np.sqrt(stats[li][:, 2] / stats[li][:, 0] - mean ** 2)
            boards[li][block] = np.where(ok, ((s - mean[:, None]) / sd[:, None]).max(0), -np.inf)
            carry = np.max(boards[:li], axis=0) if li else None
            for h in range(heads):
                cand = held[li][h] | set(block.tolist())
                if len(cand) <= CBUDGET:
                    held[li][h] = cand
                    continue
                protected = {p for p in cand if p < N_SINK or p >= seen - RECENT}
                rest = cand - protected
                carried = set(sorted(rest, key=lambda p: (-carry[p], p))[:slots]) if li else set()
                others = sorted(rest - carried, key=lambda p: (-own[li][h, p], p))
                held[li][h] = protected | carried | set(others[: CBUDGET - len(protected) - len(carried)])
        start = seen
    return [[sorted(h) for h in layer] for layer in held], boards


def carry_cache_run(layers, pieces, splits, reading, share):
    caches = [EvictionKVCache(CBUDGET, N_SINK, RECENT, "question", question_score=reading, carry=share)
              for _ in layers]
    set_probe(caches, [as_probe(q, pieces) for _, q in layers])
    start = 0
    for size in splits:
        for c, (keys, _) in zip(caches, layers):
            block = mx.array(keys[:, :, start : start + size])
            c.update_and_fetch(block, block)
        start += size
    return caches


@pytest.mark.parametrize("splits", [[CT], [16, 16, 32], [20, 9, 35]])
@pytest.mark.parametrize("share", [0.25, 0.5])
@pytest.mark.parametrize("reading", READINGS)
def test_carry_keeps_the_earlier_layers_best_as_a_numpy_run_does(reading, splits, share):
    rng = np.random.default_rng(7)
    layers = [(rng.normal(size=(1, 2, CT, 8)).astype(np.float32), carry_probe(2, 8, i)) for i in range(3)]
    pieces = np.cumsum(rng.random(CT) < 0.3)
    want, boards = numpy_carry_run(layers, pieces, splits, share, reading)
    caches = carry_cache_run(layers, pieces, splits, reading, share)
    for li, c in enumerate(caches):
        np.testing.assert_allclose(np.array(c.carry_board)[0], boards[li], rtol=1e-4, atol=1e-4)
        got = np.array(c.ordered_state()[2])[0]
        for h in range(2):
            assert list(got[h]) == want[li][h], (li, h)
    # The carried share changed what the later layers keep (else this test could not fail).
    plain, _ = numpy_carry_run(layers, pieces, splits, 0.0, reading)
    assert plain[0] == want[0] and any(plain[li] != want[li] for li in (1, 2))


@pytest.mark.parametrize("spans,pinned", [(((4, 280),), 20), (None, 0)])
def test_carry_stays_within_its_budget_and_drops_the_board_when_pinned(tiny_model, spans, pinned):
    # Through a model's forward pass: three layers in one group, in order, each holding its budget plus
    # the pinned tokens after blocks and decode steps (which carry nothing), the board gone once pinned.
    ids = random_tokens(300, seed=3).tolist()
    caches = make_eviction_cache(tiny_model, EvictionConfig(keep="question", question_score="best", budget=48),
                                 spans or ((0, 1 << 62),))
    pieces = np.cumsum(np.random.default_rng(1).random(400) < 0.3)
    set_probe(caches, [as_probe(carry_probe(2, 16, i), pieces) for i in range(len(caches))])
    assert all(c.group is caches[0].group for c in caches) and caches[0].group.carried(caches[0]) is None
    for start in range(0, 300, 64):
        tiny_model(mx.array(ids[start : start + 64])[None], cache=caches)
    for token in ids[:5]:
        tiny_model(mx.array([[token]]), cache=caches)
    for c in caches:
        assert (c.count, c.offset) == (48 + pinned + (5 if pinned else 0), 305)
        assert c.carry_board.shape == (1, 300)
        assert c.kept_bytes <= c.nbytes
    tiny_model(mx.array(ids[:8])[None], cache=caches)  # a block after decode steps: the decoded positions carry nothing
    for c in caches:
        board = np.array(c.carry_board)[0]
        assert board.shape == (313,) and np.all(board[300:305] == -np.inf) and c.count == 48 + (13 if pinned else 0) + pinned
    pin_caches(caches)
    assert all(c.carry_board is None and c.group is None for c in caches)


def test_a_batch_of_carrying_rows_keeps_what_each_row_keeps_alone():
    # Carry across a batch: the rows' groups merge into one shared by the merged layers, each row's board
    # its own; integer keys and queries make every score exact, so the kept sets must be equal.
    rng = np.random.default_rng(3)
    lengths, layers = [40, 25], 3
    keys = [[rng.integers(-4, 5, size=(1, 2, n, 8)).astype(np.float32) for n in lengths] for _ in range(layers)]
    probes = [[as_probe(rng.integers(-2, 3, size=(1, 2, 6, 8)).astype(np.float32), np.arange(n) // 4)
               for n in lengths] for _ in range(layers)]

    def fresh(b):
        caches = [EvictionKVCache(20, N_SINK, RECENT, "question", question_score="mean", carry=0.25)
                  for _ in range(layers)]
        return set_probe(caches, [probes[li][b] for li in range(layers)])

    alone = [fresh(b) for b in range(len(lengths))]
    rows = [fresh(b) for b in range(len(lengths))]  # merged layer by layer, as mlx_lm's BatchGenerator merges
    batch = [EvictionKVCache.merge([rows[b][li] for b in range(len(lengths))]) for li in range(layers)]
    assert batch[0].group is batch[2].group
    for b, caches in enumerate(alone):
        for li, c in enumerate(caches):
            block = mx.array(keys[li][b])
            c.update_and_fetch(block, block)
    n = max(lengths)
    for li, c in enumerate(batch):
        block = np.zeros((len(lengths), 2, n, 8), np.float32)
        for b, length in enumerate(lengths):
            block[b, :, :length] = keys[li][b][0]
        c.prepare(lengths=lengths, right_padding=[n - length for length in lengths])
        c.update_and_fetch(mx.array(block), mx.array(block))
        c.finalize()
    for li in range(layers):
        for b in range(len(lengths)):
            np.testing.assert_array_equal(kept_positions(batch[li].extract(b)), kept_positions(alone[b][li]))


def numpy_spread_priority(positions, heads, salt):
    """The spread tier's priority from its definition, in numpy's wrapping 64-bit integers."""
    h = (np.asarray(positions, np.uint64)[None, :] * np.uint64(0x9E3779B1)
         + np.arange(heads, dtype=np.uint64)[:, None] * np.uint64(0x85EBCA77) + np.uint64((salt + 1) * 0xC2B2AE3D))
    for shift, factor in ((15, 0x2C1B3C6D), (12, 0x297A2D39), (15, 1)):
        h = (h ^ (h.view(np.int64) >> shift).view(np.uint64)) * np.uint64(factor)
    return (h & np.uint64((1 << 31) - 1)) >> np.uint64(7)


@pytest.mark.parametrize("salt", [0, 5])
def test_spread_keeps_a_random_share_of_its_own_per_head_and_layer(salt):
    # keep="low" with spread 0.5: per head, half the rule's slots hold the positions of highest priority
    # (a hash of position, head and layer), the rest the lowest norms of the others, as a numpy run ranks them.
    keys = distinct_norm_keys(T, np.random.default_rng(4), heads=2)
    from knorm_gen.eviction.rules.norm import Low
    from knorm_gen.eviction.rules.variants import Spread

    cache = EvictionKVCache(BUDGET, N_SINK, RECENT, Spread(Low(), 0.5), salt=salt)
    feed_keys(cache, keys, [T])
    got = kept_positions(cache)
    protected = set(range(N_SINK)) | set(range(T - RECENT, T))
    rest = [p for p in range(T) if p not in protected]
    slots = int(0.5 * (BUDGET - N_SINK - RECENT))
    prio = numpy_spread_priority(range(T), 2, salt)
    norms = (keys[0].astype(np.float64) ** 2).sum(-1)
    for h in range(2):
        spread = sorted(rest, key=lambda p: (-int(prio[h, p]), p))[:slots]
        by_norm = sorted((p for p in rest if p not in spread), key=lambda p: (norms[h, p], p))
        want = protected | set(spread) | set(by_norm[: BUDGET - len(protected) - slots])
        assert list(got[0, h]) == sorted(want), h
    other = EvictionKVCache(BUDGET, N_SINK, RECENT, "low", spread=0.5, salt=salt + 1)
    feed_keys(other, keys, [T])
    assert not np.array_equal(kept_positions(other), got)  # another layer draws other positions


def test_stratify_keeps_each_stretchs_best_before_the_rest():
    # Stratify(low, 0.5), budget 40, 3 sinks, 4 recent, 200 positions in one block: int(0.5 * 33) = 16 slots
    # over stretches of 16 positions (the smallest power of two giving at most 16 stretches: 13 of them),
    # 16 * 16 // 200 = 1 slot per whole stretch, 0 for the last 8 positions; then the lowest norms.
    from knorm_gen.eviction.rules.norm import Low
    from knorm_gen.eviction.rules.variants import Stratify

    t, budget = 200, 40
    # norms falling with position, at least 0.5% apart (exact in float32), each head its own order: the rule
    # alone would keep the document's end
    rng = np.random.default_rng(8)
    norms = 1.0 + 0.01 * (t - np.arange(t))[None, :] + 0.005 * rng.integers(0, 2, size=(2, t))
    dirs = rng.normal(size=(2, t, 8))
    keys = (dirs / np.linalg.norm(dirs, axis=-1, keepdims=True) * norms[..., None]).astype(np.float32)[None]
    cache = EvictionKVCache(budget, N_SINK, RECENT, Stratify(Low(), 0.5))
    feed_keys(cache, keys, [t])
    got = kept_positions(cache)
    protected = set(range(N_SINK)) | set(range(t - RECENT, t))
    norms = (keys[0].astype(np.float64) ** 2).sum(-1)
    for h in range(2):
        best = lambda ps: sorted(ps, key=lambda p: (norms[h, p], p))  # noqa: E731
        strat = {best([p for p in range(16 * i, 16 * i + 16) if p not in protected])[0] for i in range(12)}
        rest = best([p for p in range(t) if p not in protected | strat])
        want = protected | strat | set(rest[: budget - len(protected) - len(strat)])
        assert list(got[0, h]) == sorted(want), h
        assert all(any(16 * i <= p < 16 * i + 16 for p in got[0, h]) for i in range(12))


def test_variants_stack_on_any_rule_in_their_tiers():
    # Spread(Coverage(low)): the sinks and recent window, then coverage's stride (cover_slots(14, 0.25, 7)
    # = 3 slots: stride 16 over 48 positions, 0 being a sink), then half of what is left to the rule
    # (int(0.5 * (14 - 7 - 3)) = 2) drawn by priority, then the lowest norms: counted here by hand.
    from knorm_gen.eviction.rules.norm import Low
    from knorm_gen.eviction.rules.variants import Coverage, Spread

    keys = distinct_norm_keys(T, np.random.default_rng(6), heads=2)
    rule = Spread(Coverage(Low(), 0.25), 0.5)
    cache = EvictionKVCache(BUDGET, N_SINK, RECENT, rule, salt=3)
    feed_keys(cache, keys, [T])
    got = kept_positions(cache)
    protected = set(range(N_SINK)) | set(range(T - RECENT, T))
    covered = {16, 32}
    prio = numpy_spread_priority(range(T), 2, 3)
    norms = (keys[0].astype(np.float64) ** 2).sum(-1)
    for h in range(2):
        rest = [p for p in range(T) if p not in protected | covered]
        spread = sorted(rest, key=lambda p: (-int(prio[h, p]), p))[:2]
        by_norm = sorted((p for p in rest if p not in spread), key=lambda p: (norms[h, p], p))
        want = protected | covered | set(spread) | set(by_norm[: BUDGET - len(protected) - 2 - 2])
        assert list(got[0, h]) == sorted(want), h
    # the same layout from a rule name and its variants' shares, and from the config fields
    by_name = EvictionKVCache(BUDGET, N_SINK, RECENT, "low", coverage=0.25, spread=0.5, salt=3)
    assert by_name.rule == rule
    config = EvictionConfig(budget=BUDGET, n_sink=N_SINK, recent=RECENT, keep=rule, early_keep="low")
    assert (config.keep, config.coverage, config.spread) == ("low", 0.25, 0.5)
    from .conftest import tiny_llama

    assert all(c.rule == rule for c in make_eviction_cache(tiny_llama(layers=2), config))


def test_stratify_left_unset_follows_the_rule_that_runs():
    # 0.7 under the question rule given by name; all but 0.05 of the slots carry and spread leave where
    # they leave less (0.95 - 0.5 = 0.45); 0 under any other rule and for a rule object without a Stratify
    from knorm_gen.eviction.config import make_configs
    from knorm_gen.eviction.rules.norm import Low

    assert EvictionConfig().stratify == 0.7
    assert EvictionConfig(carry=0.5).stratify == 0.45 and EvictionConfig(spread=0.25).stratify == 0.45
    assert EvictionConfig(keep="low").stratify == 0.0 and EvictionConfig(keep=Question()).stratify == 0.0
    assert EvictionConfig(keep=Low(), stratify=0.3).stratify == 0.3
    # on top of a given config (a row's override): an unset stratify follows the new rule, a set one stays
    base, _ = make_configs()
    assert make_configs(eviction=base, keep="low")[0].stratify == 0.0
    assert make_configs(eviction=base, carry=0.5)[0].stratify == 0.45
    assert make_configs(eviction=base, keep="low", stratify=0.2)[0].stratify == 0.2
    with pytest.raises(ValueError, match="carry \\+ spread \\+ stratify must be below 1"):
        EvictionConfig(carry=0.25, stratify=0.8)
