"""The tables of docs/results.md and README, and the plot docs/results.png, from the results files the
benchmarks wrote (nothing is measured here).

    python benchmarks/page.py                 # rewrites the tables of docs/results.md and README, and docs/results.png
    python benchmarks/page.py --check         # exit 1 when a table is stale

Reads ``benchmarks/results/grid-*.json`` (benchmarks/grid.py), ``coverage-*.json``
(benchmarks/coverage.py), ``cost.json`` (benchmarks/cost.py) and
``chunk-vs-truncate-smollm2.json`` (benchmarks/chunk_vs_truncate.py). Each table lies between
``<!-- page:NAME -->`` and ``<!-- /page -->`` in docs/results.md, each with the command lines
that wrote its files (from the files themselves); the text around them is the page's own.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from knorm_gen.tuning.evaluate import recovered_by_doc, summarize  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PAGE = Path(__file__).resolve().parent.parent / "docs" / "results.md"
README = PAGE.parent.parent / "README.md"  # its results tables are the page's, by the same region names
REGION = re.compile(r"(<!-- page:([\w-]+) -->\n)(.*?)(<!-- /page -->)", re.S)
MODELS = {"smollm2": "SmolLM2-135M-Instruct (the embedded model)", "gemma3": "Gemma 3 270M (base)"}
NAMES = {"full": "full cache", "default": "**default**", "random": "random eviction", "paper": "`--preset paper` (L2Norm)",
         "low": "keep-low, every layer", "no_carry": "default, `carry=0`", "spread25": "default, `spread=0.25`",
         "spread50": "default, `spread=0.5`", "spread70": "default, `spread=0.7`",
         "spread75": "default, `carry=0, spread=0.75`", "spread90": "default, `carry=0, spread=0.9`",
         "stratify50": "default of 0.14, `stratify=0.5`",
         "unstratified": "default of 0.13 (`stratify=0`)",
         "recent": "sliding window (`keep=recent`)"}


def default_arm(rows: list[dict]) -> str:
    """``default`` where today's default was measured, else ``unstratified`` (the default of 0.13
    and 0.14, which the older files measured)."""
    return "default" if any(r["arm"] == "default" for r in rows) else "unstratified"


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def rows_at(result: dict, ratio: float) -> list[dict]:
    return [r for r in result["rows"] if r["ratio"] == ratio]


def kv_bytes(rows: list[dict], arm: str) -> float | None:
    """The mean KV bytes a row of ``arm`` held over every layer. The full arm's is the model's own
    cache, as mlx_lm's ``make_prompt_cache`` holds it (a sliding-window layer at its window; the
    ``full_bytes`` of results files measured before it meant the model's own cache count such layers at
    full length, so it is not read here)."""
    kept = [r["kept_bytes"] for r in rows if r["task"] == "fidelity" and r["arm"] == arm and "kept_bytes" in r]
    return float(np.mean(kept)) if kept else None


def kv_mib(rows: list[dict], arm: str, own: float | None = None) -> str:
    """``arm``'s KV per row in MiB, with the saving against the model's own cache ``own``."""
    kept = kv_bytes(rows, arm)
    if kept is None:
        return "-"
    return f"{kept / 2**20:.1f}" + (f" ({own / kept:.2f}x)" if own and arm != "full" else "")


def interval(t: dict) -> str:
    if t.get("vs_random") is None:
        return "-"
    ci = t["vs_random_interval"]
    return f"{100 * t['vs_random']:+.1f} ({100 * ci[0]:+.1f}, {100 * ci[1]:+.1f})" if ci else f"{100 * t['vs_random']:+.1f}"


def command(*names: str) -> str:
    """The command lines that wrote the results files ``names``, as a fenced block."""
    lines = []
    for name in names:
        meta = load(name)["meta"]
        script = {"grid": "grid.py", "coverage": "coverage.py"}.get(name.split("-")[0], "")
        argv = meta.get("argv")
        if argv is None:  # coverage.py's meta is its parsed arguments
            argv = [a for k, v in meta.items() if v is not None for a in (f"--{k.replace('_', '-')}", f"{v:g}"
                                                                          if isinstance(v, float) else str(v))]
        lines.append(meta["command"] if "command" in meta else
                     "python benchmarks/" + script + " " + shlex.join(argv))
    return "```bash\n" + "\n".join(lines) + "\n```"


def ratio_files(model: str) -> list[str]:
    """The 2k grids of ``model``: the candidates at 4x first, then every file of other ratios."""
    names = [f"grid-{model}-2k-candidates.json"] + sorted(p.name for p in RESULTS.glob(f"grid-{model}-2k-ratios*.json"))
    return [n for n in names if (RESULTS / n).exists()]


def compression_table(model: str) -> str:
    """Per compression: summary kept, its difference to random, facts found, perplexity and KV per row."""
    names = ratio_files(model)
    parts = [load(n) for n in names]
    lines = ["| compression | layout | summary kept | vs random, points (95% interval) | facts found | perplexity | "
             "KV per row, MiB (saving against the model's own cache) |", "|---|---|---|---|---|---|---|"]
    own = kv_bytes(rows_at(parts[0], 4.0), "full")
    for ratio in sorted({float(r) for p in parts for r in p["meta"]["ratios"]}):
        rows = [r for p in parts for r in rows_at(p, ratio)]
        arms = [a for a in ("default", "unstratified", "random", "paper") if any(r["arm"] == a for r in rows)]
        table = summarize(rows, ["full", *arms])
        for arm in arms:
            t = table[arm]
            lines.append(f"| {ratio:g}x | {NAMES[arm]} | {_pct(t['recovered'])} | {interval(t) if arm != 'random' else '-'}"
                         f" | {t['keys_of_full']}/{t['full_keys']} | {t['ppl_ratio']:.3f}x | {kv_mib(rows, arm, own)} |")
    full = rows_at(parts[0], 4.0)
    lines.append(f"| 1x | full cache: the model's own (mlx_lm's) | 100% | - | (all) | 1.000x | {kv_mib(full, 'full')} |")
    return "\n".join(lines) + "\n\n" + command(*names)


def compact_table(model: str) -> str:
    """README's table: per compression, the default against random eviction (summary kept, the
    difference with its interval, facts found) and the KV per row with its saving against the
    model's own cache; docs/results.md has every arm and the commands."""
    parts = [load(n) for n in ratio_files(model)]
    own = kv_bytes(rows_at(parts[0], 4.0), "full")
    lines = ["| ratio | summary kept (random) | vs random, points (95% interval) | facts found (random) | "
             "KV per row, MiB (saving) |", "|---|---|---|---|---|"]
    for ratio in sorted({float(r) for p in parts for r in p["meta"]["ratios"]}):
        rows = [r for p in parts for r in rows_at(p, ratio)]
        arm = default_arm(rows)
        table = summarize(rows, ["full", arm, "random"])
        t, r = table[arm], table["random"]
        label = f"{ratio:g}x" + ("" if arm == "default" else " (the default of 0.13)")
        lines.append(f"| {label} | {_pct(t['recovered'])} ({_pct(r['recovered'])}) | {interval(t)} | "
                     f"{t['keys_of_full']}/{t['full_keys']} ({r['keys_of_full']}/{r['full_keys']}) | "
                     f"{kv_mib(rows, arm, own)} |")
    lines.append(f"| 1x, the model's own cache | 100% | - | (all) | {kv_mib(rows_at(parts[0], 4.0), 'full')} |")
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
    return "\n".join(lines) + "\n\n" + command(f"grid-{model}-2k-candidates.json")


