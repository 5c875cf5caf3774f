"""Old spellings, translated where saved things are read: records (resume), job files, rows,
saved tunings, saved documents and saved caches. Nothing else in the package knows them: the
API, the command line and the configs take today's names only.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Optional, Sequence

from .spans import ALL_EVICTABLE, pin_from

OLD_RULE_NAMES: dict[str, dict[str, Any]] = {
    "question_per_query": dict(keep="question", question_score="per_query", carry=0.0),
    "question_carry": dict(keep="question", question_score="best", carry=0.25),
    "question_per_query_carry": dict(keep="question", question_score="per_query", carry=0.25),
    "question_both_carry": dict(keep="question", question_score="mean", carry=0.25),
}
"""Rule names from before the question rule's reading and carried share were settings: each is
``keep="question"`` with the settings below. (A saved ``keep="question"`` without a
``question_score`` meant the best reading without carry.)"""

OLD_CACHE_CLASSES = {"L2NormKVCache": "EvictionKVCache", "BatchL2NormKVCache": "BatchEvictionKVCache"}
"""Cache class names a saved prompt cache may hold from before the cache ran more than one rule."""


def current_settings(settings: Mapping[str, Any]) -> dict:
    """Settings as a job file, a row, a saved tuning or a saved document spells them, in
    today's names: an old rule name in ``keep`` becomes ``keep="question"`` with the reading
    and carried share it meant; one in ``early_keep`` or ``layer_keep`` becomes ``question``."""
    out = dict(settings)
    if out.get("keep") in OLD_RULE_NAMES:
        out.update(OLD_RULE_NAMES[out["keep"]])
    if out.get("early_keep") in OLD_RULE_NAMES:
        out["early_keep"] = "question"
    layer_keep = out.get("layer_keep")
    if isinstance(layer_keep, Mapping):
        out["layer_keep"] = {k: "question" if r in OLD_RULE_NAMES else r for k, r in layer_keep.items()}
    elif isinstance(layer_keep, str):
        for name in sorted(OLD_RULE_NAMES, key=len, reverse=True):
            layer_keep = layer_keep.replace(f":{name}", ":question")
        out["layer_keep"] = layer_keep
    return out


def older_spelling(config: dict) -> Optional[dict]:
    """A record's ``config`` as it was written before the question rule's reading and carried
    share were settings (``keep="question_both_carry"`` and its siblings; a plain ``question``
    meant the best reading without carry), or None when no older spelling means the same:
    resume reads records written so as the same settings."""
    if config.get("keep") != "question" or "question_score" not in config or "carry" not in config:
        return None
    wanted = {"question_score": config["question_score"], "carry": config["carry"]}
    names = [name for name, fields in OLD_RULE_NAMES.items() if {k: fields[k] for k in wanted} == wanted]
    if not names and wanted == {"question_score": "best", "carry": 0.0}:
        names = ["question"]
    if not names:
        return None
    old = {k: v for k, v in config.items() if k not in wanted}
    old["keep"] = names[0]
    return old


def saved_rule(keep: str, question_score: Optional[str], carry: Any) -> tuple[str, str, float]:
    """``(keep, question_score, carry)`` of a saved cache: an old rule name as the settings it
    meant; a ``question`` saved before ``question_score`` existed as the best reading."""
    if keep in OLD_RULE_NAMES:
        old = OLD_RULE_NAMES[keep]
        return old["keep"], old["question_score"], old["carry"]
    if keep == "question" and question_score is None:
        return keep, "best", 0.0
    return keep, question_score or "mean", float(carry or 0.0)


def old_row_state(v: Sequence[Any]) -> tuple:
    """A single-row cache saved as positional slots, from before its saved state named its
    settings: ``(keys, values, rank, free, rule state, settings)`` as today's saved state
    holds them. Slot 10 was ``pinned`` before spans existed: every token after the budget was
    kept."""
    if len(v) < 11:
        raise ValueError("this eviction cache was saved without its rows' counts and settings, so it cannot be "
                         "restored; extract() its rows into single-row caches before saving")
    keys, values, rank, free, count, offset, budget, n_sink, recent, keep, pinned = v[:11]
    count, offset, budget = int(count), int(offset), int(budget)
    if len(v) > 12:
        spans = json.loads(v[12])
    else:
        spans = pin_from(ALL_EVICTABLE, offset - max(count - budget, 0)) if pinned else ALL_EVICTABLE

    def slot(i: int, default: Any) -> Any:
        return v[i] if len(v) > i else default

    settings = dict(n_sink=int(n_sink), keep=keep, question_score=slot(16, None), carry=slot(17, None),
                    spread=float(slot(18, 0.0)), salt=int(slot(19, 0)), coverage=float(slot(13, 0.0)),
                    kv_bits=int(slot(14, 0)) or None, kv_group_size=int(slot(15, 64)), budgets=[budget],
                    recents=[int(recent)], counts=[count], seen=[offset], holes=[free is not None], spans=[spans])
    return keys, values, rank, free, slot(11, None), settings
