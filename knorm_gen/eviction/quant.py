"""Quantized key/value storage for the eviction caches (``kv_bits``).

A cache's keys (and values) are *stored* either as one array ``(B, H, N, D)`` or,
quantized, as MLX's triple ``(packed, scales, biases)`` from ``mx.quantize``:
``packed`` is ``(B, H, N, D * bits / 32)`` uint32 and the scales and biases are
``(B, H, N, D / group_size)`` in the keys' dtype. Every operation the caches do on
their slots (slice, gather, scatter, concatenate, pad, pick batch rows) acts on
axis 2 or 0 alone, so it is the same on each part of the triple: the functions
here apply it to whichever form they are given, and the caches never branch on it.

Attention over a quantized triple is mlx_lm's quantized SDPA
(:data:`knorm_gen.platform.mlx_compat.QUANTIZED_ATTENTION`).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import mlx.core as mx

Stored = Union[mx.array, tuple]  # one array, or (packed, scales, biases)

KV_BITS = (4, 8)
"""The ``kv_bits`` the caches store (mlx_lm's ``--kv-bits`` takes these two too)."""
KV_GROUP_SIZES = (32, 64, 128)
"""The ``kv_group_size`` choices: elements of a head's key that share one scale and bias."""


def check_kv_quantization(bits, group_size) -> None:
    """ValueError naming the allowed values unless ``bits`` is None, 4 or 8 and
    ``group_size`` one of 32, 64, 128."""
    if bits is not None and (isinstance(bits, bool) or bits not in KV_BITS):
        raise ValueError(f"kv_bits must be 4 or 8 (or none: full precision), got {bits!r}")
    if isinstance(group_size, bool) or group_size not in KV_GROUP_SIZES:
        raise ValueError(f"kv_group_size must be 32, 64 or 128, got {group_size!r}")


def check_head_dims(dims: Sequence[int], group_size: int) -> None:
    """ValueError unless ``group_size`` divides every head dimension in ``dims``
    (the keys' and values' last axes): a quantization group never spans two heads."""
    bad = sorted({d for d in dims if d % group_size})
    if bad:
        fits = [g for g in KV_GROUP_SIZES if all(d % g == 0 for d in dims)]
        raise ValueError(f"kv_group_size {group_size} does not divide this model's head dimension "
                         f"{', '.join(map(str, bad))}; use --kv-group-size "
                         f"{' or '.join(map(str, fits)) if fits else '(none fits: leave kv_bits off)'}")


def quantize(x: mx.array, bits: Optional[int], group_size: int) -> Stored:
    """``x`` as stored: itself without ``bits``, else ``mx.quantize``'s triple."""
    if not bits:
        return x
    return tuple(mx.quantize(x, group_size=group_size, bits=bits))


def dequantize(x: Stored, bits: Optional[int], group_size: int) -> mx.array:
    """The float array a stored form stands for (the keys the anchored rules re-score)."""
    if not isinstance(x, tuple):
        return x
    return mx.dequantize(*x, group_size=group_size, bits=bits)


def each(fn: Callable[..., mx.array], x: Stored, *more: Stored) -> Stored:
    """``fn`` applied to ``x`` (and, part by part, ``more`` of the same form)."""
    if isinstance(x, tuple):
        return tuple(fn(*parts) for parts in zip(x, *more))
    return fn(x, *more)


def rows(x: Stored, start: int, stop: Optional[int] = None) -> Stored:
    """Slots ``[start, stop)`` of every (row, head)."""
    return each(lambda a: a[:, :, start:stop], x)


def take(x: Stored, idx: mx.array) -> Stored:
    """Slots ``idx`` ``(B, H, K)`` of each (row, head)."""
    return each(lambda a: mx.take_along_axis(a, idx[..., None], axis=2), x)


def put(x: Stored, idx: mx.array, new: Stored) -> Stored:
    """``x`` with slots ``idx`` ``(B, H, K, 1)`` written from ``new``."""
    return each(lambda a, b: mx.put_along_axis(a, idx, b, axis=2), x, new)


def assign(x: Stored, start: int, stop: int, new: Stored) -> None:
    """Write ``new`` into slots ``[start, stop)`` in place."""
    if isinstance(x, tuple):
        for a, b in zip(x, new):
            a[:, :, start:stop] = b
    else:
        x[:, :, start:stop] = new


def concat(parts: Sequence[Stored], axis: int = 2) -> Stored:
    """Parts joined along the slots (or, ``axis=0``, the batch rows)."""
    if isinstance(parts[0], tuple):
        return tuple(mx.concatenate(list(p), axis=axis) for p in zip(*parts))
    return mx.concatenate(list(parts), axis=axis)


def zeros(like: Stored, n: int, batch: Optional[int] = None) -> Stored:
    """Empty slots shaped like ``like``'s: ``n`` per (row, head), ``batch`` rows (default: like's)."""
    def z(a):
        return mx.zeros((a.shape[0] if batch is None else batch, a.shape[1], n) + tuple(a.shape[3:]), a.dtype)
    return each(z, like)


def pad(x: Stored, n: int) -> Stored:
    """``x`` with ``n`` empty slots after its own."""
    return each(lambda a: mx.pad(a, [(0, 0), (0, 0), (0, n), (0, 0)]), x)


def pick(x: Stored, sel: Union[mx.array, slice]) -> Stored:
    """Batch rows ``sel``."""
    return each(lambda a: a[sel], x)


def copy(x: Stored) -> Stored:
    """An independent copy."""
    return each(mx.array, x)


def contiguous(x: Stored) -> Stored:
    return each(mx.contiguous, x)


def slots(x: Stored) -> int:
    """Slots allocated per (row, head)."""
    return (x[0] if isinstance(x, tuple) else x).shape[2]


def nbytes(x: Optional[Stored]) -> int:
    """Bytes the stored form takes (the packed values plus scales and biases)."""
    if x is None:
        return 0
    return sum(a.nbytes for a in x) if isinstance(x, tuple) else x.nbytes


def bytes_per_slot(x: Stored) -> int:
    """Bytes one position takes in one batch row, over the heads."""
    parts = x if isinstance(x, tuple) else (x,)
    return sum(a.shape[1] * (a.shape[3] if a.ndim > 3 else 1) * a.dtype.size for a in parts)


def as_stored(v) -> Stored:
    """A loaded state entry (``load_prompt_cache`` gives a triple back as a list)."""
    return tuple(v) if isinstance(v, list) else v


def batch_rows(x: Stored) -> int:
    return (x[0] if isinstance(x, tuple) else x).shape[0]


def head_dim(x: Stored, bits: Optional[int]) -> int:
    """The unquantized last axis (a head's key or value size)."""
    if isinstance(x, tuple):
        return x[0].shape[3] * 32 // bits
    return x.shape[3]


def dtype(x: Stored):
    """The dtype the stored values stand for (the scales keep the input's)."""
    return x[1].dtype if isinstance(x, tuple) else x.dtype


def dense_bytes_per_slot(x: Stored, bits: Optional[int]) -> int:
    """Bytes one position would take, over the heads, unquantized in the model's dtype."""
    parts = x[0] if isinstance(x, tuple) else x
    return parts.shape[1] * head_dim(x, bits) * dtype(x).size


def empty(batch: int, heads: int, n: int, dim: int, dt, bits: Optional[int], group_size: int) -> Stored:
    """``n`` zero slots per (row, head) in the stored form of ``dim``-wide ``dt`` vectors."""
    if not bits:
        return mx.zeros((batch, heads, n, dim), dt)
    return (mx.zeros((batch, heads, n, dim * bits // 32), mx.uint32),
            mx.zeros((batch, heads, n, dim // group_size), dt),
            mx.zeros((batch, heads, n, dim // group_size), dt))


def mark_for_attention(cache, bits: Optional[int], group_size: int) -> None:
    """Give ``cache`` the attributes mlx_lm's attention dispatches on: ``bits`` and
    ``group_size`` when it stores quantized, none at all when it does not
    (mlx_lm tests ``hasattr(cache, "bits")``; see mlx_compat.QUANTIZED_ATTENTION)."""
    if bits:
        cache.bits, cache.group_size = bits, group_size
    else:
        for name in ("bits", "group_size"):
            cache.__dict__.pop(name, None)


def bytes_per_vector(dim: int, dtype_bytes: int, bits: Optional[int] = None, group_size: int = 64) -> int:
    """Bytes one head's key (or value) of ``dim`` elements takes: ``dim * dtype_bytes``
    in full precision; with ``bits``, the packed values plus one scale and one bias
    (in the model's dtype) per group. For layouts computed from a model's shapes."""
    if not bits:
        return dim * dtype_bytes
    return dim * bits // 8 + 2 * (dim // group_size) * dtype_bytes
