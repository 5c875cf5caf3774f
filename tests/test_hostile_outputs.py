"""knorm-batch and knorm-generate against hostile outputs, folders and prompt caches
(issue 60): each test reproduces one attack through the real command line on a tiny
random model and checks the files on disk (the user's bytes unchanged, the records
parseable, ids unique)."""

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner


from .conftest import batch_args, make_tiny_model_dir
from .conftest import invoke_batch as invoke
from .conftest import write_files as write

REPO = Path(__file__).resolve().parents[1]
QUESTION = ["--question", "Summarize the text above."]


@pytest.fixture
def tiny(tiny_model_dir):
    return batch_args(tiny_model_dir)


def records(path):
    return [json.loads(line) for line in Path(path).read_bytes().splitlines()]


# ------------------------------------------------------------ 1. 3. the run's files and the input folder


@pytest.mark.parametrize("role", ["--texts", "--summary-json", "--stats-log", "-o"])
def test_an_output_naming_a_document_of_the_input_folder_is_refused(tmp_path, tiny, role):
    root = write(tmp_path / "docs", {"a.txt": "A document.\n", "notes.md": "My notes.\nSecond line.\n",
                                     "one.md": "one line, no newline"})
    for victim in ("notes.md", "one.md"):
        before = (root / victim).read_bytes()
        extra = ["-o", tmp_path / "out.jsonl"] if role != "-o" else []
        result = invoke(root, *extra, role, root / victim, *tiny, *QUESTION)
        assert result.exit_code == 2, result.stderr
        assert str(root / victim) in result.stderr and "outside the folder" in result.stderr
        assert (root / victim).read_bytes() == before


def test_the_texts_file_inside_the_folder_is_not_read_on_a_rerun(tmp_path, tiny):
    root = write(tmp_path / "docs", {"a.txt": "A document.\n", "b.md": "Another one.\n"})
    out, texts = tmp_path / "out.jsonl", root / "summaries.md"
    for _ in range(3):
        assert invoke(root, "-o", out, "--texts", texts, *tiny, *QUESTION).exit_code == 0
        assert sorted(r["id"] for r in records(out)) == ["a.txt", "b.md"]
    assert texts.read_text(encoding="utf-8").startswith("# Texts of ")


# ------------------------------------------------------------ 2. an existing file that is not ours


@pytest.mark.parametrize("content", [b"my only line, no newline", b"my only line\n", b"  hello\n\n",
                                     b'{"id": "mine", "prompt": "a row of my own"}\n'])
def test_output_naming_someones_one_line_file_is_refused(tmp_path, tiny, content):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": "r", "prompt": "Hello there."}) + "\n")
    folder = write(tmp_path / "docs", {"a.txt": "A document.\n"})
    victim = tmp_path / "victim.txt"
    for inp, extra in ((rows, []), (folder, QUESTION)):
        victim.write_bytes(content)
        result = invoke(inp, "-o", victim, *tiny, *extra)
        assert result.exit_code == 2, result.stderr
        assert str(victim) in result.stderr and "--overwrite" in result.stderr
        assert victim.read_bytes() == content


@pytest.mark.parametrize("content", [b"Dear diary,\ntoday I ran a batch job.\n", b"one line, no newline",
                                     b'{"id": 1, "text": "my data"}\n{"id": 2, "text": "more"}\n'])
def test_a_stats_log_that_is_someones_file_is_refused(tmp_path, tiny, content):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": "r", "prompt": "Hello there."}) + "\n")
    victim = tmp_path / "diary.txt"
    victim.write_bytes(content)
    result = invoke(rows, "-o", tmp_path / "out.jsonl", "--stats-log", victim, *tiny)
    assert result.exit_code == 2 and str(victim) in result.stderr and "--overwrite" in result.stderr
    assert victim.read_bytes() == content


def test_a_torn_record_alone_is_still_cut(tmp_path, tiny):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": "r", "prompt": "Hello there."}) + "\n")
    out = tmp_path / "out.jsonl"
    out.write_bytes(b'{"id": "r", "completion": "half a rec')  # a kill mid-write of the first record
    assert invoke(rows, "-o", out, *tiny).exit_code == 0
    assert [r["id"] for r in records(out)] == ["r"]


# ------------------------------------------------------------ 4. a done file emptied since


def test_a_done_file_emptied_since_gets_the_empty_files_record(tmp_path, tiny):
    root = write(tmp_path / "docs", {"a.txt": "A document.\n", "b.txt": "Another.\n", "c.txt": ""})
    out = tmp_path / "out.jsonl"
    assert invoke(root, "-o", out, *tiny, *QUESTION).exit_code == 1  # c.txt is empty
    empty = {r["id"]: r for r in records(out)}["c.txt"]["error"]
    (root / "a.txt").write_bytes(b"")
    result = invoke(root, "-o", out, *tiny, *QUESTION)
    assert result.exit_code == 1, result.stderr
    got = {r["id"]: r for r in records(out)}
    assert sorted(got) == ["a.txt", "b.txt", "c.txt"] and len(records(out)) == 3
    assert got["a.txt"]["error"]["type"] == empty["type"] == "invalid_row"
    assert "empty" in got["a.txt"]["error"]["message"] and got["b.txt"]["error"] is None


# ------------------------------------------------------------ 5. file names that are not UTF-8


