"""The quality grid: layouts x compressions x documents on one model, through the public
harness (:mod:`knorm_gen.tuning.evaluate`): summary fidelity (against the full cache's own summary,
and the package authors' one-line summary where a document has one), a pass key inside each
document and in two fillers, and perplexity, against the full cache and random eviction at
equal bytes. One JSON file per run, written after every case (a rerun of the same command
resumes where it stopped).

    python benchmarks/grid.py --model default --docs 0:12 --tokens 2048 --ratios 2,4,8,16 \\
        --arms default,random,paper --out benchmarks/results/grid-smollm2-2k.json
    python benchmarks/grid.py --report benchmarks/results/grid-smollm2-2k.json

A rerun with more ``--arms`` adds them to the file, reading the full cache's rows back.
``--docs A:B`` takes documents A to B-1 of :func:`documents.documents` (the fixed order);
``--tokens N`` cuts each to its first N tokens (a sentence end); ``--ratios`` are compressions
(each arm keeps a document's tokens / ratio). Arms are names of
:data:`knorm_gen.eviction.layouts.CANDIDATES`.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import knorm_gen  # noqa: E402  (BLAS preload first)
from documents import documents, papers  # noqa: E402
from knorm_gen.eviction.layouts import CANDIDATES  # noqa: E402
from knorm_gen.models.load import load_model  # noqa: E402
from knorm_gen.tuning.evaluate import (FILLERS, Doc, Evaluator, bootstrap_interval, filler_text,  # noqa: E402
                                       head_tokens, recovered_by_doc, summarize, with_needle)

DEPTHS = (0.25, 0.5, 0.75)
QWEN_NAMES = ("qwen2.5-0.5b", "qwen2")
GRID_FILLERS = ("harbor", "recipe")  # held out of knorm-tune's fillers


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default", help="'default' (the embedded model), 'qwen2.5-0.5b' (the "
                                                       "benchmark-only Qwen2 model, benchmarks/qwen.py), or a path")
    ap.add_argument("--source", choices=("documents", "papers"), default="documents",
                    help="documents.documents() (the default; a one-line summary where the package has one) or "
                         "documents.papers() (R vignette papers, their authors' abstract as the human summary)")
    ap.add_argument("--held-out", action="store_true", help="--source papers: the held-out half only")
    ap.add_argument("--choosing", action="store_true", help="--source papers: the other half only (where layouts "
                                                             "are chosen)")
    ap.add_argument("--docs", default="0:12", help="A:B, documents A to B-1 of the fixed order")
    ap.add_argument("--tokens", type=int, default=2048, help="each document's first N tokens")
    ap.add_argument("--join", action="store_true", help="documents shorter than --tokens take the next ones after "
                                                         "them (a blank line between) until they reach it")
    ap.add_argument("--ratios", default="4")
    ap.add_argument("--arms", default="default,random")
    ap.add_argument("--fillers", default=",".join(GRID_FILLERS), help="fillers of knorm_gen.tuning.evaluate.FILLERS, "
                                                                         "a key in each ('' for none)")
    ap.add_argument("--draw", type=int, default=0, help="another independent set of random eviction's draws (0: the "
                                                         "usual ones): random against random is the noise floor")
    ap.add_argument("--out", help="the results file (resumed when it exists)")
    ap.add_argument("--report", help="print the table of a results file and stop")
    return ap.parse_args(argv)


def grid_docs(tok, spec: str, n_tokens: int, join: bool = False, source: str = "documents",
              held_out: Optional[bool] = None) -> list[Doc]:
    a, b = (int(x) for x in spec.split(":"))
    if source == "papers":  # the body cut to its first n_tokens, the authors' abstract the human summary
        every = papers(tok, held_out=held_out)
        return [Doc(d.name, head_tokens(tok, d.text, n_tokens), d.summary) for d in every[a:b]]
    every = documents(tok, min_tokens=1500, max_tokens=10**6)
    out = []
    for i in range(a, b):
        d, name, text, summary = every[i], every[i].name, every[i].text, every[i].summary
        j = i
        while join and d.tokens is not None and len(tok.encode(text, add_special_tokens=False)) < n_tokens:
            j = (j + 1) % len(every)
            name, text, summary = f"{name}+{every[j].name}", text + "\n\n" + every[j].text, None
        out.append(Doc(name, head_tokens(tok, text, n_tokens), summary))
    return out


def model_path(name: str):
    """``--model``: None for the embedded model, the assembled GGUF for ``qwen2.5-0.5b``, else the path."""
    if name == "default":
        return None
    if name in QWEN_NAMES:
        from qwen import qwen_gguf

        return str(qwen_gguf())
    return name


def choosing_half_options(ap: argparse.ArgumentParser, docs: str) -> None:
    """The options of the diagnostics that read papers of the choosing half (key_bias.py,
    reader_attention.py): the model, which papers, how long a body, where the rows go."""
    ap.add_argument("--model", default="qwen2.5-0.5b", help="'default', 'qwen2.5-0.5b' or a path load_model reads")
    ap.add_argument("--docs", default=docs, help="A:B, papers A to B-1 of the choosing half (the grid's --choosing)")
    ap.add_argument("--tokens", type=int, default=2048, help="each paper's body cut to this many tokens")
    ap.add_argument("--out", help="write the rows here (JSON)")


def cases(tok, docs: list[Doc], fillers: list[str], n_tokens: int) -> list[tuple]:
    import random

    rng = random.Random(0)
    out = [("document", d, str(rng.randint(10000, 99999)), DEPTHS[i % len(DEPTHS)]) for i, d in enumerate(docs)]
    out += [("filler", Doc(f"filler:{f}", filler_text(FILLERS[f], tok, min(n_tokens, 1536))),
             str(rng.randint(10000, 99999)), (0.3, 0.7)[i % 2]) for i, f in enumerate(fillers)]
    return out


def run(args: argparse.Namespace) -> dict:
    model, tok = load_model(model_path(args.model))
    arms = {a: CANDIDATES[a] for a in args.arms.split(",")}
    ratios = [float(r) for r in args.ratios.split(",")]
    docs = grid_docs(tok, args.docs, args.tokens, args.join, args.source, True if args.held_out else
                     False if args.choosing else None)
    todo = cases(tok, docs, [f for f in args.fillers.split(",") if f], args.tokens)
    out = Path(args.out) if args.out else None
    result = json.loads(out.read_text()) if out and out.exists() else {"rows": []}
    before = result.get("meta", {})
    result["meta"] = dict(model=args.model, source=args.source, held_out=args.held_out, choosing=args.choosing,
                          draw=args.draw,
                          docs=[d.name for d in docs], tokens=args.tokens, ratios=ratios,
                          arms=arms, argv=sys.argv[1:], machine=platform.processor() or platform.machine(),
                          commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                text=True).stdout.strip())
    result["meta"]["arms"] = {**before.get("arms", {}), **arms}
    if "--arms" in result["meta"]["argv"]:  # the one command that makes the whole file, arms added later included
        result["meta"]["argv"][result["meta"]["argv"].index("--arms") + 1] = ",".join(result["meta"]["arms"])
    present: dict = {}
    for r in result["rows"]:
        present.setdefault((r["ratio"], r["case"]), set()).add(r["arm"])
    full_rows: dict = {}
    for ratio in ratios:
        for kind, doc, key, depth in todo:
            case = f"{doc.name}:{key}"
            missing = {a: f for a, f in arms.items() if a not in present.get((ratio, case), ())}
            if not missing:
                continue
            # arms added to a results file: the full cache's rows (and its own summary) are read back, not rerun
            ev = Evaluator(model, tok, missing, ratio=ratio, log=lambda m: None, modes=("ctq", "prompt"), draw=args.draw)
            ev.full_rows = full_rows
            if "full" in present.get((ratio, case), ()):
                seed_full_rows(ev, [r for r in result["rows"] if r["ratio"] == ratio and r["case"] == case],
                               kind, doc, key, depth)
            tic = time.perf_counter()
            rows = (ev.document(doc, key, depth) if kind == "document"
                    else ev.passkey(doc.name, with_needle(doc.text, depth, key), key, depth))
            result["rows"] += [{**r, "ratio": ratio, "case": case} for r in rows
                               if r["arm"] in missing or "full" not in present.get((ratio, case), ())]
            print(f"{ratio:g}x {case} {time.perf_counter() - tic:.0f}s", flush=True)
            if out:
                out.write_text(json.dumps(result))
    return result


def seed_full_rows(ev: Evaluator, rows: list[dict], kind: str, doc: Doc, key: str, depth: float) -> None:
    """Hand ``ev`` a case's full-cache rows read from a results file, so arms added later are
    scored against the same references without prefilling the full cache again."""
    strip = ("ratio", "case")
    full = [{k: v for k, v in r.items() if k not in strip} for r in rows if r["arm"] in ("none", "full")]
    if kind == "document":
        refs = {r["task"]: r["reference_ids"] for r in full if r["arm"] == "none"}
        ev.full_rows["document", doc.name, key, depth, len(doc.text)] = (refs, full)
    else:
        context = with_needle(doc.text, depth, key)
        ev.full_rows["passkey", doc.name, key, depth, len(context), ev.modes] = ([], full)


def report(result: dict) -> str:
    lines = []
    arms = list(result["meta"]["arms"])
    for ratio in result["meta"]["ratios"]:
        rows = [r for r in result["rows"] if r["ratio"] == ratio]
        table = summarize(rows, ["full", *arms])
        lines.append(f"\n{result['meta']['model']} at {ratio:g}x, {len(result['meta']['docs'])} documents of "
                     f"{result['meta']['tokens']} tokens")
        lines.append("| arm | recovered | vs random (95% interval) | wins | human summary | keys of full | ppl |")
        lines.append("|---|---|---|---|---|---|---|")
        for arm in arms:
            t = table[arm]
            ci = t["vs_random_interval"]
            lines.append("| " + " | ".join([
                arm, _pct(t["recovered"]),
                "-" if t["vs_random"] is None else f"{t['vs_random']:+.3f} ({ci[0]:+.3f}, {ci[1]:+.3f})" if ci
                else f"{t['vs_random']:+.3f}",
                f"{t['wins_vs_random']}/{t['fidelity_docs']}" if arm != "random" else "-",
                _pct(t["recovered_human"]) + f" ({t['human_docs']})",
                f"{t['keys_of_full']}/{t['full_keys']}",
                "-" if t["ppl_ratio"] is None else f"{t['ppl_ratio']:.3f}x"]) + " |")
        lines += paired(rows, arms)
    return "\n".join(lines)


def paired(rows: list[dict], arms: list[str]) -> list[str]:
    """Each arm against each control arm measured (random eviction, the sliding window), per
    measure: the mean paired difference over documents in points, its bootstrap 95% interval and
    the wins."""
    lines = ["", "| measure | arm - control | points (95% interval) | wins |", "|---|---|---|---|"]
    for task, label in (("fidelity_human", "human summary"), ("fidelity", "own summary")):
        for control in [c for c in ("random", "recent") if c in arms]:
            base = recovered_by_doc(rows, control, task)
            for arm in [a for a in arms if a != control]:
                rec = recovered_by_doc(rows, arm, task)
                diffs = [100 * (rec[d] - base[d]) for d in rec if d in base]
                if not diffs:
                    continue
                ci = bootstrap_interval(diffs)
                lines.append(f"| {label} | {arm} - {control} | {sum(diffs) / len(diffs):+.1f}"
                             + (f" ({ci[0]:+.1f}, {ci[1]:+.1f})" if ci else "")
                             + f" | {sum(x > 0 for x in diffs)}/{len(diffs)} |")
    return lines


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def main(argv=None) -> None:
    args = parse(argv)
    if args.report:
        print(report(json.loads(Path(args.report).read_text())))
        return
    print(report(run(args)))


if __name__ == "__main__":
    main()
