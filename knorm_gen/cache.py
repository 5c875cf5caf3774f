"""KV-cache eviction on mlx_lm's cache protocol: one row, and a batch.

``EvictionKVCache`` holds one layer's keys for one row and keeps at most
``budget`` of the row's document tokens, chosen by a rule (the table in
:mod:`knorm_gen.scores`: the paper's L2Norm rule ``keep="low"``, Devoto et al.,
arXiv:2406.11430, KeyDiff, and the others); ``BatchEvictionKVCache`` the same for
B rows, and each (row, KV head) selects exactly as the single-row cache does on
that row alone. As in mlx_lm's own ``KVCache`` / ``BatchKVCache``, the two live
together and name each other (``merge``, ``extract``); the ranking and
selection arithmetic they share is in :mod:`knorm_gen.scores`.

What a row pins (never evicts, held on top of the budget) is given by its
*spans*, the position ranges of its document: the chat template, the system
turn, a question and the answer lie outside them (:mod:`knorm_gen.prompts`
finds them).

Batch layout: row b's valid tokens fill slots ``[0, counts[b])`` for every head
(the order inside is not time order; attention does not need it). After a
decode step over its limit each (row, head) has one *hole*, the slot it just
evicted, which the next decode step fills in place, as the single-row cache
does; any other operation first compacts the holes away. Invalid slots carry
``PAD`` rank. The mask of a call is per row: the first ``counts[b]`` stored
slots, then the incoming block causally. Rows may differ in length; padding is
never kept and never counted.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn

from .config import EvictionConfig, ResolvedEviction, validate_eviction_args
from .mlx_compat import _BaseCache, create_attention_mask, make_prompt_cache, register_cache_class
from .scores import (ALL_EVICTABLE, PAD, PROTECTED, RUNNING, Spans, block_ranks, capacity, check_spans,
                     cover_slots, evict_key, open_ended, pin_from, pinned_count, rank_positions, rescore,
                     running_reference, running_update, running_zeros, span_array)


@register_cache_class  # load_prompt_cache rebuilds caches by class name from mlx_lm's cache module
class EvictionKVCache(_BaseCache):
    """A KV cache holding at most ``budget`` evictable tokens per (batch row, KV
    head), chosen by the rule ``keep`` (:data:`knorm_gen.scores.SCORES`).

    Attend first, evict after: ``update_and_fetch`` returns every kept row plus
    the whole incoming block, then cuts the stored state back to its limit.
    Over the limit it keeps the smallest ``(score, position)`` pairs, where the
    score is the rule's: the key's L2 norm (``keep="low"``, the paper's rule),
    its negation (``"high"``), a random draw (``"random"``), the negated
    position (``"recent"``), the cosine to the head's mean unit key
    (``"keydiff"``, ``"blend"``: see :mod:`knorm_gen.scores` for the anchor), or
    minus the key's leverage against the keys seen (``"leverage"``).
    Never evicted: the first ``n_sink`` positions, the last ``recent`` ones, and
    every position outside ``spans`` (the row's document: the instructions around
    it are pinned and held on top of the budget, so the limit is ``budget`` plus
    the pinned tokens seen). ``coverage`` keeps a share of the budget evenly
    spread over the positions seen (:func:`knorm_gen.scores.cover`). Scores are
    float32; the norm rules score a token once, when it is inserted, the ones
    with running state (``scores.RUNNING``) also re-score the held keys at every block.
    """

    def __init__(self, budget: int = EvictionConfig.budget, n_sink: int = EvictionConfig.n_sink, recent: int = 0,
                 keep: str = EvictionConfig.keep, coverage: float = 0.0, spans: Spans = ALL_EVICTABLE):
        validate_eviction_args(budget, n_sink, recent, keep, coverage)
        self.budget, self.n_sink, self.recent, self.keep = budget, n_sink, recent, keep
        self.coverage = float(coverage)
        self.spans: Spans = check_spans(spans)
        self.keys: Optional[mx.array] = None
        self.values: Optional[mx.array] = None
        # int64 per slot: (score bits << 32) | position, so one integer compare
        # ranks by score and breaks ties by position; pinned ones are negative.
        self.rank: Optional[mx.array] = None
        # A decode step over the limit leaves one logically evicted slot per head;
        # the next token is written there, so no step sorts or concatenates.
        self.free: Optional[mx.array] = None
        self.count = 0  # rows held per (batch row, head)
        self.offset = 0  # absolute positions processed (RoPE needs the true one)
        # The running state of the rules in scores.RUNNING over every token seen, float32:
        # keydiff/blend the sum of the unit keys (B, H, D), leverage its scatter, inverse and mean.
        self.key_sum: Optional[mx.array] = None

    # ---- mlx_lm protocol -------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        n = keys.shape[2]
        anchor = None
        spans = self._span_array()
        if self.keep in RUNNING:
            self.key_sum = running_update(self.keep, self.key_sum, keys, self.offset)
            anchor = running_reference(self.keep, self.key_sum, self.offset + n)
            if n > 1 and self.keys is not None and self.count:  # one anchor for every score a block compares
                self._compact()
                held = self.rank[:, :, : self.count]
                self.rank[:, :, : self.count] = rescore(self.keep, self.n_sink, self.keys[:, :, : self.count],
                                                        held, anchor, spans)
        rank = block_ranks(self.keep, self.n_sink, keys, self.offset, anchor, spans)
        self.offset += n
        limit = self.limit
        if self.count + n <= limit:
            self._compact()
            self._append(keys, values, rank)
            return self.keys[..., : self.count, :], self.values[..., : self.count, :]
        if n == 1:
            return self._decode_over_budget(keys, values, rank)
        return self._block_over_budget(keys, values, rank, limit)

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        # Rows are returned as (kept rows, then the block), so a mask aligned to
        # the rows held is exact; "causal" is bottom-right aligned by MLX.
        return create_attention_mask(N, offset=self.count, return_array=return_array, window_size=window_size)

    @property
    def state(self):
        # Slot 10 was ``pinned`` (0/1) before spans existed: kept so older saved caches load.
        return (
            self.keys, self.values, self.rank, self.free,
            self.count, self.offset, self.budget, self.n_sink, self.recent, self.keep, 0,
            self.key_sum, json.dumps(self.spans), self.coverage,
        )

    @state.setter
    def state(self, v):
        (self.keys, self.values, self.rank, self.free,
         self.count, self.offset, self.budget, self.n_sink, self.recent, self.keep, pinned) = v[:11]
        self.key_sum = v[11] if len(v) > 11 else None
        if len(v) > 12:
            self.spans, self.coverage = check_spans(json.loads(v[12])), float(v[13])
        else:  # saved before 0.3: pinned meant every token after the budget was kept
            self.coverage = 0.0
            self.spans = pin_from(ALL_EVICTABLE, self.offset - max(self.count - self.budget, 0)) if pinned \
                else ALL_EVICTABLE

    @property
    def meta_state(self) -> tuple[str, ...]:
        return tuple(str(x) for x in (self.count, self.offset, self.budget, self.n_sink,
                                      self.recent, self.keep, json.dumps(self.spans), self.coverage))

    @meta_state.setter
    def meta_state(self, v: Sequence[str]) -> None:
        count, offset, budget, n_sink, recent, keep, spans, coverage = v
        self.count, self.offset, self.budget = int(count), int(offset), int(budget)
        self.n_sink, self.recent, self.keep = int(n_sink), int(recent), keep
        self.spans, self.coverage = check_spans(json.loads(spans)), float(coverage)

    def size(self) -> int:
        return self.count

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        """Bytes allocated now (key/value buffers, ranks and the rule's running state)."""
        if self.keys is None:
            return 0
        state = 0 if self.key_sum is None else self.key_sum.nbytes
        return self.keys.nbytes + self.values.nbytes + self.rank.nbytes + state

    def is_trimmable(self) -> bool:
        # Trimming is only honest while nothing has been evicted: an evicted
        # token cannot be brought back.
        return self.count == self.offset and self.free is None

    def trim(self, n: int) -> int:
        if not self.is_trimmable():
            return 0
        n = min(self.count, n)
        if self.key_sum is not None and n:  # nothing was evicted: the keys left are every key seen, in order
            left = self.keys[:, :, : self.count - n]
            self.key_sum = running_update(self.keep, None, left, 0) if self.count > n else None
        self.count -= n
        self.offset -= n
        return n

    # ---- stats ---------------------------------------------------------------
    @property
    def tokens_seen(self) -> int:
        return self.offset

    @property
    def tokens_kept(self) -> int:
        return self.count

    @property
    def tokens_pinned(self) -> int:
        """Tokens held on top of the budget: pinned positions seen, the sinks aside."""
        return pinned_count(self.spans, self.n_sink, self.offset)

    @property
    def limit(self) -> int:
        """Tokens this cache may hold now: the budget plus the pinned tokens seen."""
        return self.budget + self.tokens_pinned

    def limit_at(self, seen: int) -> int:
        """Tokens it may hold once ``seen`` positions have been fed."""
        return self.budget + pinned_count(self.spans, self.n_sink, seen)

    @property
    def evictions(self) -> int:
        """Tokens evicted so far, per (batch row, KV head)."""
        return self.offset - self.count

    def bytes_per_position(self) -> int:
        if self.keys is None:
            return 0
        b, h, _, dk = self.keys.shape
        return b * h * (dk * self.keys.dtype.size + self.values.shape[3] * self.values.dtype.size)

    @property
    def kept_bytes(self) -> int:
        """Key and value bytes of the rows held."""
        return self.count * self.bytes_per_position()

    @property
    def full_bytes(self) -> int:
        """Key and value bytes an unbounded cache would hold for the same tokens."""
        return self.offset * self.bytes_per_position()

    # ---- user-facing extras ---------------------------------------------------
    def pin(self) -> None:
        """Pin every later token (a question over a compressed context, and its answer)."""
        self.spans = pin_from(self.spans, self.offset)

    @property
    def pinned(self) -> bool:
        """Whether every later token is pinned."""
        return open_ended(self.spans)

    @classmethod
    def merge(cls, caches: Sequence["EvictionKVCache"]) -> "BatchEvictionKVCache":
        """A :class:`BatchEvictionKVCache` of these single-row caches. mlx_lm batches
        caches through ``merge``; the one inherited from ``KVCache`` would build a
        plain ``BatchKVCache`` and silently stop evicting."""
        return BatchEvictionKVCache.merge(caches)

    def copy(self) -> "EvictionKVCache":
        """An independent copy (MLX writes into a shared array object would leak across copies)."""
        new = EvictionKVCache.__new__(EvictionKVCache)
        new.state = tuple(mx.array(x) if isinstance(x, mx.array) else x for x in self.state)
        return new

    def ordered_state(self) -> tuple[mx.array, mx.array, mx.array]:
        """Kept ``(keys, values, positions)`` per head, sorted by position."""
        keys, values, rank = self.held()
        pos = rank_positions(rank)
        order = mx.argsort(pos, axis=-1)
        return (
            mx.take_along_axis(keys, order[..., None], axis=2),
            mx.take_along_axis(values, order[..., None], axis=2),
            mx.take_along_axis(pos, order, axis=-1),
        )

    def held(self) -> tuple[mx.array, mx.array, mx.array]:
        """The held ``(keys, values, ranks)`` without the evicted slot (stored order,
        not time order)."""
        if self.free is None:
            return tuple(a[:, :, : self.count] for a in (self.keys, self.values, self.rank))
        slots = mx.arange(self.count, dtype=mx.int32)
        idx = slots + (slots >= self.free[..., None]).astype(mx.int32)
        return (
            mx.take_along_axis(self.keys, idx[..., None], axis=2),
            mx.take_along_axis(self.values, idx[..., None], axis=2),
            mx.take_along_axis(self.rank, idx, axis=-1),
        )

    # ---- internals -------------------------------------------------------------
    def _span_array(self) -> Optional[mx.array]:
        # Built once per spans, not at every decode step of every layer.
        if getattr(self, "_spans_for", None) != self.spans:
            self._spans_for, self._spans_arr = self.spans, span_array([self.spans])
        return self._spans_arr

    @property
    def _cover_slots(self) -> int:
        return cover_slots(self.budget, self.coverage, self.n_sink + self.recent)

    def _evict_key(self, rank: mx.array) -> mx.array:
        return evict_key(rank, self.offset, self.recent, self._cover_slots)

    def _compact(self) -> None:
        if self.free is not None:
            self.keys, self.values, self.rank = self.held()
            self.free = None

    def _append(self, keys, values, rank) -> None:
        n = keys.shape[2]
        cap = 0 if self.keys is None else self.keys.shape[2]
        if self.count + n > cap:
            b, h = keys.shape[:2]
            grow = capacity(self.count + n, self.limit, self.pinned) - cap
            new = (
                mx.zeros((b, h, grow, keys.shape[3]), keys.dtype),
                mx.zeros((b, h, grow, values.shape[3]), values.dtype),
                mx.zeros((b, h, grow), mx.int64),
            )
            if self.keys is None:
                self.keys, self.values, self.rank = new
            else:
                self.keys, self.values, self.rank = (
                    mx.concatenate([a, z], axis=2) for a, z in zip((self.keys, self.values, self.rank), new)
                )
        start, self.count = self.count, self.count + n
        self.keys[:, :, start : self.count] = keys
        self.values[:, :, start : self.count] = values
        self.rank[:, :, start : self.count] = rank

    def _decode_over_budget(self, keys, values, rank):
        # Here count == limit: the spare slot after them takes the token.
        rows = self.count + 1
        if self.free is None:
            if self.keys.shape[2] < rows:
                self._append(keys, values, rank)  # fills the spare slot
                self.count -= 1
            else:
                self.keys[:, :, self.count : rows] = keys
                self.values[:, :, self.count : rows] = values
                self.rank[:, :, self.count : rows] = rank
        else:
            slot = self.free[..., None, None]
            self.keys = mx.put_along_axis(self.keys, slot, keys, axis=2)
            self.values = mx.put_along_axis(self.values, slot, values, axis=2)
            self.rank = mx.put_along_axis(self.rank, slot[..., 0], rank.reshape(slot.shape[:-1]), axis=2)
        # Evict after attending: the largest rank leaves; its slot takes the next token.
        self.free = mx.argmax(self._evict_key(self.rank[:, :, :rows]), axis=-1)
        return self.keys[:, :, :rows], self.values[:, :, :rows]

    def _block_over_budget(self, keys, values, rank, limit: int):
        if self.keys is None:
            all_k, all_v, all_r = keys, values, rank
        else:
            all_k, all_v, all_r = (
                mx.concatenate([a, b], axis=2) for a, b in zip(self.held(), (keys, values, rank))
            )
        keep = mx.argpartition(self._evict_key(all_r), kth=limit - 1, axis=-1)[..., :limit]
        b, h = keys.shape[:2]
        self.keys = mx.concatenate(
            [mx.take_along_axis(all_k, keep[..., None], axis=2), mx.zeros((b, h, 1, keys.shape[3]), keys.dtype)], axis=2)
        self.values = mx.concatenate(
            [mx.take_along_axis(all_v, keep[..., None], axis=2), mx.zeros((b, h, 1, values.shape[3]), values.dtype)], axis=2)
        self.rank = mx.concatenate([mx.take_along_axis(all_r, keep, axis=-1), mx.zeros((b, h, 1), mx.int64)], axis=2)
        self.count, self.free = limit, None
        return all_k, all_v


@register_cache_class
class BatchEvictionKVCache(_BaseCache):
    """One layer's eviction cache for a batch of rows (see the module docstring).
    Each row has its own spans (what it pins), so question rows, prompt rows and
    rows whose instructions differ share one batch."""

    per_row_mask = True  # rows differ in what they hold: see mlx_compat.own_layer_masks

    def __init__(self, budget: int = EvictionConfig.budget, n_sink: int = EvictionConfig.n_sink, recent: int = 0,
                 keep: str = EvictionConfig.keep, coverage: float = 0.0,
                 batch_size: int = 0, spans: Optional[Sequence[Spans]] = None):
        validate_eviction_args(budget, n_sink, recent, keep, coverage)
        self.budget, self.n_sink, self.recent, self.keep = budget, n_sink, recent, keep
        self.coverage = float(coverage)
        self.spans: list[Spans] = ([ALL_EVICTABLE] * batch_size if spans is None
                                   else [check_spans(s) for s in spans])
        self.keys: Optional[mx.array] = None  # (B, H, capacity, D)
        self.values: Optional[mx.array] = None
        self.rank: Optional[mx.array] = None  # (B, H, capacity) int64
        self.counts: list[int] = [0] * len(self.spans)  # valid slots per row
        self.seen: list[int] = [0] * len(self.spans)  # true positions per row (RoPE offset)
        self.holes: list[bool] = [False] * len(self.spans)
        self.free: Optional[mx.array] = None  # (B, H) the hole of each (row, head)
        self._lengths: Optional[list[int]] = None  # prepare(): real tokens per row, padded call
        self._consumed = 0
        self.key_sum: Optional[mx.array] = None  # each row's running state (scores.RUNNING), as EvictionKVCache
        self._sync_offset()

    # ---- mlx_lm batch protocol -----------------------------------------------
    @property
    def batch_size(self) -> int:
        return len(self.counts)

    def _sync_offset(self) -> None:
        self.offset = mx.array(self.seen, dtype=mx.int32)

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        """Before a right-padded prefill call: ``lengths`` real tokens per row."""
        if left_padding is not None and max(_as_list(left_padding), default=0) > 0:
            raise ValueError("BatchEvictionKVCache takes right-padded prompts (mlx_lm's BatchGenerator), "
                             "not left padding")
        if right_padding is not None and max(_as_list(right_padding), default=0) > 0:
            if lengths is None:
                raise ValueError("right padding needs the rows' lengths")
            self._lengths, self._consumed = _as_list(lengths), 0

    def finalize(self) -> None:
        self._lengths, self._consumed = None, 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        b, h, n, _ = keys.shape
        if b != self.batch_size:
            raise ValueError(f"a block of {b} rows for a cache of {self.batch_size}")
        if self.keys is None:
            self._allocate(h, keys.shape[3], values.shape[3], keys.dtype, 0)
        if n == 1 and self._lengths is None:
            return self._decode(keys, values)
        real = ([n] * b if self._lengths is None
                else [min(max(length - self._consumed, 0), n) for length in self._lengths])
        self._consumed += n
        return self._block(keys, values, real)

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None, **kwargs):
        """Boolean ``(B, 1, N, keys)`` for the keys the next update returns."""
        counts = mx.array(self.counts, dtype=mx.int32)[:, None]
        if N == 1 and self._lengths is None:
            width = max(self.counts, default=0) + 1
            return (mx.arange(width)[None, :] < counts + 1)[:, None, None, :]
        width = max(self.counts, default=0)
        stored = mx.arange(width)[None, :] < counts  # (B, width)
        causal = mx.arange(N)[None, :] <= mx.arange(N)[:, None]  # (N, N)
        stored = mx.broadcast_to(stored[:, None, None, :], (self.batch_size, 1, N, width))
        causal = mx.broadcast_to(causal[None, None], (self.batch_size, 1, N, N))
        return mx.concatenate([stored, causal], axis=-1)

    def filter(self, batch_indices: Sequence[int]) -> None:
        """Keep only the given rows, in that order."""
        idx = [int(i) for i in _as_list(batch_indices)]
        if self.keys is not None:
            sel = mx.array(idx, dtype=mx.int32)
            self.keys, self.values, self.rank = self.keys[sel], self.values[sel], self.rank[sel]
            if self.key_sum is not None:
                self.key_sum = self.key_sum[sel]
            if self.free is not None:
                self.free = self.free[sel]
        for name in _ROW_LISTS:
            setattr(self, name, [getattr(self, name)[i] for i in idx])
        self._sync_offset()

    def extend(self, other: "BatchEvictionKVCache") -> None:
        """Append the rows of ``other`` (same settings) after this cache's rows."""
        if not isinstance(other, BatchEvictionKVCache) or _settings(other) != _settings(self):
            raise ValueError("can only extend with a BatchEvictionKVCache of the same settings")
        if other.keys is not None or self.keys is not None:
            template = self if self.keys is not None else other
            shape = template.keys.shape
            for c in (self, other):
                if c.keys is None:
                    c._allocate(shape[1], shape[3], template.values.shape[3], template.keys.dtype, 0)
            cap = max(self.keys.shape[2], other.keys.shape[2])
            self._grow_to(cap)
            other._grow_to(cap)
            self.free = mx.concatenate([self._free_or_zero(), other._free_or_zero()])
            self.keys = mx.concatenate([self.keys, other.keys])
            self.values = mx.concatenate([self.values, other.values])
            self.rank = mx.concatenate([self.rank, other.rank])
            if self.key_sum is not None:
                self.key_sum = mx.concatenate([self.key_sum, other.key_sum])
        for name in _ROW_LISTS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self._sync_offset()

    def extract(self, idx: int) -> EvictionKVCache:
        """Row ``idx`` as a single-row :class:`EvictionKVCache`."""
        self._compact()
        single = EvictionKVCache(self.budget, self.n_sink, self.recent, self.keep, self.coverage, self.spans[idx])
        single.offset, single.count = self.seen[idx], self.counts[idx]
        n = self.counts[idx]
        if self.keys is not None and n:
            single.keys = mx.contiguous(self.keys[idx : idx + 1, :, :n])
            single.values = mx.contiguous(self.values[idx : idx + 1, :, :n])
            single.rank = mx.contiguous(self.rank[idx : idx + 1, :, :n])
        if self.key_sum is not None and self.seen[idx]:
            single.key_sum = mx.contiguous(self.key_sum[idx : idx + 1])
        return single

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> "BatchEvictionKVCache":
        """One batch cache from single-row ``EvictionKVCache`` layers of the same settings."""
        first = caches[0]
        if any(_settings(c) != _settings(first) for c in caches):
            raise ValueError("cannot batch eviction caches with different budget/n_sink/recent/keep/coverage")
        out = cls(first.budget, first.n_sink, first.recent, first.keep, first.coverage, batch_size=len(caches),
                  spans=[c.spans for c in caches])
        held = [c for c in caches if not c.empty() and c.count]
        out.seen = [c.offset for c in caches]
        out.counts = [0 if c.empty() else c.count for c in caches]
        out._sync_offset()
        if not held:
            return out
        k0, v0 = held[0].keys, held[0].values
        width = max(out.counts)
        out._allocate(k0.shape[1], k0.shape[3], v0.shape[3], k0.dtype, width)
        keys, values, ranks = [], [], []
        for c, n in zip(caches, out.counts):
            if n:
                k, v, r = c.held()
            else:
                k = mx.zeros((1, k0.shape[1], 0, k0.shape[3]), k0.dtype)
                v = mx.zeros((1, v0.shape[1], 0, v0.shape[3]), v0.dtype)
                r = mx.zeros((1, k0.shape[1], 0), mx.int64)
            pad = width - n
            keys.append(mx.pad(k, [(0, 0), (0, 0), (0, pad), (0, 0)]))
            values.append(mx.pad(v, [(0, 0), (0, 0), (0, pad), (0, 0)]))
            ranks.append(mx.pad(r, [(0, 0), (0, 0), (0, pad)], constant_values=PAD))
        out.keys, out.values, out.rank = (mx.concatenate(x) for x in (keys, values, ranks))
        if out.key_sum is not None:
            zero = running_zeros(out.keep, 1, k0.shape[1], k0.shape[3])
            out.key_sum = mx.concatenate([zero if c.key_sum is None else c.key_sum for c in caches])
        return out

    @property
    def state(self):
        """Every array the cache holds and, as JSON, its settings and per-row
        bookkeeping (counts, positions, holes, spans): a saved and loaded batch
        cache continues exactly as the one saved."""
        meta = {"budget": self.budget, "n_sink": self.n_sink, "recent": self.recent, "keep": self.keep,
                "coverage": self.coverage, "counts": self.counts, "seen": self.seen, "holes": self.holes,
                "spans": [list(map(list, s)) for s in self.spans]}
        return self.keys, self.values, self.rank, self.free, self.key_sum, json.dumps(meta)

    @state.setter
    def state(self, v):
        if len(v) != 6:
            raise ValueError("this batch eviction cache was saved before 0.3, without its rows' counts and "
                             "settings, so it cannot be restored; extract() its rows into single-row caches "
                             "before saving")
        self.keys, self.values, self.rank, self.free, self.key_sum, meta = v
        meta = json.loads(meta)
        self.budget, self.n_sink, self.recent, self.keep = meta["budget"], meta["n_sink"], meta["recent"], meta["keep"]
        self.coverage = float(meta["coverage"])
        self.counts, self.seen = list(meta["counts"]), list(meta["seen"])
        self.holes = [bool(x) for x in meta["holes"]]
        self.spans = [check_spans(s) for s in meta["spans"]]
        self._lengths, self._consumed = None, 0
        self._sync_offset()

    def size(self) -> int:
        return max(self.counts, default=0)

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        state = 0 if self.key_sum is None else self.key_sum.nbytes
        return self.keys.nbytes + self.values.nbytes + self.rank.nbytes + state

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        return 0

    # ---- internals -------------------------------------------------------------
    def _limits(self) -> list[int]:
        """Tokens each row may hold now: the budget plus its pinned tokens seen."""
        return [self.budget + pinned_count(sp, self.n_sink, s) for sp, s in zip(self.spans, self.seen)]

    def _allocate(self, heads: int, dk: int, dv: int, dtype, capacity: int) -> None:
        b = self.batch_size
        self.keys = mx.zeros((b, heads, capacity, dk), dtype)
        self.values = mx.zeros((b, heads, capacity, dv), dtype)
        self.rank = mx.full((b, heads, capacity), PAD, dtype=mx.int64)
        if self.keep in RUNNING:
            self.key_sum = running_zeros(self.keep, b, heads, dk)

    def _grow_to(self, capacity: int) -> None:
        grow = capacity - self.keys.shape[2]
        if grow <= 0:
            return
        b, h, _, dk = self.keys.shape
        self.keys = mx.concatenate([self.keys, mx.zeros((b, h, grow, dk), self.keys.dtype)], axis=2)
        self.values = mx.concatenate(
            [self.values, mx.zeros((b, h, grow, self.values.shape[3]), self.values.dtype)], axis=2)
        self.rank = mx.concatenate([self.rank, mx.full((b, h, grow), PAD, dtype=mx.int64)], axis=2)

    def _free_or_zero(self) -> mx.array:
        if self.free is None:
            return mx.zeros(self.keys.shape[:2], dtype=mx.uint32)
        return self.free

    def _compact(self) -> None:
        """Close the decode holes: valid slots first, by rank (PAD sorts last)."""
        if not any(self.holes):
            return
        width = max(c + h for c, h in zip(self.counts, self.holes))
        order = mx.argsort(self.rank[:, :, :width], axis=-1)
        self.keys = mx.take_along_axis(self.keys[:, :, :width], order[..., None], axis=2)
        self.values = mx.take_along_axis(self.values[:, :, :width], order[..., None], axis=2)
        self.rank = mx.take_along_axis(self.rank[:, :, :width], order, axis=-1)
        self.holes = [False] * self.batch_size
        self.free = None

    def _decode(self, keys: mx.array, values: mx.array):
        counts = mx.array(self.counts, dtype=mx.int32)
        slot = mx.broadcast_to(counts[:, None], keys.shape[:2])
        if any(self.holes):
            slot = mx.where(mx.array(self.holes)[:, None], self.free.astype(mx.int32), slot)
        need = max((c + 1 for c, hole in zip(self.counts, self.holes) if not hole), default=0)
        if need > self.keys.shape[2]:
            self._grow_to(capacity(need, max(self._limits()) + 1, any(open_ended(s) for s in self.spans)))
        anchor = None
        if self.key_sum is not None:
            self.key_sum = running_update(self.keep, self.key_sum, keys, self.seen)
            anchor = running_reference(self.keep, self.key_sum, [s + 1 for s in self.seen])
        rank = block_ranks(self.keep, self.n_sink, keys, mx.array(self.seen, dtype=mx.int64), anchor,
                           span_array(self.spans))
        at = slot[..., None, None]
        self.keys = mx.put_along_axis(self.keys, at, keys, axis=2)
        self.values = mx.put_along_axis(self.values, at, values, axis=2)
        self.rank = mx.put_along_axis(self.rank, slot[..., None], rank, axis=2)
        width = max(self.counts) + 1
        self.seen = [s + 1 for s in self.seen]
        self._sync_offset()
        out = self.keys[:, :, :width], self.values[:, :, :width]
        # Evict after attending: each (row, head) over its limit drops its worst rank into a hole.
        limits = self._limits()
        over = [c + 1 > limit for c, limit in zip(self.counts, limits)]
        self.counts = [limit if o else c + 1 for c, o, limit in zip(self.counts, over, limits)]
        if any(over):
            valid = mx.arange(width)[None, :] < (counts + 1)[:, None]  # (B, width)
            key = self._evict_key(self.rank[:, :, :width])
            key = mx.where(valid[:, None, :], key, PROTECTED)
            victim = mx.argmax(key, axis=-1).astype(mx.uint32)  # (B, H)
            over_rows = mx.array(over)[:, None]
            dropped = mx.put_along_axis(self.rank, victim[..., None].astype(mx.int32),
                                        mx.array(PAD, dtype=mx.int64), axis=2)
            self.rank = mx.where(over_rows[..., None], dropped, self.rank)
            self.free = mx.where(over_rows, victim, self._free_or_zero())
        self.holes = over
        return out

    def _evict_key(self, rank: mx.array) -> mx.array:
        """Ranks with each row's recent window and coverage positions protected (PAD stays PAD)."""
        return evict_key(rank, self.seen, self.recent, cover_slots(self.budget, self.coverage,
                                                                   self.n_sink + self.recent))

    def _block(self, keys: mx.array, values: mx.array, real: list[int]):
        self._compact()
        b, h, n, _ = keys.shape
        width = max(self.counts, default=0)
        spans = span_array(self.spans)
        anchor = None
        if self.key_sum is not None:
            self.key_sum = running_update(self.keep, self.key_sum, keys, self.seen, real)
            anchor = running_reference(self.keep, self.key_sum, [s + r for s, r in zip(self.seen, real)])
            if width and any(r > 1 for r in real):  # as a row alone: held keys re-scored when >1 token arrives
                held = self.rank[:, :, :width]
                again = rescore(self.keep, self.n_sink, self.keys[:, :, :width], held, anchor, spans)
                self.rank[:, :, :width] = mx.where(mx.array([r > 1 for r in real])[:, None, None], again, held)
        rank = block_ranks(self.keep, self.n_sink, keys, mx.array(self.seen, dtype=mx.int64), anchor, spans)
        if any(r < n for r in real):  # right padding: never kept, never counted
            is_pad = mx.arange(n)[None, :] >= mx.array(real)[:, None]
            rank = mx.where(is_pad[:, None, :], PAD, rank)
        all_k = mx.concatenate([self.keys[:, :, :width], keys], axis=2)
        all_v = mx.concatenate([self.values[:, :, :width], values], axis=2)
        all_r = mx.concatenate([self.rank[:, :, :width], rank], axis=2)
        self.seen = [s + r for s, r in zip(self.seen, real)]
        self._sync_offset()
        total = [c + r for c, r in zip(self.counts, real)]
        self.counts = [min(t, limit) for t, limit in zip(total, self._limits())]
        keep = max(self.counts, default=0)
        order = mx.argsort(self._evict_key(all_r), axis=-1)[..., :keep]
        self.keys = mx.take_along_axis(all_k, order[..., None], axis=2)
        self.values = mx.take_along_axis(all_v, order[..., None], axis=2)
        kept = mx.take_along_axis(all_r, order, axis=-1)
        # A row holding fewer than the widest keeps PAD in its tail slots.
        valid = mx.arange(keep)[None, :] < mx.array(self.counts)[:, None]
        self.rank = mx.where(valid[:, None, :], kept, PAD)
        return all_k, all_v


_ROW_LISTS = ("counts", "seen", "holes", "spans")


def _settings(c: Any) -> tuple:
    return (c.budget, c.n_sink, c.recent, c.keep, c.coverage)


# The names before 0.3, when the cache held one rule: saved prompt caches name them.
L2NormKVCache = EvictionKVCache
BatchL2NormKVCache = BatchEvictionKVCache
register_cache_class(EvictionKVCache, "L2NormKVCache")
register_cache_class(BatchEvictionKVCache, "BatchL2NormKVCache")


def _as_list(x: Any) -> list:
    if isinstance(x, mx.array):
        return x.tolist()
    return list(x)


def make_eviction_cache(model: nn.Module, config: Union[EvictionConfig, ResolvedEviction, None] = None,
                        spans: Spans = ALL_EVICTABLE) -> list:
    """A fresh per-layer cache list: the model's own caches, with each layer the
    resolved config compresses (a plain full-attention ``KVCache`` outside
    ``skip_layers``) replaced by an :class:`EvictionKVCache`. Rotating
    (sliding-window) and non-attention caches stay. ``config`` may be given
    resolved (:meth:`EvictionConfig.for_model`); it is then taken as it is.
    ``spans``: the positions of the row's document (everything else is pinned;
    :func:`knorm_gen.prompts.encode_with_spans`)."""
    caches = make_prompt_cache(model)
    if not isinstance(config, ResolvedEviction):
        config = (config or EvictionConfig()).for_model(model)
    if config.n_layers != len(caches):
        raise ValueError(f"these settings were resolved for a model of {config.n_layers} layers, not {len(caches)}")
    return [c if plan is None else EvictionKVCache(plan[0], config.n_sink, plan[1], config.keep, config.coverage,
                                                   spans)
            for c, plan in zip(caches, config.layers)]


def copy_caches(caches: Sequence[Any]) -> list:
    """Independent copies of a cache list (e.g. one compressed context, many questions)."""

    def dup(value):
        if isinstance(value, mx.array):
            return mx.array(value)
        if isinstance(value, list):
            return [dup(v) for v in value]
        return value

    out = []
    for c in caches:
        if isinstance(c, EvictionKVCache):
            out.append(c.copy())
            continue
        new = copy.copy(c)
        for name, value in vars(c).items():
            setattr(new, name, dup(value))
        out.append(new)
    return out


def pin_caches(caches: Sequence[Any]) -> list:
    """``caches`` with every later token pinned in each eviction layer (a question
    and its answer over a compressed context); returns the list."""
    for c in caches:
        if isinstance(c, EvictionKVCache):
            c.pin()
    return list(caches)
