"""Platform runtime: BLAS preload, the CPU float32 policy, and runtime facts.

The MLX CPU wheel for Linux bundles a reference BLAS (about 6 GFLOP/s for a
float32 1024x1024 matmul). Loading the system OpenBLAS into the global symbol
scope *before* ``mlx.core`` is imported makes MLX resolve its BLAS calls to it
(about 30x faster). That is why this module must not import mlx at its top:
``knorm_gen/__init__.py`` calls :func:`preload_blas` before anything else.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys
import warnings
from pathlib import Path
from typing import Any

__all__ = [
    "preload_blas",
    "runtime_info",
    "warn_if_slow",
    "cpu_prefers_float32",
    "on_cpu",
]

# Well-known Debian/Ubuntu locations, used when find_library finds nothing
# (it needs ldconfig, which minimal containers sometimes lack).
_FALLBACK_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
)

_FIX_HINT = (
    "install Debian's OpenBLAS (`apt-get install libopenblas0-pthread`) and "
    "import knorm_gen before mlx"
)

# Module state: what preload_blas did. None means "not attempted yet".
_blas_path: str | None = None
_blas_status: str | None = None
_warned: set[str] = set()


def _candidates() -> list[str]:
    found = ctypes.util.find_library("openblas")
    paths = [found] if found else []
    paths += [p for p in _FALLBACK_PATHS if os.path.exists(p)]
    return paths


def preload_blas() -> str | None:
    """Load the system OpenBLAS with RTLD_GLOBAL before mlx is imported.

    Returns the path loaded, or None. Idempotent: later calls return the first
    outcome. The reason for a None is kept for :func:`runtime_info`
    ("disabled", "mlx already imported", "not found", "not linux", ...).
    Set ``KNORM_NO_BLAS=1`` to skip it.
    """
    global _blas_path, _blas_status
    if _blas_status is not None:
        return _blas_path
    if not sys.platform.startswith("linux"):
        _blas_status = "not linux"
    elif os.environ.get("KNORM_NO_BLAS", "") not in ("", "0"):
        _blas_status = "disabled (KNORM_NO_BLAS=1)"
    elif "mlx.core" in sys.modules:
        # Too late: mlx has already bound its BLAS symbols to the bundled one.
        _blas_status = "mlx already imported"
    else:
        errors = []
        for path in _candidates():
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError as exc:
                errors.append(f"{path}: {exc}")
                continue
            _blas_path, _blas_status = path, "loaded"
            return _blas_path
        _blas_status = "not found" if not errors else "load failed: " + "; ".join(errors)
    return None


def blas_status() -> tuple[str | None, str]:
    """(loaded path or None, reason) of the preload; "not attempted" if never run."""
    return _blas_path, _blas_status or "not attempted"


def on_cpu() -> bool:
    """True when MLX's default device is the CPU."""
    import mlx.core as mx

    return mx.default_device().type == mx.cpu


def cpu_prefers_float32() -> bool:
    """True on the CPU device unless ``KNORM_KEEP_DTYPE=1``.

    On the CPU, half-precision and quantized matmuls are slow paths; float32
    goes through BLAS.
    """
    if os.environ.get("KNORM_KEEP_DTYPE", "") not in ("", "0"):
        return False
    return on_cpu()


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def runtime_info() -> dict[str, Any]:
    """JSON-serialisable facts about the MLX runtime and the speed policy."""
    import mlx.core as mx

    cpu = on_cpu()
    path, status = blas_status()
    return {
        "device": str(mx.default_device()),
        "cpu": cpu,
        "blas": path,
        "blas_status": status,
        "mlx": getattr(mx, "__version__", None) or _version("mlx"),
        "mlx_lm": _version("mlx-lm"),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "float32_weights": cpu_prefers_float32(),
        "fast_path": (not cpu) or path is not None,
    }


def _one_line(message, category, filename, lineno, line=None) -> str:
    """A warning as its own text on one line: no source location, no source line."""
    return " ".join(str(message).split()) + "\n"


def _warn_once(key: str, message: str) -> None:
    """Warn once per process and cause. Shown as one line (the message alone, not
    the file and line of the code that noticed it); still a RuntimeWarning, so
    ``-W`` filters and ``warnings.catch_warnings`` see it as before."""
    if key in _warned:
        return
    _warned.add(key)
    original = warnings.formatwarning
    warnings.formatwarning = _one_line
    try:
        warnings.warn(message, RuntimeWarning, stacklevel=3)
    finally:
        warnings.formatwarning = original


def warn_if_slow(*, keeps_low_precision: bool | None = None) -> None:
    """Warn (once per process and cause) when running on a known slow path.

    Causes: CPU without the OpenBLAS preload, and CPU with weights kept
    quantized or in half precision (``keeps_low_precision``; defaults to the
    negation of :func:`cpu_prefers_float32`).
    """
    if not on_cpu():
        return
    path, status = blas_status()
    if path is None and status != "not linux":
        fix = (
            "import knorm_gen before mlx and mlx_lm (make `import knorm_gen` your program's first "
            "import of either): MLX binds its BLAS when mlx.core loads, so OpenBLAS loaded after "
            "it cannot help"
            if status == "mlx already imported" else _FIX_HINT
        )
        _warn_once(
            "blas",
            f"knorm_gen: MLX runs on the CPU with its reference BLAS ({status}); "
            f"float32 matmul is ~30x slower. To fix: {fix}.",
        )
    if keeps_low_precision is None:
        keeps_low_precision = not cpu_prefers_float32()
    if keeps_low_precision:
        _warn_once(
            "dtype",
            "knorm_gen: weights kept quantized/half precision on the CPU; these "
            "kernels are many times slower than float32. Load with float32=True "
            "(and unset KNORM_KEEP_DTYPE) for speed.",
        )


def cache_root() -> Path:
    """Where knorm_gen keeps what it makes once (converted models, saved tunings): ``$KNORM_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/knorm_gen``, else ``~/.cache/knorm_gen``."""
    if env := os.environ.get("KNORM_CACHE_DIR"):
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "knorm_gen"
