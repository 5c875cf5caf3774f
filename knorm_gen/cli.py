"""Command line: ``knorm-batch`` (and ``knorm-probe``). Parse options, call the library.

Every eviction and generation option is a field of :class:`EvictionConfig` or
:class:`GenerationConfig`; job files use the same names in their ``[eviction]``
and ``[generation]`` tables, and ``tests/test_cli.py`` checks that each field is
reachable from both surfaces.
"""

from __future__ import annotations

import os
import shlex
import sys
import traceback
from pathlib import Path
from typing import Any, Optional

import click
from click.core import ParameterSource

from . import __version__
from .batch import (
    EXIT_INTERNAL_ERROR,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    BatchOptions,
    BatchUsageError,
    Interrupted,
    run_batch,
)
from .config import EVICTION_FIELDS, GENERATION_FIELDS, KEEP_MODES, EvictionConfig, GenerationConfig

RUN_KEYS = ("input", "output", "model", "batch_size", "stats_log", "summary_json", "limit")
JOB_KEYS = {None: RUN_KEYS, "eviction": EVICTION_FIELDS, "generation": GENERATION_FIELDS}
JOB_PATHS = ("input", "output", "stats_log", "summary_json")


class UsageFailure(click.ClickException):
    """A problem found before any work starts: exit status 2, no usage dump."""

    exit_code = EXIT_USAGE


def parse_budget(value: Any) -> Optional[int]:
    """``none``/``full`` (or None) = full cache, else an integer >= 1."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "full")):
        return None
    if isinstance(value, bool):
        raise ValueError(f"budget must be an integer >= 1 or 'none', got {value!r}")
    try:
        budget = int(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"budget must be an integer >= 1 or 'none', got {value!r}") from None
    if budget < 1 or (isinstance(value, float) and value != budget):
        raise ValueError(f"budget must be an integer >= 1 or 'none', got {value!r}")
    return budget


def _layer_list(text: str, what: str) -> list[int]:
    """``0,1`` or ``0-8`` (inclusive ranges) to a list of layer indices."""
    message = f"{what} must be layer indices like '0,1' or '0-8'; got {text!r}"
    items: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        lo, dash, hi = part.partition("-")
        if dash and lo.strip().isdigit() and hi.strip().isdigit():
            if int(hi) < int(lo):
                raise ValueError(f"{what}: the range {part!r} is empty; write it low-high, e.g. "
                                 f"'{hi.strip()}-{lo.strip()}'")
            items.extend(range(int(lo), int(hi) + 1))
        else:
            try:
                items.append(int(part))
            except ValueError:
                raise ValueError(message) from None
    return items


def parse_skip_layers(value: Any) -> tuple[int, ...]:
    """``0,1``, ``0-8`` (a range, inclusive) or a list of integers; ``none`` or
    empty = compress every layer."""
    if isinstance(value, (list, tuple)):
        if any(isinstance(i, bool) or not isinstance(i, int) for i in value):
            raise ValueError(f"skip_layers must be layer indices like '0,1' or '0-8', or 'none'; got {value!r}")
        return tuple(value)
    if not isinstance(value, str):
        raise ValueError(f"skip_layers must be a comma-separated list of layer indices or 'none', got {value!r}")
    if value.strip().lower() in ("none", ""):
        return ()
    return tuple(_layer_list(value, "skip_layers"))


def parse_layer_budgets(value: Any) -> Optional[dict[int, int]]:
    """``2-8:512,20:128`` (layers:budget) or a table ``{"2": 512}``; ``none`` = no overrides."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "")):
        return None
    out: dict[int, int] = {}
    if isinstance(value, dict):
        for layer, budget in value.items():
            try:
                out[int(layer)] = budget
            except (TypeError, ValueError):
                raise ValueError(f"layer_budgets keys must be layer indices, got {layer!r}") from None
        return out
    if not isinstance(value, str):
        raise ValueError(f"layer_budgets must look like '2-8:512,20:128', got {value!r}")
    for part in _budget_parts(value):
        layers, colon, budget = part.rpartition(":")
        if not colon or not budget.strip().isdigit():
            raise ValueError(f"layer_budgets must look like '2-8:512,20:128' (layers:budget), got {value!r}")
        for layer in _layer_list(layers, "layer_budgets"):
            out[layer] = int(budget)
    return out


def _budget_parts(value: str) -> list[str]:
    # "2-8:512,20:128": a comma starts a new part only after a ":budget".
    parts, current = [], ""
    for piece in value.split(","):
        current = f"{current},{piece}" if current else piece
        if ":" in piece:
            parts.append(current.strip())
            current = ""
    if current:
        parts.append(current.strip())
    return parts


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


def _expand(path: str) -> str:
    return path if path == "-" else os.path.expanduser(path)


