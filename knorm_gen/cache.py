"""L2Norm key-norm KV-cache eviction on mlx_lm's cache protocol.

Devoto et al. (arXiv:2406.11430): a key with a low L2 norm tends to draw high
attention, so when a layer's cache is over budget we keep the lowest-norm keys.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import cache as _mlx_cache
from mlx_lm.models.cache import KVCache, _BaseCache, create_attention_mask, make_prompt_cache

from .config import (  # noqa: F401  (re-exported: they lived here first)
    KEEP_MODES,
    EvictionConfig,
    auto_recent,
    default_skip_layers,
    early_layers,
    validate_eviction_args,
)
from .scores import SCORES, pack_ranks, protect_recent, rank_positions

_STEP = 256


def missing_mlx_lm_protocol() -> list[str]:
    """The pieces of mlx_lm's cache protocol this module relies on that the
    installed mlx_lm lacks; empty when all are there. pyproject.toml pins the
    tested range; this names what broke if someone installs another."""
    from mlx_lm.models import base as _base

    missing = []
    for name in ("_BaseCache", "KVCache", "RotatingKVCache", "make_prompt_cache", "load_prompt_cache",
                 "save_prompt_cache", "create_attention_mask"):
        if not hasattr(_mlx_cache, name):
            missing.append(f"mlx_lm.models.cache.{name}")
    if not callable(getattr(getattr(_mlx_cache, "_BaseCache", None), "from_state", None)):
        missing.append("mlx_lm.models.cache._BaseCache.from_state (load_prompt_cache rebuilds caches with it)")
    try:
        if "globals()" not in inspect.getsource(_mlx_cache.load_prompt_cache):
            missing.append("load_prompt_cache looking cache classes up by name in mlx_lm.models.cache")
    except (OSError, TypeError, AttributeError):
        missing.append("the source of mlx_lm.models.cache.load_prompt_cache")
    wanted = {
        (_base, "create_attention_mask"): ("h", "cache", "window_size", "return_array"),
        (_base, "create_causal_mask"): ("N", "offset", "window_size"),
        (_mlx_cache, "create_attention_mask"): ("N", "offset", "return_array", "window_size"),
    }
    for (module, name), params in wanted.items():
        fn = getattr(module, name, None)
        have = set(inspect.signature(fn).parameters) if callable(fn) else set()
        for p in params:
            if p not in have:
                missing.append(f"{module.__name__}.{name}(..., {p}=...)")
    return missing


class L2NormKVCache(_BaseCache):
    """A KV cache holding at most ``budget`` tokens per (batch row, KV head).

    Attend first, evict after: ``update_and_fetch`` returns every kept row plus
    the whole incoming block, then cuts the stored state back to the budget.
    Over budget it keeps the ``budget`` smallest ``(score, position)`` pairs
    among evictable tokens, where score is the key's L2 norm (``keep="low"``),
    its negation (``"high"``), a random draw (``"random"``) or the negated
    position (``"recent"``). The first ``n_sink`` positions and the last
    ``recent`` positions are never evicted. Scores are computed once, in
    float32, when a token is inserted.
    """

    def __init__(self, budget: int = 512, n_sink: int = 4, recent: int = 0, keep: str = "low"):
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

    # ---- mlx_lm protocol -------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        n = keys.shape[2]
        rank = self._rank(keys, self.offset)
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
        return (
            self.keys, self.values, self.rank, self.free,
            self.count, self.offset, self.budget, self.n_sink, self.recent, self.keep, int(self.pinned),
        )

    @state.setter
    def state(self, v):
        (self.keys, self.values, self.rank, self.free,
         self.count, self.offset, self.budget, self.n_sink, self.recent, self.keep, pinned) = v
        self.pinned = bool(pinned)

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

    def _row_bytes(self) -> int:
        if self.keys is None:
            return 0
        b, h, _, dk = self.keys.shape
        return b * h * (dk * self.keys.dtype.size + self.values.shape[3] * self.values.dtype.size)

    @property
    def kept_bytes(self) -> int:
        """Key and value bytes of the rows held."""
        return self.count * self._row_bytes()

    @property
    def full_bytes(self) -> int:
        """Key and value bytes an unbounded cache would hold for the same tokens."""
        return self.offset * self._row_bytes()

    # ---- user-facing extras ---------------------------------------------------
    def pin(self) -> None:
        """Stop evicting: every later token is kept (a question over a compressed context)."""
        self.pinned = True

    @classmethod
    def merge(cls, caches: Sequence["L2NormKVCache"]):
        """A :class:`~knorm_gen.batch_cache.BatchL2NormKVCache` of these single-row
        caches. mlx_lm batches caches through ``merge``; the one inherited from
        ``KVCache`` would build a plain ``BatchKVCache`` and silently stop evicting."""
        from .batch_cache import BatchL2NormKVCache

        return BatchL2NormKVCache.merge(caches)

    def copy(self) -> "L2NormKVCache":
        """An independent copy (MLX writes into a shared array object would leak across copies)."""
        new = L2NormKVCache.__new__(L2NormKVCache)
        new.state = tuple(mx.array(x) if isinstance(x, mx.array) else x for x in self.state)
        return new

    def ordered_state(self) -> tuple[mx.array, mx.array, mx.array]:
        """Kept ``(keys, values, positions)`` per head, sorted by position."""
        keys, values, rank = self._rows()
        pos = rank_positions(rank)
        order = mx.argsort(pos, axis=-1)
        return (
            mx.take_along_axis(keys, order[..., None], axis=2),
            mx.take_along_axis(values, order[..., None], axis=2),
            mx.take_along_axis(pos, order, axis=-1),
        )

    # ---- internals -------------------------------------------------------------
    def _rank(self, keys: mx.array, start: int) -> mx.array:
        """int64 rank per incoming token; ascending = kept first."""
        positions = mx.arange(start, start + keys.shape[2], dtype=mx.int64)[None, None]
        return pack_ranks(SCORES[self.keep](keys, positions), positions, self.n_sink)

    def _evict_key(self, rank: mx.array) -> mx.array:
        return rank if self.recent == 0 else protect_recent(rank, self.offset - self.recent)

    def _rows(self) -> tuple[mx.array, mx.array, mx.array]:
        """The held rows without the evicted slot (stored order, not time order)."""
        if self.free is None:
            return tuple(a[:, :, : self.count] for a in (self.keys, self.values, self.rank))
        slots = mx.arange(self.count, dtype=mx.int32)
        idx = slots + (slots >= self.free[..., None]).astype(mx.int32)
        return (
            mx.take_along_axis(self.keys, idx[..., None], axis=2),
            mx.take_along_axis(self.values, idx[..., None], axis=2),
            mx.take_along_axis(self.rank, idx, axis=-1),
        )

    def _compact(self) -> None:
        if self.free is not None:
            self.keys, self.values, self.rank = self._rows()
            self.free = None

    def _capacity(self, rows: int) -> int:
        cap = -(-rows // _STEP) * _STEP
        return cap if self.pinned else max(rows, min(cap, self.budget + 1))

    def _append(self, keys, values, rank) -> None:
        n = keys.shape[2]
        cap = 0 if self.keys is None else self.keys.shape[2]
        if self.count + n > cap:
            b, h = keys.shape[:2]
            grow = self._capacity(self.count + n) - cap
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
                mx.concatenate([a, b], axis=2) for a, b in zip(self._rows(), (keys, values, rank))
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


# load_prompt_cache rebuilds caches by class name from mlx_lm's cache module.
_mlx_cache.L2NormKVCache = L2NormKVCache


def make_eviction_cache(model: nn.Module, config: EvictionConfig | None = None) -> list:
    """A fresh per-layer cache list: the model's own caches, with each plain
    full-attention ``KVCache`` outside ``skip_layers`` replaced by an
    ``L2NormKVCache``. Rotating (sliding-window) and non-attention caches stay."""
    caches = make_prompt_cache(model)
    full = [i for i, c in enumerate(caches) if type(c) is KVCache]
    config = (config or EvictionConfig()).resolved(len(caches), full)
    if config.budget is None:
        return caches
    n = len(caches)  # resolved() has checked every index against it
    skip = {i % n for i in config.skip_layers}
    budgets = {i % n: b for i, b in (config.layer_budgets or {}).items()}
    out = []
    for i, c in enumerate(caches):
        if type(c) is KVCache and i not in skip:
            b = budgets.get(i, config.budget)
            recent = config.recent if i not in budgets else config.layer_recent(b)
            c = L2NormKVCache(b, config.n_sink, recent, config.keep)
        out.append(c)
    return out


@dataclass
class CacheStats:
    """Totals over a cache list. Bytes are keys + values over all layers.

    ``ceiling_bytes`` is the most this cache list can ever hold whatever the
    input length, or None when a layer keeps every token (a plain ``KVCache``,
    e.g. a skipped layer): then memory grows with the input.
    """

    tokens_seen: int
    tokens_kept: int
    kept_bytes: int
    full_bytes: int
    compressed_layers: int
    ceiling_bytes: Optional[int] = None

    @property
    def compression_ratio(self) -> float:
        return self.full_bytes / self.kept_bytes if self.kept_bytes else 1.0


def _layer_bytes(c: Any) -> tuple[int, int, int, int]:
    """(tokens_seen, kept_bytes, full_bytes, bytes per position) of one layer's cache."""
    if isinstance(c, L2NormKVCache):
        return c.tokens_seen, c.kept_bytes, c.full_bytes, c._row_bytes()
    keys = getattr(c, "keys", None)
    offset = getattr(c, "offset", None)
    if isinstance(keys, mx.array) and isinstance(offset, int) and keys.shape[2]:
        row = (keys.nbytes + c.values.nbytes) // keys.shape[2]
        return offset, c.size() * row, offset * row, row
    nbytes = 0 if c.empty() else c.nbytes
    return (offset or 0), nbytes, nbytes, 0


