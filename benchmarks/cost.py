"""What the default costs, in one run on one machine (issue 53, items 4 and 5).

    python benchmarks/cost.py                   # the whole measurement (80-90 minutes on 2 idle CPU cores)
    python benchmarks/cost.py --skip-job        # without the whole job (about 35 minutes)
    python benchmarks/cost.py --skip-prefill --skip-together --out benchmarks/results/cost-job.json
                                                # the whole job alone (about 70 minutes)
    python benchmarks/cost.py --quick           # smoke run (2 minutes; seconds with a tiny model: --model PATH)

It prints its own estimate at the start (a cost model scaled by a prefill timed on this machine).

Three sections, each a markdown table on stdout, every number in the JSON (``--out``):

1. **Prefill and decode per arm**: the full cache, the default layout, the L2Norm preset
   (``paper``), keep-low in every layer (``low``) and random eviction, on one row of about
   1k, 2k and 8k tokens (the "8k" row is 7,600 tokens of text, so that it, the template and
   the question fit the embedded model's 8,192-token context). Every eviction arm keeps a
   quarter of the document (``ratio=4``, the budget that follows the document), so all hold
   equal bytes but ``paper``, whose layers 0 and 1 keep every token. Each row runs as the
   product runs a question row: probe (timed alone), prefill in 512-token blocks, then the
   question and a greedy answer of a fixed length, decoded one token at a time.
2. **Prefill together or alone** (item 5): 8 prompt rows (a document, then "Summarize the
   text above.") through :class:`knorm_gen.generation.engine.BatchEngine` with
   ``prefill_together=False`` (each probed row prefilled alone, then decoded in the batch)
   and ``True`` (mlx_lm's batch prefill of right-padded chunks), at 2k and 8k tokens:
   the wall time of the whole engine run, and whether each row got the same tokens.
3. **The whole job**: 16 documents of 4-8k tokens (each document of 4,000+ tokens alone, cut
   at 7,600; with the bench extra installed that is 15, and the 16th is two shorter ones
   joined), batch 8, one question each, 64 new tokens: ``knorm-batch``'s runner (``knorm_gen.batch.job.run_batch``, the default layout at
   ratio 4) against mlx_lm's ``batch_generate`` with a full cache and with a
   ``RotatingKVCache`` per layer holding the default's mean bytes per row, on the same token
   ids: rows/hour and peak memory.

Then the issue's aims, as ratios measured in this run. Peak memory is
``mx.get_peak_memory()`` from a reset before each arm: it includes the model's weights
(``weights_gb``, the active memory after loading).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

import knorm_gen  # noqa: F401  (BLAS preload before mlx)
import mlx.core as mx
from mlx_lm.generate import batch_generate, generate_step
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from knorm_gen import EvictionConfig, GenerationConfig, cache_stats, runtime_info
from knorm_gen.eviction.cache import make_eviction_cache, pin_caches, probe_caches
from knorm_gen.eviction.cache import probed as is_probed
from knorm_gen.eviction.config import RowsConfig
from knorm_gen.generation.engine import PREFILL_TOGETHER, BatchEngine, prefill
from knorm_gen.tuning.evaluate import SUMMARY_QUESTION, head_tokens
from knorm_gen.generation.generate import prompt_request, question_request
from knorm_gen.batch.job import BatchOptions, run_batch
from knorm_gen.eviction.layouts import CANDIDATES
from knorm_gen.models.load import load_model
from knorm_gen.models.support import model_support

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from documents import documents  # noqa: E402

RATIO = 4.0
STEP = 512  # the product's prefill_step_size, used by every arm (mlx_lm's batch_generate too)
PROMPT_TAIL = "\n\nSummarize the text above."
ARMS = ("full", "default", "paper", "low", "random")
"""The prefill section's arms unless ``--arms`` names others of :data:`ALLOWED_ARMS`."""
ALLOWED_ARMS = (*ARMS, "unstratified")
GiB = 1e9  # the "GB" of mx.get_peak_memory() / 1e9, as GenerationResult.peak_memory_gb

FULL = dict(lengths={"1k": 1024, "2k": 2048, "8k": 7600}, decode_tokens=32,
            together_lengths={"2k": 2048, "8k": 7600}, together_rows=8, together_max_tokens=8,
            batch_size=8, job_rows=16, job_min=4000, job_max=7600, job_max_tokens=64)
