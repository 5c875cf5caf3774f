"""The eviction rules as data: one small scoring function per ``keep`` mode.

A score function maps a block of keys ``(B, H, N, D)``, their absolute
positions ``(B, 1, N)`` and the rule's running reference (the anchor
``(B, H, 1, D)``, or leverage's state; None for the other rules) to one float32
per token ``(B, H, N)``; **lower is kept first**. The caches share one selection
machinery on top (pack, then partition or argmax), so a new rule is one
function and one table entry, and the parametrised tests in
``tests/test_scores.py`` cover it the day it is added.

The anchor is what KeyDiff (arXiv:2504.15364) compares a key with: the mean
unit-length key of the (row, head), kept as cache state: a running sum of the
unit keys of every token the row has seen (evicted ones included), divided by
their count. Every block of more than one token first re-scores the keys held
against the anchor that includes the block, then scores the block against it,
so one selection never compares scores made against different anchors. (Scored
only at insertion, the first 512-token block of a pass-key prompt on Gemma 3
was scored against its own mean, which shares its positions' RoPE phase, and
lost its needle where a one-block prefill kept it.) A decode token is scored
against the running anchor when it arrives. A whole document prefilled in one
block is scored against the document's mean (KeyDiff's own setting); in blocks,
tokens evicted early were judged against fewer keys, so the anchored rules
depend on the block size (the others do not). Only the rules in
:data:`ANCHORED` pay for it (a normalise and a sum per block, and the held keys
re-scored); the others get ``anchor=None``.

``leverage`` works the same way with a richer running state (see
:func:`score_leverage`): the rules in :data:`RUNNING` keep per-(row, head)
state over every token seen, updated by :func:`running_update` and read by
:func:`running_reference`, and the caches treat them alike.

``question`` (:data:`PROBED`) is the one rule that looks outside the keys: it
scores them against a probe of the job's own instructions, made before the
document is read (:mod:`knorm_gen.question`); its reference is that probe, fixed,
so held keys are never re-scored. ``question_carry`` (:data:`CARRIED`) scores the same way;
its layers share what they scored best (:func:`carry_values`), and each later one keeps
a share of its slots for that (:func:`carry_tier`).
"""

from __future__ import annotations

import warnings
from typing import Callable, Optional, Sequence

import mlx.core as mx

from .question import PER_QUERY_LOCAL, REPEAT_PENALTY, question_scores

ScoreFn = Callable[[mx.array, mx.array, Optional[mx.array]], mx.array]

BLEND_WEIGHT = 0.5
"""``blend``'s weight on ln|k| beside KeyDiff's cosine, chosen so the two terms
spread alike on the embedded model: over 2,048 tokens of pydoc text, across the
heads of its 30 layers, the standard deviation of the cosine to the anchor is
0.051 on average and that of ln|k| 0.110 (ratio 0.46). On Gemma 3 270M the
same ratio is 1.31, so there the cosine weighs about 2.8x more."""


def _squared_norm(keys: mx.array) -> mx.array:
    # Squared, so no sqrt: the order is the norm's. Float32 whatever the cache dtype.
    return mx.sum(mx.square(keys.astype(mx.float32)), axis=-1)


def unit_keys(keys: mx.array) -> mx.array:
    """Keys scaled to unit length, float32 (a zero key stays zero)."""
    return keys.astype(mx.float32) * mx.rsqrt(mx.maximum(_squared_norm(keys), 1e-30))[..., None]


def score_low(keys: mx.array, positions: mx.array, anchor: Optional[mx.array] = None) -> mx.array:
    """The paper's rule: a low key norm predicts high attention, so keep it."""
    return _squared_norm(keys)


def score_high(keys: mx.array, positions: mx.array, anchor: Optional[mx.array] = None) -> mx.array:
    """The paper's ablation: keep the highest norms."""
    return -_squared_norm(keys)


def score_random(keys: mx.array, positions: mx.array, anchor: Optional[mx.array] = None) -> mx.array:
    """A baseline blind to the keys (reproducible through ``mx.random.seed``)."""
    return mx.random.uniform(shape=keys.shape[:3], dtype=mx.float32)


def score_recent(keys: mx.array, positions: mx.array, anchor: Optional[mx.array] = None) -> mx.array:
    """StreamingLLM: with the sinks, keep the most recent tokens."""
    return mx.broadcast_to(-positions.astype(mx.float32), keys.shape[:3])


