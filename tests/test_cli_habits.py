"""Issue 27: the mlx_lm habits users bring (option names, knorm-generate), and
messages that say what to do. Through Click's CliRunner on the tiny random model."""

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from knorm_gen.batch import records as rec
from knorm_gen.cli.batch import batch_command
from knorm_gen.cli.generate import generate_command
from knorm_gen.models.load import get_model
from knorm_gen.batch.rows import content_digest

REPO = Path(__file__).resolve().parents[1]
LONG = "Tell a long story about the sea. " * 8  # about 270 tokens with the tiny model's byte tokenizer


def invoke(*args, input=None):
    return CliRunner().invoke(batch_command, [str(a) for a in args], input=input, catch_exceptions=False)


def generate(*args, input=None):
    return CliRunner().invoke(generate_command, [str(a) for a in args], input=input, catch_exceptions=False)


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def records(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.fixture
def tiny(tiny_model_dir):
    return ["--model", str(tiny_model_dir), "--budget", "16", "--max-tokens", "2", "--batch-size", "1"]


# ---------------------------------------------------------------- 1. mlx_lm's option names


def test_mlx_lm_aliases_set_the_same_fields(tmp_path, tiny):
    inp = write_rows(tmp_path / "in.jsonl", [{"id": "a", "prompt": "Hello there"}])
    result = invoke(inp, "-o", tmp_path / "out.jsonl", *tiny, "--temp", "0.5", "-m", "3", "--ignore-chat-template",
                    "-q")
    assert result.exit_code == 0, result.stderr
    (record,) = records(tmp_path / "out.jsonl")
    config = record["config"]
    assert (config["temperature"], config["max_tokens"], config["chat"]) == (0.5, 3, False)


@pytest.mark.parametrize("command", [invoke, generate])
def test_max_kv_size_is_a_usage_error_that_names_budget(tmp_path, command):
    args = ([tmp_path / "in.jsonl"] if command is invoke else ["-p", "hi"]) + ["--max-kv-size", "512"]
    result = command(*args)
    assert result.exit_code == 2
    assert "--budget N" in result.stderr and "--ratio R" in result.stderr
    assert "Did you mean" not in result.stderr
    # each message names only options its own command has
    assert ("--max-kv-memory" in result.stderr) == (command is invoke)
    cli = batch_command if command is invoke else generate_command
    hinted = set(re.findall(r"--[a-z][a-z-]+", result.stderr)) - {"--max-kv-size"}
    assert hinted <= {o for p in cli.params for o in p.opts}


def test_generate_max_kv_memory_names_budget_not_max_kv_size():
    result = generate("-p", "hi", "--max-kv-memory", "2GiB")
    assert result.exit_code == 2
    assert "knorm-generate runs one prompt" in result.stderr
    assert "--budget N" in result.stderr and "--ratio R" in result.stderr
    assert "--max-kv-size" not in result.stderr and "Did you mean" not in result.stderr
    options = {o for p in generate_command.params for o in p.opts}
    hinted = set(re.findall(r"--[a-z][a-z-]+", result.stderr)) - {"--max-kv-memory"}
    assert hinted <= options, hinted - options


def test_max_kv_size_in_a_job_file_names_budget(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text("max_kv_size = 512\n")
    result = invoke("--job", job)
    assert result.exit_code == 2 and "budget = N under [eviction]" in result.stderr


def test_dash_h_works_on_every_command(capsys):
    for command in (batch_command, generate_command):
        result = CliRunner().invoke(command, ["-h"])
        assert result.exit_code == 0 and "Usage:" in result.stdout and "--max-kv-size" not in result.stdout
    from knorm_gen.tuning.probe import probe_cli

    with pytest.raises(SystemExit) as stop:
        probe_cli(["-h"])
    assert stop.value.code == 0 and "Usage: knorm-probe" in capsys.readouterr().out


def _first_token(model_dir, prompt):
    from knorm_gen import generate_with_eviction

    model, tok = get_model(str(model_dir))
    return generate_with_eviction(model, tok, prompt, budget=16, max_tokens=3).tokens[0]


def test_extra_eos_token_stops_there_and_is_part_of_the_fingerprint(tmp_path, tiny, tiny_model_dir):
    inp = write_rows(tmp_path / "in.jsonl", [{"id": "a", "prompt": "Hello there"}])
    first = _first_token(tiny_model_dir, "Hello there")
    out = tmp_path / "out.jsonl"
    result = invoke(inp, "-o", out, *tiny, "-m", "5", "--extra-eos-token", first, "-q")
    assert result.exit_code == 0, result.stderr
    (record,) = records(out)
    assert record["finish_reason"] == "stop" and record["generated_tokens"] == 1
    assert record["config"]["extra_eos_tokens"] == [str(first)]
    assert first not in get_model(str(tiny_model_dir))[1].eos_token_ids  # the cached tokenizer is untouched
    again = invoke(inp, "-o", out, *tiny, "-m", "5", "-q")
    assert again.exit_code == 2 and f'extra_eos_tokens: ["{first}"] -> (not set)' in again.stderr
    bad = invoke(inp, "-o", tmp_path / "bad.jsonl", *tiny, "--extra-eos-token", "not one token")
    assert bad.exit_code == 2 and "'not one token' is not a token of this tokenizer" in bad.stderr


def test_runs_without_the_new_options_keep_their_fingerprints(tmp_path, tiny):
    row = {"id": "a", "prompt": "Hello there"}
    inp = write_rows(tmp_path / "in.jsonl", [row])
    assert invoke(inp, "-o", tmp_path / "out.jsonl", *tiny, "-q").exit_code == 0
    (record,) = records(tmp_path / "out.jsonl")
    assert not {"extra_eos_tokens", "chat_template_config", "adapter_path"} & set(record["config"])
    assert record["fingerprint"] == rec.fingerprint(content_digest(row), record["config"], record["model"])


@pytest.fixture(scope="module")
def shouting_model_dir(tmp_path_factory):
    """The tiny model with a chat template that reads a variable (``shout``)."""
    from .conftest import TINY_CHAT_TEMPLATE, make_tiny_model_dir

    path = make_tiny_model_dir(tmp_path_factory.mktemp("shouting-model"))
    template = "{% if shout %}LOUD{% endif %}" + TINY_CHAT_TEMPLATE
    jinja = path / "chat_template.jinja"
    if jinja.exists():
        jinja.write_text(template)
    else:
        config = json.loads((path / "tokenizer_config.json").read_text())
        config["chat_template"] = template
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_chat_template_config_reaches_the_template_from_flags_and_job_files(tmp_path, shouting_model_dir):
    inp = write_rows(tmp_path / "in.jsonl", [{"id": "a", "prompt": "Hello there"}])
    base = ["--model", shouting_model_dir, "--budget", "16", "-m", "1", "-q"]
    assert invoke(inp, "-o", tmp_path / "plain.jsonl", *base).exit_code == 0
    result = invoke(inp, "-o", tmp_path / "loud.jsonl", *base, "--chat-template-config", '{"shout": true}')
    assert result.exit_code == 0, result.stderr
    (plain,), (loud,) = records(tmp_path / "plain.jsonl"), records(tmp_path / "loud.jsonl")
    assert loud["prompt_tokens"] == plain["prompt_tokens"] + len("LOUD")  # one token per byte
    assert loud["config"]["chat_template_config"] == {"shout": True}
    job = tmp_path / "job.toml"
    job.write_text(f"model = {json.dumps(str(shouting_model_dir))}\nchat_template_config = {{ shout = true }}\n"
                   "[eviction]\nbudget = 16\n[generation]\nmax_tokens = 1\n")
    assert invoke(inp, "-o", tmp_path / "job.jsonl", "--job", job, "-q").exit_code == 0
    (by_job,) = records(tmp_path / "job.jsonl")
    assert by_job["prompt_tokens"] == loud["prompt_tokens"] and by_job["fingerprint"] == loud["fingerprint"]
    bad = invoke(inp, "-o", tmp_path / "bad.jsonl", *base, "--chat-template-config", "shout")
    assert bad.exit_code == 2 and "must be a JSON object" in bad.stderr


def test_adapter_path_and_trust_remote_code_go_to_mlx_lm_load(tmp_path, tiny, monkeypatch):
    import mlx_lm

    real, calls = mlx_lm.load, []
    monkeypatch.setattr(mlx_lm, "load", lambda spec, **kw: (calls.append(kw), real(spec))[1])
    adapters = tmp_path / "adapters"
    adapters.mkdir()
    inp = write_rows(tmp_path / "in.jsonl", [{"id": "a", "prompt": "Hello there"}])
    result = invoke(inp, "-o", tmp_path / "out.jsonl", *tiny, "--adapter-path", adapters, "--trust-remote-code", "-q")
    assert result.exit_code == 0, result.stderr
    assert calls == [{"adapter_path": str(adapters), "trust_remote_code": True,
                      "tokenizer_config": {"trust_remote_code": True}}]
    (record,) = records(tmp_path / "out.jsonl")
    assert record["config"]["adapter_path"] == str(adapters)
    job = tmp_path / "job.toml"  # the job file's adapter_path is relative to the job file
    job.write_text('adapter_path = "adapters"\ntrust_remote_code = true\n')
    result = invoke(inp, "-o", tmp_path / "job.jsonl", *tiny, "--job", job, "-q")
    assert result.exit_code == 0, result.stderr
    assert records(tmp_path / "job.jsonl")[0]["fingerprint"] == record["fingerprint"]


def test_adapter_path_on_a_gguf_model_or_a_missing_folder_is_a_usage_error(tmp_path, tiny_model_dir):
    inp = write_rows(tmp_path / "in.jsonl", [{"id": "a", "prompt": "Hello there"}])
    result = invoke(inp, "--adapter-path", tmp_path)  # the default model is a GGUF
    assert result.exit_code == 2 and "--adapter-path needs an mlx_lm model" in result.stderr
    assert "the embedded SmolLM2, a GGUF" in result.stderr
    result = generate("-p", "hi", "--adapter-path", tmp_path)
    assert result.exit_code == 2 and "--adapter-path needs an mlx_lm model" in result.stderr
    result = invoke(inp, "--model", tiny_model_dir, "--adapter-path", tmp_path / "nope")
    assert result.exit_code == 2 and "no such file or folder" in result.stderr


def test_verbose_prints_one_line_per_finished_row(tmp_path, tiny):
    inp = write_rows(tmp_path / "in.jsonl", [{"id": "a", "prompt": "Hello there"}, {"id": "b", "prompt": "Bye now"},
                                             {"id": "c", "messages": "x"}])
    result = invoke(inp, "-o", tmp_path / "out.jsonl", *tiny, "-q", "-v")
    assert result.exit_code == 1
    pattern = r"row '{}' \(line {}\): \d+ tokens seen, \d+ kept, \d+\.\d\dx, \d+\.\d\d s"
    for row_id, line in (("a", 1), ("b", 2)):
        assert len(re.findall(pattern.format(row_id, line), result.stderr)) == 1, result.stderr
    assert "row 'c': failed: invalid_row: line 3: field 'messages'" in result.stderr


# ---------------------------------------------------------------- 3. messages that say what to do


def test_the_first_three_row_errors_are_on_stderr(tmp_path, tiny):
    rows = [{"id": "ok", "prompt": "Hello there"}] + [{"id": f"bad{i}", "messages": i} for i in range(5)]
    inp = write_rows(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    result = invoke(inp, "-o", out, *tiny, "-q")
    assert result.exit_code == 1
    lines = result.stderr.splitlines()
    named = [line.strip() for line in lines if line.strip().startswith("id 'bad")]
    assert named == [f"id 'bad{i}': invalid_row: line {i + 2}: field 'messages' must be a non-empty list of "
                     f"{{role, content}} objects, got an integer {i}" for i in range(3)]
    assert f"... 2 more: see the error records in {out}" in result.stderr


@pytest.mark.parametrize("field", ["text", "article", "body", "document", "content"])
def test_a_document_in_another_field_gets_a_hint(tmp_path, tiny, field):
    inp = write_rows(tmp_path / "in.jsonl", [{"id": "x", field: "A long report about the sea."}])
    out = tmp_path / "out.jsonl"
    result = invoke(inp, "-o", out, *tiny, "-q")
    # every row would fail alike: a usage error before the model loads, nothing written
    assert result.exit_code == 2 and not out.exists()
    hint = f'use --context-field {field} --question "..."'
    assert hint in result.stderr and "line 1" in result.stderr and "nothing was run" in result.stderr
    # with a job question the row needs only the field
    result = invoke(inp, "-o", out, *tiny, "-q", "--question", "Summarize it.", "--overwrite")
    assert result.exit_code == 2 and f"use --context-field {field} (or" in result.stderr
    # a later row with the wrong field is its own error record, the run goes on
    inp = write_rows(tmp_path / "in2.jsonl", [{"id": "ok", "prompt": "Hello there"}, {"id": "x", field: "A report."}])
    result = invoke(inp, "-o", out, *tiny, "-q", "--overwrite")
    assert result.exit_code == 1
    assert f'use --context-field {field} --question "..."' in records(out)[1]["error"]["message"]


def test_no_hint_when_the_row_has_no_document_like_field(tmp_path, tiny):
    inp = write_rows(tmp_path / "in.jsonl", [{"id": "x", "title": "t"}])
    result = invoke(inp, "-o", tmp_path / "out.jsonl", *tiny, "-q")
    assert result.exit_code == 1 and "--context-field" not in result.stderr


@pytest.mark.parametrize("content", [b"", b"\n\n  \n"])
@pytest.mark.parametrize("quiet", [[], ["-q"]])
def test_an_empty_input_warns_and_exits_0(tmp_path, tiny, content, quiet):
    inp = tmp_path / "empty.jsonl"
    inp.write_bytes(content)
    result = invoke(inp, *tiny, *quiet)
    assert result.exit_code == 0
    assert result.stderr.count(f"warning: no rows in {inp}") == 1, result.stderr
    assert "0 rows: 0 ok, 0 failed" in result.stderr
    assert "no rows" not in invoke(inp, *tiny, "--limit", "0", "--overwrite").stderr  # asked for none


def test_a_resume_refusal_names_the_settings_that_differ(tmp_path, tiny):
    rows = [{"id": f"r{i}", "prompt": f"Row number {i}."} for i in range(3)]
    inp, out = write_rows(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    assert invoke(inp, "-o", out, *tiny, "-q").exit_code == 0
    result = invoke(inp, "-o", out, *tiny, "--budget", "8", "--keep", "low", "-q")
    assert result.exit_code == 2
    assert "3 finished record(s) were made from another row or other settings" in result.stderr
    assert "settings that differ: budget: 16 -> 8" in result.stderr and "keep: question -> low" in result.stderr
    write_rows(inp, [{**rows[0], "prompt": "Another row."}, *rows[1:]])
    result = invoke(inp, "-o", out, *tiny, "-q")
    assert result.exit_code == 2 and "settings that differ" not in result.stderr
    assert "1 of them have the same settings, so their rows changed in the input (first: id 'r0')" in result.stderr


def test_a_budget_far_below_the_prompt_warns_once_per_run(tmp_path, tiny):
    inp = write_rows(tmp_path / "in.jsonl", [{"id": i, "prompt": LONG} for i in range(3)])
    for quiet in ([], ["-q"]):
        result = invoke(inp, "-o", tmp_path / "out.jsonl", *tiny, *quiet, "--overwrite")
        assert result.exit_code == 0, result.stderr
        assert result.stderr.count("warning: --budget 16 keeps ") == 1, result.stderr
        assert re.search(r"--budget 16 keeps \d+% of this row's \d+-token prompt; below about 25% summaries drift "
                         r"off topic on the embedded model: raise --budget or check against --budget none",
                         result.stderr)
    result = invoke(inp, "-o", tmp_path / "out.jsonl", *tiny, "--budget", "200", "--overwrite")
    assert result.exit_code == 0 and "warning: --budget" not in result.stderr


# ---------------------------------------------------------------- 4. the stats log


def test_stats_log_counts_answers_as_n_answers_and_resumes_old_logs(tmp_path, tiny):
    rows = [{"id": "p", "prompt": "Hello there"}, {"id": "q", "context": "The sea is blue.",
                                                    "questions": ["What colour?", "Why?"]}]
    inp, out, stats = write_rows(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl", tmp_path / "stats.jsonl"
    assert invoke(inp, "-o", out, "--stats-log", stats, *tiny, "-q").exit_code == 0
    entries = {e["id"]: e for e in records(stats)}
    assert (entries["p"]["n_answers"], entries["q"]["n_answers"]) == (None, 2)
    assert all("answers" not in e for e in entries.values())
    # a log written before the rename, and an output that lost its last record: the resume reads the old
    # entry, keeps it (renamed) and adds the new one
    old = [{("answers" if k == "n_answers" else k): v for k, v in e.items()} for e in records(stats)]
    stats.write_text("".join(json.dumps(e) + "\n" for e in old))
    kept = [line for line in out.read_text().splitlines(keepends=True) if json.loads(line)["id"] == "q"]
    out.write_text("".join(kept))
    result = invoke(inp, "-o", out, "--stats-log", stats, *tiny, "-q")
    assert result.exit_code == 0 and "1 skipped" in result.stderr, result.stderr
    after = records(stats)
    assert sorted(e["id"] for e in after) == ["p", "q"] and all("answers" not in e for e in after)
    assert {e["id"]: e["n_answers"] for e in after} == {"p": None, "q": 2}


def test_upgrade_stats_entry_keeps_the_field_order():
    entry = {"id": 1, "line": 1, "answers": 3, "model": "m"}
    assert list(rec.upgrade_stats_entry(entry).items()) == [("id", 1), ("line", 1), ("n_answers", 3), ("model", "m")]
    assert rec.upgrade_stats_entry({"id": 1, "n_answers": None}) == {"id": 1, "n_answers": None}


# ---------------------------------------------------------------- 2. knorm-generate


def test_generate_prints_the_text_then_one_stats_line(tiny_model_dir):
    from knorm_gen import generate_with_eviction

    result = generate("--prompt", "Hello there", "--model", tiny_model_dir, "--budget", "16", "-m", "6")
    assert result.exit_code == 0, result.stderr
    model, tok = get_model(str(tiny_model_dir))
    want = generate_with_eviction(model, tok, "Hello there", budget=16, max_tokens=6)
    assert result.stdout == want.text + "\n"
    (stats,) = [line for line in result.stderr.splitlines() if line.startswith("knorm-generate: prompt")]
    assert re.fullmatch(
        rf"knorm-generate: prompt {want.prompt_tokens} tokens, kept {want.tokens_kept} of {want.tokens_seen} seen "
        rf"\(\d+\.\d\dx compression\); prompt \d+\.\d tokens/s, generation \d+\.\d tokens/s "
        rf"\({want.generated_tokens} tokens, {want.finish_reason}\); "
        rf"peak memory \d+\.\d{{3}} GB; KV kept \d+\.\d MiB of \d+\.\d MiB "
        rf"\(\d+\.\d MiB within the budget, plus \d+\.\d MiB for {want.tokens_pinned} pinned tokens held on top "
        rf"of it: the template and the answer\)", stats), stats


def test_generate_reads_stdin_takes_mlx_lm_names_and_warns_of_a_small_budget(tiny_model_dir):
    result = generate("-p", "-", "--model", tiny_model_dir, "--budget", "16", "-m", "2", "--temp", "0",
                      "--ignore-chat-template", input=LONG)
    assert result.exit_code == 0, result.stderr
    assert re.search(r"knorm-generate: prompt \d+ tokens", result.stderr)
    assert "warning: --budget 16 keeps" in result.stderr and "of the " in result.stderr
    first = _first_token(tiny_model_dir, "Hello there")
    stopped = generate("-p", "Hello there", "--model", tiny_model_dir, "--budget", "16", "-m", "5",
                       "--extra-eos-token", first)
    assert stopped.exit_code == 0 and "(1 tokens, stop)" in stopped.stderr, stopped.stderr


@pytest.mark.parametrize("args, message", [
    (["-p", "  "], "prompt is empty"),
    (["-p", "x", "--budget", "0"], "budget must be an integer >= 1"),
    (["-p", "x", "--skip-layers", "40"], "out of range"),
    (["-p", "x", "--extra-eos-token", "no such token"], "is not a token of this tokenizer"),
])
def test_generate_usage_errors_exit_2(tiny_model_dir, args, message):
    result = generate(*args, "--model", tiny_model_dir, "-m", "2")
    assert result.exit_code == 2 and message in result.stderr, result.stderr
    assert result.stdout == ""


def test_generate_is_a_console_script():
    text = (REPO / "pyproject.toml").read_text()
    assert 'knorm-generate = "knorm_gen.cli.generate:generate_command"' in text


def test_records_written_under_the_old_rule_names_resume_as_done(tmp_path, tiny):
    # A record written when the default was spelled by an old rule name (no question_score or carry in its
    # config) counts as done: the same settings, another spelling. Its line is kept as it was written.
    import json

    from knorm_gen.batch.records import fingerprint
    from knorm_gen.eviction.legacy import OLD_RULE_NAMES

    def old_name(score, carry):
        return next(n for n, f in OLD_RULE_NAMES.items() if (f["question_score"], f["carry"]) == (score, carry))

    from knorm_gen.batch.rows import content_digest

    rows = [{"id": "r0", "prompt": "Row number 0."}, {"id": "r1", "prompt": "Row number 1."}]
    inp, out = write_rows(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    assert invoke(inp, "-o", out, *tiny, "-q").exit_code == 0
    first, second = [json.loads(line) for line in out.read_text().splitlines()]
    old_config = {k: v for k, v in first["config"].items() if k not in ("question_score", "carry")}
    old_config["keep"] = old_name("mean", 0.25)  # today's default as version 0.12 wrote it, by hand
    first.update(config=old_config, completion="written by an older version",
                 fingerprint=fingerprint(content_digest(rows[0]), old_config, first["model"]))
    out.write_text(json.dumps(first) + "\n" + json.dumps(second) + "\n")
    before = out.read_text()
    result = invoke(inp, "-o", out, *tiny, "-q")
    assert result.exit_code == 0 and out.read_text() == before  # nothing ran again, nothing was refused
    # a record of other settings is still refused, naming the difference
    old_config["keep"] = old_name("best", 0.25)  # the best reading, carrying: not today's default
    first.update(config=old_config, fingerprint=fingerprint(content_digest(rows[0]), old_config, first["model"]))
    out.write_text(json.dumps(first) + "\n" + json.dumps(second) + "\n")
    result = invoke(inp, "-o", out, *tiny, "-q")
    assert result.exit_code == 2 and f"keep: {old_name('best', 0.25)} -> question" in result.stderr


# ---------------------------------------------------------------- issue 56: a newcomer's review of the commands


def _help(command):
    result = CliRunner().invoke(command, ["-h"], terminal_width=100)
    assert result.exit_code == 0, result.output
    return result.output


ROWS = re.compile(r"\b(rows?|records?|batch(es)?|kv_ceiling_bytes)\b", re.IGNORECASE)


def test_generate_help_and_verbose_lines_speak_of_one_prompt(tiny_model_dir):
    text = _help(generate_command)
    assert not ROWS.search(text), ROWS.search(text)
    assert "mlx_lm's 100" in text  # why --max-tokens is 256
    assert "--long-documents [error|truncate]" in text  # chunk answers question rows: not one prompt's
    # knorm-batch keeps the fields' own words
    from dataclasses import fields

    from knorm_gen.eviction.config import GenerationConfig

    own = {f.name: f.metadata["help"] for f in fields(GenerationConfig)}
    batch = {p.name: p.help for p in batch_command.params}
    assert all(batch[name].startswith(own[name]) for name in own)
    result = generate("-p", "Hello there", "--model", tiny_model_dir, "--budget", "16", "-m", "2", "-v")
    assert result.exit_code == 0, result.stderr
    verbose = [line for line in result.stderr.splitlines() if not line.startswith("knorm-generate: prompt")]
    assert any("KV memory: at most" in line for line in verbose), result.stderr
    assert not any(ROWS.search(line) for line in verbose), verbose


def test_generate_stats_line_splits_the_kv_kept_into_budget_and_pinned_tokens(tiny_model_dir):
    from knorm_gen import EvictionConfig, generate_with_eviction, kv_memory
    from knorm_gen.eviction.memory import mib

    args = ["--model", tiny_model_dir, "--budget", "64", "-m", "4"]
    result = generate("-p", LONG, *args, "-v")
    assert result.exit_code == 0, result.stderr
    model, tok = get_model(str(tiny_model_dir))
    want = generate_with_eviction(model, tok, LONG, budget=64, max_tokens=4)
    memory = kv_memory(model, EvictionConfig(budget=64))
    pinned = want.tokens_pinned * memory.pinned_bytes_per_token
    bound = re.search(r"KV memory: at most (\d+\.\d) MiB for the document whatever its length, plus (\d+\.\d) KiB "
                      r"per pinned token \(the template and the answer, held on top of the budget\)", result.stderr)
    assert bound and bound[1] == f"{memory.ceiling_bytes / 2**20:.1f}", result.stderr
    assert bound[2] == f"{memory.pinned_bytes_per_token / 1024:.1f}"
    stats = re.search(r"KV kept (\S+ MiB) of (\S+ MiB) \((\S+ MiB) within the budget, plus (\S+ MiB) for (\d+) pinned "
                      r"tokens held on top of it: the template and the answer\)\n", result.stderr)
    assert stats, result.stderr
    assert stats.groups() == (mib(want.kept_bytes), mib(want.full_bytes), mib(want.kept_bytes - pinned), mib(pinned),
                              str(want.tokens_pinned))
    # what the budget holds is within the bound -v printed; the pinned tokens are what it is over
    assert want.kept_bytes - pinned <= memory.ceiling_bytes < want.kept_bytes


def test_batch_says_its_kv_memory_line_once(tmp_path, tiny):
    inp = write_rows(tmp_path / "in.jsonl", [{"id": "a", "prompt": "Hello there"}])
    for quiet in ([], ["-q"]):
        result = invoke(inp, "-o", tmp_path / "out.jsonl", *tiny, *quiet, "--overwrite")
        assert result.exit_code == 0, result.stderr
        assert result.stderr.count("KV memory per row") == 1, (quiet, result.stderr)


def test_tune_takes_task_and_reads_the_context_field_by_default(tiny_model_dir, tmp_path, monkeypatch):
    import knorm_gen.cli.tune as cli

    calls = []

    def fake_tune(*args, **kw):
        calls.append((args, kw))
        raise KeyboardInterrupt  # the call is what this test checks: stop there

    monkeypatch.setattr(cli, "tune", fake_tune)
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"id": 1, "context": "Ships sail. " * 300}) + "\n")
    result = CliRunner().invoke(cli.tune_command, [str(docs), "--model", str(tiny_model_dir), "--task", "retrieve"])
    assert result.exit_code == 130, result.output
    ((args, kw),) = calls
    assert kw["job"] == "retrieve" and args[2][0].text.startswith("Ships sail.")
    assert "task retrieve" in result.stderr
    # knorm-batch's name for a TOML file is not knorm-tune's task
    result = CliRunner().invoke(cli.tune_command, [str(docs), "--job", "retrieve"])
    assert result.exit_code == 2 and "--task summarize, retrieve or both" in result.output
    # rows shaped as knorm-batch's, with the document in another field: the fix is named
    docs.write_text(json.dumps({"id": 1, "text": "Ships sail. " * 300}) + "\n")
    result = CliRunner().invoke(cli.tune_command, [str(docs), "--model", str(tiny_model_dir)])
    assert result.exit_code == 2 and "no text in field 'context'" in result.output
    assert "--context-field text" in result.output
    context_field = {p.name: p for p in cli.tune_command.params}["context_field"]
    assert context_field.default == {p.name: p for p in batch_command.params}["context_field"].default == "context"


@pytest.mark.parametrize("flags, said", [
    (["-v"], True), (["--verbose"], True), (["--verbose", "True"], True), (["--verbose", "False"], False),
    (["-v", "0"], False), (["--verbose=false"], False), (["--verbose", "true"], True), ([], False),
])
def test_verbose_is_a_flag_that_also_takes_true_or_false(tmp_path, tiny, tiny_model_dir, flags, said):
    inp = write_rows(tmp_path / "in.jsonl", [{"id": "a", "prompt": "Hello there"}])
    # the flag before INPUT: "-v in.jsonl" is the flag and the input, as ever
    result = invoke(*flags, inp, "-o", tmp_path / "out.jsonl", *tiny, "-q")
    assert result.exit_code == 0, result.stderr
    assert ("row 'a' (line 1)" in result.stderr) == said, result.stderr
    result = generate("-p", "Hello there", "--model", tiny_model_dir, "--budget", "16", "-m", "2", *flags)
    assert result.exit_code == 0, result.stderr
    assert ("KV memory: at most" in result.stderr) == said, result.stderr


def test_a_verbose_value_that_is_no_truth_value_is_a_usage_error():
    from knorm_gen.cli.options import verbose_args

    result = generate("-p", "hi", "--verbose=maybe")
    assert result.exit_code == 2 and "--verbose takes True or False (or nothing: -v), not 'maybe'" in result.stderr
    assert verbose_args(["-v", "in.jsonl", "--verbose", "FALSE", "--", "-v", "1"]) == \
        ["-v", "in.jsonl", "--no-verbose", "--", "-v", "1"]


def test_each_command_says_what_it_does_in_its_first_sentence(capsys):
    for command in (batch_command, generate_command):
        first = _help(command).split("\n\n")[1].strip()
        assert first.endswith(".") and first.count(". ") == 0, first
    from knorm_gen.cli.tune import tune_command

    first = _help(tune_command).split("\n\n")[1].strip()
    assert first.startswith("Measure which eviction layout") and first.count(". ") == 0, first
    assert _help(batch_command).split("\n\n")[1].strip().startswith("Run a model with KV-cache eviction over every row")
    from knorm_gen.tuning.probe import probe_cli

    with pytest.raises(SystemExit):
        probe_cli(["-h"])
    assert "Inspect a model before running it with eviction" in capsys.readouterr().out