QUICK = dict(lengths={"1k": 128, "2k": 256, "8k": 512}, decode_tokens=4,
             together_lengths={"2k": 256, "8k": 512}, together_rows=2, together_max_tokens=4,
             batch_size=2, job_rows=4, job_min=512, job_max=512, job_max_tokens=4)


def log(msg: str = "") -> None:
    print(msg, flush=True)


# ---- documents ----------------------------------------------------------------------


@dataclass
class Text:
    name: str  # the documents it was made of, joined by "+"
    text: str
    tokens: int


def count(tok: Any, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False))


class Texts:
    """Texts of a given length from ``benchmarks/documents.py``'s documents in their fixed
    order: consecutive documents joined by a blank line until the length is reached, then
    cut there (``knorm_gen.tuning.evaluate.head_tokens``: at a line or sentence end). Each call
    takes the documents after those the previous call used."""

    def __init__(self, tok: Any):
        self.tok = tok
        self.docs = documents(tok, 0, 10**9)
        if not self.docs:
            raise SystemExit("no documents: benchmarks/documents.py found none installed")
        self.next = 0

    def take(self, n_tokens: int) -> Text:
        names, parts, total = [], [], 0
        while total < n_tokens:
            if len(names) >= len(self.docs):
                raise SystemExit(f"the documents together hold fewer than {n_tokens} tokens")
            d = self.docs[self.next % len(self.docs)]
            self.next += 1
            names.append(d.name)
            parts.append(d.text)
            total += d.tokens
        text = head_tokens(self.tok, "\n\n".join(parts), n_tokens)
        return Text("+".join(names), text, count(self.tok, text))

    def job(self, rows: int, low: int, high: int) -> list[Text]:
        """``rows`` texts of ``low``-``high`` tokens: each document of at least ``low`` tokens
        alone (cut at ``high``), in the fixed order; then, if too few, consecutive shorter
        documents joined until ``low`` (cut at ``high``)."""
        out = [Text(d.name, t, count(self.tok, t)) for d in self.docs if d.tokens >= low
               for t in [head_tokens(self.tok, d.text, high)]][:rows]
        short = [d for d in self.docs if d.tokens < low]
        i = 0
        while len(out) < rows:
            names, parts, total = [], [], 0
            while total < low:
                if i >= len(short):
                    raise SystemExit(f"the documents make only {len(out)} texts of {low}-{high} tokens")
                names.append(short[i].name)
                parts.append(short[i].text)
                total += short[i].tokens
                i += 1
            text = head_tokens(self.tok, "\n\n".join(parts), high)
            out.append(Text("+".join(names), text, count(self.tok, text)))
        return out


# ---- the arms -----------------------------------------------------------------------


def arm_config(arm: str) -> EvictionConfig:
    """The full cache, or a candidate layout keeping 1/RATIO of each document."""
    if arm == "full":
        return EvictionConfig(budget=None)
    return EvictionConfig(**CANDIDATES[arm], budget=None, ratio=RATIO)


def layer_budget(resolved) -> Optional[int]:
    """The budget of a row's compressed layers (None: no layer is compressed)."""
    plans = [p for p in resolved.layers if p is not None]
    return plans[0].budget if plans else None


def fresh() -> None:
    """Between arms: give back MLX's buffer cache and start the peak from here."""
    mx.clear_cache()
    mx.reset_peak_memory()