def load_job(path: str) -> dict:
    """A job file's settings as a flat dict. Paths: ``~`` is expanded (environment
    variables are not), and relative paths resolve against the file's folder."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise UsageFailure("job files need Python 3.11+ or the 'tomli' package (pip install tomli)") from None
    job_path = Path(path).expanduser()
    try:
        data = tomllib.loads(job_path.read_text(encoding="utf-8"))
    except OSError as e:
        raise UsageFailure(f"cannot read job file {path}: {e.strerror or e}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UsageFailure(f"job file {path} is not valid TOML: {e}") from None
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if key in JOB_KEYS and key is not None and isinstance(value, dict):
            for sub, subvalue in value.items():
                if sub not in JOB_KEYS[key]:
                    raise UsageFailure(f"job file {path}: unknown key '{sub}' in [{key}]; "
                                       f"allowed: {', '.join(JOB_KEYS[key])}")
                flat[sub] = subvalue
        elif key in RUN_KEYS:
            flat[key] = value
        else:
            allowed = ", ".join(RUN_KEYS) + ", [eviction], [generation]"
            raise UsageFailure(f"job file {path}: unknown key '{key}'; allowed: {allowed}")
    for key in JOB_PATHS:
        if key in flat:
            if not isinstance(flat[key], str) or not flat[key]:
                raise UsageFailure(f"job file {path}: '{key}' must be a path string")
            value = _expand(flat[key])
            if value != "-" and not Path(value).is_absolute():
                value = os.path.normpath(job_path.parent / value)
            flat[key] = value
    if "model" in flat and not isinstance(flat["model"], str):
        raise UsageFailure(f"job file {path}: 'model' must be text, got {flat['model']!r}")
    for key in ("limit", "batch_size"):
        if key in flat and (isinstance(flat[key], bool) or not isinstance(flat[key], int)):
            raise UsageFailure(f"job file {path}: '{key}' must be an integer, got {flat[key]!r}")
    try:
        if "budget" in flat:
            flat["budget"] = parse_budget(flat["budget"])
        if "skip_layers" in flat:
            flat["skip_layers"] = parse_skip_layers(flat["skip_layers"])
        if "layer_budgets" in flat:
            flat["layer_budgets"] = parse_layer_budgets(flat["layer_budgets"])
        build_configs(flat)
    except ValueError as e:
        raise UsageFailure(f"job file {path}: {e}") from None
    return flat


def build_configs(settings: dict) -> tuple[EvictionConfig, GenerationConfig]:
    """The two configs from flat settings (missing fields take their defaults)."""
    eviction = EvictionConfig(**{k: settings[k] for k in EVICTION_FIELDS if k in settings})
    generation = GenerationConfig(**{k: settings[k] for k in GENERATION_FIELDS if k in settings})
    return eviction, generation


def resume_command(argv: list[str]) -> str:
    """The command line that resumes an interrupted run: the same, without --overwrite."""
    return shlex.join(["knorm-batch", *(a for a in argv if a != "--overwrite")])


class _BatchCommand(click.Command):
    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta["argv"] = list(args)  # for the resume hint
        return super().parse_args(ctx, args)


@click.command(cls=_BatchCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("input_path", metavar="INPUT", required=False)
@click.option("-o", "--output", help="Output JSONL. Default: <input stem>.completions.jsonl beside a regular "
              "INPUT file, stdout for stdin or a pipe; '-' = stdout.")
@click.option("--model", default="default", show_default=True,
              help="'default' (embedded SmolLM2-135M), a .gguf file, or an mlx_lm model path/id.")
@click.option("--budget", type=_Parsed("INT|none", parse_budget), default="512", show_default=True,
              help="Tokens kept per compressed layer; 'none' = full cache.")
@click.option("--n-sink", type=int, default=4, show_default=True, help="Leading tokens never evicted.")
@click.option("--recent", type=int, default=None,
              help="Most recent tokens never evicted.  [default: budget // 8]")
@click.option("--keep", type=click.Choice(KEEP_MODES), default="low", show_default=True,
              help="low = keep low key norms (the paper); high = ablation; random/recent = baselines.")
@click.option("--skip-layers", type=_Parsed("LIST|none", parse_skip_layers), default=None,
              help="Layers left uncompressed (their memory grows with the input), e.g. '0,1' or '0-8'; "
                   "'none' compresses all.  [default: the first 30% of the full-attention layers, at least two: 0-8 on the embedded model, 5,11 on Gemma 3]")
@click.option("--layer-budgets", type=_Parsed("LAYERS:INT,...", parse_layer_budgets), default=None,
              help="Per-layer budgets overriding --budget, e.g. '2-8:1024,20:256'.")
@click.option("--early-factor", type=int, default=None,
              help="Bound every layer: nothing skipped, the first 30% of the full-attention layers hold N x --budget "
                   "(8: a memory ceiling at about today's retrieval; README, Results).")
@click.option("--max-tokens", type=int, default=256, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--seed", type=int, default=None, help="Sampling seed, 0 to 2**64-1 (set before each row).")
@click.option("--prefill-step-size", type=int, default=512, show_default=True,
              help="Prompt tokens per forward pass.")
@click.option("--chat/--no-chat", default=None, help="Apply the chat template to text prompts. Default: when the "
              "tokenizer has one.")
@click.option("--question-separator", default="\n\n", show_default="a blank line",
              help="Text between a context and each question.")
@click.option("--batch-size", type=int, default=BatchOptions.batch_size, show_default=True,
              help="Rows decoded together (1 = one row at a time, records in input order).")
@click.option("--stats-log", type=click.Path(dir_okay=False), help="Write per-row stats (no texts) as JSONL.")
@click.option("--summary-json", type=click.Path(dir_okay=False), help="Write the end-of-run summary as JSON.")
@click.option("--overwrite", is_flag=True, help="Start a fresh output instead of resuming.")
@click.option("--accept-old-records", is_flag=True,
              help="Resume over records made from other rows or settings, counting them as done.")
@click.option("--limit", type=click.IntRange(min=0), default=None, help="Run only the first N rows.")
@click.option("--job", "job_file", type=click.Path(dir_okay=False), help="TOML job file; command-line options "
              "override it.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar; only the final summary.")
@click.version_option(__version__, prog_name="knorm-batch")
@click.pass_context
def batch_command(ctx: click.Context, input_path: Optional[str], job_file: Optional[str], quiet: bool,
                  overwrite: bool, accept_old_records: bool, **opts: Any) -> None:
    """Run every row of the JSONL file INPUT ('-' = stdin) through the model with
    L2Norm KV-cache eviction and write one JSONL record per row.

    Rerunning the same command resumes where it stopped. Exit status: 0 all rows
    ok, 1 some rows failed (see their error records), 2 usage error (nothing
    run), 3 I/O error such as a full disk (rerun to resume), 4 internal error,
    130 interrupted by SIGINT or SIGTERM (rerun to resume), 141 the output pipe
    was closed.
    """
    settings: dict[str, Any] = {}
    if job_file:
        settings.update(load_job(job_file))
    given = {name for name in opts
             if ctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)}
    if input_path is not None and settings.get("input") and "output" not in given:
        raise UsageFailure(f"INPUT {input_path} is given on the command line and the job file {job_file} names "
                           f"its own input ({settings['input']}); to run the job's settings on another input, "
                           "also give -o/--output, so the job's output is not mixed with other rows")
    for name, value in opts.items():
        if name in given or name not in settings:
            settings[name] = value
    if input_path is not None:
        settings["input"] = input_path
    if not settings.get("input"):
        raise click.UsageError("missing INPUT (a JSONL file or '-'), or a --job file that names one")
    try:
        eviction, generation = build_configs(settings)
    except ValueError as e:
        raise UsageFailure(str(e)) from None
    options = BatchOptions(model=settings["model"], eviction=eviction, generation=generation,
                           batch_size=settings["batch_size"], overwrite=overwrite, accept_old_records=accept_old_records, limit=settings.get("limit"),
                           stats_log=settings.get("stats_log"), summary_json=settings.get("summary_json"))
    from .distributed import group as launch_group

    job = launch_group()  # one process unless started by mlx.launch
    try:
        summary = run_batch(settings["input"], settings.get("output"), options, progress=not quiet, group=job)
    except BatchUsageError as e:
        if job.rank:  # every rank reaches the same verdict; rank 0 says it
            ctx.exit(EXIT_USAGE)
        raise UsageFailure(str(e)) from None
    except Interrupted:
        click.echo("knorm-batch: interrupted before any row ran; nothing was written", err=True)
        ctx.exit(EXIT_INTERRUPTED)
    except Exception:  # noqa: BLE001 - a bug, not a bad row: say so, with the traceback to report
        click.echo(traceback.format_exc(), err=True, nl=False)
        click.echo("knorm-batch: internal error (please report it); finished records are kept and a rerun "
                   "resumes", err=True)
        ctx.exit(EXIT_INTERNAL_ERROR)
    if summary.pipe_closed:
        ctx.exit(summary.exit_code)  # the reader left: end quietly, as Unix tools do
    if job.rank and not (summary.interrupted or summary.io_error):
        # Rank 0 reports the job. A non-zero exit here would make mlx.launch stop the
        # other ranks, rank 0 among them, while it may still be printing.
        ctx.exit(0)
    click.echo(summary.text(), err=True)
    if summary.interrupted or summary.io_error:
        what = "interrupted" if summary.interrupted else "stopped"
        if job.distributed:
            click.echo(f"rank {job.rank}: {what}; every finished record is in its part file. Rerun the same "
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


def probe_command() -> None:
    """``knorm-probe``: the key-norm / attention probe (lives in :mod:`knorm_gen.probe`)."""
    from .probe import probe_cli

    probe_cli()


if __name__ == "__main__":
    main()
