"""Which of a key sentence's tokens each bounded KV head holds after the product's prefill, per arm.

    python benchmarks/held_heads.py --model default --cases-from \
        benchmarks/results/choose_default-default-fresh-readmes2-querycarry.json --docs more-itertools \
        --arms question_carry_rec25,question_per_query_carry_rec25 \
        --out benchmarks/results/held_heads-default-more-itertools.json

A diagnosis, not a score: it replays a ``choose_default.py`` file's pass-key cases asked after the
context (``ctq``; each README cut to ``--key-doc-tokens``, the key sentence placed as the file's
run placed it), prefills each through the product's caches (``Evaluator.caches``, the same path as
``choose_default.py``), and reports per bounded layer and KV head how many of the key sentence's
tokens (``knorm_gen.tune.needle``: the key, "Remember it.", the key again) the head still holds,
with the answer the arm then gives. Unlike ``layer_retention.py`` (one selection over the whole
context, no carrying board), this is the selection the product makes, block by block.
"""
import argparse
import json
import sys
from pathlib import Path

import knorm_gen  # noqa: F401  (BLAS preload first)
import numpy as np
from knorm_gen.models import load_model
from knorm_gen.scores import rank_positions
from knorm_gen.evaluate import Evaluator, head_tokens, needle, with_needle
from knorm_gen.layouts import CANDIDATES

from documents import installed_readmes


def needle_positions(tok, ids: list, key: str) -> list[int]:
    """The token positions of ``ids`` whose text overlaps the key sentence (:func:`needle`)."""
    pieces = [tok.decode([int(t)]) for t in ids]
    starts, text = [], ""
    for p in pieces:
        starts.append(len(text))
        text += p
    sentence = needle(key).strip()
    a = text.find(sentence)
    if a < 0:
        raise SystemExit(f"key {key}: its sentence is not in the decoded prompt")
    return [i for i, (s, p) in enumerate(zip(starts, pieces)) if s + len(p) > a and s < a + len(sentence)]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--cases-from", required=True, help="a choose_default.py results file: its ctq pass-key cases "
                    "on installed READMEs (doc readme:NAME) are replayed")
    ap.add_argument("--docs", default="", help="only these READMEs (package names, comma-separated)")
    ap.add_argument("--arms", default="question_carry_rec25,question_per_query_carry_rec25")
    ap.add_argument("--key-doc-tokens", type=int, default=1536)
    ap.add_argument("--ratio", type=float, default=4.0)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in CANDIDATES]
    if unknown:
        raise SystemExit(f"--arms: unknown {unknown}; choose from {', '.join(CANDIDATES)}")
    rows = json.loads(Path(args.cases_from).read_text())["rows"]
    want = {d for d in args.docs.split(",") if d}
    cases = sorted({(r["doc"], r["depth"], r["key"]) for r in rows if r.get("task") == "passkey"
                    and r.get("mode") == "ctq" and str(r.get("doc", "")).startswith("readme:")
                    and (not want or r["doc"].split(":", 1)[1] in want)})
    if not cases:
        raise SystemExit(f"--cases-from {args.cases_from}: no ctq pass-key case on a README"
                         + (f" named {sorted(want)}" if want else ""))
    model, tok = load_model(None if args.model == "default" else args.model)
    tuner = Evaluator(model, tok, {a: CANDIDATES[a] for a in arms}, ratio=args.ratio)
    texts = {d.name: head_tokens(tok, d.text, args.key_doc_tokens)
             for d in installed_readmes(sorted({c[0].split(":", 1)[1] for c in cases}))}
    out_rows = []
    for doc, depth, key in cases:
        prefix, q_ids, spans, budget = tuner.ctq_case(with_needle(texts[doc], depth, key))
        where = needle_positions(tok, list(prefix), key)
        for arm in arms:
            answer, caches = tuner.ctq_answer(arm, doc + key, prefix, q_ids, spans, budget)
            layers = {}
            for i, c in enumerate(caches):
                if getattr(c, "rank", None) is None:
                    continue  # a layer kept whole
                held = np.array(rank_positions(c.rank[:, :, : c.count]))[0]
                layers[str(i)] = [int(np.isin(where, h).sum()) for h in held]
            heads = [n for v in layers.values() for n in v]
            row = dict(doc=doc, depth=depth, key=key, arm=arm, tokens=len(prefix), budget=budget,
                       needle_at=where[0], needle_tokens=len(where), answer=answer, ok=key in answer,
                       layers=layers, heads_whole=sum(n == len(where) for n in heads),
                       heads_none=sum(n == 0 for n in heads), heads=len(heads))
            out_rows.append(row)
            print(f"{doc} {depth} {arm}: key at token {where[0]}, {answer!r}; heads holding all "
                  f"{len(where)} tokens {row['heads_whole']}, none {row['heads_none']}, of {len(heads)}",
                  file=sys.stderr, flush=True)
    result = dict(model=args.model, cases_from=args.cases_from, arms=arms, rows=out_rows)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
