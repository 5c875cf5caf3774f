"""Which variant of the question rule's scores keeps a key asked after the context, per bounded layer? (no generation)

    python benchmarks/layer_retention.py --model gemma-3-270m --split tune --docs 10 \
        --variants local64,none,line,half64,half128,annulus128_32,line_lp0.5,line_lp1,line_lp2
    python benchmarks/layer_retention.py --model default --split tune --docs 10 --variants local64,none,line
    python benchmarks/layer_retention.py --model M --split tune --docs 10 --variants local64,qlocal64,qlocal128 \
        --out benchmarks/results/layer_retention-M-tune-query.json                    # 0.9.2
    python benchmarks/layer_retention.py --model M --split tune --docs 10 --variants local64,bestof64_128 \
        --out benchmarks/results/layer_retention-M-tune-bestof.json
    python benchmarks/layer_retention.py --model M --readmes tqdm,rich,regex,pydantic,typer,tokenizers --docs 6 \
        --variants local64,zlocal64,qlocal128,zlocal128 --out benchmarks/results/layer_retention-M-readmes-tune-z.json
    python benchmarks/layer_retention.py --model M --split tune --docs 10 \
        --variants local64,carry0.125_local64,carry0.25_local64 --out benchmarks/results/layer_retention-M-tune-carry.json
    python benchmarks/layer_retention.py --model M --readmes tqdm,rich,regex,pydantic,typer,tokenizers --docs 6 \
        --variants local64,carry0.125_local64,carry0.25_local64[,carry0.5_local64] \
        --out benchmarks/results/layer_retention-M-readmes-tune-carry.json                 # 0.9.3

The proxy behind 0.9.1 (docs/results.md). Per case (each document cut to 2,048 then
1,536 tokens as ``choose_default.py`` cuts it, the key sentence at depths 0.25 and
0.75, the key question asked after the context as ``answer_questions`` asks it),
one forward pass of the context gives every layer's keys and the product's probe
(:func:`knorm_gen.question.make_probe` with the question). Each bounded layer's KV
heads then select their budget (context / 4, the recent quarter, the template pinned)
by the variant's scores in one selection, and the case reports the share of the
bounded layers' heads that keep one mention of the key's digits; a case counts as
kept when all of them do. Variants, what is taken out of a key's best probe score
before its sentence piece takes the best: ``local64`` the mean within 64 positions
(the product), ``none``, ``line`` each 512-token block's least-squares line over its
positions, ``halfN`` half the mean within N, ``annulusN_E`` the mean within N less
the E nearest, ``line_lpA`` ``line`` less A x log2 of the piece's length, ``qlocalN`` each probe query's
own mean within N taken out before the best is taken, ``zlocalN`` the mean within N out and the
result divided by the standard deviation within N, ``bestofA_B`` the larger of
``localA``'s and ``qlocalB``'s piece scores, ``carryF_BASE`` variant BASE with a share F of each
head's rule slots (after the first bounded layer) kept for the pieces with the best standardised
score (over the evictable, unrepeated positions) of any head of the bounded layers before it.
"""
import argparse
import json
import sys
from pathlib import Path

import knorm_gen  # noqa: F401  (BLAS preload first)
import mlx.core as mx
import numpy as np
from knorm_gen import question as Q
from knorm_gen.mlx_compat import full_attention_layers, record_attention
from knorm_gen.models import load_model
from knorm_gen.prompts import as_tokenizer, context_spans, has_chat_template, split_question_prompts
from knorm_gen.evaluate import KEY_CUE, KEY_QUESTION, Doc, head_tokens, needle, passkey_cases

from choose_default import SPLIT_FILLERS
from documents import documents, installed_readmes
from whole_prompt_keys import token_range

BLOCK = 512


