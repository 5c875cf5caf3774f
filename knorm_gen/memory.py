"""What a cache list holds and can ever hold: honest byte accounting over every layer.

``cache_stats`` reads a cache list after (or during) a run; ``kv_memory`` tells,
before any run, what a configuration implies for a model's KV memory per row.
Bytes are keys plus values summed over all layers; skipped layers count at full
size. What rows in flight reach together, and the limit they run under, is
:mod:`knorm_gen.admission`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional, Union

import mlx.core as mx
import mlx.nn as nn

from .cache import EvictionKVCache, make_eviction_cache
from .config import EvictionConfig, ResolvedEviction
from .mlx_compat import KVCache


@dataclass
class CacheStats:
    """Totals over a cache list. Bytes are keys + values over all layers, as
    stored (``kv_bits``: packed values plus scales and biases); ``full_bytes`` is what a
    full-precision cache without eviction would hold.

    ``ceiling_bytes`` is the most this cache list can ever hold for its row
    (the budget plus the row's pinned tokens: its instructions, question and
    answer), or None when a layer keeps every token (a plain ``KVCache``, e.g. a
    skipped layer): then memory grows with the input. ``tokens_pinned`` are the
    tokens a compressed layer holds on top of its budget.
    """

    tokens_seen: int
    tokens_kept: int
    kept_bytes: int
    full_bytes: int
    compressed_layers: int
    ceiling_bytes: Optional[int] = None
    tokens_pinned: int = 0

    @property
    def compression_ratio(self) -> float:
        """Bytes a full-precision full cache would hold over the bytes held (eviction
        times quantization)."""
        return self.full_bytes / self.kept_bytes if self.kept_bytes else 1.0

    @property
    def token_ratio(self) -> float:
        """Tokens seen over tokens a layer at the base budget holds (eviction alone)."""
        return self.tokens_seen / self.tokens_kept if self.tokens_kept else 1.0


def _layer_bytes(c: Any) -> tuple[int, int, int, int]:
    """(tokens_seen, kept_bytes, full_bytes, bytes per position) of one layer's cache."""
    if isinstance(c, EvictionKVCache):
        return c.tokens_seen, c.kept_bytes, c.full_bytes, c.bytes_per_position()
    keys = getattr(c, "keys", None)
    offset = getattr(c, "offset", None)
    if isinstance(keys, mx.array) and isinstance(offset, int) and keys.shape[2]:
        row = (keys.nbytes + c.values.nbytes) // keys.shape[2]
        return offset, c.size() * row, offset * row, row
    nbytes = 0 if c.empty() else c.nbytes
    return (offset or 0), nbytes, nbytes, 0


def layer_capacity(c: Any, seen: Optional[int] = None) -> Optional[int]:
    """Positions a layer's cache can ever hold (None: every token, no ceiling).
    An eviction cache counts at its budget plus the row's pinned tokens among the
    first ``seen`` positions (default: those fed so far; give the prompt plus
    ``max_tokens`` for the most the row can reach)."""
    if isinstance(c, EvictionKVCache):
        if not c.bounded:  # kv_bits without eviction: quantized, but every token kept
            return None
        return c.limit_at(c.offset if seen is None else max(seen, c.offset))
    max_size = getattr(c, "max_size", None)  # RotatingKVCache: a sliding window
    if isinstance(max_size, int):
        return max_size
    return None if isinstance(c, KVCache) else 0


def cache_stats(caches: Iterable[Any], ceiling_at: Optional[int] = None) -> CacheStats:
    """Honest accounting over every layer (skipped layers count at full size).
    ``ceiling_at``: the positions the row can reach (prompt plus ``max_tokens``),
    for its ceiling; default, those fed so far."""
    seen = kept = kept_b = full_b = compressed = ceiling = pinned = 0
    bounded = True
    for c in caches:
        s, kb, fb, row = _layer_bytes(c)
        seen = max(seen, s)
        kept_b += kb
        full_b += fb
        cap = layer_capacity(c, ceiling_at)
        if cap is None:
            bounded = False
        else:
            ceiling += cap * row if row else kb
        if isinstance(c, EvictionKVCache) and c.bounded:
            compressed += 1
            # the fewest: the layers at the base budget (layer_budgets may give others more)
            kept = c.tokens_kept if compressed == 1 else min(kept, c.tokens_kept)
            pinned = c.tokens_pinned
    return CacheStats(seen, kept if compressed else seen, kept_b, full_b, compressed, ceiling if bounded else None,
                      pinned)


@dataclass
class KVMemory:
    """What an eviction config implies for a model's KV memory per row, known
    before any run: each layer's bytes per position and capacity (None: it
    keeps every token)."""

    layers: list[tuple[int, Optional[int]]]
    kv_bits: Optional[int] = None
    kv_group_size: Optional[int] = None

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

    @property
    def pinned_bytes_per_token(self) -> int:
        """Bytes each pinned token (instruction, question, answer) adds on top of a bounded layer's budget."""
        return sum(row for row, cap in self.layers if cap is not None and cap > 0)

    def describe(self) -> str:
        stored = (f" (keys and values stored at {self.kv_bits} bits, groups of {self.kv_group_size}; "
                  f"sliding-window layers in full precision)" if self.kv_bits else "")
        return self._describe() + stored

    def _describe(self) -> str:
        if self.ceiling_bytes is not None:
            return (f"KV memory per row: at most {self.ceiling_bytes / 2**20:.1f} MiB for the document whatever its "
                    f"length, plus {self.pinned_bytes_per_token / 1024:.1f} KiB per pinned token (the instructions, "
                    f"question and answer); each record's kv_ceiling_bytes is its row's own")
        grow = [i for i, (_, cap) in enumerate(self.layers) if cap is None]
        return (f"KV memory per row: no ceiling: {len(grow)} of {len(self.layers)} layers keep every token "
                f"(+{self.growth_bytes_per_token / 1024:.1f} KiB per token; "
                f"{self.bytes_at(8192) / 2**20:.1f} MiB at 8192 tokens)")


def kv_memory(model: nn.Module, config: Union[EvictionConfig, ResolvedEviction, None] = None) -> KVMemory:
    """The KV memory ``config`` implies for ``model`` (one token through fresh caches
    gives each layer's bytes per position in the dtype the model really caches)."""
    caches = make_eviction_cache(model, config, ())  # the token pinned: nothing to score, no probe needed
    model(mx.array([[0]]), cache=caches)
    mx.eval([c.state for c in caches])
    bits = getattr(config, "kv_bits", None)
    return KVMemory([(_layer_bytes(c)[3], layer_capacity(c)) for c in caches], bits,
                    config.kv_group_size if bits else None)


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
