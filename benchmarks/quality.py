"""Quality side by side, one run: perplexity, passkey retrieval, summaries.

    python benchmarks/quality.py --task all            # full grid (long: see README)
    python benchmarks/quality.py --task passkey --quick

Every arm holds the same token budget per compressed layer:
  full            mlx_lm KVCache (the reference)
  l2norm          L2NormKVCache keep-low, recent = budget // 8, layers 0-1 uncompressed
  l2norm_r0       keep-low, no recent window, layers 0-1 uncompressed (the paper's setting)
  l2norm_deep     like l2norm, but layers 0-8 uncompressed: the library default on
                  the embedded model (retrieval breaks when layers 2-8 are compressed)
  keep_high       the paper's ablation (keep the highest norms)
  random          random scores, same machinery
  streaming       sinks + most recent tokens (StreamingLLM), same machinery
  rotating        mlx_lm RotatingKVCache(budget, keep=4) in every layer (max_kv_size)
The other eviction arms leave layers 0-1 uncompressed; bytes are counted
over all layers, so each arm's real compression ratio is reported next to it.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import time
from pathlib import Path
from typing import Callable, Optional

import knorm_gen  # noqa: F401  (BLAS preload first)
import mlx.core as mx
import numpy as np
from mlx_lm.generate import stream_generate
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from knorm_gen import EvictionConfig, L2NormKVCache, cache_stats, make_eviction_cache
from knorm_gen.cache import copy_caches
from knorm_gen.corpus import pydoc_sections, text_of_tokens
from knorm_gen.generate import generate_with_eviction, split_question_prompts
from knorm_gen.models import load_model

RESULTS = Path(__file__).parent / "results"
ARMS = ("full", "l2norm", "l2norm_r0", "l2norm_deep", "keep_high", "random", "streaming", "rotating")
DEEP_SKIP = tuple(range(9))


def arm_config(arm: str, budget: int) -> Optional[EvictionConfig]:
    # "l2norm" is the paper's setting (layers 0 and 1 uncompressed); "l2norm_deep"
    # leaves layers 0-8 uncompressed, which became the library default (30%).
    kw = dict(budget=budget, n_sink=EvictionConfig().n_sink, skip_layers=(0, 1))
    if arm == "l2norm":
        return EvictionConfig(**kw)
    if arm == "l2norm_r0":
        return EvictionConfig(**{**kw, "recent": 0})
    if arm == "l2norm_deep":
        return EvictionConfig(**{**kw, "skip_layers": DEEP_SKIP})
    if arm in ("keep_high", "random", "streaming"):
        keep = {"keep_high": "high", "random": "random", "streaming": "recent"}[arm]
        return EvictionConfig(**{**kw, "recent": 0, "keep": keep})
    return None


def make_arm(model, arm: str, budget: int) -> list:
    if arm == "full":
        return make_prompt_cache(model)
    if arm == "rotating":
        return [RotatingKVCache(max_size=budget, keep=4) for _ in model.layers]
    return make_eviction_cache(model, arm_config(arm, budget))


# ---------------------------------------------------------------- perplexity
def perplexity(model, ids: list[int], caches: list, block: int) -> float:
    """Generation-mode perplexity: tokens fed in blocks through the cache."""
    nll, count = 0.0, 0
    x = mx.array(ids)
    for start in range(0, len(ids) - 1, block):
        end = min(start + block, len(ids) - 1)
        logits = model(x[None, start:end], cache=caches)[0].astype(mx.float32)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        tgt = x[start + 1 : end + 1]
        nll += -mx.take_along_axis(logp, tgt[:, None], axis=-1).sum().item()
        count += end - start
        mx.eval([c.state for c in caches])
    return math.exp(nll / count)


def task_ppl(model, tok, grid: dict, arms, n_docs, block, log) -> dict:
    """``grid`` maps a length in tokens to the budgets run at that length."""
    rows = []
    lengths = list(grid)
    for length in lengths:
        budgets = grid[length]
        docs = [text_of_tokens(tok, length, skip=i * 3) for i in range(n_docs if length <= 1024 else 1)]
        for d, ids in enumerate(docs):
            full = perplexity(model, ids, make_arm(model, "full", 0), block)
            rows.append(dict(length=length, doc=d, arm="full", budget=None, ppl=full, compression=1.0))
            for budget in budgets:
                if budget >= length:
                    continue
                for arm in arms:
                    if arm == "full":
                        continue
                    caches = make_arm(model, arm, budget)
                    p = perplexity(model, ids, caches, block)
                    ratio = cache_stats(caches).compression_ratio
                    rows.append(dict(length=length, doc=d, arm=arm, budget=budget, ppl=p, compression=ratio))
                    log(f"ppl len={length} doc={d} budget={budget} {arm:14s} {p:8.2f} (full {full:.2f}, {ratio:.2f}x)")
    summary = []
    for length in lengths:
        fulls = [r["ppl"] for r in rows if r["length"] == length and r["arm"] == "full"]
        for budget in grid[length]:
            for arm in arms:
                if arm == "full":
                    continue
                sel = [r for r in rows if r["length"] == length and r["arm"] == arm and r["budget"] == budget]
                if not sel:
                    continue
                ppl = float(np.exp(np.mean([np.log(r["ppl"]) for r in sel])))
                full = float(np.exp(np.mean(np.log(fulls))))
                summary.append(dict(length=length, budget=budget, arm=arm, ppl=ppl, full_ppl=full,
                                    vs_full_pct=100 * (ppl / full - 1),
                                    compression=float(np.mean([r["compression"] for r in sel]))))
    return {"block": block, "docs": n_docs, "docs_note": "lengths above 1024 use one document", "grid": {str(k): v for k, v in grid.items()}, "rows": rows,
            "summary": summary}


# ---------------------------------------------------------------- passkey
QUESTION = "What is the pass key?"
ANSWER_PREFIX = "The pass key is"  # the assistant turn starts with it, so the digits come first
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def passkey_context(tok, n_tokens: int, depth: float, key: str) -> str:
    """Filler text of about ``n_tokens`` tokens with the key sentence at ``depth``."""
    per = len(tok.encode(FILLER, add_special_tokens=False))
    reps = max(1, n_tokens // per)
    at = int(reps * depth)
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    return "There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it. " + (
        FILLER * at + needle + FILLER * (reps - at))


def _full_prefill(model, ids: list[int], step: int = 512) -> list:
    return _prefill(model, ids, make_prompt_cache(model), step)


def _prefill(model, ids: list[int], caches: list, step: int = 512) -> list:
    """Feed ``ids`` through ``caches`` in blocks of ``step`` tokens."""
    for s in range(0, len(ids), step):
        model(mx.array(ids[s : s + step])[None], cache=caches)
        mx.eval([c.state for c in caches])
    return caches


def compress_from_full(model, full: list, arm: str, budget: int) -> list:
    """The arm's caches after one block holding everything in ``full`` (attend
    first, evict after: the same as a one-block prefill through the arm)."""
    if arm == "full":
        return copy_caches(full)
    out = []
    for f, a in zip(full, make_arm(model, arm, budget)):
        if isinstance(a, (L2NormKVCache, RotatingKVCache)):
            a.update_and_fetch(f.keys[..., : f.offset, :], f.values[..., : f.offset, :])
            out.append(a)
        else:
            out.append(copy_caches([f])[0])
    mx.eval([c.state for c in out])
    return out


def _answer(model, tok, ids: list[int], caches: list, max_tokens: int = 8) -> str:
    return "".join(r.text for r in stream_generate(model, tok, mx.array(ids), max_tokens=max_tokens,
                                                   prompt_cache=caches))


def task_passkey(model, tok, lengths, depths, n_keys, ratios, arms, log, blocked_arms=(), blocked_ratios=(4,),
                 blocked_max_length=2048) -> dict:
    rng = random.Random(0)
    rows = []
    for length in lengths:
        for depth in depths:
            for _ in range(n_keys):
                key = str(rng.randint(10000, 99999))
                context = passkey_context(tok, length, depth, key)
                prefix_ids, (q_ids,) = split_question_prompts(tok, context, [QUESTION], chat=True)
                q_ids = q_ids + tok.encode(ANSWER_PREFIX, add_special_tokens=False)
                n_ctx = len(prefix_ids)
                full_ctx = _full_prefill(model, prefix_ids)
                full_all = copy_caches(full_ctx)
                model(mx.array(q_ids[:-1])[None], cache=full_all)
                mx.eval([c.state for c in full_all])
                for ratio in ratios:
                    budget = n_ctx // ratio
                    for arm in arms:
                        # context then question: context compressed, question and answer kept
                        caches = compress_from_full(model, full_ctx, arm, budget)
                        for c in caches:
                            if isinstance(c, L2NormKVCache):
                                c.pin()
                        ctq = _answer(model, tok, q_ids, caches)
                        # whole prompt compressed (question included), answer under eviction
                        caches = compress_from_full(model, full_all, arm, budget)
                        whole = _answer(model, tok, q_ids[-1:], caches)
                        for mode, text in (("ctq", ctq), ("whole", whole)):
                            rows.append(dict(length=length, tokens=n_ctx, depth=depth, key=key, ratio=ratio,
                                             budget=budget, arm=arm, mode=mode, ok=key in text, answer=text))
                        log(f"passkey len={n_ctx} depth={depth} {ratio}x {arm:14s} ctq={key in ctq} "
                            f"whole={key in whole}")
                    if ratio not in blocked_ratios or length > blocked_max_length:
                        continue
                    for arm in blocked_arms:  # the product path: context prefilled in 512-token blocks
                        caches = _prefill(model, prefix_ids, make_arm(model, arm, budget))
                        for c in caches:
                            if isinstance(c, L2NormKVCache):
                                c.pin()
                        text = _answer(model, tok, q_ids, caches)
                        rows.append(dict(length=length, tokens=n_ctx, depth=depth, key=key, ratio=ratio,
                                         budget=budget, arm=arm, mode="ctq_blocked", ok=key in text, answer=text))
                        log(f"passkey len={n_ctx} depth={depth} {ratio}x {arm:14s} ctq_blocked={key in text}")
    summary = []
    for key_ in sorted({(r["length"], r["ratio"], r["arm"], r["mode"]) for r in rows}):
        sel = [r for r in rows if (r["length"], r["ratio"], r["arm"], r["mode"]) == key_]
        summary.append(dict(length=key_[0], ratio=key_[1], arm=key_[2], mode=key_[3],
                            correct=sum(r["ok"] for r in sel), cases=len(sel)))
    return {"rows": rows, "summary": summary}


# ---------------------------------------------------------------- summaries
def rouge_l(candidate: str, reference: str) -> float:
    """ROUGE-L F1 over lower-cased word tokens (LCS-based)."""
    a = re.findall(r"\w+", candidate.lower())
    b = re.findall(r"\w+", reference.lower())
    if not a or not b:
        return 0.0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    p, r = lcs / len(a), lcs / len(b)
    return 2 * p * r / (p + r)


def task_summary(model, tok, n_docs, max_doc_tokens, budgets, arms, max_tokens, log, blocked=True) -> dict:
    docs = pydoc_sections(min_chars=6000)[:n_docs]
    rows = []
    for name, text in docs:
        ids = tok.encode(text, add_special_tokens=False)[:max_doc_tokens]
        body = tok.decode(ids)
        prompt = [{"role": "user", "content": "Summarize the following documentation in three sentences.\n\n" + body}]
        prompt_ids = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        full = _full_prefill(model, prompt_ids[:-1])
        ref = _answer(model, tok, prompt_ids[-1:], copy_caches(full), max_tokens)
        rows.append(dict(doc=name, tokens=len(prompt_ids), arm="full", budget=None, rouge_l=1.0, summary=ref))
        for budget in budgets:
            for arm in arms:
                if arm == "full":
                    continue
                caches = compress_from_full(model, full, arm, budget)
                out = _answer(model, tok, prompt_ids[-1:], caches, max_tokens)
                score = rouge_l(out, ref)
                rows.append(dict(doc=name, tokens=len(prompt_ids), arm=arm, budget=budget, rouge_l=score,
                                 compression=cache_stats(caches).compression_ratio, summary=out))
                log(f"summary {name:16s} budget={budget} {arm:14s} ROUGE-L {score:.3f}")
            if blocked:
                r = generate_with_eviction(model, tok, prompt, budget=budget, max_tokens=max_tokens)
                score = rouge_l(r.text, ref)
                rows.append(dict(doc=name, tokens=len(prompt_ids), arm="l2norm_blocked", budget=budget,
                                 rouge_l=score, compression=r.compression_ratio, summary=r.text))
                log(f"summary {name:16s} budget={budget} l2norm_blocked ROUGE-L {score:.3f}")
    summary = []
    for budget in budgets:
        for arm in sorted({r["arm"] for r in rows if r["budget"] == budget}):
            s = [r["rouge_l"] for r in rows if r["arm"] == arm and r["budget"] == budget]
            summary.append(dict(budget=budget, arm=arm, docs=len(s), mean=float(np.mean(s)),
                                median=float(np.median(s)), min=float(np.min(s)), max=float(np.max(s))))
    return {"max_doc_tokens": max_doc_tokens, "max_tokens": max_tokens, "rows": rows, "summary": summary}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", choices=["ppl", "passkey", "summary", "all"], default="all")
    ap.add_argument("--model", default="default")
    ap.add_argument("--quick", action="store_true", help="a small grid that finishes in a few minutes")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--out-dir", default=str(RESULTS))
    args = ap.parse_args(argv)
    arms = tuple(a for a in args.arms.split(",") if a)
    unknown = set(arms) - set(ARMS)
    if unknown:
        ap.error(f"unknown arms {sorted(unknown)}; allowed: {', '.join(ARMS)}")
    model, tok = load_model(None if args.model == "default" else args.model)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    meta = {"model": args.model, "quick": args.quick, "arms": list(arms), "runtime": knorm_gen.runtime_info(),
            "defaults": EvictionConfig().to_dict()}
    results = {}
    tasks = ["ppl", "passkey", "summary"] if args.task == "all" else [args.task]
    for task in tasks:
        tic = time.perf_counter()
        if task == "ppl":
            grid = {512: [128]} if args.quick else {1024: [128, 256, 512], 4096: [512]}
            res = task_ppl(model, tok, grid, arms, 1 if args.quick else 2, 32, log)
        elif task == "passkey":
            res = task_passkey(model, tok, [1024] if args.quick else [1024, 2048, 4096],
                               [0.5] if args.quick else [0.1, 0.3, 0.5, 0.7, 0.9], 1,
                               [4] if args.quick else [4, 8], arms, log,
                               blocked_arms=() if args.quick else ("l2norm",))
        else:
            res = task_summary(model, tok, 1 if args.quick else 8, 512 if args.quick else 1024,
                               [128] if args.quick else [256], arms, 16 if args.quick else 48, log,
                               blocked=not args.quick)
        res.update(meta, task=task, seconds=time.perf_counter() - tic)
        path = out_dir / f"quality_{task}.json"
        path.write_text(json.dumps(res, indent=1))
        log(f"wrote {path} ({res['seconds']:.0f} s)")
        results[task] = res
    return results


if __name__ == "__main__":
    main()
