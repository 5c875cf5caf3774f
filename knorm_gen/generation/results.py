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
    ``compression_ratio`` the document's compression against the model's own cache: what
    the model's own cache holds of the document's positions over what is held of them, over
    every layer (eviction times quantization; the pinned tokens, held whole, are left out of
    both, so under ``ratio=R`` it is R on a model whose layers all attend to every position,
    and less where sliding-window layers hold only their window either way);
    ``full_bytes`` is the whole row in the model's own cache (what mlx_lm's
    ``make_prompt_cache`` holds after the same tokens, in the model's dtype: a full-attention
    layer every position, a sliding-window layer at most its window), ``kept_bytes`` what is
    held as stored, pinned tokens included (with ``kv_bits``: packed values plus scales and
    biases), and ``saved_bytes = full_bytes - kept_bytes`` the bytes eviction saves against
    the model's own cache;
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

    @property
    def saved_bytes(self) -> int:
        """Bytes saved against the model's own cache: ``full_bytes - kept_bytes``."""
        return self.full_bytes - self.kept_bytes

    def to_dict(self) -> dict:
        """A JSON-serialisable dict (with ``saved_bytes``)."""
        return {**asdict(self), "saved_bytes": self.saved_bytes}

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