def measure_row(model: Any, tok: Any, arm: str, text: Text, label: str, decode_tokens: int) -> dict:
    """One question row as the product runs it: probe, prefill, then the question and a
    greedy answer of ``decode_tokens`` tokens (no stop at an end-of-sequence token)."""
    generation = GenerationConfig(max_tokens=decode_tokens)
    request = question_request(model, tok, 0, text.text, [SUMMARY_QUESTION], arm_config(arm).for_model(model),
                               generation)
    ids = request.context_ids
    fresh()
    tic = time.perf_counter()
    caches = probe_caches(make_eviction_cache(model, request.eviction, request.spans), model, tok, ids,
                          request.spans, request.question_ids)
    probe_s = time.perf_counter() - tic
    tic = time.perf_counter()
    prefill(model, ids, caches, STEP)
    prefill_s = time.perf_counter() - tic
    pin_caches(caches)  # the question and its answer are never evicted
    stamps = []
    for _token, _ in generate_step(mx.array(request.question_ids[0]), model, max_tokens=decode_tokens,
                                   prompt_cache=caches, prefill_step_size=STEP):
        stamps.append(time.perf_counter())
    decode_s = stamps[-1] - stamps[0]
    peak = mx.get_peak_memory() / GiB
    stats = cache_stats(caches)
    probed = is_probed(caches)  # a layer's rule scores against the probe (the full cache runs none)
    total = probe_s + prefill_s
    return {
        "length": label, "arm": arm, "document": text.name, "tokens": len(ids),
        "budget": layer_budget(request.eviction),
        "probe_s": probe_s if probed else None, "prefill_s": prefill_s, "prefill_tps": len(ids) / total,
        "prefill_only_tps": len(ids) / prefill_s, "probe_share": probe_s / total if probed else None,
        "decode_tokens": len(stamps), "decode_s": decode_s, "decode_tps": (len(stamps) - 1) / decode_s,
        "kv_bytes": stats.kept_bytes, "kv_full_bytes": stats.full_bytes, "kv_ceiling_bytes": stats.ceiling_bytes,
        "peak_memory_gb": peak,
    }


def prefill_section(model, tok, texts: Texts, sizes: dict, arms, docs: int, decode_tokens: int) -> dict:
    rows = []
    longest = max(sizes["lengths"].values())
    for d in range(docs):
        base = texts.take(longest)  # every length is the head of one text; every arm reads the same rows
        for label, n in sizes["lengths"].items():
            text = base
            if n < longest:
                cut = head_tokens(tok, base.text, n)
                text = Text(base.name, cut, count(tok, cut))
            for arm in arms:
                row = measure_row(model, tok, arm, text, label, decode_tokens)
                rows.append(row)
                probe = "" if row["probe_share"] is None else f", probe {100 * row['probe_share']:.1f}%"
                log(f"  prefill {label} {arm:8s} doc {d}: {row['tokens']} tokens, {row['prefill_tps']:.1f} tok/s"
                    f"{probe}, decode {row['decode_tps']:.1f} tok/s, KV {row['kv_bytes'] / 2**20:.1f} MiB, "
                    f"peak {row['peak_memory_gb']:.2f} GB")
    means: dict = {}
    for label in sizes["lengths"]:
        for arm in arms:
            mine = [r for r in rows if r["length"] == label and r["arm"] == arm]
            m = {k: sum(r[k] for r in mine) / len(mine) for k in ("tokens", "prefill_tps", "prefill_only_tps",
                                                                 "decode_tps", "kv_bytes", "kv_full_bytes",
                                                                 "peak_memory_gb")}
            m["probe_share"] = None if mine[0]["probe_share"] is None else \
                sum(r["probe_s"] for r in mine) / sum(r["probe_s"] + r["prefill_s"] for r in mine)
            means.setdefault(label, {})[arm] = m
    return {"rows": rows, "means": means}


