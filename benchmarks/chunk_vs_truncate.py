"""Documents longer than the model's context: ``long_documents="chunk"`` against
``"truncate"``, both under eviction, on the embedded model (context 8,192 tokens).

    python benchmarks/chunk_vs_truncate.py --out benchmarks/results/chunk-vs-truncate-smollm2.json

Each long document joins whole package READMEs of ``benchmarks/documents.py`` (in its
fixed order) until it is about two or three times the context, with a pass key planted
in each third (at 1/6, 1/2 and 5/6 of its length). Two questions per document, answered
with ``answer_questions`` as a job row would be:

- a summary that names each project ("summary kept": the share of the joined READMEs
  whose package name the answer contains; the names are the text's own, not ours), and
- the three pass keys (found: the keys the answer contains, per third).

Nothing here is a reference of the whole document: beyond the context there is none.
One JSON file, written after every case (a rerun resumes).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from documents import documents  # noqa: E402

from knorm_gen import EvictionConfig, GenerationConfig, answer_questions  # noqa: E402
from knorm_gen.tuning.evaluate import with_needle  # noqa: E402
from knorm_gen.models.load import get_model  # noqa: E402
from knorm_gen.platform.mlx_compat import model_context_length  # noqa: E402

SUMMARY = "Summarize the text above: name each software project it describes and say in one sentence what it does."
KEYS = "The text above contains three pass keys. List all three, numbers only."
DEPTHS = (1 / 6, 1 / 2, 5 / 6)
ALIASES = {"python-slugify": ("slugify",), "python-dateutil": ("dateutil",),
           "sortedcontainers": ("sortedcontainers", "sorted containers")}


def long_documents(tok, context: int, targets=(2.0, 2.9)) -> list[dict]:
    """READMEs joined in order until each reaches its target times ``context`` tokens (the
    targets alternate); the last, shorter remainder is dropped."""
    readmes = [d for d in documents(tok, min_tokens=0, max_tokens=10**9) if d.name.startswith("readme:")]
    out, parts, tokens = [], [], 0
    for doc in readmes:
        parts.append(doc)
        tokens += doc.tokens
        if tokens >= targets[len(out) % len(targets)] * context:
            out.append({"parts": [p.name.split(":", 1)[1] for p in parts], "text": "\n\n".join(p.text for p in parts)})
            parts, tokens = [], 0
    return out


def names_found(answer: str, packages: list[str]) -> list[str]:
    low = answer.lower()
    return [p for p in packages if any(a in low for a in ALIASES.get(p, (p,)))]


def run_case(model, tok, doc: dict, mode: str, eviction: EvictionConfig, seed: int) -> dict:
    rng = random.Random(f"{seed}:{'+'.join(doc['parts'])}")
    keys = [str(rng.randrange(10000, 99999)) for _ in DEPTHS]
    text = doc["text"]
    for depth, key in sorted(zip(DEPTHS, keys), reverse=True):  # deepest first: earlier offsets stay put
        text = with_needle(text, depth, key)
    tic = time.perf_counter()
    summary, found = answer_questions(model, tok, text, [SUMMARY, KEYS], eviction=eviction,
                                      generation=GenerationConfig(long_documents=mode, max_tokens=256))
    names = names_found(summary.text, doc["parts"])
    return {"doc": "+".join(doc["parts"]), "mode": mode, "document_tokens": len(tok.encode(text)),
            "names_found": names, "names_total": len(doc["parts"]),
            "keys_found": [k in found.text for k in keys], "summary": summary.text, "keys_answer": found.text,
            "pieces": len(summary.long_document.get("pieces", [])) if summary.long_document else 0,
            "long_document": {k: v for k, v in (summary.long_document or {}).items() if k != "pieces"},
            "compression_ratio": summary.compression_ratio, "kept_bytes": summary.kept_bytes,
            "kv_ceiling_bytes": summary.kv_ceiling_bytes, "seconds": round(time.perf_counter() - tic, 1)}


def report(result: dict) -> str:
    lines = ["| document (READMEs joined) | tokens | mode | summary kept (projects named) | keys found (1st, 2nd, "
             "3rd third) | seconds |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        keys = ", ".join("yes" if k else "no" for k in r["keys_found"])
        lines.append(f"| {r['doc']} | {r['document_tokens']:,} | {r['mode']} | {len(r['names_found'])}/{r['names_total']}"
                     f" | {keys} | {r['seconds']:.0f} |")
    for mode in ("truncate", "chunk"):
        rows = [r for r in result["rows"] if r["mode"] == mode]
        if rows:
            named = sum(len(r["names_found"]) for r in rows) / sum(r["names_total"] for r in rows)
            keys = [sum(r["keys_found"][i] for r in rows) for i in range(len(DEPTHS))]
            lines.append(f"| **all {len(rows)}** | | {mode} | {100 * named:.0f}% | "
                         f"{', '.join(f'{k}/{len(rows)}' for k in keys)} | {sum(r['seconds'] for r in rows):.0f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--ratio", type=float, default=4.0, help="eviction inside each piece (and the truncated text)")
    ap.add_argument("--docs", type=int, default=4, help="how many long documents")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "chunk-vs-truncate-smollm2.json"))
    ap.add_argument("--report", action="store_true", help="print the table of --out and stop")
    args = ap.parse_args(argv)
    out = Path(args.out)
    result = json.loads(out.read_text()) if out.exists() else {"meta": {}, "rows": []}
    if args.report:
        print(report(result))
        return
    model, tok = get_model(args.model)
    context = model_context_length(model)
    eviction = EvictionConfig(ratio=args.ratio, budget=None)
    result["meta"] = {"model": args.model, "context": context, "ratio": args.ratio, "seed": args.seed,
                      "command": "python benchmarks/chunk_vs_truncate.py " + " ".join(argv or sys.argv[1:])}
    done = {(r["doc"], r["mode"]) for r in result["rows"]}
    for doc in long_documents(tok, context)[: args.docs]:
        for mode in ("truncate", "chunk"):
            if ("+".join(doc["parts"]), mode) in done:
                continue
            row = run_case(model, tok, doc, mode, eviction, args.seed)
            result["rows"].append(row)
            out.write_text(json.dumps(result, indent=1))
            print(f"{mode} {row['doc']} {row['document_tokens']} names {len(row['names_found'])}/{row['names_total']} "
                  f"keys {row['keys_found']} {row['seconds']}s", flush=True)
    print(report(result))


if __name__ == "__main__":
    main()
