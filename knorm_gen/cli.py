"""Command line: ``knorm-batch``, ``knorm-generate`` (and ``knorm-probe``). Parse options, call the library.

The eviction and generation options are generated from the fields of
:class:`~knorm_gen.eviction.config.EvictionConfig` and :class:`~knorm_gen.eviction.config.GenerationConfig`
(name, default and help come from each field), and job files use the same names
in their ``[eviction]`` and ``[generation]`` tables; ``tests/test_cli.py`` checks
that every field is reachable from both surfaces. mlx_lm's names work too:
``--temp``, ``-m`` (``--max-tokens``), ``--ignore-chat-template`` (``--no-chat``),
``--extra-eos-token``, ``--chat-template-config``, ``--adapter-path`` and
``--trust-remote-code``, ``--verbose True|False``; ``--max-kv-size`` is refused
with the name of the settings that bound the cache here (``--budget``, ``--ratio``).
A field's help speaks of rows and batches in ``knorm-batch``; ``knorm-generate``
takes its own wording from :data:`GENERATE_HELP`. ``knorm-generate``'s prompt
cache (``--save-prompt-cache``, ``--prompt-cache-file``) lives in
:mod:`knorm_gen.generation.prompt_cache`.
"""

from __future__ import annotations

import itertools
import json
import os
import shlex
import sys
import traceback
from dataclasses import Field, fields
from pathlib import Path
from typing import Any, Callable, Optional

import click
from click.core import ParameterSource

from . import __version__
from .generation.admission import parse_size
from .tuning.calibrate import settle
from .eviction.legacy import current_settings
from .eviction.config import (
    DEFAULT_RATIO,
    EVICTION_FIELDS,
    GENERATION_FIELDS,
    ROWS_FIELDS,
    EvictionConfig,
    GenerationConfig,
    RowsConfig,
    LAYOUT_FIELDS,
    PRESETS,
    ResolvedEviction,
    make_configs,
)
from .tuning.evaluate import TUNE_FILLERS
from .generation.generate import stream_with_eviction
from .batch.job import (
    EXIT_INTERNAL_ERROR,
    EXIT_IO_ERROR,
    EXIT_INTERRUPTED,
    EXIT_PIPE_CLOSED,
    EXIT_USAGE,
    BatchOptions,
    BatchUsageError,
    Interrupted,
    prepare_tokenizer,
    run_batch,
)
from .models.support import describe_model
from .eviction.layouts import CANDIDATES, describe
from .eviction.memory import kv_memory
from .models.load import get_model
from .batch.sink import budget_warning, silence_stdout
from .batch.sources import DEFAULT_GLOBS, PDF_EXTRA
from .tuning.tune import DOC_TOKENS, QUICK_ARMS, QUICK_DOCS, SWEEP_RATIOS, TUNE_ARMS, TUNE_DOCS, bounded, tune
from .generation.tunings import save_tuning

RUN_KEYS = ("input", "output", "model", "batch_size", "stats_log", "summary_json", "texts", "limit", "max_kv_memory",
            "extra_eos_tokens", "chat_template_config", "adapter_path", "trust_remote_code", "glob", "calibrate")
JOB_KEYS = {None: RUN_KEYS, "eviction": EVICTION_FIELDS + ("preset",), "generation": GENERATION_FIELDS,
            "rows": ROWS_FIELDS}
JOB_PATHS = ("input", "output", "stats_log", "summary_json", "texts", "adapter_path")
HELP = {"help_option_names": ["-h", "--help"]}

OPTION_ALIASES = {"temperature": ("--temp",), "max_tokens": ("-m",), "chat": (" /--ignore-chat-template",)}
"""mlx_lm's names for the generated options (``mlx_lm.generate --temp 0.7 -m 100 --ignore-chat-template``).
A bool field's alias names its on/off forms as ``on/off`` (a leading space: no 'on' alias)."""

MAX_KV_SIZE_HINT = (
    "--max-kv-size is mlx_lm's rotating cache of the last N tokens; knorm-batch evicts by its rule instead, and "
    "the per-layer token budget is --budget N (tokens kept per compressed layer, chosen by --keep; 'none' = the "
    "full cache) or --ratio R (keep 1/R of each document). "
    "--max-kv-memory is something else: a byte limit (e.g. 2GiB) on the KV memory of the rows in flight")
GENERATE_MAX_KV_SIZE_HINT = (
    "--max-kv-size is mlx_lm's rotating cache of the last N tokens; knorm-generate evicts by its rule instead: "
    "bound the cache with --budget N (tokens kept per compressed layer, chosen by --keep; 'none' = the full cache) "
    "or --ratio R (keep 1/R of the prompt's document)")
GENERATE_MAX_KV_MEMORY_HINT = (
    "--max-kv-memory is knorm-batch's limit on the KV memory of the rows it decodes together; knorm-generate runs "
    "one prompt: bound its KV cache with --budget N (tokens kept per compressed layer) or --ratio R (keep 1/R of "
    "the prompt's document), and -v prints the bound before the text")
TUNE_TASKS = ("summarize", "retrieve", "both")
TUNE_JOB_HINT = ("--job is knorm-batch's job file; knorm-tune chooses a layout for --task summarize, retrieve or both")

GENERATE_HELP: dict[str, dict[str, Any]] = {
    "max_tokens": {"help": "Tokens to generate at most. 256, not mlx_lm's 100: a summary of a long document in three "
                           "or so sentences rarely fits in 100 tokens."},
    "seed": {"help": "Sampling seed, 0 to 2**64-1, set before the prompt is read (it matters with --temperature "
                     "above 0, or --keep random)."},
    "system_prompt": {"help": "A system message before the prompt (chat template only); pinned, never evicted."},
    "pin_prefix_chars": {"help": "Characters at the start of the prompt (with --save-prompt-cache: the document) "
                                 "pinned with the instructions: an instruction written before the document "
                                 "('Summarize the following...'). The template, system turn, question and answer "
                                 "are always pinned."},
    "question_separator": {"help": "With --save-prompt-cache: the text between the document and each question asked "
                                   "of it later (the whole prompt is DOCUMENT, this, QUESTION); a saved document "
                                   "keeps its own."},
    "long_documents": {"help": "A prompt longer than the model's context: error = stop before generating, naming its "
                               "length and the limit; truncate = keep its start and end (half the room each), with "
                               "'[...]' where the middle was.", "choices": ("error", "truncate")},
}
"""knorm-generate's own help (and choices) for the config fields whose help speaks of rows,
records or batches; the other fields' help is the field's own, as in knorm-batch."""

CONFIG_FIELDS = {f.name: f for f in (*fields(EvictionConfig), *fields(GenerationConfig))}
ROW_SHAPE_FIELDS = {f.name: f for f in fields(RowsConfig)}
OPTION_FIELDS = {**CONFIG_FIELDS, **ROW_SHAPE_FIELDS}


class UsageFailure(click.ClickException):
    """A problem found before any work starts: exit status 2, no usage dump."""

    exit_code = EXIT_USAGE


