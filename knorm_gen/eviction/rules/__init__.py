"""The eviction rules, one small class per rule family (kvpress-style): each states its
score and what the score needs (:class:`~knorm_gen.eviction.rules.base.Rule`); the selection
machinery they share is :mod:`knorm_gen.eviction.selection`.

- :mod:`.norm`: ``low`` (the paper's L2Norm rule, arXiv:2406.11430) and ``high`` (its ablation);
- :mod:`.keydiff`: ``keydiff`` (arXiv:2504.15364) and ``blend``;
- :mod:`.leverage`: ``leverage`` (Compactor, arXiv:2507.08143);
- :mod:`.question`: ``question``, the keys the job's instructions would attend to;
- :mod:`.baselines`: ``random`` and ``recent`` (StreamingLLM).

A new rule is one file here plus its line in :data:`RULES`; ``tests/test_rules.py``
runs the shared tests over every entry.
"""

from __future__ import annotations

from typing import Any

from .base import Rule
from .baselines import Random, Recent
from .keydiff import Blend, KeyDiff
from .leverage import Leverage
from .norm import High, Low
from .question import Question

RULES: dict[str, type[Rule]] = {cls.name: cls for cls in (Low, High, Random, Recent, KeyDiff, Blend, Leverage,
                                                           Question)}
"""Every rule by its ``keep`` name."""

KEEP_MODES = tuple(RULES)


def make_rule(name: str, **settings: Any) -> Rule:
    """The rule ``name`` with its own settings (``question_score`` for ``question``;
    settings another rule does not take are ignored)."""
    if name not in RULES:
        raise ValueError(f"keep must be one of {', '.join(RULES)}; got {name!r}")
    if name == Question.name:
        return Question(settings.get("question_score", "mean"))
    return RULES[name]()


def rule_needs(name: str) -> str:
    """What rule ``name``'s score needs: ``""``, ``"running"`` or ``"probe"``."""
    return RULES[name].needs


__all__ = ["KEEP_MODES", "RULES", "Rule", "make_rule", "rule_needs"]
