"""The whole summarization job, side by side in one run: rows/hour, memory, phases, fidelity.

    python benchmarks/bench_summarize.py                    # 16 documents of 2-8k tokens (see README)
    python benchmarks/bench_summarize.py --quick            # smoke run: 2 short documents

Arms (one instruction for every document, greedy, the same max_tokens):
  ours_b8    knorm-batch's own path (run_batch): plain documents with one job question,
             --batch-size 8, the default eviction settings; each document's context is
             compressed once and its question never evicted
  ours_b1    the same at --batch-size 1
  ours_b8_q4 ours_b8 with --kv-bits 4 (the kept keys and values stored 4-bit, groups of 64)
  mlx_b8     what an mlx_lm user runs today: batch_generate with full caches, the
             instruction first and the document after it, batch 8
  mlx_kv     batch_generate with max_kv_size=budget (mlx_lm's RotatingKVCache), same prompts

Per arm: wall time, rows/hour, peak MLX memory, KV bytes per row (from the caches for ours;
counted from the positions for mlx_lm's), the prefill and decode shares of the time, and
fidelity: the teacher-forced NLL of the full cache's own summary (document, then question)
under each arm's cache after the arm's own prompt (context prefilled in 512-token blocks,
as each arm runs it), reported as the recovered share
(nll_none - nll_arm) / (nll_none - nll_full), where "none" is the question alone.
The JSON is rewritten after every arm (``--add-to`` keeps earlier arms and runs the rest).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import knorm_gen  # noqa: F401  (BLAS preload first)
import mlx.core as mx
from mlx_lm.generate import batch_generate
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

from knorm_gen import EvictionConfig, GenerationConfig, cache_stats, make_eviction_cache, probe_caches
from knorm_gen.cache import copy_caches, pin_caches
from knorm_gen.engine import prefill
from knorm_gen.config import RowsConfig
from knorm_gen.job import BatchOptions, run_batch
from knorm_gen.mlx_compat import full_attention_layers
from knorm_gen.models import load_model
from knorm_gen.prompts import context_spans, encode_prompt, split_question_prompts

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from documents import documents  # noqa: E402

QUESTION = "Summarize the documentation above in three sentences."
INSTRUCTION_FIRST = "Summarize the following documentation in three sentences.\n\n"
ARMS = ("ours_b8", "ours_b1", "mlx_b8", "mlx_kv", "ours_b8_q4")
KV_GROUP = 64


def _write(path: Path, result: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, path)


def _bytes_per_position(model) -> int:
    caches = make_prompt_cache(model)
    model(mx.array([[0]]), cache=caches)
    mx.eval([c.state for c in caches])
    return sum((c.keys.nbytes + c.values.nbytes) // c.keys.shape[2] for c in caches)


def run_ours(model, tok, docs, batch_size: int, budget: int, max_tokens: int, kv_bits=None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        inp = Path(tmp) / "docs.jsonl"
        inp.write_text("".join(json.dumps({"id": d.name, "text": d.text}) + "\n" for d in docs))
        out = Path(tmp) / "out.jsonl"
        eviction = EvictionConfig(budget=budget, kv_bits=kv_bits, kv_group_size=KV_GROUP)
        options = BatchOptions(eviction=eviction, generation=GenerationConfig(max_tokens=max_tokens),
                               batch_size=batch_size, rows=RowsConfig(questions=(QUESTION,), context_field="text"))
        mx.reset_peak_memory()
        tic = time.perf_counter()
        summary = run_batch(str(inp), str(out), options, model=model, tokenizer=tok, progress=False)
        wall = time.perf_counter() - tic
        peak = mx.get_peak_memory() / 1e9
        records = [json.loads(line) for line in out.read_text().splitlines()]
    assert summary.failed == 0, summary.errors
    prefill = sum(r["prefill_s"] for r in records)
    decode = sum(r["decode_s"] for r in records)
    return {"wall_s": wall, "peak_memory_gb": peak, "generated_tokens": sum(r["generated_tokens"] for r in records),
            "kv_bytes_max": max(r["kept_bytes"] for r in records),
            "kv_bytes_mean": sum(r["kept_bytes"] for r in records) / len(records),
            "prefill_s": prefill, "decode_s": decode,
            "prefill_share": prefill / (prefill + decode), "decode_share": decode / (prefill + decode),
            "texts": {r["id"]: r["answers"][0]["answer"] for r in records}}


def run_mlx(model, tok, docs, batch_size: int, max_tokens: int, max_kv_size=None) -> dict:
    prompts = [encode_prompt(tok, INSTRUCTION_FIRST + d.text) for d in docs]
    # mlx_lm 0.32.2's make_prompt_cache ignores max_kv_size for models with their own make_cache
    # (llama has one), so max_kv_size does nothing there: give each prompt the caches it stands for,
    # RotatingKVCache(max_kv_size, keep=4) in every full-attention layer.
    caches = None if max_kv_size is None else [_rotating(model, max_kv_size) for _ in prompts]
    mx.reset_peak_memory()
    tic = time.perf_counter()
    response = batch_generate(model, tok, prompts, prompt_caches=caches, max_tokens=max_tokens,
                              completion_batch_size=batch_size, prefill_batch_size=batch_size,
                              prefill_step_size=512, return_token_ids=True)
    wall = time.perf_counter() - tic
    peak = mx.get_peak_memory() / 1e9
    per_position = _bytes_per_position(model)
    held = [len(p) + len(t) if max_kv_size is None else min(len(p) + len(t), max_kv_size)
            for p, t in zip(prompts, response.token_ids)]
    stats = response.stats
    prefill, decode = stats.prompt_time, stats.decode_time
    return {"wall_s": wall, "peak_memory_gb": peak, "generated_tokens": sum(len(t) for t in response.token_ids),
            "kv_bytes_max": per_position * max(held), "kv_bytes_mean": per_position * sum(held) / len(held),
            "prefill_s": prefill, "decode_s": decode,
            "prefill_share": prefill / (prefill + decode), "decode_share": decode / (prefill + decode),
            "texts": {d.name: text for d, text in zip(docs, response.texts)}}


def _rotating(model, size: int) -> list:
    full = set(full_attention_layers(model))
    return [RotatingKVCache(max_size=size, keep=4) if i in full else c for i, c in enumerate(make_prompt_cache(model))]


# ---- fidelity -------------------------------------------------------------------------------



def _nll(model, caches, feed: list[int], n_answer: int) -> float:
    """Mean NLL of the last ``n_answer`` tokens of ``feed`` (fed as one block after ``caches``)."""
    logits = model(mx.array(feed)[None], cache=caches)[0].astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    targets = mx.array(feed[len(feed) - n_answer :])
    picked = mx.take_along_axis(logp[len(feed) - n_answer - 1 : -1], targets[:, None], axis=-1)
    return float(-picked.mean().item())


def fidelity(model, tok, doc, budget: int, max_tokens: int) -> dict:
    """NLL of the full cache's own greedy summary under every arm's cache."""
    from mlx_lm.generate import stream_generate

    context, (question,) = split_question_prompts(tok, doc.text, [QUESTION], chat=True)
    full = prefill(model, context, make_prompt_cache(model))
    reference = [int(r.token) for r in stream_generate(model, tok, mx.array(question), max_tokens=max_tokens,
                                                       prompt_cache=copy_caches(full))]
    ref = reference
    out = {"name": doc.name, "context_tokens": len(context), "reference_tokens": len(ref),
           "reference": tok.decode(ref)}
    out["full"] = _nll(model, full, question + ref, len(ref))
    spans = context_spans(tok, doc.text, context, chat=True)  # the template before the document pinned, as the product
    # the default (keep="question") probes the question first, as the product does (probe_caches)
    fresh = make_eviction_cache(model, EvictionConfig(budget=budget), spans)
    ours = pin_caches(prefill(model, context, probe_caches(fresh, model, tok, context, spans, [question])))
    out["ours_compression"] = cache_stats(ours).compression_ratio
    out["ours"] = _nll(model, ours, question + ref, len(ref))
    q4 = EvictionConfig(budget=budget, kv_bits=4, kv_group_size=KV_GROUP)
    ours_q4 = pin_caches(prefill(model, context, probe_caches(make_eviction_cache(model, q4, spans), model, tok, context,
                                                              spans, [question])))
    out["ours_q4_compression"] = cache_stats(ours_q4).compression_ratio
    out["ours_q4"] = _nll(model, ours_q4, question + ref, len(ref))
    first = encode_prompt(tok, INSTRUCTION_FIRST + doc.text)  # mlx arms: instruction first, then the document
    out["mlx_full"] = _nll(model, prefill(model, first[:-1], make_prompt_cache(model)), first[-1:] + ref, len(ref))
    out["mlx_kv"] = _nll(model, prefill(model, first[:-1], _rotating(model, budget)), first[-1:] + ref, len(ref))
    none = encode_prompt(tok, QUESTION)
    out["none"] = _nll(model, make_prompt_cache(model), none + ref, len(ref))
    return out


def recovered(rows: list, arm: str) -> float:
    vals = [(r["none"] - r[arm]) / (r["none"] - r["full"]) for r in rows if r["none"] != r["full"]]
    return sum(vals) / len(vals) if vals else float("nan")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model", default="default")
    ap.add_argument("--docs", type=int, default=16, help="documents (the shortest of benchmarks/documents.py)")
    ap.add_argument("--fidelity-docs", type=int, default=None, help="documents scored for fidelity (default: all)")
    ap.add_argument("--budget", type=int, default=EvictionConfig.budget)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--out", default=str(HERE / "results" / "summarize.json"))
    ap.add_argument("--add-to", default=None, help="an earlier run's JSON: keep its arms, run the others")
    args = ap.parse_args(argv)
    model, tok = load_model(None if args.model == "default" else args.model)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    docs = sorted(documents(tok, 2000, 8000), key=lambda d: (d.tokens, d.name))[: args.docs]
    budget, max_tokens = args.budget, args.max_tokens
    if args.quick:
        docs = [type(d)(**{**d.__dict__, "text": d.text[:1200]}) for d in docs[:2]]
        budget, max_tokens = 64, 8
    out = Path(args.out)
    result = json.loads(Path(args.add_to).read_text()) if args.add_to else {}
    result.update({"benchmark": "summarize", "model": args.model, "quick": args.quick,
                   "runtime": knorm_gen.runtime_info(), "question": QUESTION, "budget": budget,
                   "max_tokens": max_tokens, "documents": [d.meta() for d in docs]})
    result.setdefault("arms", {})
    for arm in args.arms.split(","):
        if arm in result["arms"]:
            continue
        if arm.startswith("ours"):
            size, _, bits = arm[len("ours_b"):].partition("_q")
            row = run_ours(model, tok, docs, int(size), budget, max_tokens, int(bits) if bits else None)
        elif arm == "mlx_b8":
            row = run_mlx(model, tok, docs, 8, max_tokens)
        elif arm == "mlx_kv":
            row = run_mlx(model, tok, docs, 8, max_tokens, max_kv_size=budget)
        else:
            ap.error(f"unknown arm {arm!r}; arms: {', '.join(ARMS)}")
        row["rows_per_hour"] = 3600 * len(docs) / row["wall_s"]
        result["arms"][arm] = row
        log(f"{arm:8s} {row['wall_s']:7.1f} s {row['rows_per_hour']:7.1f} rows/h peak {row['peak_memory_gb']:.3f} GB "
            f"KV/row max {row['kv_bytes_max'] / 2**20:.1f} MiB prefill {100 * row['prefill_share']:.0f}%")
        _write(out, result)
    rows = result.setdefault("fidelity", [])
    done = {r["name"] for r in rows}
    for doc in docs[: args.fidelity_docs or len(docs)]:
        if doc.name in done:
            continue
        rows.append(fidelity(model, tok, doc, budget, max_tokens))
        log(f"fidelity {doc.name}: " + " ".join(f"{k} {rows[-1][k]:.3f}" for k in
                                                ("full", "ours", "ours_q4", "mlx_full", "mlx_kv", "none")))
        _write(out, result)
    arms = result["arms"]
    ratios = {}
    if "ours_b8" in arms and "ours_b1" in arms:
        ratios["ours_b8_vs_ours_b1_rows_per_hour"] = arms["ours_b8"]["rows_per_hour"] / arms["ours_b1"]["rows_per_hour"]
    if "ours_b8" in arms and "mlx_b8" in arms:
        ratios["ours_b8_vs_mlx_b8_rows_per_hour"] = arms["ours_b8"]["rows_per_hour"] / arms["mlx_b8"]["rows_per_hour"]
        ratios["ours_b8_vs_mlx_b8_peak_memory"] = arms["ours_b8"]["peak_memory_gb"] / arms["mlx_b8"]["peak_memory_gb"]
    if "ours_b8" in arms and "mlx_kv" in arms:
        ratios["ours_b8_vs_mlx_kv_rows_per_hour"] = arms["ours_b8"]["rows_per_hour"] / arms["mlx_kv"]["rows_per_hour"]
    for arm in ("ours_b8_q4",):
        if arm in arms:
            for other in ("ours_b8", "mlx_b8", "mlx_kv"):
                if other in arms:
                    ratios[f"{arm}_vs_{other}_rows_per_hour"] = arms[arm]["rows_per_hour"] / arms[other]["rows_per_hour"]
                    ratios[f"{arm}_vs_{other}_peak_memory"] = arms[arm]["peak_memory_gb"] / arms[other]["peak_memory_gb"]
            if "ours_b8" in arms and "prefill_s" in arms["ours_b8"]:
                for phase in ("prefill_s", "decode_s"):
                    ratios[f"{arm}_vs_ours_b8_{phase}"] = arms[arm][phase] / arms["ours_b8"][phase]
                ratios[f"{arm}_vs_ours_b8_kv_bytes"] = arms[arm]["kv_bytes_max"] / arms["ours_b8"]["kv_bytes_max"]
    result["ratios"] = ratios
    result["recovered"] = {arm: recovered([r for r in rows if arm in r], arm)
                           for arm in ("ours", "ours_q4", "mlx_full", "mlx_kv")} if rows else {}
    _write(out, result)
    log(json.dumps({"ratios": ratios, "recovered": result["recovered"]}, indent=1))
    return result


if __name__ == "__main__":
    main()
