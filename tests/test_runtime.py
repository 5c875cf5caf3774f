"""Tests for knorm_gen.platform.runtime (BLAS preload, float32 policy, runtime_info)."""

import ctypes.util
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import knorm_gen.platform.runtime as runtime

ROOT = Path(__file__).resolve().parents[1]
PROBE = (
    "import json, knorm_gen.platform.runtime as r; r.preload_blas(); "
    "print(json.dumps(r.runtime_info()))"
)


def run_probe(code: str = PROBE, **env) -> dict:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    for key in ("KNORM_NO_BLAS", "KNORM_KEEP_DTYPE"):
        if key not in env:
            full_env.pop(key, None)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full_env,
        cwd=ROOT, check=True, timeout=120,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_runtime_info_json_serialisable():
    info = runtime.runtime_info()
    round_tripped = json.loads(json.dumps(info))
    assert round_tripped == info
    for key in ("device", "cpu", "blas", "blas_status", "mlx", "mlx_lm", "platform",
                "float32_weights", "fast_path"):
        assert key in info


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux BLAS preload")
def test_blas_loaded_in_fresh_process():
    info = run_probe()
    if ctypes.util.find_library("openblas") is None and not any(
        os.path.exists(p) for p in runtime._FALLBACK_PATHS
    ):
        assert info["blas"] is None and info["blas_status"] == "not found"
        return
    assert info["blas"] and "openblas" in info["blas"]
    assert info["blas_status"] == "loaded"
    if info["cpu"]:
        assert info["fast_path"] is True


def test_no_blas_env_disables_preload():
    info = run_probe(KNORM_NO_BLAS="1")
    assert info["blas"] is None
    assert "disabled" in info["blas_status"]
    if info["cpu"]:
        assert info["fast_path"] is False


def test_preload_after_mlx_import_reports_why():
    code = "import mlx.core; " + PROBE
    info = run_probe(code)
    assert info["blas"] is None
    assert info["blas_status"] == "mlx already imported"


IDEMPOTENT = """
import ctypes, json, knorm_gen.platform.runtime as r
first = r.preload_blas()
calls = []
def refuse(*args, **kwargs):
    calls.append(args)
    raise OSError("preload_blas must not load a second time")
ctypes.CDLL = refuse
second = r.preload_blas()
maps = open("/proc/self/maps").read() if r.sys.platform.startswith("linux") else ""
print(json.dumps({"first": first, "second": second, "calls": len(calls), "status": r.blas_status()[1],
                  "mapped": "libopenblas" in maps}))
"""


def test_preload_is_idempotent():
    # A second call must neither load again nor change the outcome.
    out = run_probe(IDEMPOTENT)
    assert out["second"] == out["first"] and out["calls"] == 0
    if out["first"] is not None:
        assert out["status"] == "loaded" and out["mapped"]  # the library really is in the process


def test_keep_dtype_env(monkeypatch):
    monkeypatch.delenv("KNORM_KEEP_DTYPE", raising=False)
    assert runtime.cpu_prefers_float32() == runtime.on_cpu()
    monkeypatch.setenv("KNORM_KEEP_DTYPE", "1")
    assert runtime.cpu_prefers_float32() is False
    assert runtime.runtime_info()["float32_weights"] is False


def test_warn_if_slow_warns_once_and_names_fix(monkeypatch):
    if not runtime.on_cpu():
        pytest.skip("CPU-only warning")
    monkeypatch.setattr(runtime, "_blas_path", None)
    monkeypatch.setattr(runtime, "_blas_status", "disabled (KNORM_NO_BLAS=1)")
    monkeypatch.setattr(runtime, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runtime.warn_if_slow(keeps_low_precision=False)
        runtime.warn_if_slow(keeps_low_precision=False)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1
    assert "apt-get install libopenblas0-pthread" in messages[0]
    assert "import knorm_gen before mlx" in messages[0]


def test_warn_if_slow_on_low_precision(monkeypatch):
    if not runtime.on_cpu():
        pytest.skip("CPU-only warning")
    monkeypatch.setattr(runtime, "_warned", {"blas"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runtime.warn_if_slow(keeps_low_precision=True)
        runtime.warn_if_slow(keeps_low_precision=True)
    assert len(caught) == 1
    assert "float32" in str(caught[0].message)


def test_the_slow_blas_warning_is_one_line_once_per_process():
    # Printed on every run where OpenBLAS is missing: the message alone, on one line, not the
    # source location warnings.warn shows by default ("models.py:153: RuntimeWarning: ...").
    if not runtime.on_cpu():
        pytest.skip("CPU-only warning")
    code = ("import knorm_gen.platform.runtime as r\n"
            "r._blas_path, r._blas_status = None, 'not found'\n"
            "r.warn_if_slow(keeps_low_precision=False)\nr.warn_if_slow(keeps_low_precision=False)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "default"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=120)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 0 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("knorm_gen: MLX runs on the CPU with its reference BLAS (not found)")
    assert ".py:" not in lines[0] and "RuntimeWarning" not in lines[0] and "apt-get install" in lines[0]
