"""Choosing a layout for one model: ``knorm-tune`` and ``knorm-batch --calibrate``.

The measurements are :mod:`knorm_gen.tuning.evaluate`'s (summary fidelity, pass keys and
perplexity through the product's own prefill, against the full cache and random
eviction at equal bytes); this module measures the user's job with it (each document at
its own length, cut only above ``doc_tokens``, at the job's budget or ratio), leaves out
of the fidelity average the documents whose reference says nothing of them
(:func:`degenerate_references`), chooses (:func:`choose`: never a layout below random
eviction beyond its 95% interval), says when the documents are too few to separate the
arms (:func:`separation_note`). The choice is saved per model in :mod:`knorm_gen.generation.tunings`,
which ``--preset auto`` reads without this module.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable, Optional, Sequence

from ..eviction.layouts import CANDIDATES, describe
from ..generation.prompts import as_tokenizer
from ..generation.tunings import below_random
from ..models.load import model_fingerprint
from .evaluate import (
    TUNE_FILLERS,
    TUNE_MODES,
    Doc,
    Evaluator,
    bootstrap_interval,
    fidelity_measure,
    head_tokens,
    measure,
    recovered_by_doc,
    summarize,
    tuning_cases,
)

TUNE_ARMS = ("default", "unstratified", "spread25", "intrinsic", "low", "keydiff", "random")
"""What ``knorm-tune`` measures by default (``--arms`` for the others of :data:`CANDIDATES`):
the default layout, the default without its stratified share (``unstratified``, the default
of 0.13) and that layout with a quarter of its rule slots drawn at random (``spread25``),
``--preset intrinsic`` (no probe), keep-low and KeyDiff in every layer at the default's recent
quarter, and random eviction as the control."""
QUICK_ARMS = ("default", "unstratified", "random")
"""``--quick`` and ``knorm-batch --calibrate``: the default, the default without its stratified
share, and the control."""
JOBS = ("summarize", "retrieve", "both")
KEYS_TARGET = 0.9  # at least this share of the full cache's pass keys
FIDELITY_SLACK = 0.02  # and summary fidelity no more than this below random eviction's
DOC_TOKENS = 4096
"""A document is measured at its own length, cut only above this many tokens."""
TUNE_DOCS = 4
"""``knorm-tune`` measures this many documents (``--docs-limit``)."""
QUICK_DOCS = 3
"""``--quick`` measures this many documents: one cannot give an interval."""




def bounded(fields: dict) -> bool:
    """Whether a layout bounds every layer (no layer left whole)."""
    return fields.get("skip_layers", ()) == () and fields.get("keep") != "full"


# ---- references that say nothing of their document ------------------------------------------

REFERENCE_MIN_TOKENS = 8
HEAD_CHARS = 200
SENTENCE_END = re.compile(r"[.!?](?=[\s\"')\]]|$)")


def degenerate_references(rows: Iterable[dict], docs: dict[str, str],
                          encode: Callable[[str], Sequence[int]]) -> dict[str, str]:
    """``{document: why}`` for each document whose full-cache summary (the ``reference_ids``
    of its ``arm="none"`` fidelity row; ``docs`` maps a name to its text) cannot measure
    what a layout keeps of it: it repeats the document's first line (its text, stripped,
    lies in the document's first :data:`HEAD_CHARS` characters, or its first 8 tokens
    are the document's first 8), or it is shorter than a sentence (under
    :data:`REFERENCE_MIN_TOKENS` tokens, or no sentence end)."""
    out = {}
    for r in rows:
        if r.get("task") != "fidelity" or r.get("arm") != "none" or r["doc"] not in docs:
            continue
        text, doc = str(r.get("reference", "")).strip(), docs[r["doc"]].strip()
        head = list(encode(doc))[:REFERENCE_MIN_TOKENS]
        if (text and text in doc[:HEAD_CHARS]) or (len(head) == REFERENCE_MIN_TOKENS
                                                  and list(encode(text))[:REFERENCE_MIN_TOKENS] == head):
            out[r["doc"]] = "its summary repeats the document's first line"
        elif len(r.get("reference_ids") or ()) < REFERENCE_MIN_TOKENS:
            out[r["doc"]] = f"its summary is shorter than a sentence ({len(r.get('reference_ids') or ())} tokens)"
        elif not SENTENCE_END.search(text):
            out[r["doc"]] = "its summary has no sentence end"
    return out


def without_fidelity_of(rows: Iterable[dict], docs: Iterable[str]) -> list[dict]:
    """``rows`` less the fidelity rows (against the full cache's summary) of ``docs``: their
    keys, perplexity and fidelity to a human summary stay."""
    left_out = set(docs)
    return [r for r in rows if not (r["task"] == "fidelity" and r["doc"] in left_out)]


# ---- choosing ------------------------------------------------------------------------------




class _Targets:
    """The targets of one job read off a :func:`~knorm_gen.tuning.evaluate.summarize` table."""

    def __init__(self, summary: dict[str, dict], job: str):
        self.summary, self.job = summary, job
        self.rand = summary.get("random", {}).get("recovered")
        self.full_keys = max(summary.get("full", {}).get("full_keys", 0), 1)

    def keys(self, a: str) -> float:
        return self.summary[a]["keys_of_full"] / self.full_keys

    def fid(self, a: str) -> float:
        return self.summary[a]["recovered"] if self.summary[a]["recovered"] is not None else float("-inf")

    def shortfalls(self, a: str) -> list[tuple[float, str]]:
        out = []
        if self.job in ("retrieve", "both") and self.keys(a) < KEYS_TARGET:
            out.append((KEYS_TARGET - self.keys(a), f"pass keys {self.keys(a):.0%} of the full cache's (target "
                                                    f"{KEYS_TARGET:.0%})"))
        if self.job in ("summarize", "both") and self.rand is not None and self.fid(a) < self.rand - FIDELITY_SLACK:
            out.append((min(self.rand - FIDELITY_SLACK - self.fid(a), 1.0),
                        f"fidelity {self.fid(a):.0%} against random eviction's {self.rand:.0%}"))
        return out

    def order(self, a: str, fields: dict) -> tuple:
        short = self.shortfalls(a)
        score = (self.keys(a), self.fid(a)) if self.job == "retrieve" else (self.fid(a), self.keys(a))
        return (-len(short), bounded(fields), -sum(x for x, _ in short), *score)

    def detail(self, a: str) -> str:
        fidelity = "not measured (no document gave a summary)" if self.fid(a) == float("-inf") else f"{self.fid(a):.0%}"
        return (f"pass keys {self.keys(a):.0%} of the full cache's, fidelity {fidelity}"
                + (f" (random eviction {self.rand:.0%})" if self.rand is not None else ""))


def rank(summary: dict[str, dict], job: str, arms: dict[str, dict]) -> list[str]:
    """The candidates of ``arms`` (random eviction aside) best first for ``job``, those below
    random beyond the interval (:func:`below_random`) left out; ValueError when no
    candidate besides random was measured."""
    names = [a for a in arms if a != "random" and a in summary]
    if not names:
        raise ValueError("no candidate besides random was measured")
    targets = _Targets(summary, job)
    return sorted((a for a in names if not below_random(summary[a])), key=lambda a: targets.order(a, arms[a]),
                  reverse=True)


def choose(summary: dict[str, dict], job: str, arms: dict[str, dict]) -> tuple[str, str]:
    """``(arm, why)``: the layout to use for ``job`` from a :func:`~knorm_gen.tuning.evaluate.summarize`
    table. A candidate qualifies when it finds at least :data:`KEYS_TARGET` of the full
    cache's pass keys (retrieve, both) and keeps at least random eviction's summary
    fidelity less :data:`FIDELITY_SLACK` (summarize, both); bounded layouts first; among
    those that qualify, the most fidelity (the most keys for retrieve). When none
    qualifies: the fewest targets missed, bounded first, then the smallest shortfall,
    and ``why`` says what it misses. Never a layout below random eviction beyond its
    95% interval: when every candidate is, random eviction is chosen and ``why`` says so
    (for a job with pass keys, how many of the full cache's it will lose)."""
    ranked = rank(summary, job, arms)
    excluded = [a for a in arms if a != "random" and a in summary and a not in ranked]
    if not ranked:
        return "random", _random_why(summary, job, excluded)
    best, targets = ranked[0], _Targets(summary, job)
    dropped = (f"; left out, below random eviction beyond the 95% interval: {', '.join(excluded)}"
               if excluded else "")
    if targets.shortfalls(best):
        return best, (f"no candidate met every target; closest: {targets.detail(best)}; misses "
                      f"{'; '.join(m for _, m in targets.shortfalls(best))}{dropped}")
    return best, (f"meets the targets with {targets.detail(best)}"
                  + ("" if bounded(arms[best]) else "; memory grows with the input") + dropped)


def _random_why(summary: dict[str, dict], job: str, excluded: Sequence[str]) -> str:
    why = (f"every candidate ({', '.join(excluded)}) keeps less of a summary than random eviction beyond the 95% "
           f"interval, so random eviction is chosen")
    if job == "summarize":
        rand = summary.get("random", {}).get("recovered")
        return why + (f" (fidelity {rand:.0%})" if rand is not None else "")
    found, full = summary["random"]["keys_of_full"], summary.get("full", {}).get("full_keys", 0)
    return why + f"; it finds {found} of the full cache's {full} pass keys, so it will lose {full - found}"


def separation_note(rows: Iterable[dict], summary: dict[str, dict], ranked: Sequence[str],
                    chosen: str, measure: str = "fidelity") -> Optional[str]:
    """A line when the documents cannot separate the chosen layout from random eviction
    or from the runner-up (the 95% interval of its paired difference to either spans 0,
    or there are too few documents for one); None when they can, or random was chosen."""
    if chosen == "random" or chosen not in summary:
        return None
    rows = list(rows)
    intervals = [summary[chosen].get("vs_random_interval")]
    runner_up = next((a for a in ranked if a != chosen), None)
    if runner_up is not None:
        ours, theirs = recovered_by_doc(rows, chosen, measure), recovered_by_doc(rows, runner_up, measure)
        intervals.append(bootstrap_interval([ours[d] - theirs[d] for d in ours if d in theirs]))
    if all(iv is not None and not iv[0] <= 0 <= iv[1] for iv in intervals):
        return None
    return f"{summary[chosen]['fidelity_docs']} documents cannot separate these arms; measure more (--docs-limit)"


# ---- measuring the job --------------------------------------------------------------------


class BudgetEvaluator(Evaluator):
    """An :class:`~knorm_gen.tuning.evaluate.Evaluator` whose arms keep ``budget`` tokens of every
    case, as ``--budget`` alone runs a job: the compression measured is each document's
    tokens / ``budget``, the job's own (an Evaluator at a ratio gives each document its
    tokens / ratio, capped by ``--budget`` where given, as ``--ratio`` runs a job)."""

    def __init__(self, model: Any, tokenizer: Any, arms: dict[str, dict], budget: int, **kwargs: Any):
        super().__init__(model, tokenizer, arms, **kwargs)
        self.budget = budget

    def budget_for(self, spans: Any, n_ids: int) -> int:
        return self.budget


def job_evaluator(model: Any, tok: Any, arms: dict[str, dict], *, ratio: Optional[float], budget: Optional[int],
                  log: Callable[[str], None]) -> Evaluator:
    """The evaluator of a job run as ``knorm-batch`` runs it: at ``ratio`` capped by ``budget``,
    or at a fixed ``budget`` without a ratio."""
    if ratio is None:
        return BudgetEvaluator(model, tok, arms, budget, log=log, modes=TUNE_MODES)
    return Evaluator(model, tok, arms, ratio=ratio, cap=budget, log=log, modes=TUNE_MODES)


def measured_compression(rows: Iterable[dict]) -> dict[str, float]:
    """Per document, the compression its arms were measured at: its tokens / their budget."""
    return {r["doc"]: r["doc_tokens"] / r["budget"] for r in rows
            if r["task"] == "ppl" and r.get("budget") and r.get("doc_tokens")}


def _mean_budget(rows: Iterable[dict]) -> int:
    budgets = [r["budget"] for r in rows if r["task"] == "ppl" and r.get("budget")]
    return round(sum(budgets) / len(budgets)) if budgets else 0


def tune(model: Any, tokenizer: Any, docs: Sequence[Doc], *, ratio: Optional[float] = 4.0,
         budget: Optional[int] = None, job: str = "both", arms: Sequence[str] = TUNE_ARMS,
         depths: Sequence[float] = (0.25, 0.75, 0.5), fillers: Sequence[str] = TUNE_FILLERS,
         doc_tokens: int = DOC_TOKENS, progress: bool = True, log: Callable[[str], None] = print,
         sweep: Sequence[float] = (), targets: tuple[Optional[float], Optional[float]] = (None, None)) -> dict:
    """Measure ``arms`` (names of :data:`~knorm_gen.eviction.layouts.CANDIDATES`) on ``docs`` for this
    model and choose one for ``job``: a record with the table, the chosen layout and why.

    Each document is measured at its own length (cut above ``doc_tokens``) at the job's
    compression, as ``knorm-batch`` runs it: each document's tokens / ``ratio``, at most
    ``budget``; without a ratio every arm keeps ``budget`` tokens of each document. Each document is one case (fidelity, a pass key
    inside it and perplexity from one prefill per arm); each filler one more, as long
    as the documents on average. Every task is measured whatever the job: the job only
    weighs them. ``sweep``: compression ratios at which the chosen layout is measured
    again on the same cases (:func:`budget_sweep`), judged against ``targets``
    (fidelity, keys)."""
    if job not in JOBS:
        raise ValueError(f"job must be one of {', '.join(JOBS)}; got {job!r}")
    unknown = [a for a in arms if a not in CANDIDATES]
    if unknown:
        raise ValueError(f"unknown candidate(s) {', '.join(unknown)}; choose from {', '.join(CANDIDATES)}")
    tok = as_tokenizer(tokenizer)
    docs = [Doc(d.name, head_tokens(tok, d.text, doc_tokens), d.summary) for d in docs]
    fields = {a: dict(CANDIDATES[a]) for a in dict.fromkeys([*arms, "random"])}
    evaluator = job_evaluator(model, tok, fields, ratio=ratio, budget=budget, log=log)
    lengths = [len(tok.encode(d.text, add_special_tokens=False)) for d in docs]
    cases = tuning_cases(docs, tok, depths=depths, fillers=fillers,
                         filler_tokens=max(256, round(sum(lengths) / max(len(lengths), 1))))
    rows = measure(evaluator, cases, "knorm-tune", progress, log)
    record = decide(rows, {d.name: d.text for d in docs}, lambda t: tok.encode(t, add_special_tokens=False), job,
                    fields)
    compression = measured_compression(rows)
    record.update(model_identity=model_fingerprint(model), job=job, docs=[d.name for d in docs], fillers=list(fillers),
                  ratio=sum(compression.values()) / len(compression) if compression else ratio,
                  budget=budget if ratio is None else _mean_budget(rows), compression=compression, rows=rows,
                  sweep=None)
    if sweep:
        record["sweep"] = _sweep(model, tok, record, evaluator, cases, sweep, targets, progress, log)
    return record


def decide(rows: list[dict], docs: dict[str, str], encode: Callable[[str], Sequence[int]], job: str,
           arms: dict[str, dict]) -> dict:
    """The choice from measured rows: the table (summary fidelity judged against the
    documents' human-written summaries where they carry them, else against the full cache's
    own summary, ``fidelity_measure`` saying which; the documents whose own-summary reference
    is degenerate left out of that one), the chosen layout's name and settings, why, and
    the note when the documents cannot separate the arms."""
    left_out = degenerate_references(rows, docs, encode)
    kept = without_fidelity_of(rows, left_out)
    measure = fidelity_measure(kept)
    table = summarize(kept, ["full", *arms], measure)
    name, why = choose(table, job, arms)
    return dict(chosen=name, why=why, layout=dict(arms[name]), layout_text=describe(arms[name]), table=table,
                fidelity_measure=measure,
                separation=separation_note(kept, table, rank(table, job, arms), name, measure),
                left_out=left_out,
                bounded=bounded(arms[name]))


def _sweep(model: Any, tok: Any, record: dict, evaluator: Evaluator, cases: list, ratios: Sequence[float],
           targets: tuple[Optional[float], Optional[float]], progress: bool, log: Callable[[str], None]) -> dict:
    """The chosen layout measured again at each of ``ratios`` on the same cases (the full
    cache's rows shared), the same documents left out of fidelity."""
    name = record["chosen"]
    points = []
    for r in ratios:
        again = Evaluator(model, tok, {name: record["layout"]}, ratio=r, log=log, modes=TUNE_MODES)
        again.full_rows = evaluator.full_rows
        rows = measure(again, cases, f"sweep {r:g}x", progress, log)
        t = summarize(without_fidelity_of(rows, record["left_out"]), ["full", name],
                      record.get("fidelity_measure", "fidelity"))[name]
        points.append(dict(ratio=r, budget=_mean_budget([x for x in rows if x["arm"] == name]),
                           recovered=t["recovered"], keys_of_full=t["keys_of_full"], full_keys=t["full_keys"]))
    return budget_sweep(name, points, *targets)


SWEEP_RATIOS = (8.0, 6.0, 4.0, 3.0, 2.0)


def budget_sweep(arm: str, points: Sequence[dict], target_fidelity: Optional[float] = None,
                 target_keys: Optional[float] = None) -> dict:
    """The sweep record: each point (``ratio``, ``budget``, ``recovered``, ``keys_of_full``,
    ``full_keys``) marked ``meets`` when its recovered share is at least
    ``target_fidelity`` and it finds at least ``target_keys`` of the full cache's pass
    keys (a target left out is not judged; keys cannot be judged where the full cache
    found none), and ``smallest``: the point with the smallest budget that meets
    both, or None."""
    out = []
    for p in points:
        fid_ok = target_fidelity is None or (p["recovered"] is not None and p["recovered"] >= target_fidelity)
        keys_ok = target_keys is None or (p["full_keys"] > 0 and p["keys_of_full"] / p["full_keys"] >= target_keys)
        out.append({**p, "meets": fid_ok and keys_ok})
    meeting = [p for p in out if p["meets"]]
    return dict(arm=arm, target_fidelity=target_fidelity, target_keys=target_keys, points=out,
                smallest=min(meeting, key=lambda p: p["budget"]) if meeting else None)
