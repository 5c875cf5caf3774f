"""The selection arithmetic every rule shares: ranks, the recent window, coverage, carry.

One int64 per token: (order-preserving integer of the float32 score) << 32 | position,
so one integer compare ranks by score and breaks ties by the earlier position; lower is
kept first. Tiers below any score: pinned and protected tokens (sinks, the recent
window) get :data:`PROTECTED` + position, coverage tokens :data:`COVERED` + position,
carried tokens :data:`CARRIED_TIER` + position, spread tokens :data:`SPREAD_TIER` + position;
empty and padding slots of a batch cache
get :data:`PAD`, above any score, never kept. A row's budget, recent window and the
slots of coverage and carry are per row, so rows of one batch may hold different budgets.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional, Sequence

import mlx.core as mx

from .rules import Rule, make_rule
from .spans import in_spans

_POS_SHIFT = 1 << 32
_POS_MASK = (1 << 32) - 1
PROTECTED = -(1 << 63)
# Coverage tokens rank above every protected one and below any real score (the
# lowest finite float32, -inf, packs to about -(2**31 - 2**23) << 32).
COVERED = PROTECTED + (1 << 34)
CARRIED_TIER = COVERED + (1 << 33)
SPREAD_TIER = CARRIED_TIER + (1 << 32)  # positions spread_tier or stratify_tier promote, after the carried ones
_SCORED = CARRIED_TIER + (1 << 33)  # every rank at or above it packs a real score
PAD = (1 << 63) - 1
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
    outside ``spans`` (:func:`~knorm_gen.eviction.spans.span_array`; None: none) are pinned like the sinks."""
    pos = positions.astype(mx.int64)
    rank = _ordered_bits(score) * _POS_SHIFT + pos
    protected = pos < n_sink if n_sink else None
    if spans is not None:
        outside = mx.logical_not(in_spans(pos, spans))
        protected = outside if protected is None else mx.logical_or(protected, outside)
    if protected is not None:
        rank = mx.where(protected, PROTECTED + pos, rank)
    return rank


def rank_positions(rank: mx.array) -> mx.array:
    """The absolute position packed in each rank."""
    return mx.bitwise_and(rank, _POS_MASK).astype(mx.int32)


UNPROBED_FALLBACK = "low"
"""The rule a probed layer (``keep="question"``) ranks by when it has no probe (a cache
made with :func:`knorm_gen.make_eviction_cache` and driven by a plain mlx_lm loop): the
paper's key norm, the one intrinsic rule with no running state to have missed."""

UNPROBED_WARNING = ("keep='question' has no probe of the job's instructions in this cache, so it keeps the "
                    "lowest-norm keys (keep='low') instead: probe it first with knorm_gen.probe_caches(caches, "
                    "model, tokenizer, prompt) (generate_with_eviction, answer_questions and knorm-batch do), or "
                    "choose a rule that needs no probe (--preset intrinsic)")


def block_ranks(rule: Rule, n_sink: int, keys: mx.array, start: Sequence[int], state: Any = None,
                spans: Optional[mx.array] = None, pinned: bool = False) -> mx.array:
    """Ranks of a block of keys ``(B, H, N, D)`` whose first token sits at absolute
    position ``start[b]`` in row b; ascending = kept first. ``state``: what the rule's
    score reads (its running reference, or the rows' probe); a probed rule without a
    probe ranks by :data:`UNPROBED_FALLBACK` and warns once. ``pinned``: the caller knows
    every position of the block is pinned: no score is needed, and no warning is due."""
    first = mx.array(list(start), dtype=mx.int64).reshape(-1, 1, 1)
    positions = first + mx.arange(keys.shape[2], dtype=mx.int64)[None, None, :]
    if rule.reads_probe and state is None:
        if pinned:
            return pack_ranks(mx.zeros(keys.shape[:3], mx.float32), positions, n_sink, spans)
        warnings.warn(UNPROBED_WARNING, stacklevel=3)
        rule = make_rule(UNPROBED_FALLBACK)
    return pack_ranks(rule.score(keys, positions, state), positions, n_sink, spans)


