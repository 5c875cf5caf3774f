"""The README's examples run as written, and what they print is checked against
independent counts (the tokenizer's own chat template, mlx_lm's own KVCache
offset, bytes per cached position), not against the library's own numbers."""

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from .conftest import document_span, kept_after

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = "\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
N_LAYERS, N_SKIPPED = 30, 0  # the embedded model; the default bounds every layer


def python_blocks():
    return re.findall(r"```python\n(.*?)```", README, flags=re.S)


def shell_lines(command):
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", README + DOCS, flags=re.S):
        for line in block.splitlines():
            line = line.split("#")[0].strip()
            if line.startswith("mlx.launch ") and f" -- {command} " in line:
                line = line.split(" -- ", 1)[1]  # the command the launcher starts on every rank
            if line.startswith(command + " "):
                lines.append(line)
    return lines


def ratio(seen, kept_per_layer):
    full = N_LAYERS * seen
    kept = N_SKIPPED * seen + (N_LAYERS - N_SKIPPED) * min(seen, kept_per_layer)
    return full / kept


@pytest.fixture(scope="module")
def executed():
    namespace, outputs = {}, []
    for block in python_blocks():
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(block, str(ROOT / "README.md"), "exec"), namespace)
        outputs.append(out.getvalue().splitlines())
    return namespace, outputs


def block_output(executed, marker):
    """What the README's python block containing ``marker`` printed."""
    blocks = python_blocks()
    (i,) = [i for i, b in enumerate(blocks) if marker in b]
    return executed[1][i]


def test_readme_python_blocks_exist():
    assert len(python_blocks()) == 4


def test_api_block_prints_true_numbers(executed):
    ns, _ = executed
    out = block_output(executed, "generate_with_eviction(")
    tok, result = ns["tokenizer"], ns["result"]
    prompt = "Explain in two sentences why the sky is blue."
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
    seen, kept, shown_ratio, _tps = _numbers_line(out)
    assert int(seen) == len(ids) + len(result.tokens)
    # only the prompt's own text is evictable (template and answer pinned)
    assert int(kept) == kept_after(int(seen), document_span(tok, ids, prompt), 64)
    assert shown_ratio == f"{int(seen) / int(kept):.2f}x"
    answers = [line for line in out if " -> " in line]
    assert len(answers) == 1 and answers[0].startswith("Where does the Rhine rise? -> ")
    assert answers[0].split(" -> ", 1)[1].strip()


def _numbers_line(lines):
    pattern = re.compile(r"^(\d+) (\d+) (\d+\.\d\dx) (\d+(?:\.\d+)?)$")
    hits = [m.groups() for m in map(pattern.match, lines) if m]
    assert len(hits) == 1, lines
    return hits[0]


def test_cache_block_prints_true_numbers(executed):
    ns, _ = executed
    cache = ns["cache"]
    seen = cache[0].offset  # every layer is an eviction cache by default; offset counts every position fed
    n_prompt = len(ns["prompt"])
    assert type(cache[0]).__name__ == "EvictionKVCache" and n_prompt < seen <= n_prompt + 40
    assert all(c.probe is not None for c in cache)  # the default rule was probed, so it did not fall back
    # no spans given: every position is evictable, so each layer holds exactly the budget
    assert block_output(executed, "make_eviction_cache(") == [f"{seen} 32 {ratio(seen, 32):.2f}x"]


def test_batch_block_prints_one_true_line_per_prompt(executed):
    ns, _ = executed
    tok = ns["tokenizer"]
    lines = block_output(executed, "generate_batch_with_eviction(")
    assert len(lines) == len(ns["prompts"]) == 3
    for prompt, line in zip(ns["prompts"], lines):
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
        m = re.match(r"^(\d+)\+(\d+) tokens, (\d+) kept: ", line)
        assert m and int(m[1]) == len(ids)  # in input order
        assert int(m[3]) == kept_after(len(ids) + int(m[2]), document_span(tok, ids, prompt), 32)


@pytest.mark.parametrize("line", shell_lines("knorm-batch"))
def test_knorm_batch_command_lines_parse(line):
    from knorm_gen.cli import batch_command

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


def test_memory_block_prints_true_numbers(executed):
    ns, outputs = executed
    row = 3 * 64 * 2 * 4  # SmolLM2-135M: 3 KV heads x 64 dims x (key + value) x 4 bytes, per layer
    # quantized, per head and vector: 64 dims at 4 or 8 bits, then a float32 scale and bias per group of 64
    q4, q8 = 3 * 2 * (64 * 4 // 8 + 2 * 4), 3 * 2 * (64 * 8 // 8 + 2 * 4)
    lengths = (4096, 8192, 32768)
    positions = {  # per layout: positions held over all 30 layers after n tokens, the ceiling, bytes per position
        "full": (lambda n: 30 * n, None, row),
        "default": (lambda n: 30 * min(n, 512), 30 * 512, row),
        "retrieval": (lambda n: 9 * n + 21 * min(n, 512), None, row),
        "paper": (lambda n: 2 * n + 28 * min(n, 512), None, row),
        "early_factor=8": (lambda n: 9 * min(n, 4096) + 21 * min(n, 512), 9 * 4096 + 21 * 512, row),
        "full, kv_bits=4": (lambda n: 30 * n, None, q4),
        "default, kv_bits=8": (lambda n: 30 * min(n, 512), 30 * 512, q8),
        "default, kv_bits=4": (lambda n: 30 * min(n, 512), 30 * 512, q4),
    }
    assert list(ns["layouts"]) == list(positions)
    expected = [f"{name} {[round(size * held(n) / 2**20, 1) for n in lengths]} {None if cap is None else size * cap}"
                for name, (held, cap, size) in positions.items()]
    assert block_output(executed, "kv_memory(") == expected


def test_readme_reads_in_ten_minutes_and_its_links_exist():
    assert len(README.splitlines()) <= 350
    for link in re.findall(r"\]\(((?:docs|benchmarks)/[^)#]+)\)", README):
        assert (ROOT / link).exists(), link
