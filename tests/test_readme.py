"""The README's examples run as written, and what they print is checked against
independent counts (the tokenizer's own chat template, mlx_lm's own KVCache
offset, bytes per cached position), not against the library's own numbers."""

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = "\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
N_LAYERS = 30  # the embedded model; the default bounds every layer


def python_blocks():
    return re.findall(r"```python\n(.*?)```", README, flags=re.S)


def shell_lines(command):
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", README + DOCS, flags=re.S):
        for line in re.sub(r"\\\n\s*", "", block).splitlines():  # a command continued with "\\" is one line
            line = line.split("#")[0].strip()
            if line.startswith("mlx.launch ") and f" -- {command} " in line:
                line = line.split(" -- ", 1)[1]  # the command the launcher starts on every rank
            if line.startswith(command + " "):
                lines.append(line)
    return lines


@pytest.fixture(scope="module")
def executed():
    import knorm_gen
    from knorm_gen.models.load import get_model

    namespace, outputs = {}, []
    own = knorm_gen.load_model
    # load_model() with no arguments is the embedded model: the process's shared copy, loaded and examined once
    knorm_gen.load_model = lambda *a, **k: get_model("default") if not (a or k) else own(*a, **k)
    try:
        run_blocks(namespace, outputs)
    finally:
        knorm_gen.load_model = own
    return namespace, outputs


def run_blocks(namespace, outputs):
    for block in python_blocks():
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(block, str(ROOT / "README.md"), "exec"), namespace)
        outputs.append(out.getvalue().splitlines())


def block_output(executed, marker):
    """What the README's python block containing ``marker`` printed."""
    blocks = python_blocks()
    (i,) = [i for i, b in enumerate(blocks) if marker in b]
    return executed[1][i]


def test_readme_python_blocks_exist():
    assert len(python_blocks()) == 3  # a summary, several questions, the API's imports


def test_summary_block_prints_true_numbers(executed):
    ns, _ = executed
    out = block_output(executed, "Summarize the text above")
    tok, summary, document = ns["tokenizer"], ns["summary"], ns["document"]
    numbers = re.compile(r"^(\d+) tokens seen, (\d+) kept per layer, (\d+\.\d)x, (\d+\.\d) MiB "
                         r"\(at most (\d+\.\d)\), (\d+\.\d) s$")
    hits = [m.groups() for m in map(numbers.match, out) if m]
    assert len(hits) == 1, out
    seen, kept, shown_ratio, mib, ceiling, _s = hits[0]
    ids = tok.apply_chat_template([{"role": "user", "content": document + "\n\n" + "Summarize the text above in "
                                    "three sentences."}], add_generation_prompt=True, tokenize=True)
    n_doc = len(tok.encode(document, add_special_tokens=False))
    generated = int(seen) - len(ids)
    assert 0 < generated <= 256  # the default max_tokens
    # the default keeps 1/4 of the document's tokens (rounded up); everything else is pinned
    expected = int(seen) - n_doc + -(-n_doc // 4)
    assert abs(int(kept) - expected) <= 2, (kept, expected)  # a token or two where document and template meet
    assert shown_ratio == "4.0"
    position = 3 * 64 * 2 * 4 * N_LAYERS  # SmolLM2-135M: 3 KV heads x 64 dims x (key + value) x float32, 30 layers
    assert mib == f"{int(kept) * position / 2**20:.1f}" and float(mib) <= float(ceiling)
    assert summary.text.strip() and summary.text.strip() in "\n".join(out)


def test_questions_block_answers_each_question(executed):
    ns, _ = executed
    out = block_output(executed, "for answer in answer_questions(")
    answered = [line for line in out if " -> " in line]
    assert [line.split(" -> ")[0] for line in answered] == ns["questions"]
    assert all(line.split(" -> ", 1)[1].strip() for line in answered)


@pytest.mark.parametrize("line", shell_lines("knorm-batch"))
def test_knorm_batch_command_lines_parse(line):
    from knorm_gen.cli.batch import batch_command

    args = shlex.split(line)[1:]
    with batch_command.make_context("knorm-batch", args, resilient_parsing=False) as ctx:
        # every option the line names arrives with the value the line gives it
        names = {opt: p.name for p in batch_command.params for opt in p.opts}
        for flag, value in zip(args, args[1:] + [None]):
            if flag.startswith("--") and value is not None and not value.startswith("-"):
                got = ctx.params.get(names[flag])
                got = got if isinstance(got, tuple) else (got,)  # a repeatable option gives a tuple
                assert str(value) in [str(g) for g in got], (flag, value, got)


def test_make_targets_named_in_readme_exist():
    makefile = (ROOT / "Makefile").read_text()
    for target in set(re.findall(r"^make (\w[\w-]*)", README, flags=re.M)):
        assert re.search(rf"^{target}:", makefile, flags=re.M), target


def test_readme_reads_in_ten_minutes_and_its_links_exist():
    assert len(README.splitlines()) <= 350 and "⟨" not in README  # no placeholder left
    for link in re.findall(r"\]\(((?:docs|benchmarks)/[^)#]+)\)", README):
        assert (ROOT / link).exists(), link
