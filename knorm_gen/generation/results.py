"""What one generated row returns: the text and the numbers that describe its cost."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

from ..eviction.memory import cache_stats


@dataclass
class GenerationResult:
    """A completion and the numbers that describe what it cost.

    ``tokens_seen`` is the number of positions the cache processed (prompt plus
    every generated token fed back, read from the cache's offset);
    ``tokens_kept`` the positions a layer at the base ``budget`` holds (the fewest
    any compressed layer holds: ``early_factor`` gives the first 30% of layers more than the
    budget, and ``layer_budgets`` may give others more; ``kept_bytes`` counts them all);
    ``compression_ratio`` the document's compression: what a full-precision full cache
    would hold of the document's positions over what is held of them, over every layer
    (eviction times quantization; the pinned tokens, held whole, are left out of both, so
    under ``ratio=R`` it is R); ``full_bytes`` is the whole row in a full-precision cache
    without eviction and ``kept_bytes`` what is held as stored, pinned tokens included
    (with ``kv_bits``: packed values plus scales and biases);
    ``token_ratio = tokens_seen / tokens_kept`` (eviction alone);
    ``kv_ceiling_bytes`` the most this row can ever hold: the budget plus its
    pinned tokens, with the whole ``max_tokens`` answer (None when some layer
    keeps every token, so memory grows with the input); ``tokens_pinned`` the
    tokens a compressed layer holds on top of its budget because they are not the
    document (the chat template, system turn, question and answer; more than the
    budget when the instructions alone are longer).
    """

    text: str
    finish_reason: str
    prompt_tokens: int
    generated_tokens: int
    tokens_seen: int
    tokens_kept: int
    compression_ratio: float
    kept_bytes: int
    full_bytes: int
    kv_ceiling_bytes: Optional[int]
    prefill_s: float
    decode_s: float
    prompt_tps: float
    generation_tps: float
    peak_memory_gb: float
    config: dict = field(default_factory=dict)
    question: Optional[str] = None
    context_prefill_s: Optional[float] = None
    tokens: list = field(default_factory=list)
    """The generated token ids, the final one included (an end-of-sequence token when
    ``finish_reason`` is ``"stop"``)."""
    tokens_pinned: int = 0
    token_ratio: float = 1.0
    long_document: Optional[dict] = None
    """What became of a document longer than the model's context (``long_documents``:
    :mod:`knorm_gen.generation.long_documents`); None when it fit."""

    def to_dict(self) -> dict:
        """A JSON-serialisable dict."""
        return asdict(self)

    @classmethod
    def from_caches(cls, caches: Sequence[Any], max_tokens: Optional[int] = None, **fields: Any) -> "GenerationResult":
        """A result whose cache numbers are read from ``caches`` (see :func:`cache_stats`);
        the ceiling counts ``prompt_tokens + max_tokens`` positions when given."""
        at = None if max_tokens is None else fields["prompt_tokens"] + max_tokens
        stats = cache_stats(caches, ceiling_at=at)
        return cls(tokens_seen=stats.tokens_seen, tokens_kept=stats.tokens_kept,
                   compression_ratio=stats.compression_ratio, kept_bytes=stats.kept_bytes,
                   full_bytes=stats.full_bytes, kv_ceiling_bytes=stats.ceiling_bytes,
                   tokens_pinned=stats.tokens_pinned, token_ratio=stats.token_ratio, **fields)
