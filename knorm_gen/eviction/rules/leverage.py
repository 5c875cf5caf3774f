"""Statistical leverage (Compactor, arXiv:2507.08143): keep the keys least explained by
the head's other keys."""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx

from .base import Rule

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


def leverage_score(keys: mx.array, state: mx.array) -> mx.array:
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
    inverse, a decode step O(D^2) (:data:`LEVERAGE_REFRESH`). ``state`` is the
    running state (:meth:`Leverage.update`): C, its regularised inverse P and μ."""
    d = keys.shape[-1]
    inv, mean = state[..., d : 2 * d, :], state[..., 2 * d :, :]
    x = keys.astype(mx.float32) - mean
    return -mx.sum((x @ inv) * x, axis=-1)


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


def leverage_update(state: Optional[mx.array], keys: mx.array, seen: Sequence[int], real: Sequence[int]) -> mx.array:
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




class Leverage(Rule):
    """Keep the keys of highest leverage against the keys seen (``keep="leverage"``,
    :func:`leverage_score`); the running state is the scatter matrix of every key the
    row has seen about their mean, its regularised inverse and the mean
    ``(B, H, 2D + 1, D)``: a block of more than one token computes the inverse afresh,
    a single token updates it (:data:`LEVERAGE_REFRESH`)."""

    name = "leverage"
    summary = "the keys least explained by the others (statistical leverage)"

    def score(self, keys: mx.array, positions: mx.array, state: Optional[mx.array] = None) -> mx.array:
        return leverage_score(keys, state)

    def zeros(self, batch: int, heads: int, dim: int) -> mx.array:
        return mx.zeros((batch, heads, 2 * dim + 1, dim), mx.float32)

    def update(self, state: Optional[mx.array], keys: mx.array, seen: Sequence[int],
               real: Sequence[int]) -> mx.array:
        return leverage_update(state, keys, list(seen), list(real))
