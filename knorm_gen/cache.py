"""L2Norm key-norm KV-cache eviction on mlx_lm's cache protocol: one row, and a batch.

Devoto et al. (arXiv:2406.11430): a key with a low L2 norm tends to draw high
attention, so when a layer's cache is over budget we keep the lowest-norm keys.

``L2NormKVCache`` holds one layer's keys for one row; ``BatchL2NormKVCache`` the
same for B rows, and each (row, KV head) selects exactly as the single-row cache
does on that row alone. As in mlx_lm's own ``KVCache`` / ``BatchKVCache``, the two
live together and name each other (``merge``, ``extract``); the ranking and
selection arithmetic they share is in :mod:`knorm_gen.scores`.

Batch layout: row b's valid tokens fill slots ``[0, counts[b])`` for every head
(the order inside is not time order; attention does not need it). After a
decode step over budget each (row, head) has one *hole*, the slot it just
evicted, which the next decode step fills in place, as the single-row cache
does; any other operation first compacts the holes away. Invalid slots carry
``PAD`` rank. The mask of a call is per row: the first ``counts[b]`` stored
slots, then the incoming block causally. Rows may differ in length; padding is
never kept and never counted.
"""

from __future__ import annotations

import copy
from typing import Any, Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn

from .config import EvictionConfig, ResolvedEviction, validate_eviction_args
from .mlx_compat import _BaseCache, create_attention_mask, make_prompt_cache, register_cache_class
from .scores import (ANCHORED, PAD, PROTECTED, anchor_sum, block_ranks, capacity, evict_key, rank_positions,
                     rescore, running_anchor)


