"""knorm-batch on a folder: one row per matching file, checked against the files on
disk (the same rows written as JSONL by hand must give the same records), with
resume, error records, usage errors, PDFs and a run across two processes."""

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from knorm_gen.batch import sources
from knorm_gen.eviction.config import RowsConfig
from knorm_gen.batch.rows import MAX_LINE_BYTES, Row, RowError
from .conftest import batch_args
from .conftest import invoke_batch as invoke
from .conftest import write_files as write

REPO = Path(__file__).resolve().parents[1]
TIMING = {"prefill_s", "decode_s", "prompt_tps", "generation_tps", "peak_memory_gb"}
QUESTION = ["--question", "Summarize the text above."]


@pytest.fixture
def tiny(tiny_model_dir):
    return batch_args(tiny_model_dir)


def records(path):
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()]


def untimed(record):
    out = {k: v for k, v in record.items() if k not in TIMING}
    if out.get("answers"):
        out["answers"] = [{k: v for k, v in a.items() if k not in TIMING} for a in out["answers"]]
    return out


def as_jsonl(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def minimal_pdf(text):
    """A one-page PDF showing ``text`` in Helvetica, written by hand."""
    content = f"BT /F1 24 Tf 72 720 Td ({text}) Tj ET".encode()
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
               b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
               b"/Resources << /Font << /F1 5 0 R >> >> >>",
               b"<< /Length %d >>\nstream\n" % len(content) + content + b"\nendstream",
               b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    out, offsets = b"%PDF-1.4\n", []
    for i, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % i + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    return out + b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)


DOCS = {
    "a.txt": "The Rhine rises in the Swiss Alps and reaches the North Sea.\n",
    "sub/b.md": "# Notes\r\nWindows line ends.\r\n",  # CRLF
    "sub/deeper/c.rst": "\ufeffA BOM first, then reStructuredText.\n",
    "sub/z.txt": "Last in order of path.\n",
    "code.py": "print('not read by default')\n",
    ".hidden.txt": "hidden file\n",
    ".git/x.md": "in a hidden folder\n",
    "sub/.cache/y.txt": "in a hidden subfolder\n",
}


def test_one_row_per_matching_file_as_the_same_rows_in_jsonl(tmp_path, tiny):
    root = write(tmp_path / "docs", DOCS)
    out = tmp_path / "folder.jsonl"
    result = invoke(root, "-o", out, *tiny, *QUESTION)
    assert result.exit_code == 0, result.output
    # by hand: the default globs at any depth, no hidden names, sorted by path; text as Python reads text
    wanted = sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                    if p.suffix in (".txt", ".md", ".rst") and not any(part.startswith(".")
                                                                       for part in p.relative_to(root).parts))
    assert wanted == ["a.txt", "sub/b.md", "sub/deeper/c.rst", "sub/z.txt"]
    rows = [{"id": rel, "context": (root / rel).read_text(encoding="utf-8-sig")} for rel in wanted]
    assert rows[1]["context"] == "# Notes\nWindows line ends.\n"
    jsonl_out = tmp_path / "jsonl.jsonl"
    assert invoke(as_jsonl(tmp_path / "rows.jsonl", rows), "-o", jsonl_out, *tiny, *QUESTION).exit_code == 0
    got = records(out)
    assert [r["id"] for r in got] == wanted
    assert [untimed(r) for r in got] == [untimed(r) for r in records(jsonl_out)]  # fingerprints too


def test_glob_replaces_the_defaults_and_is_a_job_file_key(tmp_path, tiny, tiny_model_dir):
    root = write(tmp_path / "docs", DOCS)
    out = tmp_path / "py.jsonl"
    assert invoke(root, "-o", out, *tiny, *QUESTION, "--glob", "*.py").exit_code == 0
    assert [r["id"] for r in records(out)] == ["code.py"]
    job = tmp_path / "job.toml"
    job.write_text(f'input = "docs"\noutput = "job.jsonl"\nmodel = {json.dumps(str(tiny_model_dir))}\n'
                   'glob = ["*.py", "**/*.md"]\nlimit = 2\n[eviction]\nbudget = 16\n[generation]\nmax_tokens = 2\n'
                   '[rows]\nquestions = ["Summarize."]\n')
    assert invoke("--job", job, "-q").exit_code == 0
    assert [r["id"] for r in records(tmp_path / "job.jsonl")] == ["code.py", "sub/b.md"]


