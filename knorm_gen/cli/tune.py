"""``knorm-tune``: measure the layouts on the user's model and documents, and save the choice
(:mod:`knorm_gen.tuning.tune`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import click

from .. import __version__
from ..batch.job import (
    EXIT_INTERRUPTED,
    BatchUsageError,
)
from ..eviction.config import (
    DEFAULT_RATIO,
)
from ..eviction.layouts import CANDIDATES, describe
from ..generation.tunings import save_tuning
from ..models.load import get_model
from ..tuning.evaluate import FIDELITY_MEASURES, TUNE_FILLERS
from ..tuning.tune import DOC_TOKENS, QUICK_ARMS, QUICK_DOCS, SWEEP_RATIOS, TUNE_ARMS, TUNE_DOCS, bounded, tune
from .options import HELP, UsageFailure, model_option, refusal

TUNE_TASKS = ("summarize", "retrieve", "both")
TUNE_JOB_HINT = ("--job is knorm-batch's job file; knorm-tune chooses a layout for --task summarize, retrieve or both")

@click.command(name="knorm-tune", context_settings=HELP)
@click.argument("docs", required=False, type=click.Path(dir_okay=False, allow_dash=False))
@model_option
@click.option("--context-field", default="context", show_default=True,
              help="The field of DOCS holding a document, as knorm-batch's --context-field.")
@click.option("--summary-field", default="summary", show_default=True,
              help="The field of DOCS holding a human-written summary of the document (an abstract, an "
                   "editor's summary). Where rows carry one, summary fidelity is judged against it; else against "
                   "the full cache's own summary. The table says which.")
@click.option("--budget", type=click.IntRange(min=8), default=None,
              help="As in knorm-batch: given alone, the fixed budget your runs use (every candidate keeps N tokens "
                   "of each document, so the compression measured is each document's tokens / N); with --ratio, a "
                   "cap on it.")
@click.option("--ratio", type=click.FloatRange(min=1.5), default=None,
              help=f"As in knorm-batch: every candidate keeps each document's tokens / R (at most --budget when "
                   f"given).  [default: {DEFAULT_RATIO:g} when no --budget is given]")
@click.option("--task", type=click.Choice(TUNE_TASKS), default="both", show_default=True,
              help="What the layout is chosen for: summarize (summary fidelity), retrieve (pass keys) or both.")
@click.option("--job", hidden=True, expose_value=False, callback=refusal(TUNE_JOB_HINT))
@click.option("--arms", default=None, help=f"Candidates, comma-separated (default: {','.join(TUNE_ARMS)}; random "
              f"eviction, the control, is always measured). All: " + ",".join(CANDIDATES))
@click.option("--docs-limit", type=click.IntRange(min=1), default=None,
              help=f"Documents measured (the first ones of DOCS, or of the shipped corpus).  [default: "
                   f"{TUNE_DOCS}; {QUICK_DOCS} with --quick]")
@click.option("--doc-tokens", type=click.IntRange(min=256), default=DOC_TOKENS, show_default=True,
              help="A document longer than N tokens is cut to its first N; shorter ones are measured whole.")
@click.option("--quick", is_flag=True, help=f"{QUICK_DOCS} documents, one filler and {len(QUICK_ARMS)} candidates "
              f"({', '.join(QUICK_ARMS)}).")
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="Also write the full result as JSON here.")
@click.option("--no-save", is_flag=True, help="Do not save the choice as this model's tuning (--preset auto).")
@click.option("--target-fidelity", type=click.FloatRange(0, 1, min_open=True), default=None,
              help="Budget sweep: the summary fidelity (recovered share, e.g. 0.9) a budget must keep.")
@click.option("--target-keys", type=click.FloatRange(0, 1, min_open=True), default=None,
              help="Budget sweep: the share of the full cache's pass keys (e.g. 0.9) a budget must find.")
@click.option("--sweep", "sweep_ratios", default=None,
              help="Budget sweep: compression ratios at which the chosen layout is measured again, comma-separated "
                   "(default with a target: 8,6,4,3,2); reports the smallest budget meeting the targets.")
@click.version_option(__version__, prog_name="knorm-tune")
def tune_command(docs: Optional[str], model: str, context_field: str, summary_field: str,
                 budget: Optional[int], ratio: float,
                 task: str, arms: Optional[str], docs_limit: Optional[int], doc_tokens: int, quick: bool,
                 out: Optional[str], no_save: bool, target_fidelity: Optional[float], target_keys: Optional[float],
                 sweep_ratios: Optional[str]) -> None:
    """Measure which eviction layout keeps the most on your model and documents, and save it for --preset auto.

    DOCS: JSONL rows with the document in --context-field (as knorm-batch reads
    them). The layouts are measured on three tasks at your run's compression,
    through the product's own prefill: summary fidelity (teacher-forced: against
    the human-written summary in --summary-field where rows carry one, else against the
    full cache's own summary), pass keys placed inside the documents and in repeated
    filler (a filler's also asked inside one prompt, as generate_with_eviction runs
    it), and perplexity: one prefill per layout and document serves all three. Each
    document is measured at its own length (cut above --doc-tokens) at --budget or
    --ratio. Prints the table (the chosen layout first; each layout's paired
    difference to random eviction with its 95% interval; the documents whose
    reference summary is degenerate, left out of fidelity; whether the documents can
    separate the layouts), saves the choice as this model's tuning (used by --preset
    auto and knorm_gen.tuned_config) and, with --out, the JSON. A layout below random
    eviction beyond its interval is never chosen.

    With --target-fidelity / --target-keys (or --sweep) the chosen layout is then
    measured at other compressions on the same cases, and the smallest budget that
    meets the targets is reported (each ratio costs about a tuning of one candidate).

    Without DOCS it measures the long sections of CPython's pydoc_data.topics.
    Exit status: 0 done, 2 usage error (before any measurement), 130 interrupted.
    """
    if ratio is None and budget is None:
        ratio = DEFAULT_RATIO
    sweep = _sweep_ratios(sweep_ratios) if sweep_ratios else \
        SWEEP_RATIOS if target_fidelity is not None or target_keys is not None else ()
    names = _tune_arms(arms, quick)
    documents = _tune_documents(docs, context_field, docs_limit or (QUICK_DOCS if quick else TUNE_DOCS),
                                summary_field)
    try:
        loaded, tokenizer = get_model(model)
    except (BatchUsageError, ValueError) as e:
        raise UsageFailure(str(e)) from None
    lengths = _tune_lengths(tokenizer, documents, doc_tokens, None if ratio is not None else budget)
    at = (f"your runs' budget {budget} (about {sum(lengths) / len(lengths) / budget:.1f}x)" if ratio is None
          else f"{ratio:g}x" + (f" capped at {budget} tokens" if budget is not None else ""))
    click.echo(f"knorm-tune: {len(names)} candidates on {len(documents)} document(s) of about "
               f"{sum(lengths) // len(lengths)} tokens at {at}, task {task}", err=True)
    try:
        record = tune(loaded, tokenizer, documents, ratio=ratio, budget=budget, job=task, arms=names,
                      doc_tokens=doc_tokens, fillers=TUNE_FILLERS[:1] if quick else TUNE_FILLERS, log=lambda m: None,
                      sweep=sweep, targets=(target_fidelity, target_keys))
    except KeyboardInterrupt:
        click.echo("knorm-tune: interrupted", err=True)
        sys.exit(EXIT_INTERRUPTED)
    record["model"] = model
    _report_tuning(record, loaded, no_save, out)


def _tune_arms(arms: Optional[str], quick: bool) -> tuple[str, ...]:
    """The candidates to measure (random eviction among them), or UsageFailure naming an unknown one."""
    names = QUICK_ARMS if quick and not arms else tuple(a.strip() for a in (arms or ",".join(TUNE_ARMS)).split(","))
    unknown = [a for a in names if a not in CANDIDATES]
    if unknown:
        raise UsageFailure(f"unknown candidate(s) {', '.join(unknown)}; choose from {', '.join(CANDIDATES)}")
    if not any(a != "random" for a in names):
        raise UsageFailure("--arms names only random eviction, the control: name a candidate to measure against it")
    return tuple(dict.fromkeys((*names, "random")))  # the control every verdict is measured against


def _tune_lengths(tokenizer: Any, documents: list, doc_tokens: int, budget: Optional[int]) -> list[int]:
    """Each document's tokens as measured (cut above ``doc_tokens``), or UsageFailure for
    documents too short for the runs' budget (or under 256 tokens)."""
    lengths = [min(len(tokenizer.encode(d.text, add_special_tokens=False)), doc_tokens) for d in documents]
    if budget is not None:
        short = [d.name for d, n in zip(documents, lengths) if n < 2 * budget]
        if short:
            raise UsageFailure(f"--budget {budget} keeps half or more of {len(short)} document(s) ({short[0]}, ...): "
                               f"a tuning needs documents of at least twice the budget; lower --budget or give "
                               f"longer documents")
    elif min(lengths) < 256:
        raise UsageFailure(f"document {documents[lengths.index(min(lengths))].name} has {min(lengths)} tokens; "
                           f"a tuning needs documents of at least 256 tokens")
    return lengths


