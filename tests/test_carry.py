"""keep="question_carry": a layer after the first keeps a share of its rule's slots for
the positions the earlier such layers scored best, checked against a float64 numpy run
of the same selection, block by block."""

import mlx.core as mx
import numpy as np
import pytest

from knorm_gen import EvictionConfig, question
from knorm_gen.cache import EvictionKVCache, make_eviction_cache, pin_caches, set_probe
from knorm_gen.question import LOCAL, PER_QUERY_LOCAL

from .conftest import random_tokens
from .test_question import reference_scores
from .test_scores import both_reference, per_query_reference

REFERENCE = {  # each rule's float64 scores of one block (1, H, N), higher kept first
    "question_carry": lambda keys, q, pieces: reference_scores(keys, q, [list(pieces)], LOCAL),
    "question_per_query_carry": lambda keys, q, pieces: per_query_reference(keys, q, pieces, PER_QUERY_LOCAL),
    "question_both_carry": both_reference,
}

T, BUDGET, N_SINK, RECENT = 64, 24, 3, 4


def probe(heads, dim, seed):
    rng = np.random.default_rng(200 + seed)
    q = rng.normal(size=(1, heads, 6, dim))
    return (q / np.linalg.norm(q, axis=-1, keepdims=True)).astype(np.float32)


def numpy_carry_run(layers, pieces, splits, share, keep="question_carry"):
    """Kept positions per layer and head of question_carry layers ``layers`` (each
    ``(keys (1, H, T, D), queries)``), fed block by block as a forward pass feeds them:
    each block scored by the float64 question reference, each layer's best standardised
    score per position (over its heads; the mean and spread of every scored position so
    far, the sinks left out) on a board, and each layer after the first keeping
    ``share`` of its rule slots for the best of the earlier layers' boards."""
    heads = layers[0][0].shape[1]
    held = [[set() for _ in range(heads)] for _ in layers]
    own = [np.full((heads, T), np.nan) for _ in layers]
    boards = [np.full(T, -np.inf) for _ in layers]
    stats = [np.zeros((heads, 3)) for _ in layers]
    slots = int(share * (BUDGET - N_SINK - RECENT))
    start = 0
    for size in splits:
        block = np.arange(start, start + size)
        seen = start + size
        for li, (keys, q) in enumerate(layers):
            s = REFERENCE[keep](keys[:, :, block], q, pieces[block])[0]
            own[li][:, block] = s
            ok = block >= N_SINK
            stats[li] += np.stack([ok.sum() * np.ones(heads), s[:, ok].sum(-1), (s[:, ok] ** 2).sum(-1)], -1)
            mean = stats[li][:, 1] / stats[li][:, 0]
            sd = np.sqrt(stats[li][:, 2] / stats[li][:, 0] - mean ** 2)
            boards[li][block] = np.where(ok, ((s - mean[:, None]) / sd[:, None]).max(0), -np.inf)
            carry = np.max(boards[:li], axis=0) if li else None
            for h in range(heads):
                cand = held[li][h] | set(block.tolist())
                if len(cand) <= BUDGET:
                    held[li][h] = cand
                    continue
                protected = {p for p in cand if p < N_SINK or p >= seen - RECENT}
                rest = cand - protected
                carried = set(sorted(rest, key=lambda p: (-carry[p], p))[:slots]) if li else set()
                others = sorted(rest - carried, key=lambda p: (-own[li][h, p], p))
                held[li][h] = protected | carried | set(others[: BUDGET - len(protected) - len(carried)])
        start = seen
    return [[sorted(h) for h in layer] for layer in held], boards


def cache_run(layers, pieces, splits, keep):
    caches = [EvictionKVCache(BUDGET, N_SINK, RECENT, keep) for _ in layers]
    set_probe(caches, [(mx.array(q), mx.array(pieces)[None]) for _, q in layers])
    start = 0
    for size in splits:
        for c, (keys, _) in zip(caches, layers):
            block = mx.array(keys[:, :, start : start + size])
            c.update_and_fetch(block, block)
        start += size
    return caches


@pytest.mark.parametrize("splits", [[T], [16, 16, 32], [20, 9, 35]])
@pytest.mark.parametrize("share", [0.25, 0.5])
@pytest.mark.parametrize("keep", list(REFERENCE))
def test_question_carry_keeps_the_earlier_layers_best_as_a_numpy_run_does(keep, splits, share, monkeypatch):
    monkeypatch.setattr(question, "CARRY_SHARE", share)
    rng = np.random.default_rng(7)
    layers = [(rng.normal(size=(1, 2, T, 8)).astype(np.float32), probe(2, 8, i)) for i in range(3)]
    pieces = np.cumsum(rng.random(T) < 0.3)
    want, boards = numpy_carry_run(layers, pieces, splits, share, keep)
    caches = cache_run(layers, pieces, splits, keep)
    for li, c in enumerate(caches):
        np.testing.assert_allclose(np.array(c.carry_board)[0], boards[li], rtol=1e-4, atol=1e-4)
        got = np.array(c.ordered_state()[2])[0]
        for h in range(2):
            assert list(got[h]) == want[li][h], (li, h)
    # The carried share changed what the later layers keep (else this test could not fail).
    plain, _ = numpy_carry_run(layers, pieces, splits, 0.0, keep)
    assert plain[0] == want[0] and any(plain[li] != want[li] for li in (1, 2))


@pytest.mark.parametrize("spans,pinned", [(((4, 280),), 20), (None, 0)])
def test_question_carry_stays_within_its_budget_and_drops_the_board_when_pinned(tiny_model, spans, pinned):
    # Through a model's forward pass: three layers linked in order, each holding its budget plus the
    # pinned tokens after blocks and decode steps (which carry nothing), the board gone once pinned.
    ids = random_tokens(300, seed=3).tolist()
    caches = make_eviction_cache(tiny_model, EvictionConfig(keep="question_carry", budget=48),
                                 spans or ((0, 1 << 62),))
    pieces = mx.array(np.cumsum(np.random.default_rng(1).random(400) < 0.3))[None]
    set_probe(caches, [(mx.array(probe(2, 16, i)), pieces) for i in range(len(caches))])
    assert [len(c.carry_from) for c in caches] == [0, 1, 2]
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
    assert all(c.carry_board is None and c.carry_from is None for c in caches)
