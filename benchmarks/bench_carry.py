"""Prefill time of the carrying rules against keep="question", in one run.

    python benchmarks/bench_carry.py --models default,gemma-3-270m
    python benchmarks/bench_carry.py --rules question,question_carry,question_per_query_carry

Per model: the first held-out document of ``benchmarks/documents.py`` cut to 2,048 tokens, one
question asked apart (``answer_questions``, one answer token), budget 512; after one warm-up call,
three rounds alternating the rules; prints each rule's median prefill seconds (the probe
included) and its ratio to the first rule's. Nothing is written.
"""
import argparse
import statistics

import knorm_gen  # noqa: F401  (BLAS preload first)
from knorm_gen import EvictionConfig, answer_questions
from knorm_gen.models import load_model
from knorm_gen.evaluate import head_tokens

from documents import documents

RULES = ("question", "question_carry")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="default,gemma-3-270m")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rules", default=",".join(RULES),
                    help="keep= rules to time, comma-separated; ratios are to the first")
    args = ap.parse_args(argv)
    rules = args.rules.split(",")
    out = {}
    for spec in args.models.split(","):
        model, tok = load_model(None if spec == "default" else spec)
        text = head_tokens(tok, documents(tok)[1].text, 2048)
        ask = ["Summarize the text above."]
        answer_questions(model, tok, text, ask, budget=512, max_tokens=1)  # warm-up
        seconds = {rule: [] for rule in rules}
        for _ in range(args.rounds):
            for rule in rules:
                r, = answer_questions(model, tok, text, ask, max_tokens=1, eviction=EvictionConfig(budget=512, keep=rule))
                seconds[rule].append(r.prefill_s)
        median = {rule: statistics.median(seconds[rule]) for rule in rules}
        ratios = {rule: median[rule] / median[rules[0]] for rule in rules[1:]}
        out[spec] = dict(median, ratios=ratios)
        print(f"{spec}: prefill median of {args.rounds} (probe included), 2,048 tokens, budget 512: "
              + ", ".join(f"{rule} {median[rule]:.2f} s" for rule in rules) + "; ratios to " + rules[0] + ": "
              + ", ".join(f"{rule} {r:.3f}" for rule, r in ratios.items()), flush=True)
    return out


if __name__ == "__main__":
    main()