PAPER_MODELS = {"smollm2": "SmolLM2-135M-Instruct (llama)", "gemma3": "Gemma 3 270M (gemma3)",
                "qwen2": "Qwen2.5-Coder 0.5B Instruct (qwen2, benchmark only)"}


def papers_table() -> str:
    """Per model, on held-out papers: each layout's share of the authors' abstract kept (the
    reader's measure, first) and of the full cache's own summary, each paired to random
    eviction with its interval, the abstract paired to the sliding window, pass keys and
    perplexity."""
    lines = ["| model | layout | abstract kept | vs random, points (95% interval) | vs sliding window | "
             "own summary kept | vs random | facts found | perplexity |", "|---|---|---|---|---|---|---|---|---|"]
    names = [f"grid-{m}-papers-2k.json" for m in PAPER_MODELS if (RESULTS / f"grid-{m}-papers-2k.json").exists()]
    for name in names:
        result = load(name)
        rows = rows_at(result, 4.0)
        arms = list(result["meta"]["arms"])
        human = summarize(rows, ["full", *arms], "fidelity_human")
        own = summarize(rows, ["full", *arms])
        window = recovered_by_doc(rows, "recent", "fidelity_human")
        model = PAPER_MODELS[name.split("-")[1]] + f", {human['full']['human_docs']} papers"
        for arm in arms:
            h, o = human[arm], own[arm]
            mine = recovered_by_doc(rows, arm, "fidelity_human")
            diffs = [100 * (mine[d] - window[d]) for d in mine if d in window]
            vs_window = "-" if arm == "recent" or not diffs else f"{np.mean(diffs):+.1f}"
            lines.append(f"| {model} | {NAMES.get(arm, arm)} | {_pct(h['recovered'])} | "
                         f"{interval(h) if arm != 'random' else '-'} | {vs_window} | {_pct(o['recovered'])} | "
                         f"{interval(o) if arm != 'random' else '-'} | {h['keys_of_full']}/{h['full_keys']} | "
                         f"{h['ppl_ratio']:.3f}x |")
            model = ""
    return "\n".join(lines) + "\n\n" + command(*names)