def test_bad_files_are_error_records_and_the_others_run(tmp_path, tiny):
    root = write(tmp_path / "docs", {"good.txt": "A fine document.\n", "latin1.txt": b"caf\xe9 au lait\n",
                                     "empty.md": b"", "blank.md": " \n\t\n", "z.txt": "Also fine.\n"})
    with open(root / "huge.txt", "wb") as f:
        f.truncate(MAX_LINE_BYTES + 1)  # sparse: never read
    os.symlink(root / "missing.txt", root / "dangling.txt")
    os.mkfifo(root / "pipe.txt")
    out, stats = tmp_path / "out.jsonl", tmp_path / "stats.jsonl"
    result = invoke(root, "-o", out, "--stats-log", stats, *tiny, *QUESTION)
    assert result.exit_code == 1, result.output
    by_id = {r["id"]: r for r in records(out)}
    order = sorted(["good.txt", "latin1.txt", "empty.md", "blank.md", "z.txt", "huge.txt", "dangling.txt", "pipe.txt"])
    assert sorted(by_id) == sorted(order)
    assert by_id["good.txt"]["error"] is None and by_id["z.txt"]["error"] is None
    expected = {"latin1.txt": ("invalid_utf8", "latin1.txt: not valid UTF-8 (byte 0xe9 at offset 3)"),
                "empty.md": ("invalid_row", "empty.md: the file is empty"),
                "blank.md": ("invalid_row", "blank.md: the file holds only whitespace"),
                "huge.txt": ("file_too_large", f"huge.txt: the file is larger than the {MAX_LINE_BYTES}-byte"),
                "dangling.txt": ("unreadable_file", "dangling.txt: it is a link to a missing file"),
                "pipe.txt": ("unreadable_file", "pipe.txt: not a regular file")}
    for rel, (kind, message) in expected.items():
        error = by_id[rel]["error"]
        assert error["type"] == kind and error["message"].startswith(message), error
        assert error["line"] == order.index(rel) + 1  # the file's place in the sorted list
    assert {s["id"]: s["error"] for s in records(stats)} == {k: v[0] for k, v in expected.items()} | {
        "good.txt": None, "z.txt": None}
    assert "8 rows: 2 ok, 6 failed" in result.stderr


def test_a_file_that_vanishes_after_the_listing_is_an_error_record(tmp_path):
    root = write(tmp_path / "docs", {"a.txt": "one\n", "b.txt": "two\n"})
    source = sources.open_source(str(root), RowsConfig(questions=("Q?",)))
    (root / "a.txt").unlink()
    gone, kept = source.items()
    assert isinstance(gone, RowError) and gone.type == "unreadable_file" and gone.id == "a.txt"
    assert gone.message == "a.txt: the file is gone (deleted or moved since the folder was listed)"
    assert isinstance(kept, Row) and (kept.id, kept.line, kept.context, kept.path) == ("b.txt", 2, "two\n", "b.txt")


def test_a_file_or_subfolder_without_permission_is_an_error_record(tmp_path, monkeypatch):
    # the tests may run as root, who reads everything: the kernel's refusal is simulated
    root = write(tmp_path / "docs", {"a.txt": "one\n", "locked.txt": "two\n", "private/c.txt": "three\n"})
    real_open, real_scandir = os.open, os.scandir

    def refuse(real, name):
        def call(path, *args, **kwargs):
            if Path(path).name == name:
                raise PermissionError(13, "Permission denied", str(path))
            return real(path, *args, **kwargs)
        return call

    monkeypatch.setattr(os, "open", refuse(real_open, "locked.txt"))
    monkeypatch.setattr(os, "scandir", refuse(real_scandir, "private"))
    items = list(sources.open_source(str(root), RowsConfig(questions=("Q?",))).items())
    assert [(i.id, type(i).__name__) for i in items] == [("a.txt", "Row"), ("locked.txt", "RowError"),
                                                         ("private/", "RowError")]
    assert items[1].message == "locked.txt: cannot read the file: Permission denied"
    assert items[2].message == "private/: cannot list this folder: Permission denied; the files in it were not read"
    assert items[1].type == items[2].type == "unreadable_file"


