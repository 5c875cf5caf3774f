"""What a cache list holds and can ever hold: honest byte accounting over every layer.

``cache_stats`` reads a cache list after (or during) a run; ``kv_memory`` tells,
before any run, what a configuration implies for a model's KV memory per row.
Bytes are keys plus values summed over all layers; skipped layers count at full
size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional, Union

import mlx.core as mx
import mlx.nn as nn

from .cache import L2NormKVCache, make_eviction_cache
from .config import EvictionConfig, ResolvedEviction
from .mlx_compat import KVCache


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
        return c.tokens_seen, c.kept_bytes, c.full_bytes, c.bytes_per_position()
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


def kv_memory(model: nn.Module, config: Union[EvictionConfig, ResolvedEviction, None] = None) -> KVMemory:
    """The KV memory ``config`` implies for ``model`` (one token through fresh caches
    gives each layer's bytes per position in the dtype the model really caches)."""
    caches = make_eviction_cache(model, config)
    model(mx.array([[0]]), cache=caches)
    mx.eval([c.state for c in caches])
    return KVMemory([(_layer_bytes(c)[3], layer_capacity(c)) for c in caches])
