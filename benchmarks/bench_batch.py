"""Batched generation, one run: ours at batch 1/4/8/16 against mlx_lm's own
``batch_generate`` with full caches at the same batch sizes.

    python benchmarks/bench_batch.py            # both workloads (about 1.5 h on 2 CPU cores; --sizes/--long-sizes trim it)
    python benchmarks/bench_batch.py --quick    # smoke run (batch 1 and 2, two short rows per workload)

Workloads: decode-heavy (short chat prompts, 256 new tokens) and the long-document
summarization job (jobs/longdocs-summarize.toml's documents and settings, 128 new
tokens). Arms run one after another in this process, each timed from its first
prompt to its last result; ``ours_b1`` is what ``knorm-batch --batch-size 1`` runs
(one row at a time on mlx_lm's stream_generate).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
import sys
import time
from pathlib import Path

import knorm_gen  # noqa: F401  (BLAS preload first)
import mlx.core as mx
from mlx_lm.generate import batch_generate

from knorm_gen import EvictionConfig, GenerationConfig, generate_batch_with_eviction, generate_with_eviction
from knorm_gen.cli.job_file import build_configs, load_job
from knorm_gen.generation.prompts import encode_prompt
from knorm_gen.models.load import load_model

HERE = Path(__file__).parent
ROOT = HERE.parent
DECODE_PROMPTS = [
    "Write a short story about a lighthouse keeper.", "Explain how a bicycle works.",
    "Describe a day at the beach.", "Write a letter to a friend about a trip to the mountains.",
    "Explain why the sky is blue.", "Tell me about the history of bread.",
    "Describe how to plant a tree.", "Write a poem about autumn leaves.",
    "Explain what a computer does.", "Describe a busy market in the morning.",
    "Write instructions for making tea.", "Tell a story about a lost cat.",
    "Explain how rain forms.", "Describe a train journey through the countryside.",
    "Write about a childhood memory.", "Explain how bees make honey.",
]


def kv_row_bytes(model) -> int:
    """Key + value bytes of one position in one layer (float32 cache)."""
    attn = model.layers[0].self_attn
    heads = getattr(attn, "n_kv_heads", None) or getattr(attn, "num_key_value_heads")
    head_dim = getattr(attn, "head_dim", None) or model.args.hidden_size // model.args.num_attention_heads
    return heads * head_dim * 2 * 4


def run_ours(model, tok, prompts, eviction, generation, batch_size):
    if batch_size == 1:
        return [generate_with_eviction(model, tok, p, eviction=eviction, generation=generation) for p in prompts]
    return generate_batch_with_eviction(model, tok, prompts, batch_size=batch_size, eviction=eviction,
                                        generation=generation)


def timed(fn):
    """(result, wall seconds, peak GB) of one arm."""
    mx.reset_peak_memory()
    tic = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - tic, mx.get_peak_memory() / 1e9


def numbers(name, wall, peak, generated, kv_bytes, full_bytes) -> dict:
    """One arm's row: throughput and the KV bytes each row held at its end."""
    rows = len(generated)
    return {"arm": name, "rows": rows, "wall_s": wall, "peak_memory_gb": peak, "generated_tokens": sum(generated),
            "tokens_per_s": sum(generated) / wall, "rows_per_hour": 3600 * rows / wall,
            "kv_bytes_mean": sum(kv_bytes) / rows, "kv_bytes_max": max(kv_bytes), "kv_full_bytes_max": max(full_bytes)}


