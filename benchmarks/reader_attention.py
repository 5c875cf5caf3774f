"""How much of each query head's attention a layout keeps, while the model reads a human-written summary.

The grid scores a layout by the teacher-forced likelihood of a paper's own abstract. This looks one
step inside that number. Per paper, as the grid builds it (the same prompt, pass key and pinned
summary question; :class:`~knorm_gen.tuning.evaluate.Evaluator`), each layout's caches are
prefilled and their kept positions read. Then the full cache reads the abstract after the summary
question, and for every compressed layer and **query head** this measures the share of the head's
attention on the document that falls on the positions its KV head kept. A KV head serves a group
of query heads (3 on SmolLM2, 4 on Gemma 3 270M, 7 on Qwen2.5-0.5B), and it keeps one set of
positions for all of them.

Printed per model: the mean share per layout, how many query heads the first layout serves worse
than the second, and the same for the worst-served head of each group. Then what each layout keeps
by kind of token and by stretch of the document: the share of its kept document positions that are
*word* tokens (any letter or digit; the others are spaces, punctuation, line breaks, markup), beside
that share in the whole document and the share of the reader's attention that falls on word tokens;
and per tenth of the document, the share of it each layout keeps and the reader's attention on it.

    python benchmarks/reader_attention.py --model qwen2.5-0.5b --docs 0:3 --out benchmarks/results/reader-attention-qwen2.json
    python benchmarks/reader_attention.py --model default --docs 0:3
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import knorm_gen  # noqa: F401  (before mlx: it loads OpenBLAS)
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grid import cases, choosing_half_options, grid_docs, model_path  # noqa: E402

from knorm_gen import load_model  # noqa: E402
from knorm_gen.eviction.cache import EvictionKVCache  # noqa: E402
from knorm_gen.eviction.layouts import CANDIDATES  # noqa: E402
from knorm_gen.generation.engine import prefill  # noqa: E402
from knorm_gen.platform.mlx_compat import record_attention  # noqa: E402
from knorm_gen.tuning.evaluate import Evaluator  # noqa: E402


def kept_positions(ev: Evaluator, arm: str, c: dict) -> dict[int, list[set]]:
    """Per compressed layer, per KV head, the positions ``arm`` kept once the prompt is read,
    prefilled as the grid prefills it."""
    ev.seed(c["doc"].name + c["key"])
    caches, _ = ev.prefill_case(arm, c)
    return {i: [set(map(int, h)) for h in np.array(cache.ordered_state()[2][0]).tolist()]
            for i, cache in enumerate(caches) if isinstance(cache, EvictionKVCache)}


def reader_attention(ev: Evaluator, c: dict, layers: set) -> dict[int, np.ndarray]:
    """Per layer in ``layers``, ``(query heads, positions)``: the full cache's attention of the
    abstract's tokens, read after the summary question, summed over those tokens."""
    model, prefix = ev.model, c["prefix"]
    caches = prefill(model, prefix, make_prompt_cache(model), ev.step)
    model(mx.array([c["sum_q"]]), cache=caches)
    calls: list = []
    human = c["human"]
    with record_attention(model, calls):
        model(mx.array([human[:-1]]), cache=caches)
    out = {}
    for layer, (q, k, scale) in enumerate(calls):
        if layer not in layers:
            continue
        q, k = q.astype(mx.float32)[0], k.astype(mx.float32)[0]  # (Hq, L, D), (Hkv, T, D)
        group = q.shape[0] // k.shape[0]
        k = mx.repeat(k, group, axis=0)
        s = (q @ mx.swapaxes(k, -1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
        n_q, n_k = s.shape[1], s.shape[2]
        causal = mx.arange(n_k)[None, :] <= (n_k - n_q + mx.arange(n_q))[:, None]
        w = mx.softmax(mx.where(causal[None], s, -mx.inf), axis=-1)
        out[layer] = np.array(mx.sum(w, axis=1))  # (Hq, T)
    return out


def shares(weights: dict[int, np.ndarray], kept: dict[int, list[set]], start: int, end: int) -> dict[int, list]:
    """Per layer, per query head: the share of its attention on the document that falls on the
    positions its KV head kept."""
    out = {}
    for layer, w in weights.items():
        heads = kept[layer]
        group = w.shape[0] // len(heads)
        row = []
        for h in range(w.shape[0]):
            doc = w[h, start:end]
            keep = [p - start for p in heads[h // group] if start <= p < end]
            row.append(float(doc[keep].sum() / doc.sum()))
        out[layer] = row
    return out


def word_tokens(tok, ids: list, start: int, end: int) -> np.ndarray:
    """Per document position, whether its token holds a letter or a digit."""
    return np.array([any(ch.isalnum() for ch in tok.decode([int(t)])) for t in list(ids)[start:end]])


def by_kind(weights: dict[int, np.ndarray], kept: dict[int, list[set]], words: np.ndarray, start: int) -> dict:
    """The share of kept document positions that are word tokens, the reader's attention share on word
    tokens, and per tenth of the document the share kept and the reader's attention share (means over
    compressed layers and heads)."""
    n = len(words)
    tenth = np.minimum(np.arange(n) * 10 // n, 9)
    word_share, kept_tenths = [], []
    for heads in kept.values():
        for h in heads:
            pos = np.array(sorted(p - start for p in h if start <= p < start + n), dtype=int)
            word_share.append(words[pos].mean() if len(pos) else 0.0)
            kept_tenths.append(np.bincount(tenth[pos], minlength=10) / np.bincount(tenth, minlength=10))
    read_word, read_tenths = [], []
    for w in weights.values():
        doc = w[:, start : start + n]
        doc = doc / doc.sum(axis=1, keepdims=True)
        read_word.append(doc[:, words].sum(axis=1).mean())
        read_tenths.append(np.stack([doc[:, tenth == t].sum(axis=1) for t in range(10)], axis=1).mean(axis=0))
    return dict(kept_word_share=float(np.mean(word_share)), document_word_share=float(words.mean()),
                reader_word_share=float(np.mean(read_word)), kept_by_tenth=np.mean(kept_tenths, axis=0).round(4).tolist(),
                reader_by_tenth=np.mean(read_tenths, axis=0).round(4).tolist())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    choosing_half_options(ap, docs="0:3")
    ap.add_argument("--arms", default="default,random", help="two layouts of knorm_gen.eviction.layouts.CANDIDATES")
    args = ap.parse_args()
    path = model_path(args.model)
    model, tok = load_model(path)
    arms = args.arms.split(",")
    ev = Evaluator(model, tok, {a: CANDIDATES[a] for a in arms}, ratio=4.0, log=lambda _: None)
    rows, kinds = [], []
    for _, doc, key, depth in cases(tok, grid_docs(tok, args.docs, args.tokens, source="papers", held_out=False), [],
                                    args.tokens):
        c = ev.document_case(doc, key, depth, 256)
        (start, end), = c["spans"]
        kept = {arm: kept_positions(ev, arm, c) for arm in arms}
        weights = reader_attention(ev, c, set(kept[arms[0]]))
        words = word_tokens(tok, c["prefix"], start, end)
        for arm in arms:
            for layer, row in shares(weights, kept[arm], start, end).items():
                rows.append(dict(doc=doc.name, arm=arm, layer=layer, shares=[round(x, 4) for x in row]))
            kinds.append(dict(doc=doc.name, arm=arm, **by_kind(weights, kept[arm], words, start)))
        print(f"{doc.name}: {end - start} document tokens, {len(c['human'])} abstract tokens", flush=True)
    first, second = arms
    by = {(r["doc"], r["arm"], r["layer"]): np.array(r["shares"]) for r in rows}
    keys = sorted({(d, l) for d, _, l in by})
    diff = np.concatenate([by[d, first, l] - by[d, second, l] for d, l in keys])
    n_kv = len(kept[first][next(iter(kept[first]))])
    group = len(diff) // len(keys) // n_kv
    worst = np.concatenate([(by[d, first, l] - by[d, second, l]).reshape(n_kv, group).min(axis=1) for d, l in keys])
    summary = dict(mean_share={arm: round(float(np.mean(np.concatenate([by[d, arm, l] for d, l in keys]))), 4)
                               for arm in arms},
                   query_heads=len(diff), heads_worse=int((diff < 0).sum()), group=group,
                   mean_difference=round(float(diff.mean()), 4),
                   worst_head_of_group_mean_difference=round(float(worst.mean()), 4),
                   groups_whose_worst_head_is_worse=int((worst < 0).sum()), groups=len(worst))
    print(f"{args.model}: query heads per KV head {group}; share of each query head's document attention kept: "
          + ", ".join(f"{arm} {v:.3f}" for arm, v in summary["mean_share"].items()))
    print(f"  {first} keeps less than {second} for {summary['heads_worse']} of {summary['query_heads']} "
          f"(layer, head, paper) cases; mean difference {summary['mean_difference']:+.3f}; the worst-served "
          f"head of each group {summary['worst_head_of_group_mean_difference']:+.3f} "
          f"({summary['groups_whose_worst_head_is_worse']} of {summary['groups']} worse)")
    for arm in arms:
        mine = [k for k in kinds if k["arm"] == arm]
        summary[f"by_kind_{arm}"] = {key: (np.mean([k[key] for k in mine], axis=0).round(4).tolist()
                                          if isinstance(mine[0][key], list) else round(float(np.mean([k[key] for k in mine])), 4))
                                    for key in mine[0] if key not in ("doc", "arm")}
        k = summary[f"by_kind_{arm}"]
        print(f"  {arm}: word tokens {k['kept_word_share']:.3f} of the kept document positions (the document "
              f"{k['document_word_share']:.3f}; the reader's attention on them {k['reader_word_share']:.3f}); kept per "
              f"tenth " + " ".join(f"{x:.2f}" for x in k["kept_by_tenth"]))
    print("  the reader's attention per tenth " + " ".join(f"{x:.2f}" for x in summary[f"by_kind_{arms[0]}"]["reader_by_tenth"]))
    if args.out:
        meta = dict(model=args.model, docs=args.docs, tokens=args.tokens, arms=arms, ratio=4, out=args.out)
        Path(args.out).write_text(json.dumps(dict(meta=meta, summary=summary, rows=rows, kinds=kinds), indent=1) + "\n")


if __name__ == "__main__":
    main()
