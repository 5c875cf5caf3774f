"""Keys in real prose: a question-aware selection, as a prototype patched in (not in the product yet).

    python benchmarks/question_probe.py --model default --split tune --docs 4
    python benchmarks/question_probe.py --model gemma-3-270m --split heldout --docs 4
    python benchmarks/question_probe.py --split heldout --docs 0 --fillers harbor,recipe --depths 0.1,0.3,0.5,0.7,0.9

Every intrinsic layout measured so far keeps no key planted in real prose at 4x
(choose_default.py, docs/results.md). Per case (a document of the split cut to
``--key-doc-tokens`` tokens, the key sentence at depth 0.25 and 0.75, the
pass-key question after it and pinned, budget = prompt / 4) this runs four arms
through the product's 512-token prefill:

- ``full``: no eviction;
- ``default``: today's default layout (blend, leverage in the first 30% of the
  full-attention layers, coverage 0.25, recent_share 0.5);
- ``pinned_needle``: the default with the needle's tokens pinned (an oracle: it
  knows where the key is), which tells a lost key (selection) from a model
  that cannot read a fragmentary context;
- ``question``: a rule that scores each key by the attention the job's own
  instructions would give it. Before the document is prefilled, a probe pass runs
  the template before the document, then the instructions after it and the
  question at their true positions (RoPE), then ``--draft`` tokens the model
  answers with no document ("The pass key is a ..."), recording the queries.
  A key's score is its largest dot product with a unit-length probe query of its
  KV head's group, less the mean score of the keys within ``--local`` positions
  (RoPE's decay with distance would otherwise favour late keys), max-pooled over
  ``--pool`` positions either side (keeps the tokens around a hit: the digits
  after "is"; ``--ahead`` reaches further after a hit). The score is static, so held keys are not re-scored. It runs in
  every evicting layer with the recent window at 1/8 of the budget, no coverage.

The rule is patched into :mod:`knorm_gen.scores` and :mod:`knorm_gen.cache` for
this run only. Results: results/question_probe-<model>-<split>.json (with ``--docs 0
--fillers ...``: ``-fillers.json``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import zlib
from pathlib import Path

import knorm_gen  # noqa: F401  (BLAS preload first)
import mlx.core as mx

import knorm_gen.cache as kc
import knorm_gen.scores as ks
from knorm_gen.cache import EvictionKVCache, make_eviction_cache, pin_caches
from knorm_gen.config import EvictionConfig
from knorm_gen.engine import prefill
from knorm_gen.mlx_compat import record_attention
from knorm_gen.models import load_model
from knorm_gen.prompts import context_spans, has_chat_template, split_question_prompts
from knorm_gen.tune import (CANDIDATES, FILLERS, KEY_CUE, KEY_QUESTION, Doc, _greedy, filler_text, head_tokens,
                            with_needle)

from documents import documents  # benchmarks/documents.py

RESULTS = Path(__file__).parent / "results"
DEFAULT = "lev30_blend_cov25_rec50"
ARMS = ("full", "default", "pinned_needle", "question")


def question_score(pool: int, local: int, ahead: int = 0):
    def score(keys: mx.array, positions: mx.array, anchor: mx.array = None) -> mx.array:
        s = mx.max(keys.astype(mx.float32) @ mx.swapaxes(anchor, -1, -2), axis=-1)  # (B, H, N)
        n = s.shape[-1]
        if local:
            c = mx.concatenate([mx.zeros(s.shape[:-1] + (1,), s.dtype), mx.cumsum(s, axis=-1)], axis=-1)
            i = mx.arange(n)
            lo, hi = mx.maximum(i - local, 0), mx.minimum(i + local + 1, n)
            s = s - (mx.take(c, hi, axis=-1) - mx.take(c, lo, axis=-1)) / (hi - lo).astype(mx.float32)
        fwd = max(pool, ahead)
        if fwd:  # a token takes the best score from `fwd` positions before it to `pool` after it
            pad = mx.full(s.shape[:-1] + (fwd,), -1e30, dtype=s.dtype)
            p = mx.concatenate([pad, s, pad], axis=-1)
            s = mx.max(mx.stack([p[..., fwd + j : fwd + j + n] for j in range(-fwd, pool + 1)]), axis=0)
        return -s  # lower is kept first
    return score


def patch(pool: int, local: int, ahead: int = 0) -> None:
    """Register ``keep="question"``: its running state is the probe's queries, fixed."""
    ks.SCORES["question"] = question_score(pool, local, ahead)
    kc.RUNNING = ks.RUNNING | {"question"}
    update, reference, rescore = kc.running_update, kc.running_reference, kc.rescore
    kc.running_update = lambda keep, state, *a, **k: state if keep == "question" else update(keep, state, *a, **k)
    kc.running_reference = lambda keep, state, *a, **k: state if keep == "question" else reference(keep, state, *a, **k)
    kc.rescore = lambda keep, n_sink, keys, rank, anchor, spans=None: (
        rank if keep == "question" else rescore(keep, n_sink, keys, rank, anchor, spans))


