"""The tiny-model cache tests again under MLX's bundled BLAS (KNORM_NO_BLAS=1).

OpenBLAS and the bundled reference BLAS compute the same matmuls with other
kernels, so a test that silently needs bitwise-equal floats across paths
fails here on any machine, not only on the next CPU model CI happens to get.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_cache_tests_pass_with_the_bundled_blas():
    env = {**os.environ, "KNORM_NO_BLAS": "1"}
    info = subprocess.run([sys.executable, "-c", "import json, knorm_gen; print(json.dumps(knorm_gen.runtime_info()))"],
                          capture_output=True, text=True, env=env, cwd=ROOT, check=True, timeout=120)
    assert json.loads(info.stdout)["blas"] is None  # really the other BLAS path
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cache.py",
                           "tests/test_rules.py"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