def readme_papers_table() -> str:
    """README's table of the held-out papers: per model, the default's share of the authors' abstract
    kept, against random eviction (with its interval) and the sliding window, and the pass keys."""
    lines = ["| model | papers | abstract kept: default (random, window) | default vs random, points (95% interval) | "
             "facts found: default (random) |", "|---|---|---|---|---|"]
    for m, label in PAPER_MODELS.items():
        if not (RESULTS / f"grid-{m}-papers-2k.json").exists():
            continue
        rows = rows_at(load(f"grid-{m}-papers-2k.json"), 4.0)
        human = summarize(rows, ["full", "default", "random", "recent"], "fidelity_human")
        d, r, w = human["default"], human["random"], human["recent"]
        lines.append(f"| {label} | {d['human_docs']} | {_pct(d['recovered'])} ({_pct(r['recovered'])}, "
                     f"{_pct(w['recovered'])}) | {interval(d)} | {d['keys_of_full']}/{d['full_keys']} "
                     f"({r['keys_of_full']}/{r['full_keys']}) |")
    return "\n".join(lines)


LENGTHS = {"smollm2": [("1,024", "grid-smollm2-1k.json"), ("2,048", "grid-smollm2-2k-candidates.json"),
                       ("4,096", "grid-smollm2-4k.json"), ("7,600", "grid-smollm2-7600.json")],
           "gemma3": [("1,024", "grid-gemma3-1k.json"), ("2,048", "grid-gemma3-2k-candidates.json"),
                      ("4,096", "grid-gemma3-4k.json"), ("8,192", "grid-gemma3-8k.json")]}


def length_table(model: str) -> str:
    """The default at 4x on documents of each length: summary kept, against random, facts found."""
    lines = ["| document tokens | documents | default kept | random kept | default vs random, points (95% interval) | "
             "facts found |", "|---|---|---|---|---|---|"]
    names = []
    for label, name in LENGTHS[model]:
        path = RESULTS / name
        if not path.exists():
            lines.append(f"| {label} | not measured | | | | |")
            continue
        names.append(name)
        result = json.loads(path.read_text())
        arm = default_arm(rows_at(result, 4.0))
        table = summarize(rows_at(result, 4.0), ["full", arm, "random"])
        t, r = table[arm], table["random"]
        label += "" if arm == "default" else " (the default of 0.13)"
        lines.append(f"| {label} | {t['fidelity_docs']} | {_pct(t['recovered'])} | {_pct(r['recovered'])} | "
                     f"{interval(t)} | {t['keys_of_full']}/{t['full_keys']} |")
    return "\n".join(lines) + ("\n\n" + command(*names) if names else "")


def coverage_table(model: str) -> str:
    path = RESULTS / f"coverage-{model}.json"
    if not path.exists():
        return "(not measured)"
    rows = json.loads(path.read_text())["rows"]
    lines = ["| layout | kept per head | head union | head overlap | layer overlap | model union |",
             "|---|---|---|---|---|---|"]
    for arm in dict.fromkeys(r["arm"] for r in rows):
        mine = [r for r in rows if r["arm"] == arm]
        cells = [[r[k] for r in mine if r[k] is not None and r[k] == r[k]] for k in
                 ("kept_per_head", "head_union", "head_overlap", "layer_overlap", "model_union")]
        # one KV head per layer (Gemma 3 270M) has no overlap between heads
        lines.append(f"| {NAMES.get(arm, arm)} | " + " | ".join(f"{np.mean(c):.2f}" if c else "-" for c in cells) + " |")
    return "\n".join(lines) + "\n\n" + command(f"coverage-{model}.json")