def test_rerun_skips_every_file_and_an_edited_file_alone_runs_again(tmp_path, tiny):
    root = write(tmp_path / "docs", {"a.txt": "First document.\n", "b.md": "Second one.\n", "c.rst": "Third.\n"})
    out, stats = tmp_path / "out.jsonl", tmp_path / "stats.jsonl"
    args = [root, "-o", out, "--stats-log", stats, *tiny, *QUESTION]
    assert invoke(*args).exit_code == 0
    before, before_stats = out.read_bytes(), stats.read_bytes()
    result = invoke(*args)
    assert result.exit_code == 0 and "3 rows: 0 ok, 0 failed, 3 skipped" in result.stderr
    assert out.read_bytes() == before and stats.read_bytes() == before_stats
    (root / "b.md").write_text("Second one, edited: a longer text now.\n")
    result = invoke(*args)
    assert result.exit_code == 0 and "3 rows: 1 ok, 0 failed, 2 skipped" in result.stderr
    old, new = before.splitlines(keepends=True), out.read_bytes().splitlines(keepends=True)
    assert new[:2] == [old[0], old[2]] and [json.loads(line)["id"] for line in new] == ["a.txt", "c.rst", "b.md"]
    assert json.loads(new[2])["answers"][0]["prompt_tokens"] > json.loads(old[1])["answers"][0]["prompt_tokens"]
    assert [s["id"] for s in records(stats)] == ["a.txt", "c.rst", "b.md"]
    result = invoke(root, "-o", out, *tiny, *QUESTION, "--budget", "12")  # settings changed: refused as ever
    assert result.exit_code == 2 and "budget: 16 -> 12" in result.stderr


def test_no_matching_file_and_bad_globs_are_usage_errors(tmp_path, tiny):
    root = write(tmp_path / "docs", {"code.py": "x = 1\n", ".notes.md": "hidden\n"})
    result = invoke(root, *tiny, *QUESTION)
    assert result.exit_code == 2
    assert f"INPUT {root} is a directory with no file matching '*.txt', '*.md', '*.rst' (the default globs)" \
        in result.stderr and "--glob PATTERN" in result.stderr
    assert not (tmp_path / "docs.completions.jsonl").exists()
    result = invoke(root, *tiny, *QUESTION, "--glob", "*.html")
    assert result.exit_code == 2 and "no file matching '*.html' at any depth" in result.stderr
    result = invoke(root, *tiny, *QUESTION, "--glob", "sub/*.md")
    assert result.exit_code == 2 and "names no folder" in result.stderr
    missing = invoke(tmp_path / "nowhere", *tiny, *QUESTION)
    missing_jsonl = invoke(tmp_path / "nowhere.jsonl", *tiny, *QUESTION)
    assert missing.exit_code == missing_jsonl.exit_code == 2 and "cannot read input" in missing.stderr
    inp = as_jsonl(tmp_path / "rows.jsonl", [{"prompt": "x"}])
    result = invoke(inp, *tiny, "--glob", "*.md")
    assert result.exit_code == 2 and "--glob picks the files of a folder INPUT" in result.stderr


def test_a_folder_without_a_question_gives_invalid_rows_naming_question(tmp_path, tiny):
    root = write(tmp_path / "docs", {"a.txt": "Some text.\n"})
    result = invoke(root, *tiny)
    assert result.exit_code == 1
    (record,) = records(tmp_path / "docs.completions.jsonl")  # the default output: beside the folder
    assert record["id"] == "a.txt" and record["error"]["type"] == "invalid_row"
    assert record["error"]["message"].startswith("a.txt: ") and "--question" in record["error"]["message"]


def test_the_runs_own_files_inside_the_folder_are_not_read(tmp_path, tiny):
    root = write(tmp_path / "docs", {"a.txt": "A document.\n", "out/old.txt": "an earlier output folder\n"})
    out = root / "out" / "summaries.txt"
    assert invoke(root, "-o", out, *tiny, *QUESTION).exit_code == 0
    assert [r["id"] for r in records(out)] == ["a.txt"]
    beside = root / "summaries.jsonl"  # the output at the top of the folder, and a glob that matches it
    for _ in range(2):
        assert invoke(root, "-o", beside, "--stats-log", root / "stats.jsonl", *tiny, *QUESTION,
                      "--glob", "*.txt", "--glob", "*.jsonl").exit_code == 0
    assert [r["id"] for r in records(beside)] == ["a.txt", "out/old.txt", "out/summaries.txt"]


