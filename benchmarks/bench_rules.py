"""What each eviction rule costs in the cache alone, and how exact leverage is, in one run.

    python benchmarks/bench_rules.py            # SmolLM2-like and Gemma-like shapes, random keys
    python benchmarks/bench_rules.py --quick    # a smoke run (seconds): one repeat, small blocks

Times, for ``keep`` = low, keydiff and leverage, one prefill block (``--block``
tokens into caches already at the budget, every compressed layer) and one decode
step over the budget (every compressed layer), on random keys of two shapes:
SmolLM2-135M (3 KV heads, head_dim 64, 30 layers) and Gemma 3 270M (1 KV head,
head_dim 256, its 3 full-attention layers). Prints the times and their ratio to
``keep="low"``; ratios within one run are what to compare (the machine may be
shared). Then the float32 leverage scores against a float64 computation of the
same definition, on anisotropic keys with a shared offset (the shape real keys
have): blocks, and a block followed by decode steps. ``--out`` writes the numbers
as JSON too.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import knorm_gen  # noqa: F401  (BLAS preload first)
import mlx.core as mx
import numpy as np

from knorm_gen import runtime_info
from knorm_gen.eviction.cache import EvictionKVCache
from knorm_gen.eviction.rules.leverage import LEVERAGE_REFRESH, LEVERAGE_RIDGE, Leverage

SHAPES = {"smollm2": dict(heads=3, dim=64, layers=30), "gemma3": dict(heads=1, dim=256, layers=3)}
RULES = ("low", "keydiff", "leverage")


def time_rule(keep: str, heads: int, dim: int, layers: int, budget: int, block: int, steps: int,
              repeats: int) -> dict:
    """Best-of-``repeats`` microseconds per block and per decode step, all layers together."""
    blocks = [mx.random.normal((1, heads, block, dim), key=mx.random.key(i)) for i in range(4)]
    tokens = [mx.random.normal((1, heads, 1, dim), key=mx.random.key(100 + i)) for i in range(steps)]
    mx.eval(blocks, tokens)
    best_block = best_step = float("inf")
    for _ in range(repeats):
        caches = [EvictionKVCache(budget, keep=keep) for _ in range(layers)]
        for c in caches:
            c.update_and_fetch(blocks[0], blocks[0])
        mx.eval([c.state for c in caches])
        tic = time.perf_counter()
        for b in blocks[1:]:
            mx.eval([c.update_and_fetch(b, b) for c in caches], [c.state for c in caches])
        best_block = min(best_block, (time.perf_counter() - tic) / (len(blocks) - 1))
        tic = time.perf_counter()
        for t in tokens:
            mx.eval([c.update_and_fetch(t, t) for c in caches], [c.state for c in caches])
        best_step = min(best_step, (time.perf_counter() - tic) / len(tokens))
    return {"block_us": best_block * 1e6, "decode_us": best_step * 1e6}


def realistic_keys(heads: int, dim: int, t: int, seed: int) -> np.ndarray:
    """``(heads, t, dim)`` float64 keys with a decaying spectrum and a shared offset."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(heads):
        basis, _ = np.linalg.qr(rng.normal(size=(dim, dim)))
        spread = np.exp(-np.arange(dim) / (dim / 12))
        offset = 3.0 * rng.normal(size=dim) * (rng.random(dim) < 0.1)
        out.append((rng.normal(size=(t, dim)) * np.sqrt(spread)) @ basis.T + offset)
    return np.stack(out)


def float64_scores(keys: np.ndarray, splits: list[int]) -> list[np.ndarray]:
    """Leverage of each block's keys, from the definition in float64 (λ set at the
    blocks and at the decode steps that refresh it, as :mod:`knorm_gen.eviction.rules.leverage` does)."""
    out, seen, lam, dim = [], 0, None, keys.shape[-1]
    for n in splits:
        seen += n
        mean = keys[:, :seen].mean(axis=1)
        centred = keys[:, :seen] - mean[:, None]
        scatter = np.swapaxes(centred, 1, 2) @ centred
        if n > 1 or seen & (seen - 1) == 0 or seen % LEVERAGE_REFRESH == 0:
            trace = np.trace(scatter, axis1=1, axis2=2)
            lam = LEVERAGE_RIDGE / dim * np.maximum(trace, 1e-6 * (mean ** 2).sum(-1))
        inv = np.linalg.inv(scatter + lam[:, None, None] * np.eye(dim))
        x = keys[:, seen - n : seen] - mean[:, None]
        out.append(-np.einsum("hnd,hde,hne->hn", x, inv, x))
    return out


def leverage_error(heads: int, dim: int, splits: list[int], seed: int = 0) -> float:
    """Largest relative difference of the float32 scores from the float64 ones."""
    keys = realistic_keys(heads, dim, sum(splits), seed)
    want = float64_scores(keys, splits)
    rule, state, seen, worst = Leverage(), None, 0, 0.0
    for n, ref in zip(splits, want):
        block = mx.array(keys[None, :, seen : seen + n].astype(np.float32))
        state = rule.update(state, block, [seen], [n])
        got = np.array(rule.score(block, None, state))[0]
        worst = max(worst, float(np.max(np.abs(got - ref) / np.abs(ref))))
        seen += n
    return worst


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--block", type=int, default=512)
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: one repeat, 128-token blocks, 8 decode steps, a 32-step error check")
    ap.add_argument("--out", default=None, help="also write the numbers as JSON here")
    args = ap.parse_args(argv)
    repeats, steps = (1, 8) if args.quick else (5, args.steps)
    if args.quick:
        args.budget, args.block = min(args.budget, 128), min(args.block, 128)
    out = {"benchmark": "rule_cost", "budget": args.budget, "block": args.block, "cost": {}, "leverage_error": {}}
    for shape, dims in SHAPES.items():
        cost = {keep: time_rule(keep, **dims, budget=args.budget, block=args.block, steps=steps, repeats=repeats)
                for keep in RULES}
        for keep, c in cost.items():
            c["block_vs_low"] = c["block_us"] / cost["low"]["block_us"]
            c["decode_vs_low"] = c["decode_us"] / cost["low"]["decode_us"]
            c["block_vs_keydiff"] = c["block_us"] / cost["keydiff"]["block_us"]
            c["decode_vs_keydiff"] = c["decode_us"] / cost["keydiff"]["decode_us"]
            print(f"{shape:8s} ({dims['heads']} heads, D={dims['dim']}, {dims['layers']} layers) {keep:8s} "
                  f"block {c['block_us'] / 1000:8.2f} ms ({c['block_vs_low']:5.2f}x low, "
                  f"{c['block_vs_keydiff']:5.2f}x keydiff)   decode step {c['decode_us'] / 1000:7.3f} ms "
                  f"({c['decode_vs_low']:5.2f}x low, {c['decode_vs_keydiff']:5.2f}x keydiff)", flush=True)
        out["cost"][shape] = {"shape": dims, "rules": cost}
    decode = 32 if args.quick else 1024
    for shape, dims in SHAPES.items():
        for name, splits in (("blocks", [args.block] * 4), ("decode", [args.block] + [1] * decode)):
            err = leverage_error(dims["heads"], dims["dim"], splits)
            out["leverage_error"][f"{shape}_{name}"] = err
            print(f"leverage float32 vs float64, {shape} keys, {name} ({len(splits)} updates): "
                  f"max relative error {err:.1e}", flush=True)
    out["runtime"] = runtime_info()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2))
        print(f"wrote {args.out}")
    return out


if __name__ == "__main__":
    main()