def _cosine_to_anchor(keys: mx.array, anchor: mx.array) -> mx.array:
    return mx.sum(unit_keys(keys) * unit_keys(anchor), axis=-1)


def score_keydiff(keys: mx.array, positions: mx.array, anchor: Optional[mx.array] = None) -> mx.array:
    """KeyDiff: keep the keys least like the head's mean direction (coverage of
    what the document says, not of what draws attention)."""
    return _cosine_to_anchor(keys, anchor)


def score_blend(keys: mx.array, positions: mx.array, anchor: Optional[mx.array] = None) -> mx.array:
    """KeyDiff's cosine plus :data:`BLEND_WEIGHT` x ln|k|: a key is kept for being
    unlike the rest or for a low norm (the paper's signal), the two traded off."""
    return _cosine_to_anchor(keys, anchor) + (0.5 * BLEND_WEIGHT) * mx.log(
        mx.maximum(_squared_norm(keys), 1e-30))


LEVERAGE_RIDGE = 1e-2
"""``leverage``'s ridge, relative: λ = LEVERAGE_RIDGE x trace(C) / D, a hundredth of
the mean variance per dimension of the keys seen. Relative, so the score does not
depend on the keys' scale, and a direction in which the keys barely vary does not
rank them by noise. It bounds the matrix's condition number by D / LEVERAGE_RIDGE
+ 1, which keeps float32 within float64's reach: on the embedded model's keys
(layers 2-29, 2,048 tokens in 512-token blocks, or one block and 1,536 decode
steps) the scores differed by at most 3e-6 (relative), on synthetic anisotropic
keys of D = 64 and 256 by at most 5e-5 (``benchmarks/bench_rules.py`` prints it);
a ridge of 1e-3 let the latter reach 2e-4."""

LEVERAGE_REFRESH = 256
"""Decode steps update ``leverage``'s inverse in O(D^2) (Sherman-Morrison, λ held);
at a row's positions 1, 2, 4, ..., 128 and every multiple of this many it is
computed afresh instead, λ re-set from the trace, so λ follows the keys as a
decode grows and the rank-one updates cannot drift for long (they did not
measurably: 1,536 of them stayed within 5e-5 of float64 on D = 256 keys)."""


def score_leverage(keys: mx.array, positions: mx.array, anchor: Optional[mx.array] = None) -> mx.array:
    """Statistical leverage (Compactor, arXiv:2507.08143): keep the keys least
    explained by the head's other keys, ``(k - μ)^T (C + λI)^-1 (k - μ)`` with
    ``C`` the scatter of every key the row has seen about their mean ``μ`` (the
    leverage of a regression with an intercept, less the 1/n every key shares).
    Negated: high leverage, a key unlike the rest, is kept first.

    Centred (as Compactor's reference code centres), so a key is judged by how it
    departs from the head's mean: keys share an offset (on the embedded model its
    squared norm is 0.5-1.8x the keys' whole variance, ten times their largest
    direction of variance), which uncentred would be the dominant direction of
    K^T K and would raise a ridge relative to the trace 1.5-2.8x, muting the
    spread that tells keys apart. Not normalised: the keys' scale is information
    the leverage weighs per direction (and the one the paper's rule uses); a
    rule on directions alone is ``keydiff``. Scored on the keys as cached (after
    RoPE; the cache never sees them before). Float32 from float32 keys, on a
    scatter matrix per (row, KV head): a block costs O(N D^2) plus an O(D^3)
    inverse, a decode step O(D^2) (:data:`LEVERAGE_REFRESH`). ``anchor`` is the
    running state (:func:`running_update`): C, its regularised inverse P and μ."""
    d = keys.shape[-1]
    inv, mean = anchor[..., d : 2 * d, :], anchor[..., 2 * d :, :]
    x = keys.astype(mx.float32) - mean
    return -mx.sum((x @ inv) * x, axis=-1)


