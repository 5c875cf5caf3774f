"""knorm-batch's output and side files under hostile use (issue 20, items 4-8):
a deleted output, links to a locked output, a symlinked output rewritten, the
stats log and summary under kills and full disks, temp files left by kills.
Through the real command line on the tiny random model; kills between writes
by strace fault injection, full disks by a small tmpfs (the suite runs as root)."""

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from knorm_gen.batch import records as rec
from tests.test_hostile import CLI, REPO, ids_of, invoke, rows_file, slow_rows, wait_lines


@pytest.fixture
def fast(tiny_model_dir):
    return ["--model", str(tiny_model_dir), "--budget", "16", "--max-tokens", "3", "-q"]


def slow(tiny_model_dir, tokens):
    return ["--model", str(tiny_model_dir), "--budget", "16", "--max-tokens", str(tokens), "-q", "--batch-size", "1"]


def popen(args, **kw):
    return subprocess.Popen([*CLI, *map(str, args)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=REPO,
                            **kw)


def killed_at(syscall, n, args):
    """The CLI under strace, SIGKILLed on entering its ``n``-th ``syscall``."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}  # no .pyc renames before ours
    return subprocess.run(["strace", "-f", "-qq", "-o", "/dev/null", "-e", f"trace={syscall}",
                           "-e", f"inject={syscall}:signal=SIGKILL:when={n}", *CLI, *map(str, args)],
                          capture_output=True, cwd=REPO, timeout=300, env=env)


def entries(path):
    return [json.loads(line) for line in Path(path).read_bytes().splitlines()]  # every line whole


def temps(folder):
    return sorted(p.name for p in Path(folder).rglob(".*.tmp"))


class Tmpfs:
    """A small tmpfs at ``path``: a disk that fills up. Mounting must work (root)."""

    def __init__(self, path, size):
        self.path = Path(path)
        self.path.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(self.path)], check=True)

    def resize(self, size):
        subprocess.run(["mount", "-o", f"remount,size={size}", str(self.path)], check=True)

    def fill(self):
        with open(self.path / "filler", "wb", buffering=0) as f:
            try:
                while f.write(b"\0" * 4096):
                    pass
            except OSError:
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        subprocess.run(["umount", "-l", str(self.path)], check=True)


# ------------------------------------------------------------ 4. the output deleted during a run


def test_output_deleted_during_a_run_stops_with_exit_3(tmp_path, tiny_model_dir):
    inp, outdir, stats = slow_rows(tmp_path / "in.jsonl", n=4), tmp_path / "outdir", tmp_path / "stats.jsonl"
    out = outdir / "o.jsonl"
    args = [inp, "-o", out, "--stats-log", stats, *slow(tiny_model_dir, 60)]
    proc = popen(args)
    wait_lines(proc, out, 1)
    shutil.rmtree(outdir)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 3, err.decode()
    assert f"the output {out} was deleted (or its folder was) while this run was writing it".encode() in err
    assert not out.exists()
    again = invoke(*args)  # starts over; the stats log keeps no entry of a lost record
    assert again.exit_code == 0, again.stderr
    assert ids_of(out) == list(range(4)) and [e["id"] for e in entries(stats)] == list(range(4))


# ------------------------------------------------------------ 5. two runs on one output through a link


def test_links_to_a_locked_output_are_locked_too(tmp_path, tiny_model_dir):
    inp, out = slow_rows(tmp_path / "in.jsonl", n=30), tmp_path / "a.jsonl"
    first = popen([inp, "-o", out, *slow(tiny_model_dir, 400)])
    wait_lines(first, out, 1)
    os.symlink(out, tmp_path / "soft.jsonl")
    os.link(out, tmp_path / "hard.jsonl")
    seconds = {alias: popen([inp, "-o", tmp_path / alias, *slow(tiny_model_dir, 400)])
               for alias in ("soft.jsonl", "hard.jsonl")}
    stderr = {alias: second.communicate(timeout=300)[1] for alias, second in seconds.items()}
    still_running = first.poll() is None
    first.send_signal(signal.SIGTERM)  # finishes its row in flight: no need to wait for all of them
    first.communicate(timeout=300)
    for alias, second in seconds.items():
        assert second.returncode == 2, (alias, stderr[alias].decode())
        assert b"is being written by another knorm-batch run" in stderr[alias], alias
    assert f"(pid {first.pid})".encode() in stderr["soft.jsonl"]
    assert still_running, "the first run ended before the others were checked"
    ids = ids_of(out)
    assert ids and len(ids) == len(set(ids))


# ------------------------------------------------------------ 6. a symlinked output rewritten


def test_a_resume_through_symlinks_rewrites_their_targets(tmp_path, fast):
    inp, real = rows_file(tmp_path / "in.jsonl"), tmp_path / "real"
    real.mkdir()
    out, stats = tmp_path / "out.jsonl", tmp_path / "stats.jsonl"
    out.symlink_to(real / "o.jsonl")
    stats.symlink_to(real / "s.jsonl")
    assert invoke(inp, "-o", out, "--stats-log", stats, "--limit", 2, *fast).exit_code == 0
    for target in ("o.jsonl", "s.jsonl"):
        with open(real / target, "ab") as f:
            f.write(b'{"id": "r2", "compl')  # a kill mid-write
    result = invoke(inp, "-o", out, "--stats-log", stats, *fast)
    assert result.exit_code == 0 and "2 skipped" in result.stderr, result.stderr
    assert os.readlink(out) == str(real / "o.jsonl") and os.readlink(stats) == str(real / "s.jsonl")
    assert ids_of(real / "o.jsonl") == ["r0", "r1", "r2", "r3"]
    assert [e["id"] for e in entries(real / "s.jsonl")] == ["r0", "r1", "r2", "r3"]


# ------------------------------------------------------------ 7. the stats log and the summary under faults


def test_a_kill_between_a_record_and_its_stats_entry_is_repaired_by_the_resume(tmp_path, fast):
    inp, out, stats = rows_file(tmp_path / "in.jsonl"), tmp_path / "out.jsonl", tmp_path / "stats.jsonl"
    args = [inp, "-o", out, "--stats-log", stats, *fast, "--batch-size", "1"]
    # fsyncs: record 1, entry 1, ..., record 4 (the 7th): killed with record 4 written, its entry not
    killed = killed_at("fsync", 7, args)
    assert killed.returncode in (-9, 137), killed.stderr.decode()
    assert ids_of(out) == ["r0", "r1", "r2", "r3"] and [e["id"] for e in entries(stats)] == ["r0", "r1", "r2"]
    result = invoke(*args)
    assert result.exit_code == 0 and "4 skipped" in result.stderr, result.stderr
    records = [json.loads(line) for line in out.read_bytes().splitlines()]
    assert entries(stats) == [rec.stats_entry(r, n) for n, r in enumerate(records, 1)]  # rebuilt exactly


def test_a_full_disk_under_the_stats_log_names_it_and_the_resume_completes_it(tmp_path, fast):
    inp, out, summary = rows_file(tmp_path / "in.jsonl", n=40), tmp_path / "out.jsonl", tmp_path / "summary.json"
    with Tmpfs(tmp_path / "small", "16k") as disk:
        stats = disk.path / "stats.jsonl"
        args = [inp, "-o", out, "--stats-log", stats, "--summary-json", summary, "--batch-size", "8", *fast]
        result = invoke(*args)
        assert result.exit_code == 3, result.stderr
        assert f"cannot write the stats log {stats}: No space left on device" in result.stderr
        written = ids_of(out)
        assert 0 < len(written) < 40
        assert json.loads(summary.read_text())["ok"] == len(written)  # the summary counts what was written
        assert len(entries(stats)) < len(written)
        disk.resize("1m")
        result = invoke(*args)
        assert result.exit_code == 0, result.stderr
        assert [e["id"] for e in entries(stats)] == ids_of(out)  # one entry per record, in its order
        assert sorted(ids_of(out)) == sorted(f"r{i}" for i in range(40))


# ------------------------------------------------------------ 8. temp files left by kills and full disks


def test_temp_files_of_killed_rewrites_are_removed_at_start(tmp_path, fast):
    inp, out = rows_file(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    s1, s2 = tmp_path / "s1.json", tmp_path / "s2.json"
    rename = "rename,renameat,renameat2"
    killed = killed_at(rename, 1, [inp, "-o", out, "--summary-json", s1, "--limit", 2, *fast])  # at the summary
    assert killed.returncode in (-9, 137) and ids_of(out) == ["r0", "r1"], killed.stderr.decode()
    with open(out, "ab") as f:
        f.write(b'{"id": "r2", "compl')  # a kill mid-write: the resume rewrites the output
    killed = killed_at(rename, 1, [inp, "-o", out, "--summary-json", s2, *fast])  # at the output's rewrite
    assert killed.returncode in (-9, 137), killed.stderr.decode()
    left = temps(tmp_path)
    assert len(left) == 2 and any(n.startswith(".s1.json.") for n in left), left
    copy = next(tmp_path / n for n in left if n.startswith(".out.jsonl."))
    assert ids_of(copy) == ["r0", "r1"]  # a full copy of the output
    alive = tmp_path / f".out.jsonl.{os.getppid()}.tmp"  # a live process's rewrite in progress: kept
    alive.write_bytes(b"")
    result = invoke(inp, "-o", out, "--summary-json", s1, *fast)
    assert result.exit_code == 0, result.stderr
    assert temps(tmp_path) == [alive.name] and ids_of(out) == ["r0", "r1", "r2", "r3"]


def test_rewrites_on_a_full_disk_leave_no_temp_file(tmp_path, fast):
    inp = rows_file(tmp_path / "in.jsonl")
    with Tmpfs(tmp_path / "small", "64k") as disk:
        out, summary = disk.path / "out.jsonl", disk.path / "summary.json"
        assert invoke(inp, "-o", out, "--limit", 2, *fast).exit_code == 0
        with open(out, "ab") as f:
            f.write(b'{"id": "r2", "compl')
        before = out.read_bytes()
        disk.fill()
        result = invoke(inp, "-o", out, *fast)  # the torn line cut needs a copy: no room
        assert result.exit_code == 2, result.stderr
        assert f"cannot rewrite {out}: No space left on device" in result.stderr
        assert out.read_bytes() == before and temps(disk.path) == []
        result = invoke(inp, "-o", tmp_path / "elsewhere.jsonl", "--summary-json", summary, *fast)
        assert result.exit_code == 3 and f"cannot write summary {summary}" in result.stderr, result.stderr
        assert temps(disk.path) == []
