"""The tables of docs/results.md and the plot in README, from the results files the
benchmarks wrote (nothing is measured here).

    python benchmarks/page.py                 # prints every table; writes docs/results.png

Reads ``benchmarks/results/grid-*.json`` (benchmarks/grid.py), ``coverage-*.json``
(benchmarks/coverage.py) and ``cost.json`` (benchmarks/cost.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from knorm_gen.evaluate import recovered_by_doc, summarize  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = {"smollm2": "SmolLM2-135M-Instruct (the embedded model)", "gemma3": "Gemma 3 270M (base)"}
NAMES = {"full": "full cache", "default": "**default**", "random": "random eviction", "paper": "`--preset paper` (L2Norm)",
         "low": "keep-low, every layer", "no_carry": "default, `carry=0`", "spread25": "default, `spread=0.25`",
         "spread50": "default, `spread=0.5`"}


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def rows_at(result: dict, ratio: float) -> list[dict]:
    return [r for r in result["rows"] if r["ratio"] == ratio]


def kv_mib(rows: list[dict], arm: str) -> str:
    kept = [r["kept_bytes"] for r in rows if r["task"] == "fidelity" and r["arm"] == arm and "kept_bytes" in r]
    full = [r["full_bytes"] for r in rows if r["task"] == "fidelity" and r["arm"] == arm and "full_bytes" in r]
    if arm == "full":
        kept = [r["full_bytes"] for r in rows if r["task"] == "fidelity" and "full_bytes" in r]
    return f"{np.mean(kept) / 2**20:.1f}" if kept else "-"


def interval(t: dict) -> str:
    if t.get("vs_random") is None:
        return "-"
    ci = t["vs_random_interval"]
    return f"{100 * t['vs_random']:+.1f} ({100 * ci[0]:+.1f}, {100 * ci[1]:+.1f})" if ci else f"{100 * t['vs_random']:+.1f}"


def compression_table(model: str) -> str:
    """Per compression: summary kept, its difference to random, facts found, perplexity and KV per row."""
    parts = [load(f"grid-{model}-2k-ratios.json"), load(f"grid-{model}-2k-candidates.json")]
    lines = ["| compression | layout | summary kept | vs random, points (95% interval) | facts found | perplexity | "
             "KV per row, MiB |", "|---|---|---|---|---|---|---|"]
    for ratio in (2.0, 4.0, 8.0, 16.0):
        result = next(p for p in parts if ratio in p["meta"]["ratios"])
        rows = rows_at(result, ratio)
        table = summarize(rows, ["full", "default", "random", "paper"])
        for arm in ("default", "random", "paper"):
            t = table[arm]
            lines.append(f"| {ratio:g}x | {NAMES[arm]} | {_pct(t['recovered'])} | {interval(t) if arm != 'random' else '-'}"
                         f" | {t['keys_of_full']}/{t['full_keys']} | {t['ppl_ratio']:.3f}x | {kv_mib(rows, arm)} |")
    full = rows_at(parts[1], 4.0)
    lines.append(f"| 1x | full cache | 100% | - | (all) | 1.000x | {kv_mib(full, 'full')} |")
    return "\n".join(lines)


def candidates_table(model: str) -> str:
    result = load(f"grid-{model}-2k-candidates.json")
    arms = list(result["meta"]["arms"])
    table = summarize(rows_at(result, 4.0), ["full", *arms])
    lines = ["| layout | summary kept | vs random, points (95% interval) | human summary kept | facts found | perplexity |",
             "|---|---|---|---|---|---|"]
    for arm in arms:
        t = table[arm]
        lines.append(f"| {NAMES.get(arm, arm)} | {_pct(t['recovered'])} | {interval(t)} | "
                     f"{_pct(t['recovered_human'])} ({t['human_docs']} docs) | {t['keys_of_full']}/{t['full_keys']} | "
                     f"{t['ppl_ratio']:.3f}x |")
    return "\n".join(lines)


def length_table(model: str, lengths: list[tuple[str, str]]) -> str:
    lines = ["| document tokens | documents | default kept | random kept | default vs random, points (95% interval) | "
             "facts found |", "|---|---|---|---|---|---|"]
    for label, name in lengths:
        path = RESULTS / name
        if not path.exists():
            lines.append(f"| {label} | not measured | | | | |")
            continue
        result = json.loads(path.read_text())
        table = summarize(rows_at(result, 4.0), ["full", "default", "random"])
        t, r = table["default"], table["random"]
        lines.append(f"| {label} | {t['fidelity_docs']} | {_pct(t['recovered'])} | {_pct(r['recovered'])} | "
                     f"{interval(t)} | {t['keys_of_full']}/{t['full_keys']} |")
    return "\n".join(lines)


def coverage_table(model: str) -> str:
    path = RESULTS / f"coverage-{model}.json"
    if not path.exists():
        return "(not measured)"
    rows = json.loads(path.read_text())["rows"]
    lines = ["| layout | kept per head | head union | head overlap | layer overlap | model union |",
             "|---|---|---|---|---|---|"]
    for arm in dict.fromkeys(r["arm"] for r in rows):
        mine = [r for r in rows if r["arm"] == arm]
        cells = [np.mean([r[k] for r in mine if r[k] is not None]) for k in
                 ("kept_per_head", "head_union", "head_overlap", "layer_overlap", "model_union")]
        lines.append(f"| {NAMES.get(arm, arm)} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    return "\n".join(lines)


def plot(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    for col, model in enumerate(MODELS):
        parts = [load(f"grid-{model}-2k-ratios.json"), load(f"grid-{model}-2k-candidates.json")]
        for arm, style in (("default", "o-"), ("random", "s--"), ("paper", "^:")):
            xs, fid, keys = [], [], []
            for ratio in (2.0, 4.0, 8.0, 16.0):
                result = next(p for p in parts if ratio in p["meta"]["ratios"])
                t = summarize(rows_at(result, ratio), ["full", arm])[arm]
                xs.append(ratio)
                fid.append(100 * (t["recovered"] or 0))
                keys.append(100 * t["keys_of_full"] / max(t["full_keys"], 1))
            axes[0, col].plot(xs, fid, style, label=NAMES[arm].strip("*`"))
            axes[1, col].plot(xs, keys, style, label=NAMES[arm].strip("*`"))
        for row in (0, 1):
            axes[row, col].axhline(100, color="grey", lw=0.8, label="full cache")
            axes[row, col].set_xscale("log", base=2)
            axes[row, col].set_xticks([2, 4, 8, 16], ["2x", "4x", "8x", "16x"])
        axes[0, col].set_title(MODELS[model])
        axes[0, col].set_ylabel("summary kept, % of the full cache's gain")
        axes[1, col].set_ylabel("pass keys found, % of the full cache's")
        axes[1, col].set_xlabel("compression (document tokens per kept token)")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle("2,048-token documents, 12 per model (held out of each other); benchmarks/grid.py")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plot", default=str(Path(__file__).resolve().parent.parent / "docs" / "results.png"))
    args = ap.parse_args(argv)
    for model in MODELS:
        for title, make in (("compressions", compression_table), ("candidates", candidates_table),
                            ("coverage", coverage_table)):
            print(f"\n### {model}: {title}\n")
            try:
                print(make(model))
            except (FileNotFoundError, StopIteration) as e:
                print(f"(missing: {e})")
    lengths = {"smollm2": [("1,024", "grid-smollm2-1k.json"), ("2,048", "grid-smollm2-2k-candidates.json"),
                           ("4,096", "grid-smollm2-4k.json"), ("7,600", "grid-smollm2-7600.json")],
               "gemma3": [("1,024", "grid-gemma3-1k.json"), ("2,048", "grid-gemma3-2k-candidates.json"),
                          ("4,096", "grid-gemma3-4k.json"), ("8,192", "grid-gemma3-8k.json")]}
    for model, names in lengths.items():
        print(f"\n### {model}: lengths at 4x\n")
        print(length_table(model, names))
    try:
        plot(Path(args.plot))
        print(f"\nwrote {args.plot}")
    except (FileNotFoundError, StopIteration) as e:
        print(f"\nno plot yet (missing: {e})")


if __name__ == "__main__":
    main()
