"""Every benchmark in one command, then the tables and plots.

    python benchmarks/run_all.py            # the published run on the embedded model (hours on 2 CPU cores)
    python benchmarks/run_all.py --only gemma,gemma_probe,load   # the second model
    python benchmarks/run_all.py --quick    # smoke run, a few minutes; checks it completes

Each benchmark runs in its own process (the BLAS preload must precede mlx's
import, and memory peaks stay separate), writing JSON under ``--out-dir``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--model", default="default")
    ap.add_argument("--out-dir", default=str(HERE / "results"))
    ap.add_argument("--only", default="quality,probe,cache,runtime,batch,summarize,distributed",
                    help="comma-separated subset; add gemma for the second model (quality and probe)")
    args = ap.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    quick = ["--quick"] if args.quick else []
    probe = "import sys; from knorm_gen.probe import probe_cli; probe_cli(sys.argv[1:])"
    steps = {
        "quality": [str(HERE / "quality.py"), "--model", args.model, "--out-dir", str(out), *quick],
        "probe": ["-c", probe, "--model", args.model, "--tokens", "256" if args.quick else "1024",
                  "--json", str(out / "probe.json")],
        "cache": [str(HERE / "bench_cache.py"), "--model", args.model, "--out", str(out / "cache_speed.json"), *quick],
        "runtime": [str(HERE / "bench_runtime.py"), "--out", str(out / "runtime.json"), *quick],
        "batch": [str(HERE / "bench_batch.py"), "--model", args.model, "--out", str(out / "batch.json"), *quick],
        "summarize": [str(HERE / "bench_summarize.py"), "--model", args.model, "--out", str(out / "summarize.json"),
                      *quick],
        "distributed": [str(HERE / "bench_distributed.py"), "--out", str(out / "distributed.json"), *quick],
        "gemma": [str(HERE / "quality.py"), "--model", "gemma-3-270m", "--task", "ppl,passkey,fidelity", "--out-dir",
                  str(out), *quick],
        "gemma_probe": ["-c", probe, "--model", "gemma-3-270m", "--json", str(out / "probe_gemma-3-270m.json")],
        "load": [str(HERE / "bench_load.py"), "--out", str(out / "load.json")],
    }
    for name in args.only.split(","):
        tic = time.perf_counter()
        print(f"== {name}", flush=True)
        rc = subprocess.call([sys.executable, *steps[name]])
        if rc:
            print(f"{name} failed with exit status {rc}", file=sys.stderr)
            return rc
        print(f"== {name} done in {time.perf_counter() - tic:.0f} s", flush=True)
    subprocess.check_call([sys.executable, str(HERE / "report.py"), "--results-dir", str(out)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
