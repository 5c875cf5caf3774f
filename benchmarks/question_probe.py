"""Keys in real prose: a question-aware selection, as a prototype patched in (not in the product yet).

    python benchmarks/question_probe.py --model default --split tune --docs 4
    python benchmarks/question_probe.py --model gemma-3-270m --split heldout --docs 4
    python benchmarks/question_probe.py --split heldout --docs 0 --fillers harbor,recipe --depths 0.1,0.3,0.5,0.7,0.9
    python benchmarks/question_probe.py --segment 16 --split heldout --arms full,question    # sentence pieces
    python benchmarks/question_probe.py --task fidelity --segment 16 --split heldout --arms random,default,question

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
  after "is"; ``--ahead`` reaches further after a hit), or with ``--segment N``
  instead the best score of its sentence piece of at most N tokens (a hit keeps its
  sentence). The score is static, so held keys are not re-scored. It runs in
  every evicting layer with the recent window at 1/8 of the budget, no coverage.

``--task fidelity`` measures summary fidelity instead (the tuner's protocol: the
full cache's own 64-token summary of each document cut to ``--doc-tokens``,
teacher-forced; recovered share against no document), with arms full, none,
random, default, question and ``question_<layout>`` (the question rule on another
CANDIDATES layout's budget split, e.g. its coverage and recent shares); the probe
is the summary instruction and a no-document draft.

The probe pass, the pieces and the scores are :mod:`knorm_gen.question`'s; the
rule is patched into :mod:`knorm_gen.scores` and :mod:`knorm_gen.cache` for this
run only. Results: results/question_probe-<model>-<split>.json (with ``--docs 0
--fillers ...``: ``-fillers.json``; ``--task fidelity``: results/question_fidelity-<model>-<split>.json).
"""

from __future__ import annotations

import argparse
import json
import time
import zlib
from pathlib import Path

import knorm_gen  # noqa: F401  (BLAS preload first)
import mlx.core as mx
import numpy as np

import knorm_gen.cache as kc
import knorm_gen.scores as ks
from knorm_gen.cache import EvictionKVCache, make_eviction_cache, pin_caches, set_probe
from knorm_gen.config import EvictionConfig
from knorm_gen.engine import prefill
from knorm_gen.models import load_model
from knorm_gen.prompts import context_spans, has_chat_template, split_question_prompts
from knorm_gen.question import LOCAL, make_probe, probe_queries, question_scores, segment_ids
from knorm_gen.cache import copy_caches
from knorm_gen.evaluate import (FILLERS, KEY_CUE, KEY_QUESTION, SUMMARY_QUESTION, Doc, answer_nll, cut_repetition,
                                filler_text, head_tokens, with_needle)
from knorm_gen.evaluate import greedy_ids as _greedy
from knorm_gen.layouts import CANDIDATES

from documents import documents  # benchmarks/documents.py

RESULTS = Path(__file__).parent / "results"
DEFAULT = "lev30_blend_cov25_rec50"  # its "default" arm: 0.6's default (--preset intrinsic)
ARMS = ("full", "default", "pinned_needle", "question")


SEGMENTS: dict = {}  # "ids": np.ndarray, the segment of each absolute position of the current case


def question_score(pool: int, local: int, ahead: int = 0, shared: bool = False, segment: int = 0):
    def score(keys: mx.array, positions: mx.array, anchor: mx.array = None) -> mx.array:
        n = keys.shape[2]
        segs = None
        if segment:  # the pieces of the block's positions (the case's prompt, knorm_gen.question.segment_ids)
            at = np.clip(np.array(positions.reshape(-1))[-n:], 0, len(SEGMENTS["ids"]) - 1)
            segs = mx.array(SEGMENTS["ids"][at])[None]
        s = question_scores(keys, anchor, segs, local=local)
        if shared:  # every KV head of the layer keeps the same positions: the best head's score
            s = mx.broadcast_to(mx.max(s, axis=1, keepdims=True), s.shape)
        fwd = 0 if segment else max(pool, ahead)
        if fwd:  # a token takes the best score from `fwd` positions before it to `pool` after it
            pad = mx.full(s.shape[:-1] + (fwd,), -1e30, dtype=s.dtype)
            p = mx.concatenate([pad, s, pad], axis=-1)
            s = mx.max(mx.stack([p[..., fwd + j : fwd + j + n] for j in range(-fwd, pool + 1)]), axis=0)
        return -s  # lower is kept first
    return score


PROTO = "question_proto"  # the patched variants' rule name (the product's own is "question")
RUN: dict = {}  # how this run's question arm scores: product (bool), draft, segment


