"""Decode speed of the eviction cache against mlx_lm's own caches, in one run.

    python benchmarks/bench_cache.py                 # default model, 1k / 4k / 8k tokens of context
    python benchmarks/bench_cache.py --model tiny    # random small llama, seconds

The caches as an mlx_lm user drives them: :func:`knorm_gen.make_eviction_cache` handed
to mlx_lm's own ``generate_step``, with no probe of a prompt (the product's path, probe
included, is ``benchmarks/cost.py``'s). Arms: full ``KVCache``;
``RotatingKVCache(budget, keep=4)`` in every full-attention layer (what ``max_kv_size``
gives an mlx_lm user); keep-low in every full-attention layer (``l2norm``, the
like-for-like arm); ``keydiff`` and ``blend`` in every full-attention layer; ``skip30``
(keep-low, the first 30% of the full-attention layers uncompressed); ``paper`` (keep-low,
layers 0-1 uncompressed); and ``intrinsic`` (``--preset intrinsic``, the preset whose
rules need no probe). All run on the same prompt. Prints prefill and decode tokens/s and
ratios, the share of prefill time spent in eviction (selection measured in isolation on
the same block sequence), ``intrinsic``'s prefill rate at each length against its rate at
the shortest, and each rule's cost per prefill block and per decode step against
``keep="low"`` (one layer's cache, the model's KV shapes, in isolation; the question rule
with a random probe of 40 tokens per query head). Writes
``benchmarks/results/cache_speed.json``.

    python benchmarks/bench_cache.py --model gemma-3-270m --contexts 1024,8192,16384
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import knorm_gen  # noqa: F401  (BLAS preload first)
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

from knorm_gen import PRESETS, EvictionConfig, EvictionKVCache, cache_stats, make_eviction_cache, runtime_info
from knorm_gen.eviction.config import early_layers
from knorm_gen.platform.mlx_compat import full_attention_layers
from knorm_gen.eviction.rules import RULES
from knorm_gen.eviction.rules.question import Probe

ARMS = ("full", "rotating", "l2norm", "keydiff", "blend", "skip30", "paper", "intrinsic")

RESULTS = Path(__file__).parent / "results"


def load(spec: str):
    if spec == "tiny":
        from mlx_lm.models import llama

        mx.random.seed(0)
        args = llama.ModelArgs(
            model_type="llama", hidden_size=256, num_hidden_layers=8, intermediate_size=512,
            num_attention_heads=8, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=1000,
        )
        model = llama.Model(args)
        mx.eval(model.parameters())
        return model
    from knorm_gen.models.load import load_model

    return load_model(None if spec == "default" else spec)[0]


def make_arm(model, arm: str, budget: int):
    full = full_attention_layers(model)
    if arm == "full":
        return make_prompt_cache(model)
    if arm == "rotating":
        return [RotatingKVCache(max_size=budget, keep=4) if i in full else c
                for i, c in enumerate(make_prompt_cache(model))]
    configs = {  # every full-attention layer bounded, like the rotating arm, unless the arm says otherwise
        "l2norm": EvictionConfig(budget=budget, keep="low", skip_layers=(), coverage=0.0),
        "keydiff": EvictionConfig(budget=budget, keep="keydiff", skip_layers=(), coverage=0.0),
        "blend": EvictionConfig(budget=budget, keep="blend", skip_layers=(), coverage=0.0),
        "skip30": EvictionConfig(budget=budget, keep="low", skip_layers=early_layers(len(model.layers), full), coverage=0.0),
        "paper": EvictionConfig(budget=budget, keep="low", skip_layers=(0, 1), coverage=0.0),
        # the preset whose rules need no probe: this script feeds caches without one
        "intrinsic": EvictionConfig(budget=budget, **PRESETS["intrinsic"]),
    }
    return make_eviction_cache(model, configs[arm])


def run_arm(model, caches, prompt: mx.array, decode: int, step: int) -> dict:
    mx.reset_peak_memory()
    tic = time.perf_counter()
    gen = generate_step(prompt, model, prompt_cache=caches, max_tokens=decode + 1, prefill_step_size=step)
    next(gen)
    prefill_s = time.perf_counter() - tic
    tic = time.perf_counter()
    n = sum(1 for _ in gen)
    decode_s = time.perf_counter() - tic
    stats = cache_stats(caches)
    return {
        "prefill_s": prefill_s,
        "prefill_tps": prompt.size / prefill_s,
        "decode_tokens": n,
        "decode_s": decode_s,
        "decode_tps": n / decode_s,
        "peak_memory_gb": mx.get_peak_memory() / 1e9,
        "kv_kept_bytes": stats.kept_bytes,
        "kv_full_bytes": stats.full_bytes,
    }


def eviction_cost(model, context: int, budget: int, step: int, n_compressed: int, repeats: int = 3) -> float:
    """Seconds spent in keep-low cache updates over a whole prefill, all compressed layers."""
    attn = model.layers[0].self_attn
    heads, dim = attn.n_kv_heads, attn.head_dim
    dtype = model.layers[0].self_attn.k_proj.weight.dtype
    if dtype not in (mx.float32, mx.float16, mx.bfloat16):
        dtype = mx.float16
    blocks = [mx.random.normal((1, heads, min(step, context - s), dim)).astype(dtype) for s in range(0, context, step)]
    mx.eval(blocks)
    best = float("inf")
    for _ in range(repeats):
        caches = [EvictionKVCache(budget) for _ in range(n_compressed)]
        tic = time.perf_counter()
        for b in blocks:
            for c in caches:
                c.update_and_fetch(b, b)
            mx.eval([c.state for c in caches])
        best = min(best, time.perf_counter() - tic)
    return best


def rule_cost(model, budget: int, step: int, repeats: int = 5, steps: int = 64) -> dict:
    """Microseconds per prefill block (``step`` tokens into a cache already at the
    budget) and per decode step over budget, one layer's cache, each rule."""
    attn = model.layers[0].self_attn
    heads, dim = attn.n_kv_heads, attn.head_dim
    blocks = [mx.random.normal((1, heads, step, dim), key=mx.random.key(i)) for i in range(4)]
    tokens = [mx.random.normal((1, heads, 1, dim), key=mx.random.key(100 + i)) for i in range(steps)]
    mx.eval(blocks, tokens)
    group = attn.n_heads // heads
    # keep="question"'s probe: 40 probe tokens (instructions, question, draft) per query head, sentence pieces of 12
    q = mx.random.normal((1, heads, group * 40, dim), key=mx.random.key(999))
    pieces = mx.arange(4 * step)[None] // 12
    probe = Probe(q * mx.rsqrt(mx.sum(q * q, axis=-1, keepdims=True)), pieces, mx.zeros(pieces.shape, mx.bool_))
    out = {}
    for keep in RULES:
        best_block = best_step = float("inf")
        for _ in range(repeats):
            c = EvictionKVCache(budget, keep=keep)
            if RULES[keep].reads_probe:
                c.set_probe([probe])
            c.update_and_fetch(blocks[0], blocks[0])
            mx.eval(c.state)
            tic = time.perf_counter()
            for b in blocks[1:]:
                mx.eval(c.update_and_fetch(b, b), c.state)
            best_block = min(best_block, (time.perf_counter() - tic) / (len(blocks) - 1))
            tic = time.perf_counter()
            for t in tokens:
                mx.eval(c.update_and_fetch(t, t), c.state)
            best_step = min(best_step, (time.perf_counter() - tic) / len(tokens))
        out[keep] = {"block_us": best_block * 1e6, "decode_us": best_step * 1e6}
    for keep in out:
        out[keep]["block_vs_low"] = out[keep]["block_us"] / out["low"]["block_us"]
        out[keep]["decode_vs_low"] = out[keep]["decode_us"] / out["low"]["decode_us"]
    return out