def prefill_table(section: dict) -> str:
    out = ["| length | arm | tokens | prefill tok/s | probe share | prefill tok/s without probe | decode tok/s | "
           "KV MiB/row | full-cache KV MiB | peak GB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for label, arms in section["means"].items():
        for arm, m in arms.items():
            share = "-" if m["probe_share"] is None else f"{100 * m['probe_share']:.1f}%"
            out.append(f"| {label} | {arm} | {m['tokens']:.0f} | {m['prefill_tps']:.1f} | {share} | "
                       f"{m['prefill_only_tps']:.1f} | {m['decode_tps']:.2f} | {m['kv_bytes'] / 2**20:.1f} | "
                       f"{m['kv_full_bytes'] / 2**20:.1f} | {m['peak_memory_gb']:.2f} |")
    return "\n".join(out)


# ---- prefill together or alone (item 5) --------------------------------------------------


def engine_run(model, tok, resolved, requests, batch_size: int, together: bool) -> dict:
    fresh()
    engine = BatchEngine(model, tok, resolved, batch_size=batch_size, prefill_step_size=STEP,
                         prefill_together=together)
    tic = time.perf_counter()
    try:
        for r in requests:
            engine.add(r.key, r.ids, r.generation, spans=r.spans, eviction=r.eviction)
        results = dict(engine.run())
    finally:
        engine.close()
    wall = time.perf_counter() - tic
    tokens = sum(len(r.ids) for r in requests)
    return {"wall_s": wall, "prompt_tps": tokens / wall, "peak_memory_gb": mx.get_peak_memory() / GiB,
            "_tokens": {k: list(v.tokens) for k, v in results.items()}}


def together_section(model, tok, texts: Texts, sizes: dict) -> dict:
    resolved = arm_config("default").for_model(model)
    generation = GenerationConfig(max_tokens=sizes["together_max_tokens"])
    out = {}
    for label, n in sizes["together_lengths"].items():
        rows = [texts.take(n) for _ in range(sizes["together_rows"])]
        requests = [prompt_request(model, tok, i, t.text + PROMPT_TAIL, resolved, generation)
                    for i, t in enumerate(rows)]
        runs = {}
        for mode, together in (("alone", False), ("together", True)):
            runs[mode] = engine_run(model, tok, resolved, requests, sizes["batch_size"], together)
            log(f"  {label} {mode:8s}: {runs[mode]['wall_s']:.1f} s for {len(requests)} rows")
        alone, together = runs["alone"].pop("_tokens"), runs["together"].pop("_tokens")
        differences = []
        for key in sorted(alone):
            a, b = alone[key], together[key]
            if a != b:
                i = next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), min(len(a), len(b)))
                differences.append({"row": key, "at_token": i, "alone": a[i:i + 4], "together": b[i:i + 4]})
        speed = runs["alone"]["wall_s"] / runs["together"]["wall_s"]
        out[label] = {
            "rows": len(requests), "prompt_tokens_mean": sum(len(r.ids) for r in requests) / len(requests),
            "documents": [t.name for t in rows], "max_tokens": generation.max_tokens,
            "alone": runs["alone"], "together": runs["together"], "speed_together_over_alone": speed,
            "faster": "together" if speed > 1 else "alone", "differing_rows": len(differences),
            "differences": differences,
        }
    return out


def together_table(section: dict) -> str:
    out = ["| length | rows | prompt tokens (mean) | alone s | together s | together / alone speed | "
           "alone peak GB | together peak GB | rows with other tokens |", "|---|---|---|---|---|---|---|---|---|"]
    for label, s in section.items():
        out.append(f"| {label} | {s['rows']} | {s['prompt_tokens_mean']:.0f} | {s['alone']['wall_s']:.1f} | "
                   f"{s['together']['wall_s']:.1f} | {s['speed_together_over_alone']:.2f}x | "
                   f"{s['alone']['peak_memory_gb']:.2f} | {s['together']['peak_memory_gb']:.2f} | "
                   f"{s['differing_rows']} |")
    return "\n".join(out)


# ---- the whole job ------------------------------------------------------------------


