"""``knorm-generate``: one prompt, streamed, as ``mlx_lm.generate`` runs it, with eviction; its prompt
cache (``--save-prompt-cache``, ``--prompt-cache-file``) lives in
:mod:`knorm_gen.generation.prompt_cache`."""

from __future__ import annotations

import itertools
import json
import shlex
import sys
import traceback
from pathlib import Path
from typing import Any, Optional

import click
from click.core import ParameterSource

from .. import __version__
from ..batch.job import (
    EXIT_INTERNAL_ERROR,
    EXIT_INTERRUPTED,
    EXIT_PIPE_CLOSED,
    BatchOptions,
    BatchUsageError,
    prepare_tokenizer,
)
from ..batch.sink import budget_warning, silence_stdout
from ..eviction.config import (
    EVICTION_FIELDS,
    GENERATION_FIELDS,
    EvictionConfig,
    GenerationConfig,
    ResolvedEviction,
    make_configs,
)
from ..eviction.memory import kv_memory
from ..generation.generate import stream_with_eviction
from ..models.load import get_model
from ..models.support import describe_model
from .job_file import auto_layout, build_configs
from .options import (
    HELP,
    Command,
    UsageFailure,
    generate_run_options,
    generation_options,
    model_option,
    preset_option,
    verbose_option,
)


@click.command(name="knorm-generate", cls=Command, context_settings=HELP)
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
    from ..generation.prompt_cache import SUFFIX

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
    from ..generation.tunings import auto_config, run_ratio

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
    from ..generation.engine import needs_probe
    from ..generation.prompt_cache import save_document

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
    from ..eviction.memory import mib

    return (f"knorm-generate: saved {report.path} ({mib(report.file_bytes)}): a document of {report.document_tokens} "
            f"tokens ({report.prompt_tokens} with the template), {report.tokens_kept} positions kept per compressed "
            f"layer ({report.compression_ratio:.2f}x compression of the document), KV {mib(report.kept_bytes)} of "
            f"{mib(report.full_bytes)}, prefill {report.prefill_s:.1f} s; ask it: knorm-generate --prompt-cache-file "
            f"{shlex.quote(report.path)} -p QUESTION")


def _ask_saved_document(ctx: click.Context, question: str, path: str, run: BatchOptions, preset: Optional[str],
                        verbose: bool, opts: dict) -> None:
    """--prompt-cache-file: ``question`` answered after the saved document, from the file's
    caches pinned; the run's settings checked against the file's first."""
    from ..generation.prompt_cache import (
        DOCUMENT_SETTINGS,
        PromptCacheError,
        read_document,
        resolved_for,
        stream_answer_from,
    )

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

    from ..generation.prompt_cache import model_id

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
    from ..generation.prompt_cache import describe_differences, eviction_differences, generation_differences

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
    from ..eviction.memory import cache_stats, mib

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
    from ..eviction.memory import mib

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
