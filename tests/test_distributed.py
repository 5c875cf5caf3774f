"""knorm-batch across processes with a real ``mlx.launch -n 2`` (ring backend on
127.0.0.1), on a tiny random model through the same code path. --batch-size 1
keeps every row's computation the same as in one process, so outputs compare
exactly (same machine, same shapes)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from knorm_gen.batch.job import BatchOptions, BatchUsageError, run_batch
from knorm_gen.batch.distributed import Group, local_parts, part_path, shard_of
from knorm_gen.batch.resume import merge_records
from knorm_gen.batch import records as rec
from knorm_gen.batch.rows import Row, RowError

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TOKENS_KILLED = 150  # long enough rows that a kill lands mid-run
TIMING = {"prefill_s", "decode_s", "prompt_tps", "generation_tps", "peak_memory_gb"}


def rows(path, n=10, slow=False):
    prompt = "Tell a long story. " * 8 if slow else "Count to {}."
    path.write_text("".join(json.dumps({"id": f"r{i}", "prompt": prompt.format(i)}) + "\n" for i in range(n)))
    return path


def args(inp, out, model, *extra, tokens=4):
    return [str(inp), "-o", str(out), "--model", str(model), "--budget", "16", "--max-tokens", str(tokens),
            "--batch-size", "1", "-q", *map(str, extra)]


def launch(n, argv, **kw):
    cmd = [str(BIN / "mlx.launch"), "-n", str(n), "--python", sys.executable, "--", "-m", "knorm_gen.cli", *argv]
    return subprocess.run(cmd, capture_output=True, cwd=REPO, timeout=kw.pop("timeout", 300), **kw)


def single(argv):
    return subprocess.run([sys.executable, "-m", "knorm_gen.cli", *argv], capture_output=True, cwd=REPO,
                          timeout=300)


def untimed(path):
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in Path(path).read_text().splitlines()]


def test_two_ranks_equal_one_process_record_for_record(tmp_path, tiny_model_dir):
    inp = rows(tmp_path / "rows.jsonl")
    with open(inp, "a") as f:
        f.write('{"id": "bad", "prompt": ""}\n')  # an error record is merged like the others
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    assert single(args(inp, one, tiny_model_dir)).returncode == 1  # one row fails
    proc = launch(2, args(inp, two, tiny_model_dir, "--stats-log", tmp_path / "stats.jsonl",
                          "--summary-json", tmp_path / "summary.json"))
    assert proc.returncode == 0, proc.stderr.decode()
    assert untimed(two) == untimed(one)  # in input order, texts and stats
    assert local_parts(str(two)) == []  # merged and removed
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["rows"], summary["ok"], summary["failed"], summary["exit_code"]) == (11, 10, 1, 1)
    assert [r["rows"] for r in summary["ranks"]] == [6, 5]  # rows 0, 2, ... on rank 0
    stats = [json.loads(line) for line in (tmp_path / "stats.jsonl").read_text().splitlines()]
    assert [s["line"] for s in stats] == list(range(1, 12))
    err = proc.stderr.decode()
    assert "rank 0: 6 rows" in err and "rank 1: 5 rows" in err and err.count("knorm-batch: 11 rows") == 1


def rank_pid(out_marker, rank):
    """The pid of the knorm-batch process with this MLX_RANK whose command line names out_marker."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if out_marker.encode() in cmdline and b"knorm_gen.cli" in cmdline and f"MLX_RANK={rank}".encode() in \
                environ.split(b"\0"):
            return int(pid)
    return None


def kill_rank_after(tmp_path, inp, out, model, rank, k):
    cmd = [str(BIN / "mlx.launch"), "-n", "2", "--python", sys.executable, "--", "-m", "knorm_gen.cli",
           *args(inp, out, model, tokens=TOKENS_KILLED)]
    launcher = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=REPO)
    part = Path(part_path(str(out), rank, 2))
    deadline = time.monotonic() + 120
    while not (part.exists() and part.read_bytes().count(b"\n") >= k):
        assert launcher.poll() is None and time.monotonic() < deadline, "the launch ended early"
        time.sleep(0.05)
    pid = rank_pid(str(out), rank)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    launcher.communicate(timeout=120)  # the launcher stops the other rank: no hang
    return {p.name: p.read_bytes()[: p.read_bytes().rfind(b"\n") + 1] for p in local_parts(str(out))}


