"""Issue 27: the mlx_lm habits users bring (option names, knorm-generate), and
messages that say what to do. Through Click's CliRunner on the tiny random model."""

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from knorm_gen import records as rec
from knorm_gen.cli import batch_command
from knorm_gen.job import get_model
from knorm_gen.rows import content_digest

REPO = Path(__file__).resolve().parents[1]
LONG = "Tell a long story about the sea. " * 8  # about 270 tokens with the tiny model's byte tokenizer


def invoke(*args, input=None):
    return CliRunner().invoke(batch_command, [str(a) for a in args], input=input, catch_exceptions=False)


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def records(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.fixture
def tiny(tiny_model_dir):
    return ["--model", str(tiny_model_dir), "--budget", "16", "--max-tokens", "2", "--batch-size", "1"]


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
