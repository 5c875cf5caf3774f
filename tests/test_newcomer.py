"""A newcomer's path works as pasted (issue 63): install targets, help and error messages that
say what to do, knorm-generate's prompt and folder, one-question rows, the example jobs."""

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from knorm_gen import EvictionConfig
from knorm_gen.batch.sources import PDF_EXTRA
from knorm_gen.cli import generate as cli_generate
from knorm_gen.cli.batch import batch_command
from knorm_gen.cli.options import UsageFailure
from knorm_gen.batch.records import question_numbers

ROOT = Path(__file__).resolve().parents[1]


def test_make_run_installs_only_the_main_job_s_needs():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^run: setup$", makefile, flags=re.M)
    assert re.search(r"^setup:\n\tbash scripts/setup.sh$", makefile, flags=re.M)
    assert re.search(r"^test: setup-dev$", makefile, flags=re.M)
    assert re.search(r"^setup-dev:\n\tbash scripts/setup.sh --dev$", makefile, flags=re.M)
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    default = re.findall(r'^EXTRAS="([^"]*)"', setup, flags=re.M) + re.findall(r'&& EXTRAS="([^"]*)"', setup)
    assert default == ["", "cpu"], default  # the user's install: no test, gemma, bench or pdf extra
    assert 'EXTRAS="${EXTRAS:+$EXTRAS,}test,gemma,bench,pdf"' in setup and 'if [ -n "$DEV" ]' in setup


def test_no_install_hint_names_a_release_the_index_lacks():
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "knorm_gen").rglob("*.py"))]:
        assert "knorm-gen[" not in path.read_text(), path
    assert 'pip install -e ".[pdf]"' in PDF_EXTRA


def test_keep_l2norm_points_to_low(tmp_path):
    with pytest.raises(ValueError, match="L2Norm rule .* is 'low'"):
        EvictionConfig(keep="l2norm")
    (tmp_path / "x.jsonl").write_text("{\"prompt\": \"hi\"}\n")
    result = CliRunner().invoke(batch_command, [str(tmp_path / "x.jsonl"), "--keep", "l2norm"])
    assert result.exit_code == 2 and "is 'low'" in result.output


def test_texts_works_with_the_default_output_and_says_so():
    (texts,) = [p for p in batch_command.params if p.name == "texts"]
    assert "Needs -o" not in texts.help


def test_prompt_text_is_read_as_written(monkeypatch):
    text = "C:\\new\\table and a literal \\n\\t in a document"
    assert cli_generate._prompt_text(text) == text
    monkeypatch.setattr(sys, "stdin", SimpleNamespace(read=lambda: "from stdin \\n"))
    assert cli_generate._prompt_text("-") == "from stdin \\n"


def test_save_prompt_cache_creates_its_folder(tmp_path):
    target = tmp_path / "out" / "deeper" / "doc.safetensors"
    cli_generate._make_save_folder(str(target))
    assert target.parent.is_dir() and not target.exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageFailure, match="cannot create the folder"):
        cli_generate._make_save_folder(str(tmp_path / "file" / "doc.safetensors"))
    cli_generate._make_save_folder(str(tmp_path / "new" / "doc.txt"))  # a wrong name is refused where it is saved
    assert not (tmp_path / "new").exists()


def _answer(question, text):
    return SimpleNamespace(question=question, text=text, finish_reason="stop", prompt_tokens=10, generated_tokens=2,
                           tokens_seen=12, tokens_kept=8, compression_ratio=2.0, prefill_s=0.1, decode_s=0.1,
                           generation_tps=20.0, context_prefill_s=0.05, tokens_pinned=3, token_ratio=1.5,
                           kept_bytes=80, full_bytes=120, saved_bytes=40, kv_ceiling_bytes=100, prompt_tps=100.0,
                           peak_memory_gb=0.1)


def test_a_one_question_row_has_its_answer_as_its_completion():
    one = question_numbers([_answer("Q?", "The answer.")])
    assert one["completion"] == "The answer." == one["answers"][0]["answer"]
    assert one["saved_bytes"] == 40
    two = question_numbers([_answer("Q1?", "A1."), _answer("Q2?", "A2.")])
    assert two["completion"] is None and [a["answer"] for a in two["answers"]] == ["A1.", "A2."]


def test_the_longdocs_job_runs_the_default_ratio_with_a_cap():
    tomllib = pytest.importorskip("tomllib")
    job = tomllib.loads((ROOT / "jobs" / "longdocs-summarize.toml").read_text())
    # 4x is the compression README's pass-key rule accepts; 512 caps a document over ~2,048 tokens,
    # and examples/longdocs.jsonl has documents up to about 3,500
    assert job["eviction"] == {"ratio": 4, "budget": 512}


def test_the_warning_says_to_import_knorm_gen_first():
    code = ("import mlx.core, warnings\nwarnings.simplefilter('always')\nimport knorm_gen\n"
            "from knorm_gen.platform.runtime import warn_if_slow\nwarn_if_slow(keeps_low_precision=False)")
    env = {k: v for k, v in os.environ.items() if k != "KNORM_NO_BLAS"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                            cwd=ROOT)
    if "not linux" in result.stderr or not sys.platform.startswith("linux"):
        pytest.skip("the BLAS preload is Linux's")
    assert "mlx already imported" in result.stderr and "import knorm_gen before mlx and mlx_lm" in result.stderr


def test_the_probe_advice_names_no_page_that_lacks_it():
    source = (ROOT / "knorm_gen" / "tuning" / "probe.py").read_text()
    assert "docs/results.md" not in source