def rescore(rule: Rule, n_sink: int, keys: mx.array, rank: mx.array, state: Any,
            spans: Optional[mx.array] = None) -> mx.array:
    """Ranks of held ``keys`` (their positions packed in ``rank``) scored again
    against ``state``; PAD slots stay PAD, pinned positions stay pinned."""
    positions = rank_positions(rank)
    new = pack_ranks(rule.score(keys, positions, state), positions, n_sink, spans)
    return mx.where(rank == PAD, rank, new)


# ---- the tiers a layout puts before the rule's scores --------------------------------


def protect_recent(rank: mx.array, first_recent: mx.array) -> mx.array:
    """Ranks with every position at or after ``first_recent`` (per row) protected from eviction."""
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


def cover(rank: mx.array, seen: Sequence[int], slots: Sequence[int]) -> mx.array:
    """``rank`` with every position that is a multiple of its row's
    :func:`coverage_stride` ranked before any scored token (coverage: a share of the
    budget spread evenly over the positions seen; rows with no slots get none). As
    ``seen`` grows the stride doubles, so the covered positions are always a subset of
    those covered before: none of them was evicted earlier."""
    stride = mx.array([coverage_stride(s, n) if n else 1 for s, n in zip(seen, slots)],
                      dtype=mx.int32).reshape(-1, 1, 1)
    pos = rank_positions(rank)
    hit = mx.logical_and(mx.remainder(pos, stride) == 0, rank > COVERED)
    if not all(slots):
        hit = mx.logical_and(hit, mx.array([n > 0 for n in slots]).reshape(-1, 1, 1))
    return mx.where(mx.logical_and(hit, rank != PAD), COVERED + pos.astype(mx.int64), rank)


def evict_key(rank: mx.array, seen: Sequence[int], recent: Sequence[int],
              cover_slots: Sequence[int] = ()) -> mx.array:
    """What eviction ranks by: ``rank`` with each row's last ``recent[b]`` of ``seen[b]``
    positions protected and, with ``cover_slots``, its coverage positions next
    (:func:`cover`); PAD stays PAD."""
    if any(cover_slots):
        rank = cover(rank, seen, cover_slots)
    if not any(recent):
        return rank
    first = mx.array([s - r for s, r in zip(seen, recent)], dtype=mx.int64).reshape(-1, 1, 1)
    return mx.where(rank == PAD, rank, protect_recent(rank, first))