def score_question(keys: mx.array, positions: mx.array, anchor: Optional[tuple] = None,
                   per_query: Optional[bool] = None, local: Optional[int] = None) -> mx.array:
    """Minus the attention the job's instructions would give the key: ``anchor`` is
    the probe ``(queries (B, H, M, D), pieces (B, P)[, repeated (B, P)])`` of
    :func:`knorm_gen.question.make_probe`; the score is :func:`knorm_gen.question.question_scores`
    with each token in its sentence piece (a position past the probed prompt, a generated
    token, is a piece of its own), less :data:`~knorm_gen.question.REPEAT_PENALTY` in a
    piece that repeats an earlier one (``per_query``, ``local``: as :func:`question_scores`). Static: it
    depends on the key and the probe only."""
    if anchor is None:
        raise ValueError("keep='question' scores keys against a probe of the job's instructions, and this cache has "
                         "none: run it through generate_with_eviction, answer_questions or knorm-batch, which probe "
                         "first, or set one with knorm_gen.cache.set_probe")
    queries, pieces, *repeated = anchor  # a probe made by hand may leave ``repeated`` out
    pos = positions[:, 0, :].astype(mx.int64)  # (B, N)
    last = pieces.shape[-1] - 1
    inside = mx.take_along_axis(pieces, mx.minimum(pos, last), axis=-1)
    seg = mx.where(pos <= last, inside, pieces[:, last:] + pos - last)
    s = question_scores(keys, queries, seg, local=local, per_query=per_query)
    if not repeated:
        return -s
    again = mx.logical_and(pos <= last, mx.take_along_axis(repeated[0], mx.minimum(pos, last), axis=-1))
    return -mx.where(again[:, None, :], s - REPEAT_PENALTY, s)


def score_question_per_query(keys: mx.array, positions: mx.array, anchor: Optional[tuple] = None) -> mx.array:
    """:func:`score_question` with each probe query's own mean within
    :data:`~knorm_gen.question.PER_QUERY_LOCAL` positions taken out before the best query is
    taken (0.9.2; a reach of 128 since 0.9.3): a query that scores whole regions high no
    longer decides the selection alone.
    On Gemma 3 it kept more keys than ``question``, on SmolLM2 fewer (docs/results.md);
    0.11's default was it carrying (:func:`score_question_per_query_carry`)."""
    return score_question(keys, positions, anchor, per_query=True, local=PER_QUERY_LOCAL)


def score_question_carry(keys: mx.array, positions: mx.array, anchor: Optional[tuple] = None) -> mx.array:
    """:func:`score_question`, the same score per key (0.10): what differs is the cache's
    selection. In a prompt's caches a ``question_carry`` layer after the first keeps a
    share (:data:`~knorm_gen.question.CARRY_SHARE`) of its rule's slots for the positions
    the earlier such layers scored best (:func:`carry_tier`); alone it is ``question``."""
    return score_question(keys, positions, anchor)


def score_question_per_query_carry(keys: mx.array, positions: mx.array, anchor: Optional[tuple] = None) -> mx.array:
    """:func:`score_question_per_query`, its layers carrying like ``question_carry``'s (0.10;
    0.11's default)."""
    return score_question_per_query(keys, positions, anchor)


def score_question_both_carry(keys: mx.array, positions: mx.array, anchor: Optional[tuple] = None) -> mx.array:
    """The mean of :func:`score_question`'s and :func:`score_question_per_query`'s scores (each
    with its sentence pieces and repeats), its layers carrying like ``question_carry``'s
    (the default since 0.12). On SmolLM2 the per-query scores alone dropped a
    key sentence from most heads of the later layers where ``question``'s kept it
    (docs/results.md); the mean keeps a piece that either ranks high."""
    return 0.5 * (score_question(keys, positions, anchor) + score_question_per_query(keys, positions, anchor))


SCORES: dict[str, ScoreFn] = {
    "low": score_low,
    "high": score_high,
    "random": score_random,
    "recent": score_recent,
    "keydiff": score_keydiff,
    "blend": score_blend,
    "leverage": score_leverage,
    "question": score_question,
    "question_per_query": score_question_per_query,
    "question_carry": score_question_carry,
    "question_per_query_carry": score_question_per_query_carry,
    "question_both_carry": score_question_both_carry,
}

ANCHORED = frozenset({"keydiff", "blend"})
"""The rules that score against the running anchor (block-size dependent, see above)."""

PROBED = frozenset({"question", "question_per_query", "question_carry", "question_per_query_carry",
                    "question_both_carry"})
"""The rules that score against a probe of the job's instructions, set before the
prefill (:func:`knorm_gen.cache.set_probe`) and fixed; the caches hand it over as
the anchor and never re-score held keys."""

CARRIED = frozenset({"question_carry", "question_per_query_carry", "question_both_carry"})
"""The probed rules whose layers share a board in one prompt's caches (:func:`knorm_gen.cache.set_probe`):
each writes its best standardised score per position (:func:`carry_values`), and each after the first
keeps a share of its slots for the best of the earlier ones' (:func:`carry_tier`)."""

