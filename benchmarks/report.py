"""Turn benchmarks/results/*.json into markdown tables (results/summary.md) and PNG plots.

    python benchmarks/report.py [--results-dir benchmarks/results]

Plots need matplotlib (``pip install -e ".[plot]"``); without it only the tables are written.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
ARM_ORDER = ("full", "l2norm", "l2norm_r0", "l2norm_deep", "keep_high", "random", "streaming", "rotating",
             "l2norm_blocked")


def _load(d: Path, name: str):
    p = d / name
    return json.loads(p.read_text()) if p.exists() else None


def _arms(present) -> list[str]:
    return [a for a in ARM_ORDER if a in present] + sorted(set(present) - set(ARM_ORDER))


def speed_table(res: dict) -> str:
    lines = ["| context | arm | prefill tok/s | decode tok/s | peak GB | KV held MiB |", "|---|---|---|---|---|---|"]
    for ctx in res["contexts"]:
        for arm, r in ctx["arms"].items():
            lines.append(f"| {ctx['context']} | {arm} | {r['prefill_tps']:.1f} | {r['decode_tps']:.2f} | "
                         f"{r['peak_memory_gb']:.3f} | {r['kv_kept_bytes'] / 2**20:.1f} |")
    lines += ["", "| context | decode l2norm / rotating | decode l2norm / full | decode l2norm_default / full | "
              "eviction share of prefill |", "|---|---|---|---|---|"]
    for ctx in res["contexts"]:
        r = ctx["ratios"]
        lines.append(f"| {ctx['context']} | {r['l2norm_vs_rotating_decode']:.2f} | {r['l2norm_vs_full_decode']:.2f} | "
                     f"{r['l2norm_default_vs_full_decode']:.2f} | {100 * r['eviction_share_of_prefill']:.2f}% |")
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
    ratios = {}
    for r in summ:
        ratios.setdefault((r["length"], r["budget"]), {})[r["arm"]] = r["compression"]
    lines += ["", "Byte compression ratio (all layers) per arm: " + "; ".join(
        f"{k[0]} tokens, budget {k[1]}: " + ", ".join(f"{a} {v:.2f}x" for a, v in sorted(d.items()))
        for k, d in sorted(ratios.items()))]
    return "\n".join(lines)


def passkey_table(res: dict) -> str:
    summ = res["summary"]
    arms = _arms({r["arm"] for r in summ})
    lines = ["| tokens | ratio | mode | " + " | ".join(arms) + " |", "|---|---|---|" + "---|" * len(arms)]
    for key in sorted({(r["length"], r["ratio"], r["mode"]) for r in summ}):
        cells = {r["arm"]: r for r in summ if (r["length"], r["ratio"], r["mode"]) == key}
        row = [f"{cells[a]['correct']}/{cells[a]['cases']}" if a in cells else "" for a in arms]
        lines.append(f"| {key[0]} | {key[1]}x | {key[2]} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def summary_table(res: dict) -> str:
    lines = ["| budget | arm | docs | ROUGE-L mean | median | min | max |", "|---|---|---|---|---|---|---|"]
    for r in sorted(res["summary"], key=lambda r: (r["budget"], ARM_ORDER.index(r["arm"]) if r["arm"] in ARM_ORDER else 99)):
        lines.append(f"| {r['budget']} | {r['arm']} | {r['docs']} | {r['mean']:.3f} | {r['median']:.3f} | "
                     f"{r['min']:.3f} | {r['max']:.3f} |")
    return "\n".join(lines)


def probe_table(res: dict) -> str:
    lines = ["| layer | mean rho | min | max |", "|---|---|---|---|"]
    for s in res["layers"]:
        lines.append(f"| {s['layer']} | {s['rho_mean']:+.3f} | {s['rho_min']:+.2f} | {s['rho_max']:+.2f} |")
    lines.append("")
    lines.append(f"Negative mean correlation in {res['negative_layers']} of {len(res['layers'])} layers; "
                 f"suggested skip_layers (mean rho > {res['threshold']:+.2f}): {res['suggested_skip_layers']}")
    return "\n".join(lines)


def plots(d: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []
    ppl = _load(d, "quality_ppl.json")
    if ppl:
        fig, ax = plt.subplots(figsize=(6, 4))
        length = min(r["length"] for r in ppl["summary"])
        for arm in _arms({r["arm"] for r in ppl["summary"]}):
            pts = sorted((r["budget"], r["vs_full_pct"]) for r in ppl["summary"] if r["arm"] == arm and r["length"] == length)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=arm)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget (tokens per compressed layer)")
        ax.set_ylabel("perplexity vs full cache (%)")
        ax.set_title(f"Generation-mode perplexity, {length} tokens")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(d / "ppl.png", dpi=110)
        made.append("ppl.png")
    pk = _load(d, "quality_passkey.json")
    if pk:
        fig, ax = plt.subplots(figsize=(7, 4))
        keys = sorted({(r["length"], r["ratio"]) for r in pk["summary"] if r["mode"] == "ctq"})
        arms = _arms({r["arm"] for r in pk["summary"] if r["mode"] == "ctq"})
        width = 0.8 / max(1, len(arms))
        for i, arm in enumerate(arms):
            vals = []
            for k in keys:
                sel = [r for r in pk["summary"] if (r["length"], r["ratio"]) == k and r["arm"] == arm and r["mode"] == "ctq"]
                vals.append(sel[0]["correct"] / sel[0]["cases"] if sel else 0)
            ax.bar([j + i * width for j in range(len(keys))], vals, width, label=arm)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(keys))])
        ax.set_xticklabels([f"{k[0]} tok\n{k[1]}x" for k in keys], fontsize=7)
        ax.set_ylabel("passkey accuracy (context then question)")
        ax.legend(fontsize=6, ncol=2)
        fig.tight_layout()
        fig.savefig(d / "passkey.png", dpi=110)
        made.append("passkey.png")
    sm = _load(d, "quality_summary.json")
    if sm:
        fig, ax = plt.subplots(figsize=(7, 4))
        arms = [a for a in _arms({r["arm"] for r in sm["rows"]}) if a != "full"]
        ax.boxplot([[r["rouge_l"] for r in sm["rows"] if r["arm"] == a] for a in arms])
        ax.set_xticks(range(1, len(arms) + 1))
        ax.set_xticklabels(arms, rotation=30, fontsize=7)
        ax.set_ylabel("ROUGE-L vs full-cache summary")
        fig.tight_layout()
        fig.savefig(d / "summaries.png", dpi=110)
        made.append("summaries.png")
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
    plt.close("all")
    return made


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results-dir", default=str(RESULTS))
    d = Path(ap.parse_args(argv).results_dir)
    parts = []
    for title, name, fn in (
        ("Speed and memory", "cache_speed.json", speed_table),
        ("Runtime (BLAS and float32)", "runtime.json", runtime_table),
        ("Perplexity (generation mode)", "quality_ppl.json", ppl_table),
        ("Passkey retrieval", "quality_passkey.json", passkey_table),
        ("Summaries (ROUGE-L vs the full-cache summary)", "quality_summary.json", summary_table),
        ("Key norm vs attention (knorm-probe)", "probe.json", probe_table),
    ):
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
