"""Where 4-bit KV loses: per layer, the error quantization puts into attention's output.

    python benchmarks/quant_error.py --model default --docs 2

Each held-out document (the odd ones of ``benchmarks/documents.py``, cut to
``--tokens``) is prefilled once with full caches, recording every layer's queries,
keys and values (post-RoPE, as attention sees them). For the last ``--queries``
queries of each layer, attention over all keys is computed in float64 from the
original keys and values and from their ``mx.quantize`` round trip at each setting;
the table gives the relative error ||out_q - out|| / ||out|| per layer (mean over
documents and heads), and which of keys or values carries it (each quantized alone).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import knorm_gen  # noqa: F401  (BLAS preload first)
import mlx.core as mx
import numpy as np

from knorm_gen.platform.mlx_compat import make_prompt_cache, record_attention
from knorm_gen.models.load import load_model
from knorm_gen.tuning.evaluate import head_tokens

sys.path.insert(0, str(Path(__file__).parent))
from documents import documents  # noqa: E402

SETTINGS = (("q8g64", 8, 64), ("q4g64", 4, 64), ("q4g32", 4, 32))


def roundtrip(x: np.ndarray, bits: int, group: int) -> np.ndarray:
    q = mx.quantize(mx.array(x.astype(np.float32)), group_size=group, bits=bits)
    return np.array(mx.dequantize(*q, group_size=group, bits=bits)).astype(np.float64)


def attend(q, k, v, scale):
    s = np.einsum("hqd,hkd->hqk", q, k) * scale
    s -= s.max(-1, keepdims=True)
    w = np.exp(s)
    w /= w.sum(-1, keepdims=True)
    return np.einsum("hqk,hkd->hqd", w, v)


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--docs", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--queries", type=int, default=64)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "quant_error.json"))
    args = ap.parse_args(argv)
    model, tok = load_model(None if args.model == "default" else args.model)
    docs = documents(tok)[1::2][: args.docs]
    per_layer: dict = {}
    for doc in docs:
        ids = tok.encode(head_tokens(tok, doc.text, args.tokens))
        caches, calls = make_prompt_cache(model), []
        with record_attention(model, calls):
            model(mx.array(ids)[None], cache=caches)
        layer_values = [c for c in caches if getattr(c, "values", None) is not None]
        for i, ((q, k, scale), c) in enumerate(zip(calls, caches)):
            q = np.array(q[0, :, -args.queries:].astype(mx.float32)).astype(np.float64)
            k = np.array(k[0].astype(mx.float32)).astype(np.float64)
            v = np.array(c.values[0, :, : k.shape[1]].astype(mx.float32)).astype(np.float64)
            rep = q.shape[0] // k.shape[0]
            kk, vv = np.repeat(k, rep, axis=0), np.repeat(v, rep, axis=0)
            ref = attend(q, kk, vv, scale)
            row = per_layer.setdefault(i, {})
            for name, bits, group in SETTINGS:
                if k.shape[-1] % group:
                    continue
                kq = np.repeat(roundtrip(k, bits, group), rep, axis=0)
                vq = np.repeat(roundtrip(v, bits, group), rep, axis=0)
                for part, (a, b) in (("both", (kq, vq)), ("keys", (kq, vv)), ("values", (kk, vq))):
                    row.setdefault(f"{name}_{part}", []).append(rel(attend(q, a, b, scale), ref))
        del layer_values
    table = {i: {k: float(np.mean(v)) for k, v in row.items()} for i, row in per_layer.items()}
    out = {"model": args.model, "docs": [d.name for d in docs], "tokens": args.tokens, "queries": args.queries,
           "layers": table}
    Path(args.out).write_text(json.dumps(out, indent=1))
    cols = sorted(next(iter(table.values())))
    print("| layer | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for i, row in table.items():
        print(f"| {i} | " + " | ".join(f"{row[c]:.3f}" for c in cols) + " |")
    return out


if __name__ == "__main__":
    main()
