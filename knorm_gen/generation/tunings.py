"""Saved tunings: what ``knorm-tune`` chose per model, read by ``--preset auto`` and
``knorm-batch --calibrate``.

A small store both sides use: the tuner (:mod:`knorm_gen.tuning.tune`) writes a tuning; the
product reads one here without importing the tuner or its measuring harness. Tunings
are kept per model (:func:`~knorm_gen.models.load.model_fingerprint`, its content) under
``cache_root()/tuned``.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from ..eviction.config import OLD_RECENT_SHARE, EvictionConfig
from ..eviction.layouts import describe
from ..eviction.legacy import current_settings, older_weights_digest
from ..models.load import model_fingerprint
from ..platform.runtime import cache_root
from .prompts import as_tokenizer


class NoTuningError(LookupError):
    """No saved tuning for this model (and budget)."""


def below_random(entry: dict) -> bool:
    """Whether a :func:`~knorm_gen.tuning.evaluate.summarize` entry keeps less of a summary than
    random eviction beyond its 95% interval (the interval's upper end below 0)."""
    interval = entry.get("vs_random_interval")
    return interval is not None and interval[1] < 0


def tuning_dir() -> Path:
    return Path(cache_root()) / "tuned"


def tuning_path(model: Any) -> Path:
    return tuning_dir() / f"{model_fingerprint(model)}.json"


def save_tuning(model: Any, record: dict) -> Path:
    """Write ``record`` (what :func:`tune` returns) as this model's saved tuning."""
    path = tuning_path(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)
    return path


def load_tuning(model: Any) -> Optional[dict]:
    """This model's saved tuning, or None (one saved under the older digest of its weights is found too)."""
    for path in (tuning_path(model), tuning_dir() / f"{older_weights_digest(model)}.json"):
        if path.exists():
            return json.loads(path.read_text())
    return None


def tuned_config(model: Any, budget: Optional[int] = None) -> EvictionConfig:
    """The layout ``knorm-tune`` chose for ``model`` (at ``budget`` when given, else
    the budget it was tuned at). Raises :class:`NoTuningError` naming the command to
    run when this model has none."""
    saved = load_tuning(model)
    if saved is None:
        raise NoTuningError("no saved tuning for this model: run `knorm-tune --model <this model>` (on a few of "
                            "your own documents: `knorm-tune --model M docs.jsonl --context-field text`)")
    return EvictionConfig(**{**saved_layout(saved), "budget": budget if budget is not None else saved["budget"]})


def saved_layout(saved: dict) -> dict:
    """A saved tuning's layout (:class:`~knorm_gen.eviction.config.EvictionConfig` fields), each
    field it lacks read as what it meant when it was saved: before ``recent_share``, the
    window every layout had then (:data:`~knorm_gen.eviction.config.OLD_RECENT_SHARE`); before
    ``early_keep``, its rule in every layer; before ``question_score`` and ``carry``, a
    plain ``keep="question"`` was the best reading without carry (an old rule name,
    ``question_carry`` and the like, as :func:`~knorm_gen.eviction.legacy.current_settings`
    reads it); before ``spread`` and ``stratify``, none."""
    layout = current_settings(saved["layout"])
    old_rule = "blend" if layout.get("keep") == "blend" else "auto"  # auto: the blend alone gets leverage
    then = {"recent_share": OLD_RECENT_SHARE, "early_keep": old_rule, "spread": 0.0, "stratify": 0.0}
    if layout.get("keep") == "question":
        then.update(question_score="best", carry=0.0)
    out = {**then, **layout}
    if out.get("skip_layers") is not None:
        out["skip_layers"] = tuple(out["skip_layers"])
    return out


RATIO_TOLERANCE = 1.5
"""``--preset auto`` uses a tuning for runs that compress within this factor of the
ratio it was measured at (tuned at 4x: 2.7x to 6x); outside it the default runs."""


def run_ratio(tokenizer: Any, texts: Iterable[Any], eviction: Any) -> Optional[float]:
    """A run's compression, as ``knorm-tune`` measures it: the mean over its documents
    (``texts``: strings, token ids or chat messages) of each one's tokens per token kept,
    under ``eviction``'s ``ratio`` (1/R of each document) capped by its ``budget``. None
    with neither, or without a text."""
    ratio, budget = getattr(eviction, "ratio", None), getattr(eviction, "budget", None)
    if budget is None:
        return ratio
    tok = as_tokenizer(tokenizer)
    counts = []
    for t in texts:
        if isinstance(t, str):
            counts.append(len(tok.encode(t, add_special_tokens=False)))
        elif isinstance(t, (list, tuple)) and t and all(isinstance(m, dict) for m in t):
            counts.append(sum(len(tok.encode(str(m.get("content", "")), add_special_tokens=False)) for m in t))
        elif isinstance(t, (list, tuple)) or hasattr(t, "shape"):
            counts.append(len(t))
    per_doc = [max(ratio or 0.0, n / budget) for n in counts]
    return sum(per_doc) / len(per_doc) if per_doc else None


def tuning_refusal(saved: Optional[dict], ratio: Optional[float]) -> Optional[tuple[str, str]]:
    """Why ``--preset auto`` does not use a saved tuning, and what to run instead; None
    when it does. ``ratio``: the run's compression (:func:`run_ratio`); a tuning measured
    at a ratio more than :data:`RATIO_TOLERANCE` times off it is not used, nor one whose
    chosen layout was recorded as below random eviction beyond its 95% interval (older
    tunings have no interval, and are used)."""
    if saved is None:
        return "no saved tuning for this model", "run `knorm-tune --model ...` to measure one"
    if ratio is not None and max(ratio / saved["ratio"], saved["ratio"] / ratio) > RATIO_TOLERANCE:
        return (f"this model's tuning was measured at {saved['ratio']:.3g}x and this run compresses about "
                f"{ratio:.1f}x", f"run `knorm-tune --model ... --ratio {ratio:.1f}` to tune for it")
    if below_random((saved.get("table") or {}).get(saved.get("chosen"), {})):
        return (f"this model's tuning chose {saved['chosen']}, which kept less of a summary than random eviction "
                f"beyond its 95% interval", "run `knorm-tune --model ...` again, on more documents")
    return None


def auto_config(model: Any, eviction: EvictionConfig, given: Sequence[str] = (),
                ratio: Optional[float] = None) -> tuple[EvictionConfig, str]:
    """``--preset auto``: the saved tuning's layout at ``eviction``'s budget (the
    layout fields named in ``given``, set by the user beside the preset, stay), or
    the default layout when :func:`tuning_refusal` refuses it (no tuning, one made at
    another ratio or one below random eviction); and one line saying which and why.
    Tunings are kept per model (a digest of its weights), so another model's is never
    found."""
    saved = load_tuning(model)
    refused = tuning_refusal(saved, ratio)
    if refused is not None:
        return eviction, f"preset auto: {refused[0]}, so the default layout runs (keep={eviction.keep}); {refused[1]}"
    fields = {k: v for k, v in saved_layout(saved).items() if k != "budget" and k not in given}
    return replace(eviction, **fields), (f"preset auto: {saved['chosen']} ({describe(fields)}), tuned for job "
                                         f"{saved['job']} at {saved['ratio']:.3g}x on {len(saved['docs'])} documents"
                                         + (f" (this run: about {ratio:.1f}x)" if ratio is not None else ""))
