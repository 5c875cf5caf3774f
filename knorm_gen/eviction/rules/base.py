"""What a rule is: a score per key, lower kept first, and what the score needs.

The caches share one selection machinery (:mod:`knorm_gen.eviction.selection`): a rule only
states its score, so a new rule is one small class in one file of this package plus
its entry in :data:`knorm_gen.eviction.rules.RULES`, and the shared tests
(``tests/test_rules.py``) cover it the day it is added.
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional, Sequence

import mlx.core as mx


class Rule:
    """A ranking rule. ``score(keys (B, H, N, D), positions (B, 1, N), state)`` gives one
    float32 per token ``(B, H, N)``; **lower is kept first**. ``needs`` says what
    ``state`` is:

    - ``""``: nothing (None): the keys alone;
    - ``"running"``: state over every token the row has seen, kept by the cache with
      :meth:`zeros`, :meth:`update` and read through :meth:`reference`; a block of
      more than one token re-scores the held keys against the updated state;
    - ``"probe"``: a probe of the job's instructions made before the document is read
      (:mod:`knorm_gen.eviction.rules.question`), fixed, so held keys are never re-scored.

    ``early``: the rule of the early layers under ``early_keep="auto"`` (None: this one).
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""  # what it keeps, in a few words: the command line's help lists it
    needs: ClassVar[str] = ""
    early: ClassVar[Optional[str]] = None

    def score(self, keys: mx.array, positions: mx.array, state: Any = None) -> mx.array:
        raise NotImplementedError

    def settings(self) -> dict:
        """The rule's own parameters, as config fields (empty for most rules)."""
        return {}

    # running state (``needs == "running"``)
    def zeros(self, batch: int, heads: int, dim: int) -> mx.array:
        raise NotImplementedError

    def update(self, state: Optional[mx.array], keys: mx.array, seen: Sequence[int],
               real: Sequence[int]) -> mx.array:
        raise NotImplementedError

    def reference(self, state: mx.array, seen: Sequence[int]) -> mx.array:
        return state

    def __eq__(self, other: Any) -> bool:
        return type(other) is type(self) and other.settings() == self.settings()

    def __hash__(self) -> int:
        return hash((self.name, tuple(sorted(self.settings().items()))))

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.settings().items())
        return f"{type(self).__name__}({params})"


def squared_norm(keys: mx.array) -> mx.array:
    """``|k|^2`` per key, float32 whatever the cache dtype (no sqrt: the order is the norm's)."""
    return mx.sum(mx.square(keys.astype(mx.float32)), axis=-1)


def unit_keys(keys: mx.array) -> mx.array:
    """Keys scaled to unit length, float32 (a zero key stays zero)."""
    return keys.astype(mx.float32) * mx.rsqrt(mx.maximum(squared_norm(keys), 1e-30))[..., None]