@register_cache_class  # load_prompt_cache rebuilds caches by class name from mlx_lm's cache module
class L2NormKVCache(_BaseCache):
    """A KV cache holding at most ``budget`` tokens per (batch row, KV head).

    Attend first, evict after: ``update_and_fetch`` returns every kept row plus
    the whole incoming block, then cuts the stored state back to the budget.
    Over budget it keeps the ``budget`` smallest ``(score, position)`` pairs
    among evictable tokens, where score is the key's L2 norm (``keep="low"``),
    its negation (``"high"``), a random draw (``"random"``) or the negated
    position (``"recent"``), or the cosine to the head's mean unit key
    (``"keydiff"``, ``"blend"``: see :mod:`knorm_gen.scores` for the anchor).
    The first ``n_sink`` positions and the last ``recent`` positions are never
    evicted. Scores are float32; the norm rules score a token once, when it is
    inserted, the anchored ones also re-score the held keys at every block.
    """

    def __init__(self, budget: int = EvictionConfig.budget, n_sink: int = EvictionConfig.n_sink, recent: int = 0,
                 keep: str = EvictionConfig.keep):
        validate_eviction_args(budget, n_sink, recent, keep)
        self.budget, self.n_sink, self.recent, self.keep = budget, n_sink, recent, keep
        self.keys: Optional[mx.array] = None
        self.values: Optional[mx.array] = None
        # int64 per slot: (score bits << 32) | position, so one integer compare
        # ranks by score and breaks ties by position; sinks are negative.
        self.rank: Optional[mx.array] = None
        # A decode step over budget leaves one logically evicted slot per head;
        # the next token is written there, so no step sorts or concatenates.
        self.free: Optional[mx.array] = None
        self.count = 0  # rows held per (batch row, head)
        self.offset = 0  # absolute positions processed (RoPE needs the true one)
        self.pinned = False
        # keydiff/blend: the sum of the unit keys of every token seen, (B, H, D) float32
        self.key_sum: Optional[mx.array] = None

    # ---- mlx_lm protocol -------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        n = keys.shape[2]
        anchor = None
        if self.keep in ANCHORED:
            part = anchor_sum(keys)
            self.key_sum = part if self.key_sum is None else self.key_sum + part
            anchor = running_anchor(self.key_sum, self.offset + n)
            if n > 1 and self.keys is not None and self.count:  # one anchor for every score a block compares
                self._compact()
                held = self.rank[:, :, : self.count]
                self.rank[:, :, : self.count] = rescore(self.keep, self.n_sink, self.keys[:, :, : self.count],
                                                        held, anchor)
        rank = block_ranks(self.keep, self.n_sink, keys, self.offset, anchor)
        self.offset += n
        if self.pinned or self.count + n <= self.budget:
            self._compact()
            self._append(keys, values, rank)
            return self.keys[..., : self.count, :], self.values[..., : self.count, :]
        if n == 1:
            return self._decode_over_budget(keys, values, rank)
        return self._block_over_budget(keys, values, rank)

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        # Rows are returned as (kept rows, then the block), so a mask aligned to
        # the rows held is exact; "causal" is bottom-right aligned by MLX.
        return create_attention_mask(N, offset=self.count, return_array=return_array, window_size=window_size)

    @property
    def state(self):
        state = (
            self.keys, self.values, self.rank, self.free,
            self.count, self.offset, self.budget, self.n_sink, self.recent, self.keep, int(self.pinned),
        )
        return state if self.key_sum is None else state + (self.key_sum,)

    @state.setter
    def state(self, v):
        (self.keys, self.values, self.rank, self.free,
         self.count, self.offset, self.budget, self.n_sink, self.recent, self.keep, pinned) = v[:11]
        self.pinned = bool(pinned)
        self.key_sum = v[11] if len(v) > 11 else None

    @property
    def meta_state(self) -> tuple[str, ...]:
        return tuple(str(x) for x in (self.count, self.offset, self.budget, self.n_sink,
                                      self.recent, self.keep, int(self.pinned)))

    @meta_state.setter
    def meta_state(self, v: Sequence[str]) -> None:
        count, offset, budget, n_sink, recent, keep, pinned = v
        self.count, self.offset, self.budget = int(count), int(offset), int(budget)
        self.n_sink, self.recent, self.keep, self.pinned = int(n_sink), int(recent), keep, bool(int(pinned))

    def size(self) -> int:
        return self.count

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        """Bytes allocated now (key/value buffers and ranks)."""
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes + self.rank.nbytes

    def is_trimmable(self) -> bool:
        # Trimming is only honest while nothing has been evicted: an evicted
        # token cannot be brought back.
        return self.count == self.offset and self.free is None

    def trim(self, n: int) -> int:
        if not self.is_trimmable():
            return 0
        n = min(self.count, n)
        if self.key_sum is not None and n:  # nothing was evicted: the trimmed keys are the last ones held
            self.key_sum = self.key_sum - anchor_sum(self.keys[:, :, self.count - n : self.count])
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
        """Stop evicting: every later token is kept (a question over a compressed context)."""
        self.pinned = True

    @classmethod
    def merge(cls, caches: Sequence["L2NormKVCache"]) -> "BatchL2NormKVCache":
        """A :class:`BatchL2NormKVCache` of these single-row caches. mlx_lm batches
        caches through ``merge``; the one inherited from ``KVCache`` would build a
        plain ``BatchKVCache`` and silently stop evicting."""
        return BatchL2NormKVCache.merge(caches)

    def copy(self) -> "L2NormKVCache":
        """An independent copy (MLX writes into a shared array object would leak across copies)."""
        new = L2NormKVCache.__new__(L2NormKVCache)
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
    def _evict_key(self, rank: mx.array) -> mx.array:
        return evict_key(rank, self.offset, self.recent)

    def _compact(self) -> None:
        if self.free is not None:
            self.keys, self.values, self.rank = self.held()
            self.free = None

    def _append(self, keys, values, rank) -> None:
        n = keys.shape[2]
        cap = 0 if self.keys is None else self.keys.shape[2]
        if self.count + n > cap:
            b, h = keys.shape[:2]
            grow = capacity(self.count + n, self.budget, self.pinned) - cap
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
        rows = self.budget + 1
        if self.free is None:
            if self.keys.shape[2] < rows:
                self._append(keys, values, rank)  # fills the spare slot
                self.count -= 1
            else:
                self.keys[:, :, self.budget : rows] = keys
                self.values[:, :, self.budget : rows] = values
                self.rank[:, :, self.budget : rows] = rank
        else:
            slot = self.free[..., None, None]
            self.keys = mx.put_along_axis(self.keys, slot, keys, axis=2)
            self.values = mx.put_along_axis(self.values, slot, values, axis=2)
            self.rank = mx.put_along_axis(self.rank, slot[..., 0], rank.reshape(slot.shape[:-1]), axis=2)
        # Evict after attending: the largest rank leaves; its slot takes the next token.
        self.free = mx.argmax(self._evict_key(self.rank[:, :, :rows]), axis=-1)
        return self.keys[:, :, :rows], self.values[:, :, :rows]

    def _block_over_budget(self, keys, values, rank):
        if self.keys is None:
            all_k, all_v, all_r = keys, values, rank
        else:
            all_k, all_v, all_r = (
                mx.concatenate([a, b], axis=2) for a, b in zip(self.held(), (keys, values, rank))
            )
        keep = mx.argpartition(self._evict_key(all_r), kth=self.budget - 1, axis=-1)[..., : self.budget]
        b, h = keys.shape[:2]
        self.keys = mx.concatenate(
            [mx.take_along_axis(all_k, keep[..., None], axis=2), mx.zeros((b, h, 1, keys.shape[3]), keys.dtype)], axis=2)
        self.values = mx.concatenate(
            [mx.take_along_axis(all_v, keep[..., None], axis=2), mx.zeros((b, h, 1, values.shape[3]), values.dtype)], axis=2)
        self.rank = mx.concatenate([mx.take_along_axis(all_r, keep, axis=-1), mx.zeros((b, h, 1), mx.int64)], axis=2)
        self.count, self.free = self.budget, None
        return all_k, all_v


