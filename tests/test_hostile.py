"""knorm-batch under hostile but realistic use: each test reproduces one attack
(issue 9) through the real command line, on a tiny random model so it stays
fast. Subprocesses where signals, locks, pipes or two processes are involved."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from knorm_gen.batch import rows
from knorm_gen.cli.batch import batch_command

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "knorm_gen.cli"]


@pytest.fixture
def fast(tiny_model_dir):
    return ["--model", str(tiny_model_dir), "--budget", "16", "--max-tokens", "3", "-q"]


def invoke(*args, input=None, env=None):
    return CliRunner().invoke(batch_command, [str(a) for a in args], input=input, catch_exceptions=False, env=env)


def rows_file(path, n=4, ids=True):
    path.write_text("".join(json.dumps({**({"id": f"r{i}"} if ids else {}), "prompt": f"Row number {i}."}) + "\n"
                            for i in range(n)))
    return path


def ids_of(path):
    return [json.loads(line)["id"] for line in Path(path).read_bytes().splitlines()]


def run(args, **kw):
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, cwd=REPO, timeout=300, **kw)


# ------------------------------------------------------------ 1. side files


@pytest.mark.parametrize("role", ["-o", "--stats-log", "--summary-json"])
def test_side_file_equal_to_the_input_is_refused(tmp_path, fast, role):
    inp = rows_file(tmp_path / "same.jsonl")
    before = inp.read_bytes()
    extra = ["-o", tmp_path / "out.jsonl"] if role != "-o" else []
    result = invoke(inp, *extra, role, inp, "--overwrite", *fast)
    assert result.exit_code == 2 and "is the same file as the input" in result.stderr
    assert inp.read_bytes() == before


def test_links_count_as_the_same_file(tmp_path, fast):
    inp = rows_file(tmp_path / "in.jsonl")
    os.link(inp, tmp_path / "hard.jsonl")
    os.symlink(inp, tmp_path / "soft.jsonl")
    for alias in ("hard.jsonl", "soft.jsonl"):
        result = invoke(inp, "-o", tmp_path / alias, "--overwrite", *fast)
        assert result.exit_code == 2 and "same file" in result.stderr, alias
    out = tmp_path / "out.jsonl"
    result = invoke(inp, "-o", out, "--stats-log", out, *fast)
    assert result.exit_code == 2 and "the stats log" in result.stderr and "the output" in result.stderr
    assert rows_file(tmp_path / "check.jsonl").read_bytes() == inp.read_bytes()


# ------------------------------------------------------------ 2. two runs on one output


def slow_rows(path, n=6):
    path.write_text("".join(json.dumps({"id": i, "prompt": "Tell a long story. " * 10}) + "\n" for i in range(n)))
    return path


def test_a_second_run_on_a_locked_output_exits_2_naming_the_holder(tmp_path, tiny_model_dir):
    inp, out = slow_rows(tmp_path / "in.jsonl", n=2), tmp_path / "out.jsonl"
    args = [inp, "-o", out, "--model", tiny_model_dir, "--budget", "16", "--max-tokens", "300", "-q",
            "--batch-size", "1"]
    first = subprocess.Popen([*CLI, *map(str, args)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=REPO)
    deadline = time.monotonic() + 120
    while not (out.exists() and out.read_bytes().count(b"\n") >= 1):
        assert first.poll() is None and time.monotonic() < deadline, "first run ended early"
        time.sleep(0.01)
    first.send_signal(signal.SIGSTOP)  # paused with its second row in flight: it holds the lock, whatever the speed
    try:
        assert first.poll() is None, "first run ended early"
        second = run(args)
    finally:
        first.send_signal(signal.SIGCONT)
    assert second.returncode == 2
    assert f"being written by another knorm-batch run (pid {first.pid})".encode() in second.stderr
    assert first.wait(timeout=300) == 0
    assert sorted(ids_of(out)) == list(range(2))  # every id once


def test_resume_refuses_an_output_holding_an_id_twice(tmp_path, fast):
    inp, out = rows_file(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    assert invoke(inp, "-o", out, *fast).exit_code == 0
    lines = out.read_bytes().splitlines(keepends=True)
    out.write_bytes(b"".join(lines + lines[:1]))  # what two concurrent runs left
    result = invoke(inp, "-o", out, *fast)
    assert result.exit_code == 2 and "holds a successful record for id 'r0' twice" in result.stderr


# ------------------------------------------------------------ 3. interrupted --overwrite


def wait_lines(proc, path, k, timeout=120):
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_bytes().count(b"\n") >= k):
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline
        time.sleep(0.02)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_prints_a_resume_command_without_overwrite(tmp_path, tiny_model_dir, sig):
    inp, out = slow_rows(tmp_path / "in.jsonl", n=6), tmp_path / "out.jsonl"
    args = [inp, "-o", out, "--overwrite", "--model", tiny_model_dir, "--budget", "16", "--max-tokens", "150",
            "-q", "--batch-size", "2"]
    proc = subprocess.Popen([*CLI, *map(str, args)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=REPO)
    wait_lines(proc, out, 2)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err.decode()
    text = err.decode()
    assert "rows: " in text  # the summary is printed, as for Ctrl-C
    command = text.split("to resume, run:\n", 1)[1].strip().splitlines()[0]
    assert "--overwrite" not in command and command.startswith("knorm-batch ")
    first = out.read_bytes()
    import shlex
    again = run(shlex.split(command)[1:])
    assert again.returncode == 0, again.stderr.decode()
    assert out.read_bytes().startswith(first) and sorted(ids_of(out)) == list(range(6))


# ------------------------------------------------------------ 4. fingerprints


def test_inserted_line_shifts_default_ids_and_is_refused(tmp_path, fast):
    inp, out = rows_file(tmp_path / "in.jsonl", ids=False), tmp_path / "out.jsonl"
    assert invoke(inp, "-o", out, *fast).exit_code == 0
    inp.write_text('{"prompt": "A new first row."}\n' + inp.read_text())
    before = out.read_bytes()
    result = invoke(inp, "-o", out, *fast)
    assert result.exit_code == 2
    assert "4 finished record(s) were made from another row or other settings" in result.stderr
    assert "--overwrite" in result.stderr and "--accept-old-records" in result.stderr
    assert out.read_bytes() == before


@pytest.mark.parametrize("change", [["--budget", "32"], ["--keep", "high"], ["--max-tokens", "2"],
                                    ["--model", "OTHER"]])
def test_changed_settings_are_refused(tmp_path, fast, tiny_model_dir, change):
    inp, out = rows_file(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    assert invoke(inp, "-o", out, *fast).exit_code == 0
    if change[0] == "--model":  # the same weights under another spec is another model as far as records go
        other = tmp_path / "other-model"
        other.symlink_to(tiny_model_dir)
        change = ["--model", other]
    result = invoke(inp, "-o", out, *fast, *change)
    assert result.exit_code == 2 and "4 finished record(s)" in result.stderr


def test_unchanged_rerun_skips_and_accept_keeps_old_records(tmp_path, fast):
    inp, out = rows_file(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    assert invoke(inp, "-o", out, *fast).exit_code == 0
    result = invoke(inp, "-o", out, *fast)
    assert result.exit_code == 0 and "4 skipped" in result.stderr
    before = out.read_bytes()
    result = invoke(inp, "-o", out, *fast, "--budget", "32", "--accept-old-records")
    assert result.exit_code == 0 and "4 skipped" in result.stderr and out.read_bytes() == before


def test_records_whose_ids_left_the_input_are_refused(tmp_path, fast):
    inp, out = rows_file(tmp_path / "in.jsonl"), tmp_path / "out.jsonl"
    assert invoke(inp, "-o", out, *fast).exit_code == 0
    rows_file(inp, n=3)
    result = invoke(inp, "-o", out, *fast)
    assert result.exit_code == 2 and "1 record(s) have ids that are no longer in the input (first: id 'r3')" in \
        result.stderr
    assert invoke(inp, "-o", out, *fast, "--accept-old-records").exit_code == 0
    assert ids_of(out) == ["r0", "r1", "r2", "r3"]


# ------------------------------------------------------------ 5, 6. lines that break parsers


def test_unparseable_lines_become_error_records_and_resume_works(tmp_path, fast):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    deep = "[" * 100_000 + "]" * 100_000
    inp.write_text(
        '{"id": "a", "prompt": "Hello."}\n'
        '{"id": "deep", "prompt": "x", "extra": ' + deep + '}\n'
        '{"id": ' + "7" * 5000 + ', "prompt": "x"}\n'
        '{"id": "nan", "prompt": "x", "score": NaN}\n'
        '{"id": "inf", "prompt": "x", "temperature": Infinity}\n'
        '{"id": "big", "prompt": "x", "temperature": 1e999}\n'
        '{"id": "b", "prompt": "Bye."}\n')
    for attempt in range(2):  # the rerun must not crash on the same lines either
        result = invoke(inp, "-o", out, *fast)
        assert result.exit_code == 1, result.stderr
    records = [rows.loads_strict(line) for line in out.read_text().splitlines()]  # strict JSON throughout
    errors = {r["error"]["line"]: r["error"]["type"] for r in records if r["error"]}
    assert errors == {2: "invalid_json", 3: "invalid_json", 4: "invalid_json", 5: "invalid_json",
                      6: "invalid_json"}
    assert sorted(r["id"] for r in records if r["error"] is None) == ["a", "b"]
    assert "not a JSON number" in errors_text(records, 4) and "nested too deeply" in errors_text(records, 2)


def errors_text(records, line):
    return next(r["error"]["message"] for r in records if r["error"] and r["error"]["line"] == line)


@pytest.mark.parametrize("args, message", [
    (["--temperature", "inf"], "temperature must be a finite number"),
    (["--temperature", "nan"], "temperature must be a finite number"),
    (["--top-p", "nan"], "top_p must be a finite number"),
    (["--seed", "-1"], "seed must be an integer from 0 to 2**64 - 1"),
    (["--seed", str(2**64)], "seed must be an integer from 0 to 2**64 - 1"),
    (["--skip-layers", "99"], "skip_layers index 99 is out of range for a model with 4 layers"),
    (["--skip-layers", "5-2"], "the range '5-2' is empty"),
    (["--layer-budgets", "9:64"], "layer_budgets index 9 is out of range"),
    (["--model", "/nonexistent/model"], "the path /nonexistent/model does not exist"),
])
def test_bad_settings_are_usage_errors(tmp_path, fast, args, message):
    inp = rows_file(tmp_path / "in.jsonl")
    result = invoke(inp, "-o", tmp_path / "out.jsonl", *fast, *args)
    assert result.exit_code == 2 and message in result.stderr, result.stderr
    assert not (tmp_path / "out.jsonl").exists()


# ------------------------------------------------------------ 7, 8. pipes and devices


def test_pipes_work_as_input(tmp_path, tiny_model_dir):
    inp = rows_file(tmp_path / "in.jsonl", n=3)
    model = ["--model", str(tiny_model_dir), "--budget", "16", "--max-tokens", "2", "-q"]
    for stdin in (open(inp, "rb"), subprocess.Popen(["cat", str(inp)], stdout=subprocess.PIPE).stdout):
        via_stdin = subprocess.run([*CLI, "/dev/stdin", *model], stdin=stdin, capture_output=True, cwd=REPO,
                                   timeout=120)
        assert via_stdin.returncode == 0, via_stdin.stderr.decode()
        assert [json.loads(x)["id"] for x in via_stdin.stdout.splitlines()] == ["r0", "r1", "r2"]
    cmd = " ".join([*CLI, "<(cat " + str(inp) + ")", *model])
    substituted = subprocess.run(["bash", "-c", cmd], capture_output=True, cwd=REPO, timeout=120)
    assert substituted.returncode == 0, substituted.stderr.decode()
    assert len(substituted.stdout.splitlines()) == 3


def test_output_to_dev_stdout_through_a_pipe_does_not_hang(tmp_path, tiny_model_dir):
    inp = rows_file(tmp_path / "in.jsonl", n=3)
    cmd = " ".join([*CLI, str(inp), "-o", "/dev/stdout", "--model", str(tiny_model_dir), "--budget", "16",
                    "--max-tokens", "2", "-q", "| cat"])
    proc = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()
    assert [json.loads(x)["id"] for x in proc.stdout.splitlines()] == ["r0", "r1", "r2"]


def test_closed_output_pipe_ends_quietly_with_141(tmp_path, tiny_model_dir):
    inp = slow_rows(tmp_path / "in.jsonl", n=300)  # more output than a pipe buffers
    cmd = " ".join([*CLI, str(inp), "-o", "-", "--model", str(tiny_model_dir), "--budget", "16",
                    "--max-tokens", "2", "-q", "| head -1"])
    proc = subprocess.run(["bash", "-c", cmd + "; echo \"rc=${PIPESTATUS[0]}\" >&2"], capture_output=True,
                          cwd=REPO, timeout=120)
    assert len(proc.stdout.splitlines()) == 1
    assert proc.stderr.decode().strip() == "rc=141"  # nothing else: no traceback, no noise


def test_full_disk_is_an_io_error_with_one_line_and_no_traceback(tmp_path, fast):
    inp = rows_file(tmp_path / "in.jsonl")
    for args in (["-o", "/dev/full"], ["-o", tmp_path / "out.jsonl", "--stats-log", "/dev/full"]):
        result = invoke(inp, *args, *fast)
        assert result.exit_code == 3, result.stderr
        assert "Traceback" not in result.stderr and "No space left on device" in result.stderr


def test_ctrl_c_before_rows_run_is_an_interrupt(tmp_path, tiny_model_dir):
    fifo = tmp_path / "rows.fifo"
    os.mkfifo(fifo)
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen([*CLI, str(fifo), "-o", str(out), "--model", str(tiny_model_dir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=REPO)
    deadline = time.monotonic() + 60
    while True:  # a FIFO opens for writing only once the runner has it open for reading
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    os.close(fd)
    assert proc.returncode == 130 and b"interrupted before any row ran" in err and b"Traceback" not in err
    assert not out.exists()


# ------------------------------------------------------------ job files and the stats log


def test_job_paths_expand_the_home_folder(tmp_path, fast):
    home = tmp_path / "home"
    home.mkdir()
    rows_file(home / "in.jsonl")
    job = tmp_path / "job.toml"
    job.write_text('input = "~/in.jsonl"\noutput = "~/out.jsonl"\n')
    result = invoke("--job", job, *fast, env={"HOME": str(home)})
    assert result.exit_code == 0, result.stderr
    assert ids_of(home / "out.jsonl") == ["r0", "r1", "r2", "r3"] and not (Path.cwd() / "~").exists()


def test_input_beside_a_job_with_its_own_input_needs_an_output(tmp_path, fast):
    rows_file(tmp_path / "job-rows.jsonl")
    other = rows_file(tmp_path / "other.jsonl", n=2)
    job = tmp_path / "job.toml"
    job.write_text('input = "job-rows.jsonl"\noutput = "job-out.jsonl"\n')
    result = invoke(other, "--job", job, *fast)
    assert result.exit_code == 2 and "also give -o/--output" in result.stderr
    assert not (tmp_path / "job-out.jsonl").exists()
    result = invoke(other, "--job", job, "-o", tmp_path / "other-out.jsonl", *fast)
    assert result.exit_code == 0 and ids_of(tmp_path / "other-out.jsonl") == ["r0", "r1"]


def test_torn_stats_log_line_is_repaired(tmp_path, fast):
    inp, out, stats = rows_file(tmp_path / "in.jsonl", n=2), tmp_path / "out.jsonl", tmp_path / "stats.jsonl"
    assert invoke(inp, "-o", out, "--stats-log", stats, *fast, "--limit", "1").exit_code == 0
    with open(stats, "ab") as f:
        f.write(b'{"id": "r1", "line": 2, "finish_re')  # a kill mid-write
    assert invoke(inp, "-o", out, "--stats-log", stats, *fast).exit_code == 0
    entries = [json.loads(line) for line in stats.read_text().splitlines()]  # every line whole
    assert [e["id"] for e in entries] == ["r0", "r1"]
