"""Turn benchmarks/results/*.json into markdown tables (results/summary.md) and PNG plots.

    python benchmarks/report.py [--results-dir benchmarks/results]

Plots need matplotlib (``pip install -e ".[plot]"``); without it only the tables are written.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
ARM_ORDER = ("full", "default", "keydiff_all", "blend_all", "low_all", "random_all", "skip30", "bounded_x8",
             "bounded_x4", "paper", "probe", "keep_high", "random", "streaming", "rotating")
MODE_ORDER = ("ctq", "whole", "ctq_product", "whole_product")
MODELS = (("", "SmolLM2-135M-Instruct (embedded default)"), ("_gemma-3-270m", "Gemma 3 270M (base)"))


def _load(d: Path, name: str):
    p = d / name
    return json.loads(p.read_text()) if p.exists() else None


def _arms(present) -> list[str]:
    return [a for a in ARM_ORDER if a in present] + sorted(set(present) - set(ARM_ORDER))


def speed_table(res: dict) -> str:
    lines = ["| context | arm | prefill tok/s | decode tok/s | prefill vs full | decode vs full | peak GB | KV held MiB |",
             "|---|---|---|---|---|---|---|---|"]
    for ctx in res["contexts"]:
        for arm, r in ctx["arms"].items():
            vs = lambda kind, arm=arm: (f"{ctx['ratios'][f'{arm}_vs_full_{kind}']:.2f}x"  # noqa: E731
                                        if f"{arm}_vs_full_{kind}" in ctx["ratios"] else "")
            lines.append(f"| {ctx['context']} | {arm} | {r['prefill_tps']:.1f} | {r['decode_tps']:.2f} | "
                         f"{vs('prefill')} | {vs('decode')} | {r['peak_memory_gb']:.3f} | "
                         f"{r['kv_kept_bytes'] / 2**20:.1f} |")
    shares = [f"{ctx['context']}: {100 * ctx['ratios']['eviction_share_of_prefill']:.2f}%" for ctx in res["contexts"]
              if "eviction_share_of_prefill" in ctx["ratios"]]
    if shares:
        lines += ["", "Eviction's share of the keep-low prefill (selection timed alone): " + ", ".join(shares) + "."]
    if res.get("default_prefill_vs_shortest"):
        lines += ["", "The default's prefill tokens/s against its rate at the shortest context: "
                  + ", ".join(f"{c} tokens {v:.2f}x" for c, v in res["default_prefill_vs_shortest"].items()) + "."]
    if res.get("rule_cost"):
        lines += ["", "| rule | µs per 512-token block (one layer) | vs low | µs per decode step (one layer) | vs low |",
                  "|---|---|---|---|---|"]
        for keep, c in res["rule_cost"].items():
            lines.append(f"| {keep} | {c['block_us']:.0f} | {c['block_vs_low']:.2f}x | {c['decode_us']:.0f} | "
                         f"{c['decode_vs_low']:.2f}x |")
    return "\n".join(lines)


def runtime_table(res: dict) -> str:
    g = res["matmul_gflops"]
    lines = ["| fp32 matmul | OpenBLAS GFLOP/s | bundled BLAS GFLOP/s | ratio |", "|---|---|---|---|"]
    for n in g["blas"]:
        lines.append(f"| {n}x{n} | {g['blas'][n]:.1f} | {g['no_blas'][n]:.1f} | {g['ratio'][n]:.1f}x |")
    lines += ["", "| weights | prompt | prefill tok/s | decode tok/s |", "|---|---|---|---|"]
    for arm in res["model"]:
        name = "float32" if arm["float32"] else "Q4_1 (quantized)"
        lines.append(f"| {name} | {arm['prompt_tokens']} | {arm['prefill_tok_s']:.1f} | {arm['decode_tok_s']:.1f} |")
    return "\n".join(lines)


def ppl_table(res: dict) -> str:
    summ = res["summary"]
    arms = _arms({r["arm"] for r in summ})
    lines = ["| tokens | budget | full | " + " | ".join(arms) + " |", "|---|---|---|" + "---|" * len(arms)]
    for key in sorted({(r["length"], r["budget"]) for r in summ}):
        cells = {r["arm"]: r for r in summ if (r["length"], r["budget"]) == key}
        full = next(iter(cells.values()))["full_ppl"]
        row = [f"{cells[a]['ppl']:.2f} ({cells[a]['vs_full_pct']:+.0f}%)" if a in cells else "" for a in arms]
        lines.append(f"| {key[0]} | {key[1]} | {full:.2f} | " + " | ".join(row) + " |")
    lines += ["", "Byte compression (all layers):", ""]
    lines += ["| tokens | budget | " + " | ".join(arms) + " |", "|---|---|" + "---|" * len(arms)]
    for key in sorted({(r["length"], r["budget"]) for r in summ}):
        cells = {r["arm"]: r for r in summ if (r["length"], r["budget"]) == key}
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(
            f"{cells[a]['compression']:.2f}x" if a in cells else "" for a in arms) + " |")
    docs = res["docs"]
    lines.append(f"\n{docs} document{'s' if docs != 1 else ''} per length; the table gives the geometric mean.")
    return "\n".join(lines)


def passkey_table(res: dict, default_arm: str = "skip30") -> str:
    summ = res["summary"]
    full = {(r["length"], r["mode"]): r for r in summ if r["arm"] == "full"}
    lengths = sorted({r["length"] for r in summ})
    lines = ["Full cache (the reference): " + "; ".join(
        f"{n} tokens {full[(n, 'ctq')]['correct']}/{full[(n, 'ctq')]['cases']} (ctq), "
        f"{full[(n, 'whole')]['correct']}/{full[(n, 'whole')]['cases']} (whole)"
        for n in lengths if (n, "ctq") in full), ""]
    ratio_rows = [r for r in summ if r["ratio"] is not None]
    if ratio_rows:
        arms = _arms({r["arm"] for r in ratio_rows})
        lines += ["| tokens | ratio | mode | full | " + " | ".join(arms) + " |",
                  "|---|---|---|---|" + "---|" * len(arms)]
        for length, ratio in sorted({(r["length"], r["ratio"]) for r in ratio_rows}):
            for mode in MODE_ORDER:
                cells = {r["arm"]: r for r in ratio_rows if (r["length"], r["ratio"], r["mode"]) == (length, ratio, mode)}
                if not cells:
                    continue
                ref = full.get((length, mode.replace("_product", "")))
                lines.append(f"| {length} | {ratio}x | {mode} | {ref['correct']}/{ref['cases']} | " + " | ".join(
                    f"{cells[a]['correct']}/{cells[a]['cases']}" if a in cells else "" for a in arms) + " |")
        lines += ["", "Byte compression at each ratio (all layers, ctq): " + "; ".join(
            f"{length} tokens {ratio}x: " + ", ".join(
                f"{r['arm']} {r['compression']:.2f}x" for r in sorted(
                    (r for r in ratio_rows if (r["length"], r["ratio"], r["mode"]) == (length, ratio, "ctq")),
                    key=lambda r: _arms([r["arm"]])[0]))
            for length, ratio in sorted({(r["length"], r["ratio"]) for r in ratio_rows}))]
    lines += targets(summ, default_arm)
    fixed = [r for r in summ if r["ratio"] is None and r["arm"] != "full"]
    if fixed:
        arms = _arms({r["arm"] for r in fixed})
        lines += ["", "At a fixed budget:", "",
                  "| tokens | budget | mode | full | " + " | ".join(f"{a} (bytes)" for a in arms) + " |",
                  "|---|---|---|---|" + "---|" * len(arms)]
        for length, budget in sorted({(r["length"], r["budget"]) for r in fixed}):
            for mode in MODE_ORDER:
                cells = {r["arm"]: r for r in fixed if (r["length"], r["budget"], r["mode"]) == (length, budget, mode)}
                if not cells:
                    continue
                ref = full.get((length, mode.replace("_product", "")))
                lines.append(f"| {length} | {budget} | {mode} | {ref['correct']}/{ref['cases']} | " + " | ".join(
                    f"{cells[a]['correct']}/{cells[a]['cases']} ({cells[a]['compression']:.2f}x)" if a in cells else ""
                    for a in arms) + " |")
    return "\n".join(lines)


DEFAULT_ARMS = {"": "keydiff_all", "_gemma-3-270m": "keydiff_all"}  # the arm equal to the library default
AIMS = {4: 0.9, 8: 0.8}  # the default keeps this share of the full cache's hits at 4x and 8x in tokens
STREAMING_AIM = 0.3      # while streaming stays at or below this share


def targets(summ: list, default_arm: str) -> list[str]:
    """The aims checked where the full cache finds at least 8 keys in 10 (ctq and whole)."""
    full = {(r["length"], r["mode"]): r for r in summ if r["arm"] == "full"}
    out = []
    for (length, mode), ref in sorted(full.items()):
        if ref["correct"] < 0.8 * ref["cases"]:
            out.append(f"- {length} tokens, {mode}: the full cache found {ref['correct']}/{ref['cases']}, below 8/10: "
                       "no aim applies")
            continue
        for ratio, aim in AIMS.items():
            cells = {r["arm"]: r for r in summ if (r["length"], r["ratio"], r["mode"]) == (length, ratio, mode)}
            if default_arm not in cells:
                continue
            got = cells[default_arm]["correct"] / ref["correct"]
            stream = cells["streaming"]["correct"] / ref["correct"] if "streaming" in cells else None
            verdict = "met" if got >= aim and (stream is None or stream <= STREAMING_AIM) else "NOT met"
            out.append(f"- {length} tokens, {mode}, {ratio}x: default {got:.2f}x of the full cache's hits (aim "
                       f">= {aim}), streaming " + (f"{stream:.2f}x (aim <= {STREAMING_AIM})" if stream is not None
                                                   else "not run") + f": {verdict}")
    return ["", "Aims (default = " + default_arm + "):", "", *out] if out else []


def summary_table(res: dict) -> str:
    lines = ["| budget | arm | docs | ROUGE-L mean | median | min | max |", "|---|---|---|---|---|---|---|"]
    order = {a: i for i, a in enumerate(ARM_ORDER)}
    for r in sorted(res["summary"], key=lambda r: (r["budget"], order.get(r["arm"], 99))):
        lines.append(f"| {r['budget']} | {r['arm']} | {r['docs']} | {r['mean']:.3f} | {r['median']:.3f} | "
                     f"{r['min']:.3f} | {r['max']:.3f} |")
    return "\n".join(lines)


FIDELITY_ORDER = ("default", "keydiff_all", "blend_all", "low_all", "random_all", "skip30", "paper", "random_same",
                  "recent_all", "rotating")


def fidelity_table(res: dict) -> str:
    """Recovered share per ratio and reference: mean (median), paired wins vs random_same, bytes."""
    summ = res["summary"]
    arms = [a for a in FIDELITY_ORDER if a in {r["arm"] for r in summ}]
    arms += sorted({r["arm"] for r in summ} - set(arms))
    lines = [f"**Pilot run ({len(res['documents'])} documents): checks the set-up; not the results.**", ""] \
        if res.get("pilot") else []
    lines += ["| ratio | reference | docs | NLL full / none | " + " | ".join(arms) + " |",
             "|---|---|---|---|" + "---|" * len(arms)]
    pct = lambda v: "n/a" if v is None else f"{100 * v:.0f}%"  # noqa: E731
    for ratio, ref in sorted({(r["ratio"], r["reference"]) for r in summ}, key=lambda k: (k[0], k[1] != "self")):
        cells = {r["arm"]: r for r in summ if (r["ratio"], r["reference"]) == (ratio, ref)}
        any_cell = next(iter(cells.values()))
        row = []
        for a in arms:
            c = cells.get(a)
            if not c:
                row.append("")
                continue
            if c.get("wins_vs_random_twin") is not None:
                wins = f", {c['wins_vs_random_twin']}/{c['twin_pairs']} vs {c['random_twin']}"
            elif c["wins_vs_random_same"] is not None:
                wins = f", {c['wins_vs_random_same']}/{c['pairs']} vs random_same"
            else:
                wins = ""
            row.append(f"{pct(c['recovered_mean'])} ({pct(c['recovered_median'])}{wins}; {c['compression']:.2f}x)")
        lines.append(f"| {ratio}x | {ref} | {any_cell['docs']} | {any_cell['full_nll']:.3f} / {any_cell['none_nll']:.3f} | "
                     + " | ".join(row) + " |")
    n = len(res["documents"])
    lines += ["", f"Each cell: mean recovered share (median, documents where the arm's NLL is below that of the "
              f"random arm holding the same layers at the same budget, i.e. equal bytes; "
              f"byte compression over all layers). recovered = (nll_none - nll_arm) / (nll_none - nll_full), over the "
              f"documents where the document lowers the NLL. {n} document{'s' if n != 1 else ''}; reference `self`: "
              "the full cache's greedy summary, `human`: the package's own one-line summary."]
    return "\n".join(lines)


def probe_table(res: dict) -> str:
    lines = ["| layer | kind | mean rho | min | max | key-norm CV |", "|---|---|---|---|---|---|"]
    for s in res["layers"]:
        if s["kind"] != "full":
            continue
        lines.append(f"| {s['layer']} | {s['kind']} | {s['rho_mean']:+.3f} | {s['rho_min']:+.2f} | "
                     f"{s['rho_max']:+.2f} | {s['norm_cv']:.3f} |")
    sliding = [s["layer"] for s in res["layers"] if s["kind"] != "full"]
    lines.append("")
    if sliding:
        lines.append(f"Sliding-window layers (not measured, never compressed): {sliding}.")
    lines.append(f"Negative mean correlation in {res['negative_layers']} of {len(res['full_layers'])} full-attention "
                 f"layers; suggested skip_layers (mean rho > {res['threshold']:+.2f}): {res['suggested_skip_layers']}.")
    lines.append(f"Advice: {res['advice']}")
    if res.get("rule_advice"):
        lines.append(f"Rules: {res['rule_advice']}")
    return "\n".join(lines)


def batch_table(res: dict) -> str:
    lines = []
    for w in res["workloads"]:
        lines += [f"**{w['workload']}** ({len(w['prompt_tokens'])} rows, {min(w['prompt_tokens'])}-"
                  f"{max(w['prompt_tokens'])} prompt tokens, up to {w['max_tokens']} new tokens)", "",
                  "| arm | wall s | rows/hour | generated tok/s | peak GB | KV per row, max MiB |",
                  "|---|---|---|---|---|---|"]
        for a in w["arms"]:
            lines.append(f"| {a['arm']} | {a['wall_s']:.1f} | {a['rows_per_hour']:.0f} | {a['tokens_per_s']:.2f} | "
                         f"{a['peak_memory_gb']:.3f} | {a['kv_bytes_max'] / 2**20:.1f} |")
        lines += ["", "; ".join(f"{k.replace('_', ' ')} {v:.2f}" for k, v in w["ratios"].items()), ""]
    return "\n".join(lines)


def distributed_table(res: dict) -> str:
    lines = ["| processes | wall s | rows/hour | generated tok/s | serial s | serial share |", "|---|---|---|---|---|---|"]
    for a in res["arms"]:
        lines.append(f"| {a['processes']} | {a['wall_s']:.1f} | {a['rows_per_hour']:.0f} | "
                     f"{a['generated_tokens_per_s']:.2f} | {a['serial_s']:.1f} | {a['serial_s'] / a['wall_s']:.2f} |")
    lines += ["", f"Speedup 2 vs 1 process: {res['speedup_2_vs_1']:.2f}. Records identical between the two: "
              f"{res['records_equal_default_batch']}/{res['rows']} at the default batch size, "
              f"{'all' if res['records_equal_batch1'] else 'not all'} at --batch-size 1."]
    return "\n".join(lines)


def plots(d: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []
    def grouped_bars(name, title, keys, arms, value, ylabel, labels):
        fig, ax = plt.subplots(figsize=(8, 4))
        width = 0.8 / max(1, len(arms))
        for i, arm in enumerate(arms):
            ax.bar([j + i * width for j in range(len(keys))], [value(k, arm) for k in keys], width, label=arm)
        ax.set_xticks([j + 0.4 for j in range(len(keys))])
        ax.set_xticklabels([labels(k) for k in keys], fontsize=7)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=6, ncol=3)
        fig.tight_layout()
        fig.savefig(d / name, dpi=110)
        made.append(name)

    for suffix, title in MODELS:
        pk = _load(d, f"quality_passkey{suffix}.json")
        if pk:
            rows = [r for r in pk["summary"] if r["ratio"] is not None and r["mode"] == "ctq"]
            full = {r["length"]: r for r in pk["summary"] if r["arm"] == "full" and r["mode"] == "ctq"}

            def accuracy(k, arm, rows=rows, full=full):
                sel = [full[k[0]]] if arm == "full" else [r for r in rows if (r["length"], r["ratio"]) == k
                                                          and r["arm"] == arm]
                return sel[0]["correct"] / sel[0]["cases"] if sel else 0

            grouped_bars(f"passkey{suffix}.png", title, sorted({(r["length"], r["ratio"]) for r in rows}),
                         ["full", *_arms({r["arm"] for r in rows})], accuracy,
                         "passkey accuracy (context then question)", lambda k: f"{k[0]} tok\n{k[1]}x")
        ppl = _load(d, f"quality_ppl{suffix}.json")
        if ppl:
            summ = ppl["summary"]
            grouped_bars(f"ppl{suffix}.png", title, sorted({(r["length"], r["budget"]) for r in summ}),
                         _arms({r["arm"] for r in summ}),
                         lambda k, arm, summ=summ: next((r["vs_full_pct"] for r in summ
                                                         if (r["length"], r["budget"]) == k and r["arm"] == arm), 0),
                         "perplexity vs full cache (%)", lambda k: f"{k[0]} tok\nbudget {k[1]}")
    sp = _load(d, "cache_speed.json")
    if sp:
        fig, ax = plt.subplots(figsize=(6, 4))
        for arm in sp["contexts"][0]["arms"]:
            ax.plot([c["context"] for c in sp["contexts"]], [c["arms"][arm]["decode_tps"] for c in sp["contexts"]],
                    marker="o", label=arm)
        ax.set_xlabel("tokens of context")
        ax.set_ylabel("decode tokens/s")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(d / "speed.png", dpi=110)
        made.append("speed.png")
    bt = _load(d, "batch.json")
    if bt:
        fig, axes = plt.subplots(1, len(bt["workloads"]), figsize=(9, 3.5))
        for ax, w in zip(axes, bt["workloads"]):
            names = [a["arm"] for a in w["arms"]]
            ax.bar(names, [a["tokens_per_s"] for a in w["arms"]],
                   color=["tab:blue" if n.startswith("ours") else "tab:gray" for n in names])
            ax.set_title(w["workload"], fontsize=9)
            ax.set_ylabel("generated tokens/s")
            ax.tick_params(axis="x", labelrotation=45, labelsize=7)
        fig.tight_layout()
        fig.savefig(d / "batch.png", dpi=110)
        made.append("batch.png")
    plt.close("all")
    return made


def three_tasks_table(d: Path, suffix: str) -> str:
    """One row per arm, the default first: summary fidelity (4x, 8x), pass keys (4x, 8x; the longest
    length run; one-block and product modes), perplexity (vs the full cache) and bytes."""
    fid, pk, ppl = (_load(d, f"quality_{t}{suffix}.json") for t in ("fidelity", "passkey", "ppl"))
    if not (fid or pk or ppl):
        return ""
    present = set()
    for res in (fid, pk, ppl):
        present |= {r["arm"] for r in (res or {}).get("summary", [])}
    arms = [a for a in _arms(present - {"full", "none"})]
    fcell = {}
    for r in (fid or {}).get("summary", []):
        if r["reference"] == "self":
            fcell[(r["arm"], r["ratio"])] = r
    length = max((r["length"] for r in (pk or {}).get("summary", []) if r["arm"] == "full"), default=None)
    pcell = {(r["arm"], r["ratio"], r["mode"]): r for r in (pk or {}).get("summary", []) if r["length"] == length}
    qlen = max((r["length"] for r in (ppl or {}).get("summary", [])), default=None)
    qcell = {r["arm"]: r for r in (ppl or {}).get("summary", []) if r["length"] == qlen}
    qbudget = next(iter(qcell.values()))["budget"] if qcell else None

    def fid_text(arm, ratio):
        c = fcell.get((arm, ratio))
        if not c or c["recovered_mean"] is None:
            return ""
        wins = f", {c['wins_vs_random_twin']}/{c['twin_pairs']}" if c.get("wins_vs_random_twin") is not None else ""
        return f"{100 * c['recovered_mean']:.0f}%{wins} ({c['compression']:.2f}x)"

    def pk_text(arm, ratio):
        out = []
        for mode in MODE_ORDER:
            c = pcell.get((arm, ratio, mode))
            if c:
                out.append(f"{c['correct']}/{c['cases']}" + ("p" if mode.endswith("product") else ""))
        return " ".join(out)

    full_pk = " ".join(f"{pcell[('full', None, m)]['correct']}/{pcell[('full', None, m)]['cases']}"
                       for m in ("ctq", "whole") if ("full", None, m) in pcell)
    lines = ["| arm | fidelity 4x (wins vs random twin; bytes) | fidelity 8x | "
             f"pass keys 4x at {length} (ctq whole, p = product) | pass keys 8x | "
             + (f"perplexity at {qlen}, budget {qbudget} |" if qlen else "perplexity (not run) |"),
             "|---|---|---|---|---|---|"]
    if full_pk or qcell:
        lines.append(f"| full | 100% | 100% | {full_pk} | {full_pk} | "
                     f"{next(iter(qcell.values()))['full_ppl']:.2f} |" if qcell else f"| full | 100% | 100% | {full_pk} | {full_pk} | |")
    for arm in arms:
        q = qcell.get(arm)
        qt = f"{q['ppl']:.2f} ({q['vs_full_pct']:+.0f}%, {q['compression']:.2f}x)" if q else ""
        lines.append(f"| {arm} | {fid_text(arm, 4)} | {fid_text(arm, 8)} | {pk_text(arm, 4)} | {pk_text(arm, 8)} | "
                     f"{qt} |")
    n_docs = len((fid or {}).get("documents", []))
    lines += ["", f"Fidelity: mean recovered share over {n_docs} documents (reference: the full cache's greedy "
              "summary); wins: documents where the arm's NLL is below its random twin's (the random arm with the "
              "same layers at the same budget, so equal bytes). Pass keys: hits of ctq (context compressed, "
              "question kept), whole (everything under eviction), and with p the same through the library's own "
              "512-token block prefill."]
    return "\n".join(lines)


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results-dir", default=str(RESULTS))
    d = Path(ap.parse_args(argv).results_dir)
    parts = []
    sections = [("Speed and memory", "cache_speed.json", speed_table),
                ("Speed and memory, Gemma 3 270M", "cache_speed_gemma-3-270m.json", speed_table),
                ("Batched generation", "batch.json", batch_table),
                ("More than one process", "distributed.json", distributed_table),
                ("Runtime (BLAS and float32)", "runtime.json", runtime_table)]
    for suffix, title in MODELS:
        table = three_tasks_table(d, suffix)
        if table:
            parts.append(f"### The three tasks, {title}\n\n{table}\n")
    for suffix, title in MODELS:
        sections += [(f"Perplexity (generation mode), {title}", f"quality_ppl{suffix}.json", ppl_table),
                     (f"Passkey retrieval, {title}", f"quality_passkey{suffix}.json",
                      lambda res, arm=DEFAULT_ARMS[suffix]: passkey_table(res, arm)),
                     (f"Summaries (ROUGE-L vs the full-cache summary), {title}", f"quality_summary{suffix}.json",
                      summary_table),
                     (f"Summary fidelity (recovered share of the reference's NLL), {title}",
                      f"quality_fidelity{suffix}.json", fidelity_table),
                     (f"Key norm vs attention (knorm-probe), {title}", f"probe{suffix}.json", probe_table)]
    for title, name, fn in sections:
        res = _load(d, name)
        if res:
            parts.append(f"### {title}\n\n{fn(res)}\n")
    made = plots(d)
    if made:
        parts.append("Plots: " + ", ".join(made))
    text = "\n".join(parts)
    (d / "summary.md").write_text(text + "\n")
    print(text)
    return text


if __name__ == "__main__":
    main()
