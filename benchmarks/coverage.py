"""How much of a document the kept positions cover, across KV heads and across layers
(issue 55, item 2): random eviction keeps a different share in every head and layer; a
rule's scores, carry and coverage make heads and layers agree on the same positions.

For each layout and document (cut to ``--tokens``, prefilled as the product prefills a
question row at ``--ratio``), per compressed layer:

- **head union**: the share of the document's positions some KV head of the layer keeps;
- **head overlap**: the mean Jaccard similarity of the kept sets of two heads of the layer;
- **layer overlap**: the mean Jaccard similarity of a head's kept set in one compressed layer
  and the same head's in the next;
- **model union**: the share of the document's positions some head of some layer keeps.

    python benchmarks/coverage.py --model default --docs 0:6 --arms default,no_carry,spread25,random,intrinsic \\
        --out benchmarks/results/coverage-smollm2.json
    python benchmarks/coverage.py --model qwen2.5-0.5b --source papers --docs 0:3 --arms default,random \\
        --out benchmarks/results/coverage-qwen2-papers.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import knorm_gen  # noqa: E402  (BLAS preload first)
from grid import grid_docs, model_path  # noqa: E402
from knorm_gen import EvictionConfig  # noqa: E402
from knorm_gen.eviction.cache import EvictionKVCache  # noqa: E402
from knorm_gen.eviction.config import GenerationConfig  # noqa: E402
from knorm_gen.generation.engine import BatchEngine  # noqa: E402
from knorm_gen.tuning.evaluate import SUMMARY_QUESTION  # noqa: E402
from knorm_gen.generation.generate import question_request  # noqa: E402
from knorm_gen.eviction.layouts import CANDIDATES  # noqa: E402
from knorm_gen.models.load import load_model  # noqa: E402


def jaccard(a: set, b: set) -> float:
    return len(a & b) / max(len(a | b), 1)


def kept_sets(model, tok, fields: dict, text: str, ratio: float, seed: int) -> tuple[list[list[set]], range]:
    """Per compressed layer, per KV head, the document positions kept after the product's prefill."""
    import mlx.core as mx

    eviction = EvictionConfig(budget=None, ratio=ratio, **fields).for_model(model)
    req = question_request(model, tok, "c", text, [SUMMARY_QUESTION], eviction, GenerationConfig())
    mx.random.seed(seed)
    caches, _ = BatchEngine(model, tok, eviction, batch_size=1).prefill_context(
        req.eviction, req.context_ids, req.spans, req.question_ids)
    (start, end), = req.spans
    doc = range(start, end)
    layers = []
    for c in caches:
        if isinstance(c, EvictionKVCache) and c.bounded:
            pos = np.array(c.ordered_state()[2])[0]
            layers.append([{int(p) for p in head if start <= p < end} for head in pos])
    return layers, doc


def measures(layers: list[list[set]], doc: range) -> dict:
    n = len(doc)
    union = [len(set().union(*heads)) / n for heads in layers]
    head_overlap = [np.mean([jaccard(a, b) for i, a in enumerate(heads) for b in heads[i + 1:]]) for heads in layers
                    if len(heads) > 1]
    layer_overlap = [np.mean([jaccard(a, b) for a, b in zip(x, y)]) for x, y in zip(layers, layers[1:])]
    everything = set().union(*(h for heads in layers for h in heads))
    return dict(head_union=float(np.mean(union)), head_overlap=float(np.mean(head_overlap)) if head_overlap else None,
                layer_overlap=float(np.mean(layer_overlap)) if layer_overlap else None,
                model_union=len(everything) / n, kept_per_head=float(np.mean([len(h) for hs in layers for h in hs]) / n),
                per_layer_union=[round(u, 4) for u in union])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--docs", default="0:6")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--ratio", type=float, default=4.0)
    ap.add_argument("--arms", default="default,no_carry,spread25,random,intrinsic")
    ap.add_argument("--source", choices=("documents", "papers"), default="documents",
                    help="as grid.py's; papers: the choosing half (the held-out half is for judging layouts)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    model, tok = load_model(model_path(args.model))
    docs = grid_docs(tok, args.docs, args.tokens, source=args.source,
                     held_out=False if args.source == "papers" else None)
    rows = []
    for arm in args.arms.split(","):
        for i, d in enumerate(docs):
            layers, doc = kept_sets(model, tok, CANDIDATES[arm], d.text, args.ratio, seed=i)
            rows.append(dict(arm=arm, doc=d.name, **measures(layers, doc)))
            print(arm, d.name, {k: v for k, v in rows[-1].items() if k not in ("arm", "doc", "per_layer_union")},
                  flush=True)
    print(f"\n{args.model}, {len(docs)} documents of {args.tokens} tokens at {args.ratio:g}x (means over documents)")
    print("| layout | kept per head | head union | head overlap | layer overlap | model union |")
    print("|---|---|---|---|---|---|")
    for arm in args.arms.split(","):
        mine = [r for r in rows if r["arm"] == arm]
        cells = [np.mean([r[k] for r in mine if r[k] is not None]) for k in
                 ("kept_per_head", "head_union", "head_overlap", "layer_overlap", "model_union")]
        print(f"| {arm} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(meta=vars(args), rows=rows), indent=1))


if __name__ == "__main__":
    main()
