"""Variants: a rule wrapped so that a share of its slots holds positions its scores did not
choose (kvpress's wrapper presses, e.g. ``PerLayerCompressionPress(press, ratios)``).

``Coverage(Question(), 0.25)`` keeps a quarter of each layer's budget evenly spread over the
positions seen; ``Spread(Question(), 0.5)`` keeps half of the rule's slots for positions drawn
at random, each KV head and layer its own. A variant scores, prepares and updates exactly as
the rule it wraps (every hook is the wrapped rule's), so the cache holds it as it holds any
rule. The cache asks only :meth:`Rule.variants` for the tiers to rank ahead of the scores:
each variant says how many slots it takes (:meth:`Variant.slots`) and marks them
(:meth:`Variant.mark`). Its share is a setting under its own key (``coverage``, ``spread``),
so it reaches options, job files, records and fingerprints as a rule's settings do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Sequence

import mlx.core as mx

from ..selection import carry_slots, cover, cover_slots, spread_tier, stratify_tier
from .base import Rule


def _of_rule(attr: str) -> property:
    """A property that reads ``attr`` of the wrapped rule."""
    return property(lambda self: getattr(self.rule, attr), doc=f"The wrapped rule's ``{attr}``.")


@dataclass(frozen=True, eq=True)
class Variant(Rule):
    """A rule whose every hook is ``rule``'s, with ``share`` of its slots ranked ahead of its
    scores by :meth:`mark`. ``after_carry``: whether the variant's tier comes after the carried
    positions (a share of what the rule itself would choose) or before them."""

    rule: Rule = None  # type: ignore[assignment]
    share: float = 0.0
    key: ClassVar[str] = ""
    after_carry: ClassVar[bool] = False

    def __post_init__(self):
        if not isinstance(self.rule, Rule):
            raise TypeError(f"{type(self).__name__} wraps a rule object (e.g. Question()), got {self.rule!r}")
        self.check_share("share", key=self.key)

    # ---- every hook is the wrapped rule's ----------------------------------------
    name = _of_rule("name")  # type: ignore[assignment]
    summary = _of_rule("summary")  # type: ignore[assignment]
    reads_probe = _of_rule("reads_probe")  # type: ignore[assignment]
    penalty = _of_rule("penalty")  # type: ignore[assignment]
    early = _of_rule("early")  # type: ignore[assignment]
    carry = _of_rule("carry")  # type: ignore[assignment]
    carries = _of_rule("carries")

    def score(self, keys: mx.array, positions: mx.array, state: Any = None) -> mx.array:
        return self.rule.score(keys, positions, state)

    def update(self, state: Any, keys: mx.array, seen: Sequence[int], real: Sequence[int]) -> Optional[mx.array]:
        return self.rule.update(state, keys, seen, real)

    def reference(self, state: Any, seen: Sequence[int]) -> Any:
        return self.rule.reference(state, seen)

    def zeros(self, batch: int, heads: int, dim: int) -> mx.array:
        return self.rule.zeros(batch, heads, dim)

    def prepare(self, probes: Sequence[Any]) -> Any:
        return self.rule.prepare(probes)

    def settings(self) -> dict:
        return {**self.rule.settings(), self.key: self.share}

    def variants(self) -> tuple["Variant", ...]:
        return (*self.rule.variants(), self)

    def base(self) -> Rule:
        return self.rule.base()

    # ---- what the variant keeps ----------------------------------------------------
    def slots(self, budget: int, reserved: int) -> int:
        """Slots of a layer's ``budget`` this variant takes beside the ``reserved`` ones: ``share`` of
        those left to the rule (as carry counts its own)."""
        return carry_slots(budget, self.share, reserved)

    def mark(self, key: mx.array, seen: Sequence[int], slots: Sequence[int], salt: int) -> mx.array:
        """``key`` (the eviction ranks) with each row's ``slots[b]`` positions of this variant
        moved to its tier, ahead of the scores; ``salt`` is the layer."""
        raise NotImplementedError


@dataclass(frozen=True, eq=True)
class Coverage(Variant):
    """``share`` of each layer's budget kept evenly spread over the positions seen, the same
    positions in every head (:func:`~knorm_gen.eviction.selection.cover`): what a summary of the
    whole document needs beside what the rule keeps."""

    key: ClassVar[str] = "coverage"

    def slots(self, budget: int, reserved: int) -> int:
        return cover_slots(budget, self.share, reserved)

    def mark(self, key: mx.array, seen: Sequence[int], slots: Sequence[int], salt: int) -> mx.array:
        return cover(key, seen, slots) if any(slots) else key


@dataclass(frozen=True, eq=True)
class Spread(Variant):
    """``share`` of the rule's slots (beside the sinks, the recent window and coverage) held by
    positions drawn at random, each KV head and layer its own
    (:func:`~knorm_gen.eviction.selection.spread_tier`): what random eviction would keep."""

    key: ClassVar[str] = "spread"
    after_carry: ClassVar[bool] = True

    def mark(self, key: mx.array, seen: Sequence[int], slots: Sequence[int], salt: int) -> mx.array:
        return spread_tier(key, slots, salt)


@dataclass(frozen=True, eq=True)
class Stratify(Variant):
    """``share`` of the rule's slots (beside the sinks, the recent window and coverage) given out
    over stretches of the positions seen, each stretch its share by length, to the positions the
    rule ranks best within it (:func:`~knorm_gen.eviction.selection.stratify_tier`): the rule still
    chooses, but no stretch of the document is left bare because another scores higher."""

    key: ClassVar[str] = "stratify"
    after_carry: ClassVar[bool] = True

    def mark(self, key: mx.array, seen: Sequence[int], slots: Sequence[int], salt: int) -> mx.array:
        return stratify_tier(key, seen, slots)


VARIANTS: dict[str, type[Variant]] = {cls.key: cls for cls in (Coverage, Stratify, Spread)}
"""Every variant by the key of its share."""


def with_variants(rule: Rule, coverage: float = 0.0, spread: float = 0.0, stratify: float = 0.0) -> Rule:
    """``rule`` wrapped by each variant whose share is above 0 (none: ``rule`` itself)."""
    if coverage:
        rule = Coverage(rule, coverage)
    if stratify:
        rule = Stratify(rule, stratify)
    if spread:
        rule = Spread(rule, spread)
    return rule


def share_of(rule: Rule, key: str) -> float:
    """The share of the variant of ``key`` (``coverage``, ``spread``) wrapping ``rule``; 0 if none does."""
    return sum(v.share for v in rule.variants() if v.key == key)