def layer_capacity(c: Any) -> Optional[int]:
    """Positions a layer's cache can ever hold (None: every token, no ceiling).
    A pinned eviction cache (a question over a compressed context) counts at its
    budget: the question and answer tokens come on top."""
    if isinstance(c, L2NormKVCache):
        return c.budget
    max_size = getattr(c, "max_size", None)  # RotatingKVCache: a sliding window
    if isinstance(max_size, int):
        return max_size
    return None if isinstance(c, KVCache) else 0


def cache_stats(caches: Iterable[Any]) -> CacheStats:
    """Honest accounting over every layer (skipped layers count at full size)."""
    seen = kept = kept_b = full_b = compressed = ceiling = 0
    bounded = True
    for c in caches:
        s, kb, fb, row = _layer_bytes(c)
        seen = max(seen, s)
        kept_b += kb
        full_b += fb
        cap = layer_capacity(c)
        if cap is None:
            bounded = False
        else:
            ceiling += cap * row if row else kb
        if isinstance(c, L2NormKVCache):
            compressed += 1
            # the fewest: the layers at the base budget (layer_budgets may give others more)
            kept = c.tokens_kept if compressed == 1 else min(kept, c.tokens_kept)
    return CacheStats(seen, kept if compressed else seen, kept_b, full_b, compressed, ceiling if bounded else None)


