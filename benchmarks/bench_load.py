"""Model loading benchmark: GGUF readers, first (converting) and cached loads.

Arms:
  * SmolLM2's Q4_1 GGUF read by MLX (``mx.load``, quantized triples, then
    dequantized in MLX) and by llama.cpp's ``gguf`` package (parse, then
    dequantize every tensor with numpy);
  * ``load_model(spec)`` in a fresh process on an empty cache (the conversion,
    plus Gemma's assembly from its part packages), then again in a fresh
    process on the filled cache; for "default" and "gemma-3-270m".

Writes benchmarks/results/load.json and prints a table. Every cache it fills
is a temporary folder, removed at the end.

    python benchmarks/bench_load.py [--models default,gemma-3-270m]
    python benchmarks/bench_load.py --quick [--models PATH]   # smoke run: the first model, MLX's read alone
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import knorm_gen  # noqa: E402,F401  (BLAS preload before mlx)

RESULTS = ROOT / "benchmarks" / "results" / "load.json"


def readers(gguf_package: bool = True) -> dict:
    """Seconds to read the embedded model's GGUF with MLX and (``gguf_package``) with the ``gguf`` package."""
    import mlx.core as mx
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from knorm_gen.models.load import default_model_path

    path = str(default_model_path())
    t = time.perf_counter()
    weights = mx.load(path, return_metadata=True)[0]
    mx.eval(weights)
    mlx_read = time.perf_counter() - t
    t = time.perf_counter()
    for name in [k[: -len(".scales")] for k in weights if k.endswith(".scales")]:
        w, s, b = (weights[f"{name}.{kind}"] for kind in ("weight", "scales", "biases"))
        # GGUF blocks hold 32 values: 32 * bits / 32 uint32 words per scale
        mx.eval(mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=32,
                              bits=w.shape[-1] // s.shape[-1]))
    mlx_dequant = time.perf_counter() - t
    gguf_read = gguf_dequant = None
    if gguf_package:
        t = time.perf_counter()
        reader = GGUFReader(path)
        gguf_read = round(time.perf_counter() - t, 2)
        t = time.perf_counter()
        for tensor in reader.tensors:
            dequantize(tensor.data, tensor.tensor_type)
        gguf_dequant = round(time.perf_counter() - t, 2)
    return {
        "file": Path(path).name,
        "mx_load_s": round(mlx_read, 2),
        "mlx_dequantize_s": round(mlx_dequant, 2),
        "gguf_reader_s": gguf_read,
        "gguf_dequantize_s": gguf_dequant,
    }


def timed_load(spec: str, cache: str) -> dict:
    """load_model(spec) in a fresh process; seconds for the call alone."""
    code = (
        "import time, json, warnings; warnings.simplefilter('ignore');"
        "from knorm_gen.models.load import load_model;"
        f"t = time.perf_counter(); m, tok = load_model({spec!r}); s = time.perf_counter() - t;"
        "print(json.dumps({'s': s, 'dtype': m.knorm_info['dtype']}))"
    )
    env = {**os.environ, "KNORM_CACHE_DIR": cache}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="default,gemma-3-270m")
    ap.add_argument("--quick", action="store_true", help="a smoke run: the first of --models only, and the GGUF "
                    "read by MLX alone (the gguf package's parse takes seconds)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.quick:
        args.models = args.models.split(",")[0]

    result = {"runtime": knorm_gen.runtime_info(), "readers": readers(gguf_package=not args.quick), "loads": []}
    for spec in args.models.split(","):
        with tempfile.TemporaryDirectory(prefix="knorm-bench-cache-") as cache:
            first = timed_load(spec, cache)
            cached = timed_load(spec, cache)
            size = sum(p.stat().st_size for p in Path(cache, "converted").rglob("*") if p.is_file())
        result["loads"].append({"model": spec, "first_s": round(first["s"], 1), "cached_s": round(cached["s"], 1),
                                "dtype": cached["dtype"], "cache_mb": round(size / 2**20)})

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    r = result["readers"]
    print(f"{r['file']}: mx.load {r['mx_load_s']} s + MLX dequantize {r['mlx_dequantize_s']} s"
          + (f"; gguf reader {r['gguf_reader_s']} s + numpy dequantize {r['gguf_dequantize_s']} s"
             if r["gguf_reader_s"] is not None else ""))
    print("| model | first load s | cached load s | cache MiB |")
    print("|---|---|---|---|")
    for row in result["loads"]:
        print(f"| {row['model']} | {row['first_s']} | {row['cached_s']} | {row['cache_mb']} |")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
