"""The eviction cache for several rows at once, on mlx_lm's batch cache protocol.

``BatchL2NormKVCache`` holds one layer's keys for B rows. Each (row, KV head)
selects exactly as :class:`~knorm_gen.cache.L2NormKVCache` does on that row
alone: the same ranks (score, then position), the row's own sinks, recent
window and true positions. Rows may differ in length; padding is never kept
and never counted.

Layout: row b's valid tokens fill slots ``[0, counts[b])`` for every head (the
order inside is not time order; attention does not need it). After a decode
step over budget each (row, head) has one *hole*, the slot it just evicted,
which the next decode step fills in place, as the single-row cache does; any
other operation first compacts the holes away. Invalid slots carry ``PAD``
rank. The mask of a call is per row: the first ``counts[b]`` stored slots, then
the incoming block causally.

mlx_lm builds one full-attention mask per forward from the first full-attention
layer's cache and hands it to every layer. With uncompressed ``skip_layers``
(full history) beside compressed layers (at most ``budget``) no single mask fits
both once rows differ in length, so :func:`own_layer_masks` lets each layer
build its mask from its own cache, for the duration of our calls only.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, _BaseCache

from .config import validate_eviction_args
from .scores import SCORES, pack_ranks, protect_recent

PAD = 2**63 - 1  # rank of an empty or padding slot: sorts last, never kept
_NEVER_EVICT = -(2**63)
_STEP = 256


class BatchL2NormKVCache(_BaseCache):
    """One layer's eviction cache for a batch of rows (see the module docstring)."""

    def __init__(self, budget: int = 512, n_sink: int = 4, recent: int = 0, keep: str = "low",
                 batch_size: int = 0, pinned: bool = False):
        validate_eviction_args(budget, n_sink, recent, keep)
        self.budget, self.n_sink, self.recent, self.keep = budget, n_sink, recent, keep
        self.pinned = pinned
        self.keys: Optional[mx.array] = None  # (B, H, capacity, D)
        self.values: Optional[mx.array] = None
        self.rank: Optional[mx.array] = None  # (B, H, capacity) int64
        self.counts: list[int] = [0] * batch_size  # valid slots per row
        self.seen: list[int] = [0] * batch_size  # true positions per row (RoPE offset)
        self.holes: list[bool] = [False] * batch_size
        self.free: Optional[mx.array] = None  # (B, H) the hole of each (row, head)
        self._lengths: Optional[list[int]] = None  # prepare(): real tokens per row, padded call
        self._consumed = 0
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
            if self.free is not None:
                self.free = self.free[sel]
        self.counts = [self.counts[i] for i in idx]
        self.seen = [self.seen[i] for i in idx]
        self.holes = [self.holes[i] for i in idx]
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
        self.counts += other.counts
        self.seen += other.seen
        self.holes += other.holes
        self._sync_offset()

    def extract(self, idx: int):
        """Row ``idx`` as a single-row :class:`~knorm_gen.cache.L2NormKVCache`."""
        from .cache import L2NormKVCache

        self._compact()
        single = L2NormKVCache(self.budget, self.n_sink, self.recent, self.keep)
        single.offset, single.count, single.pinned = self.seen[idx], self.counts[idx], self.pinned
        n = self.counts[idx]
        if self.keys is not None and n:
            single.keys = mx.contiguous(self.keys[idx : idx + 1, :, :n])
            single.values = mx.contiguous(self.values[idx : idx + 1, :, :n])
            single.rank = mx.contiguous(self.rank[idx : idx + 1, :, :n])
        return single

    @classmethod
    def merge(cls, caches: Sequence[Any]) -> "BatchL2NormKVCache":
        """One batch cache from single-row ``L2NormKVCache`` layers of the same settings."""
        first = caches[0]
        if any(_settings(c) != _settings(first) for c in caches):
            raise ValueError("cannot batch eviction caches with different budget/n_sink/recent/keep/pinned")
        out = cls(first.budget, first.n_sink, first.recent, first.keep, batch_size=len(caches),
                  pinned=first.pinned)
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
                k, v, r = c._rows()
            else:
                k = mx.zeros((1, k0.shape[1], 0, k0.shape[3]), k0.dtype)
                v = mx.zeros((1, v0.shape[1], 0, v0.shape[3]), v0.dtype)
                r = mx.zeros((1, k0.shape[1], 0), mx.int64)
            pad = width - n
            keys.append(mx.pad(k, [(0, 0), (0, 0), (0, pad), (0, 0)]))
            values.append(mx.pad(v, [(0, 0), (0, 0), (0, pad), (0, 0)]))
            ranks.append(mx.pad(r, [(0, 0), (0, 0), (0, pad)], constant_values=PAD))
        out.keys, out.values, out.rank = (mx.concatenate(x) for x in (keys, values, ranks))
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

    def _ranks(self, keys: mx.array, start: mx.array) -> mx.array:
        positions = start[:, None, None] + mx.arange(keys.shape[2], dtype=mx.int64)[None, None, :]
        return pack_ranks(SCORES[self.keep](keys, positions), positions, self.n_sink)

    def _decode(self, keys: mx.array, values: mx.array):
        counts = mx.array(self.counts, dtype=mx.int32)
        slot = mx.broadcast_to(counts[:, None], keys.shape[:2])
        if any(self.holes):
            slot = mx.where(mx.array(self.holes)[:, None], self.free.astype(mx.int32), slot)
        need = max((c + 1 for c, hole in zip(self.counts, self.holes) if not hole), default=0)
        if need > self.keys.shape[2]:
            cap = -(-need // _STEP) * _STEP
            self._grow_to(cap if self.pinned else max(need, min(cap, self.budget + 1)))
        rank = self._ranks(keys, mx.array(self.seen, dtype=mx.int64))
        at = slot[..., None, None]
        self.keys = mx.put_along_axis(self.keys, at, keys, axis=2)
        self.values = mx.put_along_axis(self.values, at, values, axis=2)
        self.rank = mx.put_along_axis(self.rank, slot[..., None], rank, axis=2)
        width = max(self.counts) + 1
        self.seen = [s + 1 for s in self.seen]
        self._sync_offset()
        out = self.keys[:, :, :width], self.values[:, :, :width]
        # Evict after attending: each over-budget (row, head) drops its worst rank into a hole.
        over = [not self.pinned and c + 1 > self.budget for c in self.counts]
        self.counts = [self.budget if o else c + 1 for c, o in zip(self.counts, over)]
        if any(over):
            valid = mx.arange(width)[None, :] < (counts + 1)[:, None]  # (B, width)
            key = self._evict_key(self.rank[:, :, :width])
            key = mx.where(valid[:, None, :], key, _NEVER_EVICT)
            victim = mx.argmax(key, axis=-1).astype(mx.uint32)  # (B, H)
            over_rows = mx.array(over)[:, None]
            dropped = mx.put_along_axis(self.rank, victim[..., None].astype(mx.int32),
                                        mx.array(PAD, dtype=mx.int64), axis=2)
            self.rank = mx.where(over_rows[..., None], dropped, self.rank)
            self.free = mx.where(over_rows, victim, self._free_or_zero())
        self.holes = over
        return out

    def _evict_key(self, rank: mx.array) -> mx.array:
        """Ranks with the recent window protected, per row (PAD stays PAD)."""
        if self.recent == 0:
            return rank
        first = (mx.array(self.seen, dtype=mx.int64) - self.recent)[:, None, None]
        return mx.where(rank == PAD, rank, protect_recent(rank, first))

    def _block(self, keys: mx.array, values: mx.array, real: list[int]):
        self._compact()
        b, h, n, _ = keys.shape
        width = max(self.counts, default=0)
        rank = self._ranks(keys, mx.array(self.seen, dtype=mx.int64))
        if any(r < n for r in real):  # right padding: never kept, never counted
            is_pad = mx.arange(n)[None, :] >= mx.array(real)[:, None]
            rank = mx.where(is_pad[:, None, :], PAD, rank)
        all_k = mx.concatenate([self.keys[:, :, :width], keys], axis=2)
        all_v = mx.concatenate([self.values[:, :, :width], values], axis=2)
        all_r = mx.concatenate([self.rank[:, :, :width], rank], axis=2)
        self.seen = [s + r for s, r in zip(self.seen, real)]
        self._sync_offset()
        total = [c + r for c, r in zip(self.counts, real)]
        self.counts = total if self.pinned else [min(t, self.budget) for t in total]
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
    return (c.budget, c.n_sink, c.recent, c.keep, bool(c.pinned))


def _as_list(x: Any) -> list:
    if isinstance(x, mx.array):
        return x.tolist()
    return list(x)


# ---- the shared-mask trap ----------------------------------------------------

_OWN_MASK = (BatchL2NormKVCache, BatchKVCache)


class _OwnMaskLayer:
    """Wraps one transformer block: with a full-attention batch cache it builds the
    mask from that layer's own cache instead of the one the model shares."""

    def __init__(self, block: Any):
        self._block = block

    def __call__(self, x, mask=None, cache=None, *args, **kwargs):
        if isinstance(cache, _OWN_MASK):
            mask = cache.make_mask(x.shape[1], return_array=True)
        return self._block(x, mask, cache, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._block, name)


@contextmanager
def own_layer_masks(model: Any) -> Iterator[None]:
    """While the block runs, every layer of ``model`` with a full-attention batch
    cache attends with a mask built from its own cache. The model's layer list is
    restored on exit, so outside our calls the model behaves exactly as before;
    nothing in mlx_lm is patched."""
    layers = model.layers
    if any(isinstance(block, _OwnMaskLayer) for block in layers):
        yield  # already inside our call
        return
    originals = list(layers)
    try:
        for i, block in enumerate(originals):
            layers[i] = _OwnMaskLayer(block)
        if not isinstance(model.layers[0], _OwnMaskLayer):
            raise TypeError(f"{type(model).__name__}.layers is not the list the model runs, so each layer cannot "
                            "build its own mask; batched eviction does not support this model")
        yield
    finally:
        layers[:] = originals