RUNNING = ANCHORED | {"leverage"}
"""The rules with running state over every token seen: a block of more than one
token updates it, then the held keys are re-scored against it with the block."""


def anchor_sum(keys: mx.array, real: Optional[mx.array] = None) -> mx.array:
    """``(B, H, D)``: the sum of a block's unit keys over its real tokens
    (``real``: tokens per row; right padding after them is left out)."""
    unit = unit_keys(keys)
    if real is not None:
        valid = mx.arange(keys.shape[2])[None, :] < real.reshape(-1, 1)
        unit = unit * valid[:, None, :, None]
    return mx.sum(unit, axis=2)


def running_anchor(total: mx.array, seen: mx.array | int) -> mx.array:
    """``(B, H, 1, D)`` anchor from the running sum of unit keys and the tokens seen."""
    count = mx.maximum(mx.array(seen, dtype=mx.float32).reshape(-1, 1, 1), 1.0)
    return (total / count)[:, :, None, :]


def _refreshes(seen: int) -> bool:
    """Whether a decode step that brings a row to ``seen`` tokens computes leverage's inverse afresh."""
    return seen & (seen - 1) == 0 or seen % LEVERAGE_REFRESH == 0


def leverage_inverse(scatter: mx.array, mean: mx.array) -> mx.array:
    """``(C + λI)^-1`` for scatter matrices ``(..., D, D)``: λ = :data:`LEVERAGE_RIDGE`
    / D x trace(C), or x 1e-6 |μ|^2 where that is larger (identical keys then leave
    no singular matrix). Float32, on the CPU stream (MLX's factorisations have no
    GPU kernel); by Cholesky, as the matrix is symmetric positive definite."""
    d = scatter.shape[-1]
    trace = mx.sum(mx.diagonal(scatter, axis1=-2, axis2=-1), axis=-1)
    lam = LEVERAGE_RIDGE / d * mx.maximum(trace, 1e-6 * mx.sum(mx.square(mean), axis=-1))
    lam = mx.maximum(lam, 1e-30)[..., None, None]
    ridged = scatter + lam * mx.eye(d, dtype=mx.float32)
    inv = mx.linalg.cholesky_inv(mx.linalg.cholesky(ridged, stream=mx.cpu), stream=mx.cpu)
    return 0.5 * (inv + mx.swapaxes(inv, -1, -2))


def _leverage_update(state: Optional[mx.array], keys: mx.array, seen: Sequence[int], real: Sequence[int]) -> mx.array:
    # Chan et al.'s pairwise update of a mean and a scatter matrix: the block's own
    # scatter about its own mean, plus the shift between the two means. Unlike
    # K^T K - n mu mu^T, no large offset cancels in float32.
    b, h, n, d = keys.shape
    if state is None:
        state = mx.zeros((b, h, 2 * d + 1, d), mx.float32)
    scatter, inv, mean = state[..., :d, :], state[..., d : 2 * d, :], state[..., 2 * d, :]
    before = mx.array(seen, dtype=mx.float32).reshape(b, 1, 1)
    if all(r == 1 for r in real):  # decode: the same arithmetic as below with a one-token block, fewer ops
        total = before + 1.0
        shift = keys[:, :, 0, :].astype(mx.float32) - mean
        weight = (before / total)[..., None]
        new_scatter = scatter + weight * (shift[..., :, None] * shift[..., None, :])
        new_mean = mean + shift * (1.0 / total)
    else:
        count = mx.array(real, dtype=mx.float32).reshape(b, 1, 1)
        valid = (mx.arange(n)[None, :] < mx.array(real).reshape(b, 1))[:, None, :, None]
        x = mx.where(valid, keys.astype(mx.float32), 0.0)
        block_mean = mx.sum(x, axis=2) / mx.maximum(count, 1.0)
        xc = mx.where(valid, x - block_mean[:, :, None, :], 0.0)
        total = mx.maximum(before + count, 1.0)
        shift = block_mean - mean
        weight = (before * count / total)[..., None]
        new_scatter = scatter + mx.swapaxes(xc, -1, -2) @ xc + weight * (shift[..., :, None] * shift[..., None, :])
        new_mean = mean + shift * (count / total)
    fresh = [r > 1 or (r == 1 and _refreshes(s + 1)) for s, r in zip(seen, real)]
    rank_one = [r == 1 and not f for r, f in zip(real, fresh)]
    new_inv = inv
    if any(rank_one):  # Sherman-Morrison: (A + u u^T)^-1 = P - (P u)(P u)^T / (1 + u^T P u)
        u = mx.sqrt(weight[..., 0]) * shift
        pu = (u[..., None, :] @ inv)[..., 0, :]
        scale = pu / (1.0 + mx.sum(u * pu, axis=-1, keepdims=True))
        updated = inv - pu[..., :, None] * scale[..., None, :]
        new_inv = updated if all(rank_one) else mx.where(mx.array(rank_one).reshape(b, 1, 1, 1), updated, inv)
    if any(fresh):
        again = leverage_inverse(new_scatter, new_mean)
        new_inv = again if all(fresh) else mx.where(mx.array(fresh).reshape(b, 1, 1, 1), again, new_inv)
    return mx.concatenate([new_scatter, new_inv, new_mean[..., None, :]], axis=-2)