def chunk_table() -> str:
    """--long-documents chunk against truncate on documents beyond the context."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from chunk_vs_truncate import report

    name = "chunk-vs-truncate-smollm2.json"
    if not (RESULTS / name).exists():
        return "(not measured)"
    return report(load(name)) + "\n\n" + command(name)


JOB_FILE = "cost-job.json"  # the whole job measured alone
JOB_COMMAND = f"python benchmarks/cost.py --skip-prefill --skip-together --out benchmarks/results/{JOB_FILE}"


def cost_tables() -> str:
    """What the default costs: prefill and decode per arm, prefill together or alone, the whole
    job against mlx_lm, and the aims (benchmarks/cost.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cost import aims, aims_table, job_table, prefill_table, together_table

    result = load("cost.json")
    where = result["machine"]
    parts = [f"Measured {result['date'][:10]} on {where.get('cpu_model') or 'this machine'} ({where.get('cores')} "
             f"cores, mlx {where['runtime'].get('mlx')} with {where['runtime'].get('blas')}, float32 weights "
             f"{result['weights_gb']:.2f} GB).",
             "**Prefill and decode, one row** (each eviction arm keeps a quarter of the document):",
             prefill_table(result["prefill"])]
    if result.get("together"):
        parts += ["**Probed rows prefilled together or alone** (8 rows, through the batch engine):",
                  together_table(result["together"])]
    job, commands = result, ["python benchmarks/cost.py" + (" --quick" if result.get("quick") else "")]
    if not result.get("job") and (RESULTS / JOB_FILE).exists():
        job = load(JOB_FILE)
        commands.append(JOB_COMMAND)
    if job.get("job"):
        when = "" if job is result else (f", measured {job['date'][:10]} in a run of its own on "
                                         f"{job['machine'].get('cpu_model') or 'this machine'}")
        parts += [f"**The whole job** (`knorm-batch`'s runner against mlx_lm's `batch_generate`{when}):",
                  job_table(job["job"])]
    else:
        parts.append("**The whole job** (`knorm-batch`'s runner against mlx_lm's `batch_generate`): not measured.")
        commands.append(JOB_COMMAND)
    measured = aims({**result, "job": job.get("job")}, {})
    if measured:
        parts += ["**The aims**, as ratios of the numbers above:", aims_table(measured)]
    parts.append("```bash\n" + "\n".join(commands) + "\n```")
    return "\n\n".join(parts)


def tables() -> dict:
    """Every table of docs/results.md, by region name."""
    out = {}
    for model in MODELS:
        out[f"compressions-{model}"] = lambda m=model: compression_table(m)
        out[f"readme-{model}"] = lambda m=model: compact_table(m)
        out[f"candidates-{model}"] = lambda m=model: candidates_table(m)
        out[f"lengths-{model}"] = lambda m=model: length_table(m)
        out[f"coverage-{model}"] = lambda m=model: coverage_table(m)
    out["papers"] = papers_table
    out["readme-papers"] = readme_papers_table
    out["chunk"] = chunk_table
    out["cost"] = cost_tables
    return out


def render(page: str) -> str:
    """``page`` with every ``<!-- page:NAME -->`` region rewritten from the results files."""
    made = tables()

    def one(m: re.Match) -> str:
        if m.group(2) not in made:
            raise SystemExit(f"<!-- page:{m.group(2)} --> names no table of benchmarks/page.py")
        return m.group(1) + made[m.group(2)]() + "\n" + m.group(4)

    return REGION.sub(one, page)


def plot(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for col, model in enumerate(MODELS):
        parts = [load(n) for n in ratio_files(model)]
        ratios = sorted({float(r) for p in parts for r in p["meta"]["ratios"]})
        for arm, style in (("default", "o-"), ("unstratified", "o:"), ("random", "s--"), ("paper", "^:")):
            xs, fid, keys = [], [], []
            for ratio in ratios:
                rows = [r for p in parts for r in rows_at(p, ratio)]
                if not any(r["arm"] == arm for r in rows):
                    continue
                t = summarize(rows, ["full", arm])[arm]
                xs.append(ratio)
                fid.append(100 * (t["recovered"] or 0))
                keys.append(100 * t["keys_of_full"] / max(t["full_keys"], 1))
            axes[0, col].plot(xs, fid, style, label=NAMES[arm].replace("`", "").replace("*", ""))
            axes[1, col].plot(xs, keys, style, label=NAMES[arm].replace("`", "").replace("*", ""))
        for row in (0, 1):
            axes[row, col].axhline(100, color="grey", lw=0.8, label="full cache")
            axes[row, col].set_xscale("log", base=2)
            axes[row, col].set_xticks(ratios, [f"{r:g}x" for r in ratios])
        axes[0, col].set_title(MODELS[model])
        axes[0, col].set_ylabel("summary kept, % of the full cache's gain")
        axes[1, col].set_ylabel("pass keys found, % of the full cache's")
        axes[1, col].set_xlabel("compression (document tokens per kept token)")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle("2,048-token documents, 12 per model (held out of each other; Gemma 3's summaries over 8 of them)\n"
                 "benchmarks/grid.py")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plot", default=str(Path(__file__).resolve().parent.parent / "docs" / "results.png"))
    ap.add_argument("--check", action="store_true", help="exit 1 when a table of docs/results.md or README is stale")
    args = ap.parse_args(argv)
    pages = {path: path.read_text() for path in (PAGE, README)}
    new = {path: render(text) for path, text in pages.items()}
    stale = [str(path) for path in pages if new[path] != pages[path]]
    if args.check:
        sys.exit(f"{', '.join(stale)} stale: run python benchmarks/page.py" if stale else 0)
    for path, text in new.items():
        path.write_text(text)
    plot(Path(args.plot))
    print(f"wrote {PAGE}, {README} and {args.plot}")


if __name__ == "__main__":
    main()