def variant(name: str) -> dict:
    """A variant's settings from its name (see the module docstring)."""
    if name == "local64":
        return dict(local=64)
    if name == "none":
        return dict(local=0)
    if name.startswith("line"):
        return dict(local=0, line=True, lp=float(name.split("_lp")[1]) if "_lp" in name else 0.0)
    if name.startswith("half"):
        return dict(local=int(name[4:]), frac=0.5)
    if name.startswith("bestof"):  # bestofA_B: the larger of local A and qlocal B
        a, b = name[6:].split("_")
        return dict(bestof=(dict(local=int(a)), dict(local=int(b), perq=True)))
    if name.startswith("zlocal"):  # zlocalN: the local mean out, then divided by the local spread
        return dict(local=int(name[6:]), z=True)
    if name.startswith("qlocal"):
        return dict(local=int(name[6:]), perq=True)
    if name.startswith("carry"):  # carryF_BASE: a share F of the rule's slots to the earlier layers' best
        share, base = name[5:].split("_", 1)
        return dict(variant(base), carry=float(share))
    if name.startswith("annulus"):
        reach, near = name[7:].split("_")
        return dict(local=int(reach), near=int(near))
    raise SystemExit(f"--variants: unknown {name!r}; choose local64, none, line, line_lpA, halfN, qlocalN, zlocalN, bestofA_B, "
                     "annulusN_E, carryF_BASE")


def window_sum(x: np.ndarray, reach: int) -> tuple[np.ndarray, np.ndarray]:
    """Sums of ``x`` (positions on axis 1) within ``reach`` positions either side, and
    how many positions each sum holds (fewer at the ends)."""
    n = x.shape[1]
    c = np.concatenate([np.zeros_like(x[:, :1]), np.cumsum(x, axis=1)], axis=1)
    i = np.arange(n)
    lo, hi = np.maximum(i - reach, 0), np.minimum(i + reach + 1, n)
    return c[:, hi] - c[:, lo], (hi - lo).astype(np.float64)