@register_cache_class
class BatchL2NormKVCache(_BaseCache):
    """One layer's eviction cache for a batch of rows (see the module docstring)."""

    per_row_mask = True  # rows differ in what they hold: see mlx_compat.own_layer_masks

    def __init__(self, budget: int = EvictionConfig.budget, n_sink: int = EvictionConfig.n_sink, recent: int = 0,
                 keep: str = EvictionConfig.keep,
                 batch_size: int = 0, pinned: Optional[Sequence[bool]] = None):
        validate_eviction_args(budget, n_sink, recent, keep)
        self.budget, self.n_sink, self.recent, self.keep = budget, n_sink, recent, keep
        # Per row: a pinned row (a question over its compressed context) keeps every
        # later token, so question rows and prompt rows can share one batch.
        self.pinned: list[bool] = [False] * batch_size if pinned is None else [bool(p) for p in pinned]
        self.keys: Optional[mx.array] = None  # (B, H, capacity, D)
        self.values: Optional[mx.array] = None
        self.rank: Optional[mx.array] = None  # (B, H, capacity) int64
        self.counts: list[int] = [0] * batch_size  # valid slots per row
        self.seen: list[int] = [0] * batch_size  # true positions per row (RoPE offset)
        self.holes: list[bool] = [False] * batch_size
        self.free: Optional[mx.array] = None  # (B, H) the hole of each (row, head)
        self._lengths: Optional[list[int]] = None  # prepare(): real tokens per row, padded call
        self._consumed = 0
        self.key_sum: Optional[mx.array] = None  # keydiff/blend: (B, H, D) sum of each row's unit keys
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
            raise ValueError("BatchL2NormKVCache takes right-padded prompts (mlx_lm's BatchGenerator), "
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
        self.counts = [self.counts[i] for i in idx]
        self.seen = [self.seen[i] for i in idx]
        self.holes = [self.holes[i] for i in idx]
        self.pinned = [self.pinned[i] for i in idx]
        self._sync_offset()

    def extend(self, other: "BatchL2NormKVCache") -> None:
        """Append the rows of ``other`` (same settings) after this cache's rows."""
        if not isinstance(other, BatchL2NormKVCache) or _settings(other) != _settings(self):
            raise ValueError("can only extend with a BatchL2NormKVCache of the same settings")
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
        self.counts += other.counts
        self.seen += other.seen
        self.holes += other.holes
        self.pinned += other.pinned
        self._sync_offset()

    def extract(self, idx: int) -> L2NormKVCache:
        """Row ``idx`` as a single-row :class:`L2NormKVCache`."""
        self._compact()
        single = L2NormKVCache(self.budget, self.n_sink, self.recent, self.keep)
        single.offset, single.count, single.pinned = self.seen[idx], self.counts[idx], self.pinned[idx]
        n = self.counts[idx]
        if self.keys is not None and n:
            single.keys = mx.contiguous(self.keys[idx : idx + 1, :, :n])
            single.values = mx.contiguous(self.values[idx : idx + 1, :, :n])
            single.rank = mx.contiguous(self.rank[idx : idx + 1, :, :n])
        if self.key_sum is not None and self.seen[idx]:
            single.key_sum = mx.contiguous(self.key_sum[idx : idx + 1])
        return single

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> "BatchL2NormKVCache":
        """One batch cache from single-row ``L2NormKVCache`` layers of the same settings."""
        first = caches[0]
        if any(_settings(c) != _settings(first) for c in caches):
            raise ValueError("cannot batch eviction caches with different budget/n_sink/recent/keep")
        out = cls(first.budget, first.n_sink, first.recent, first.keep, batch_size=len(caches),
                  pinned=[c.pinned for c in caches])
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
            zero = mx.zeros((1, k0.shape[1], k0.shape[3]), mx.float32)
            out.key_sum = mx.concatenate([zero if c.key_sum is None else c.key_sum for c in caches])
        return out

    @property
    def state(self):
        return self.keys, self.values, self.rank, self.offset

    @state.setter
    def state(self, v):
        self.keys, self.values, self.rank, self.offset = v
        self.seen = [int(x) for x in _as_list(self.offset)]

    def size(self) -> int:
        return max(self.counts, default=0)

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes + self.rank.nbytes

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        return 0

    # ---- internals -------------------------------------------------------------
    def _allocate(self, heads: int, dk: int, dv: int, dtype, capacity: int) -> None:
        b = self.batch_size
        self.keys = mx.zeros((b, heads, capacity, dk), dtype)
        self.values = mx.zeros((b, heads, capacity, dv), dtype)
        self.rank = mx.full((b, heads, capacity), PAD, dtype=mx.int64)
        if self.keep in ANCHORED:
            self.key_sum = mx.zeros((b, heads, dk), mx.float32)

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
            self._grow_to(capacity(need, self.budget, any(self.pinned)))
        anchor = None
        if self.key_sum is not None:
            self.key_sum = self.key_sum + anchor_sum(keys)
            anchor = running_anchor(self.key_sum, [s + 1 for s in self.seen])
        rank = block_ranks(self.keep, self.n_sink, keys, mx.array(self.seen, dtype=mx.int64), anchor)
        at = slot[..., None, None]
        self.keys = mx.put_along_axis(self.keys, at, keys, axis=2)
        self.values = mx.put_along_axis(self.values, at, values, axis=2)
        self.rank = mx.put_along_axis(self.rank, slot[..., None], rank, axis=2)
        width = max(self.counts) + 1
        self.seen = [s + 1 for s in self.seen]
        self._sync_offset()
        out = self.keys[:, :, :width], self.values[:, :, :width]
        # Evict after attending: each over-budget (row, head) drops its worst rank into a hole.
        over = [not pinned and c + 1 > self.budget for c, pinned in zip(self.counts, self.pinned)]
        self.counts = [self.budget if o else c + 1 for c, o in zip(self.counts, over)]
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
        """Ranks with each row's recent window protected (PAD stays PAD)."""
        return evict_key(rank, mx.array(self.seen, dtype=mx.int64), self.recent)

    def _block(self, keys: mx.array, values: mx.array, real: list[int]):
        self._compact()
        b, h, n, _ = keys.shape
        width = max(self.counts, default=0)
        anchor = None
        if self.key_sum is not None:
            self.key_sum = self.key_sum + anchor_sum(keys, mx.array(real))
            anchor = running_anchor(self.key_sum, [s + r for s, r in zip(self.seen, real)])
            if width and any(r > 1 for r in real):  # as a row alone: held keys re-scored when >1 token arrives
                held = self.rank[:, :, :width]
                again = rescore(self.keep, self.n_sink, self.keys[:, :, :width], held, anchor)
                self.rank[:, :, :width] = mx.where(mx.array([r > 1 for r in real])[:, None, None], again, held)
        rank = block_ranks(self.keep, self.n_sink, keys, mx.array(self.seen, dtype=mx.int64), anchor)
        if any(r < n for r in real):  # right padding: never kept, never counted
            is_pad = mx.arange(n)[None, :] >= mx.array(real)[:, None]
            rank = mx.where(is_pad[:, None, :], PAD, rank)
        all_k = mx.concatenate([self.keys[:, :, :width], keys], axis=2)
        all_v = mx.concatenate([self.values[:, :, :width], values], axis=2)
        all_r = mx.concatenate([self.rank[:, :, :width], rank], axis=2)
        self.seen = [s + r for s, r in zip(self.seen, real)]
        self._sync_offset()
        total = [c + r for c, r in zip(self.counts, real)]
        self.counts = [t if pinned else min(t, self.budget) for t, pinned in zip(total, self.pinned)]
        keep = max(self.counts, default=0)
        order = mx.argsort(self._evict_key(all_r), axis=-1)[..., :keep]
        self.keys = mx.take_along_axis(all_k, order[..., None], axis=2)
        self.values = mx.take_along_axis(all_v, order[..., None], axis=2)
        kept = mx.take_along_axis(all_r, order, axis=-1)
        # A row holding fewer than the widest keeps PAD in its tail slots.
        valid = mx.arange(keep)[None, :] < mx.array(self.counts)[:, None]
        self.rank = mx.where(valid[:, None, :], kept, PAD)
        return all_k, all_v


def _settings(c: Any) -> tuple:
    return (c.budget, c.n_sink, c.recent, c.keep)


def _as_list(x: Any) -> list:
    if isinstance(x, mx.array):
        return x.tolist()
    return list(x)


def make_eviction_cache(model: nn.Module, config: Union[EvictionConfig, ResolvedEviction, None] = None) -> list:
    """A fresh per-layer cache list: the model's own caches, with each layer the
    resolved config compresses (a plain full-attention ``KVCache`` outside
    ``skip_layers``) replaced by an ``L2NormKVCache``. Rotating (sliding-window)
    and non-attention caches stay. ``config`` may be given resolved
    (:meth:`EvictionConfig.for_model`); it is then taken as it is."""
    caches = make_prompt_cache(model)
    if not isinstance(config, ResolvedEviction):
        config = (config or EvictionConfig()).for_model(model)
    if config.n_layers != len(caches):
        raise ValueError(f"these settings were resolved for a model of {config.n_layers} layers, not {len(caches)}")
    return [c if plan is None else L2NormKVCache(plan[0], config.n_sink, plan[1], config.keep)
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
        if isinstance(c, L2NormKVCache):
            out.append(c.copy())
            continue
        new = copy.copy(c)
        for name, value in vars(c).items():
            setattr(new, name, dup(value))
        out.append(new)
    return out
