"""The eviction rules, one small class per rule family (kvpress-style): each states its
score and the hooks it needs the cache to call (:class:`~knorm_gen.eviction.rules.base.Rule`); the selection
machinery they share is :mod:`knorm_gen.eviction.selection`.

- :mod:`.norm`: ``low`` (the paper's L2Norm rule, arXiv:2406.11430) and ``high`` (its ablation);
- :mod:`.keydiff`: ``keydiff`` (arXiv:2504.15364) and ``blend``;
- :mod:`.leverage`: ``leverage`` (Compactor, arXiv:2507.08143);
- :mod:`.question`: ``question``, the keys the job's instructions would attend to;
- :mod:`.baselines`: ``random`` and ``recent`` (StreamingLLM).

A new rule is one file here plus its line in :data:`RULES`; its settings are its dataclass
fields (:func:`~knorm_gen.eviction.rules.base.setting`), which become config fields, options,
job-file keys and record keys by themselves. ``tests/test_rules.py`` runs the shared tests
over every entry; its numpy reference for the new rule is the third file.

:mod:`.variants` (imported from there) wraps any rule: ``Coverage(rule, share)``, ``Stratify(rule, share)``
and ``Spread(rule, share)`` set a share of its slots apart (the config fields of those names).
"""

from __future__ import annotations

from dataclasses import Field
from typing import Any, Union

from .base import Rule, setting
from .baselines import Random, Recent
from .keydiff import Blend, KeyDiff
from .leverage import Leverage
from .norm import High, Low
from .question import Question

RULES: dict[str, type[Rule]] = {cls.name: cls for cls in (Low, High, Random, Recent, KeyDiff, Blend, Leverage,
                                                           Question)}
"""Every rule by its ``keep`` name."""

KEEP_MODES = tuple(RULES)


def make_rule(keep: Union[str, Rule], **settings: Any) -> Rule:
    """The rule ``keep`` (a name of :data:`RULES`, or a rule object, returned as it is) with its
    own settings taken from ``settings`` by their keys (``question_score=...``); keys of other
    rules' settings are ignored."""
    if isinstance(keep, Rule):
        return keep
    if keep not in RULES:
        raise ValueError(f"keep must be one of {', '.join(RULES)}; got {keep!r}")
    return RULES[keep].from_settings(settings)


def setting_fields() -> dict[str, tuple[type[Rule], Field]]:
    """Every rule's settings by their key: the rule that owns each and its field."""
    return {key: (cls, f) for cls in RULES.values() for key, f in cls.setting_fields().items()}


__all__ = ["KEEP_MODES", "RULES", "Rule", "make_rule", "setting", "setting_fields"]
