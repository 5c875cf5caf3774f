"""knorm-batch through Click's CliRunner, and real subprocesses for kill -9 and Ctrl-C."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from knorm_gen.models.load import get_model
from knorm_gen.cli.batch import batch_command

TIMING = {"prefill_s", "decode_s", "prompt_tps", "generation_tps", "peak_memory_gb"}
FAST = ["--budget", "16", "--max-tokens", "2"]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def loaded_model():
    get_model("default")  # cached in-process: every CliRunner call reuses it


@pytest.fixture
def tiny(tiny_model_dir):
    """Options that run the tiny random model: exact and fast, for runner behaviour."""
    return ["--model", str(tiny_model_dir), *FAST]


def invoke(*args, input=None):
    return CliRunner().invoke(batch_command, [str(a) for a in args], input=input, catch_exceptions=False)


def lines(path):
    return Path(path).read_bytes().splitlines(keepends=True)


def records(path):
    return [json.loads(line) for line in lines(path)]


def untimed(record):
    out = {k: v for k, v in record.items() if k not in TIMING}
    if out.get("answers"):
        out["answers"] = [untimed(a) for a in out["answers"]]
    return out


def test_default_output_beside_input_and_summary(tmp_path, loaded_model):
    inp = tmp_path / "prompts.jsonl"
    inp.write_text('{"id": "a", "prompt": "Say hi."}\n{"id": "b", "prompt": "Say bye."}\n')
    result = invoke(inp, *FAST)
    assert result.exit_code == 0, result.output
    out = tmp_path / "prompts.completions.jsonl"
    assert [r["id"] for r in records(out)] == ["a", "b"]
    assert "2 rows: 2 ok, 0 failed, 0 skipped" in result.stderr and "compression mean" in result.stderr
    # the default bounds all 30 layers: the summary states the ceiling (30 x budget x 1536 bytes per position)
    budget = int(FAST[FAST.index("--budget") + 1]) if "--budget" in FAST else 512
    assert f"KV memory per row: at most {30 * budget * 1536 / 2**20:.1f} MiB for the document whatever its length" \
        in result.stderr
    assert result.stdout == ""


def test_stdin_to_stdout(tmp_path, tiny):
    result = invoke("-", "-o", "-", *tiny, "--quiet", input='{"prompt": "Say hi."}\n')
    assert result.exit_code == 0
    (record,) = [json.loads(line) for line in result.stdout.splitlines()]
    assert record["id"] == 1 and record["error"] is None and "1 rows: 1 ok" in result.stderr


def test_hostile_inputs_give_documented_records(tmp_path, tiny):
    inp = tmp_path / "hostile.jsonl"
    inp.write_bytes(
        b"\xef\xbb\xbf" + b'{"id": "bom", "prompt": "Say hi."}\r\n'   # 1 BOM + CRLF
        b'{"id": "bytes", "prompt": "\xff\xfe"}\r\n'                  # 2 not UTF-8
        b'{"id": "trunc", "prompt": "Say\n'                            # 3 truncated JSON
        b'{"id": "big", "prompt": "' + b"lorem " * 350_000 + b'"}\n'   # 4 2 MB, longer than the context
        b'{"id": "types", "messages": "x"}\n'                          # 5 wrong type
        b'{"id": "both", "prompt": "a", "messages": []}\n'             # 6 prompt and messages
        b'{"id": "empty", "context": "c", "questions": []}\n'          # 7 empty questions
        b'{"id": "bom", "prompt": "again"}\n'                          # 8 duplicate id
        b'{"id": "last", "prompt": "Say bye."}'                        # 9 no final newline
    )
    out = tmp_path / "out.jsonl"
    result = invoke(inp, "-o", out, *tiny)
    assert result.exit_code == 1
    got = [(r["id"], r["error"] and r["error"]["type"], r["error"] and r["error"]["line"]) for r in records(out)]
    # batched by default: records appear as rows finish (bad rows at once, good ones when decoded)
    assert sorted(got, key=repr) == sorted(
        [("bom", None, None), (None, "invalid_utf8", 2), (None, "invalid_json", 3),
         ("big", "prompt_too_long", 4), ("types", "invalid_row", 5), ("both", "invalid_row", 6),
         ("empty", "invalid_row", 7), (None, "duplicate_id", 8), ("last", None, None)], key=repr)
    assert "9 rows: 2 ok, 7 failed" in result.stderr


def test_empty_file_exits_zero(tmp_path, tiny):
    inp = tmp_path / "empty.jsonl"
    inp.write_bytes(b"")
    result = invoke(inp, *tiny)
    assert result.exit_code == 0 and "0 rows: 0 ok, 0 failed, 0 skipped" in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--budget", "0"], "budget must be an integer >= 1"),
    (["--keep", "best"], "'best' is not one of"),
    (["--skip-layers", "a,b"], "skip_layers must be layer indices"),
    (["--budget", "8", "--n-sink", "4", "--recent", "4"], "n_sink + recent must be < budget"),
    (["--max-tokens", "0"], "max_tokens must be an integer >= 1"),
])
def test_bad_options_exit_2(tmp_path, tiny_model_dir, args, message):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "x"}\n')
    result = invoke(inp, "--model", tiny_model_dir, *args)
    assert result.exit_code == 2 and message in result.stderr
    assert not (tmp_path / "in.completions.jsonl").exists()


def test_unreadable_input_and_unwritable_output_exit_2(tmp_path):
    assert invoke(tmp_path / "missing.jsonl").exit_code == 2
    result = invoke(tmp_path)  # a directory
    assert result.exit_code == 2 and "is a directory" in result.stderr
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "x"}\n')
    result = invoke(inp, "-o", inp / "out.jsonl")  # parent is a file
    assert result.exit_code == 2 and "cannot write output" in result.stderr
    result = invoke()
    assert result.exit_code == 2 and "missing INPUT" in result.stderr


def test_version():
    result = invoke("--version")
    assert result.exit_code == 0 and "knorm-batch, version" in result.stdout


def test_job_file_equals_flags_and_flags_override(tmp_path, loaded_model):
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    inp = tmp_path / "rows.jsonl"
    inp.write_text('{"id": "a", "prompt": "Name a fruit."}\n{"id": "b", "context": "Ice is cold.", "question": "Is ice hot?"}\n')
    job = jobs / "job.toml"
    job.write_text('input = "../rows.jsonl"\noutput = "../out/job.jsonl"\nmodel = "default"\n'
                   '[eviction]\nbudget = 16\nn_sink = 2\nrecent = 4\nkeep = "low"\nskip_layers = [0]\n'
                   '[generation]\nmax_tokens = 3\ntemperature = 0.0\n')
    assert invoke("--job", job, "-q").exit_code == 0
    flags = tmp_path / "flags.jsonl"
    assert invoke(inp, "-o", flags, "--budget", "16", "--n-sink", "2", "--recent", "4", "--skip-layers", "0",
                  "--keep", "low", "--max-tokens", "3", "-q").exit_code == 0
    by_job = records(tmp_path / "out" / "job.jsonl")
    assert [untimed(r) for r in by_job] == [untimed(r) for r in records(flags)]
    assert by_job[0]["config"]["recent"] == 4 and by_job[0]["config"]["skip_layers"] == [0]

    over = tmp_path / "over.jsonl"
    assert invoke("--job", job, "-o", over, "--max-tokens", "1", "--budget", "none", "-q").exit_code == 0
    r = records(over)[0]
    assert r["config"]["max_tokens"] == 1 and r["config"]["budget"] is None and r["config"]["recent"] == 4


@pytest.mark.parametrize("text, message", [
    ('inputs = "x"\n', "unknown key 'inputs'"),
    ('[eviction]\nbugdet = 3\n', "unknown key 'bugdet' in [eviction]"),
    ('[generation]\ntemperature = "hot"\n', "temperature must be a finite number, got 'hot'"),
    ('input = \n', "not valid TOML"),
])
def test_bad_job_file_exit_2(tmp_path, text, message):
    job = tmp_path / "job.toml"
    job.write_text(text)
    result = invoke("--job", job)
    assert result.exit_code == 2 and message in result.stderr


def test_shipped_job_files_parse():
    from knorm_gen.cli.job_file import load_job

    for job in sorted((REPO / "jobs").glob("*.toml")):
        settings = load_job(str(job))
        assert Path(settings["input"]).exists(), job  # a JSONL file or a folder


# ---------------------------------------------------------------- subprocesses


def start(inp, out, *extra):
    cmd = [sys.executable, "-m", "knorm_gen.cli", str(inp), "-o", str(out), "--budget", "16", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=REPO)


def wait_for_lines(proc, out, k, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if out.exists() and out.read_bytes().count(b"\n") >= k:
            return
        if proc.poll() is not None:
            pytest.fail(f"runner exited early: {proc.stderr.read().decode()}")
        time.sleep(0.02)
    proc.kill()
    pytest.fail("timed out waiting for records")


def eight_rows(tmp_path):
    inp = tmp_path / "rows.jsonl"
    inp.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"Count from {i} to {i + 9}. " * 4}) + "\n"
                           for i in range(8)))
    return inp


# The tiny random model: what is killed is the runner, not a model; long answers so the signal
# lands with rows still to run.
SLOW_TINY = ("--max-tokens", "120", "--batch-size", "1")


def test_kill_9_then_rerun_loses_nothing(tmp_path, tiny_model_dir):
    inp, out = eight_rows(tmp_path), tmp_path / "out.jsonl"
    proc = start(inp, out, "--model", str(tiny_model_dir), *SLOW_TINY)
    wait_for_lines(proc, out, 3)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = out.read_bytes()
    complete = before[: before.rfind(b"\n") + 1].splitlines(keepends=True)
    assert 3 <= len(complete) < 8, "the kill should land mid-run"

    result = invoke(inp, "-o", out, "--budget", "16", "--model", str(tiny_model_dir), *SLOW_TINY)
    assert result.exit_code == 0, result.stderr
    after = lines(out)
    assert after[: len(complete)] == complete  # byte-identical
    ids = [json.loads(line)["id"] for line in after]
    assert sorted(ids) == sorted(f"r{i}" for i in range(8)) and len(set(ids)) == 8
    assert all(json.loads(line)["error"] is None for line in after)


def test_ctrl_c_finishes_the_row_then_exits_130(tmp_path, tiny_model_dir):
    inp, out = eight_rows(tmp_path), tmp_path / "out.jsonl"
    proc = start(inp, out, "--model", str(tiny_model_dir), *SLOW_TINY)
    wait_for_lines(proc, out, 2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err.decode()
    assert b"to resume, run:" in err
    data = out.read_bytes()
    assert data.endswith(b"\n") and 2 <= data.count(b"\n") < 8
    assert all(json.loads(line)["error"] is None for line in data.splitlines())


def test_skip_layers_accepts_ranges():
    from knorm_gen.eviction.config import parse_skip_layers

    assert parse_skip_layers("0-3,7") == (0, 1, 2, 3, 7)
    assert parse_skip_layers("none") == ()
    assert parse_skip_layers([0, 1]) == (0, 1)
    with pytest.raises(ValueError, match="'0-8'"):
        parse_skip_layers("0-x")


def test_kill_9_with_a_batch_in_flight_then_rerun_gives_every_id_once(tmp_path, tiny_model_dir):
    inp, out = tmp_path / "rows.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt": "Tell a long story. " * 8}) + "\n" for i in range(12)))
    args = [str(inp), "-o", str(out), "--model", str(tiny_model_dir), "--budget", "16", "--max-tokens", "400",
            "--batch-size", "3", "-q"]
    proc = subprocess.Popen([sys.executable, "-m", "knorm_gen.cli", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, cwd=REPO)
    wait_for_lines(proc, out, 3)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = out.read_bytes()
    complete = before[: before.rfind(b"\n") + 1]
    assert 3 <= complete.count(b"\n") < 12, "the kill should land with rows in flight"
    again = subprocess.run([sys.executable, "-m", "knorm_gen.cli", *args], capture_output=True, cwd=REPO, timeout=300)
    assert again.returncode == 0, again.stderr.decode()
    after = out.read_bytes()
    assert after.startswith(complete)  # finished records byte-identical
    ids = [json.loads(line)["id"] for line in after.splitlines()]
    assert sorted(ids) == list(range(12))


def test_early_factor_bounds_memory_and_says_so(tmp_path, loaded_model):
    inp = tmp_path / "prompts.jsonl"
    inp.write_text('{"id": "a", "prompt": "Say hi."}\n')
    result = invoke(inp, *FAST, "--early-factor", "8")
    assert result.exit_code == 0, result.output
    (record,) = records(tmp_path / "prompts.completions.jsonl")
    assert record["config"]["skip_layers"] == [] and record["config"]["layer_budgets"] == {
        str(i): 8 * 16 for i in range(9)}
    # SmolLM2-135M: 3 KV heads x 64 dims x (key + value) x 4 bytes per position and layer;
    # layers 0-8 hold 8 x 16 positions, the other 21 hold 16
    ceiling = 3 * 64 * 2 * 4 * (9 * 8 * 16 + 21 * 16)
    assert f"KV memory per row: at most {ceiling / 2**20:.1f} MiB for the document whatever its length" \
        in result.stderr
    clash = invoke(inp, *FAST, "--early-factor", "8", "--skip-layers", "0,1", "-o", str(tmp_path / "x.jsonl"))
    assert clash.exit_code == 2 and "early_factor" in clash.stderr


# ---------------------------------------------------------------- every setting is reachable

# A value other than the default for every config field, its text on the command line,
# and what the record's effective config then says (early_factor shows as the layout it sets).
FIELD_VALUES = {
    "budget": ("24", 24, "budget", 24),
    "ratio": ("4", 4.0, "ratio", 4.0),
    "long_documents": ("truncate", "truncate", "long_documents", "truncate"),
    "n_sink": ("2", 2, "n_sink", 2),
    "recent": ("5", 5, "recent", 5),
    "keep": ("high", "high", "keep", "high"),
    "question_score": ("best", "best", "question_score", "best"),
    "carry": ("0.5", 0.5, "carry", 0.5),
    "spread": ("0.25", 0.25, "spread", 0.25),
    "stratify": ("0.5", 0.5, "stratify", 0.5),
    "skip_layers": ("0,2", [0, 2], "skip_layers", [0, 2]),
    "layer_budgets": ("1:40", {"1": 40}, "layer_budgets", {"1": 40}),
    "early_factor": ("3", 3, "layer_budgets", {"0": 48, "1": 48}),
    "coverage": ("0.25", 0.25, "coverage", 0.25),
    "recent_share": ("0.5", 0.5, "recent", 8),  # half of budget 16
    "early_keep": ("low", "low", "layer_keep", {"0": "low", "1": "low"}),  # the first 2 of the tiny model's layers
    "layer_keep": ("1:low", {"1": "low"}, "layer_keep", {"1": "low"}),  # 0: the default's rule, question everywhere
    "max_tokens": ("3", 3, "max_tokens", 3),
    "temperature": ("0.5", 0.5, "temperature", 0.5),
    "top_p": ("0.9", 0.9, "top_p", 0.9),
    "seed": ("7", 7, "seed", 7),
    "prefill_step_size": ("64", 64, "prefill_step_size", 64),
    "chat": ("--no-chat", False, "chat", False),
    "parse_special_tokens": ("--parse-special-tokens", True, "parse_special_tokens", True),
    "question_separator": (" | ", " | ", "question_separator", " | "),
    "top_k": ("5", 5, "top_k", 5),
    "min_p": ("0.1", 0.1, "min_p", 0.1),
    "repetition_penalty": ("1.3", 1.3, "repetition_penalty", 1.3),
    "repetition_context_size": ("7", 7, "repetition_context_size", 7),
    "system_prompt": ("Be brief.", "Be brief.", "system_prompt", "Be brief."),
    "questions": ("Why?", ["Why?"], "questions", ["Why?"]),
    "context_field": ("text", "text", "context_field", "text"),
    "pin_prefix_chars": ("5", 5, "pin_prefix_chars", 5),
    "kv_bits": ("8", 8, "kv_bits", 8),
    "kv_group_size": ("32", 32, "kv_group_size", 32),
}


def test_every_config_field_is_reachable_from_the_cli_and_job_files(tmp_path, tiny_model_dir, tiny_model_dir_64):
    from dataclasses import fields

    from knorm_gen.eviction.config import EvictionConfig, GenerationConfig, RowsConfig

    names = [f.name for f in (*fields(EvictionConfig), *fields(GenerationConfig), *fields(RowsConfig))]
    assert sorted(FIELD_VALUES) == sorted(names), "a config field has no check here: add it to FIELD_VALUES"
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": "a", "prompt": "Hello there, how are you today?"}\n')
    for name, (text, toml_value, key, expected) in FIELD_VALUES.items():
        base = {"budget": 16, "max_tokens": 2} if name not in ("budget", "max_tokens") else {}
        if name == "early_factor":
            base["budget"] = 16
        model_dir = tiny_model_dir_64 if name.startswith("kv_") else tiny_model_dir  # groups divide head_dim
        if name == "kv_group_size":
            base["kv_bits"] = 8  # the group size is recorded with the bits it groups
        section = ("eviction" if name in [f.name for f in fields(EvictionConfig)] else
                   "rows" if name in [f.name for f in fields(RowsConfig)] else "generation")
        flag = "question" if name == "questions" else name
        args = [text] if text.startswith("--") else [f"--{flag.replace('_', '-')}", text]
        flag_out = tmp_path / f"{name}.flags.jsonl"
        result = invoke(inp, "-o", flag_out, "--model", model_dir, "--batch-size", "1", "-q", *args,
                        *[a for k, v in base.items() for a in (f"--{k.replace('_', '-')}", str(v))])
        assert result.exit_code == 0, (name, result.stderr)
        job = tmp_path / f"{name}.toml"
        job.write_text(f'model = {json.dumps(str(model_dir))}\nbatch_size = 1\n'
                       f"[eviction]\n" + "".join(f"{k} = {v}\n" for k, v in base.items() if k in ("budget", "kv_bits"))
                       + (f"{name} = {_toml(toml_value)}\n" if section == "eviction" else "")
                       + "[generation]\n" + "".join(f"{k} = {v}\n" for k, v in base.items() if k == "max_tokens")
                       + (f"{name} = {_toml(toml_value)}\n"
                          if section == "generation" else "")
                       + (f"[rows]\n{name} = {_toml(toml_value)}\n" if section == "rows" else ""))
        job_out = tmp_path / f"{name}.job.jsonl"
        result = invoke(inp, "-o", job_out, "--job", job, "-q")
        assert result.exit_code == 0, (name, job.read_text(), result.stderr)
        for out in (flag_out, job_out):
            (record,) = records(out)
            assert record["error"] is None and record["config"][key] == expected, (name, out.name, record["config"])


def _toml(value):
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{ " + ", ".join(f'"{k}" = {json.dumps(v)}' for k, v in value.items()) + " }"
    return json.dumps(value)


def test_a_preset_sets_the_layout_and_explicit_options_override_it(tmp_path, tiny_model_dir):
    # tiny_model_dir: 4 layers, so 'retrieval' skips the first 30% (at least two): 0, 1
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": "a", "prompt": "Hello there, how are you today?"}\n')
    runs = {"paper": (["--preset", "paper"], "low", [0, 1]),
            "retrieval": (["--preset", "retrieval"], "low", [0, 1]),
            "summarize": (["--preset", "summarize"], "keydiff", []),
            "override": (["--preset", "paper", "--keep", "random", "--skip-layers", "3"], "random", [3])}
    for name, (args, keep, skip) in runs.items():
        out = tmp_path / f"{name}.jsonl"
        result = invoke(inp, "-o", out, "--model", tiny_model_dir, "--budget", "16", "--max-tokens", "2", "-q", *args)
        assert result.exit_code == 0, (name, result.stderr)
        (record,) = records(out)
        assert (record["config"]["keep"], record["config"]["skip_layers"]) == (keep, skip), name
    job = tmp_path / "job.toml"
    job.write_text(f'model = {json.dumps(str(tiny_model_dir))}\n[eviction]\npreset = "paper"\nbudget = 16\n'
                   '[generation]\nmax_tokens = 2\n')
    out = tmp_path / "job.jsonl"
    assert invoke(inp, "-o", out, "--job", job, "-q").exit_code == 0
    (record,) = records(out)
    assert (record["config"]["keep"], record["config"]["skip_layers"]) == ("low", [0, 1])
    job.write_text('[eviction]\npreset = "fast"\n')
    result = invoke(inp, "--job", job)
    assert result.exit_code == 2 and "preset must be one of default, paper, retrieval, summarize, question, intrinsic, auto; got 'fast'" in result.stderr
    result = invoke(inp, "--preset", "fast")
    assert result.exit_code == 2 and "'fast' is not one of" in result.stderr