def job_section(model, tok, model_spec: str, rows: list[Text], sizes: dict, workdir: Path) -> dict:
    batch, max_tokens = sizes["batch_size"], sizes["job_max_tokens"]
    arms = {}

    # ours: the knorm-batch runner
    source = workdir / "job.jsonl"
    source.write_text("".join(json.dumps({"id": f"row{i}", "text": t.text}) + "\n" for i, t in enumerate(rows)))
    options = BatchOptions(model=model_spec, eviction=EvictionConfig(budget=None, ratio=RATIO),
                           generation=GenerationConfig(max_tokens=max_tokens), batch_size=batch, overwrite=True,
                           rows=RowsConfig(questions=(SUMMARY_QUESTION,), context_field="text"))
    fresh()
    tic = time.perf_counter()
    summary = run_batch(str(source), str(workdir / "job.out.jsonl"), options, model=model, tokenizer=tok,
                        progress=False, log=lambda _msg: None)
    wall = time.perf_counter() - tic
    peak = mx.get_peak_memory() / GiB
    if summary.failed or summary.ok != len(rows):
        raise SystemExit(f"the job failed: {summary.text()}")
    records = [json.loads(line) for line in (workdir / "job.out.jsonl").read_text().splitlines() if line.strip()]
    # KV bytes of one position, every layer: full_bytes is the model's own cache, every position on a
    # model without sliding windows (the embedded one this measures)
    per_token = [r["full_bytes"] / r["tokens_seen"] for r in records]
    arms["ours_default"] = _job_arm(len(rows), wall, peak, [r["generated_tokens"] for r in records],
                                    [r["kept_bytes"] for r in records])
    log(f"  job ours_default: {wall:.1f} s")

    # mlx_lm's batch_generate on the same token ids: a full cache, then a rotating cache of the default's bytes
    resolved = arm_config("default").for_model(model)
    generation = GenerationConfig(max_tokens=max_tokens)
    prompts = []
    for i, t in enumerate(rows):
        r = question_request(model, tok, i, t.text, [SUMMARY_QUESTION], resolved, generation)
        prompts.append(list(r.context_ids) + list(r.question_ids[0]))
    position = sum(per_token) / len(per_token)
    window = round(sum(r["kept_bytes"] / p for r, p in zip(records, per_token)) / len(records))
    for name, size in (("mlx_rotating", window), ("mlx_batch_generate", None)):
        caches = None if size is None else [
            [RotatingKVCache(max_size=size, keep=4) if type(c) is KVCache else c for c in make_prompt_cache(model)]
            for _ in prompts]
        fresh()
        tic = time.perf_counter()
        response = batch_generate(model, tok, prompts, prompt_caches=caches, max_tokens=max_tokens,
                                  completion_batch_size=batch, prefill_batch_size=batch, prefill_step_size=STEP,
                                  return_token_ids=True)
        wall = time.perf_counter() - tic
        peak = mx.get_peak_memory() / GiB
        generated = [len(t) for t in response.token_ids]
        kept = [round(position * (len(p) + g if size is None else min(size, len(p) + g)))
                for p, g in zip(prompts, generated)]
        arms[name] = _job_arm(len(rows), wall, peak, generated, kept)
        if size is not None:
            arms[name]["max_kv_size"] = size
        log(f"  job {name}: {wall:.1f} s")
    ours, full = arms["ours_default"], arms["mlx_batch_generate"]
    return {
        "rows": len(rows), "batch_size": batch, "max_tokens": max_tokens,
        "documents": [{"name": t.name, "tokens": t.tokens} for t in rows],
        "prompt_tokens": [len(p) for p in prompts], "arms": arms,
        "ratios": {
            "ours_vs_mlx_rows_per_hour": ours["rows_per_hour"] / full["rows_per_hour"],
            "ours_vs_mlx_peak_memory": ours["peak_memory_gb"] / full["peak_memory_gb"],
            "ours_vs_rotating_rows_per_hour": ours["rows_per_hour"] / arms["mlx_rotating"]["rows_per_hour"],
            "ours_vs_rotating_peak_memory": ours["peak_memory_gb"] / arms["mlx_rotating"]["peak_memory_gb"],
        },
    }


def _job_arm(rows: int, wall: float, peak: float, generated: list, kv: list) -> dict:
    return {"wall_s": wall, "rows_per_hour": 3600 * rows / wall, "generated_tokens": sum(generated),
            "generated_tps": sum(generated) / wall, "kv_bytes_mean": sum(kv) / len(kv), "peak_memory_gb": peak}


def job_table(section: dict) -> str:
    out = ["| arm | rows | wall s | rows/hour | generated tokens | KV MiB/row (mean) | peak GB |",
           "|---|---|---|---|---|---|---|"]
    for name, a in section["arms"].items():
        label = f"{name} (max_kv_size {a['max_kv_size']})" if "max_kv_size" in a else name
        out.append(f"| {label} | {section['rows']} | {a['wall_s']:.1f} | {a['rows_per_hour']:.1f} | "
                   f"{a['generated_tokens']} | {a['kv_bytes_mean'] / 2**20:.1f} | {a['peak_memory_gb']:.2f} |")
    return "\n".join(out)


# ---- the aims -----------------------------------------------------------------------


