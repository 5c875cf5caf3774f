"""Pass keys in fillers nothing was tuned on, through the public API, at the lengths users run.

    python benchmarks/unseen_fillers.py --model default --tokens 3000
    python benchmarks/unseen_fillers.py --model gemma-3-270m --tokens 3000,4000 --fillers weather,library

Every other pass-key run in this repository uses the four fillers of
:data:`knorm_gen.tune.FILLERS` at 1,500 tokens (two tuned on, two held out). The
fillers here were written for this script after the 0.8 default was chosen, and no
layout was chosen on them: a check on material the default has never seen, as a
user's own text is. Per case (a filler repeated to ``--tokens`` tokens, the key
sentence at each depth), the key is asked two ways, each through the function a
user calls:

- ``prompt``: ``generate_with_eviction(model, tok, filler + "\\n\\n" + question)``,
  the question written after the text (completion style for a base model:
  "What is the pass key? The pass key is");
- ``ctq``: ``answer_questions(model, tok, filler, [question])``, asked apart.

Arms: the default (``EvictionConfig()``, budget = prompt tokens / ``--ratio``), the
full cache (``budget=None``) and random eviction at the same budget (``keep="random"``).
Results: results/unseen_fillers-<model>.json (one row per case, mode and arm); with
``--add-to`` the finished cases of an earlier run are kept.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import knorm_gen  # noqa: F401  (BLAS preload first)
from knorm_gen import EvictionConfig, answer_questions, generate_with_eviction
from knorm_gen.models import load_model
from knorm_gen.prompts import as_tokenizer, has_chat_template
from knorm_gen.evaluate import FILLERS, KEY_CUE, KEY_QUESTION, filler_text, with_needle
from knorm_gen.layouts import CANDIDATES

from rule_switches import add_rule_switches, apply_rule_switches

RESULTS = Path(__file__).parent / "results"

UNSEEN = {
    "weather": "It rained in the morning and cleared up by the afternoon, as the forecast said it would. ",
    "library": "The library opens at nine and closes at six, and the reading room stays quiet all day. ",
    "train": "The train left the station on time and stopped at every small town along the river. ",
    "garden": "She watered the tomatoes, pulled a few weeds, and sat for a while on the bench by the fence. ",
}

TUNING = {name: FILLERS[name] for name in ("grass", "ledger")}  # choose_default.py's tuning split's fillers
DEV = {  # long sentences like the unseen ones, to try a change on before measuring it on UNSEEN
    "office": "The meeting in the small office ran late again because nobody had read the notes beforehand. ",
    "river": "The river ran slowly past the old mill, and the children threw stones into the water all afternoon. ",
}

ALL = {**UNSEEN, **DEV, **TUNING}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--fillers", default=",".join(UNSEEN))
    ap.add_argument("--tokens", default="3000", help="filler lengths in tokens, comma-separated")
    ap.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    ap.add_argument("--ratio", type=float, default=4.0)
    ap.add_argument("--modes", default="prompt,ctq")
    ap.add_argument("--arms", default="default,full,random")
    add_rule_switches(ap)
    ap.add_argument("--add-to", default="")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    bad = [a for a in args.arms.split(",") if a not in ("default", "full", "random", *CANDIDATES)]
    if bad:
        ap.error(f"--arms: unknown {', '.join(bad)}; choose default, full, random or a knorm-tune candidate")
    unknown = [n for n in args.fillers.split(",") if n not in ALL]
    if unknown:  # before any model work
        ap.error(f"--fillers: unknown {', '.join(unknown)}; choose from {', '.join(ALL)}")
    apply_rule_switches(args)
    model, tok = load_model(None if args.model == "default" else args.model)
    tok = as_tokenizer(tok)
    chat = has_chat_template(tok)
    question = KEY_QUESTION if chat else KEY_CUE
    out = Path(args.out or RESULTS / f"unseen_fillers-{args.model}.json")
    rows = json.loads(Path(args.add_to).read_text())["rows"] if args.add_to else []
    done = {(r["filler"], r["tokens"], r["depth"], r["mode"], r["arm"]) for r in rows}
    used = {name: ALL[name] for name in args.fillers.split(",")}
    rng = random.Random(7)
    cases = [(f, int(n), float(d), str(rng.randint(10000, 99999)))
             for f in args.fillers.split(",") for n in args.tokens.split(",") for d in args.depths.split(",")]
    for f, n, depth, key in cases:
        context = with_needle(filler_text(ALL[f], tok, n), depth, key)
        context_tokens = len(tok.encode(context, add_special_tokens=False))
        budget = int(context_tokens / args.ratio)
        for mode in args.modes.split(","):
            for arm in args.arms.split(","):
                if (f, n, depth, mode, arm) in done:
                    continue
                eviction = (EvictionConfig(budget=None) if arm == "full" else
                            EvictionConfig(budget=budget, keep="random", early_keep="auto", recent_share=0.125)
                            if arm == "random" else EvictionConfig(budget=budget, **CANDIDATES[arm])
                            if arm in CANDIDATES else EvictionConfig(budget=budget))
                tic = time.perf_counter()
                if mode == "prompt":
                    r = generate_with_eviction(model, tok, context + "\n\n" + question, eviction=eviction,
                                               max_tokens=16, temperature=0.0)
                else:
                    r, = answer_questions(model, tok, context, [question], eviction=eviction, max_tokens=16,
                                          temperature=0.0)
                rows.append(dict(filler=f, tokens=n, depth=depth, key=key, mode=mode, arm=arm,
                                 context_tokens=context_tokens, budget=None if arm == "full" else budget,
                                 ok=key in r.text, answer=r.text, kept_bytes=r.kept_bytes,
                                 seconds=round(time.perf_counter() - tic, 2)))
                print(f"{f} {n} {depth} {mode} {arm}: {'ok' if key in r.text else 'MISS'} {r.text[:40]!r}",
                      file=sys.stderr, flush=True)
                out.write_text(json.dumps(dict(model=args.model, ratio=args.ratio, fillers=used, rows=rows),
                                          indent=1))
    summary = {}
    for mode in args.modes.split(","):
        full = {(r["filler"], r["tokens"], r["depth"]) for r in rows if r["mode"] == mode and r["arm"] == "full"
                and r["ok"]}
        for arm in args.arms.split(","):
            got = {(r["filler"], r["tokens"], r["depth"]) for r in rows if r["mode"] == mode and r["arm"] == arm
                   and r["ok"]}
            asked = sum(r["mode"] == mode and r["arm"] == arm for r in rows)
            summary[f"{mode}/{arm}"] = dict(found=len(got), asked=asked, of_full=len(got & full), full=len(full))
            print(f"{mode:6s} {arm:8s} found {len(got)}/{asked}, {len(got & full)} of the full cache's {len(full)}")
    out.write_text(json.dumps(dict(model=args.model, ratio=args.ratio, fillers=used, rows=rows,
                                   summary=summary), indent=1))
    return summary


if __name__ == "__main__":
    main()