def test_pdf_text_is_read_and_a_scan_is_an_error_record(tmp_path, tiny, monkeypatch):
    pypdf = pytest.importorskip("pypdf")
    blank = io.BytesIO()
    writer = pypdf.PdfWriter()
    writer.add_blank_page(612, 792)
    writer.write(blank)
    root = write(tmp_path / "docs", {"paper.pdf": minimal_pdf("The Rhine reaches the North Sea."),
                                     "scan.pdf": blank.getvalue(), "broken.pdf": b"%PDF-1.4 not really",
                                     "notes.txt": "plain text\n"})
    out = tmp_path / "out.jsonl"
    result = invoke(root, "-o", out, *tiny, *QUESTION, "--glob", "*.pdf")
    assert result.exit_code == 1, result.output
    by_id = {r["id"]: r for r in records(out)}
    assert sorted(by_id) == ["broken.pdf", "paper.pdf", "scan.pdf"]
    assert by_id["scan.pdf"]["error"]["type"] == "invalid_row"
    assert "holds no text layer" in by_id["scan.pdf"]["error"]["message"]
    assert by_id["broken.pdf"]["error"]["type"] == "unreadable_file"
    assert "pypdf cannot read it as a PDF" in by_id["broken.pdf"]["error"]["message"]
    jsonl_out = tmp_path / "jsonl.jsonl"
    rows = as_jsonl(tmp_path / "rows.jsonl", [{"id": "paper.pdf", "context": "The Rhine reaches the North Sea."}])
    assert invoke(rows, "-o", jsonl_out, *tiny, *QUESTION).exit_code == 0
    assert untimed(by_id["paper.pdf"]) == untimed(records(jsonl_out)[0])
    monkeypatch.setattr(sources, "pdf_support", lambda: False)  # as without the pdf extra
    result = invoke(root, "-o", tmp_path / "again.jsonl", *tiny, *QUESTION, "--glob", "*.pdf")
    assert result.exit_code == 2 and 'pip install -e ".[pdf]"' in result.stderr


def test_two_ranks_share_and_merge_a_folder_as_one_process_does(tmp_path, tiny_model_dir):
    files = {f"d{i}.txt": f"Document number {i} of the folder.\n" for i in range(5)}
    root = write(tmp_path / "docs", {**files, "bad.md": b"\xff\n"})
    common = ["--model", str(tiny_model_dir), "--budget", "16", "--max-tokens", "2", "--batch-size", "1", "-q",
              *QUESTION]
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    assert invoke(root, "-o", one, *common).exit_code == 1  # one process (bad.md fails)
    run = dict(capture_output=True, cwd=REPO, timeout=300)
    launcher = str(Path(sys.executable).parent / "mlx.launch")
    launch = [launcher, "-n", "2", "--python", sys.executable, "--", "-m", "knorm_gen.cli", str(root), "-o", str(two),
              "--summary-json", str(tmp_path / "summary.json"), *common]
    proc = subprocess.run(launch, **run)
    assert proc.returncode == 0, proc.stderr.decode()
    assert [untimed(r) for r in records(two)] == [untimed(r) for r in records(one)]
    assert [r["id"] for r in records(two)] == ["bad.md", *files]  # sorted by path
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["rows"], summary["failed"]) == (6, 1) and [r["rows"] for r in summary["ranks"]] == [3, 3]
    before = two.read_bytes().splitlines()
    (root / "d3.txt").write_text("Document number 3, edited since the first launch.\n")
    assert subprocess.run(launch, **run).returncode == 0
    after = two.read_bytes().splitlines()
    assert [r["id"] for r in records(two)] == ["bad.md", *files]  # input order again, each id once
    assert [a == b for a, b in zip(before, after)] == [True] * 4 + [False, True]  # bad.md failed: run again
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["ok"], summary["skipped"], summary["failed"]) == (1, 4, 1)


def test_texts_file_holds_every_records_text_after_a_resume(tmp_path, tiny):
    root = write(tmp_path / "docs", {"a.txt": "First document.\n", "b.txt": "Second document.\n", "c.md": b"\xff\n"})
    out, texts = tmp_path / "out.jsonl", tmp_path / "texts.md"
    assert invoke(root, "-o", out, *tiny, *QUESTION, "--limit", "1").exit_code == 0
    assert invoke(root, "-o", out, *tiny, *QUESTION, "--texts", texts).exit_code == 1  # c.md is not UTF-8
    md = texts.read_text(encoding="utf-8")
    for r in records(out):  # the records on disk, the first one written by the earlier run
        assert f"## {r['id']}" in md
        if r["error"]:
            assert r["error"]["type"] in md
        else:
            assert r["answers"][0]["question"] in md and r["answers"][0]["answer"].strip() in md
    assert md.index("## a.txt") < md.index("## b.txt")
    result = invoke(root, *tiny, *QUESTION, "-o", "-", "--texts", texts)
    assert result.exit_code == 2 and "--texts" in result.stderr and "-o FILE" in result.stderr
