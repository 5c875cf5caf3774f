"""The eviction rules as data: one small scoring function per ``keep`` mode.

A score function maps a block of keys ``(B, H, N, D)`` and their absolute
positions ``(B, 1, N)`` to one float32 per token ``(B, H, N)``; **lower is
kept first**. The caches share one selection machinery on top (pack, then
partition or argmax), so a new rule is one function and one table entry, and
the parametrised tests in ``tests/test_scores.py`` cover it the day it is added.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx

ScoreFn = Callable[[mx.array, mx.array], mx.array]


def _squared_norm(keys: mx.array) -> mx.array:
    # Squared, so no sqrt: the order is the norm's. Float32 whatever the cache dtype.
    return mx.sum(mx.square(keys.astype(mx.float32)), axis=-1)


def score_low(keys: mx.array, positions: mx.array) -> mx.array:
    """The paper's rule: a low key norm predicts high attention, so keep it."""
    return _squared_norm(keys)


def score_high(keys: mx.array, positions: mx.array) -> mx.array:
    """The paper's ablation: keep the highest norms."""
    return -_squared_norm(keys)


def score_random(keys: mx.array, positions: mx.array) -> mx.array:
    """A baseline blind to the keys (reproducible through ``mx.random.seed``)."""
    return mx.random.uniform(shape=keys.shape[:3], dtype=mx.float32)


def score_recent(keys: mx.array, positions: mx.array) -> mx.array:
    """StreamingLLM: with the sinks, keep the most recent tokens."""
    return mx.broadcast_to(-positions.astype(mx.float32), keys.shape[:3])


SCORES: dict[str, ScoreFn] = {
    "low": score_low,
    "high": score_high,
    "random": score_random,
    "recent": score_recent,
}

# ---- the selection arithmetic both caches share ---------------------------------
# One int64 per token: (order-preserving integer of the float32 score) << 32 | position,
# so one integer compare ranks by score and breaks ties by the earlier position.
# Protected tokens (sinks, the recent window) get PROTECTED + position: below any score.
# Empty and padding slots of a batch cache get PAD: above any score, never kept.
_POS_SHIFT = 1 << 32
_POS_MASK = (1 << 32) - 1
PROTECTED = -(1 << 63)
PAD = (1 << 63) - 1
STEP = 256  # buffers grow in steps of this many slots (as mlx_lm's KVCache does)


def _ordered_bits(score: mx.array) -> mx.array:
    """float32 -> int64 in [-2**31, 2**31) with the same order (IEEE-754 sign-magnitude)."""
    bits = mx.view(score.astype(mx.float32), mx.int32).astype(mx.int64)
    return mx.where(bits < 0, -bits - (1 << 31) - 1, bits)


def pack_ranks(score: mx.array, positions: mx.array, n_sink: int) -> mx.array:
    """int64 ranks of a block; ``positions`` broadcast against ``score``."""
    pos = positions.astype(mx.int64)
    rank = _ordered_bits(score) * _POS_SHIFT + pos
    if n_sink:
        rank = mx.where(pos < n_sink, PROTECTED + pos, rank)
    return rank


def block_ranks(keep: str, n_sink: int, keys: mx.array, start: mx.array | int) -> mx.array:
    """Ranks of a block of keys ``(B, H, N, D)`` whose first token sits at absolute
    position ``start`` (an int, or one per batch row); ascending = kept first."""
    first = mx.array(start, dtype=mx.int64).reshape(-1, 1, 1)
    positions = first + mx.arange(keys.shape[2], dtype=mx.int64)[None, None, :]
    return pack_ranks(SCORES[keep](keys, positions), positions, n_sink)


def rank_positions(rank: mx.array) -> mx.array:
    """The absolute position packed in each rank."""
    return mx.bitwise_and(rank, _POS_MASK).astype(mx.int32)


def protect_recent(rank: mx.array, first_recent: mx.array | int) -> mx.array:
    """Ranks with every position at or after ``first_recent`` protected from eviction."""
    pos = rank_positions(rank)
    return mx.where(pos >= first_recent, PROTECTED + pos.astype(mx.int64), rank)


def evict_key(rank: mx.array, seen: mx.array | int, recent: int) -> mx.array:
    """What eviction ranks by: ``rank`` with the last ``recent`` of ``seen``
    positions protected (``seen`` an int, or one per batch row); PAD stays PAD."""
    if recent == 0:
        return rank
    first = mx.array(seen, dtype=mx.int64).reshape(-1, 1, 1) - recent
    return mx.where(rank == PAD, rank, protect_recent(rank, first))


def capacity(rows: int, budget: int, pinned: bool) -> int:
    """Slots to allocate for ``rows`` held rows: whole steps, but never more than
    the budget plus the one spare slot a decode step writes into (unless pinned:
    then every later token is kept)."""
    cap = -(-rows // STEP) * STEP
    return cap if pinned else max(rows, min(cap, budget + 1))
