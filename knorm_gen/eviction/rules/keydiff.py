"""KeyDiff (arXiv:2504.15364) and the blend of KeyDiff with the paper's key norm.

Both compare a key with an *anchor*: the mean unit-length key of the (row, head), kept
as running state: the sum of the unit keys of every token the row has seen (evicted
ones included), divided by their count. Every block of more than one token first
re-scores the held keys against the anchor that includes the block, then scores the
block against it, so one selection never compares scores made against different anchors.
(Scored only at insertion, the first 512-token block of a pass-key prompt on Gemma 3 was
scored against its own mean, which shares its positions' RoPE phase, and lost its needle
where a one-block prefill kept it.) A decode token is scored against the running anchor
when it arrives. In blocks, tokens evicted early were judged against fewer keys, so these
rules depend on the block size (the others do not).
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx

from .base import Rule, squared_norm, unit_keys

BLEND_WEIGHT = 0.5
"""``blend``'s weight on ln|k| beside KeyDiff's cosine, chosen so the two terms spread
alike on the embedded model: over 2,048 tokens of pydoc text, across the heads of its 30
layers, the standard deviation of the cosine to the anchor is 0.051 on average and that
of ln|k| 0.110 (ratio 0.46). On Gemma 3 270M the same ratio is 1.31, so there the cosine
weighs about 2.8x more."""


def anchor_sum(keys: mx.array, real: Optional[Sequence[int]] = None) -> mx.array:
    """``(B, H, D)``: the sum of a block's unit keys over its real tokens (``real``:
    tokens per row; right padding after them is left out)."""
    unit = unit_keys(keys)
    if real is not None and any(r != keys.shape[2] for r in real):
        valid = mx.arange(keys.shape[2])[None, :] < mx.array(list(real)).reshape(-1, 1)
        unit = unit * valid[:, None, :, None]
    return mx.sum(unit, axis=2)


def running_anchor(total: mx.array, seen: Sequence[int]) -> mx.array:
    """``(B, H, 1, D)`` anchor from the running sum of unit keys and the tokens seen per row."""
    count = mx.maximum(mx.array(list(seen), dtype=mx.float32).reshape(-1, 1, 1), 1.0)
    return (total / count)[:, :, None, :]


def cosine_to_anchor(keys: mx.array, anchor: mx.array) -> mx.array:
    return mx.sum(unit_keys(keys) * unit_keys(anchor), axis=-1)


class _Anchored(Rule):
    def zeros(self, batch: int, heads: int, dim: int) -> mx.array:
        return mx.zeros((batch, heads, dim), mx.float32)

    def update(self, state: Optional[mx.array], keys: mx.array, seen: Sequence[int],
               real: Sequence[int]) -> mx.array:
        part = anchor_sum(keys, real)
        return part if state is None else state + part

    def reference(self, state: mx.array, seen: Sequence[int]) -> mx.array:
        return running_anchor(state, seen)


class KeyDiff(_Anchored):
    """Keep the keys least like the head's mean direction (``keep="keydiff"``): coverage
    of what the document says, not of what draws attention."""

    name = "keydiff"
    summary = "the keys least like the head's mean (KeyDiff)"

    def score(self, keys: mx.array, positions: mx.array, state: Optional[mx.array] = None) -> mx.array:
        return cosine_to_anchor(keys, state)


class Blend(_Anchored):
    """KeyDiff's cosine plus :data:`BLEND_WEIGHT` x ln|k| (``keep="blend"``): a key is
    kept for being unlike the rest or for a low norm (the paper's signal), the two
    traded off. Its early layers take ``leverage`` under ``early_keep="auto"``: on
    Gemma 3 the blend lost the pass keys placed early in a filler because its first
    global layer evicted them, where leverage kept them."""

    name = "blend"
    summary = "keydiff and low traded off (with leverage in the early layers)"
    early = "leverage"

    def score(self, keys: mx.array, positions: mx.array, state: Optional[mx.array] = None) -> mx.array:
        return cosine_to_anchor(keys, state) + (0.5 * BLEND_WEIGHT) * mx.log(mx.maximum(squared_norm(keys), 1e-30))