class _Parsed(click.ParamType):
    def __init__(self, name: str, parse):
        self.name, self._parse = name, parse

    def convert(self, value, param, ctx):
        if not isinstance(value, str):
            return value
        try:
            return self._parse(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


_TYPES = {"int": click.INT, "Optional[int]": click.INT, "float": click.FLOAT, "str": click.STRING,
          "Optional[str]": click.STRING, "tuple[str, ...]": click.STRING}


class _Choice(click.Choice):
    """click's Choice, with a pointer for a rule name a reader of the paper may try
    (``--keep l2norm``: the rule is ``low``)."""

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        try:
            return super().convert(value, param, ctx)
        except click.BadParameter as e:
            from .eviction.config import RULE_HINTS

            key = str(value).strip().lower().replace("-", "").replace("_", "")
            if key in RULE_HINTS and "low" in self.choices:
                self.fail(f"{e.message.rstrip('.')}: {RULE_HINTS[key]}", param, ctx)
            raise


def _config_option(f: Field, override: Optional[dict] = None) -> Callable:
    """One ``click.option`` for a config field, from the field itself (``override``: a
    command's own ``help`` or ``choices`` for it, :data:`GENERATE_HELP`)."""
    meta = {**f.metadata, **(override or {})}
    # The field's own default (shown in --help); only options given on the command
    # line override a job file, so a default here never masks one.
    help_text = meta.get("help") + (f"  [default: {meta['default_text']}]" if meta.get("default_text") else "")
    kw: dict[str, Any] = dict(help=help_text, default=f.default, show_default=f.default is not None
                              and not meta.get("default_text") and f.default != "")
    name = "--" + (meta.get("cli_name") or f.name).replace("_", "-")
    aliases = OPTION_ALIASES.get(f.name, ())
    if meta.get("multiple"):
        kw.update(multiple=True, default=(), show_default=False)
    if f.type in ("Optional[bool]", "bool"):
        return click.option(f"{name}/--no-{f.name.replace('_', '-')}", *aliases, f.name, **kw)
    if meta.get("parse"):
        kw["type"] = _Parsed(meta.get("metavar") or f.name.upper(), meta["parse"])
    elif meta.get("choices"):
        kw["type"] = _Choice(meta["choices"])
    else:
        kw["type"] = _TYPES[f.type]
    return click.option(name, *aliases, f.name, **kw)


def _options_for(option_fields: dict, overrides: Optional[dict] = None) -> Callable[[Callable], Callable]:
    def add(command: Callable) -> Callable:
        for f in reversed(list(option_fields.values())):
            command = _config_option(f, (overrides or {}).get(f.name))(command)
        return command

    return add


config_options = _options_for(OPTION_FIELDS)
config_options.__doc__ = "Add an option for every field of the configs (eviction, generation, rows)."
generation_options = _options_for(CONFIG_FIELDS, GENERATE_HELP)
generation_options.__doc__ = ("Add an option for every field of the eviction and generation configs, in "
                              "knorm-generate's words (:data:`GENERATE_HELP`).")


def parse_template_config(value: Any) -> Optional[dict]:
    """``--chat-template-config``: a JSON object (text, or a table in a job file) of
    keyword arguments for ``apply_chat_template``, as ``mlx_lm.generate`` takes it."""
    if value is None or isinstance(value, dict):
        obj = value
    else:
        try:
            obj = json.loads(value)
        except (TypeError, ValueError) as e:
            raise ValueError(f"chat template config must be a JSON object such as '{{\"enable_thinking\": false}}'; "
                             f"{value!r} is not JSON ({e})") from None
    if obj is not None and not isinstance(obj, dict):
        raise ValueError(f"chat template config must be a JSON object (keyword arguments for the chat template), "
                         f"got {value!r}")
    return obj


def _refusal(hint: str) -> Callable:
    """A callback that refuses its option, given any value, with ``hint`` (what to use instead)."""
    def refuse(ctx: click.Context, param: click.Parameter, value: Any) -> None:
        if value is not None:
            raise UsageFailure(hint)

    return refuse


def _refused_options(hints: dict[str, str]) -> list[Callable]:
    """Hidden options that name what to use instead (``{"--max-kv-size": hint}``)."""
    return [click.option(name, hidden=True, expose_value=False, callback=_refusal(hint), metavar="N", help=hint)
            for name, hint in hints.items()]


def _run_options(command: Callable, refused: dict[str, str]) -> Callable:
    """The options a run takes as mlx_lm.generate does (tokenizer and loader), and the
    hidden ``refused`` ones that say what to use instead."""
    for option in reversed([
        click.option("--extra-eos-token", "extra_eos_tokens", multiple=True, metavar="TOKEN",
                     help="Also stop at this token (as the tokenizer spells it, e.g. '<|im_end|>', or a token id); "
                          "repeat for several. As mlx_lm.generate's --extra-eos-token."),
        click.option("--chat-template-config", type=_Parsed("JSON", parse_template_config), default=None,
                     help="A JSON object of keyword arguments for the chat template, e.g. "
                          "'{\"enable_thinking\": false}'. As mlx_lm.generate's --chat-template-config."),
        click.option("--adapter-path", type=click.Path(), default=None,
                     help="LoRA adapters for an mlx_lm model (a folder or hub id), loaded by mlx_lm; not for "
                          "GGUF models (the default is one)."),
        click.option("--trust-remote-code", is_flag=True, default=False,
                     help="Let mlx_lm run the model's and tokenizer's own code (an mlx_lm model id that needs it)."),
        *_refused_options(refused),
    ]):
        command = option(command)
    return command


def run_options(command: Callable) -> Callable:
    """knorm-batch's :func:`_run_options` (mlx_lm's --max-kv-size refused, naming --budget)."""
    return _run_options(command, {"--max-kv-size": MAX_KV_SIZE_HINT})


def generate_run_options(command: Callable) -> Callable:
    """knorm-generate's :func:`_run_options`: --max-kv-size and --max-kv-memory refused,
    each naming what bounds one prompt's cache (--budget, --ratio)."""
    return _run_options(command, {"--max-kv-size": GENERATE_MAX_KV_SIZE_HINT,
                                  "--max-kv-memory": GENERATE_MAX_KV_MEMORY_HINT})


def _expand(path: str) -> str:
    return path if path == "-" else os.path.expanduser(path)


def _read_toml(path: str) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise UsageFailure("job files need Python 3.11+ or the 'tomli' package (pip install tomli)") from None
    try:
        return tomllib.loads(Path(path).expanduser().read_text(encoding="utf-8"))
    except OSError as e:
        raise UsageFailure(f"cannot read job file {path}: {e.strerror or e}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UsageFailure(f"job file {path} is not valid TOML: {e}") from None


def _key_hint(key: str) -> str:
    if key in ("max_kv_size", "max-kv-size"):
        return "; the per-layer token budget is budget = N under [eviction] (mlx_lm's max_kv_size has no equivalent)"
    return ""


def _flatten_job(path: str, data: dict) -> dict:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if key in JOB_KEYS and key is not None and isinstance(value, dict):
            for sub, subvalue in value.items():
                if sub not in JOB_KEYS[key]:
                    raise UsageFailure(f"job file {path}: unknown key '{sub}' in [{key}]; "
                                       f"allowed: {', '.join(JOB_KEYS[key])}{_key_hint(sub)}")
                flat[sub] = subvalue
        elif key in RUN_KEYS:
            flat[key] = value
        else:
            allowed = ", ".join(RUN_KEYS) + ", [eviction], [generation], [rows]"
            raise UsageFailure(f"job file {path}: unknown key '{key}'; allowed: {allowed}{_key_hint(key)}")
    return flat


def _check_run_keys(path: str, flat: dict) -> None:
    job_dir = Path(path).expanduser().parent
    for key in JOB_PATHS:
        if key in flat:
            if not isinstance(flat[key], str) or not flat[key]:
                raise UsageFailure(f"job file {path}: '{key}' must be a path string")
            value = _expand(flat[key])
            if value != "-" and not Path(value).is_absolute():
                value = os.path.normpath(job_dir / value)
            flat[key] = value
    if "model" in flat and not isinstance(flat["model"], str):
        raise UsageFailure(f"job file {path}: 'model' must be text, got {flat['model']!r}")
    for key in ("limit", "batch_size", "calibrate"):
        if key in flat and (isinstance(flat[key], bool) or not isinstance(flat[key], int)):
            raise UsageFailure(f"job file {path}: '{key}' must be an integer, got {flat[key]!r}")
    if "max_kv_memory" in flat:
        try:
            flat["max_kv_memory"] = parse_size(flat["max_kv_memory"])
        except ValueError as e:
            raise UsageFailure(f"job file {path}: max_kv_memory: {e}") from None
    if "extra_eos_tokens" in flat:
        tokens = flat["extra_eos_tokens"]
        tokens = [tokens] if isinstance(tokens, (str, int)) and not isinstance(tokens, bool) else tokens
        if not isinstance(tokens, list) or not all(isinstance(t, (str, int)) and not isinstance(t, bool)
                                                   for t in tokens):
            raise UsageFailure(f"job file {path}: 'extra_eos_tokens' must be a list of tokens (text or ids), "
                               f"got {flat['extra_eos_tokens']!r}")
        flat["extra_eos_tokens"] = tuple(str(t) for t in tokens)
    if "chat_template_config" in flat:
        try:
            flat["chat_template_config"] = parse_template_config(flat["chat_template_config"])
        except ValueError as e:
            raise UsageFailure(f"job file {path}: {e}") from None
    if "glob" in flat:
        globs = [flat["glob"]] if isinstance(flat["glob"], str) else flat["glob"]
        if not isinstance(globs, list) or not globs or not all(isinstance(g, str) and g.strip() for g in globs):
            raise UsageFailure(f"job file {path}: 'glob' must be a file name pattern or a list of them, such as "
                               f"[\"*.md\", \"*.txt\"], got {flat['glob']!r}")
        flat["glob"] = tuple(globs)
    if "trust_remote_code" in flat and not isinstance(flat["trust_remote_code"], bool):
        raise UsageFailure(f"job file {path}: 'trust_remote_code' must be true or false, "
                           f"got {flat['trust_remote_code']!r}")


def load_job(path: str) -> dict:
    """A job file's settings as a flat dict. Paths: ``~`` is expanded (environment
    variables are not), and relative paths resolve against the file's folder.
    Config values in text form (``budget = "none"``, ``skip_layers = "0-8"``) are
    parsed by their field's parser and every value is checked by the configs."""
    flat = current_settings(_flatten_job(path, _read_toml(path)))
    _check_run_keys(path, flat)
    try:
        for key, value in flat.items():
            parse = OPTION_FIELDS[key].metadata.get("parse") if key in OPTION_FIELDS else None
            if parse:
                flat[key] = parse(value)
        build_configs(flat)
        rows_config(flat)
    except ValueError as e:
        raise UsageFailure(f"job file {path}: {e}") from None
    return flat


def auto_layout(settings: dict) -> Optional[tuple]:
    """With ``--preset auto``, the layout fields given beside it (they win over the
    saved tuning); None without it."""
    if settings.get("preset") != "auto":
        return None
    return tuple(k for k in LAYOUT_FIELDS if settings.get(k) is not None)


def build_configs(settings: dict) -> tuple[EvictionConfig, GenerationConfig]:
    """The two configs from flat settings (missing fields take their defaults)."""
    return make_configs(preset=settings.get("preset"), **{k: v for k, v in settings.items() if k in CONFIG_FIELDS})


def rows_config(settings: dict) -> RowsConfig:
    """How rows are read, from flat settings."""
    return RowsConfig(**{k: v for k, v in settings.items() if k in ROW_SHAPE_FIELDS})


def resume_command(argv: list[str]) -> str:
    """The command line that resumes an interrupted run: the same, without --overwrite."""
    return shlex.join(["knorm-batch", *(a for a in argv if a != "--overwrite")])


BOOL_WORDS = {"true": True, "t": True, "yes": True, "1": True, "false": False, "f": False, "no": False, "0": False}
"""The values ``--verbose`` takes, as mlx_lm's commands take ``--verbose True|False`` (any case)."""


def verbose_args(args: list[str]) -> list[str]:
    """``args`` with mlx_lm's ``--verbose True|False`` (``-v 0``, ``--verbose=false``) spelled as
    the flags ``--verbose`` / ``--no-verbose``; ``-v`` or ``--verbose`` before anything else
    stays the flag. UsageFailure for ``--verbose=`` and a word that is no truth value."""
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            return out + args[i:]
        word = arg.split("=", 1)[1] if arg.startswith("--verbose=") else \
            args[i + 1] if arg in ("-v", "--verbose") and i + 1 < len(args) and args[i + 1].lower() in BOOL_WORDS \
            else None
        if word is None:
            out.append(arg)
            i += 1
            continue
        if word.lower() not in BOOL_WORDS:
            raise UsageFailure(f"--verbose takes True or False (or nothing: -v), not {word!r}")
        out.append("--verbose" if BOOL_WORDS[word.lower()] else "--no-verbose")
        i += 1 if arg.startswith("--verbose=") else 2
    return out


def verbose_option(help_text: str) -> Callable:
    """``-v`` / ``--verbose``: a flag that also takes mlx_lm's ``True`` / ``False`` (see :func:`verbose_args`)."""
    return click.option("-v", "--verbose/--no-verbose", default=False, help=help_text + " A plain flag; "
                        "--verbose True|False (mlx_lm's spelling) and --no-verbose work too.")


class _Command(click.Command):
    """A command that reads ``--verbose True|False`` as mlx_lm's commands do."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, verbose_args(list(args)))


class _BatchCommand(_Command):
    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta["argv"] = list(args)  # for the resume hint
        return super().parse_args(ctx, args)


def _settings(ctx: click.Context, input_path: Optional[str], job_file: Optional[str], opts: dict) -> dict:
    """The job file's settings, with what the command line gives on top."""
    settings: dict[str, Any] = load_job(job_file) if job_file else {}
    given = {name for name in opts
             if ctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)}
    if input_path is not None and settings.get("input") and "output" not in given:
        raise UsageFailure(f"INPUT {input_path} is given on the command line and the job file {job_file} names "
                           f"its own input ({settings['input']}); to run the job's settings on another input, "
                           "also give -o/--output, so the job's output is not mixed with other rows")
    for name, value in opts.items():
        if name in given or (name not in settings and name not in OPTION_FIELDS):
            settings[name] = value
    if input_path is not None:
        settings["input"] = input_path
    if not settings.get("input"):
        raise click.UsageError("missing INPUT (a JSONL file, a folder or '-'), or a --job file that names one")
    return settings


model_option = click.option("--model", default=BatchOptions.model, show_default=True,
                            help="'default' (embedded SmolLM2-135M), a .gguf file, or an mlx_lm model path/id.")
preset_option = click.option(
    "--preset", type=click.Choice(tuple(PRESETS)), default=None,
    help="A named eviction layout; the eviction options given beside it override it. default: the question rule "
         "(mean reading, carrying a quarter), the recent quarter, every layer bounded; paper: keep-low (the L2Norm "
         "rule), layers 0-1 uncompressed (the paper); retrieval: keep-low, the first 30% of the full-attention layers "
         "uncompressed (memory grows with the input); summarize: KeyDiff in every layer; question: the question rule "
         "with the best reading, no carry, the recent eighth; intrinsic: the keys alone, no probe (leverage in the "
         "first 30% of the full-attention layers, the blend in the rest, coverage 0.25, the recent half); auto: the "
         "layout knorm-tune saved for this model (the default without one).")


@click.command(name="knorm-batch", cls=_BatchCommand, context_settings=HELP)
@click.argument("input_path", metavar="INPUT", required=False)
@click.option("-o", "--output", help="Output JSONL. Default: <input stem>.completions.jsonl beside a regular "
              "INPUT file, <folder name>.completions.jsonl beside a folder, stdout for stdin or a pipe; '-' = stdout.")
@click.option("--glob", "glob", multiple=True, metavar="PATTERN",
              help="A folder INPUT: read the files whose name matches PATTERN, at any depth; repeat for several. "
                   f"Given, it replaces the default: {', '.join(DEFAULT_GLOBS)}. '*.pdf' reads PDFs "
                   f"({PDF_EXTRA}).")
@model_option
@config_options
@preset_option
@click.option("--batch-size", type=int, default=BatchOptions.batch_size, show_default=True,
              help="Rows decoded together (1 = one row at a time, records in input order).")
@click.option("--stats-log", type=click.Path(dir_okay=False), help="Write per-row stats (no texts) as JSONL.")
@click.option("--summary-json", type=click.Path(dir_okay=False), help="Write the end-of-run summary as JSON.")
@click.option("--texts", type=click.Path(dir_okay=False), metavar="FILE.md",
              help="As the run ends, write every record's texts to FILE.md: a section per row (its id) with the "
                   "completion, or each question and its answer. It reads the output file back: the default output of "
                   "a file or folder INPUT works; an output on stdout (-o -, or INPUT from stdin) does not.")
@click.option("--overwrite", is_flag=True, help="Start a fresh output instead of resuming.")
@click.option("--accept-old-records", is_flag=True,
              help="Resume over records made from other rows or settings, counting them as done.")
@click.option("--limit", type=click.IntRange(min=0), default=None, help="Run only the first N rows.")
@click.option("--calibrate", type=click.IntRange(min=1), default=None, metavar="N",
              help="Without a saved tuning for the model and a layout you set: measure the quick candidates on the "
                   "first N rows' documents against the full cache at this run's budget, choose, save the choice as "
                   "the model's tuning and run every row with it (docs/batch.md: what it costs). Off by default.")
@click.option("--max-kv-memory", metavar="SIZE", default=None,
              help="KV memory the rows in flight may reach together, e.g. 2GiB or 512MiB; a row joins the batch "
                   "only while it fits, and a row that cannot fit alone becomes a kv_memory_exceeded record.  "
                   "[default: half the machine's memory (of Metal's recommended working set on a Mac)]")
@run_options
@click.option("--job", "job_file", type=click.Path(dir_okay=False), help="TOML job file; command-line options "
              "override it.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar; only the final summary.")
@verbose_option("One line per finished row on stderr: id, tokens seen and kept, compression, seconds.")
@click.version_option(__version__, prog_name="knorm-batch")
@click.pass_context
def batch_command(ctx: click.Context, input_path: Optional[str], job_file: Optional[str], quiet: bool,
                  verbose: bool, overwrite: bool, accept_old_records: bool, **opts: Any) -> None:
    """Run a model with KV-cache eviction over every row of a JSONL file (or every file of a folder), writing one JSONL record per row.

    INPUT is a JSONL file ('-' = stdin) or a folder, which gives one row per file
    that --glob matches (its id: the file's path under the folder; its text: the
    document, asked --question). Eviction runs the default rule, or the one --keep
    or --preset names; the instructions, questions and answers are never evicted.

    Rerunning the same command resumes where it stopped. Exit status: 0 all rows
    ok (an input with no rows too, with a warning), 1 some rows failed (the
    summary names the first few; every one has an error record), 2 usage error
    (nothing run), 3 I/O error such as a full disk (rerun to resume), 4 internal
    error, 130 interrupted by SIGINT or SIGTERM (rerun to resume), 141 the
    output pipe was closed.
    """
    settings = _settings(ctx, input_path, job_file, opts)
    try:
        eviction, generation = build_configs(settings)
        rows = rows_config(settings)
        max_kv = settings.get("max_kv_memory")
        max_kv = None if max_kv is None else parse_size(max_kv)
    except ValueError as e:
        raise UsageFailure(str(e)) from None
    _check_first_row(settings.get("input"), rows)
    options = BatchOptions(model=settings["model"], eviction=eviction, generation=generation,
                           auto_layout=auto_layout(settings), batch_size=settings["batch_size"], overwrite=overwrite,
                           accept_old_records=accept_old_records, limit=settings.get("limit"),
                           stats_log=settings.get("stats_log"), summary_json=settings.get("summary_json"),
                           texts=settings.get("texts"), rows=rows, globs=tuple(settings.get("glob") or ()), max_kv_memory=max_kv,
                           extra_eos_tokens=tuple(settings.get("extra_eos_tokens") or ()),
                           chat_template_config=settings.get("chat_template_config"),
                           adapter_path=settings.get("adapter_path"),
                           trust_remote_code=bool(settings.get("trust_remote_code")), verbose=verbose,
                           calibrate=settings.get("calibrate"))
    _run(ctx, settings, options, quiet)


def _check_first_row(path: Any, shape: Any) -> None:
    """A JSONL file whose first row holds its document in another field than --context-field
    (``text`` where the run reads ``context``): every row would fail alike, so it is a usage
    error before the model loads, naming the option that fixes it. Anything else a first row
    gets wrong is its own error record, as ever."""
    from .batch.rows import RowError, parse_row

    if not isinstance(path, str) or path == "-" or not Path(path).expanduser().is_file():
        return
    try:
        with open(Path(path).expanduser(), "rb") as f:
            line = next((raw for raw in itertools.islice(iter(lambda: f.readline(1 << 20), b""), 1000)
                         if raw.strip()), b"")
        obj = json.loads(line.decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return
    if not isinstance(obj, dict):
        return
    row = parse_row(obj, 1, shape)
    if isinstance(row, RowError) and "use --context-field" in row.message:
        raise UsageFailure(f"{path} {row.message}; nothing was run")


def _run(ctx: click.Context, settings: dict, options: BatchOptions, quiet: bool) -> None:
    from .batch.distributed import PeerLost, group as launch_group

    group = launch_group()  # one process unless started by mlx.launch
    try:
        summary = run_batch(settings["input"], settings.get("output"), options, progress=not quiet, group=group,
                            calibrator=settle)
    except BatchUsageError as e:
        if group.rank:  # every rank reaches the same verdict; rank 0 says it
            ctx.exit(EXIT_USAGE)
        raise UsageFailure(str(e)) from None
    except Interrupted:
        click.echo("knorm-batch: interrupted before any row ran; nothing was written", err=True)
        ctx.exit(EXIT_INTERRUPTED)
    except PeerLost as e:  # another rank was killed: not a bug here, and the same contract as a full disk
        click.echo(f"knorm-batch: {e}; finished records are kept in the part files, rerun the launch to resume "
                   f"(mlx.launch reports which rank exited, with its status)", err=True)
        ctx.exit(EXIT_IO_ERROR)
    except Exception:  # noqa: BLE001 - a bug, not a bad row: say so, with the traceback to report
        click.echo(traceback.format_exc(), err=True, nl=False)
        click.echo("knorm-batch: internal error (please report it); finished records are kept and a rerun "
                   "resumes", err=True)
        ctx.exit(EXIT_INTERNAL_ERROR)
    if summary.pipe_closed:
        ctx.exit(summary.exit_code)  # the reader left: end quietly, as Unix tools do
    if group.rank and not (summary.interrupted or summary.io_error):
        # Rank 0 reports the job. A non-zero exit here would make mlx.launch stop the
        # other ranks, rank 0 among them, while it may still be printing.
        ctx.exit(0)
    # without -q, the run said its warnings as they arose, and its KV memory line as it started
    click.echo(summary.text(warnings=quiet, memory=quiet), err=True)
    if summary.interrupted or summary.io_error:
        what = "interrupted" if summary.interrupted else "stopped"
        if group.distributed:
            click.echo(f"rank {group.rank}: {what}; every finished record is in its part file. Rerun the same "
                       "mlx.launch command (without --overwrite) to resume", err=True)
        elif summary.output == "-":
            click.echo(f"{what} after {summary.ok + summary.failed} rows; output went to stdout, so there is "
                       "nothing to resume", err=True)
        else:
            click.echo(f"{what} after {summary.ok + summary.failed} rows; to resume, run:\n  "
                       f"{resume_command(ctx.meta.get('argv', []))}", err=True)
    ctx.exit(summary.exit_code)


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point. Click's own handling would turn a Ctrl-C outside the runner
    (while options are parsed) into "Aborted!" and status 1; here it is an
    interrupt like any other: status 130."""
    try:
        code = batch_command.main(args=argv, prog_name="knorm-batch", standalone_mode=False)
    except click.ClickException as e:
        e.show()
        code = e.exit_code
    except (KeyboardInterrupt, click.Abort):
        print("knorm-batch: interrupted before any row ran; nothing was written", file=sys.stderr)
        code = EXIT_INTERRUPTED
    sys.exit(code or 0)


@click.command(name="knorm-generate", cls=_Command, context_settings=HELP)
@click.option("-p", "--prompt", required=True, metavar="TEXT",
              help="The prompt (with --save-prompt-cache: the document; with --prompt-cache-file: the question); "
                   "'-' reads it from stdin. TEXT is read as written: a backslash and an n stay two characters "
                   "(mlx_lm.generate reads them as a newline), so -p \"$(cat FILE)\" passes a file's text unchanged.")
@model_option
@generation_options
@preset_option
@generate_run_options
@click.option("--save-prompt-cache", metavar="FILE", default=None,
              help="Compress the prompt, a document, once through the eviction caches and save them to FILE "
                   "(.safetensors) with what is needed to check and continue them; nothing is generated. Ask it "
                   "questions later with --prompt-cache-file FILE.")
@click.option("--question", "questions", multiple=True, metavar="TEXT",
              help="With --save-prompt-cache: a question the document will be asked (repeat for several); the "
                   "question rule (the default) keeps what it would attend to. Any question can be asked later; "
                   "without one the rule reads the document's last paragraph.")
@click.option("--prompt-cache-file", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              callback=lambda ctx, param, value: _existing_cache_file(value),
              help="Answer the prompt, a question, after the document saved in FILE with --save-prompt-cache: the "
                   "whole prompt is the document, the file's question separator and the question. The file is only "
                   "read, so it answers any number of questions. The model and eviction settings are the file's: "
                   "leave them out, or give the same.")
@verbose_option("Also print the model and the KV memory bound before the text.")
@click.version_option(__version__, prog_name="knorm-generate")
@click.pass_context
def generate_command(ctx: click.Context, prompt: str, model: str, preset: Optional[str], verbose: bool,
                     save_prompt_cache: Optional[str], questions: tuple, prompt_cache_file: Optional[str],
                     extra_eos_tokens: tuple, chat_template_config: Optional[dict], adapter_path: Optional[str],
                     trust_remote_code: bool, **opts: Any) -> None:
    """Generate for one prompt with KV-cache eviction, in mlx_lm.generate's shape.

    The text is printed as it is generated (stdout), then one stats line (stderr):
    prompt tokens, tokens kept, compression, prompt and generation speed, peak
    memory, and the KV memory kept: what the budget holds, plus the pinned tokens
    (template, question, answer) held on top of it.

    Compress a document once and ask it many questions, as mlx_lm.cache_prompt
    and mlx_lm.generate --prompt-cache-file do: knorm-generate -p DOCUMENT
    --save-prompt-cache doc.safetensors, then knorm-generate --prompt-cache-file
    doc.safetensors -p QUESTION, for each question.

    Exit status: 0 done, 2 usage error (an option, the model, an empty prompt or
    one longer than the model's context, a prompt cache file that does not fit
    the run; nothing generated or saved), 4 internal error, 130 interrupted, 141
    the output pipe was closed.
    """
    text = _prompt_text(prompt)
    _check_cache_options(save_prompt_cache, questions, prompt_cache_file, opts["long_documents"])
    _make_save_folder(save_prompt_cache)
    run = BatchOptions(model=model, extra_eos_tokens=extra_eos_tokens, chat_template_config=chat_template_config,
                       adapter_path=adapter_path, trust_remote_code=trust_remote_code)
    if prompt_cache_file:
        _ask_saved_document(ctx, text, prompt_cache_file, run, preset, verbose, opts)
        return
    eviction, generation = _configs({**opts, "preset": preset})
    loaded, tokenizer = _load_generate_model(run)
    eviction = _layout(loaded, tokenizer, eviction, preset, opts, text)
    if save_prompt_cache:
        _save_document(ctx, text, save_prompt_cache, questions, (loaded, tokenizer), eviction, generation, run,
                       verbose)
        return
    resolved = _for_model(eviction, loaded)
    if verbose:
        _describe_run(loaded, model, resolved, "the template and the answer")
    result = _stream_text(ctx, stream_with_eviction(loaded, tokenizer, text, eviction=resolved, generation=generation))
    click.echo(stats_line(result, kv_memory(loaded, resolved), "the template and the answer"), err=True)
    warning = budget_warning(resolved.budget, result.prompt_tokens, whose="the", ratio=resolved.ratio)
    if warning:
        click.echo(f"knorm-generate: warning: {warning}", err=True)


def _existing_cache_file(path: Optional[str]) -> Optional[str]:
    """--prompt-cache-file's value, or UsageFailure naming how to make the file."""
    if path is not None and not Path(path).expanduser().is_file():
        raise UsageFailure(f"--prompt-cache-file {path}: no such file; save a document there first: knorm-generate "
                           f"-p DOCUMENT --save-prompt-cache {shlex.quote(path)}")
    return path


def _prompt_text(prompt: str) -> str:
    """--prompt's text as written (no escapes read: a document's literal backslash-n stays), or
    stdin for '-'."""
    return sys.stdin.read() if prompt == "-" else prompt


def _make_save_folder(path: Optional[str]) -> None:
    """--save-prompt-cache FILE: its folder created when missing (as knorm-batch creates -o's),
    before the model loads; a folder that cannot be made is a usage error."""
    if not path:
        return
    from .generation.prompt_cache import SUFFIX

    target = Path(path).expanduser()
    if target.suffix != SUFFIX or target.parent.is_dir():
        return  # a wrong name is refused, naming the fix, where the document is saved
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageFailure(f"--save-prompt-cache {path}: cannot create the folder {target.parent} "
                           f"({e.strerror or e})") from None


def _check_cache_options(save: Optional[str], questions: tuple, load: Optional[str], long_documents: str) -> None:
    """UsageFailure for prompt cache options that cannot go together."""
    if save and load:
        raise UsageFailure("--save-prompt-cache saves a document and --prompt-cache-file asks a saved one a "
                           "question: give one of them (save first, then ask)")
    if questions and not save:
        raise UsageFailure("--question says what a document is saved for: give it with --save-prompt-cache; to ask "
                           "a saved document, give the question as --prompt with --prompt-cache-file")
    if (save or load) and long_documents != "error":
        raise UsageFailure("--long-documents truncate cuts a prompt as it is read, and a saved document is read "
                           "whole: leave it out (cut a document too long for the model's context before saving it)")


def _configs(settings: dict) -> tuple[EvictionConfig, GenerationConfig]:
    """:func:`build_configs`, a bad value a usage error."""
    try:
        return build_configs(settings)
    except ValueError as e:
        raise UsageFailure(str(e)) from None


def _load_generate_model(run: BatchOptions) -> tuple[Any, Any]:
    """The model and its tokenizer, with the run's extra eos tokens and template config."""
    try:
        loaded, tokenizer = get_model(run.model, adapter_path=run.adapter_path,
                                      trust_remote_code=run.trust_remote_code)
        return loaded, prepare_tokenizer(tokenizer, run)
    except (BatchUsageError, ValueError) as e:
        raise UsageFailure(str(e)) from None


def _layout(model: Any, tokenizer: Any, eviction: EvictionConfig, preset: Optional[str], opts: dict,
            text: str) -> EvictionConfig:
    """``eviction`` with --preset auto's layout (the model's saved tuning, said on stderr)."""
    if preset != "auto":
        return eviction
    from .generation.tunings import auto_config, run_ratio

    try:
        eviction, note = auto_config(model, eviction, auto_layout({**opts, "preset": preset}),
                                     run_ratio(tokenizer, [text], eviction))
    except ValueError as e:
        raise UsageFailure(str(e)) from None
    click.echo(f"knorm-generate: {note}", err=True)
    return eviction


def _for_model(eviction: EvictionConfig, model: Any) -> ResolvedEviction:
    try:
        return eviction.for_model(model)
    except ValueError as e:
        raise UsageFailure(str(e)) from None


def _describe_run(model: Any, spec: str, resolved: ResolvedEviction, pinned: str) -> None:
    """-v: the model, and the KV memory bound of one prompt."""
    click.echo(f"knorm-generate: {describe_model(model, spec)}", err=True)
    click.echo(f"knorm-generate: {prompt_memory_line(kv_memory(model, resolved), pinned)}", err=True)


def _stream_text(ctx: click.Context, pieces: Any) -> Any:
    """Print the text pieces as they come (stdout); the result that ends them. A bad prompt
    (found as the first piece is made) is a usage error; an interrupt, a closed pipe and a
    bug end the command with their exit status."""
    result = None
    try:
        try:
            first = next(pieces)  # the prompt is encoded and checked here: its errors are usage errors
        except ValueError as e:
            raise UsageFailure(str(e)) from None
        for piece in itertools.chain([first], pieces):
            if isinstance(piece, str):
                click.echo(piece, nl=False)
            else:
                result = piece
        click.echo()
    except KeyboardInterrupt:
        click.echo("\nknorm-generate: interrupted", err=True)
        ctx.exit(EXIT_INTERRUPTED)
    except BrokenPipeError:
        silence_stdout()
        ctx.exit(EXIT_PIPE_CLOSED)
    except click.ClickException:
        raise
    except Exception:  # noqa: BLE001 - a bug: say so, with the traceback to report
        click.echo(traceback.format_exc(), err=True, nl=False)
        click.echo("knorm-generate: internal error (please report it)", err=True)
        ctx.exit(EXIT_INTERNAL_ERROR)
    return result


def _save_document(ctx: click.Context, text: str, path: str, questions: tuple, loaded: tuple,
                   eviction: EvictionConfig, generation: GenerationConfig, run: BatchOptions, verbose: bool) -> None:
    """--save-prompt-cache: the document compressed and saved; its numbers on stderr."""
    from .generation.engine import needs_probe
    from .generation.prompt_cache import save_document

    model, tokenizer = loaded
    resolved = _for_model(eviction, model)
    if verbose:
        _describe_run(model, run.model, resolved, "the template, and later each question and answer")
    try:
        report = save_document(model, tokenizer, text, path, eviction=eviction, generation=generation,
                               questions=questions, model_spec=run.model, adapter_path=run.adapter_path,
                               chat_template_config=run.chat_template_config)
    except ValueError as e:  # a bad document, file name or setting (PromptCacheError, PromptTooLongError)
        raise UsageFailure(str(e)) from None
    except KeyboardInterrupt:
        click.echo("knorm-generate: interrupted; nothing was saved", err=True)
        ctx.exit(EXIT_INTERRUPTED)
    click.echo(save_line(report), err=True)
    if not questions and needs_probe(resolved):
        click.echo("knorm-generate: no --question: the question rule kept what the document's last paragraph would "
                   "attend to; give --question with the question you will ask (or one like it) to keep what it "
                   "needs", err=True)
    warning = budget_warning(resolved.budget, report.prompt_tokens, whose="the", ratio=resolved.ratio)
    if warning:
        click.echo(f"knorm-generate: warning: {warning}", err=True)


def save_line(report: Any) -> str:
    """The line --save-prompt-cache ends with: what was saved, and how to ask it."""
    from .eviction.memory import mib

    return (f"knorm-generate: saved {report.path} ({mib(report.file_bytes)}): a document of {report.document_tokens} "
            f"tokens ({report.prompt_tokens} with the template), {report.tokens_kept} positions kept per compressed "
            f"layer ({report.compression_ratio:.2f}x compression of the document), KV {mib(report.kept_bytes)} of "
            f"{mib(report.full_bytes)}, prefill {report.prefill_s:.1f} s; ask it: knorm-generate --prompt-cache-file "
            f"{shlex.quote(report.path)} -p QUESTION")


def _ask_saved_document(ctx: click.Context, question: str, path: str, run: BatchOptions, preset: Optional[str],
                        verbose: bool, opts: dict) -> None:
    """--prompt-cache-file: ``question`` answered after the saved document, from the file's
    caches pinned; the run's settings checked against the file's first."""
    from .generation.prompt_cache import DOCUMENT_SETTINGS, PromptCacheError, read_document, resolved_for, stream_answer_from

    given = _given(ctx, opts)
    try:
        saved = read_document(path)
        run = _saved_run(ctx, saved, run)
        _check_saved_settings(saved, preset, {k: opts[k] for k in given})
    except PromptCacheError as e:
        raise UsageFailure(str(e)) from None
    model, tokenizer = _load_generate_model(run)
    try:
        resolved = resolved_for(saved, model)
    except PromptCacheError as e:
        raise UsageFailure(str(e)) from None
    if verbose:
        click.echo(f"knorm-generate: {describe_model(model, run.model)}", err=True)
        click.echo(f"knorm-generate: {saved_document_line(saved)}", err=True)
    fields_ = {k: v for k, v in opts.items() if k in GENERATION_FIELDS and (k in given or k not in DOCUMENT_SETTINGS)}
    result = _stream_text(ctx, stream_answer_from(model, tokenizer, saved, question, consume=True, **fields_))
    click.echo(stats_line(result, kv_memory(model, resolved), "the template, question and answer",
                          saved_tokens=len(saved.ids)), err=True)


def _given(ctx: click.Context, opts: dict) -> set:
    """The options of ``opts`` the command line (or the environment) gave."""
    return {name for name in opts
            if ctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)}


def _saved_run(ctx: click.Context, saved: Any, run: BatchOptions) -> BatchOptions:
    """The run with the saved document's model, adapters and chat template config, unless
    the command line gives others: UsageFailure names them and the fix."""
    from dataclasses import replace

    from .generation.prompt_cache import model_id

    differ = []
    if ctx.get_parameter_source("model") == ParameterSource.COMMANDLINE and model_id(run.model) != saved.model:
        differ.append(("--model", saved.model, run.model))
    if run.adapter_path is not None and model_id(run.adapter_path) != saved.adapter_path:
        differ.append(("--adapter-path", saved.adapter_path, run.adapter_path))
    if run.chat_template_config is not None and run.chat_template_config != saved.chat_template_config:
        differ.append(("--chat-template-config", json.dumps(saved.chat_template_config),
                       json.dumps(run.chat_template_config)))
    if differ:
        listed = "; ".join(f"{name} {theirs} here, {mine} in the file" for name, mine, theirs in differ)
        names = ", ".join(name for name, _, _ in differ)
        raise UsageFailure(f"{saved.path} was saved with another model or template ({listed}): leave out {names} "
                           f"(the file's are used), or save the document again with them")
    return replace(run, model=saved.model, adapter_path=saved.adapter_path,
                   chat_template_config=saved.chat_template_config)


def _check_saved_settings(saved: Any, preset: Optional[str], given: dict) -> None:
    """UsageFailure when the eviction or document settings the command line gives differ
    from those the document was saved with (naming each, the file's value and the fix)."""
    from .generation.prompt_cache import describe_differences, eviction_differences, generation_differences

    if preset == "auto":
        raise UsageFailure(f"--preset auto chooses a layout before a document is compressed, and {saved.path} keeps "
                           f"the one it was saved with: leave out --preset")
    eviction = {k: v for k, v in given.items() if k in EVICTION_FIELDS}
    try:
        candidate = make_configs(saved.eviction, preset=preset, **eviction)[0] if eviction or preset else None
    except ValueError as e:
        raise UsageFailure(str(e)) from None
    differ = (eviction_differences(saved, candidate) if candidate else []) + generation_differences(saved, given)
    if differ:
        raise UsageFailure(f"{saved.path} was compressed with other settings ({describe_differences(differ)}): "
                           f"leave those options out (the file's are used), or save the document again with them")


def saved_document_line(saved: Any) -> str:
    """-v with --prompt-cache-file: what the file holds."""
    from .eviction.memory import cache_stats, mib

    stats = cache_stats(saved.caches)
    asked = ("compressed for " + "; ".join(repr(q) for q in saved.questions) if saved.questions
             else "compressed for no question in particular")
    return (f"prompt cache {saved.path}: a document of {len(saved.ids)} tokens with the template, "
            f"{stats.tokens_kept} positions kept per compressed layer ({stats.compression_ratio:.2f}x compression of "
            f"the document), KV {mib(stats.kept_bytes)} of {mib(stats.full_bytes)}, {asked}; the question and "
            f"answer are pinned on top")


def prompt_memory_line(memory: Any, pinned: str) -> str:
    """-v: the KV memory bound of one prompt, in knorm-generate's words (``pinned``: what
    the prompt's pinned tokens are); ``KVMemory.describe`` speaks of a batch's rows."""
    per_pinned = (f"plus {memory.pinned_bytes_per_token / 1024:.1f} KiB per pinned token ({pinned}, held on top of "
                  f"the budget)")
    if memory.ceiling_bytes is None:
        grow = sum(1 for _, cap in memory.layers if cap is None)
        line = (f"KV memory: no ceiling: {grow} of {len(memory.layers)} layers keep every token "
                f"(+{memory.growth_bytes_per_token / 1024:.1f} KiB per token; "
                f"{memory.bytes_at(8192) / 2**20:.1f} MiB at 8192 tokens)")
        own = memory.own_line(8192)
    elif memory.ratio is not None:
        capped = f", at most {memory.cap} tokens (--budget caps it)" if memory.cap is not None else ""
        line = (f"KV memory: 1/{memory.ratio:g} of the document's tokens per compressed layer{capped}, so at most "
                f"{memory.ceiling_bytes / 2**20:.1f} MiB for a document of {memory.doc_tokens} tokens (the model's "
                f"context) and less for a shorter one, {per_pinned}")
        own = memory.own_line(memory.doc_tokens)
    else:
        line = f"KV memory: at most {memory.ceiling_bytes / 2**20:.1f} MiB for the document whatever its length, {per_pinned}"
        own = memory.own_line(8192)
    if memory.kv_bits:
        line += (f" (keys and values stored at {memory.kv_bits} bits, groups of {memory.kv_group_size}; "
                 f"sliding-window layers in full precision)")
    return line + own


def stats_line(result: Any, memory: Any = None, pinned: str = "the template, question and answer",
               saved_tokens: int = 0) -> str:
    """``knorm-generate``'s one line of numbers after the text. With ``memory`` (the run's
    :class:`~knorm_gen.eviction.memory.KVMemory`) and a ceiling, the KV kept is split into what the
    budget holds and the pinned tokens (``pinned``: what they are) held on top of it. With
    ``saved_tokens`` (a saved document's), the prompt rate is of the tokens read after it."""
    from .eviction.memory import mib

    read = (f" ({result.prompt_tokens - saved_tokens} read now after {saved_tokens} saved)" if saved_tokens else "")
    line = (f"knorm-generate: prompt {result.prompt_tokens} tokens{read}, kept {result.tokens_kept} of "
            f"{result.tokens_seen} seen ({result.compression_ratio:.2f}x compression); "
            f"prompt {result.prompt_tps:.1f} tokens/s, generation {result.generation_tps:.1f} tokens/s "
            f"({result.generated_tokens} tokens, {result.finish_reason}); peak memory {result.peak_memory_gb:.3f} GB; "
            f"KV kept {mib(result.kept_bytes)} of {mib(result.full_bytes)}")
    if memory is None or memory.ceiling_bytes is None or not result.tokens_pinned:
        return line
    pinned_bytes = result.tokens_pinned * memory.pinned_bytes_per_token
    return (f"{line} ({mib(result.kept_bytes - pinned_bytes)} within the budget, plus {mib(pinned_bytes)} for "
            f"{result.tokens_pinned} pinned tokens held on top of it: {pinned})")


@click.command(name="knorm-tune", context_settings=HELP)
@click.argument("docs", required=False, type=click.Path(dir_okay=False, allow_dash=False))
@model_option
@click.option("--context-field", default="context", show_default=True,
              help="The field of DOCS holding a document, as knorm-batch's --context-field.")
@click.option("--budget", type=click.IntRange(min=8), default=None,
              help="As in knorm-batch: given alone, the fixed budget your runs use (every candidate keeps N tokens "
                   "of each document, so the compression measured is each document's tokens / N); with --ratio, a "
                   "cap on it.")
@click.option("--ratio", type=click.FloatRange(min=1.5), default=None,
              help=f"As in knorm-batch: every candidate keeps each document's tokens / R (at most --budget when "
                   f"given).  [default: {DEFAULT_RATIO:g} when no --budget is given]")
@click.option("--task", type=click.Choice(TUNE_TASKS), default="both", show_default=True,
              help="What the layout is chosen for: summarize (summary fidelity), retrieve (pass keys) or both.")
@click.option("--job", hidden=True, expose_value=False, callback=_refusal(TUNE_JOB_HINT))
@click.option("--arms", default=None, help=f"Candidates, comma-separated (default: {','.join(TUNE_ARMS)}; random "
              f"eviction, the control, is always measured). All: " + ",".join(CANDIDATES))
@click.option("--docs-limit", type=click.IntRange(min=1), default=None,
              help=f"Documents measured (the first ones of DOCS, or of the shipped corpus).  [default: "
                   f"{TUNE_DOCS}; {QUICK_DOCS} with --quick]")
@click.option("--doc-tokens", type=click.IntRange(min=256), default=DOC_TOKENS, show_default=True,
              help="A document longer than N tokens is cut to its first N; shorter ones are measured whole.")
@click.option("--quick", is_flag=True, help=f"{QUICK_DOCS} documents, one filler and {len(QUICK_ARMS)} candidates "
              f"({', '.join(QUICK_ARMS)}).")
@click.option("--out", type=click.Path(dir_okay=False), default=None, help="Also write the full result as JSON here.")
@click.option("--no-save", is_flag=True, help="Do not save the choice as this model's tuning (--preset auto).")
@click.option("--target-fidelity", type=click.FloatRange(0, 1, min_open=True), default=None,
              help="Budget sweep: the summary fidelity (recovered share, e.g. 0.9) a budget must keep.")
@click.option("--target-keys", type=click.FloatRange(0, 1, min_open=True), default=None,
              help="Budget sweep: the share of the full cache's pass keys (e.g. 0.9) a budget must find.")
@click.option("--sweep", "sweep_ratios", default=None,
              help="Budget sweep: compression ratios at which the chosen layout is measured again, comma-separated "
                   "(default with a target: 8,6,4,3,2); reports the smallest budget meeting the targets.")
@click.version_option(__version__, prog_name="knorm-tune")
def tune_command(docs: Optional[str], model: str, context_field: str, budget: Optional[int], ratio: float,
                 task: str, arms: Optional[str], docs_limit: Optional[int], doc_tokens: int, quick: bool,
                 out: Optional[str], no_save: bool, target_fidelity: Optional[float], target_keys: Optional[float],
                 sweep_ratios: Optional[str]) -> None:
    """Measure which eviction layout keeps the most on your model and documents, and save it for --preset auto.

    DOCS: JSONL rows with the document in --context-field (as knorm-batch reads
    them). The layouts are measured on three tasks at your run's compression,
    through the product's own prefill: summary fidelity (the full cache's own
    summary, teacher-forced), pass keys placed inside the documents and in repeated
    filler (a filler's also asked inside one prompt, as generate_with_eviction runs
    it), and perplexity: one prefill per layout and document serves all three. Each
    document is measured at its own length (cut above --doc-tokens) at --budget or
    --ratio. Prints the table (the chosen layout first; each layout's paired
    difference to random eviction with its 95% interval; the documents whose
    reference summary is degenerate, left out of fidelity; whether the documents can
    separate the layouts), saves the choice as this model's tuning (used by --preset
    auto and knorm_gen.tuned_config) and, with --out, the JSON. A layout below random
    eviction beyond its interval is never chosen.

    With --target-fidelity / --target-keys (or --sweep) the chosen layout is then
    measured at other compressions on the same cases, and the smallest budget that
    meets the targets is reported (each ratio costs about a tuning of one candidate).

    Without DOCS it measures the long sections of CPython's pydoc_data.topics.
    Exit status: 0 done, 2 usage error (before any measurement), 130 interrupted.
    """
    if ratio is None and budget is None:
        ratio = DEFAULT_RATIO
    sweep = _sweep_ratios(sweep_ratios) if sweep_ratios else \
        SWEEP_RATIOS if target_fidelity is not None or target_keys is not None else ()
    names = _tune_arms(arms, quick)
    documents = _tune_documents(docs, context_field, docs_limit or (QUICK_DOCS if quick else TUNE_DOCS))
    try:
        loaded, tokenizer = get_model(model)
    except (BatchUsageError, ValueError) as e:
        raise UsageFailure(str(e)) from None
    lengths = _tune_lengths(tokenizer, documents, doc_tokens, None if ratio is not None else budget)
    at = (f"your runs' budget {budget} (about {sum(lengths) / len(lengths) / budget:.1f}x)" if ratio is None
          else f"{ratio:g}x" + (f" capped at {budget} tokens" if budget is not None else ""))
    click.echo(f"knorm-tune: {len(names)} candidates on {len(documents)} document(s) of about "
               f"{sum(lengths) // len(lengths)} tokens at {at}, task {task}", err=True)
    try:
        record = tune(loaded, tokenizer, documents, ratio=ratio, budget=budget, job=task, arms=names,
                      doc_tokens=doc_tokens, fillers=TUNE_FILLERS[:1] if quick else TUNE_FILLERS, log=lambda m: None,
                      sweep=sweep, targets=(target_fidelity, target_keys))
    except KeyboardInterrupt:
        click.echo("knorm-tune: interrupted", err=True)
        sys.exit(EXIT_INTERRUPTED)
    record["model"] = model
    _report_tuning(record, loaded, no_save, out)


def _tune_arms(arms: Optional[str], quick: bool) -> tuple[str, ...]:
    """The candidates to measure (random eviction among them), or UsageFailure naming an unknown one."""
    names = QUICK_ARMS if quick and not arms else tuple(a.strip() for a in (arms or ",".join(TUNE_ARMS)).split(","))
    unknown = [a for a in names if a not in CANDIDATES]
    if unknown:
        raise UsageFailure(f"unknown candidate(s) {', '.join(unknown)}; choose from {', '.join(CANDIDATES)}")
    if not any(a != "random" for a in names):
        raise UsageFailure("--arms names only random eviction, the control: name a candidate to measure against it")
    return tuple(dict.fromkeys((*names, "random")))  # the control every verdict is measured against


def _tune_lengths(tokenizer: Any, documents: list, doc_tokens: int, budget: Optional[int]) -> list[int]:
    """Each document's tokens as measured (cut above ``doc_tokens``), or UsageFailure for
    documents too short for the runs' budget (or under 256 tokens)."""
    lengths = [min(len(tokenizer.encode(d.text, add_special_tokens=False)), doc_tokens) for d in documents]
    if budget is not None:
        short = [d.name for d, n in zip(documents, lengths) if n < 2 * budget]
        if short:
            raise UsageFailure(f"--budget {budget} keeps half or more of {len(short)} document(s) ({short[0]}, ...): "
                               f"a tuning needs documents of at least twice the budget; lower --budget or give "
                               f"longer documents")
    elif min(lengths) < 256:
        raise UsageFailure(f"document {documents[lengths.index(min(lengths))].name} has {min(lengths)} tokens; "
                           f"a tuning needs documents of at least 256 tokens")
    return lengths


def _report_tuning(record: dict, model: Any, no_save: bool, out: Optional[str]) -> None:
    """The table (and the sweep's), the saved tuning, the JSON and its plot."""
    click.echo(tune_table(record))
    if record.get("sweep"):
        click.echo(sweep_table(record["sweep"]))
    if not no_save:
        click.echo(f"saved as this model's tuning (--preset auto): {save_tuning(model, record)}", err=True)
    if out:
        Path(out).write_text(json.dumps(record, indent=1))
        _tune_plot(record, Path(out).with_suffix(".png"))


def _sweep_ratios(text: str) -> tuple[float, ...]:
    """--sweep's ratios, or UsageFailure naming the bad one."""
    out = []
    for part in text.split(","):
        try:
            r = float(part)
        except ValueError:
            r = float("nan")
        if not r >= 1.5 or r == float("inf"):
            raise UsageFailure(f"--sweep: {part.strip()!r} is not a compression ratio of at least 1.5; give ratios "
                               f"like 8,6,4,3,2")
        out.append(r)
    return tuple(sorted(set(out), reverse=True))


def sweep_table(sweep: dict) -> str:
    """The budget sweep: each ratio's fidelity and keys, and the smallest budget meeting the targets."""
    targets = [f"fidelity >= {sweep['target_fidelity']:.0%}" if sweep["target_fidelity"] is not None else "",
               f"keys >= {sweep['target_keys']:.0%} of the full cache's" if sweep["target_keys"] is not None else ""]
    targets = [t for t in targets if t]
    lines = [f"budget sweep of {sweep['arm']}" + (f" (targets: {', '.join(targets)})" if targets else ""),
             f"{'ratio':>6s} {'budget':>7s} {'fidelity':>8s} {'keys':>7s}  meets"]
    for p in sweep["points"]:
        rec = "-" if p["recovered"] is None else f"{p['recovered']:.0%}"
        lines.append(f"{p['ratio']:>5.1f}x {p['budget']:>7d} {rec:>8s} {p['keys_of_full']:>3d}/{p['full_keys']:<3d}  "
                     f"{'yes' if p['meets'] else 'no'}")
    best = sweep["smallest"]
    lines.append(f"smallest budget meeting the targets: {best['budget']} tokens per layer ({best['ratio']:g}x)" if best
                 else "no measured budget meets the targets: sweep lower ratios (--sweep 3,2,1.5) or lower the targets")
    return "\n".join(lines)


def _tune_documents(path: Optional[str], field: str, limit: int) -> list:
    """The documents to tune on: DOCS' rows, or the shipped corpus. UsageFailure names a bad file."""
    import json

    from .tuning.corpus import pydoc_sections
    from .tuning.evaluate import Doc

    if path is None:
        shipped = [Doc(f"pydoc:{name}", text) for name, text in pydoc_sections(min_chars=9000)[:limit]]
        if not shipped:
            raise UsageFailure("no documents to tune on: this Python has no pydoc_data.topics (the shipped corpus); "
                               "give your own as DOCS (JSONL rows with the document in --context-field)")
        return shipped
    docs = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageFailure(f"cannot read {path}: {e}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageFailure(f"{path} line {n}: not JSON ({e.msg}); each line must be an object like "
                               f'{{"id": 1, "{field}": "..."}}') from None
        text = row.get(field) if isinstance(row, dict) else None
        if not isinstance(text, str) or not text.strip():
            have = ", ".join(sorted(row)) if isinstance(row, dict) else type(row).__name__
            texts = [k for k, v in row.items() if isinstance(v, str) and v.strip()] if isinstance(row, dict) else []
            name = f": --context-field {texts[0]}" if len(texts) == 1 else " with --context-field"
            raise UsageFailure(f"{path} line {n}: no text in field '{field}' (it has: {have}); name the document's "
                               f"field{name}")
        docs.append(Doc(str(row.get("id", n)), text))
        if len(docs) >= limit:
            break
    if not docs:
        raise UsageFailure(f"{path} holds no rows; give JSONL rows with the document in '{field}'")
    return docs


def tune_table(record: dict) -> str:
    """The terminal table: the chosen layout first, then the others; then the compression
    measured, the documents left out of fidelity, whether the documents separate the
    layouts, and why the chosen one."""
    table = record["table"]
    order = [record["chosen"]] + [a for a in table if a not in (record["chosen"], "full")] + ["full"]
    width = max(15, *(len(a) for a in order))  # a long layout name must not push its row out of the columns
    lines = [f"{'layout':{width}s} {'fidelity':>8s} {'vs random [95%]':>20s} {'wins/rand':>9s} {'keys':>7s} "
             f"{'in docs':>8s} {'filler':>7s} {'ppl x':>6s}  memory"]
    lines += [_tune_row(a, table[a], width, a == record["chosen"]) for a in order if a in table]
    lines.append("keys: found of those the full cache found (in the documents, in repeated filler); "
                 "fidelity: summary recovered; vs random: the mean paired difference to random eviction over "
                 "documents, with its 95% bootstrap interval; ppl: perplexity of each document's end vs the full cache")
    compression = list((record.get("compression") or {}).values())
    if compression:
        lines.append(f"measured at {sum(compression) / len(compression):.2f}x (each document's tokens per kept token: "
                     f"{min(compression):.2f}x to {max(compression):.2f}x; budget {record.get('budget')})")
    for doc, why in (record.get("left_out") or {}).items():
        lines.append(f"left out of fidelity: {doc}: {why}")
    if record.get("separation"):
        lines.append(record["separation"])
    lines.append(f"chosen: {record['chosen']} ({record.get('layout_text') or describe(record['layout'])}): "
                 f"{record['why']}")
    return "\n".join(lines)


def _tune_row(a: str, v: dict, width: int, chosen: bool) -> str:
    """One layout's row of :func:`tune_table`."""
    rec = "-" if v["recovered"] is None else f"{v['recovered']:.0%}"
    ppl = "-" if v["ppl_ratio"] is None else f"{v['ppl_ratio']:.3f}"
    diff, interval = v.get("vs_random"), v.get("vs_random_interval")
    vs = "-" if diff is None else f"{diff:+.1%}" + (f" [{interval[0]:+.0%}, {interval[1]:+.0%}]" if interval else "")
    mem = "grows with input" if a == "full" or not bounded(CANDIDATES.get(a, {})) else "bounded"
    filler, filler_full = v.get("filler_keys_of_full", 0), v.get("filler_full_keys", 0)
    in_docs = f"{v['keys_of_full'] - filler}/{v['full_keys'] - filler_full}"
    return (f"{a:{width}s} {rec:>8s} {vs:>20s} {v['wins_vs_random']:>4d}/{v['fidelity_docs']:<4d} "
            f"{v['keys_of_full']:>3d}/{v['full_keys']:<3d} {in_docs:>8s} {f'{filler}/{filler_full}':>7s} "
            f"{ppl:>6s}  {mem}" + (" <- chosen" if chosen else ""))


def _tune_plot(record: dict, path: Path) -> None:
    """Fidelity and pass keys against the KV bytes each layout kept (mean per document)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        click.echo("knorm-tune: no plot (pip install -e '.[plot]' in the knorm_gen checkout, or pip install matplotlib)", err=True)
        return
    kept: dict[str, list] = {}
    for r in record["rows"]:
        if r["task"] == "fidelity" and r["arm"] != "none" and "kept_bytes" in r:
            kept.setdefault(r["arm"], []).append(r["kept_bytes"])
            kept.setdefault("full", []).append(r["full_bytes"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for a, v in record["table"].items():
        if a not in kept:
            continue
        mib = sum(kept[a]) / len(kept[a]) / 2**20
        keys = v["keys_of_full"] / max(v["full_keys"], 1)
        for ax, y in zip(axes, (v["recovered"], keys)):
            if y is not None:
                ax.scatter(mib, y, marker="*" if a == record["chosen"] else "o")
                ax.annotate(a, (mib, y), fontsize=7)
    axes[0].set_ylabel("summary fidelity (recovered share)")
    axes[1].set_ylabel("pass keys (share of the full cache's)")
    for ax in axes:
        ax.set_xlabel("KV kept per document, MiB (mean)")
    fig.suptitle(f"knorm-tune at {record['ratio']:.1f}x: {record['chosen']} chosen (*)")
    fig.tight_layout()
    fig.savefig(path)
    click.echo(f"knorm-tune: plot {path}", err=True)


def probe_command() -> None:
    """``knorm-probe``: the key-norm / attention probe (lives in :mod:`knorm_gen.tuning.probe`)."""
    from .tuning.probe import probe_cli

    probe_cli()


if __name__ == "__main__":
    main()
