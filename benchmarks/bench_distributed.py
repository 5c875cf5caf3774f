"""One knorm-batch job in 1 and 2 local processes (mlx.launch -n 2), one run.

    python benchmarks/bench_distributed.py            # about 10 minutes on 2 CPU cores
    python benchmarks/bench_distributed.py --quick    # smoke run: two short rows, the --batch-size 1 pair only

Each arm is the real command in a fresh process tree, timed from start to exit
(imports, model load, the start-up exchange, the rows, the merge). The serial
share is what a second process cannot take off: the arm's wall time minus its
slowest rank's time on rows. Both processes share this machine's 2 cores, so
little speedup is expected here; across N hosts the model is
T(N) = serial + rows_time(1) / N.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import knorm_gen

HERE = Path(__file__).parent
ROOT = HERE.parent
BIN = Path(sys.executable).parent
TIMING = {"prefill_s", "decode_s", "prompt_tps", "generation_tps", "peak_memory_gb"}


def rows(quick: bool) -> list[dict]:
    # examples/docs.jsonl's four documents as instruction-first prompt rows: the workload these numbers were measured on
    docs = [json.loads(line) for line in (ROOT / "examples" / "docs.jsonl").read_text().splitlines()]
    main = [{"id": d["id"], "prompt": "Summarize the following documentation in three sentences.\n\n" + d["text"],
             "source": d["source"]} for d in docs]
    short = [{"id": f"short-{i}", "prompt": p} for i, p in enumerate(
        ["Write a short story about a lighthouse keeper.", "Explain how a bicycle works.",
         "Describe a day at the beach.", "Explain why the sky is blue."])]
    return short[:2] if quick else main + short


def run_arm(n: int, inp: Path, out: Path, tokens: int, extra: list[str], model: str = "default") -> dict:
    summary = out.with_suffix(".summary.json")
    argv = [str(inp), "-o", str(out), "--overwrite", "-q", "--budget", "128", "--max-tokens", str(tokens),
            "--summary-json", str(summary), *(["--model", model] if model != "default" else []), *extra]
    cmd = ([sys.executable, "-m", "knorm_gen.cli", *argv] if n == 1 else
           [str(BIN / "mlx.launch"), "-n", str(n), "--python", sys.executable, "--", "-m", "knorm_gen.cli", *argv])
    tic = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, cwd=ROOT, timeout=3600)
    wall = time.perf_counter() - tic
    if proc.returncode or not summary.exists():
        raise SystemExit(f"{n} process(es) failed: {proc.stderr.decode()[-2000:]}")
    s = json.loads(summary.read_text())
    rank_walls = [r["wall_s"] for r in s["ranks"]] or [s["wall_s"]]
    return {"processes": n, "wall_s": wall, "rows": s["rows"], "ok": s["ok"], "rows_per_hour": 3600 * s["rows"] / wall,
            "generated_tokens": s["generated_tokens"], "generated_tokens_per_s": s["generated_tokens"] / wall,
            "rows_wall_s": rank_walls, "serial_s": wall - max(rank_walls), "ranks": s["ranks"]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model", default="default", help="'default' (the embedded model) or knorm-batch's --model")
    ap.add_argument("--out", default=str(HERE / "results" / "distributed.json"))
    ap.add_argument("--work-dir", default=None, help="where the job's files go (default: a temporary folder)")
    args = ap.parse_args(argv)
    import tempfile

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="knorm-dist-"))
    work.mkdir(parents=True, exist_ok=True)
    inp = work / "rows.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows(args.quick)))
    tokens = 8 if args.quick else 64
    tic = time.perf_counter()
    # The same job at --batch-size 1 in both: each row's computation is then identical.
    same = [run_arm(n, inp, work / f"exact-{n}.jsonl", tokens, ["--batch-size", "1"], args.model) for n in (1, 2)]
    if args.quick:  # a smoke run: the batch-1 pair stands for both (mlx.launch starts are most of its time)
        arms = same
        for n in (1, 2):
            (work / f"out-{n}.jsonl").write_text((work / f"exact-{n}.jsonl").read_text())
    else:
        arms = [run_arm(n, inp, work / f"out-{n}.jsonl", tokens, [], args.model) for n in (1, 2)]

    def untimed(path):  # by id: one batched process writes in finishing order, a launch in input order
        records = [{k: v for k, v in json.loads(x).items() if k not in TIMING} for x in path.read_text().splitlines()]
        return {r["id"]: r for r in records}

    a, b = untimed(work / "out-1.jsonl"), untimed(work / "out-2.jsonl")
    equal_default = sum(a[k] == b.get(k) for k in a)
    exact = untimed(work / "exact-1.jsonl") == untimed(work / "exact-2.jsonl")
    one, two = arms
    res = {"benchmark": "distributed", "quick": args.quick, "runtime": knorm_gen.runtime_info(), "rows": one["rows"],
           "max_tokens": tokens, "arms": arms, "batch1_arms": same,
           "records_equal_default_batch": equal_default, "records_equal_batch1": exact,
           "speedup_2_vs_1": one["wall_s"] / two["wall_s"],
           "serial_share_1": one["serial_s"] / one["wall_s"], "serial_share_2": two["serial_s"] / two["wall_s"],
           "seconds": time.perf_counter() - tic}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    for a in arms:
        print(f"{a['processes']} process(es): {a['wall_s']:.1f} s, {a['rows_per_hour']:.0f} rows/h, "
              f"{a['generated_tokens_per_s']:.2f} tok/s, serial {a['serial_s']:.1f} s", flush=True)
    print(f"speedup 2 vs 1: {res['speedup_2_vs_1']:.2f}; identical records: {equal_default}/{one['rows']} "
          f"(default batch), {'all' if exact else 'not all'} (batch 1); wrote {args.out}")
    return res


if __name__ == "__main__":
    main()
