"""KV memory per row with and without ``kv_bits``: the embedded model measured, an 8B-class layout computed.

    python benchmarks/kv_memory_table.py            # markdown table (README, "Quantized KV")

The embedded model's rows come from ``knorm_gen.kv_memory`` (one token through real
caches: the bytes each layer really stores, float32 here). The 8B-class rows are
computed from its shapes (32 layers, 8 KV heads of 128, bfloat16: Llama 3.1 8B's)
with :func:`knorm_gen.eviction.quant.bytes_per_vector`, which ``tests/test_quant.py`` checks
against real caches. Every count is per row, for the document, before pinned tokens.
"""

from __future__ import annotations

import knorm_gen  # noqa: F401  (BLAS preload first)
from knorm_gen import EvictionConfig, kv_memory, load_model
from knorm_gen.eviction.quant import bytes_per_vector

TOKENS = (4096, 8192, 32768)
BUDGET = 512
LAYOUTS = (("full cache", None, None), ("full cache, --kv-bits 8", None, 8), ("full cache, --kv-bits 4", None, 4),
           ("default, budget 512", BUDGET, None), ("default, budget 512, --kv-bits 8", BUDGET, 8),
           ("default, budget 512, --kv-bits 4", BUDGET, 4))


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f}" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def computed(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int, budget, bits) -> list[float]:
    per_position = layers * kv_heads * 2 * bytes_per_vector(head_dim, dtype_bytes, bits, 64)
    return [per_position * (n if budget is None else min(n, budget)) for n in TOKENS]


def main() -> str:
    model, _ = load_model()
    lines = ["| layout | model | " + " | ".join(f"{n // 1024}k tokens" for n in TOKENS) + " |",
             "|---|---|" + "---|" * len(TOKENS)]
    for name, budget, bits in LAYOUTS:
        memory = kv_memory(model, EvictionConfig(budget=budget, kv_bits=bits))
        lines.append(f"| {name} | SmolLM2-135M (measured) | "
                     + " | ".join(mib(memory.bytes_at(n)) for n in TOKENS) + " |")
    for name, budget, bits in LAYOUTS:
        lines.append(f"| {name} | 8B class (computed) | "
                     + " | ".join(mib(b) for b in computed(32, 8, 128, 2, budget, bits)) + " |")
    text = "\n".join(lines)
    print(text)
    return text


if __name__ == "__main__":
    main()