def running_update(keep: str, state: Optional[mx.array], keys: mx.array, seen: Sequence[int] | int,
                   real: Optional[Sequence[int]] = None) -> mx.array:
    """The running state of a rule in :data:`RUNNING` after a block of keys
    ``(B, H, N, D)``: ``seen`` tokens per row before it (an int for one row),
    ``real`` tokens per row in it (right padding after them is left out).
    ``state`` None: nothing seen yet. Anchored rules: the sum of unit keys
    ``(B, H, D)``. ``leverage``: ``(B, H, 2D + 1, D)``, the scatter matrix C of the
    keys seen about their mean, the inverse P = (C + λI)^-1, and the mean μ; a
    block of more than one token computes P afresh, a single token updates it."""
    b, _, n, _ = keys.shape
    seen = [seen] * b if isinstance(seen, int) else [int(s) for s in seen]
    real = [n] * b if real is None else [int(r) for r in real]
    if keep == "leverage":
        return _leverage_update(state, keys, seen, real)
    part = anchor_sum(keys, None if real == [n] * b else mx.array(real))
    return part if state is None else state + part


def running_reference(keep: str, state: mx.array, seen: Sequence[int] | int) -> mx.array:
    """What the rule's score compares keys with, from its running state and the
    tokens seen per row: the anchor (:func:`running_anchor`), or leverage's state."""
    return state if keep == "leverage" else running_anchor(state, seen)


def running_zeros(keep: str, batch: int, heads: int, dim: int) -> mx.array:
    """The running state of rows that have seen nothing."""
    shape = (batch, heads, 2 * dim + 1, dim) if keep == "leverage" else (batch, heads, dim)
    return mx.zeros(shape, mx.float32)

# ---- the selection arithmetic both caches share ---------------------------------
# One int64 per token: (order-preserving integer of the float32 score) << 32 | position,
# so one integer compare ranks by score and breaks ties by the earlier position.
# Protected tokens (sinks, the recent window) get PROTECTED + position: below any score.
# Empty and padding slots of a batch cache get PAD: above any score, never kept.
_POS_SHIFT = 1 << 32
_POS_MASK = (1 << 32) - 1
PROTECTED = -(1 << 63)
# Coverage tokens rank above every protected one and below any real score (the
# lowest finite float32, -inf, packs to about -(2**31 - 2**23) << 32).
COVERED = PROTECTED + (1 << 34)
# Carried tokens (:func:`carry_tier`) rank after the coverage ones and before any real score.
CARRIED_TIER = COVERED + (1 << 33)
_SCORED = CARRIED_TIER + (1 << 33)  # every rank at or above it packs a real score
PAD = (1 << 63) - 1
NO_END = 1 << 62  # the end of a span that runs on for ever
ALL_EVICTABLE: tuple = ((0, NO_END),)
"""The spans of a row with nothing pinned: every position may be evicted (the sinks aside)."""
STEP = 256  # buffers grow in steps of this many slots (as mlx_lm's KVCache does)


def _flip_negatives(bits: mx.array) -> mx.array:
    """Reverse the order of the negative int64 ``bits`` (a float32's sign-magnitude bits);
    its own inverse, so it both packs and unpacks."""
    return mx.where(bits < 0, -bits - (1 << 31) - 1, bits)


def _ordered_bits(score: mx.array) -> mx.array:
    """float32 -> int64 in [-2**31, 2**31) with the same order (IEEE-754 sign-magnitude)."""
    return _flip_negatives(mx.view(score.astype(mx.float32), mx.int32).astype(mx.int64))


