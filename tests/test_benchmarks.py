"""Smoke run of the benchmarks' --quick mode: it completes and its JSON has the
documented shape. Quality numbers are not asserted here (they live in README)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_run_all_quick_writes_valid_results(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run_all.py"), "--quick", "--out-dir",
                           str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ppl = json.loads((tmp_path / "quality_ppl.json").read_text())
    arms = {r["arm"] for r in ppl["summary"]}
    assert {"l2norm", "keep_high", "random", "streaming", "rotating"} <= arms
    assert all(r["ppl"] > 1 and r["full_ppl"] > 1 for r in ppl["summary"])
    passkey = json.loads((tmp_path / "quality_passkey.json").read_text())
    assert {(r["arm"], r["mode"]) for r in passkey["summary"]} >= {("full", "ctq"), ("l2norm", "whole")}
    assert all(0 <= r["correct"] <= r["cases"] for r in passkey["summary"])
    summ = json.loads((tmp_path / "quality_summary.json").read_text())
    assert all(0 <= r["mean"] <= 1 for r in summ["summary"])
    speed = json.loads((tmp_path / "cache_speed.json").read_text())
    ctx = speed["contexts"][0]
    assert set(ctx["arms"]) == {"full", "rotating", "l2norm", "l2norm_default"}
    assert ctx["ratios"]["l2norm_vs_rotating_decode"] > 0
    # the bounded arms really hold less than the full cache
    assert ctx["arms"]["l2norm"]["kv_kept_bytes"] < ctx["arms"]["full"]["kv_kept_bytes"]
    probe = json.loads((tmp_path / "probe.json").read_text())
    assert len(probe["layers"]) == 30
    runtime = json.loads((tmp_path / "runtime.json").read_text())
    assert runtime["matmul_gflops"]["blas"]
    assert "### Passkey retrieval" in (tmp_path / "summary.md").read_text()