def test_names_that_are_not_utf8_get_unique_ids_that_name_the_file(tmp_path, tiny):
    root = tmp_path / "docs"
    root.mkdir()
    names = [b"\xff.txt", b"\xfe.txt", "\ufffd.txt".encode(), b"\\xff.txt", b"ok.txt"]
    for name in names:
        with open(os.path.join(os.fsencode(root), name), "wb") as f:
            f.write(b"A document.\n")
    out = tmp_path / "out.jsonl"
    assert invoke(root, "-o", out, *tiny, *QUESTION).exit_code == 1
    got = records(out)
    ids = [r["id"] for r in got]
    assert len(ids) == len(set(ids)) == len(names)
    bad = [r for r in got if r["error"]]
    assert len(bad) == 2 and all(r["error"]["type"] == "invalid_utf8" for r in bad)
    assert {r["id"] for r in bad} & {"\ufffd.txt", "\\xff.txt"} == set()
    for r in bad:
        assert r["error"]["message"].startswith(r["id"] + ": ") and "rename" in r["error"]["message"]
    assert sorted(r["id"] for r in got if not r["error"]) == ["\\xff.txt", "ok.txt", "\ufffd.txt"]
    assert invoke(root, "-o", out, *tiny, *QUESTION).exit_code == 1  # a rerun settles: the same ids once
    assert sorted(r["id"] for r in records(out)) == sorted(ids)


# ------------------------------------------------------------ 6. 7. chunk


@pytest.fixture(scope="module")
def ctx512(tmp_path_factory):
    """The tiny model with a 512-token context (its byte tokenizer: a token per character)."""
    path = make_tiny_model_dir(tmp_path_factory.mktemp("ctx512"), layers=2)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 512
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_chunk_skips_a_blank_stretch(tmp_path, ctx512):
    text = "Words before the gap. " * 30 + "\n" * 1000 + "Words after the gap. " * 30
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": "gap", "context": text}) + "\n")
    out = tmp_path / "out.jsonl"
    result = invoke(rows, "-o", out, "--model", ctx512, "--budget", "32", "--max-tokens", "2", "-q",
                    "--long-documents", "chunk", *QUESTION)
    assert result.exit_code == 0, result.stderr
    ((r),) = records(out)
    assert r["error"] is None and r["long_document"]["mode"] == "chunk"
    assert all(p["tokens"] > 0 for p in r["long_document"]["pieces"])


@pytest.mark.parametrize("text", ["words only and more words " * 40, "digits 12345 and words " * 40])
def test_chunk_without_room_for_the_answer_fails_at_once_naming_both(tmp_path, ctx512, text):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": "x", "context": text}) + "\n")
    out = tmp_path / "out.jsonl"
    result = invoke(rows, "-o", out, "--model", ctx512, "--budget", "32", "-m", "508", "-q",
                    "--long-documents", "chunk", *QUESTION)
    assert result.exit_code == 1, result.stderr
    ((r),) = records(out)
    message = r["error"]["message"]
    assert "max_tokens 508" in message and "512-token context" in message and "context is empty" not in message


# ------------------------------------------------------------ 9. a disk that fills mid-run


def _file_size_limit(limit):
    def limited():  # in the child: writes past ``limit`` bytes fail with EFBIG (as on a full disk)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return limited


def test_a_disk_that_fills_mid_run_keeps_every_record_and_a_rerun_finishes(tmp_path, tiny_model_dir):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"id": f"r{i}", "prompt": f"Row number {i} says hello."}) + "\n"
                            for i in range(8)))
    out, stats = tmp_path / "out.jsonl", tmp_path / "stats.jsonl"
    args = [sys.executable, "-m", "knorm_gen.cli", rows, "-o", out, "--stats-log", stats, "--model", tiny_model_dir,
            "--budget", "16", "-m", "3", "-q", "--batch-size", "3"]
    full = subprocess.run(list(map(str, args)), capture_output=True, cwd=REPO, timeout=300,
                          preexec_fn=_file_size_limit(3000))
    assert full.returncode == 3, full.stderr.decode()
    message = full.stderr.decode()
    assert str(out) in message and "file size limit" in message and "rerun" in message
    written = records(out)  # every line whole and parseable
    assert 0 < len(written) < 8 and out.read_bytes().endswith(b"\n")
    assert [e["id"] for e in records(stats)] == [r["id"] for r in written]
    again = subprocess.run(list(map(str, args)), capture_output=True, cwd=REPO, timeout=300)
    assert again.returncode == 0, again.stderr.decode()
    ids = [r["id"] for r in records(out)]
    assert sorted(ids) == [f"r{i}" for i in range(8)] and ids[: len(written)] == [r["id"] for r in written]
    assert [e["id"] for e in records(stats)] == ids


# ------------------------------------------------------------ 8. a prompt cache and the model at its path


def test_a_prompt_cache_refuses_other_weights_at_the_models_path(tmp_path):
    from knorm_gen.models import load as models
    from knorm_gen.cli.generate import generate_command

    def generate(*args):
        models._MODELS.clear()  # as a new process would: the model is loaded from its path again
        return CliRunner().invoke(generate_command, [str(a) for a in args], catch_exceptions=False)

    model, path = tmp_path / "model", tmp_path / "doc.safetensors"
    make_tiny_model_dir(model, layers=2, seed=0)
    document = "The Mary sailed at dawn with forty barrels of salt. " * 4
    assert generate("--model", model, "-p", document, "--budget", "24", "--save-prompt-cache", path).exit_code == 0
    assert generate("--prompt-cache-file", path, "-p", "Which ship?", "-m", "2").exit_code == 0
    saved = path.read_bytes()
    make_tiny_model_dir(model, layers=2, seed=1)  # other weights of the same shapes, at the same path
    result = generate("--prompt-cache-file", path, "-p", "Which ship?", "-m", "2")
    assert result.exit_code == 2 and result.stdout == ""
    assert "another model" in result.stderr and result.stderr.count(str(model)) >= 2, result.stderr
    assert path.read_bytes() == saved