def _report_tuning(record: dict, model: Any, no_save: bool, out: Optional[str]) -> None:
    """The table (and the sweep's), the saved tuning, the JSON and its plot."""
    click.echo(tune_table(record))
    if record.get("sweep"):
        click.echo(sweep_table(record["sweep"]))
    if not no_save:
        click.echo(f"saved as this model's tuning (--preset auto): {save_tuning(model, record)}", err=True)
    if out:
        Path(out).write_text(json.dumps(record, indent=1))
        _tune_plot(record, Path(out).with_suffix(".png"))


def _sweep_ratios(text: str) -> tuple[float, ...]:
    """--sweep's ratios, or UsageFailure naming the bad one."""
    out = []
    for part in text.split(","):
        try:
            r = float(part)
        except ValueError:
            r = float("nan")
        if not r >= 1.5 or r == float("inf"):
            raise UsageFailure(f"--sweep: {part.strip()!r} is not a compression ratio of at least 1.5; give ratios "
                               f"like 8,6,4,3,2")
        out.append(r)
    return tuple(sorted(set(out), reverse=True))


def sweep_table(sweep: dict) -> str:
    """The budget sweep: each ratio's fidelity and keys, and the smallest budget meeting the targets."""
    targets = [f"fidelity >= {sweep['target_fidelity']:.0%}" if sweep["target_fidelity"] is not None else "",
               f"keys >= {sweep['target_keys']:.0%} of the full cache's" if sweep["target_keys"] is not None else ""]
    targets = [t for t in targets if t]
    lines = [f"budget sweep of {sweep['arm']}" + (f" (targets: {', '.join(targets)})" if targets else ""),
             f"{'ratio':>6s} {'budget':>7s} {'fidelity':>8s} {'keys':>7s}  meets"]
    for p in sweep["points"]:
        rec = "-" if p["recovered"] is None else f"{p['recovered']:.0%}"
        lines.append(f"{p['ratio']:>5.1f}x {p['budget']:>7d} {rec:>8s} {p['keys_of_full']:>3d}/{p['full_keys']:<3d}  "
                     f"{'yes' if p['meets'] else 'no'}")
    best = sweep["smallest"]
    lines.append(f"smallest budget meeting the targets: {best['budget']} tokens per layer ({best['ratio']:g}x)" if best
                 else "no measured budget meets the targets: sweep lower ratios (--sweep 3,2,1.5) or lower the targets")
    return "\n".join(lines)


