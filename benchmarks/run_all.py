"""Every benchmark, each in its own process, then one line per step with its time.

    python benchmarks/run_all.py                       # every benchmark on the embedded model (many hours)
    python benchmarks/run_all.py --model gemma-3-270m --only grid,coverage   # the second model's quality files
    python benchmarks/run_all.py --quick               # smoke run: every step at a tiny size (minutes)
    python benchmarks/run_all.py --quick --model PATH  # the same on a tiny mlx_lm model folder (under a minute)

Each step runs in its own process (the BLAS preload must precede mlx's import, and memory
peaks stay separate) and writes its JSON under ``--out-dir``, by default
``benchmarks/results/`` (a new temporary folder with ``--quick``: a smoke run never
overwrites a published file), under the names ``benchmarks/README.md`` documents. A failed
step does not stop the others; the exit status is 1 if any failed. With ``--quick`` two
steps run at a time (``--jobs``), a step's own output is shown only when it fails, and each
step runs with one BLAS thread (``OPENBLAS_NUM_THREADS=1``): a smoke run's numbers mean
nothing, and on a shared machine spinning BLAS threads cost it more than its work.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

HERE = Path(__file__).resolve().parent
STEPS = ("grid", "coverage", "cost", "cache", "rules", "runtime", "batch", "distributed", "pinning", "load")
LABELS = {"default": "smollm2", "gemma-3-270m": "gemma3"}  # the model names in grid-*.json and coverage-*.json
COVERAGE_ARMS = "default,no_carry,spread25,spread50,random,intrinsic,low"


def grid_runs(label: str) -> list[tuple[str, list[str]]]:
    """The grid runs benchmarks/page.py reads, as run for docs/results.md: (file suffix, arguments).
    Each model on its own documents (0-11 SmolLM2, 12-23 Gemma 3); the longest documents are
    the model's context less the template (7,600 tokens on SmolLM2's 8,192; Gemma 3 at 8k),
    joined from shorter ones, and fewer of them (each joins several)."""
    first = int(GRID_DOCS.get(label, "0:12").split(":")[0])
    docs = lambda n: ["--docs", f"{first}:{first + n}"]  # noqa: E731
    at4 = ["--ratios", "4", "--arms", "default,random", "--fillers", ""]
    longest = [("4k", docs(8) + ["--tokens", "4096", "--join", *at4])]
    longest += ([("8k", docs(6) + ["--tokens", "8192", "--join", *at4])] if label == "gemma3" else
                [("7600", docs(6) + ["--tokens", "7600", "--join", *at4])])
    return [("2k-candidates", docs(12) + ["--tokens", "2048", "--ratios", "4", "--arms",
                                          "default,random,no_carry,spread25,spread50,low,paper"]),
            ("2k-ratios", docs(12) + ["--tokens", "2048", "--ratios", "2,8,16", "--arms", "default,random,paper"]),
            ("1k", docs(12) + ["--tokens", "1024", *at4]), *longest]
GRID_DOCS = {"gemma3": "12:24"}  # each model's twelve documents, held out of the other's (else 0:12)
LONGEST_STEPS = ("distributed", "load", "cost")  # the longest quick steps (process starts, the GGUF reader)
GRID_QUICK = ["--docs", "0:1", "--tokens", "256", "--ratios", "4", "--arms", "default,random", "--fillers", ""]


def model_name(spec: str) -> str:
    """A file-name part for a model spec: a folder's own name, else the spec."""
    return Path(spec).name if ("/" in spec or Path(spec).exists()) else spec