def aims(result: dict, sizes: dict) -> dict:
    out = {}
    prefill_means = result.get("prefill", {}).get("means", {})
    default = {label: arms.get("default") for label, arms in prefill_means.items()}
    if default.get("8k") and default.get("1k"):
        out["prefill_8k_vs_1k"] = {"value": default["8k"]["prefill_tps"] / default["1k"]["prefill_tps"],
                                   "aim": ">= 0.8", "what": "the default's prefill tokens/s at 8k over its rate at 1k"}
    if default.get("8k") and default["8k"]["probe_share"] is not None:
        out["probe_share_8k"] = {"value": default["8k"]["probe_share"], "aim": "<= 0.1",
                                 "what": "the probe's share of the default's prefill time at 8k"}
    job = result.get("job")
    if job:
        out["job_rows_per_hour_vs_mlx"] = {"value": job["ratios"]["ours_vs_mlx_rows_per_hour"], "aim": ">= 3",
                                           "what": "the whole job's rows/hour over mlx_lm batch_generate's"}
        out["job_peak_memory_vs_mlx"] = {"value": job["ratios"]["ours_vs_mlx_peak_memory"], "aim": "<= 0.2",
                                         "what": "the whole job's peak memory over mlx_lm batch_generate's"}
    for a in out.values():
        op, bound = a["aim"].split()
        a["met"] = a["value"] >= float(bound) if op == ">=" else a["value"] <= float(bound)
    return out


def aims_table(section: dict) -> str:
    out = ["| aim | measured | wanted | met |", "|---|---|---|---|"]
    for a in section.values():
        out.append(f"| {a['what']} | {a['value']:.3f} | {a['aim']} | {'yes' if a['met'] else 'no'} |")
    return "\n".join(out)


# ---- the estimate -------------------------------------------------------------------

# DESIGN.md section 4 (SmolLM2 fp32, 2 cores, OpenBLAS): the GEMMs of a prefill run ~1,060 tok/s;
# attention costs ~4.9e-6 s per query-key pair over the 30 layers (3.8 s at 1k, 46 s at 4k);
# decode ~18 tok/s at short context, 10.7 at 4,096 tokens.
GEMM_TPS, PAIR_S, DECODE_S, DECODE_PER_KEY_S = 1060.0, 4.9e-6, 0.055, 9.3e-6


def prefill_cost(n: float, cap: Optional[float] = None) -> float:
    t, p = 0.0, 0
    while p < n:
        s = min(STEP, n - p)
        t += s / GEMM_TPS + PAIR_S * s * ((p if cap is None else min(p, cap)) + s / 2)
        p += s
    return t


def decode_cost(keys: float, tokens: int, rows: int = 1) -> float:
    return tokens * (DECODE_S + rows * keys * DECODE_PER_KEY_S)


def estimate(sizes: dict, arms, docs: int, skip_together: bool, skip_job: bool, n_layers: int,
             job_tokens: list) -> dict:
    """Seconds per section, from the cost model above (the embedded model on a 2-core CPU);
    ``job_tokens``: the whole job's document lengths."""
    paper_full = min(2, n_layers) / n_layers

    def arm_cost(arm, n):
        bounded = prefill_cost(n, n / RATIO) + decode_cost(n / RATIO, sizes["decode_tokens"])
        full = prefill_cost(n) + decode_cost(n, sizes["decode_tokens"])
        return {"full": full, "paper": paper_full * full + (1 - paper_full) * bounded}.get(arm, bounded)

    out = {"prefill": docs * sum(arm_cost(a, n) for n in sizes["lengths"].values() for a in arms)}
    if not skip_together:
        rows, b = sizes["together_rows"], sizes["batch_size"]
        out["together"] = sum(2 * rows * prefill_cost(n, n / RATIO) + 2 * decode_cost(n / RATIO,
                              sizes["together_max_tokens"], min(rows, b)) for n in sizes["together_lengths"].values())
    if not skip_job:
        rows, b, t = len(job_tokens), sizes["batch_size"], sizes["job_max_tokens"]
        n = sum(job_tokens) / rows
        out["job"] = (sum(2 * prefill_cost(k, k / RATIO + 64) + prefill_cost(k) for k in job_tokens)
                      + math.ceil(rows / b) * (2 * decode_cost(n / RATIO, t, b) + decode_cost(n, t, b)))
    return out


# ---- the run ------------------------------------------------------------------------


def machine() -> dict:
    cpu = ""
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), "")
    except OSError:
        pass
    return {"processor": platform.processor(), "cpu_model": cpu, "cores": os.cpu_count(), "runtime": runtime_info()}


