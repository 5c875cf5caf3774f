"""``knorm-batch --calibrate N``: a run that chooses its own layout when the model has no tuning.

It measures the quick candidates (:data:`~knorm_gen.tuning.tune.QUICK_ARMS`) on the documents of
the job's own first N rows (a row's context, else its prompt) against the full cache, as
``knorm-tune --quick`` does (:func:`~knorm_gen.tuning.tune.tune`, job ``both``, at the run's own
budget or ratio), chooses, saves the choice as the model's tuning (so ``--preset auto``
and a rerun that resumes find it) and runs every row with it. It does not calibrate when
the user set the layout (any layout field, or a preset), when the model already has a
saved tuning (that tuning runs, as under ``--preset auto``), without eviction, or in a
process group. The run prints which layout ran and why; its summary and each record's
``meta`` (key ``layout``) say it too.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Optional

from ..eviction.config import LAYOUT_FIELDS, EvictionConfig
from ..eviction.layouts import describe
from ..generation.prompts import as_tokenizer
from ..generation.tunings import auto_config, load_tuning, run_ratio, save_tuning, saved_layout, tuning_refusal
from .evaluate import TUNE_FILLERS, Doc
from .tune import QUICK_ARMS, tune


@dataclass
class Settled:
    """The layout a run runs: its eviction config, the line it prints, and ``layout``
    (``{"name", "why"}``) for its summary and records."""

    eviction: EvictionConfig
    note: str
    layout: dict


def layout_given(eviction: EvictionConfig) -> dict:
    """The layout fields of ``eviction`` that differ from the default layout's (what the
    user set: a field or a preset)."""
    default = EvictionConfig()
    return {k: getattr(eviction, k) for k in LAYOUT_FIELDS if getattr(eviction, k) != getattr(default, k)}


def settle(model: Any, tokenizer: Any, options: Any, documents: list, *, distributed: bool = False,
           log: Optional[Callable[[str], None]] = None) -> Settled:
    """The layout of a run with ``options.calibrate`` (N) set: calibrated on the first N of
    ``documents`` (the texts of the input's first rows), or why not and what runs instead."""
    n, eviction = options.calibrate, options.eviction
    ratio = run_ratio(tokenizer, documents, eviction)
    given = layout_given(eviction)
    if given:
        return _instead(model, options, ratio, f"the layout was set ({describe(given)}), so it runs as given")
    if distributed:
        return _instead(model, options, ratio, "a process group does not calibrate (each rank would measure on "
                                               "its own); calibrate in one process first, then launch")
    if eviction.budget is None and getattr(eviction, "ratio", None) is None:
        return _instead(model, options, ratio, "nothing is evicted (--budget none)")
    saved = load_tuning(model)
    if saved is not None:
        run, note = auto_config(model, eviction, options.auto_layout or (), ratio)
        name = "default" if tuning_refusal(saved, ratio) else saved["chosen"]
        why = f"this model has a saved tuning, so no calibration: {note}"
        return Settled(run, f"--calibrate {n}: {why}", dict(name=name, why=why))
    docs = _calibration_docs(tokenizer, documents, n, eviction)
    if not docs:
        return _instead(model, options, ratio, "none of the first rows' documents is longer than the budget "
                                               "(eviction keeps them whole), so there is nothing to measure")
    return calibrate(model, tokenizer, eviction, docs, n, log)


def _instead(model: Any, options: Any, ratio: Optional[float], why: str) -> Settled:
    """No calibration, and why: the run's own layout runs (the saved tuning's under ``--preset auto``)."""
    eviction, name = options.eviction, "given" if layout_given(options.eviction) else "default"
    if options.auto_layout is not None:
        eviction, note = auto_config(model, eviction, options.auto_layout, ratio)
        saved = load_tuning(model)
        if name == "default" and saved is not None and tuning_refusal(saved, ratio) is None:
            name = saved["chosen"]
        why = f"{why}; {note}"
    line = f"no calibration: {why}"
    return Settled(eviction, f"--calibrate {options.calibrate}: {line}", dict(name=name, why=line))


def _calibration_docs(tokenizer: Any, documents: Iterable[Any], n: int, eviction: EvictionConfig) -> list[Doc]:
    """The first ``n`` documents (texts, or a chat's contents) that eviction would touch:
    longer than the budget (under a ratio: any)."""
    tok, out = as_tokenizer(tokenizer), []
    fixed = eviction.budget if getattr(eviction, "ratio", None) is None else 0
    for i, d in enumerate(documents):
        if isinstance(d, (list, tuple)) and all(isinstance(m, dict) for m in d):
            d = "\n\n".join(str(m.get("content", "")) for m in d)
        if isinstance(d, str) and d.strip() and len(tok.encode(d, add_special_tokens=False)) > max(fixed, 16):
            out.append(Doc(f"row {i + 1}", d))
        if len(out) >= n:
            break
    return out


def calibrate(model: Any, tokenizer: Any, eviction: EvictionConfig, docs: list[Doc], n: int,
              log: Optional[Callable[[str], None]] = None) -> Settled:
    """Measure :data:`~knorm_gen.tuning.tune.QUICK_ARMS` on ``docs`` at the run's budget (or
    ratio), job both; save the choice as the model's tuning; the run's layout is it."""
    ratio = getattr(eviction, "ratio", None)
    if log:
        log(f"knorm-batch: --calibrate {n}: measuring {', '.join(QUICK_ARMS)} on {len(docs)} of the first rows' "
            f"documents against the full cache (saved for this model; --preset auto reuses it)")
    tic = time.perf_counter()
    record = tune(model, tokenizer, docs, ratio=ratio, budget=eviction.budget,
                  job="both", arms=QUICK_ARMS, fillers=TUNE_FILLERS[:1], log=lambda m: None,
                  progress=bool(log) and sys.stderr.isatty())
    seconds = time.perf_counter() - tic
    record["calibrated"] = dict(rows=[d.name for d in docs], seconds=seconds)
    save_tuning(model, record)
    fields = {k: v for k, v in saved_layout(record).items() if k != "budget"}
    why = (f"calibrated on {len(docs)} of the first rows' documents ({', '.join(d.name for d in docs)}) at "
           f"{record['ratio']:.1f}x in {seconds:.0f} s: {record['why']}"
           + (f"; {record['separation'].replace('(--docs-limit)', '(a larger --calibrate N)')}"
              if record.get("separation") else "")
           + "".join(f"; {doc} left out of fidelity: {w}" for doc, w in record["left_out"].items()))
    note = f"--calibrate {n}: {record['chosen']} ({describe(fields)}), {why}"
    return Settled(replace(eviction, **fields), note, dict(name=record["chosen"], why=why))