def commands(step: str, args: argparse.Namespace, out: Path) -> list[list[str]]:
    """The command lines (script and arguments) a step runs."""
    quick, model = args.quick, args.model
    name = model_name(model)
    label = LABELS.get(model, name)
    suffix = "" if model == "default" else f"_{name}"  # the bench_* files of another model
    m = ["--model", model]
    q = ["--quick"] if quick else []
    if step == "grid":
        grid = [str(HERE / "grid.py"), *m]
        if quick:
            return [[*grid, *GRID_QUICK, "--out", str(out / f"grid-{label}.json")]]
        return [[*grid, *argv, "--out", str(out / f"grid-{label}-{suffix_}.json")]
                for suffix_, argv in grid_runs(label)]
    if step == "coverage":
        size = (["--docs", "0:1", "--tokens", "256", "--arms", "default,random"] if quick else
                ["--docs", GRID_DOCS.get(label, "0:12"), "--arms", COVERAGE_ARMS])
        return [[str(HERE / "coverage.py"), *m, *size, "--out", str(out / f"coverage-{label}.json")]]
    if step == "cost":
        return [[str(HERE / "cost.py"), *m, *q, "--out", str(out / ("cost.json" if model == "default" else
                                                                     f"cost-{name}.json"))]]
    if step == "cache":
        return [[str(HERE / "bench_cache.py"), *m, *q, "--out", str(out / f"cache_speed{suffix}.json")]]
    if step == "rules":  # random keys of two fixed shapes: no model
        return [[str(HERE / "bench_rules.py"), *q, "--out", str(out / "rules.json")]]
    if step == "runtime":
        return [[str(HERE / "bench_runtime.py"), *m, *q, "--out", str(out / f"runtime{suffix}.json")]]
    if step == "batch":
        return [[str(HERE / "bench_batch.py"), *m, *q, "--out", str(out / f"batch{suffix}.json")]]
    if step == "distributed":
        return [[str(HERE / "bench_distributed.py"), *m, *q, "--out", str(out / f"distributed{suffix}.json")]]
    if step == "pinning":
        return [[str(HERE / "bench_pinning.py"), *m, *q, "--out", str(out / f"pinning{suffix}.json")]]
    if step == "load":  # GGUF readers on the embedded model's file, then loads of each model in fresh processes
        models = model if quick or model != "default" else "default,gemma-3-270m"
        return [[str(HERE / "bench_load.py"), "--models", models, *q, "--out", str(out / f"load{suffix}.json")]]
    raise ValueError(step)


def run_step(step: str, cmds: list[list[str]], quick: bool, env) -> tuple[str, float, int, str]:
    """``(step, seconds, exit status, its output's tail where it failed)``; a full run's output streams."""
    tic = time.perf_counter()
    for cmd in cmds:
        if quick:
            proc = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, env=env)
            if proc.returncode:
                tail = f"$ {' '.join(cmd)}\n{(proc.stdout + proc.stderr)[-4000:]}"
                return step, time.perf_counter() - tic, proc.returncode, tail
        else:
            print(f"$ {' '.join(cmd)}", flush=True)
            rc = subprocess.call([sys.executable, *cmd])
            if rc:
                return step, time.perf_counter() - tic, rc, ""
    return step, time.perf_counter() - tic, 0, ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="every step at a tiny size (a smoke run)")
    ap.add_argument("--model", default="default", help="'default' (the embedded model), 'gemma-3-270m' or an mlx_lm "
                                                       "model folder")
    ap.add_argument("--out-dir", help="where the files go (default: benchmarks/results, with --quick a new "
                                      "temporary folder)")
    ap.add_argument("--only", default=",".join(STEPS), help=f"comma-separated steps, of {', '.join(STEPS)}")
    ap.add_argument("--jobs", type=int, help="steps run at once (default: 1; 2 with --quick). Steps that share "
                                             "the machine time each other's load: measure with 1")
    args = ap.parse_args(argv)
    steps = [s for s in args.only.split(",") if s]
    if set(steps) - set(STEPS):
        ap.error(f"unknown steps {sorted(set(steps) - set(STEPS))}; steps: {', '.join(STEPS)}")
    jobs = args.jobs or (2 if args.quick else 1)
    out = Path(args.out_dir or (tempfile.mkdtemp(prefix="knorm-bench-quick-") if args.quick else HERE / "results"))
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"} if args.quick else None
    start, failed = time.perf_counter(), []

    def report(step: str, seconds: float, rc: int, tail: str) -> None:
        if rc:
            failed.append(step)
            print(tail, flush=True)
        print(f"{step:12s} {seconds:7.1f} s  {f'failed (exit status {rc})' if rc else 'ok'}", flush=True)

    if jobs == 1:
        for step in steps:
            report(*run_step(step, commands(step, args, out), args.quick, env))
    else:  # the longest steps first, so that the short ones fill the other slots
        order = sorted(steps, key=lambda s: s not in LONGEST_STEPS)
        with ThreadPoolExecutor(jobs) as pool:
            running = [pool.submit(run_step, step, commands(step, args, out), args.quick, env) for step in order]
            for done in as_completed(running):
                report(*done.result())
    print(f"{'all':12s} {time.perf_counter() - start:7.1f} s  "
          + (f"failed: {', '.join(failed)}" if failed else f"ok; results in {out}"), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