def bench_context(model, context: int, budget: int, decode: int, step: int, arm_names=ARMS) -> dict:
    """The arms at one context length, plus the isolated eviction cost."""
    vocab = model.args.vocab_size
    prompt = mx.random.randint(0, vocab, (context,), key=mx.random.key(context)).astype(mx.int32)
    arms = {}
    for arm in arm_names:
        arms[arm] = run_arm(model, make_arm(model, arm, budget), prompt, decode, step)
        print(f"[{context}] {arm:15s} prefill {arms[arm]['prefill_tps']:8.1f} tok/s   decode "
              f"{arms[arm]['decode_tps']:7.2f} tok/s   peak {arms[arm]['peak_memory_gb']:.3f} GB   "
              f"KV {arms[arm]['kv_kept_bytes'] / 2**20:.1f} MiB", flush=True)
    evict_s = eviction_cost(model, context, budget, step, len(model.layers))
    ratios = {"eviction_share_of_prefill": evict_s / arms["l2norm"]["prefill_s"]} if "l2norm" in arms else {}
    for arm in arms:
        if arm != "full" and "full" in arms:
            ratios[f"{arm}_vs_full_decode"] = arms[arm]["decode_tps"] / arms["full"]["decode_tps"]
            ratios[f"{arm}_vs_full_prefill"] = arms[arm]["prefill_tps"] / arms["full"]["prefill_tps"]
    if "l2norm" in arms and "rotating" in arms:
        ratios["l2norm_vs_rotating_decode"] = arms["l2norm"]["decode_tps"] / arms["rotating"]["decode_tps"]
    print(f"[{context}] " + "; ".join(f"{k} {v:.3f}" for k, v in ratios.items())
          + f" (eviction {evict_s * 1000:.1f} ms)", flush=True)
    return {"context": context, "arms": arms, "eviction_s": evict_s, "ratios": ratios}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="'default', 'tiny', or a model spec for load_model")
    ap.add_argument("--contexts", default="1024,4096,8192", help="comma-separated context lengths")
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--decode", type=int, default=48)
    ap.add_argument("--prefill-step", type=int, default=512)
    ap.add_argument("--arms", default="", help=f"comma-separated, of {', '.join(ARMS)} (default: all; --quick: "
                    "full, rotating, l2norm, intrinsic)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 256 tokens of context, budget 64, "
                    "128-token blocks, 8 decode steps, one repeat")
    ap.add_argument("--out", default=str(RESULTS / "cache_speed.json"))
    args = ap.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    arm_names = tuple(a for a in args.arms.split(",") if a) or (
        ("full", "rotating", "l2norm", "intrinsic") if args.quick else ARMS)
    if set(arm_names) - set(ARMS):
        ap.error(f"unknown arms {sorted(set(arm_names) - set(ARMS))}; allowed: {', '.join(ARMS)}")
    if args.quick:
        contexts, args.decode, args.budget, args.prefill_step = [256], 8, 64, 128

    model = load(args.model)
    # Warm-up (kernels, allocator) so the first arm is not penalised.
    vocab = model.args.vocab_size
    warm = mx.random.randint(0, vocab, (256,), key=mx.random.key(1)).astype(mx.int32)
    run_arm(model, make_arm(model, "full", args.budget), warm, 4, args.prefill_step)
    results = [bench_context(model, c, args.budget, args.decode, args.prefill_step, arm_names) for c in contexts]
    intrinsic_rate = {r["context"]: r["arms"]["intrinsic"]["prefill_tps"] for r in results
                      if "intrinsic" in r["arms"]}
    shortest = min(intrinsic_rate, default=None)
    out = {
        "benchmark": "cache_speed",
        "model": args.model,
        "budget": args.budget,
        "decode_tokens": args.decode,
        "prefill_step": args.prefill_step,
        "skip_layers_default": list(EvictionConfig().resolved(len(model.layers),
                                                               full_attention_layers(model)).skip_layers),
        "default_config": EvictionConfig().to_dict(),
        "contexts": results,
        # intrinsic's prefill tokens/s at each length over its rate at the shortest
        "intrinsic_prefill_vs_shortest": {str(c): r / intrinsic_rate[shortest] for c, r in intrinsic_rate.items()},
        "rule_cost": rule_cost(model, args.budget, args.prefill_step, repeats=1 if args.quick else 5,
                               steps=8 if args.quick else 64),
        "runtime": runtime_info(),
    }
    for keep, c in out["rule_cost"].items():
        print(f"rule {keep:8s} block {c['block_us']:8.0f} us ({c['block_vs_low']:.2f}x low)   decode step "
              f"{c['decode_us']:6.0f} us ({c['decode_vs_low']:.2f}x low)", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")
    return out


if __name__ == "__main__":
    main()