@pytest.fixture(scope="module")
def killed_launch(tmp_path_factory, tiny_model_dir):
    """One launch whose rank 1 was SIGKILLed after 2 records: its folder, a copy of what the kill left
    there, and the records finished before it. Each rerun variant starts from that copy, at the same paths."""
    work = tmp_path_factory.mktemp("killed")
    inp, out = rows(work / "rows.jsonl", n=8, slow=True), work / "out.jsonl"
    before = kill_rank_after(work, inp, out, tiny_model_dir, rank=1, k=2)
    finished = [line for blob in before.values() for line in blob.splitlines()]
    assert 2 <= len(finished) < 8, "the kill should land mid-run"
    left = {p.name: p.read_bytes() for p in work.iterdir() if p.is_file()}
    return work, left, finished


@pytest.mark.parametrize("rerun_ranks", [2, 1, 3], ids=["same-size", "one-process", "three-ranks"])
def test_kill_9_of_a_rank_then_rerun_gives_every_id_once(killed_launch, tiny_model_dir, rerun_ranks):
    work, left, finished = killed_launch
    for p in work.iterdir():  # back to what the kill left, whatever an earlier variant wrote
        if p.is_file():
            p.unlink()
    for name, data in left.items():
        (work / name).write_bytes(data)
    inp, out = work / "rows.jsonl", work / "out.jsonl"
    argv = args(inp, out, tiny_model_dir, tokens=TOKENS_KILLED)
    proc = launch(rerun_ranks, argv) if rerun_ranks > 1 else single(argv)
    assert proc.returncode == 0, proc.stderr.decode()
    lines = out.read_bytes().splitlines()
    ids = [json.loads(line)["id"] for line in lines]
    # each id once; a launch writes input order, one process appends to what was done
    assert (ids if rerun_ranks > 1 else sorted(ids)) == [f"r{i}" for i in range(8)]
    for line in finished:
        assert line in lines  # finished records byte-identical
    assert local_parts(str(out)) == []


def test_a_rank_that_cannot_start_fails_the_launch_with_its_error(tmp_path):
    inp = rows(tmp_path / "rows.jsonl", n=2)
    proc = launch(2, [str(inp), "-o", str(tmp_path / "out.jsonl"), "--model", str(tmp_path / "missing-model")],
                  timeout=120)
    err = proc.stderr.decode()
    assert "does not exist" in err and "Traceback" not in err
    assert not (tmp_path / "out.jsonl").exists()


class TwoRanks(Group):
    """Rank 0 of a pretend pair whose other rank reports ``failure`` at the start."""

    def __init__(self, failure):
        super().__init__(rank=0, size=2, handle=None)
        object.__setattr__(self, "failure", failure)

    def gather_json(self, value):
        return [value, self.failure]

    def gather_bytes(self, data):
        return [data, b""]


def test_every_rank_hears_of_another_ranks_start_failure(tmp_path, tiny_model_dir):
    from knorm_gen.models.load import load_model

    model, tok = load_model(str(tiny_model_dir))
    inp = rows(tmp_path / "rows.jsonl", n=2)
    with pytest.raises(BatchUsageError, match="rank 1: cannot load model 'x': the path x does not exist"):
        run_batch(str(inp), str(tmp_path / "out.jsonl"), BatchOptions(), model=model, tokenizer=tok,
                  progress=False, group=TwoRanks("cannot load model 'x': the path x does not exist"))
    assert not (tmp_path / "out.jsonl").exists()


def test_sharding_and_merge_order():
    assert [shard_of(i, 3) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert part_path("/a/out.jsonl", 1, 4) == "/a/out.part-1-of-4.jsonl"
    ok = [rec.dump_record({"id": i, "error": None, "fingerprint": "f"}) for i in ("a", "b")]
    bad = rec.dump_record({"id": None, "error": {"type": "invalid_json", "message": "m", "line": 2}})
    items = [Row(1, "a", "prompt"), RowError(2, "invalid_json", "m"), Row(3, "b", "prompt")]
    merged = merge_records(iter(items), [ok[1]], [ok[0] + bad, b""], {"a": "f", "b": "f"}, False)
    assert merged == [ok[0], bad, ok[1]]
