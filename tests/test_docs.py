"""The docs name what the code has, under its names of today: every ``knorm_gen`` name they
mention imports, every signature on docs/api.md is the code's, its settings tables are what
``scripts/config_tables.py`` writes, every option written after a command is one of that
command's, and docs/batch.md lists exactly the job-file keys the loader takes and the keys of a
record. The markdown is parsed and the code asked by name; no model is loaded.

docs/results.md and docs/history.md are left out: they report past versions in the words of
their time (a rule name of 0.12 in 0.12's section is true of 0.12).
"""

from __future__ import annotations

import builtins
import importlib
import importlib.util
import inspect
import re
import shlex
import sys
from dataclasses import fields
from pathlib import Path

import click
import pytest

import knorm_gen
from knorm_gen.eviction import config as config_module
from knorm_gen.cli.batch import batch_command
from knorm_gen.cli.generate import generate_command
from knorm_gen.cli.job_file import JOB_KEYS
from knorm_gen.cli.tune import tune_command
from knorm_gen.tuning.probe import make_probe_command
from knorm_gen.batch.records import ANSWER_FIELDS, ERROR_TYPES, RECORD_FIELDS
from knorm_gen.batch.rows import OVERRIDE_FIELDS

ROOT = Path(__file__).resolve().parents[1]
HISTORIES = ("results.md", "history.md")
PAGES = [ROOT / "README.md"] + [p for p in sorted((ROOT / "docs").glob("*.md")) if p.name not in HISTORIES]
API, BATCH = ROOT / "docs" / "api.md", ROOT / "docs" / "batch.md"
COMMANDS = {"knorm-batch": batch_command, "knorm-generate": generate_command, "knorm-tune": tune_command,
            "knorm-probe": make_probe_command()}
SETTINGS = ("EvictionConfig", "GenerationConfig", "RowsConfig")
HARNESS = {"knorm_gen.tuning.evaluate": ("Doc", "Evaluator", "tuning_cases", "measure", "summarize", "bootstrap_interval"),
           "knorm_gen.generation.prompt_cache": ("save_document", "answer_from", "stream_answer_from", "read_document")}
