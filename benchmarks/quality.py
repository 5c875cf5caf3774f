"""Quality side by side, one run per model: perplexity, passkey retrieval, summaries, summary fidelity.

    python benchmarks/quality.py --model default --task all          # SmolLM2 (hours: see README)
    python benchmarks/quality.py --model gemma-3-270m --task passkey
    python benchmarks/quality.py --task passkey --quick              # smoke run
    python benchmarks/quality.py --task fidelity --fidelity-docs 20 --ratios 4,8

Every eviction arm holds the same token budget per compressed layer; bytes are
counted over all layers, so each arm's real byte compression is reported beside it.
  full        the model's own caches (the reference)
  default     the library default, whatever it is when the benchmark runs (0.3: blend with coverage 0.25;
              every other arm sets coverage=0, its rule alone)
  keydiff_all keep="keydiff" in every full-attention layer (the default of 0.2)
  random_all  random scores in every full-attention layer: keydiff_all's twin at equal bytes
  blend_all   keep="blend" (KeyDiff's cosine + 0.5 ln|k|) in every full-attention layer
  low_all     keep-low in every full-attention layer
  paper       keep-low, recent = budget // 8, layers 0-1 uncompressed (the paper's layers)
  keep_high   the paper's ablation (keep the highest norms), layers 0-1 uncompressed
  random      random scores, same machinery, layers 0-1 uncompressed
  streaming   sinks + most recent tokens (StreamingLLM), same machinery, layers 0-1 uncompressed
  rotating    mlx_lm RotatingKVCache(budget, keep=4) in every full-attention layer (max_kv_size)
  probe       keep-low with the layers knorm-probe suggests uncompressed (computed at the start)
  skip30      keep-low with the first 30% of all layers uncompressed: the default before 0.2 on models
              without sliding-window layers (on Gemma 3 it skipped global layers 5 and 11: `probe`)
  bounded_x8  keep-low in every full-attention layer; the first 30% get 8x the budget (a ceiling:
              EvictionConfig(early_factor=8))
  bounded_x4  the same with 4x
Sliding-window layers (Gemma 3) keep their own caches in every arm.

Fidelity (DESIGN.md section 9) takes any of the arms above, and its own:
  none        the question alone, no document (what the model guesses unaided)
  random_same random scores with the retrieval preset's layers whole (skip30's twin on SmolLM2, probe's on Gemma 3)
  recent_all  sinks + most recent in every full-attention layer
  rotating    as above
and reports recovered = (nll_none - nll_arm) / (nll_none - nll_full) of a reference summary
(the full cache's greedy one, and the package authors' one-line summary where there is one)
after the product path's 512-token block prefill of the document through the arm.

Passkey: a needle sentence in repetitive filler at depths 0.1-0.9, then the cue
"The pass key is" for the model to complete (completion style: the full cache
found keys far more often so than with a chat turn, a longer question or prose
filler; see README). Each case's context
is prefilled once with the full cache; every arm compresses a copy of it, which is
what a one-block prefill through the arm keeps (attend first, evict after). The
product path (the library's 512-token block prefill) runs for the default arm.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

import knorm_gen  # noqa: F401  (BLAS preload first)
import mlx.core as mx
import numpy as np
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

from knorm_gen import EvictionConfig, L2NormKVCache, cache_stats, make_eviction_cache
from knorm_gen import answer_questions
from knorm_gen.cache import copy_caches, pin_caches
from knorm_gen.engine import prefill
from knorm_gen.evaluate import answer_nll, cut_repetition  # the tuner's fidelity, shared
from knorm_gen.config import PRESETS, early_layers as default_skip_layers
from knorm_gen.mlx_compat import full_attention_layers
from knorm_gen.corpus import pydoc_sections, text_of_tokens
from knorm_gen.generate import generate_with_eviction
from knorm_gen.prompts import split_question_prompts
from knorm_gen.models import load_model
from knorm_gen.probe import probe_model

from documents import documents, missing as missing_documents  # benchmarks/documents.py

RESULTS = Path(__file__).parent / "results"
ARMS = ("full", "keydiff_all", "random_all", "blend_all", "low_all", "skip30", "bounded_x8", "bounded_x4", "paper",
        "probe", "keep_high", "random", "streaming", "rotating", "default")
DEFAULT_RUN = ARMS[:-1]  # "default" is keydiff_all, the library's default: listed once
QUICK_RUN = ("full", "keydiff_all", "random_all", "skip30", "paper", "probe", "rotating")  # the smoke run
FIDELITY_ARMS = ("full", "none", "keydiff_all", "random_all", "blend_all", "low_all", "skip30", "paper",
                 "random_same", "recent_all", "rotating")
# each arm's random counterpart at equal bytes (the same layers compressed): paired wins are counted against it
RANDOM_PAIR = {"default": "random_all", "skip30": "random_same", "low_all": "random_all",
               "keydiff_all": "random_all", "blend_all": "random_all", "recent_all": "random_all"}
QUICK_FIDELITY_ARMS = ("full", "none", "keydiff_all", "random_all", "rotating")


class Arms:
    """Cache lists for every arm of one model."""

    def __init__(self, model, probe_skip: list[int]):
        self.model = model
        self.n = len(model.layers)
        self.full_layers = full_attention_layers(model)
        self.probe_skip = tuple(probe_skip)
        self.early = default_skip_layers(self.n)

    def config(self, arm: str, budget: int) -> Optional[EvictionConfig]:
        # every arm but "default" states coverage=0: its rule alone (the default's layout changed in 0.3)
        paper = dict(budget=budget, skip_layers=(0, 1), coverage=0.0)
        low = dict(budget=budget, keep="low", coverage=0.0)
        table = {  # every arm names its rule: the default's rule changed in 0.2
            # 0.5's and 0.6's default (--preset intrinsic): these arms are fed without a probe, so since 0.7
            # (the question rule, probed) the default is measured by choose_default.py and question_probe.py
            "default": EvictionConfig(budget=budget, **PRESETS["intrinsic"]),
            "paper": EvictionConfig(**paper, keep="low"),
            "keep_high": EvictionConfig(**paper, recent=0, keep="high"),
            "random": EvictionConfig(**paper, recent=0, keep="random"),
            "streaming": EvictionConfig(**paper, recent=0, keep="recent"),
            "probe": EvictionConfig(**low, skip_layers=self.probe_skip),
            "skip30": EvictionConfig(**low, skip_layers=self.early),
            "bounded_x8": EvictionConfig(**low, early_factor=8),
            "bounded_x4": EvictionConfig(**low, early_factor=4),
            # skip30's twin at equal bytes: random with the retrieval preset's layers whole
            "random_same": EvictionConfig(budget=budget, keep="random", skip_layers=None, coverage=0.0),
            "low_all": EvictionConfig(**low, skip_layers=()),
            "random_all": EvictionConfig(budget=budget, keep="random", skip_layers=(), coverage=0.0),
            "recent_all": EvictionConfig(budget=budget, keep="recent", skip_layers=(), coverage=0.0),
            "keydiff_all": EvictionConfig(budget=budget, keep="keydiff", skip_layers=(), coverage=0.0),
            "blend_all": EvictionConfig(budget=budget, keep="blend", skip_layers=(), coverage=0.0),
        }
        return table.get(arm)

    def caches(self, arm: str, budget: int) -> list:
        if arm == "full":
            return make_prompt_cache(self.model)
        if arm == "rotating":
            return [RotatingKVCache(max_size=budget, keep=4) if i in self.full_layers else c
                    for i, c in enumerate(make_prompt_cache(self.model))]
        return make_eviction_cache(self.model, self.config(arm, budget))


def compress_from_full(arms: Arms, full: list, arm: str, budget: int) -> list:
    """The arm's caches after one block holding everything in ``full`` (attend
    first, evict after: the same as a one-block prefill through the arm)."""
    if arm == "full":
        return copy_caches(full)
    out = []
    for i, (f, a) in enumerate(zip(full, arms.caches(arm, budget))):
        if isinstance(a, L2NormKVCache) or (isinstance(a, RotatingKVCache) and i in arms.full_layers):
            a.update_and_fetch(f.keys[..., : f.offset, :], f.values[..., : f.offset, :])
            out.append(a)
        else:
            out.append(copy_caches([f])[0])
    mx.eval([c.state for c in out])
    return out




def _answer(model, tok, ids: list[int], caches: list, max_tokens: int = 8) -> str:
    return "".join(r.text for r in stream_generate(model, tok, mx.array(ids), max_tokens=max_tokens,
                                                   prompt_cache=caches))


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


def task_ppl(model, tok, arms: Arms, grid: list, arm_names, n_docs: int, log) -> dict:
    """``grid`` lists ``(length, budget, arms)`` (``arms`` None: every arm given);
    documents are pydoc prose (sections joined), each starting at other sections."""
    rows = []
    lengths = sorted({length for length, _, _ in grid})
    for length in lengths:
        block = 32 if length <= 1024 else 64
        for d in range(n_docs):
            ids = text_of_tokens(tok, length, skip=d * 7)
            full = perplexity(model, ids, arms.caches("full", 0), block)
            rows.append(dict(length=length, doc=d, arm="full", budget=None, ppl=full, compression=1.0, block=block))
            for _, budget, only in (g for g in grid if g[0] == length):
                for arm in arm_names:
                    if arm == "full" or (only is not None and arm not in only):
                        continue
                    caches = arms.caches(arm, budget)
                    p = perplexity(model, ids, caches, block)
                    ratio = cache_stats(caches).compression_ratio
                    rows.append(dict(length=length, doc=d, arm=arm, budget=budget, ppl=p, compression=ratio,
                                     block=block))
                    log(f"ppl len={length} doc={d} budget={budget} {arm:11s} {p:8.2f} (full {full:.2f}, {ratio:.2f}x)")
    summary = []
    for length, budget, _ in grid:
        fulls = [r["ppl"] for r in rows if r["length"] == length and r["arm"] == "full"]
        for arm in arm_names:
            sel = [r for r in rows if r["length"] == length and r["arm"] == arm and r["budget"] == budget]
            if arm == "full" or not sel:
                continue
            ppl = float(np.exp(np.mean([np.log(r["ppl"]) for r in sel])))
            full = float(np.exp(np.mean(np.log(fulls))))
            summary.append(dict(length=length, budget=budget, arm=arm, ppl=ppl, full_ppl=full,
                                vs_full_pct=100 * (ppl / full - 1), docs=len(sel),
                                compression=float(np.mean([r["compression"] for r in sel]))))
    grid_out: dict = {}
    for length, budget, _ in grid:
        grid_out.setdefault(str(length), []).append(budget)
    return {"docs": n_docs, "grid": grid_out, "rows": rows, "summary": summary}


# ---------------------------------------------------------------- passkey
# The cue the model completes. Calibrated (README): with "What is the pass key? The pass key is"
# the full cache lost keys past the first third of a 2k context on SmolLM2; with the bare cue it
# found them at 2k-8k on SmolLM2 and at 4k-16k on Gemma 3.
QUESTION = "The pass key is"
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
INTRO = "There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it. "


def passkey_context(tok, n_tokens: int, depth: float, key: str) -> str:
    """Filler text of about ``n_tokens`` tokens with the key sentence at ``depth``."""
    per = len(tok.encode(FILLER, add_special_tokens=False))
    reps = max(1, n_tokens // per)
    at = int(reps * depth)
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    return INTRO + FILLER * at + needle + FILLER * (reps - at)


def task_passkey(model, tok, arms: Arms, lengths, depths, n_keys, ratios, arm_names, log, fixed_budgets=(),
                 fixed_arms=(), product_arms=("default",), product_ratios=(4, None), product_max_length=4096,
                 full_only=(), seed=0, earlier_rows=(), on_case=None) -> dict:
    """Per case: one full prefill of the context (and of context + question);
    every arm compresses copies. Modes: ``ctq`` (context compressed, question and
    answer kept), ``whole`` (question compressed too, answer under eviction), and
    the product path through the library (``ctq_product``: ``answer_questions``;
    ``whole_product``: ``generate_with_eviction``), both with 512-token blocks, for
    ``product_arms`` at ``product_ratios`` (None: the fixed budgets) up to
    ``product_max_length`` tokens (each is a prefill of its own). Keys come from
    ``random.Random(seed)``; ``earlier_rows`` (another seed's run) join the table;
    ``on_case(result)`` gets the table so far after every case (a checkpoint)."""
    rng = random.Random(seed)
    rows = list(earlier_rows)
    for length in lengths:
        for depth in depths:
            for _ in range(n_keys):
                key = str(rng.randint(10000, 99999))
                context = passkey_context(tok, length, depth, key)
                prefix_ids, (q_ids,) = split_question_prompts(tok, context, [QUESTION], chat=False)
                n_ctx = len(prefix_ids)
                tic = time.perf_counter()
                full_ctx = prefill(model, prefix_ids, arms.caches("full", 0))
                full_all = copy_caches(full_ctx)
                model(mx.array(q_ids[:-1])[None], cache=full_all)
                mx.eval([c.state for c in full_all])
                prefill_s = time.perf_counter() - tic

                def record(arm, budget, ratio, mode, text, compression):
                    rows.append(dict(length=length, tokens=n_ctx, depth=depth, key=key, ratio=ratio, budget=budget,
                                     arm=arm, mode=mode, ok=key in text, answer=text, compression=compression))

                settings = [(r, n_ctx // r, arm_names) for r in ratios if length not in full_only]
                settings += [(None, b, fixed_arms) for b in fixed_budgets if b < n_ctx and length not in full_only]
                record("full", None, None, "ctq", _answer(model, tok, q_ids, copy_caches(full_ctx)), 1.0)
                record("full", None, None, "whole", _answer(model, tok, q_ids[-1:], copy_caches(full_all)), 1.0)
                for ratio, budget, names in settings:
                    for arm in names:
                        if arm == "full":
                            continue
                        caches = compress_from_full(arms, full_ctx, arm, budget)
                        pin_caches(caches)
                        record(arm, budget, ratio, "ctq", _answer(model, tok, q_ids, caches),
                               cache_stats(caches).compression_ratio)
                        caches = compress_from_full(arms, full_all, arm, budget)
                        text = _answer(model, tok, q_ids[-1:], caches)
                        record(arm, budget, ratio, "whole", text, cache_stats(caches).compression_ratio)
                    if length > product_max_length or ratio not in product_ratios:
                        continue
                    for arm in product_arms:
                        config = arms.config(arm, budget)
                        (r,) = answer_questions(model, tok, context, [QUESTION], eviction=config, max_tokens=8,
                                                chat=False)
                        record(arm, budget, ratio, "ctq_product", r.text, r.compression_ratio)
                        r = generate_with_eviction(model, tok, context + "\n\n" + QUESTION, eviction=config,
                                                   max_tokens=8, chat=False)
                        record(arm, budget, ratio, "whole_product", r.text, r.compression_ratio)
                ok = [r for r in rows if r["key"] == key]
                log(f"passkey len={n_ctx} depth={depth} full prefill {prefill_s:.0f}s: "
                    + " ".join(f"{r['arm']}/{r['ratio'] or r['budget']}/{r['mode']}={int(r['ok'])}" for r in ok)
                    + f" ... ({sum(r['ok'] for r in ok)}/{len(ok)} ok)")
                if on_case:
                    on_case(passkey_table(rows))
    return passkey_table(rows)


def passkey_table(rows: list) -> dict:
    """Rows and their summary per (length, ratio or fixed budget, arm, mode)."""
    groups: dict = {}
    for r in rows:  # a row of the table: length, then a ratio or a fixed budget, arm, mode
        groups.setdefault((r["length"], r["ratio"], None if r["ratio"] else r["budget"], r["arm"], r["mode"]),
                          []).append(r)
    summary = [dict(length=k[0], ratio=k[1], budget=k[2], arm=k[3], mode=k[4], correct=sum(r["ok"] for r in sel),
                    cases=len(sel), compression=float(np.mean([r["compression"] for r in sel])))
               for k, sel in sorted(groups.items(), key=lambda kv: str(kv[0]))]
    return {"question": QUESTION, "rows": rows, "summary": summary}


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


def task_summary(model, tok, arms: Arms, n_docs, max_doc_tokens, budgets, arm_names, max_tokens, log) -> dict:
    docs = pydoc_sections(min_chars=6000)[:n_docs]
    rows = []
    for name, text in docs:
        ids = tok.encode(text, add_special_tokens=False)[:max_doc_tokens]
        prompt = [{"role": "user", "content": "Summarize the following documentation in three sentences.\n\n"
                   + tok.decode(ids)}]
        prompt_ids = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        full = prefill(model, prompt_ids[:-1], arms.caches("full", 0))
        ref = _answer(model, tok, prompt_ids[-1:], copy_caches(full), max_tokens)
        rows.append(dict(doc=name, tokens=len(prompt_ids), arm="full", budget=None, rouge_l=1.0, compression=1.0,
                         summary=ref))
        for budget in budgets:
            for arm in arm_names:
                if arm == "full":
                    continue
                caches = compress_from_full(arms, full, arm, budget)
                out = _answer(model, tok, prompt_ids[-1:], caches, max_tokens)
                score = rouge_l(out, ref)
                rows.append(dict(doc=name, tokens=len(prompt_ids), arm=arm, budget=budget, rouge_l=score,
                                 compression=cache_stats(caches).compression_ratio, summary=out))
                log(f"summary {name:16s} budget={budget} {arm:11s} ROUGE-L {score:.3f}")
    summary = []
    for budget in budgets:
        for arm in arm_names:
            s = [r["rouge_l"] for r in rows if r["arm"] == arm and r["budget"] == budget]
            if s:
                summary.append(dict(budget=budget, arm=arm, docs=len(s), mean=float(np.mean(s)),
                                    median=float(np.median(s)), min=float(np.min(s)), max=float(np.max(s))))
    return {"max_doc_tokens": max_doc_tokens, "max_tokens": max_tokens, "rows": rows, "summary": summary}


# ---------------------------------------------------------------- summary fidelity
# DESIGN.md section 9: teacher-forced NLL of a reference summary given what the arm's cache
# holds after the product path's prefill, as the share of the document's worth it recovers.
FIDELITY_QUESTION = "Summarize the following documentation in three sentences."


def _greedy_ids(model, tok, ids: list[int], caches: list, max_tokens: int, penalty: float = 1.0) -> list[int]:
    eos = set(tok.eos_token_ids)
    processors = make_logits_processors(repetition_penalty=penalty) if penalty != 1.0 else None
    return [r.token for r in stream_generate(model, tok, mx.array(ids), max_tokens=max_tokens, prompt_cache=caches,
                                             logits_processors=processors)
            if r.token not in eos]


def _doc_seed(name: str) -> int:
    return int.from_bytes(name.encode(), "little") % (2**31)  # the same draws for a document in every run


def task_fidelity(model, tok, arms: Arms, docs: list, ratios, arm_names, max_tokens: int, log,
                  earlier: Optional[dict] = None, on_doc=None, step: int = 512, penalty: float = 1.0) -> dict:
    """Per document: the full cache's greedy summary (reference ``self``) and the
    human summary where there is one (``human``); then, per arm and ratio (budget =
    context tokens // ratio), the context prefilled through the arm in ``step``-token
    blocks (the product path), the compressed caches pinned, question + reference as one
    block, NLL over the reference's tokens. ``none``: the question alone (chat template).
    ``penalty``: the reference's repetition penalty (greedy SmolLM2 summaries loop without one);
    the reference is cut at its first repeated 8-gram (:func:`cut_repetition`).
    ``earlier`` (a results file): its documents join the table and are not run again;
    ``on_doc(table)`` after every document (a checkpoint)."""
    rows = list((earlier or {}).get("rows", []))
    documents = list((earlier or {}).get("documents", []))
    done = {d["name"] for d in documents}
    chat = bool(getattr(tok, "has_chat_template", False))  # Gemma 3's GGUF has none: plain text, as the product
    none_prompt = (tok.apply_chat_template([{"role": "user", "content": FIDELITY_QUESTION}],
                                           add_generation_prompt=True, tokenize=True) if chat
                   else (lambda p, q: p + q[0])(*split_question_prompts(tok, "", [FIDELITY_QUESTION], chat=False)))
    for doc in docs:
        if doc.name in done:
            log(f"fidelity {doc.name}: in the earlier run, not run again")
            continue
        prefix, (q_ids,) = split_question_prompts(tok, doc.text, [FIDELITY_QUESTION], chat=chat)
        n_ctx = len(prefix)
        tic = time.perf_counter()
        full = prefill(model, prefix, arms.caches("full", 0), step)
        prefill_s = time.perf_counter() - tic
        tic = time.perf_counter()
        refs = {"self": cut_repetition(_greedy_ids(model, tok, q_ids, copy_caches(full), max_tokens, penalty))}
        generate_s = time.perf_counter() - tic
        if doc.summary:
            refs["human"] = tok.encode(doc.summary, add_special_tokens=False)
        documents.append({**doc.meta(), "context_tokens": n_ctx, "reference": tok.decode(refs["self"]),
                          "full_prefill_s": prefill_s, "generate_s": generate_s})

        def record(arm, ratio, budget, nlls, compression, seconds):
            for ref, nll in nlls.items():
                rows.append(dict(doc=doc.name, tokens=n_ctx, ratio=ratio, budget=budget, arm=arm, reference=ref,
                                 answer_tokens=len(refs[ref]), nll=nll, compression=compression, seconds=seconds))

        tic = time.perf_counter()  # full and none, every table's two ends, always run
        record("full", None, None, {r: answer_nll(model, copy_caches(full), q_ids, a) for r, a in refs.items()},
               1.0, time.perf_counter() - tic)
        tic = time.perf_counter()
        record("none", None, None, {r: answer_nll(model, arms.caches("full", 0), none_prompt, a)
                                    for r, a in refs.items()}, None, time.perf_counter() - tic)
        for ratio in ratios:
            budget = n_ctx // ratio
            for arm in arm_names:
                if arm in ("full", "none"):
                    continue
                mx.random.seed(_doc_seed(doc.name))
                tic = time.perf_counter()
                caches = prefill(model, prefix, arms.caches(arm, budget), step)
                compression = cache_stats(caches).compression_ratio
                nlls = {r: answer_nll(model, pin_caches(copy_caches(caches)), q_ids, a) for r, a in refs.items()}
                record(arm, ratio, budget, nlls, compression, time.perf_counter() - tic)
        own = {(r["arm"], r["ratio"], r["reference"]): r["nll"] for r in rows if r["doc"] == doc.name}
        log(f"fidelity {doc.name} ({n_ctx} tok, prefill {prefill_s:.0f}s, summary {generate_s:.0f}s): "
            f"full {own[('full', None, 'self')]:.3f} none {own[('none', None, 'self')]:.3f} | "
            + " ".join(f"{a}/{r}={v:.3f}" for (a, r, ref), v in own.items() if ref == "self" and r is not None))
        log(f"  reference: {documents[-1]['reference']!r}")
        if on_doc:
            on_doc(fidelity_table(rows, documents))
    return fidelity_table(rows, documents)


def fidelity_table(rows: list, documents: list) -> dict:
    """Rows with their recovered share, and the summary per (ratio, reference, arm):
    mean and median recovered share, paired wins against ``random_same``, NLLs, bytes."""
    ends = {(r["doc"], r["reference"], r["arm"]): r["nll"] for r in rows if r["arm"] in ("full", "none")}
    for r in rows:
        full, none = ends.get((r["doc"], r["reference"], "full")), ends.get((r["doc"], r["reference"], "none"))
        gap = None if full is None or none is None else none - full
        r["recovered"] = (none - r["nll"]) / gap if gap and gap > 0 else None  # None: the document did not help
    nll = {(r["doc"], r["ratio"], r["reference"], r["arm"]): r["nll"] for r in rows}
    summary = []
    keys = sorted({(r["ratio"], r["reference"], r["arm"]) for r in rows if r["ratio"] is not None},
                  key=lambda k: (k[0], k[1], FIDELITY_ARMS.index(k[2]) if k[2] in FIDELITY_ARMS else 99, k[2]))
    for ratio, ref, arm in keys:
        sel = [r for r in rows if (r["ratio"], r["reference"], r["arm"]) == (ratio, ref, arm)]
        rec = [r["recovered"] for r in sel if r["recovered"] is not None]
        pairs = [(r["nll"], nll[(r["doc"], ratio, ref, "random_same")]) for r in sel
                 if (r["doc"], ratio, ref, "random_same") in nll and arm != "random_same"]
        twin = RANDOM_PAIR.get(arm)
        equal = [(r["nll"], nll[(r["doc"], ratio, ref, twin)]) for r in sel if (r["doc"], ratio, ref, twin) in nll]
        docs = [r["doc"] for r in sel]
        summary.append(dict(
            ratio=ratio, reference=ref, arm=arm, docs=len(sel), helped_docs=len(rec),
            recovered_mean=float(np.mean(rec)) if rec else None, recovered_median=float(np.median(rec)) if rec else None,
            wins_vs_random_same=sum(a < b for a, b in pairs) if pairs else None, pairs=len(pairs),
            random_twin=twin if equal else None, wins_vs_random_twin=sum(a < b for a, b in equal) if equal else None,
            twin_pairs=len(equal),
            nll=float(np.mean([r["nll"] for r in sel])),
            full_nll=float(np.mean([ends[(d, ref, "full")] for d in docs if (d, ref, "full") in ends])),
            none_nll=float(np.mean([ends[(d, ref, "none")] for d in docs if (d, ref, "none") in ends])),
            compression=float(np.mean([r["compression"] for r in sel])),
            seconds=float(np.mean([r["seconds"] for r in sel]))))
    return {"question": FIDELITY_QUESTION, "documents": documents, "rows": rows, "summary": summary}


# ---------------------------------------------------------------- grids per model
# Issue 13's question (a bounded default) is asked at a fixed budget of 512, where the
# candidates differ from the 0.1 default (skip30) only past 8x the budget.
CANDIDATES = ("keydiff_all", "skip30", "bounded_x8", "bounded_x4")
CORE = ("skip30", "bounded_x8", "paper", "probe", "streaming", "rotating")
PLANS = {
    # SmolLM2: trained context 8k; the full cache found 4/4 keys at 2k and 4k, 2/3 at 8k (calibration, README)
    "default": dict(passkey=[1024, 2048, 4096, 8192],
                    ppl=[(1024, 256, None), (4096, 1024, CORE), (4096, 512, CORE + ("bounded_x4",)),
                         (8192, 1024, CORE), (8192, 512, CANDIDATES)],
                    summary=True),
    # Gemma 3 270M: 32k context; the full cache found 3/3 keys at 4k, 2/3 at 8k (calibration, README)
    "gemma-3-270m": dict(passkey=[2048, 4096, 8192, 16384],
                         ppl=[(4096, 1024, CORE), (4096, 512, CORE), (8192, 1024, CORE), (8192, 512, CANDIDATES)],
                         summary=False),
}
QUICK = dict(passkey=[1024], ppl=[(512, 128, None)], summary=True)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="all", help="ppl, passkey, summary, a comma-separated list, or all")
    ap.add_argument("--model", default="default")
    ap.add_argument("--quick", action="store_true", help="a small grid that finishes in a few minutes")
    ap.add_argument("--arms", default="", help="arms, comma-separated (default: each task's own list; "
                    f"ppl/passkey/summary {','.join(DEFAULT_RUN)}; fidelity {','.join(FIDELITY_ARMS)})")
    ap.add_argument("--cases", type=int, default=2, help="keys per depth (5 depths): 2 gives 10 cases per row")
    ap.add_argument("--full-only", default="", help="passkey lengths run with the full cache only")
    ap.add_argument("--lengths", default="", help="passkey lengths, in the order run (default: the model's plan)")
    ap.add_argument("--ratios", default="4,8", help="passkey compression ratios (context tokens per kept token)")
    ap.add_argument("--product", default="4,fixed",
                    help="settings the product path runs at: ratios and/or 'fixed' (the fixed budget 512)")
    ap.add_argument("--ppl-grid", default="",
                    help="LENGTH/BUDGET[/ARM+ARM...] items, comma-separated (default: the model's plan)")
    ap.add_argument("--docs", type=int, default=3, help="perplexity documents per length")
    ap.add_argument("--summary-docs", type=int, default=8, help="documents summarized")
    ap.add_argument("--fidelity-docs", type=int, default=20, help="fidelity: documents (benchmarks/documents.py order)")
    ap.add_argument("--pilot", action="store_true",
                    help="fidelity: mark the file as a pilot (a few documents to check the set-up; not the results)")
    ap.add_argument("--fidelity-tokens", type=int, default=112, help="fidelity: tokens of the reference summary at most")
    ap.add_argument("--fidelity-order", choices=("fixed", "shortest"), default="fixed",
                    help="fidelity: documents.py's order, or the shortest first (a grid that fits the time)")
    ap.add_argument("--reference-penalty", type=float, default=1.2,
                    help="fidelity: repetition penalty of the full cache's reference summary (1 = plain greedy; "
                         "greedy SmolLM2 summaries loop)")
    ap.add_argument("--product-arms", default="keydiff_all",
                    help="passkey: the arms also run through the library's own calls (512-token blocks)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the pass keys (another seed: more cases)")
    ap.add_argument("--add-to", default="",
                    help="an earlier results file whose rows join this run's table: passkey (another seed's cases) "
                         "or fidelity (its documents are not run again: also a resume after a kill)")
    ap.add_argument("--out-dir", default=str(RESULTS))
    args = ap.parse_args(argv)
    arm_names = tuple(a for a in args.arms.split(",") if a) or (QUICK_RUN if args.quick else DEFAULT_RUN)
    unknown = set(arm_names) - set(ARMS) - set(FIDELITY_ARMS)
    if unknown:
        ap.error(f"unknown arms {sorted(unknown)}; allowed: {', '.join(dict.fromkeys(ARMS + FIDELITY_ARMS))}")
    fidelity_arms = tuple(a for a in args.arms.split(",") if a) or (QUICK_FIDELITY_ARMS if args.quick else FIDELITY_ARMS)
    arm_names = tuple(a for a in arm_names if a != "none")  # the other tasks have no no-document arm
    model, tok = load_model(None if args.model == "default" else args.model)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    probe = probe_model(model, tok, n_tokens=512 if args.quick else 1024)
    arms = Arms(model, probe.suggested_skip_layers)
    plan = dict(QUICK if args.quick else PLANS.get(args.model, PLANS["default"]))
    if args.lengths:
        plan["passkey"] = [int(x) for x in args.lengths.split(",")]
    if args.ppl_grid:
        plan["ppl"] = [(int(item.split("/")[0]), int(item.split("/")[1]),
                        tuple(item.split("/")[2].split("+")) if item.count("/") == 2 else None)
                       for item in args.ppl_grid.split(",")]
    ratios = [int(x) for x in args.ratios.split(",") if x]
    product = tuple(None if x == "fixed" else int(x) for x in args.product.split(",") if x)
    meta = {"model": args.model, "quick": args.quick, "arms": list(arm_names), "runtime": knorm_gen.runtime_info(),
            "defaults": EvictionConfig().for_model(model).to_dict(),
            "full_attention_layers": arms.full_layers, "probe_skip_layers": list(arms.probe_skip)}
    results = {}
    tasks = ["ppl", "passkey", "summary", "fidelity"] if args.task == "all" else args.task.split(",")
    if set(tasks) - {"ppl", "passkey", "summary", "fidelity"}:
        ap.error(f"unknown task in {args.task!r}")
    slug = "" if args.model == "default" else "_" + re.sub(r"[^A-Za-z0-9]+", "-", args.model).strip("-")
    earlier_file = json.loads(Path(args.add_to).read_text()) if args.add_to else None
    if earlier_file is not None and earlier_file.get("task", "passkey") not in tasks:
        ap.error(f"{args.add_to} holds task {earlier_file.get('task')!r}, not run here")
    add_to = lambda task: earlier_file if earlier_file and earlier_file.get("task", "passkey") == task else None  # noqa: E731

    def save_partial(task, partial, start):  # a checkpoint: a kill never leaves half a file
        partial.update(meta, task=task, seconds=time.perf_counter() - start)
        if task == "fidelity":
            partial.update(arms=list(fidelity_arms), pilot=args.pilot, reference_penalty=args.reference_penalty)
        tmp = out_dir / f".quality_{task}{slug}.json.tmp"
        tmp.write_text(json.dumps(partial, indent=1))
        tmp.replace(out_dir / f"quality_{task}{slug}.json")
    for task in tasks:
        if task == "summary" and not plan["summary"]:
            continue
        tic = time.perf_counter()
        if task == "ppl":
            res = task_ppl(model, tok, arms, plan["ppl"], arm_names, 1 if args.quick else args.docs, log)
        elif task == "passkey":
            full_only = [int(x) for x in args.full_only.split(",") if x]
            earlier = add_to("passkey") or {"rows": []}
            earlier.setdefault("seeds", [0])  # files from before --seed hold seed 0
            earlier_s = earlier.get("seconds", 0.0) if add_to("passkey") else 0.0
            if args.seed in earlier["seeds"] and add_to("passkey"):
                ap.error(f"{args.add_to} already holds the cases of seed {args.seed}")
            seeds = [*earlier["seeds"], args.seed] if add_to("passkey") else [args.seed]

            def checkpoint(partial, tic=tic, seeds=seeds):
                partial.update(meta, task="passkey", seconds=earlier_s + time.perf_counter() - tic, seeds=seeds)
                tmp = out_dir / f".quality_passkey{slug}.json.tmp"
                tmp.write_text(json.dumps(partial, indent=1))
                tmp.replace(out_dir / f"quality_passkey{slug}.json")  # a kill never leaves half a file

            res = task_passkey(model, tok, arms, plan["passkey"], [0.5] if args.quick else [0.1, 0.3, 0.5, 0.7, 0.9],
                               1 if args.quick else args.cases, ratios, arm_names, log,
                               fixed_budgets=() if args.quick else (512,),
                               fixed_arms=tuple(a for a in CANDIDATES + ("paper",) if a in arm_names),
                               product_arms=tuple(a for a in args.product_arms.split(",") if a),
                               product_ratios=product, full_only=full_only,
                               seed=args.seed, earlier_rows=earlier["rows"], on_case=checkpoint)
            res["seeds"] = seeds
            tic -= earlier_s  # seconds: every joined run together
        elif task == "fidelity":
            earlier = add_to("fidelity")
            earlier_s = earlier.get("seconds", 0.0) if earlier else 0.0
            limit = 2 if args.quick else args.fidelity_docs
            docs = documents(tok, limit=None if args.fidelity_order == "shortest" else limit)
            if args.fidelity_order == "shortest":
                docs = sorted(docs, key=lambda d: d.tokens)[:limit]
            if args.quick:  # two short documents: the first 384 tokens of each
                docs = [replace(d, text=tok.decode(tok.encode(d.text, add_special_tokens=False)[:384]), tokens=384)
                        for d in docs]
            elif len(docs) < args.fidelity_docs:
                log(f"fidelity: {len(docs)} documents of 2k-8k tokens here (not installed: {missing_documents()}; "
                    'pip install -e ".[bench]")')
            res = task_fidelity(model, tok, arms, docs, ratios[:1] if args.quick else ratios, fidelity_arms,
                                24 if args.quick else args.fidelity_tokens, log, earlier=earlier,
                                on_doc=lambda t, start=tic - earlier_s: save_partial("fidelity", t, start),
                                penalty=args.reference_penalty)
            tic -= earlier_s  # seconds: every joined run together
        else:
            res = task_summary(model, tok, arms, 1 if args.quick else args.summary_docs, 512 if args.quick else 1024,
                               [128] if args.quick else [256], arm_names, 16 if args.quick else 48, log)
        res.update(meta, task=task, seconds=time.perf_counter() - tic)
        if task == "fidelity":
            res.update(arms=list(fidelity_arms), pilot=args.pilot, reference_penalty=args.reference_penalty)
        path = out_dir / f"quality_{task}{slug}.json"
        path.write_text(json.dumps(res, indent=1))
        log(f"wrote {path} ({res['seconds']:.0f} s)")
        results[task] = res
    return results


if __name__ == "__main__":
    main()
