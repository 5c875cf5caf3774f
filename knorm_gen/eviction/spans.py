"""A row's spans: the position ranges ``[start, end)`` of its document, the only
positions eviction may drop. Every position outside them (the chat template, the
system turn, a question, the answer) is pinned and held on top of the budget."""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx

Spans = tuple  # tuple[tuple[int, int], ...], sorted, disjoint

NO_END = 1 << 62
"""The end of a span that runs on for ever."""

ALL_EVICTABLE: Spans = ((0, NO_END),)
"""The spans of a row with nothing pinned: every position may be evicted (the sinks aside)."""


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


def evictable_count(spans: Spans, n_sink: int, seen: int) -> int:
    """Positions before ``seen`` that may be evicted: the row's document, its sinks aside."""
    return max(seen - n_sink, 0) - pinned_count(spans, n_sink, seen)


def span_positions(spans: Spans, seen: int) -> int:
    """Positions before ``seen`` inside ``spans``: the document's, sinks among them."""
    return sum(max(min(b, seen) - a, 0) for a, b in spans)


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
