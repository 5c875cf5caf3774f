"""What a cache list holds and can ever hold: honest byte accounting over every layer.

``cache_stats`` reads a cache list after (or during) a run; ``kv_memory`` tells,
before any run, what a configuration implies for a model's KV memory per row.
Bytes are keys plus values summed over all layers; skipped layers count at full
size.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Union

import mlx.core as mx
import mlx.nn as nn

from .cache import EvictionKVCache, make_eviction_cache
from .config import EvictionConfig, ResolvedEviction
from .mlx_compat import KVCache


@dataclass
class CacheStats:
    """Totals over a cache list. Bytes are keys + values over all layers.

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
        return self.full_bytes / self.kept_bytes if self.kept_bytes else 1.0


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
        if isinstance(c, EvictionKVCache):
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
    caches = make_eviction_cache(model, config)
    model(mx.array([[0]]), cache=caches)
    mx.eval([c.state for c in caches])
    return KVMemory([(_layer_bytes(c)[3], layer_capacity(c)) for c in caches])


# ---- what rows in flight can reach ---------------------------------------------------

DEFAULT_KV_SHARE = 0.5
"""The default ``--max-kv-memory``: this share of the machine's memory (of Metal's
recommended working set on a Mac), leaving the rest to the weights, the prefill's
transient activations and everything else on the machine."""


class KVMemoryExceeded(ValueError):
    """A row needs more KV memory than the limit allows, even alone."""


@dataclass(frozen=True)
class KVNeed:
    """The most KV memory one sequence can reach: the bytes of its bounded layers,
    and the positions its layers that keep every token will hold."""

    bounded_bytes: int
    unbounded_positions: int


def sequence_need(memory: KVMemory, tokens: int, pinned: int = 0) -> KVNeed:
    """What a sequence of ``tokens`` positions (prompt plus ``max_tokens``) can reach;
    the last ``pinned`` of them (a question and its answer over a compressed context)
    are never evicted, so they come on top of a bounded layer's budget."""
    bounded = sum(row * (min(tokens - pinned, cap) + pinned) for row, cap in memory.layers if cap is not None)
    return KVNeed(bounded, tokens if memory.growth_bytes_per_token else 0)


_BATCH_STEP = 256  # mlx_lm's BatchKVCache grows in steps of 256 positions


def batch_bytes(needs: list[KVNeed], growth_bytes_per_token: int) -> int:
    """KV bytes a batch of these sequences can reach together. mlx_lm's batch cache
    for a layer that keeps every token pads every row to the longest one, so those
    layers cost rows x the longest row (in 256-position steps), not the sum."""
    if not needs:
        return 0
    longest = max(n.unbounded_positions for n in needs)
    longest = -(-longest // _BATCH_STEP) * _BATCH_STEP
    return sum(n.bounded_bytes for n in needs) + len(needs) * longest * growth_bytes_per_token


def machine_memory_bytes() -> int:
    """Metal's recommended working set on an Apple GPU, else the machine's physical memory."""
    try:
        if mx.metal.is_available():
            info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
            return int(info["max_recommended_working_set_size"])
    except (AttributeError, KeyError, RuntimeError, TypeError, ValueError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_kv_limit() -> int:
    """The default limit on KV memory in flight: :data:`DEFAULT_KV_SHARE` of
    :func:`machine_memory_bytes`."""
    return int(DEFAULT_KV_SHARE * machine_memory_bytes())


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