def patch(pool: int, local: int, ahead: int = 0, shared: bool = False, segment: int = 0, draft: int = 8) -> None:
    """Choose the question arm's rule: the product's ``keep="question"`` (knorm_gen.question)
    for ``--segment N --local 64`` without the other variants; else register ``keep="question_proto"``
    here, whose running state is the probe's queries, fixed."""
    RUN.update(product=bool(segment) and local == LOCAL and not shared, draft=draft, segment=segment)
    ks.SCORES[PROTO] = question_score(pool, local, ahead, shared, segment)
    kc.RUNNING = ks.RUNNING | {PROTO}
    update, reference, rescore = kc.running_update, kc.running_reference, kc.rescore
    kc.running_update = lambda keep, state, *a, **k: state if keep == PROTO else update(keep, state, *a, **k)
    kc.running_reference = lambda keep, state, *a, **k: state if keep == PROTO else reference(keep, state, *a, **k)
    kc.rescore = lambda keep, n_sink, keys, rank, anchor, spans=None: (
        rank if keep == PROTO else rescore(keep, n_sink, keys, rank, anchor, spans))


def needle_span(tok, prefix: list, start: int, end: int, key: str) -> tuple[int, int]:
    """Token positions around the key sentence (both copies of the key, and the words around them)."""
    hits = [i for i in range(start, end) if key in tok.decode(prefix[max(start, i - 5) : i + 1])
            and key not in tok.decode(prefix[max(start, i - 5) : i])]
    return (hits[0] - 12, hits[-1] + 10) if hits else (start, start)


def question_caches(model, tok, layout: dict, budget: int, prefix: list, spans, q_ids: list) -> list:
    """Caches of ``layout``'s budget split with the question rule in every evicting layer,
    probed with the text after the document, ``q_ids`` and a no-document draft."""
    if RUN["product"]:
        config = EvictionConfig(budget=budget, **{**layout, "keep": "question", "early_keep": "question"})
        caches = make_eviction_cache(model, config, spans)
        return set_probe(caches, make_probe(model, tok, prefix, spans, [q_ids], RUN["draft"], RUN["segment"]))
    (start, end), = spans
    SEGMENTS["ids"] = segment_ids(tok, prefix, RUN["segment"] or 1)
    queries = probe_queries(model, prefix, start, end, q_ids, RUN["draft"])
    caches = make_eviction_cache(model, EvictionConfig(budget=budget, **{**layout, "keep": "low", "early_keep": "low"}),
                                 spans)
    for c, q in zip(caches, queries):
        if isinstance(c, EvictionKVCache) and c.budget is not None and c.budget < kc.UNBOUNDED:
            c.keep, c.key_sum = PROTO, q
    return caches