def unpack_scores(rank: mx.array) -> mx.array:
    """The float32 scores packed in ranks (:func:`pack_ranks`); meaningless where
    :func:`scored` is False (pinned, protected, covered, carried or PAD)."""
    return mx.view(_flip_negatives(mx.right_shift(rank, 32)).astype(mx.int32), mx.float32)


def scored(rank: mx.array) -> mx.array:
    """Whether each rank packs a rule's score (not a pinned, protected, covered, carried or PAD one)."""
    return mx.logical_and(rank >= _SCORED, rank != PAD)


def pack_ranks(score: mx.array, positions: mx.array, n_sink: int, spans: Optional[mx.array] = None) -> mx.array:
    """int64 ranks of a block; ``positions`` broadcast against ``score``. Positions
    outside ``spans`` (:func:`span_array`; None: none) are pinned like the sinks."""
    pos = positions.astype(mx.int64)
    rank = _ordered_bits(score) * _POS_SHIFT + pos
    protected = pos < n_sink if n_sink else None
    if spans is not None:
        outside = mx.logical_not(in_spans(pos, spans))
        protected = outside if protected is None else mx.logical_or(protected, outside)
    if protected is not None:
        rank = mx.where(protected, PROTECTED + pos, rank)
    return rank


UNPROBED_FALLBACK = "low"
"""The rule a ``keep="question"`` layer ranks by when it has no probe (a cache made
with :func:`knorm_gen.make_eviction_cache` and driven by a plain mlx_lm loop): the
paper's key norm, the one intrinsic rule with no running state to have missed."""

UNPROBED_WARNING = ("keep='question' has no probe of the job's instructions in this cache, so it keeps the "
                    "lowest-norm keys (keep='low') instead: probe it first with knorm_gen.probe_caches(caches, "
                    "model, tokenizer, prompt) (generate_with_eviction, answer_questions and knorm-batch do), or "
                    "choose a rule that needs no probe (--preset intrinsic)")


def block_ranks(keep: str, n_sink: int, keys: mx.array, start: mx.array | int,
                anchor: Optional[mx.array] = None, spans: Optional[mx.array] = None,
                pinned: bool = False) -> mx.array:
    """Ranks of a block of keys ``(B, H, N, D)`` whose first token sits at absolute
    position ``start`` (an int, or one per batch row); ascending = kept first.
    ``anchor`` (:func:`running_reference`) is needed by the rules in :data:`RUNNING`,
    the probe by those in :data:`PROBED` (without one, they rank by
    :data:`UNPROBED_FALLBACK` and warn once); positions outside ``spans`` are pinned.
    ``pinned``: the caller knows every position of the block is pinned
    (:func:`evictable_from`): no score is needed, and no warning is due."""
    if keep in RUNNING and anchor is None:
        raise ValueError(f"keep={keep!r} scores against its running state: pass it (running_reference)")
    first = mx.array(start, dtype=mx.int64).reshape(-1, 1, 1)
    positions = first + mx.arange(keys.shape[2], dtype=mx.int64)[None, None, :]
    if keep in PROBED and anchor is None:  # no probe (dropped when pinned): fine while every position is pinned
        if pinned:
            return pack_ranks(mx.zeros(keys.shape[:3], mx.float32), positions, n_sink, spans)
        warnings.warn(UNPROBED_WARNING, stacklevel=2)
        keep = UNPROBED_FALLBACK
    return pack_ranks(SCORES[keep](keys, positions, anchor), positions, n_sink, spans)


def rescore(keep: str, n_sink: int, keys: mx.array, rank: mx.array, anchor: mx.array,
            spans: Optional[mx.array] = None) -> mx.array:
    """Ranks of held ``keys`` (their positions packed in ``rank``) scored again
    against ``anchor``; PAD slots stay PAD, pinned positions stay pinned."""
    positions = rank_positions(rank)
    new = pack_ranks(SCORES[keep](keys, positions, anchor), positions, n_sink, spans)
    return mx.where(rank == PAD, rank, new)


# ---- pinned positions: what is not the document -----------------------------------
# A row's *spans* are the position ranges [start, end) that may be evicted (the
# document); every position outside them (the chat template, the system turn, a
# question, the answer) is pinned and held on top of the budget.

Spans = tuple  # tuple[tuple[int, int], ...], sorted, disjoint


