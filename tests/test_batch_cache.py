"""BatchL2NormKVCache against independent references on identical key tensors:
each row alone in a single-row cache, a numpy ranking, and attention computed
per row with an explicit causal mask."""

import copy

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from knorm_gen import L2NormKVCache
from knorm_gen.cache import BatchL2NormKVCache
from knorm_gen.mlx_compat import own_layer_masks
from knorm_gen.scores import ANCHORED, PAD

from .conftest import tiny_llama
from .test_cache import distinct_norm_keys, kept_positions
from .test_scores import numpy_running_kept

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
        self.singles = [L2NormKVCache(*self.settings) for _ in lengths]
        self.batch = L2NormKVCache.merge(self.singles_empty(len(lengths)))

    def singles_empty(self, n):
        return [L2NormKVCache(*self.settings) for _ in range(n)]

    def chunk(self, sizes):
        """One call: row b gets its next sizes[b] tokens, right-padded to the widest."""
        n = max(sizes)
        blk_k = np.zeros((len(sizes), HEADS, n, DIM), np.float32)
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
            np.testing.assert_allclose(got[b : b + 1, :, :size], want, rtol=1e-5, atol=1e-5)
            self.fed[b] += size
            self.splits[b].append(size)

    def check(self):
        budget, n_sink, recent, keep = self.settings
        for b in range(len(self.fed)):
            row = self.batch.extract(b)
            assert row.offset == self.fed[b] == self.batch.seen[b]
            got = kept_positions(row)
            np.testing.assert_array_equal(got, kept_positions(self.singles[b]))
            if keep in ANCHORED:
                want = numpy_running_kept(self.keys[b][:, :, : self.fed[b]], self.splits[b], *self.settings)
            else:
                want = numpy_kept(self.keys[b][:, :, : self.fed[b]], *self.settings)
            assert [list(g) for g in got[0]] == want
            assert got.max(initial=-1) < self.fed[b]  # padding is never kept
        assert [int(x) for x in np.array(self.batch.offset)] == self.fed


SETTINGS = [(12, 3, 0, "low"), (12, 0, 2, "low"), (10, 2, 3, "high"), (9, 4, 2, "recent"), (16, 4, 2, "low"),
            (12, 3, 2, "keydiff"), (10, 2, 1, "blend")]


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


@pytest.mark.parametrize("keep", ["low", "keydiff"])
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


@pytest.mark.parametrize("keep", ["low", "blend"])
def test_merge_of_used_single_caches_and_deepcopy(keep):
    rng = np.random.default_rng(9)
    settings = (8, 2, 1, keep)
    singles, keys = [], []
    for t, splits in ((20, [15, 1, 1, 1, 1, 1]), (5, [5]), (0, [])):
        k = distinct_norm_keys(max(t, 1), rng, heads=HEADS, dim=DIM)[:, :, :t]
        c = L2NormKVCache(*settings)
        start = 0
        for size in splits:
            c.update_and_fetch(mx.array(k[:, :, start : start + size]), mx.array(k[:, :, start : start + size]))
            start += size
        singles.append(c)
        keys.append(k)
    batch = L2NormKVCache.merge(singles)
    assert type(batch) is BatchL2NormKVCache  # never mlx_lm's plain BatchKVCache
    assert batch.seen == [20, 5, 0] and batch.counts == [8, 5, 0]
    for b, c in enumerate(singles[:2]):
        np.testing.assert_array_equal(kept_positions(batch.extract(b)), kept_positions(c))
    assert batch.extract(2).empty() and batch.extract(2).offset == 0
    clone = copy.deepcopy(batch)
    clone.filter([0])
    assert batch.batch_size == 3 and clone.batch_size == 1
    assert int(np.array(batch.rank).max()) == PAD  # padded slots carry PAD rank


def test_left_padding_is_refused_with_a_clear_message():
    batch = BatchL2NormKVCache(8, 2, 0, "low", batch_size=2)
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
        return [KVCache(), L2NormKVCache(8, 2, 1), L2NormKVCache(8, 2, 1)]

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
