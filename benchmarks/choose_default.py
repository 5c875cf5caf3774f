"""Choose the default layout by measurement, on a split of the documents it was not tuned on.

    python benchmarks/choose_default.py --model default --split tune            # every candidate
    python benchmarks/choose_default.py --model default --split heldout --arms low_cov25,keydiff,random
    python benchmarks/choose_default.py --model default --split heldout --arms lev30_blend_cov25_rec50,lev30_blend_cov25_rec50@q8
    python benchmarks/choose_default.py --report results/choose_default-*.json   # markdown tables

The documents of ``benchmarks/documents.py`` are split by position: even ones are the
tuning split, odd ones the held-out split; fillers are split the same way (tune:
grass, ledger; held-out: harbor, recipe). Each document is cut to its first
``--doc-tokens`` tokens. Every arm runs through the product's prefill path
(:mod:`knorm_gen.tune`); results go to results/choose_default-<model>-<split>.json,
checkpointed after each case (``--add-to`` continues a run). An arm ``NAME@qB``
is candidate NAME with its kept keys and values stored at B bits (``kv_bits``,
groups of 64; ``NAME@qBgG``: groups of G). The arm ``mix`` is the per-layer mix a
``knorm-tune --out FILE`` run measured (``--mix-from FILE``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import knorm_gen  # noqa: F401  (BLAS preload first)
from knorm_gen.models import load_model
from knorm_gen.evaluate import Doc, head_tokens, summarize
from knorm_gen.layouts import CANDIDATES

from documents import documents, installed_readmes  # benchmarks/documents.py
from rule_switches import add_rule_switches, apply_rule_switches

RESULTS = Path(__file__).parent / "results"
SPLIT_FILLERS = {"tune": ("grass", "ledger"), "heldout": ("harbor", "recipe")}


def arm_fields(name: str, mix_from: str = "") -> dict:
    """The config fields of an arm: a candidate, or ``candidate@q4`` / ``@q8`` (kv_bits),
    or ``mix`` (the per-layer mix of the tuning in ``mix_from``)."""
    if name == "mix":
        layout = (json.loads(Path(mix_from).read_text()).get("mix") or {}).get("layout") if mix_from else None
        if not layout:
            raise SystemExit("arm mix needs --mix-from FILE: a knorm-tune --out file whose tuning measured a mix")
        return {k: tuple(v) if k == "skip_layers" else v for k, v in layout.items()}
    base, _, quant = name.partition("@q")
    bits, _, group = quant.partition("g")
    if base not in CANDIDATES or bits not in ("", "4", "8") or group not in ("", "32", "64", "128"):
        raise SystemExit(f"unknown arm {name!r}: a candidate ({', '.join(CANDIDATES)}), optionally with @q4 or @q8 "
                         f"and a group size (@q4g32)")
    return {**CANDIDATES[base], **({"kv_bits": int(bits), "kv_group_size": int(group or 64)} if bits else {})}


def merged(paths) -> list[dict]:
    """The results files grouped by (model, split, ratio): rows of runs over the same documents
    join (each run measures its own arms; the full cache and no-document rows, which do
    not depend on the arms, are kept once)."""
    groups: dict[tuple, dict] = {}
    for path in paths:
        d = json.loads(Path(path).read_text())
        g = groups.setdefault((d["model"], d["split"], d["ratio"]),
                              {**d, "rows": [], "arms": {}, "docs": [], "fillers": []})
        g["arms"].update(d["arms"])
        g["docs"] += [x for x in d["docs"] if x not in g["docs"]]
        g["fillers"] += [x for x in d["fillers"] if x not in g["fillers"]]
        seen = {(r["task"], r["doc"], r["arm"], r.get("key"), r.get("mode")) for r in g["rows"]}
        g["rows"] += [r for r in d["rows"] if (r["task"], r["doc"], r["arm"], r.get("key"), r.get("mode")) not in seen]
    return list(groups.values())


def report(paths, first: str = "question_rec25") -> str:
    """One markdown table per (model, split): recovered share, paired wins against
    random, pass keys found of the full cache's (in documents, in filler), perplexity
    ratio to the full cache; ``first`` (the default's layout) leads."""
    out = []
    for d in merged(paths):
        arms = sorted(d["arms"], key=lambda a: (a != first, a == "random"))
        table = summarize(d["rows"], ["full", *arms])
        out.append(f"**{d['model']}, {d['split']} split** ({', '.join(d['docs'])}; fillers "
                   f"{', '.join(d['fillers'])}; {d['ratio']:g}x)\n")
        out.append("| layout | fidelity (recovered) | wins vs random | pass keys (of the full cache's) | in documents "
                   "| in filler | ppl vs full |")
        out.append("|---|---|---|---|---|---|---|")
        # a case is (document, key, mode): with --modes ctq,whole each key is asked twice
        def cases(arm, ok=False):
            return {(r["doc"], r["key"], r.get("mode")) for r in d["rows"]
                    if r["task"] == "passkey" and r["arm"] == arm and (r["ok"] or not ok)}

        def in_filler(group, filler):
            return {c for c in group if c[0].startswith("filler:") == filler}

        found, every = cases("full", ok=True), cases("full")
        for arm, v in [(a, table[a]) for a in (*arms, "full")]:
            rec = "-" if v["recovered"] is None else f"{v['recovered']:.1%}"
            ppl = "-" if v["ppl_ratio"] is None else f"{v['ppl_ratio']:.3f}x"
            asked, ok = cases(arm), cases(arm, ok=True)
            keys = (f"{v['full_keys']}/{v['keys_total']}" if arm == "full" else "-" if not v["keys_total"] else
                    f"{len(ok & found)}/{len(asked & found)}")
            wins = f"{v['wins_vs_random']}/{v['fidelity_docs']}" if arm not in ("full", "random") and v["fidelity_docs"] \
                else "-"
            split = []
            for filler in (False, True):
                a, k = in_filler(asked, filler), in_filler(ok, filler)
                split.append(f"{len(k)}/{len(in_filler(every, filler))}" if arm == "full" else
                             f"{len(k & found)}/{len(a & found)}" if a else "-")
            out.append(f"| {arm} | {rec} | {wins} | {keys} | {split[0]} | {split[1]} | {ppl} |")
        out.append("")
    return "\n".join(out)


def reuse_full_rows(tuner, pattern: str, model: str, modes: tuple) -> None:
    """Answer the full cache's pass-key cases from earlier results files of this model
    (``pattern``, a glob) where each mode asked was run there; a reused row whose prompt
    length differs from this run's is an error (not the same case)."""
    import glob

    have: dict[tuple, dict] = {}
    for path in sorted(glob.glob(pattern)):
        d = json.loads(Path(path).read_text())
        if d.get("model") == model:
            have.update({(r["doc"], r["key"], r["depth"], r.get("mode", "ctq")): r for r in d["rows"]
                         if r["task"] == "passkey" and r["arm"] == "full"})
    real = tuner.passkey

    def passkey(name, context, key, depth):
        found = [have.get((name, key, depth, m)) for m in modes]
        if all(found):
            tuner.full_rows["passkey", name, key, depth, len(context), modes] = ([], [dict(r) for r in found])
        rows = real(name, context, key, depth)
        if len({r["tokens"] for r in rows}) > 1:
            raise SystemExit(f"--full-from: {name} {key} was run on a prompt of another length there")
        return rows

    tuner.passkey = passkey


def main(argv=None) -> dict:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--report":
        print(report(sys.argv[2:]))
        return {}
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--split", choices=("tune", "heldout"), default="tune")
    ap.add_argument("--arms", default=",".join(CANDIDATES), help="candidates, comma-separated")
    ap.add_argument("--docs", type=int, default=3, help="documents of the split")
    ap.add_argument("--skip", type=int, default=0, help="leave out the split's first N documents (a fresh set)")
    ap.add_argument("--readmes", default="", help="instead of the split's documents, the READMEs of these installed "
                    "packages, comma-separated (fresh material; the split names the fillers)")
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--key-doc-tokens", type=int, default=1536, help="pass keys: documents cut to this many tokens")
    ap.add_argument("--ratio", type=float, default=4.0)
    ap.add_argument("--tasks", default="fidelity,passkey,ppl")
    ap.add_argument("--depths", default="0.25,0.75")
    ap.add_argument("--filler-depths", default="0.3,0.7")
    ap.add_argument("--modes", default="ctq", help="pass-key modes: ctq (context, then the pinned question), "
                    "whole (one prompt, nothing pinned, the chat template's tokens too), prompt (one prompt as "
                    "generate_with_eviction runs it: the chat template pinned)")
    ap.add_argument("--fidelity-mode", choices=("ctq", "prompt"), default="ctq", help="fidelity: the summary "
                    "question asked after the context (ctq), or written into the prompt after the document, the "
                    "prompt run as generate_with_eviction runs it (prompt)")
    ap.add_argument("--probe-sink", type=int, default=-1, help="the first tokens a prompt's probe runs before "
                    "its document (knorm_gen.question.PROBE_SINK; -1: the product's)")
    add_rule_switches(ap, prompt_probe=True)
    ap.add_argument("--full-from", default="", help="results files (a glob) whose full-cache pass-key rows stand in "
                    "for running the full cache again on the same cases (it does not depend on the arms)")
    ap.add_argument("--mix-from", default="", help="a knorm-tune --out file: its per-layer mix is the arm 'mix'")
    ap.add_argument("--add-to", default="", help="a results file to continue (its finished cases are kept)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    raise SystemExit("choose_default.py measured through knorm_gen.tune's Tuner (separate fidelity, pass-key and "
                     "perplexity passes), removed in 0.13: measure with benchmarks/grid.py (knorm_gen.evaluate); "
                     "--report still reads this script's results files")
    apply_rule_switches(args)
    if args.probe_sink >= 0:
        import knorm_gen.question

        knorm_gen.question.PROBE_SINK = args.probe_sink
    model, tok = load_model(None if args.model == "default" else args.model)
    if args.readmes:
        split = installed_readmes(args.readmes.split(","))
    else:
        all_docs = documents(tok)
        split = all_docs[0::2] if args.split == "tune" else all_docs[1::2]
    docs = [Doc(d.name, head_tokens(tok, d.text, args.doc_tokens)) for d in split[args.skip : args.skip + args.docs]]
    arms = {a: arm_fields(a, args.mix_from) for a in args.arms.split(",") if a}
    out = Path(args.out or RESULTS / f"choose_default-{args.model}-{args.split}.json")
    done = json.loads(Path(args.add_to).read_text())["rows"] if args.add_to else []
    tuner = Tuner(model, tok, arms, ratio=args.ratio, log=lambda m: print(m, file=sys.stderr, flush=True),
                  modes=args.modes.split(","))
    tuner.fidelity_mode = args.fidelity_mode
    if args.full_from:
        reuse_full_rows(tuner, args.full_from, args.model, tuple(args.modes.split(",")))
    meta = dict(model=args.model, split=args.split, docs=[d.name for d in docs], doc_tokens=args.doc_tokens,
                ratio=args.ratio, arms=arms, fillers=SPLIT_FILLERS[args.split])

    def save(rows):
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps({**meta, "rows": rows, "summary": summarize(rows, ["full", *arms])}, indent=1))
        tmp.replace(out)

    tasks = args.tasks.split(",")
    depths = [float(x) for x in args.depths.split(",")]
    rows = run(tuner, docs, tasks=[t for t in tasks if t != "passkey"], done=done, on_rows=save)
    if "passkey" in tasks:
        key_docs = [Doc(d.name, head_tokens(tok, d.text, args.key_doc_tokens)) for d in docs]
        rows = run(tuner, key_docs, tasks=["passkey"], fillers=(), depths=depths, done=rows, on_rows=save)
        rows = run(tuner, [], tasks=["passkey"], fillers=SPLIT_FILLERS[args.split],
                   depths=[float(x) for x in args.filler_depths.split(",")], seed=1, done=rows, on_rows=save)
    save(rows)
    table = summarize(rows, ["full", *arms])
    for arm, v in table.items():
        print(f"{arm:14s} " + " ".join(f"{k}={v[k]:.3f}" if isinstance(v[k], float) else f"{k}={v[k]}"
                                       for k in v))
    return table


if __name__ == "__main__":
    main()