def scores(keys: mx.array, queries: mx.array, pieces: np.ndarray, repeated: np.ndarray, v: dict) -> np.ndarray:
    """(H, N) float64 piece scores of one layer's keys under variant ``v`` (higher kept first)."""
    if v.get("bestof"):
        a, b = v["bestof"]
        return np.maximum(scores(keys, queries, pieces, repeated, a), scores(keys, queries, pieces, repeated, b))
    full = np.array(keys.astype(mx.float32) @ mx.swapaxes(queries, -1, -2))[0].astype(np.float64)  # (H, N, M)
    h, n = full.shape[:2]
    if v.get("perq"):  # each probe query's own local mean out before the best is taken
        total, count = window_sum(full, v["local"])
        full = full - total / count[None, :, None]
        v = {**v, "local": 0}
    s = full.max(axis=-1)
    if v.get("local"):
        total, count = window_sum(s, v["local"])
        if v.get("near"):
            t2, c2 = window_sum(s, v["near"])
            total, count = total - t2, count - c2
        mean = total / np.maximum(count, 1.0)
        if v.get("z"):
            sq, _ = window_sum(s * s, v["local"])
            spread = np.sqrt(np.maximum(sq / np.maximum(count, 1.0) - mean * mean, 1e-12))
            s = (s - mean) / spread
        else:
            s = s - v.get("frac", 1.0) * mean
    if v.get("line"):
        for b0 in range(0, n, BLOCK):
            blk = s[:, b0:b0 + BLOCK]
            x = np.arange(blk.shape[1], dtype=np.float64)
            for r in range(h):
                fit = np.polyval(np.polyfit(x, blk[r], 1), x) if len(x) > 2 else blk[r].mean()
                blk[r] -= fit
    out = np.empty_like(s)
    for p in np.unique(pieces):
        m = pieces == p
        out[:, m] = s[:, m].max(axis=-1, keepdims=True) - v.get("lp", 0.0) * np.log2(m.sum())
    return out - Q.REPEAT_PENALTY * repeated[None].astype(np.float64)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--split", choices=("tune", "heldout"), default="tune")
    ap.add_argument("--readmes", default="", help="instead of the split's documents, these installed packages' READMEs")
    ap.add_argument("--docs", type=int, default=10)
    ap.add_argument("--fillers", action="store_true", help="also the split's two fillers (choose_default's)")
    ap.add_argument("--variants", default="local64,none,line")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    names = args.variants.split(",")
    settings = {name: variant(name) for name in names}  # an unknown name stops here, before the model loads
    model, tok = load_model(None if args.model == "default" else args.model)
    tok = as_tokenizer(tok)
    chat = has_chat_template(tok)
    split = installed_readmes(args.readmes.split(",")) if args.readmes else \
        documents(tok)[0::2] if args.split == "tune" else documents(tok)[1::2]
    docs = [Doc(d.name, head_tokens(tok, head_tokens(tok, d.text, 2048), 1536)) for d in split[:args.docs]]
    cases = passkey_cases(docs, (), tok, [0.25, 0.75], 0)
    if args.fillers:
        cases += passkey_cases([], SPLIT_FILLERS[args.split], tok, [0.3, 0.7], 1)
    layers = full_attention_layers(model)
    question = KEY_QUESTION if chat else KEY_CUE
    head = len(split_question_prompts(tok, "x", [question], chat=chat)[0]) - 1 if chat else 0
    rows = []
    for name, context, key, depth in cases:
        prefix, (q_ids,) = split_question_prompts(tok, context, [question], chat=chat)
        spans = context_spans(tok, context, prefix, chat=chat)
        n = len(prefix)
        budget = max(8, int(n / 4))
        recent = int(budget * 0.25)
        at = context.index(needle(key))
        lo, hi = token_range(tok, prefix, at, at + len(needle(key)), head)
        digits = [i for i in range(lo, hi) if any(ch.isdigit() for ch in tok.decode([prefix[i]]))]
        mentions = (digits[: len(digits) // 2], digits[len(digits) // 2:])
        calls: list = []
        with record_attention(model, calls):
            model(mx.array(prefix)[None])
        probe = Q.make_probe(model, tok, prefix, spans, [q_ids])
        evictable = np.zeros(n, bool)
        for a, b in spans:
            evictable[a:b] = True
        evictable[n - recent:] = False
        row = dict(doc=name, depth=depth, key=key, tokens=n, budget=budget)
        for vname, v in settings.items():
            kept = []
            carry = None  # per position, the best standardised piece score of the earlier bounded layers' heads
            share = int(v.get("carry", 0.0) * max(budget - int((~evictable).sum()), 0))
            for li in layers:
                queries, pieces, repeated = probe[li]
                rep = np.array(repeated)[0, :n]
                s = scores(calls[li][1], queries, np.array(pieces)[0, :n], rep, v)
                carried = np.argsort(-carry, kind="stable")[:share] if carry is not None else []
                for r in range(s.shape[0]):
                    rank = np.where(evictable, s[r], np.inf)
                    rank[carried] = np.inf  # the carried share first, then the head's own scores
                    order = np.argsort(-rank, kind="stable")[:budget]
                    keep = set(order.tolist())
                    kept.append(any(all(i in keep for i in m) for m in mentions))
                if v.get("carry"):
                    ok = evictable & ~rep
                    mu = s[:, ok].mean(axis=1, keepdims=True)
                    sd = np.maximum(s[:, ok].std(axis=1, keepdims=True), 1e-12)
                    z = np.where(ok[None], (s - mu) / sd, -np.inf).max(axis=0)
                    carry = z if carry is None else np.maximum(carry, z)
            row[vname] = float(np.mean(kept))
        rows.append(row)
        print(f"{name:28s} {depth:.2f} " + " ".join(f"{v}:{row[v]:.2f}" for v in names), flush=True)
    summary = {v: dict(mean=float(np.mean([r[v] for r in rows])), cases_kept=sum(r[v] == 1.0 for r in rows),
                       cases=len(rows)) for v in names}
    for v, t in summary.items():
        print(f"{v:14s} heads keeping the key {t['mean']:.3f}, cases kept {t['cases_kept']}/{t['cases']}")
    out = Path(args.out or Path(__file__).parent / "results" / f"layer_retention-{args.model}-{args.split}.json")
    out.write_text(json.dumps(dict(model=args.model, split=args.split, variants=names, rows=rows, summary=summary),
                              indent=1))
    return summary


if __name__ == "__main__":
    main()
