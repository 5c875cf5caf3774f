"""Runtime speed benchmark: the OpenBLAS preload and the CPU float32 policy.

Arms:
  * float32 matmul GFLOP/s with the OpenBLAS preload (this process) and
    without it (a subprocess with KNORM_NO_BLAS=1: the preload has to happen
    before mlx is imported, so it cannot be undone in-process);
  * the model's prefill and decode tok/s (the embedded SmolLM2-135M-Instruct
    unless ``--model``) on the float32 path, and optionally on the GGUF's
    quantized weights.

Writes benchmarks/results/runtime.json and prints a table.

    python benchmarks/bench_runtime.py [--quick] [--include-quantized] [--model SPEC]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import knorm_gen.platform.runtime as runtime  # noqa: E402  (must precede any mlx import)

runtime.preload_blas()

import mlx.core as mx  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "runtime.json"
TEXT = (
    "The committee met on Tuesday to review the quarterly report. Revenue rose 12 percent, "
    "driven by exports to 14 countries, while costs fell in three of five divisions. "
)


def matmul_gflops(n: int, seconds: float) -> float:
    """Best-of-run float32 n x n matmul throughput, measured for ~`seconds`."""
    a = mx.random.normal((n, n), dtype=mx.float32)
    b = mx.random.normal((n, n), dtype=mx.float32)
    mx.eval(a, b)
    mx.eval(a @ b)  # warm-up
    best, spent = float("inf"), 0.0
    while spent < seconds:
        t = time.perf_counter()
        mx.eval(a @ b)
        dt = time.perf_counter() - t
        best, spent = min(best, dt), spent + dt
    return 2 * n**3 / best / 1e9


def matmul_arm(sizes: list[int], seconds: float) -> dict:
    return {str(n): round(matmul_gflops(n, seconds), 2) for n in sizes}


def model_arm(float32: bool, prompt_tokens: int, decode_tokens: int, repeats: int, spec: str = "default") -> dict:
    from mlx_lm.models.cache import make_prompt_cache

    from knorm_gen.models.load import load_model

    t = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, tok = load_model(None if spec == "default" else spec, float32=float32)
    load_s = time.perf_counter() - t

    ids = tok.encode(TEXT, add_special_tokens=False)
    ids = (ids * (prompt_tokens // len(ids) + 1))[:prompt_tokens]
    prompt = mx.array(ids)[None]

    def run(n_decode: int) -> tuple[float, float]:
        cache = make_prompt_cache(model)
        t0 = time.perf_counter()
        logits = model(prompt, cache=cache)
        y = mx.argmax(logits[:, -1], axis=-1)
        mx.eval(y)
        t1 = time.perf_counter()
        for _ in range(n_decode):
            y = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
            mx.eval(y)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1

    run(2)  # warm-up (kernel and allocator first use)
    prefill, decode = [], []
    for _ in range(repeats):
        p, d = run(decode_tokens)
        prefill.append(p)
        decode.append(d)
    return {
        "float32": float32,
        "dtype": model.knorm_info["dtype"],
        "load_s": round(load_s, 2),
        "prompt_tokens": prompt_tokens,
        "decode_tokens": decode_tokens,
        "prefill_tok_s": round(prompt_tokens / min(prefill), 1),
        "decode_tok_s": round(decode_tokens / min(decode), 1),
    }


def no_blas_subprocess(sizes: list[int], seconds: float) -> dict:
    env = {**os.environ, "KNORM_NO_BLAS": "1"}
    args = [sys.executable, __file__, "--worker-matmul", ",".join(map(str, sizes)),
            "--seconds", str(seconds)]
    out = subprocess.run(args, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run (seconds)")
    ap.add_argument("--model", default="default", help="'default' (the embedded model) or a spec for load_model")
    ap.add_argument("--include-quantized", action="store_true",
                    help="also time the GGUF's quantized weights (slow on CPU)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--worker-matmul", help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker_matmul:  # child process of the no-BLAS arm
        sizes = [int(s) for s in args.worker_matmul.split(",")]
        print(json.dumps({"runtime": runtime.runtime_info(),
                          "gflops": matmul_arm(sizes, args.seconds)}))
        return

    quick = args.quick
    sizes = [512] if quick else [1024, 2048]
    seconds = 0.2 if quick else 3.0
    prompt_tokens, decode_tokens = (128, 8) if quick else (512, 64)
    repeats = 1 if quick else 3

    info = runtime.runtime_info()
    t0 = time.perf_counter()
    blas = matmul_arm(sizes, seconds)
    ref = no_blas_subprocess(sizes, seconds)
    arms = [model_arm(True, prompt_tokens, decode_tokens, repeats, args.model)]
    if args.include_quantized:
        # Quantized CPU prefill runs ~8 tok/s: keep this arm short.
        arms.append(model_arm(False, min(prompt_tokens, 128), min(decode_tokens, 16), 1, args.model))

    result = {
        "runtime": info,
        "no_blas_runtime": ref["runtime"],
        "quick": quick,
        "matmul_gflops": {"blas": blas, "no_blas": ref["gflops"],
                          "ratio": {n: round(blas[n] / ref["gflops"][n], 1) for n in blas}},
        "model": arms,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")

    print(f"device {info['device']}  blas {info['blas']} ({info['blas_status']})")
    print(f"{'fp32 matmul':<14}{'BLAS GFLOP/s':>14}{'ref GFLOP/s':>14}{'ratio':>8}")
    for n in sizes:
        k = str(n)
        print(f"{n:>4}x{n:<9}{blas[k]:>14.1f}{ref['gflops'][k]:>14.1f}"
              f"{result['matmul_gflops']['ratio'][k]:>7.1f}x")
    print(f"{'model arm':<22}{'prefill tok/s':>14}{'decode tok/s':>14}{'load s':>8}")
    for arm in arms:
        name = "float32" if arm["float32"] else "quantized (Q4_1)"
        label = f"{name} p{arm['prompt_tokens']}/d{arm['decode_tokens']}"
        print(f"{label:<22}{arm['prefill_tok_s']:>14.1f}{arm['decode_tok_s']:>14.1f}"
              f"{arm['load_s']:>8.1f}")
    if len(arms) == 2:
        print(f"float32 / quantized: prefill {arms[0]['prefill_tok_s'] / arms[1]['prefill_tok_s']:.1f}x,"
              f" decode {arms[0]['decode_tok_s'] / arms[1]['decode_tok_s']:.1f}x")
    print(f"wrote {args.out} ({result['wall_s']} s)")


if __name__ == "__main__":
    main()