def capacity(rows: int, limit: int, grows: bool) -> int:
    """Slots to allocate for ``rows`` held rows: whole steps, but never more than
    the row's limit (budget plus pinned tokens) plus the one spare slot a decode
    step writes into, unless the row ``grows`` (every later token is pinned)."""
    cap = -(-rows // STEP) * STEP
    return cap if grows else max(rows, min(cap, limit + 1))


# ---- carry: what earlier layers scored best -------------------------------------------


def carry_slots(budget: int, share: float, reserved: int = 0) -> int:
    """Slots of a ``budget`` a carrying layer keeps for carried positions: ``share`` of
    those left to the rule beside the ``reserved`` ones (sinks, the recent window,
    coverage). Fixed by the budget, so the layer stays bounded as input grows."""
    return int(share * max(budget - reserved, 0))


def carry_values(rank: mx.array, stats: Optional[mx.array], repeat_penalty: float) -> tuple[mx.array, mx.array]:
    """``(values (B, N), stats (B, H, 3))``: a block's best standardised score per position
    over a layer's heads, and the running per-(row, head) count, sum and sum of squares of
    the scores it standardises by (``stats`` those before the block; None: none yet).

    A head's score (minus the packed one: higher kept first) is standardised by the mean and
    spread of every score it has ranked so far, this block's included, over the positions
    that are scored and not in a repeated piece (a repeated piece's score is lowered by
    ``repeat_penalty``); the rest get -inf."""
    s = -unpack_scores(rank).astype(mx.float32)
    ok = mx.logical_and(scored(rank), s > -0.5 * repeat_penalty)
    x = mx.where(ok, s, 0.0)
    block = mx.stack([mx.sum(ok.astype(mx.float32), axis=-1), mx.sum(x, axis=-1), mx.sum(x * x, axis=-1)], axis=-1)
    stats = block if stats is None else stats + block
    count = mx.maximum(stats[..., 0:1], 1.0)
    mean = stats[..., 1:2] / count
    spread = mx.sqrt(mx.maximum(stats[..., 2:3] / count - mean * mean, 1e-12))
    z = mx.where(ok, (s - mean) / spread, -mx.inf)
    return mx.max(z, axis=1), stats


def carry_tier(key: mx.array, carry: mx.array, slots: Sequence[int]) -> mx.array:
    """``key`` (:func:`evict_key`) with, per (row, head), the ``slots[b]`` positions of the
    largest ``carry`` value ``(B, S)`` (indexed by position; -inf or past its end: none)
    among those ranked by score moved to the carried tier, ranked before any scored
    token. Re-chosen at every selection, so at most ``slots[b]`` are carried at a time."""
    if max(slots, default=0) <= 0 or carry.shape[-1] == 0:
        return key
    pos = rank_positions(key)
    width = carry.shape[-1]
    look = mx.take_along_axis(mx.broadcast_to(carry[:, None, :], key.shape[:2] + (width,)),
                              mx.minimum(pos, width - 1), axis=-1)
    eligible = mx.logical_and(mx.logical_and(scored(key), pos < width), look > -mx.inf)
    return _promote(key, pos, -look, eligible, slots, CARRIED_TIER)


def _promote(key: mx.array, pos: mx.array, value: mx.array, eligible: mx.array, slots: Sequence[int],
             tier: int) -> mx.array:
    """``key`` with, per (row, head), the ``slots[b]`` eligible positions of the smallest
    ``value`` (ties to the earlier position) ranked in ``tier`` + position."""
    order_key = mx.where(eligible, pack_ranks(value, pos, 0), PAD)
    n, most = order_key.shape[-1], max(slots)
    if len(set(slots)) > 1:  # rows take different counts: the first slots[b] of each row's order
        order = mx.argsort(order_key, axis=-1)
        take = mx.arange(n)[None, None, :] < mx.array(list(slots)).reshape(-1, 1, 1)
        chosen = mx.logical_and(mx.take_along_axis(eligible, order, axis=-1), take)
    else:
        if most < n:
            order = mx.argpartition(order_key, kth=most - 1, axis=-1)[..., :most]
        else:
            order = mx.broadcast_to(mx.arange(n, dtype=mx.uint32), order_key.shape)
        chosen = mx.take_along_axis(eligible, order, axis=-1)
    return _to_tier(key, pos, order, chosen, tier)


def _to_tier(key: mx.array, pos: mx.array, order: mx.array, chosen: mx.array, tier: int) -> mx.array:
    """``key`` with the positions at ``order`` (per row and head) that ``chosen`` marks, in the same
    order, ranked in ``tier`` + position; the others as they were."""
    at = mx.take_along_axis(pos, order, axis=-1).astype(mx.int64)
    was = mx.take_along_axis(key, order, axis=-1)
    return mx.put_along_axis(key, order, mx.where(chosen, tier + at, was), axis=-1)


# ---- spread: a share of each head's slots drawn per head and layer --------------------------


def spread_priority(positions: mx.array, salt: int) -> mx.array:
    """A pseudo-random priority in [0, 2**31) per (row, head, position) of ``positions``
    ``(B, H, N)``: a hash of the position, the KV head and ``salt`` (the layer), so each head
    and layer draws its own positions, the same ones in every run."""
    heads = mx.arange(positions.shape[1], dtype=mx.int64).reshape(1, -1, 1)
    h = positions.astype(mx.int64) * 0x9E3779B1 + heads * 0x85EBCA77 + (salt + 1) * 0xC2B2AE3D
    for shift, factor in ((15, 0x2C1B3C6D), (12, 0x297A2D39), (15, 1)):
        h = mx.bitwise_xor(h, mx.right_shift(h, shift)) * factor
    return mx.bitwise_and(h, (1 << 31) - 1)


def spread_tier(key: mx.array, slots: Sequence[int], salt: int) -> mx.array:
    """``key`` with, per (row, head), the ``slots[b]`` positions of highest
    :func:`spread_priority` among those ranked by score moved to the spread tier, before
    any scored token: a share of each head's slots holds a random choice of its own, as
    random eviction would keep, whatever the rule scores. Re-chosen at every selection
    among the positions held, so at most ``slots[b]`` are spread at a time."""
    if max(slots, default=0) <= 0:
        return key
    pos = rank_positions(key)
    # 24 bits of the priority: exact in the float32 a rank packs
    value = -mx.right_shift(spread_priority(pos, salt), 7).astype(mx.float32)
    return _promote(key, pos, value, scored(key), slots, SPREAD_TIER)


# ---- stratify: a share of each head's slots given out over stretches of the positions seen -----

STRETCHES = 16
"""The most stretches :func:`stratify_tier` splits the positions seen into."""


def stretch_width(seen: int, stretches: int = STRETCHES) -> int:
    """The smallest power of two ``w`` with at most ``stretches`` stretches of ``w`` positions
    below ``seen``: as ``seen`` grows the width doubles, so a stretch is always a union of
    earlier ones."""
    w = 1
    while -(-seen // w) > stretches:
        w *= 2
    return w


def stretch_quotas(seen: int, slots: int, stretches: int = STRETCHES) -> list[int]:
    """Slots each stretch of :func:`stretch_width` gets of ``slots``: its share of the positions
    seen, rounded down (a partial last stretch gets its part)."""
    if seen <= 0:
        return [0] * stretches
    w = stretch_width(seen, stretches)
    lengths = [max(0, min(w, seen - i * w)) for i in range(stretches)]
    return [slots * n // seen for n in lengths]


def stratify_tier(key: mx.array, seen: Sequence[int], slots: Sequence[int],
                  stretches: int = STRETCHES) -> mx.array:
    """``key`` with, per (row, head) and per stretch of the positions seen (:func:`stretch_width`),
    the stretch's quota (:func:`stretch_quotas` of ``slots[b]``) of its best-ranked scored
    positions moved to the tier after carry: each stretch of the document keeps its share of
    what the rule would keep there, so no stretch is left bare because another scores higher."""
    if max(slots, default=0) <= 0:
        return key
    pos = rank_positions(key)
    width = mx.array([stretch_width(s, stretches) for s in seen], dtype=mx.int64).reshape(-1, 1, 1)
    stretch = mx.minimum(pos.astype(mx.int64) // width, stretches - 1).astype(mx.int32)
    eligible = scored(key)
    order = mx.argsort(mx.where(eligible, key, PAD), axis=-1)  # best first within the row and head
    s_sorted = mx.take_along_axis(stretch, order, axis=-1)
    e_sorted = mx.take_along_axis(eligible, order, axis=-1)
    onehot = mx.logical_and(s_sorted[..., None] == mx.arange(stretches, dtype=mx.int32), e_sorted[..., None])
    onehot = onehot.astype(mx.int32)
    within = mx.sum(mx.cumsum(onehot, axis=-2) * onehot, axis=-1) - 1  # rank inside its stretch
    quota = mx.array([stretch_quotas(s, n, stretches) for s, n in zip(seen, slots)], dtype=mx.int32)  # (B, S)
    q_sorted = mx.take_along_axis(mx.broadcast_to(quota[:, None, :], key.shape[:2] + (stretches,)),
                                  s_sorted, axis=-1)
    return _to_tier(key, pos, order, mx.logical_and(e_sorted, within < q_sorted), SPREAD_TIER)