def check_spans(spans) -> Spans:
    """``spans`` as a sorted tuple of ``(start, end)`` integer pairs, or ValueError."""
    try:
        out = tuple((int(a), int(b)) for a, b in spans)
    except (TypeError, ValueError):
        raise ValueError(f"spans must be (start, end) pairs of positions, got {spans!r}") from None
    last = 0
    for a, b in out:
        if a < last or b < a:
            raise ValueError(f"spans must be sorted, disjoint (start, end) pairs with start <= end, got {spans!r}")
        last = b
    return out


def pinned_count(spans: Spans, n_sink: int, seen: int) -> int:
    """Positions before ``seen`` that are pinned by ``spans`` and are not sinks: the
    tokens a row holds on top of its budget."""
    outside = max(seen - n_sink, 0)
    for a, b in spans:
        lo, hi = max(a, n_sink), min(b, seen)
        if hi > lo:
            outside -= hi - lo
    return outside


def pin_from(spans: Spans, at: int) -> Spans:
    """``spans`` with every position from ``at`` on pinned."""
    return tuple((a, min(b, at)) for a, b in spans if a < at)


def evictable_from(spans: Spans, at: int) -> bool:
    """Whether any position from ``at`` on lies in ``spans`` (may be evicted)."""
    return any(b > at for _, b in spans)


def open_ended(spans: Spans) -> bool:
    """Whether every position from some point on is pinned (a question and its answer):
    the row then grows by every token it is fed."""
    return not spans or spans[-1][1] < NO_END


def span_array(rows: Sequence[Spans]) -> Optional[mx.array]:
    """``(B, S, 2)`` int64 spans of each row (padded with empty spans), or None when
    no row pins anything (every position evictable)."""
    if all(s == ALL_EVICTABLE for s in rows):
        return None
    width = max(1, max(len(s) for s in rows))
    padded = [list(s) + [(NO_END, NO_END)] * (width - len(s)) for s in rows]
    return mx.array(padded, dtype=mx.int64)


def in_spans(positions: mx.array, spans: mx.array) -> mx.array:
    """Whether each position ``(B, ..., N)`` lies inside one of its row's spans ``(B, S, 2)``."""
    shape = (spans.shape[0],) + (1,) * (positions.ndim - 1) + (spans.shape[1],)
    start, end = spans[..., 0].reshape(shape), spans[..., 1].reshape(shape)
    pos = positions[..., None]
    return mx.any(mx.logical_and(pos >= start, pos < end), axis=-1)


def rank_positions(rank: mx.array) -> mx.array:
    """The absolute position packed in each rank."""
    return mx.bitwise_and(rank, _POS_MASK).astype(mx.int32)


def protect_recent(rank: mx.array, first_recent: mx.array | int) -> mx.array:
    """Ranks with every position at or after ``first_recent`` protected from eviction."""
    pos = rank_positions(rank)
    return mx.where(pos >= first_recent, PROTECTED + pos.astype(mx.int64), rank)


def cover_slots(budget: int, coverage: float, reserved: int = 0) -> int:
    """Slots of a ``budget`` that coverage keeps evenly spread: ``coverage`` of it, but
    always at least one slot left to the rule beside the ``reserved`` ones (sinks and
    the recent window), so a small budget keeps its meaning. The positions covered are
    fewer: the multiples of a power-of-two stride (:func:`coverage_stride`) that fit in
    these slots, between half of them and all; the slots they leave go to the rule."""
    return max(0, min(int(coverage * budget), budget - reserved - 1))


