"""Decode speed of the eviction cache against mlx_lm's own caches, in one run.

    python benchmarks/bench_cache.py                 # default model, 1k / 4k / 8k tokens of context
    python benchmarks/bench_cache.py --model tiny    # random small llama, seconds

Arms: full ``KVCache``; ``RotatingKVCache(budget, keep=4)`` (what ``max_kv_size``
gives an mlx_lm user); ``L2NormKVCache(budget)`` in every layer (``l2norm``, the
like-for-like arm); and the library default with its uncompressed skip layers
(``l2norm_default``). All run mlx_lm's own
``generate_step`` on the same prompt. Prints decode tokens/s and ratios, and the
share of prefill time spent in eviction (selection measured in isolation on
the same block sequence). Writes ``benchmarks/results/cache_speed.json``.
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

from knorm_gen import EvictionConfig, L2NormKVCache, cache_stats, make_eviction_cache, runtime_info

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
    from knorm_gen.models import load_model

    return load_model(None if spec == "default" else spec)[0]


def make_arm(model, arm: str, budget: int, skip_layers: tuple[int, ...]):
    if arm == "full":
        return make_prompt_cache(model)
    if arm == "rotating":
        return [RotatingKVCache(max_size=budget, keep=4) for _ in model.layers]
    if arm == "l2norm":  # every layer bounded, like the rotating arm
        return make_eviction_cache(model, EvictionConfig(budget=budget, skip_layers=()))
    return make_eviction_cache(model, EvictionConfig(budget=budget, skip_layers=skip_layers))


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
    """Seconds spent in L2NormKVCache updates over a whole prefill, all compressed layers."""
    attn = model.layers[0].self_attn
    heads, dim = attn.n_kv_heads, attn.head_dim
    dtype = model.layers[0].self_attn.k_proj.weight.dtype
    if dtype not in (mx.float32, mx.float16, mx.bfloat16):
        dtype = mx.float16
    blocks = [mx.random.normal((1, heads, min(step, context - s), dim)).astype(dtype) for s in range(0, context, step)]
    mx.eval(blocks)
    best = float("inf")
    for _ in range(repeats):
        caches = [L2NormKVCache(budget) for _ in range(n_compressed)]
        tic = time.perf_counter()
        for b in blocks:
            for c in caches:
                c.update_and_fetch(b, b)
            mx.eval([c.state for c in caches])
        best = min(best, time.perf_counter() - tic)
    return best


def bench_context(model, context: int, budget: int, decode: int, step: int) -> dict:
    """All arms at one context length, plus the isolated eviction cost."""
    vocab = model.args.vocab_size
    prompt = mx.random.randint(0, vocab, (context,), key=mx.random.key(context)).astype(mx.int32)
    skip = EvictionConfig().resolved(len(model.layers)).skip_layers
    arms = {}
    for arm in ("full", "rotating", "l2norm", "l2norm_default"):
        arms[arm] = run_arm(model, make_arm(model, arm, budget, skip), prompt, decode, step)
        print(f"[{context}] {arm:15s} prefill {arms[arm]['prefill_tps']:8.1f} tok/s   decode "
              f"{arms[arm]['decode_tps']:7.2f} tok/s   peak {arms[arm]['peak_memory_gb']:.3f} GB   "
              f"KV {arms[arm]['kv_kept_bytes'] / 2**20:.1f} MiB", flush=True)
    evict_s = eviction_cost(model, context, budget, step, len(model.layers))
    ratios = {
        "l2norm_vs_rotating_decode": arms["l2norm"]["decode_tps"] / arms["rotating"]["decode_tps"],
        "l2norm_vs_full_decode": arms["l2norm"]["decode_tps"] / arms["full"]["decode_tps"],
        "l2norm_default_vs_full_decode": arms["l2norm_default"]["decode_tps"] / arms["full"]["decode_tps"],
        "rotating_vs_full_decode": arms["rotating"]["decode_tps"] / arms["full"]["decode_tps"],
        "l2norm_vs_full_prefill": arms["l2norm"]["prefill_tps"] / arms["full"]["prefill_tps"],
        "eviction_share_of_prefill": evict_s / arms["l2norm"]["prefill_s"],
    }
    print(f"[{context}] decode l2norm/rotating = {ratios['l2norm_vs_rotating_decode']:.3f} (target >= 0.9); "
          f"l2norm/full = {ratios['l2norm_vs_full_decode']:.3f}; eviction share of prefill = "
          f"{100 * ratios['eviction_share_of_prefill']:.2f}% ({evict_s * 1000:.1f} ms; target < 2%)", flush=True)
    return {"context": context, "arms": arms, "eviction_s": evict_s, "ratios": ratios}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="'default', 'tiny', or a model spec for load_model")
    ap.add_argument("--contexts", default="1024,4096,8192", help="comma-separated context lengths")
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--decode", type=int, default=48)
    ap.add_argument("--prefill-step", type=int, default=512)
    ap.add_argument("--quick", action="store_true", help="1024 tokens of context, 16 decode steps")
    ap.add_argument("--out", default=str(RESULTS / "cache_speed.json"))
    args = ap.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.quick:
        contexts, args.decode = [1024], 16

    model = load(args.model)
    # Warm-up (kernels, allocator) so the first arm is not penalised.
    vocab = model.args.vocab_size
    warm = mx.random.randint(0, vocab, (256,), key=mx.random.key(1)).astype(mx.int32)
    run_arm(model, make_arm(model, "full", args.budget, ()), warm, 4, args.prefill_step)
    out = {
        "benchmark": "cache_speed",
        "model": args.model,
        "budget": args.budget,
        "decode_tokens": args.decode,
        "prefill_step": args.prefill_step,
        "skip_layers_default": list(EvictionConfig().resolved(len(model.layers)).skip_layers),
        "contexts": [bench_context(model, c, args.budget, args.decode, args.prefill_step) for c in contexts],
        "runtime": runtime_info(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")
    return out


if __name__ == "__main__":
    main()
