"""What a cache list holds and can ever hold: honest byte accounting over every layer.

``cache_stats`` reads a cache list after (or during) a run; ``kv_memory`` tells,
before any run, what a configuration implies for a model's KV memory per row.
Bytes are keys plus values summed over all layers. Every saving is counted against
the model's own cache: what mlx_lm's ``make_prompt_cache(model)`` holds after the same
tokens (a full-attention layer every position; a sliding-window layer, a
``RotatingKVCache``, at most its window; a skipped layer every position, as here).
What rows in flight reach together, and the limit they run under, is
:mod:`knorm_gen.generation.admission`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional, Union

import mlx.core as mx
import mlx.nn as nn

from ..platform.mlx_compat import KVCache, model_context_length
from .cache import EvictionKVCache, make_eviction_cache
from .config import EvictionConfig, ResolvedEviction
from .spans import span_positions


@dataclass
class CacheStats:
    """Totals over a cache list. Bytes are keys + values over all layers, as
    stored (``kv_bits``: packed values plus scales and biases); ``full_bytes`` is what the
    model's own cache (mlx_lm's ``make_prompt_cache``, in the model's dtype) holds after the
    same tokens: a full-attention layer every position, a sliding-window layer at most its
    window (positions held; mlx_lm's preallocation in steps of 256 is not counted).

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
    document_full_bytes: int = 0
    document_kept_bytes: int = 0

    @property
    def saved_bytes(self) -> int:
        """Bytes saved against the model's own cache: ``full_bytes - kept_bytes``."""
        return self.full_bytes - self.kept_bytes

    @property
    def compression_ratio(self) -> float:
        """The document's compression against the model's own cache: the bytes the model's own
        cache holds of the document's positions over the bytes held of them, over every layer
        (eviction times quantization). A layer that keeps every token (a skipped layer) and a
        sliding-window layer, which holds at most its window either way, count the same on both
        sides. The pinned tokens (template, question, answer), held whole, are left out of both,
        so under ``ratio=R`` this is R on a model whose layers all attend to every position, and
        less on a model with sliding-window layers (Gemma 2 and 3, Mistral-style). 1.0 when
        nothing is evicted."""
        if not self.document_kept_bytes:
            return 1.0
        return self.document_full_bytes / self.document_kept_bytes

    @property
    def token_ratio(self) -> float:
        """Tokens seen over tokens a layer at the base budget holds (eviction alone)."""
        return self.tokens_seen / self.tokens_kept if self.tokens_kept else 1.0


def _layer_bytes(c: Any) -> tuple[int, int, int, int]:
    """(tokens_seen, kept_bytes, full_bytes, bytes per position) of one layer's cache;
    ``full_bytes`` is what the model's own cache holds for the layer: an eviction layer
    replaces a full-attention ``KVCache`` (every position), and a cache the model made
    itself (a skipped layer's ``KVCache``, a ``RotatingKVCache``) holds what it holds."""
    if isinstance(c, EvictionKVCache):
        return c.tokens_seen, c.kept_bytes, c.full_bytes, c.bytes_per_position()
    keys = getattr(c, "keys", None)
    offset = getattr(c, "offset", None)
    if isinstance(keys, mx.array) and isinstance(offset, int) and keys.shape[2]:
        row = (keys.nbytes + c.values.nbytes) // keys.shape[2]
        return offset, c.size() * row, c.size() * row, row
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
    caches = list(caches)
    seen = kept = kept_b = full_b = compressed = ceiling = pinned = 0
    bounded = True
    doc_full, doc_kept = _document_bytes(caches)
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
                      pinned, doc_full, doc_kept)


def _document_bytes(caches: list) -> tuple[int, int]:
    """``(full, kept)`` bytes of the document's positions (inside the row's spans) over every
    layer that holds them per position, ``full`` as the model's own cache holds them: an
    eviction layer (a full-attention layer) all of them against its kept document tokens; a
    layer that keeps every token all of them on both sides; a sliding-window layer those of its
    window that are not pinned, on both sides. The spans are the eviction layers' (one row's:
    every such layer has them)."""
    evicting = [c for c in caches if isinstance(c, EvictionKVCache) and c.bounded and c.keys is not None]
    if not evicting:
        return 0, 0
    outside = evicting[0].offset - span_positions(evicting[0].row_spans, evicting[0].offset)  # all held, always
    full = kept = 0
    for c in caches:
        seen, _, _, row = _layer_bytes(c)
        if not row:
            continue
        doc_seen = max(seen - outside, 0)
        if isinstance(c, EvictionKVCache):
            full += doc_seen * c.full_precision_bytes_per_position()
            kept += max(c.tokens_kept - outside, 0) * c.bytes_per_position()
        else:
            held = min(doc_seen, max(c.size() - outside, 0) if layer_capacity(c) else doc_seen) * row
            full += held
            kept += held
    return full, kept


