"""What every command shares: options generated from the config fields (name, default and help
come from each field), mlx_lm's names for them, the options refused with a hint, and
``--verbose``."""

from __future__ import annotations

import json
from dataclasses import Field, fields
from typing import Any, Callable, Optional

import click

from ..batch.job import (
    EXIT_USAGE,
    BatchOptions,
)
from ..eviction.config import (
    PRESETS,
    EvictionConfig,
    GenerationConfig,
    RowsConfig,
)

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


_TYPES = {"int": click.INT, "Optional[int]": click.INT, "float": click.FLOAT, "Optional[float]": click.FLOAT,
          "str": click.STRING,
          "Optional[str]": click.STRING, "tuple[str, ...]": click.STRING}


class _Choice(click.Choice):
    """click's Choice, with a pointer for a rule name a reader of the paper may try
    (``--keep l2norm``: the rule is ``low``)."""

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        try:
            return super().convert(value, param, ctx)
        except click.BadParameter as e:
            from ..eviction.config import RULE_HINTS

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


def refusal(hint: str) -> Callable:
    """A callback that refuses its option, given any value, with ``hint`` (what to use instead)."""
    def refuse(ctx: click.Context, param: click.Parameter, value: Any) -> None:
        if value is not None:
            raise UsageFailure(hint)

    return refuse


def refused_options(hints: dict[str, str]) -> list[Callable]:
    """Hidden options that name what to use instead (``{"--max-kv-size": hint}``)."""
    return [click.option(name, hidden=True, expose_value=False, callback=refusal(hint), metavar="N", help=hint)
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
        *refused_options(refused),
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


class Command(click.Command):
    """A command that reads ``--verbose True|False`` as mlx_lm's commands do."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, verbose_args(list(args)))


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