def fidelity(model, tok, chat: bool, docs: list, arms: list, layouts: dict, out: Path, meta: dict) -> list:
    """Summary fidelity (tune.Tuner.fidelity's protocol): the full cache's own 64-token summary,
    teacher-forced; recovered = (none - arm) / (none - full) of its mean NLL."""
    rows: list = []
    for d in docs:
        prefix, (q_ids,) = split_question_prompts(tok, d.text, [SUMMARY_QUESTION], chat=chat)
        spans = context_spans(tok, d.text, prefix, chat=chat) or ((0, len(prefix)),)
        budget = max(8, len(prefix) // 4)
        full = prefill(model, prefix, make_eviction_cache(model, EvictionConfig(budget=None), spans), 512)
        ref = cut_repetition(_greedy(model, tok, q_ids, copy_caches(full), 64, penalty=1.2))
        none_prefix, (none_q,) = split_question_prompts(tok, "(no document)", [SUMMARY_QUESTION], chat=chat)
        nll = dict(full=answer_nll(model, copy_caches(full), q_ids, ref),
                   none=answer_nll(model, make_eviction_cache(model, EvictionConfig(budget=None)), none_prefix + none_q, ref))
        line = []
        for arm in arms:
            if arm in ("full", "none"):
                continue
            mx.random.seed(0)
            if arm.startswith("question"):
                caches = question_caches(model, tok, layouts[arm], budget, prefix, spans, q_ids)
            else:
                caches = make_eviction_cache(model, EvictionConfig(budget=budget, **layouts[arm]), spans)
            caches = prefill(model, prefix, caches, 512)
            nll[arm] = answer_nll(model, pin_caches(caches), q_ids, ref)
        for arm, v in nll.items():
            rec = (nll["none"] - v) / (nll["none"] - nll["full"]) if nll["none"] > nll["full"] else None
            rows.append(dict(task="fidelity", doc=d.name, tokens=len(prefix), budget=budget, arm=arm, nll=v,
                             recovered=rec, reference=tok.decode(ref)))
            line.append(f"{arm}={rec:.2f}" if rec is not None else f"{arm}=?")
        print(d.name, len(prefix), " ".join(line), flush=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps({**meta, "rows": rows}, indent=1))
        tmp.replace(out)
    for arm in dict.fromkeys(r["arm"] for r in rows):
        rec = [r["recovered"] for r in rows if r["arm"] == arm and r["recovered"] is not None]
        print(f"{arm:16s} recovered {sum(rec) / max(1, len(rec)):.3f} over {len(rec)} documents")
    return rows


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
    ap.add_argument("--shared-heads", action="store_true", help="a layer's KV heads keep the same positions "
                    "(the best head's score)")
    ap.add_argument("--task", choices=("passkey", "fidelity"), default="passkey")
    ap.add_argument("--doc-tokens", type=int, default=2048, help="fidelity: documents cut to this many tokens")
    ap.add_argument("--question-layout", default="low", help="the CANDIDATES layout the arm 'question' takes its "
                    "budget split from (its rule replaced); with --task fidelity, 'question_<layout>' arms name others")
    ap.add_argument("--segment", type=int, default=0, help="score sentence pieces of at most this many tokens "
                    "by their best token, instead of --pool (0: off)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    arms = args.arms.split(",")
    if args.task == "fidelity":
        return run_fidelity(args, arms)
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"unknown arm(s) {', '.join(unknown)}: choose from {', '.join(ARMS)}")
    patch(args.pool, args.local, args.ahead, args.shared_heads, args.segment, args.draft)
    model, tok = load_model(None if args.model == "default" else args.model)
    chat = has_chat_template(tok)
    split = documents(tok)[(0 if args.split == "tune" else 1)::2][args.skip : args.skip + args.docs]
    split += [Doc(f"filler:{f}", filler_text(FILLERS[f], tok, args.key_doc_tokens)) for f in args.fillers.split(",") if f]
    name = f"question_probe-{args.model}-{args.split}" + ("-fillers" if not args.docs and args.fillers else "")
    out = Path(args.out or RESULTS / f"{name}.json")
    meta = dict(model=args.model, split=args.split, ratio=4.0, pool=args.pool, ahead=args.ahead, local=args.local, draft=args.draft,
                shared_heads=args.shared_heads, segment=args.segment, question_layout=args.question_layout,
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
            line = []
            for arm in arms:
                tic = time.perf_counter()
                if arm == "full":
                    caches = make_eviction_cache(model, EvictionConfig(budget=None), spans)
                elif arm in ("default", "pinned_needle"):
                    caches = make_eviction_cache(model, EvictionConfig(budget=budget, **CANDIDATES[DEFAULT]),
                                                 ((start, lo), (hi, end)) if arm == "pinned_needle" else spans)
                else:  # question
                    caches = question_caches(model, tok, CANDIDATES[args.question_layout], budget, prefix, spans,
                                             q_ids)
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


def run_fidelity(args, arms: list) -> list:
    layouts = {"default": CANDIDATES[DEFAULT], "random": CANDIDATES["random"],
               "question": CANDIDATES[args.question_layout]}
    layouts.update({a: CANDIDATES[a[len("question_"):]] for a in arms if a.startswith("question_")})
    unknown = [a for a in arms if a not in layouts and a not in ("full", "none")]
    if unknown:
        raise SystemExit(f"unknown arm(s) {', '.join(unknown)}: full, none, random, default, question, "
                         f"question_<a CANDIDATES layout>")
    patch(args.pool, args.local, args.ahead, args.shared_heads, args.segment, args.draft)
    model, tok = load_model(None if args.model == "default" else args.model)
    chat = has_chat_template(tok)
    split = documents(tok)[(0 if args.split == "tune" else 1)::2][args.skip : args.skip + args.docs]
    docs = [Doc(d.name, head_tokens(tok, d.text, args.doc_tokens)) for d in split]
    out = Path(args.out or RESULTS / f"question_fidelity-{args.model}-{args.split}.json")
    meta = dict(model=args.model, task="fidelity", split=args.split, ratio=4.0, pool=args.pool, local=args.local,
                draft=args.draft, segment=args.segment, question_layout=args.question_layout,
                doc_tokens=args.doc_tokens, docs=[d.name for d in docs])
    return fidelity(model, tok, chat, docs, arms, layouts, out, meta)


if __name__ == "__main__":
    main()
