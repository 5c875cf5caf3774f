"""The candidate layouts ``knorm-tune`` and the benchmarks measure (:data:`CANDIDATES`), each a
set of :class:`~knorm_gen.eviction.config.EvictionConfig` layout fields built from a preset
(:data:`~knorm_gen.eviction.config.PRESETS`, the layouts users name) and a few settings. Apart from
the tuner so the command line can list them without loading it."""

from __future__ import annotations

from .config import PRESETS


def _layout(preset: str, **fields) -> dict:
    return {**PRESETS[preset], **fields}


CANDIDATES: dict[str, dict] = {
    "default": _layout("default"),
    # the default of 0.13 (before stratify), and its settings one at a time, as they were measured
    "unstratified": _layout("default", stratify=0.0),
    "no_carry": _layout("default", carry=0.0, stratify=0.0),
    "spread25": _layout("default", spread=0.25, stratify=0.0),
    "spread50": _layout("default", spread=0.5, stratify=0.0),
    "spread70": _layout("default", spread=0.7, stratify=0.0),
    "spread75": _layout("default", carry=0.0, spread=0.75, stratify=0.0),
    "spread90": _layout("default", carry=0.0, spread=0.9, stratify=0.0),
    "stratify50": _layout("default", stratify=0.5),
    "best": _layout("default", question_score="best", stratify=0.0),
    "per_query": _layout("default", question_score="per_query", stratify=0.0),
    # the other presets, and their rules alone in every layer at the default's recent quarter
    "question": _layout("question"),
    "intrinsic": _layout("intrinsic"),
    "paper": _layout("paper"),
    "low": _layout("default", keep="low"),
    "keydiff": _layout("default", keep="keydiff"),
    "blend": _layout("default", keep="blend", early_keep="blend"),
    "leverage": _layout("default", keep="leverage"),
    # the control every layout is judged against: random eviction at equal bytes, the default's layers and window
    "random": _layout("default", keep="random"),
    # a sliding window with the sinks: what mlx_lm's --max-kv-size (a RotatingKVCache) keeps, at equal bytes
    "recent": _layout("default", keep="recent"),
}
"""Candidate layouts by name. ``random`` is every candidate's equal-bytes control, ``recent``
the user's alternative in mlx_lm (the sinks and the most recent tokens); ``paper``
leaves layers 0 and 1 whole (more bytes than the others at one budget)."""


def describe(fields: dict) -> str:
    """The settings a layout sets, as a user would write them (``keep=question, carry=0.25, ...``)."""
    shown = {k: v for k, v in fields.items() if v not in (None, (), 0.0, "auto") or k in ("keep", "carry")
             or (k == "stratify" and v is not None)}
    if shown.get("keep") != "question":
        shown.pop("question_score", None)
        shown.pop("carry", None)
        if not shown.get("stratify"):
            shown.pop("stratify", None)
    return ", ".join(f"{k}={v}" for k, v in shown.items())