def _tune_documents(path: Optional[str], field: str, limit: int, summary_field: str = "summary") -> list:
    """The documents to tune on: DOCS' rows (with the human-written summary in ``summary_field``
    where a row has one), or the shipped corpus. UsageFailure names a bad file."""
    import json

    from ..tuning.corpus import pydoc_sections
    from ..tuning.evaluate import Doc

    if path is None:
        shipped = [Doc(f"pydoc:{name}", text) for name, text in pydoc_sections(min_chars=9000)[:limit]]
        if not shipped:
            raise UsageFailure("no documents to tune on: this Python has no pydoc_data.topics (the shipped corpus); "
                               "give your own as DOCS (JSONL rows with the document in --context-field)")
        return shipped
    docs = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageFailure(f"cannot read {path}: {e}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageFailure(f"{path} line {n}: not JSON ({e.msg}); each line must be an object like "
                               f'{{"id": 1, "{field}": "..."}}') from None
        text = row.get(field) if isinstance(row, dict) else None
        if not isinstance(text, str) or not text.strip():
            have = ", ".join(sorted(row)) if isinstance(row, dict) else type(row).__name__
            texts = [k for k, v in row.items() if isinstance(v, str) and v.strip()] if isinstance(row, dict) else []
            name = f": --context-field {texts[0]}" if len(texts) == 1 else " with --context-field"
            raise UsageFailure(f"{path} line {n}: no text in field '{field}' (it has: {have}); name the document's "
                               f"field{name}")
        summary = row.get(summary_field)
        if summary is not None and not isinstance(summary, str):
            raise UsageFailure(f"{path} line {n}: field '{summary_field}' must be the summary's text, got "
                               f"{type(summary).__name__}; name another field with --summary-field")
        docs.append(Doc(str(row.get("id", n)), text, summary.strip() if summary and summary.strip() else None))
        if len(docs) >= limit:
            break
    if not docs:
        raise UsageFailure(f"{path} holds no rows; give JSONL rows with the document in '{field}'")
    return docs