def git() -> dict:
    def out(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    return {"commit": out("rev-parse", "HEAD") or "unknown", "dirty": bool(out("status", "--porcelain"))}


def write(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    tmp.replace(path)


def prefill_report(model, tok, texts: Texts, sizes: dict, arms, docs: int, weights_gb: float, result: dict,
                   out: Path) -> None:
    """Section 1 (prefill and decode per arm) into ``result``, written to ``out`` and printed."""
    log("\n## Prefill and decode per arm\n")
    result["prefill"] = prefill_section(model, tok, texts, sizes, arms, docs, sizes["decode_tokens"])
    write(out, result)
    log("\n" + prefill_table(result["prefill"]))
    log(f"\ntokens: the row's context (template and document) fed in {STEP}-token blocks; each length's text is "
        f"cut at {', '.join(f'{k} = {v}' for k, v in sizes['lengths'].items())} tokens (at a line or sentence end; "
        f"7,600 for 8k, so that it, the template and the question fit an 8,192-token context). Prefill tok/s: "
        f"context tokens / (probe + prefill) seconds; probe share: the probe's seconds over that (-: the arm runs "
        f"no probe). Decode tok/s: "
        f"one row's greedy answer of {sizes['decode_tokens']} tokens after the question, the first token left out. "
        f"KV MiB/row: knorm_gen.cache_stats(caches).kept_bytes after the answer, every layer; full-cache KV: the "
        f"same positions uncompressed. Peak GB: mx.get_peak_memory() over the row, the weights "
        f"({weights_gb:.2f} GB) included. Every eviction arm keeps 1/{RATIO:g} of the document; paper keeps "
        f"layers 0-1 whole (more bytes).")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run): seconds")
    ap.add_argument("--skip-job", action="store_true", help="leave out the whole-job section")
    ap.add_argument("--skip-together", action="store_true", help="leave out the prefill together/alone section")
    ap.add_argument("--skip-prefill", action="store_true", help="leave out the prefill and decode per arm section")
    ap.add_argument("--model", default="default", help="'default' (the embedded model) or an mlx_lm model folder")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"arms of the prefill section (of {', '.join(ALLOWED_ARMS)})")
    ap.add_argument("--docs", type=int, default=1, help="rows per length in the prefill section")
    ap.add_argument("--out", default=str(HERE / "results" / "cost.json"))
    args = ap.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not arms or any(a not in ALLOWED_ARMS for a in arms):
        ap.error(f"--arms takes names of {', '.join(ALLOWED_ARMS)}")
    if "default" not in arms:
        ap.error("--arms must hold 'default' (every aim is about it)")
    if args.docs < 1:
        ap.error("--docs must be at least 1")
    sizes = QUICK if args.quick else FULL
    start = time.perf_counter()
    model, tok = load_model(None if args.model == "default" else args.model)
    mx.eval(model.parameters())
    weights_gb = mx.get_active_memory() / GiB
    texts = Texts(tok)
    n_layers = len(make_prompt_cache(model))

    # warm up (first-call costs stay out of the arms: the package's one check of a model at its first use, a
    # few seconds, is paid here as the load is) and scale the cost model to this machine
    model_support(model)
    warm = texts.take(sizes["lengths"]["1k"])
    texts.next = 0
    measure_row(model, tok, "default", warm, "warm-up", 2)
    fresh()
    tic = time.perf_counter()
    caches = make_prompt_cache(model)
    prefill(model, tok.encode(warm.text, add_special_tokens=False), caches, STEP)
    scale = (time.perf_counter() - tic) / prefill_cost(warm.tokens)
    del caches
    job_rows = [] if args.skip_job else texts.job(sizes["job_rows"], sizes["job_min"], sizes["job_max"])
    planned = {k: scale * v for k, v in estimate(sizes, arms, 0 if args.skip_prefill else args.docs,
                                                  args.skip_together, args.skip_job,
                                                  n_layers, [t.tokens for t in job_rows]).items()}
    log(f"cost.py: model {args.model}, {n_layers} layers, weights {weights_gb:.2f} GB; every eviction arm keeps "
        f"1/{RATIO:g} of each document (ratio={RATIO:g}); prefill in {STEP}-token blocks")
    log(f"estimated time: {sum(planned.values()) / 60:.1f} min ("
        + ", ".join(f"{k} {v / 60:.1f}" for k, v in planned.items())
        + f"; a cost model from DESIGN.md section 4 scaled by a {warm.tokens}-token full-cache prefill timed here)")

    result: dict[str, Any] = {
        "benchmark": "cost", "model": args.model, "quick": args.quick,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "git": git(), "machine": machine(),
        "settings": {"ratio": RATIO, "prefill_step_size": STEP, "question": SUMMARY_QUESTION,
                     "prompt_tail": PROMPT_TAIL, "arms": arms, "docs_per_length": args.docs,
                     "default_prefill_together": PREFILL_TOGETHER, **sizes},
        "weights_gb": weights_gb, "estimate_s": sum(planned.values()),
    }
    out = Path(args.out)

    if not args.skip_prefill:
        prefill_report(model, tok, texts, sizes, arms, args.docs, weights_gb, result, out)
    if not args.skip_together:
        log("\n## Prefill together or alone\n")
        result["together"] = together_section(model, tok, texts, sizes)
        write(out, result)
        log("\n" + together_table(result["together"]))
        for label, s in result["together"].items():
            for d in s["differences"]:
                log(f"  {label}: row {d['row']} differs from token {d['at_token']}: alone {d['alone']}, "
                    f"together {d['together']}")
        log(f"\n{sizes['together_rows']} prompt rows (a document, then \"{PROMPT_TAIL.strip()}\"), the default "
            f"layout at ratio {RATIO:g}, batch {sizes['batch_size']}, {sizes['together_max_tokens']} new tokens "
            f"each, through knorm_gen.generation.engine.BatchEngine: alone = prefill_together=False (each row probed and "
            f"prefilled alone, then decoded in the batch), together = True (mlx_lm's batch prefill of right-padded "
            f"chunks). Seconds: the whole engine run (every add, then run). Speed together/alone: alone seconds over "
            f"together seconds (above 1: together is faster). Rows with other tokens: greedy outputs that differ "
            f"(listed above with where they part). The default today: prefill_together={PREFILL_TOGETHER}.")

    if not args.skip_job:
        log("\n## The whole job\n")
        with tempfile.TemporaryDirectory(prefix="knorm-cost-") as workdir:
            result["job"] = job_section(model, tok, args.model, job_rows, sizes, Path(workdir))
        write(out, result)
        j = result["job"]
        log("\n" + job_table(j))
        log(f"\n{j['rows']} documents of {min(d['tokens'] for d in j['documents'])}-"
            f"{max(d['tokens'] for d in j['documents'])} tokens (each document of {sizes['job_min']}+ tokens alone, "
            f"cut at {sizes['job_max']}; shorter ones joined in pairs or more), one question each "
            f"(\"{SUMMARY_QUESTION}\"), {j['max_tokens']} new tokens at most, batch {j['batch_size']}, greedy. "
            f"ours_default: knorm_gen.batch.job.run_batch (knorm-batch) with the default layout at ratio {RATIO:g}. "
            f"mlx_batch_generate: mlx_lm.generate.batch_generate on the same token ids, full cache. mlx_rotating: the "
            f"same with a RotatingKVCache per layer of max_kv_size positions, the default's mean KV bytes per row "
            f"(mlx_lm's batch_generate ignores max_kv_size for a model with make_cache, so the caches are passed "
            f"in). Every arm prefills in {STEP}-token chunks of up to {j['batch_size']} rows. Rows/hour: 3600 x rows "
            f"/ wall seconds. KV MiB/row: ours, the records' kept_bytes; mlx_lm's arms, the positions they hold x "
            f"the bytes of one position. Peak GB: mx.get_peak_memory() over the arm, weights included.")

    result["aims"] = aims(result, sizes)
    result["seconds"] = time.perf_counter() - start
    write(out, result)
    if result["aims"]:
        log("\n## The aims, measured in this run\n")
        log(aims_table(result["aims"]))
        log("\nEach a ratio of two numbers above, measured in this run on this machine; 'met' compares it with "
            "the issue's aim.")
    log(f"\nwrote {out} ({result['seconds'] / 60:.1f} min; estimated {result['estimate_s'] / 60:.1f} min)")
    return result


if __name__ == "__main__":
    main()
