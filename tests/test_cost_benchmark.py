"""Smoke run of benchmarks/cost.py --quick on the tiny random model: every section and
number is written, and every measured number is positive. Speeds are not asserted."""

import json
import subprocess
import sys
from pathlib import Path

from .test_benchmarks import check_file, documented_schema, schema_for

ROOT = Path(__file__).resolve().parents[1]

# None where the arm has no such thing: no probe (every rule but the question rule), no
# compressed layer (the full cache's budget), no ceiling (a layer that keeps every token)
MAY_BE_NONE = {"probe_s", "probe_share", "budget", "kv_ceiling_bytes"}
COUNTS = {"differing_rows"}  # may be 0


def leaves(value, path=""):
    """``(path, key, value)`` of every number or None under ``value`` (the token lists of
    ``differences`` aside)."""
    if isinstance(value, dict):
        for k, v in value.items():
            if k != "differences":
                yield from leaves(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from leaves(v, f"{path}[{i}]")
    elif value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        yield path, path.rsplit(".", 1)[-1].split("[")[0], value


def test_cost_quick_writes_every_section(tiny_model_dir, tmp_path):
    out = tmp_path / "cost.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cost.py"), "--quick", "--model",
                           str(tiny_model_dir), "--out", str(out)], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    check_file(data, schema_for("cost.json", documented_schema()))  # benchmarks/README.md's results table
    assert {"benchmark", "model", "quick", "date", "git", "machine", "settings", "weights_gb", "estimate_s",
            "prefill", "together", "job", "aims", "seconds"} <= set(data)
    assert data["quick"] is True and data["git"]["commit"] and data["machine"]["runtime"]

    prefill = data["prefill"]
    assert {(r["length"], r["arm"]) for r in prefill["rows"]} == {
        (n, a) for n in ("1k", "2k", "8k") for a in ("full", "default", "paper", "low", "random")}
    for row in prefill["rows"]:
        for key in ("tokens", "prefill_s", "prefill_tps", "prefill_only_tps", "decode_tps", "kv_bytes",
                    "kv_full_bytes", "peak_memory_gb"):
            assert row[key] > 0, (row["length"], row["arm"], key)
        assert (row["probe_share"] is not None) == (row["arm"] == "default"), row  # only the default probes
        assert (row["budget"] is None) == (row["arm"] == "full"), row
        if row["arm"] != "full":
            assert row["kv_bytes"] < row["kv_full_bytes"], row  # eviction kept less than the full cache
    assert set(prefill["means"]) == {"1k", "2k", "8k"}

    for label in ("2k", "8k"):
        section = data["together"][label]
        for mode in ("alone", "together"):
            assert {"wall_s", "prompt_tps", "peak_memory_gb"} <= set(section[mode])
        assert section["speed_together_over_alone"] > 0 and section["faster"] in ("alone", "together")
        assert section["differing_rows"] == len(section["differences"])

    job = data["job"]
    assert set(job["arms"]) == {"ours_default", "mlx_batch_generate", "mlx_rotating"}
    for arm in job["arms"].values():
        assert {"wall_s", "rows_per_hour", "generated_tokens", "kv_bytes_mean", "peak_memory_gb"} <= set(arm)
    assert job["arms"]["mlx_rotating"]["max_kv_size"] > 0 and job["rows"] == 4
    assert set(job["ratios"]) == {"ours_vs_mlx_rows_per_hour", "ours_vs_mlx_peak_memory",
                                  "ours_vs_rotating_rows_per_hour", "ours_vs_rotating_peak_memory"}
    assert set(data["aims"]) == {"prefill_8k_vs_1k", "probe_share_8k", "job_rows_per_hour_vs_mlx",
                                 "job_peak_memory_vs_mlx"}
    assert all(isinstance(a["met"], bool) for a in data["aims"].values())

    for path, key, value in leaves(data):
        if value is None:
            assert key in MAY_BE_NONE, path
        elif key in COUNTS:
            assert value >= 0, path
        else:
            assert value > 0, path

    for heading in ("## Prefill and decode per arm", "## Prefill together or alone", "## The whole job",
                    "## The aims, measured in this run"):
        assert heading in proc.stdout
    assert "| 8k | default |" in proc.stdout


def test_cost_job_alone_writes_only_the_job(tiny_model_dir, tmp_path):
    """``--skip-prefill --skip-together``: the whole job and its aims, no other section."""
    out = tmp_path / "cost-job.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "cost.py"), "--quick", "--skip-prefill",
                           "--skip-together", "--model", str(tiny_model_dir), "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert "prefill" not in data and "together" not in data
    assert set(data["job"]["arms"]) == {"ours_default", "mlx_batch_generate", "mlx_rotating"}
    assert set(data["aims"]) == {"job_rows_per_hour_vs_mlx", "job_peak_memory_vs_mlx"}
    assert "## Prefill and decode per arm" not in proc.stdout and "## The whole job" in proc.stdout