def tune_table(record: dict) -> str:
    """The terminal table: the chosen layout first, then the others; then the compression
    measured, the documents left out of fidelity, whether the documents separate the
    layouts, and why the chosen one."""
    table = record["table"]
    order = [record["chosen"]] + [a for a in table if a not in (record["chosen"], "full")] + ["full"]
    width = max(15, *(len(a) for a in order))  # a long layout name must not push its row out of the columns
    lines = [f"{'layout':{width}s} {'fidelity':>8s} {'vs random [95%]':>20s} {'wins/rand':>9s} {'keys':>7s} "
             f"{'in docs':>8s} {'filler':>7s} {'ppl x':>6s}  memory"]
    lines += [_tune_row(a, table[a], width, a == record["chosen"]) for a in order if a in table]
    lines.append("keys: found of those the full cache found (in the documents, in repeated filler); "
                 f"fidelity: the share recovered of {FIDELITY_MEASURES[record.get('fidelity_measure', 'fidelity')]}"
                 "; vs random: the mean paired difference to random eviction over "
                 "documents, with its 95% bootstrap interval; ppl: perplexity of each document's end vs the full cache")
    compression = list((record.get("compression") or {}).values())
    if compression:
        lines.append(f"measured at {sum(compression) / len(compression):.2f}x (each document's tokens per kept token: "
                     f"{min(compression):.2f}x to {max(compression):.2f}x; budget {record.get('budget')})")
    for doc, why in (record.get("left_out") or {}).items():
        lines.append(f"left out of fidelity: {doc}: {why}")
    if record.get("separation"):
        lines.append(record["separation"])
    lines.append(f"chosen: {record['chosen']} ({record.get('layout_text') or describe(record['layout'])}): "
                 f"{record['why']}")
    return "\n".join(lines)


def _tune_row(a: str, v: dict, width: int, chosen: bool) -> str:
    """One layout's row of :func:`tune_table`."""
    rec = "-" if v["recovered"] is None else f"{v['recovered']:.0%}"
    ppl = "-" if v["ppl_ratio"] is None else f"{v['ppl_ratio']:.3f}"
    diff, interval = v.get("vs_random"), v.get("vs_random_interval")
    vs = "-" if diff is None else f"{diff:+.1%}" + (f" [{interval[0]:+.0%}, {interval[1]:+.0%}]" if interval else "")
    mem = "grows with input" if a == "full" or not bounded(CANDIDATES.get(a, {})) else "bounded"
    filler, filler_full = v.get("filler_keys_of_full", 0), v.get("filler_full_keys", 0)
    in_docs = f"{v['keys_of_full'] - filler}/{v['full_keys'] - filler_full}"
    return (f"{a:{width}s} {rec:>8s} {vs:>20s} {v['wins_vs_random']:>4d}/{v['fidelity_docs']:<4d} "
            f"{v['keys_of_full']:>3d}/{v['full_keys']:<3d} {in_docs:>8s} {f'{filler}/{filler_full}':>7s} "
            f"{ppl:>6s}  {mem}" + (" <- chosen" if chosen else ""))


def _tune_plot(record: dict, path: Path) -> None:
    """Fidelity and pass keys against the KV bytes each layout kept (mean per document)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        click.echo("knorm-tune: no plot (pip install -e '.[plot]' in the knorm_gen checkout, or pip install matplotlib)", err=True)
        return
    kept: dict[str, list] = {}
    for r in record["rows"]:
        if r["task"] == "fidelity" and r["arm"] != "none" and "kept_bytes" in r:
            kept.setdefault(r["arm"], []).append(r["kept_bytes"])
            kept.setdefault("full", []).append(r["full_bytes"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for a, v in record["table"].items():
        if a not in kept:
            continue
        mib = sum(kept[a]) / len(kept[a]) / 2**20
        keys = v["keys_of_full"] / max(v["full_keys"], 1)
        for ax, y in zip(axes, (v["recovered"], keys)):
            if y is not None:
                ax.scatter(mib, y, marker="*" if a == record["chosen"] else "o")
                ax.annotate(a, (mib, y), fontsize=7)
    axes[0].set_ylabel("summary fidelity (recovered share)")
    axes[1].set_ylabel("pass keys (share of the full cache's)")
    for ax in axes:
        ax.set_xlabel("KV kept per document, MiB (mean)")
    fig.suptitle(f"knorm-tune at {record['ratio']:.1f}x: {record['chosen']} chosen (*)")
    fig.tight_layout()
    fig.savefig(path)
    click.echo(f"knorm-tune: plot {path}", err=True)