def coverage_stride(seen: int, slots: int) -> int:
    """The smallest power of two ``s`` with at most ``slots`` multiples of ``s`` below
    ``seen``: the spacing of the coverage tokens."""
    s = 1
    while -(-seen // s) > slots:
        s *= 2
    return s


def cover(rank: mx.array, seen: Sequence[int], slots: int) -> mx.array:
    """``rank`` with every position that is a multiple of its row's
    :func:`coverage_stride` ranked before any scored token (coverage: a share of
    the budget spread evenly over the positions seen). As ``seen`` grows the
    stride doubles, so the covered positions are always a subset of those
    covered before: none of them was evicted earlier."""
    stride = mx.array([coverage_stride(s, slots) for s in seen], dtype=mx.int32).reshape(-1, 1, 1)
    pos = rank_positions(rank)
    hit = mx.logical_and(mx.remainder(pos, stride) == 0, rank > COVERED)
    return mx.where(mx.logical_and(hit, rank != PAD), COVERED + pos.astype(mx.int64), rank)


def evict_key(rank: mx.array, seen: mx.array | int, recent: int, cover_slots: int = 0) -> mx.array:
    """What eviction ranks by: ``rank`` with the last ``recent`` of ``seen``
    positions protected (``seen`` an int, or one per batch row) and, with
    ``cover_slots``, the coverage positions next (:func:`cover`); PAD stays PAD."""
    if cover_slots:
        rows = [seen] if isinstance(seen, int) else [int(x) for x in
                                                      (seen.tolist() if isinstance(seen, mx.array) else seen)]
        rank = cover(rank, rows, cover_slots)
    if recent == 0:
        return rank
    first = mx.array(seen, dtype=mx.int64).reshape(-1, 1, 1) - recent
    return mx.where(rank == PAD, rank, protect_recent(rank, first))


def capacity(rows: int, limit: int, grows: bool) -> int:
    """Slots to allocate for ``rows`` held rows: whole steps, but never more than
    the row's limit (budget plus pinned tokens) plus the one spare slot a decode
    step writes into, unless the row ``grows`` (every later token is pinned)."""
    cap = -(-rows // STEP) * STEP
    return cap if grows else max(rows, min(cap, limit + 1))


# ---- carrying: what earlier layers scored best -------------------------------------
def carry_slots(budget: int, share: float, reserved: int = 0) -> int:
    """Slots of a ``budget`` a ``question_carry`` layer keeps for carried positions:
    ``share`` of those left to the rule beside the ``reserved`` ones (sinks, the recent
    window, coverage). Fixed by the budget, so the layer stays bounded as input grows."""
    return int(share * max(budget - reserved, 0))


def carry_values(rank: mx.array, stats: Optional[mx.array]) -> tuple[mx.array, mx.array]:
    """``(values (B, N), stats (B, H, 3))``: a block's best standardised score per position
    over a layer's heads, and the running per-(row, head) count, sum and sum of squares of
    the scores it standardises by (``stats`` those before the block; None: none yet).

    A head's score (minus the packed one: higher kept first) is standardised by the mean and
    spread of every score it has ranked so far, this block's included, over the positions
    that are scored and not in a repeated piece (a repeated piece's score is lowered by
    :data:`~knorm_gen.question.REPEAT_PENALTY`); the rest get -inf."""
    s = -unpack_scores(rank).astype(mx.float32)
    ok = mx.logical_and(scored(rank), s > -0.5 * REPEAT_PENALTY)
    x = mx.where(ok, s, 0.0)
    block = mx.stack([mx.sum(ok.astype(mx.float32), axis=-1), mx.sum(x, axis=-1), mx.sum(x * x, axis=-1)], axis=-1)
    stats = block if stats is None else stats + block
    count = mx.maximum(stats[..., 0:1], 1.0)
    mean = stats[..., 1:2] / count
    spread = mx.sqrt(mx.maximum(stats[..., 2:3] / count - mean * mean, 1e-12))
    z = mx.where(ok, (s - mean) / spread, -mx.inf)
    return mx.max(z, axis=1), stats


def carry_tier(key: mx.array, carry: mx.array, slots: int) -> mx.array:
    """``key`` (:func:`evict_key`) with, per (row, head), the ``slots`` positions of the
    largest ``carry`` value ``(B, S)`` (indexed by position; -inf or past its end: none)
    among those ranked by score moved to the carried tier, ranked before any scored
    token. Re-chosen at every selection, so at most ``slots`` are carried at a time."""
    if slots <= 0 or carry.shape[-1] == 0:
        return key
    pos = rank_positions(key)
    width = carry.shape[-1]
    look = mx.take_along_axis(mx.broadcast_to(carry[:, None, :], key.shape[:2] + (width,)),
                              mx.minimum(pos, width - 1), axis=-1)
    eligible = mx.logical_and(mx.logical_and(scored(key), pos < width), look > -mx.inf)
    # (value, position) packed as a rank, so ties (a sentence piece shares one value) go to the earlier position
    order_key = mx.where(eligible, pack_ranks(-look, pos, 0), PAD)
    if slots < order_key.shape[-1]:
        order = mx.argpartition(order_key, kth=slots - 1, axis=-1)[..., :slots]
    else:
        order = mx.broadcast_to(mx.arange(order_key.shape[-1], dtype=mx.uint32), order_key.shape)
    chosen = mx.take_along_axis(eligible, order, axis=-1)
    at = mx.take_along_axis(pos, order, axis=-1).astype(mx.int64)
    was = mx.take_along_axis(key, order, axis=-1)
    return mx.put_along_axis(key, order, mx.where(chosen, CARRIED_TIER + at, was), axis=-1)
