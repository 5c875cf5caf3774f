"""What is never evicted, measured: the share of the instruction tokens each layer
still holds after prefill, and a code written only in the system prompt, asked for
after a long document, with the full cache and at 4x and 8x of the prompt's tokens.

    python benchmarks/bench_pinning.py [--docs 3] [--out results/pinning.json]
    python benchmarks/bench_pinning.py --quick     # smoke run: one document cut to 1,000 characters
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import knorm_gen  # noqa: F401  (BLAS preload first)
from knorm_gen import EvictionConfig, answer_questions, load_model, make_eviction_cache, probe_caches
from knorm_gen.eviction.cache import EvictionKVCache
from knorm_gen.tuning.corpus import pydoc_sections
from knorm_gen.generation.engine import prefill
from knorm_gen.generation.prompts import context_spans, split_question_prompts

SYSTEM = "You are a careful technical writer. The project code name is {code}. Answer in one line."
QUESTION = "What is the project code name?"
CODES = ("Bluefin", "Marigold", "Copperhead", "Nightjar", "Saltmarsh", "Tamarind")


def held_share(model, tok, text: str, budget: int) -> tuple[float, float]:
    """Mean and worst share, over layers and heads, of the positions before the document that are held."""
    system = SYSTEM.format(code="Bluefin")
    prefix, questions = split_question_prompts(tok, text, [QUESTION], chat=True, system_prompt=system)
    spans = context_spans(tok, text, prefix, chat=True, system_prompt=system)
    head = set(range(spans[0][0]))
    caches = probe_caches(make_eviction_cache(model, EvictionConfig(budget=budget), spans), model, tok, prefix, spans,
                          questions)  # the default (keep="question") is probed first, as the product does
    caches = prefill(model, prefix, caches)
    shares = []
    for c in caches:
        if isinstance(c, EvictionKVCache):
            _, _, pos = c.ordered_state()
            for h in pos.tolist()[0]:
                shares.append(len(head & set(h)) / len(head))
    return sum(shares) / len(shares), min(shares)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=3)
    ap.add_argument("--model", default="default", help="'default' (the embedded model) or a spec for load_model")
    ap.add_argument("--quick", action="store_true", help="one document cut to its first 1,000 characters")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "pinning.json"))
    args = ap.parse_args(argv)
    model, tok = load_model(None if args.model == "default" else args.model)
    sections = [text for name, text in pydoc_sections() if 6000 <= len(text) <= 12000][: args.docs]
    if args.quick:
        sections = [sections[0][:1000]]
    rng = random.Random(0)
    rows = []
    for i, text in enumerate(sections):
        mean, worst = held_share(model, tok, text, 128)
        code = CODES[i % len(CODES)]
        found = {}
        for ratio in (None, 4, 8):
            system = SYSTEM.format(code=code)
            n = len(split_question_prompts(tok, text, [QUESTION], chat=True, system_prompt=system)[0])
            budget = None if ratio is None else n // ratio
            (r,) = answer_questions(model, tok, text, [QUESTION], budget=budget, max_tokens=16, system_prompt=system)
            found["full" if ratio is None else f"{ratio}x"] = code in r.text
            rows.append(dict(doc=i, tokens=n, ratio=ratio, code=code, answer=r.text, found=code in r.text,
                             kept_bytes=r.kept_bytes, kv_ceiling_bytes=r.kv_ceiling_bytes))
        print(f"doc {i} ({rows[-1]['tokens']} tokens): instruction tokens held at budget 128: mean {mean:.0%}, "
              f"worst layer/head {worst:.0%}; code found {found}", flush=True)
        rows.append(dict(doc=i, held_mean=mean, held_worst=worst))
    result = {"model": args.model, "budget_held": 128, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