"""The public names of the two submodules a user calls (the package's own: ``knorm_gen.__all__``)."""


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def resolve(dotted: str):
    """The object ``knorm_gen.a.b.C`` names: the longest importable module prefix, then
    attributes. AttributeError or ImportError when the name is stale."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def section(text: str, heading: str) -> str:
    """The lines under ``heading`` (a markdown heading line) up to the next heading outside a code block."""
    lines = text.splitlines()[text.splitlines().index(heading) + 1:]
    out, fenced = [], False
    for line in lines:
        fenced ^= line.startswith("```")
        if not fenced and re.match(r"#{1,6} ", line):
            break
        out.append(line)
    return "\n".join(out)


def table_rows(text: str) -> list[list[str]]:
    """The cells of each body row of the first markdown table in ``text`` (a ``\\|`` stays in its cell)."""
    table = re.search(r"^\|.*(?:\n\|.*)*", text, flags=re.M)
    rows = table[0].splitlines()[2:] if table else []
    return [[c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]] for row in rows]


# ---- (a) every knorm_gen name the docs mention is importable ---------------------------------


def named_objects(text: str) -> list[str]:
    """``knorm_gen.x.y`` references and the names of ``from knorm_gen... import a, b`` lines."""
    names = re.findall(r"\bknorm_gen(?:\.[A-Za-z_]\w*)+", text)
    for module, grouped, plain in re.findall(r"from (knorm_gen[\w.]*) import (?:\(([^)]*)\)|([\w ,]+))", text):
        names += [f"{module}.{n.strip()}" for n in (grouped or plain).split(",") if n.strip()]
    return names


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_every_knorm_gen_name_the_docs_mention_imports(page):
    stale = []
    for dotted in dict.fromkeys(named_objects(read(page))):
        try:
            resolve(dotted)
        except (AttributeError, ImportError):
            stale.append(dotted)
    assert not stale, f"{name(page)} names what knorm_gen does not have: {', '.join(stale)}"


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_every_settings_field_the_docs_mention_is_one(page):
    text, stale = read(page), []
    for cls, field in re.findall(rf"`({'|'.join(SETTINGS)})\.(\w+)", text):
        if field not in {f.name for f in fields(getattr(config_module, cls))} and not hasattr(
                getattr(config_module, cls), field):
            stale.append(f"{cls}.{field}")
    for cls, region in re.findall(r"<!-- fields:(\w+) -->\n(.*?)<!-- /fields -->", text, flags=re.S):
        real = {f.name for f in fields(getattr(config_module, cls))}
        stale += [f"{cls}.{row[0].strip('`')}" for row in table_rows(region) if row[0].strip("`") not in real]
    assert not stale, f"{name(page)} lists settings fields that do not exist: {', '.join(stale)}"


# ---- docs/api.md: every public name, with the code's own signature ---------------------------


def split_params(text: str) -> list[str]:
    """``a, b=(1, 2), *, c="x,y"`` -> its parameters, split at the commas outside brackets and quotes."""
    out, depth, quote, current = [], 0, None, ""
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(current.strip())
            current = ""
            continue
        current += ch
    return out + ([current.strip()] if current.strip() else [])


def real_params(obj) -> list[tuple[str, object]]:
    """``(shape, default)`` per parameter as a signature is written: ``name``, ``*``, ``*args``,
    ``**kwargs``, ``/``; ``default`` is ``inspect.Parameter.empty`` when there is none."""
    out, star = [], False
    params = list(inspect.signature(obj).parameters.values())
    for i, p in enumerate(params):
        if p.kind is p.VAR_POSITIONAL:
            out.append((f"*{p.name}", p.empty))
            star = True
        elif p.kind is p.VAR_KEYWORD:
            out.append((f"**{p.name}", p.empty))
        else:
            if p.kind is p.KEYWORD_ONLY and not star:
                out.append(("*", p.empty))
                star = True
            out.append((p.name, p.default))
        if p.kind is p.POSITIONAL_ONLY and (i + 1 == len(params) or params[i + 1].kind is not p.POSITIONAL_ONLY):
            out.append(("/", p.empty))
    return out


SIGNATURE = re.compile(r"^- `((?:knorm_gen\.[\w.]+\.)?[A-Za-z_]\w*)\(([^`]*)\)`", flags=re.M)


def test_every_signature_on_the_api_page_is_the_codes():
    problems = []
    for dotted, written in SIGNATURE.findall(read(API)):
        try:
            obj = resolve(dotted if dotted.startswith("knorm_gen.") else f"knorm_gen.{dotted}")
        except (AttributeError, ImportError):
            problems.append(f"{dotted}: no such name")
            continue
        namespace = {**vars(builtins), **vars(sys.modules[obj.__module__])}
        real = real_params(obj)
        doc = [p.split("=", 1) for p in split_params(written)]
        if [d[0].strip() for d in doc] != [shape for shape, _ in real]:
            problems.append(f"{dotted}({written}): the code's parameters are "
                            f"({', '.join(shape for shape, _ in real)})")
            continue
        for (shape, default), d in zip(real, doc):
            if (len(d) == 2) != (default is not inspect.Parameter.empty):
                problems.append(f"{dotted}: {shape} {'has no' if len(d) == 2 else 'has a'} default in the code")
            elif len(d) == 2 and eval(d[1], namespace) != default:  # noqa: S307 - the docs' own text
                problems.append(f"{dotted}: {shape}={d[1].strip()}, the code's default is {default!r}")
    assert not problems, "docs/api.md: " + "; ".join(problems)


def test_the_api_page_documents_every_public_name():
    text = read(API)
    missing = [n for n in knorm_gen.__all__ if n != "__version__" and not re.search(rf"`{n}[`(]", text)]
    missing += [f"{module}.{n}" for module, names in HARNESS.items() for n in names
                if not re.search(rf"`{re.escape(module)}\.{n}[`(]", text)]
    assert not missing, f"docs/api.md does not document {', '.join(missing)}"


def test_the_api_page_lists_every_field_of_a_result():
    text = read(API)
    entry = text[text.index("- `GenerationResult`"):text.index("- `cache_stats(")]
    missing = [f.name for f in fields(knorm_gen.GenerationResult) if f"`{f.name}`" not in entry]
    assert not missing, f"docs/api.md's GenerationResult entry does not list {', '.join(missing)}"


# ---- (b) the settings tables are what scripts/config_tables.py writes ----------------------


def config_tables():
    spec = importlib.util.spec_from_file_location("config_tables", ROOT / "scripts" / "config_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_settings_tables_are_written_from_the_configs():
    text = read(API)
    assert [f"<!-- fields:{cls} -->" in text for cls in SETTINGS] == [True] * len(SETTINGS), \
        f"docs/api.md lacks a fields region for one of {', '.join(SETTINGS)}"
    written, now = text, config_tables().render(text)
    stale = [f"{a} / {b}" for a, b in zip(written.splitlines(), now.splitlines()) if a != b]
    assert written == now, ("docs/api.md's settings tables are stale (run python scripts/config_tables.py); "
                            "first difference, page / code: " + (stale[0] if stale else "the number of rows"))


# ---- (c) every option written after a command is one of its options -----------------------


def options_of(command: click.Command) -> set[str]:
    names = set(command.context_settings.get("help_option_names", ["--help"]))
    for p in command.params:
        if isinstance(p, click.Option) and not p.hidden:
            names.update(p.opts + p.secondary_opts)
    return names


def command_lines(text: str, inline: bool) -> list[str]:
    """The lines of ```bash blocks (continuations joined) and, with ``inline``, the code spans
    that start with a command."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        lines += block.replace("\\\n", " ").splitlines()
    if inline:
        lines += [span.replace("\\|", "|") for span in re.findall(rf"`((?:{'|'.join(COMMANDS)})\b[^`]*)`", text)]
    return lines


def written_options(line: str) -> list[tuple[str, str]]:
    """``(command, option)`` for each option a line writes after one of the commands."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    tokens, out, command = list(lexer), [], None
    for token in tokens:
        if command and re.fullmatch(r"[();<>|&]+", token):
            command = None
        elif token.rsplit("/", 1)[-1] in COMMANDS:
            command = token.rsplit("/", 1)[-1]
        elif command and token.startswith("-") and token != "-" and not re.match(r"-\d", token):
            out.append((command, token.split("=", 1)[0]))
    return out


INLINE_EXEMPT = ("README.md",)
"""Pages whose inline code spans are not checked (their ```bash blocks are): README.md still writes
``knorm-tune ... --job summarize`` in its table, which its owners are to make ``--task``."""


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_every_option_written_after_a_command_is_one_of_its_options(page):
    stale = [f"{command} {option}" for line in command_lines(read(page), inline=page.name not in INLINE_EXEMPT)
             for command, option in written_options(line) if option not in options_of(COMMANDS[command])]
    assert not stale, f"{name(page)} writes options these commands do not take: {', '.join(dict.fromkeys(stale))}"


def test_the_batch_page_names_every_option_of_every_command():
    written = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", read(BATCH)))
    missing = [f"{cname} {p.opts[-1]}" for cname, command in COMMANDS.items() for p in command.params
               if isinstance(p, click.Option) and not p.hidden and not set(p.opts + p.secondary_opts) & written]
    assert not missing, f"docs/batch.md does not describe {', '.join(missing)}"


# ---- (d) docs/batch.md lists the job-file keys, the record's keys and the row overrides -----


def test_the_job_file_keys_are_exactly_the_loaders():
    listed: dict = {}
    for where, keys in table_rows(section(read(BATCH), "### Job files")):
        table = None if where == "top level" else where.strip("`[]")
        listed[table] = re.findall(r"`([a-z_]+)`", keys)
    problems = [f"[{t}]" if t else "top level" for t in JOB_KEYS if t not in listed]
    problems += [f"a [{t}] table, which the loader does not take" for t in listed if t not in JOB_KEYS]
    for table, keys in listed.items():
        where = f"[{table}]" if table else "the top level"
        accepted = set(JOB_KEYS.get(table, ()))
        problems += [f"{k} at {where}, which the loader refuses" for k in keys if k not in accepted]
        problems += [f"{k} at {where} is not listed" for k in sorted(accepted - set(keys))]
    assert not problems, "docs/batch.md, Job files: " + "; ".join(problems)


def test_the_record_table_lists_every_record_key_in_order():
    rows = table_rows(section(read(BATCH), "### Output record schema"))
    listed = [k for row in rows for k in re.findall(r"`(\w+)`", row[0])]
    assert listed == list(RECORD_FIELDS), f"docs/batch.md's record table lists {listed}, records have " \
                                          f"{list(RECORD_FIELDS)}"
    (answers,) = [row for row in rows if row[0] == "`answers`"]
    inner = re.search(r"\[\{([^}]*)\}\]", answers[2])[1]
    assert [k.strip() for k in inner.split(",")] == list(ANSWER_FIELDS), \
        f"docs/batch.md's answers row lists {inner}, an answer has {', '.join(ANSWER_FIELDS)}"
    (error,) = [row for row in rows if row[0] == "`error`"]
    assert f"`type` is one of `{', '.join(ERROR_TYPES)}`" in error[2], \
        f"docs/batch.md's error row does not list the error types {', '.join(ERROR_TYPES)}"


def test_the_row_overrides_are_the_ones_rows_take():
    (line,) = [line for line in read(BATCH).splitlines() if line.startswith("- Per-row overrides:")]
    listed = re.findall(r"`(\w+)`", line)
    assert listed == list(OVERRIDE_FIELDS), f"docs/batch.md lists the row overrides {listed}, rows take " \
                                            f"{list(OVERRIDE_FIELDS)}"


def test_the_results_page_is_what_the_results_files_say():
    """docs/results.md's tables, rewritten from benchmarks/results/ by benchmarks/page.py, equal the page."""
    import subprocess

    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "page.py"), "--check"], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    page = (ROOT / "docs" / "results.md").read_text()
    assert "⟨" not in page and "<!-- /page -->" in page  # every placeholder filled, the tables in place