@dataclass
class KVMemory:
    """What an eviction config implies for a model's KV memory per row, known
    before any run: each layer's bytes per position and capacity (None: it
    keeps every token)."""

    layers: list[tuple[int, Optional[int]]]
    kv_bits: Optional[int] = None
    kv_group_size: Optional[int] = None
    ratio: Optional[float] = None  # the budget follows each document: these layers are for one of doc_tokens
    doc_tokens: Optional[int] = None
    cap: Optional[int] = None  # under ratio: the budget given with it, the most a compressed layer keeps
    own: Optional[list[tuple[int, Optional[int]]]] = None
    """The model's own cache (mlx_lm's ``make_prompt_cache``): each layer's bytes per position
    and capacity (None: every position; a sliding window: its size); None when not measured."""

    def own_bytes_at(self, tokens: int) -> Optional[int]:
        """KV bytes the model's own cache holds after ``tokens`` positions (None: not measured)."""
        if self.own is None:
            return None
        return sum(row * (tokens if cap is None else min(tokens, cap)) for row, cap in self.own)

    def own_line(self, tokens: int) -> str:
        """What the model's own cache holds at ``tokens`` positions, in words ("" when not measured)."""
        own = self.own_bytes_at(tokens)
        if own is None:
            return ""
        windows = sum(1 for _, cap in self.own if cap)
        where = (f"; {windows} of its {len(self.own)} layers are sliding windows that hold at most their window"
                 if windows else "")
        return f"; the model's own cache (mlx_lm's) holds {own / 2**20:.1f} MiB at {tokens} tokens{where}"

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

    def for_plan(self, eviction: "ResolvedEviction") -> "KVMemory":
        """The same layers with each compressed one's capacity the budget ``eviction`` plans for it
        (a row whose budget follows its document)."""
        if eviction.ratio is None or not eviction.sized:
            return self
        layers = [(row, plan.budget if plan is not None and cap is not None else cap)
                  for (row, cap), plan in zip(self.layers, eviction.layers)]
        return KVMemory(layers, self.kv_bits, self.kv_group_size, own=self.own)

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
        if self.ceiling_bytes is not None and self.ratio is not None:
            capped = f", at most {self.cap} tokens (--budget caps it)" if self.cap is not None else ""
            return (f"KV memory per row: 1/{self.ratio:g} of each document's tokens per compressed layer{capped}, so "
                    f"at most {self.ceiling_bytes / 2**20:.1f} MiB for a document of {self.doc_tokens} tokens (the "
                    f"model's context) and less for a shorter one, plus {self.pinned_bytes_per_token / 1024:.1f} KiB "
                    f"per pinned token (the instructions, question and answer); each record's kv_ceiling_bytes is "
                    f"its row's own{self.own_line(self.doc_tokens)}")
        if self.ceiling_bytes is not None:
            return (f"KV memory per row: at most {self.ceiling_bytes / 2**20:.1f} MiB for the document whatever its "
                    f"length, plus {self.pinned_bytes_per_token / 1024:.1f} KiB per pinned token (the instructions, "
                    f"question and answer); each record's kv_ceiling_bytes is its row's own{self.own_line(8192)}")
        grow = [i for i, (_, cap) in enumerate(self.layers) if cap is None]
        return (f"KV memory per row: no ceiling: {len(grow)} of {len(self.layers)} layers keep every token "
                f"(+{self.growth_bytes_per_token / 1024:.1f} KiB per token; "
                f"{self.bytes_at(8192) / 2**20:.1f} MiB at 8192 tokens){self.own_line(8192)}")


def kv_memory(model: nn.Module, config: Union[EvictionConfig, ResolvedEviction, None] = None,
              doc_tokens: Optional[int] = None) -> KVMemory:
    """The KV memory ``config`` implies for ``model`` (one token through fresh caches
    gives each layer's bytes per position in the dtype the model really caches). A budget
    that follows the document (``ratio``) is taken for a document of ``doc_tokens``
    (default: the model's context length, the longest a row can be)."""
    if not isinstance(config, ResolvedEviction):
        config = (config or EvictionConfig()).for_model(model)
    if not config.sized:
        doc_tokens = doc_tokens or model_context_length(model) or 8192
        config = config.for_document(doc_tokens, reserved=config.n_sink)  # sinks outside it: the most it holds
    caches = make_eviction_cache(model, config, ())  # the token pinned: nothing to score, no probe needed
    model(mx.array([[0]]), cache=caches)
    mx.eval([c.state for c in caches])
    bits = getattr(config, "kv_bits", None)
    return KVMemory([(_layer_bytes(c)[3], layer_capacity(c)) for c in caches], bits,
                    config.kv_group_size if bits else None, config.ratio, doc_tokens if config.ratio else None,
                    config.budget if config.ratio is not None else None, model_cache_layers(model))


def model_cache_layers(model: nn.Module) -> Optional[list[tuple[int, Optional[int]]]]:
    """The model's own cache, mlx_lm's ``make_prompt_cache(model)``, per layer: bytes per
    position (one token through it, in the dtype the model caches) and capacity (None: every
    position; a sliding window: its size). None where mlx_lm cannot build or feed it."""
    from ..platform.mlx_compat import make_prompt_cache

    try:
        caches = make_prompt_cache(model)
        model(mx.array([[0]]), cache=caches)
        mx.eval([c.state for c in caches])
    except Exception:  # noqa: BLE001  (an architecture mlx_lm's cache cannot serve: not counted)
        return None
    return [(_layer_bytes(c)[3], layer_capacity(c)) for c in caches]


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
