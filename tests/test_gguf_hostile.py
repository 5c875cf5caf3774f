"""A GGUF is untrusted input, and the conversion cache is a folder anyone can write to.

Crafted GGUFs are written here, a few bytes each. Those that crashed the
process (SIGSEGV inside mx.load) or grew it without bound run through the real
CLI in a subprocess with a timeout and a 4 GiB address-space cap.
"""

import fcntl
import os
import resource
import signal
import struct
import subprocess
import sys
import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest

from knorm_gen.models import gguf as kgguf
from knorm_gen.models.load import load_model

from .test_gguf import TOKENS, close, reference_and_gguf

ROOT = Path(__file__).resolve().parents[1]
MEMORY_CAP = 4 << 30


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "knorm-cache"
    monkeypatch.setenv("KNORM_CACHE_DIR", str(d))
    return d


def _cap_memory():
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))


def _env(cache_dir):
    return {**os.environ, "KNORM_CACHE_DIR": str(cache_dir),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def run_cli(tmp_path, cache_dir, model) -> subprocess.CompletedProcess:
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "hi"}\n')
    return subprocess.run([sys.executable, "-m", "knorm_gen.cli", str(rows), "--model", str(model), "--quiet"],
                          capture_output=True, text=True, timeout=120, env=_env(cache_dir),
                          preexec_fn=_cap_memory)


# ------------------------------------------------------------ crafted bytes