def workload(model, tok, name, prompts, eviction, generation, sizes, log):
    ids = [encode_prompt(tok, p, generation.chat) for p in prompts]
    per_position = kv_row_bytes(model) * len(model.layers)  # a full cache, every layer
    arms = []
    for size in sizes:
        results, wall, peak = timed(lambda: run_ours(model, tok, prompts, eviction, generation, size))
        arms.append(numbers(f"ours_b{size}", wall, peak, [r.generated_tokens for r in results],
                            [r.kept_bytes for r in results], [r.full_bytes for r in results]))
        if size > 1:
            response, wall, peak = timed(lambda: batch_generate(
                model, tok, ids, max_tokens=generation.max_tokens, completion_batch_size=size,
                prefill_batch_size=size, prefill_step_size=generation.prefill_step_size, return_token_ids=True))
            generated = [len(t) for t in response.token_ids]
            full = [per_position * (len(i) + g) for i, g in zip(ids, generated)]
            arms.append(numbers(f"mlx_b{size}", wall, peak, generated, full, full))
        for row in arms[-2 if size > 1 else -1:]:
            log(f"{name} {row['arm']:10s} {row['wall_s']:7.1f} s {row['tokens_per_s']:7.2f} tok/s "
                f"{row['rows_per_hour']:8.1f} rows/h  peak {row['peak_memory_gb']:.3f} GB  "
                f"KV/row max {row['kv_bytes_max'] / 2**20:.1f} MiB")
    by = {a["arm"]: a for a in arms}
    ratios = {}
    for size in sizes[1:]:
        ratios[f"ours_b{size}_vs_ours_b1_tokens_per_s"] = (by[f"ours_b{size}"]["tokens_per_s"]
                                                          / by["ours_b1"]["tokens_per_s"])
        ratios[f"ours_b{size}_vs_mlx_b{size}_rows_per_hour"] = (by[f"ours_b{size}"]["rows_per_hour"]
                                                               / by[f"mlx_b{size}"]["rows_per_hour"])
    return {"workload": name, "prompt_tokens": [len(i) for i in ids], "max_tokens": generation.max_tokens,
            "eviction": eviction.for_model(model).to_dict(), "arms": arms, "ratios": ratios}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model", default="default")
    ap.add_argument("--out", default=str(HERE / "results" / "batch.json"))
    ap.add_argument("--sizes", default="1,4,8,16", help="batch sizes of the decode-heavy workload")
    ap.add_argument("--long-sizes", default="1,4,8", help="batch sizes of the long-document workload")
    args = ap.parse_args(argv)
    model, tok = load_model(None if args.model == "default" else args.model)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    sizes = (1, 2) if args.quick else tuple(int(x) for x in args.sizes.split(","))
    long_sizes = (1, 2) if args.quick else tuple(int(x) for x in args.long_sizes.split(","))
    if sizes[0] != 1 or long_sizes[0] != 1:
        ap.error("batch sizes start with 1 (the baseline every ratio divides by)")
    generate_with_eviction(model, tok, "Warm up.", max_tokens=4)  # first-call costs stay out of the arms
    tic = time.perf_counter()
    decode_gen = GenerationConfig(max_tokens=8 if args.quick else 256)
    decode = workload(model, tok, "decode_heavy", DECODE_PROMPTS[: 2 if args.quick else 16], EvictionConfig(),
                      decode_gen, sizes, log)
    job = load_job(str(ROOT / "jobs" / "longdocs-summarize.toml"))
    eviction, generation = build_configs(job)
    generation = replace(generation, repetition_penalty=1.0)  # mlx_lm's arms have none: the same sampling in every arm
    rows = [json.loads(line) for line in Path(job["input"]).read_text().splitlines() if line.strip()]
    # The instruction first, then the document (cost.py's whole job measures the job's own shape: documents
    # with one question each, through knorm-batch's runner).
    prompts = ["Summarize the following documentation in three sentences.\n\n" + r["text"] for r in rows]
    if args.quick:
        prompts = [p[:800] for p in prompts[:2]]
        generation = GenerationConfig(max_tokens=8)
    # 10 documents: a batch of 16 would hold them all, like 8 nearly does; 16 is left to the short rows
    longdocs = workload(model, tok, "longdocs", prompts, eviction, generation, long_sizes, log)
    res = {"benchmark": "batch", "model": args.model, "quick": args.quick, "runtime": knorm_gen.runtime_info(),
           "workloads": [decode, longdocs], "seconds": time.perf_counter() - tic}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    for w in res["workloads"]:
        for k, v in w["ratios"].items():
            log(f"{w['workload']}: {k} = {v:.2f}")
    log(f"wrote {args.out} ({res['seconds']:.0f} s)")
    return res


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