class _ProbeCache:
    """A plain growing cache whose offset (the RoPE position) can jump over the document."""

    def __init__(self):
        self.keys = self.values = None
        self.offset = 0

    def update_and_fetch(self, k, v):
        self.keys = k if self.keys is None else mx.concatenate([self.keys, k], axis=2)
        self.values = v if self.values is None else mx.concatenate([self.values, v], axis=2)
        self.offset += k.shape[2]
        return self.keys, self.values

    @property
    def state(self):
        return self.keys, self.values


def probe_queries(model, prefix: list, start: int, end: int, q_ids: list, draft: int) -> list:
    """Per layer ``(1, KV heads, group x probe tokens, D)`` unit queries of the
    instructions after the document, the question and a no-document answer draft."""
    caches = [_ProbeCache() for _ in model.layers]
    calls: list = []
    with record_attention(model, calls):
        if start > 0:
            model(mx.array(prefix[:start])[None], cache=caches)
        calls.clear()
        for c in caches:
            c.offset = end
        logits = model(mx.array(prefix[end:] + q_ids)[None], cache=caches)
        for _ in range(draft):
            logits = model(mx.array([[int(mx.argmax(logits[0, -1]).item())]]), cache=caches)
    n = len(model.layers)
    out = []
    for i in range(n):
        q = mx.concatenate([calls[j][0] for j in range(i, len(calls), n)], axis=2).astype(mx.float32)
        b, hq, m, d = q.shape
        hk = calls[i][1].shape[1]
        q = q.reshape(b, hk, (hq // hk) * m, d)
        out.append(q * mx.rsqrt(mx.maximum(mx.sum(q * q, axis=-1, keepdims=True), 1e-30)))
    return out


def needle_span(tok, prefix: list, start: int, end: int, key: str) -> tuple[int, int]:
    """Token positions around the key sentence (both copies of the key, and the words around them)."""
    hits = [i for i in range(start, end) if key in tok.decode(prefix[max(start, i - 5) : i + 1])
            and key not in tok.decode(prefix[max(start, i - 5) : i])]
    return (hits[0] - 12, hits[-1] + 10) if hits else (start, start)


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--split", choices=("tune", "heldout"), default="tune")
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--skip", type=int, default=0, help="leave out the split's first N documents (a fresh set)")
    ap.add_argument("--key-doc-tokens", type=int, default=1536)
    ap.add_argument("--depths", default="0.25,0.75")
    ap.add_argument("--fillers", default="", help="also these fillers of knorm_gen.tune.FILLERS, a key in each "
                    "(docs 0 leaves only them)")
    ap.add_argument("--arms", default="full,default,pinned_needle,question")
    ap.add_argument("--pool", type=int, default=4)
    ap.add_argument("--local", type=int, default=64)
    ap.add_argument("--ahead", type=int, default=0, help="a hit's score also reaches this many positions after it "
                    "(when more than --pool)")
    ap.add_argument("--draft", type=int, default=8)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"unknown arm(s) {', '.join(unknown)}: choose from {', '.join(ARMS)}")
    patch(args.pool, args.local, args.ahead)
    model, tok = load_model(None if args.model == "default" else args.model)
    chat = has_chat_template(tok)
    split = documents(tok)[(0 if args.split == "tune" else 1)::2][args.skip : args.skip + args.docs]
    split += [Doc(f"filler:{f}", filler_text(FILLERS[f], tok, args.key_doc_tokens)) for f in args.fillers.split(",") if f]
    name = f"question_probe-{args.model}-{args.split}" + ("-fillers" if not args.docs and args.fillers else "")
    out = Path(args.out or RESULTS / f"{name}.json")
    meta = dict(model=args.model, split=args.split, ratio=4.0, pool=args.pool, ahead=args.ahead, local=args.local, draft=args.draft,
                docs=[d.name for d in split])
    rows: list = []
    for d in split:
        for depth in (float(x) for x in args.depths.split(",")):
            key = str(10000 + zlib.crc32(f"{d.name}{depth}".encode()) % 89999)
            text = with_needle(head_tokens(tok, d.text, args.key_doc_tokens), depth, key)
            prefix, (q_ids,) = split_question_prompts(tok, text, [KEY_QUESTION if chat else KEY_CUE], chat=chat)
            spans = context_spans(tok, text, prefix, chat=chat) or ((0, len(prefix)),)
            (start, end), = spans
            budget = max(8, len(prefix) // 4)
            lo, hi = needle_span(tok, prefix, start, end, key)
            queries = probe_queries(model, prefix, start, end, q_ids, args.draft) if "question" in arms else None
            line = []
            for arm in arms:
                tic = time.perf_counter()
                if arm == "full":
                    caches = make_eviction_cache(model, EvictionConfig(budget=None), spans)
                elif arm in ("default", "pinned_needle"):
                    caches = make_eviction_cache(model, EvictionConfig(budget=budget, **CANDIDATES[DEFAULT]),
                                                 ((start, lo), (hi, end)) if arm == "pinned_needle" else spans)
                else:  # question
                    caches = make_eviction_cache(model, EvictionConfig(budget=budget, **CANDIDATES["low"]), spans)
                    for c, q in zip(caches, queries):
                        if isinstance(c, EvictionKVCache) and c.budget is not None and c.budget < kc.UNBOUNDED:
                            c.keep, c.key_sum = "question", q
                mx.random.seed(0)
                caches = prefill(model, prefix, caches, 512)
                answer = tok.decode(_greedy(model, tok, q_ids, pin_caches(caches), 16))
                rows.append(dict(doc=d.name, depth=depth, key=key, tokens=len(prefix), budget=budget, arm=arm,
                                 ok=key in answer, answer=answer, seconds=round(time.perf_counter() - tic, 2)))
                line.append(f"{arm}={int(key in answer)}")
            print(d.name, depth, len(prefix), " ".join(line), flush=True)
            tmp = out.with_suffix(".tmp")  # a checkpoint per case: a kill never leaves half a file
            tmp.write_text(json.dumps({**meta, "rows": rows}, indent=1))
            tmp.replace(out)
    found = {(r["doc"], r["depth"]) for r in rows if r["arm"] == "full" and r["ok"]}
    for arm in arms:
        ok = {(r["doc"], r["depth"]) for r in rows if r["arm"] == arm and r["ok"]}
        print(f"{arm:14s} {len(ok)}/{len(rows) // len(arms)} found, {len(ok & found)}/{len(found)} "
              f"of the full cache's")
    return rows


if __name__ == "__main__":
    main()