def _s(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def _header(n_tensors: int, n_kv: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv)


def _array_of_strings(n: int) -> bytes:  # a metadata entry claiming n strings, holding 3
    return _s(b"tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, n) + b"".join(_s(b"tok") for _ in range(3))


CRAFTED = {  # name -> (file bytes, what the one-line message must say)
    "tensor_count": (_header(2**63 - 1, 0), "claims 9223372036854775807 tensors"),
    "kv_count": (_header(0, 2**63) + _s(b"general.architecture") + struct.pack("<I", 8) + _s(b"llama"),
                 "claims 9223372036854775808 metadata entries"),
    "key_length": (_header(0, 1) + struct.pack("<Q", 2**62) + b"general.name",
                   "key of metadata entry 0 claims 4611686018427387904 bytes"),
    "dimensions": (_header(1, 0) + _s(b"token_embd.weight") + struct.pack("<I", 2**31) + bytes(64),
                   "tensor 'token_embd.weight' claims 2147483648 dimensions"),
    "array_length": (_header(0, 2) + _s(b"general.architecture") + struct.pack("<I", 8) + _s(b"llama")
                     + _array_of_strings(2**40) + bytes(40),
                     "metadata 'tokenizer.ggml.tokens' claims 1099511627776 elements"),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_header_is_a_usage_error_naming_the_field(tmp_path, cache_dir, case):
    data, message = CRAFTED[case]
    bad = tmp_path / "x.gguf"
    bad.write_bytes(data)
    result = run_cli(tmp_path, cache_dir, bad)
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and str(bad) in lines[0], result.stderr
    converted = cache_dir / "converted"
    assert not converted.exists() or not any(converted.iterdir())  # no hidden temp folder left


# ------------------------------------------------------------ bad metadata


def tiny_llama_gguf(path: Path, **override) -> Path:
    """A two-block llama GGUF (float32 tensors) whose metadata values can be overridden."""
    hidden, ffn, heads, kv, head_dim, vocab = 64, 128, 4, 2, 16, 300
    meta = {"block_count": 2, "context_length": 256, "embedding_length": hidden, "feed_forward_length": ffn,
            "attention.head_count": heads, "attention.head_count_kv": kv, "rope.dimension_count": head_dim}
    meta.update({k.replace("__", "."): v for k, v in override.items()})
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in meta.items():
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(vocab)])
    w.add_token_types([1] * vocab)
    w.add_token_merges(["t 1"])
    rng = np.random.default_rng(0)
    shapes = {"token_embd": (vocab, hidden), "output_norm": (hidden,)}
    for b in range(2):
        shapes.update({f"blk.{b}.attn_q": (heads * head_dim, hidden), f"blk.{b}.attn_k": (kv * head_dim, hidden),
                       f"blk.{b}.attn_v": (kv * head_dim, hidden), f"blk.{b}.attn_output": (hidden, hidden),
                       f"blk.{b}.ffn_gate": (ffn, hidden), f"blk.{b}.ffn_up": (ffn, hidden),
                       f"blk.{b}.ffn_down": (hidden, ffn), f"blk.{b}.attn_norm": (hidden,),
                       f"blk.{b}.ffn_norm": (hidden,)})
    for name, shape in shapes.items():
        w.add_tensor(f"{name}.weight", (0.1 * rng.standard_normal(shape)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("count, message", [
    (10**7, "'llama.block_count' is 10000000 but the file's tensors are for blocks blk.0 to blk.1"),
    (2**32 - 1, "'llama.block_count' is 4294967295 but the file's tensors are for blocks blk.0 to blk.1"),
])
def test_block_count_the_tensors_do_not_have_is_a_usage_error(tmp_path, cache_dir, count, message):
    """10^7 blocks grew the process by 110 MB/s; 2^32-1 ended with an empty message."""
    result = run_cli(tmp_path, cache_dir, tiny_llama_gguf(tmp_path / "x.gguf", block_count=count))
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr


def test_zero_heads_names_the_field(tmp_path, cache_dir):
    path = tiny_llama_gguf(tmp_path / "x.gguf", attention__head_count=0)
    with pytest.raises(ValueError, match=r"x\.gguf: .*'llama.attention.head_count' is 0; it must be"):
        load_model(str(path))


def test_head_count_against_the_tensors_is_refused_and_never_cached(tmp_path, cache_dir):
    path = tiny_llama_gguf(tmp_path / "x.gguf", attention__head_count=3, attention__head_count_kv=1)
    for _ in range(2):  # the same answer every time, no "converting again"
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(ValueError,
                               match=r"blk\.0\.attn_q\.weight' has shape \(64, 64\).*head_count=3 heads"):
                load_model(str(path))
    converted = cache_dir / "converted"
    assert not converted.exists() or not any(converted.iterdir())


def test_a_conversion_that_does_not_load_is_not_cached(tmp_path, cache_dir, monkeypatch):
    ref, path = reference_and_gguf(tmp_path, "llama")

    def broken(folder):
        raise ValueError("Expected shape (48, 64) but received shape (64, 64)")

    monkeypatch.setattr(kgguf, "load_converted", broken)
    with pytest.raises(ValueError, match="does not load"):
        load_model(str(path))
    assert kgguf.cached_conversion(kgguf.file_sha256(path)) is None
    assert not any((cache_dir / "converted").iterdir())
    monkeypatch.undo()
    monkeypatch.setenv("KNORM_CACHE_DIR", str(cache_dir))
    model, _ = load_model(str(path))
    assert close(model(TOKENS), ref(TOKENS))


# ---------------------------------------------------------------- the cache


def test_same_size_overwrite_of_the_weights_is_caught_and_rebuilt(tmp_path, cache_dir, monkeypatch):
    ref, path = reference_and_gguf(tmp_path, "llama")
    load_model(str(path))
    weights = kgguf.converted_dir(kgguf.file_sha256(path)) / "model.safetensors"
    before, size = weights.stat(), weights.stat().st_size
    with weights.open("r+b") as f:  # zeros over the middle third, the header intact
        f.seek(size // 3)
        f.write(bytes(size // 3))
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))  # the mtime set back too
    reads = []
    real = kgguf.read_gguf
    monkeypatch.setattr(kgguf, "read_gguf", lambda p: reads.append(p) or real(p))
    with pytest.warns(RuntimeWarning, match="model.safetensors does not match the sha256"):
        model, _ = load_model(str(path))
    assert len(reads) == 1 and close(model(TOKENS), ref(TOKENS))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_model(str(path))  # verified once more, nothing to say
    assert len(reads) == 1


def test_conversion_files_are_fsynced_before_the_rename(tmp_path, cache_dir, monkeypatch):
    _, path = reference_and_gguf(tmp_path, "llama")
    synced, checked = set(), []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        synced.add(os.fstat(fd).st_ino)
        return real_fsync(fd)

    def rename(src, dst):
        if Path(dst) == kgguf.converted_dir(kgguf.file_sha256(path)):
            files = [*Path(src).iterdir(), Path(src)]
            checked.append(sorted(p.name for p in files if p.stat().st_ino not in synced))
        return real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    load_model(str(path))
    assert checked == [[]]  # every file, and the folder, synced before the rename


_KILLED_CONVERSION = """
import os, sys, time
import mlx.core as mx
from knorm_gen.models.load import load_model
real = mx.save_safetensors
def save_then_hang(*a, **k):
    real(*a, **k)
    print("written", flush=True)
    time.sleep(60)
mx.save_safetensors = save_then_hang
load_model(sys.argv[1])
"""


def test_temp_folder_of_a_killed_conversion_is_removed_though_the_entry_exists(tmp_path, cache_dir):
    _, path = reference_and_gguf(tmp_path, "llama")
    load_model(str(path))
    entry = kgguf.converted_dir(kgguf.file_sha256(path))
    entry.rename(tmp_path / "entry")  # so that the child converts
    child = subprocess.Popen([sys.executable, "-c", _KILLED_CONVERSION, str(path)], stdout=subprocess.PIPE,
                             text=True, env=_env(cache_dir), preexec_fn=_cap_memory)
    try:
        assert child.stdout.readline().strip() == "written"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    (tmp_path / "entry").rename(entry)
    left = [p for p in entry.parent.iterdir() if p.name.startswith(".")]
    assert len(left) == 1 and (left[0] / "model.safetensors").is_file()
    live = entry.parent / f".{entry.name}.{os.getpid()}.busy"  # a running conversion holds its lock
    live.mkdir()
    fd = os.open(live, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        load_model(str(path))
        assert not left[0].exists() and live.exists()
    finally:
        os.close(fd)


@pytest.fixture
def full_disk(tmp_path):
    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    # The suite runs as root on its machines (CI included): a full disk is a real 64 KiB tmpfs.
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True, check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_full_disk_names_the_path_and_cause_and_loads_uncached(tmp_path, full_disk, monkeypatch):
    ref, path = reference_and_gguf(tmp_path, "llama")
    monkeypatch.setenv("KNORM_CACHE_DIR", str(full_disk))
    with pytest.warns(RuntimeWarning) as caught:
        model, _ = load_model(str(path))
    message = next(str(w.message) for w in caught if "without caching" in str(w.message))
    assert f"cannot write {full_disk}/converted/." in message and "the disk is full" in message
    assert "KNORM_CACHE_DIR" in message
    assert close(model(TOKENS), ref(TOKENS))
    assert list((full_disk / "converted").iterdir()) == []  # the partial conversion removed


_CONVERT = """
import sys
from knorm_gen.models import gguf
folder, info = gguf.ensure_converted(sys.argv[1])
print(folder)
"""


def test_concurrent_conversions_of_one_gguf_agree(tmp_path, cache_dir):
    _, path = reference_and_gguf(tmp_path, "llama")
    children = [subprocess.Popen([sys.executable, "-c", _CONVERT, str(path)], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=_env(cache_dir), preexec_fn=_cap_memory)
                for _ in range(2)]
    outs = [c.communicate(timeout=120) for c in children]
    assert [c.returncode for c in children] == [0, 0], outs
    entry = kgguf.converted_dir(kgguf.file_sha256(path))
    assert {o.strip() for o, _ in outs} == {str(entry)}
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]
    assert kgguf.cached_conversion(kgguf.file_sha256(path)) is not None