@dataclass
class KVMemory:
    """What an eviction config implies for a model's KV memory per row, known
    before any run: each layer's bytes per position and capacity (None: it
    keeps every token)."""

    layers: list[tuple[int, Optional[int]]]

    @property
    def ceiling_bytes(self) -> Optional[int]:
        """The most one row can ever hold, or None when memory grows with the input."""
        if any(cap is None for _, cap in self.layers):
            return None
        return sum(row * cap for row, cap in self.layers)

    @property
    def growth_bytes_per_token(self) -> int:
        """Bytes every further token adds once the bounded layers are full."""
        return sum(row for row, cap in self.layers if cap is None)

    def bytes_at(self, tokens: int) -> int:
        """KV bytes held after ``tokens`` positions."""
        return sum(row * (tokens if cap is None else min(tokens, cap)) for row, cap in self.layers)

    def describe(self) -> str:
        if self.ceiling_bytes is not None:
            return f"KV memory per row: at most {self.ceiling_bytes / 2**20:.1f} MiB, whatever the input length"
        grow = [i for i, (_, cap) in enumerate(self.layers) if cap is None]
        return (f"KV memory per row: no ceiling: {len(grow)} of {len(self.layers)} layers keep every token "
                f"(+{self.growth_bytes_per_token / 1024:.1f} KiB per token; "
                f"{self.bytes_at(8192) / 2**20:.1f} MiB at 8192 tokens)")


def kv_memory(model: nn.Module, config: EvictionConfig | None = None) -> KVMemory:
    """The KV memory ``config`` implies for ``model`` (one token through fresh caches
    gives each layer's bytes per position in the dtype the model really caches)."""
    caches = make_eviction_cache(model, config)
    model(mx.array([[0]]), cache=caches)
    mx.eval([c.state for c in caches])
    return KVMemory([(_layer_bytes(c)[3], layer_capacity(c)) for c in caches])


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
