"""``knorm-batch``: parse the options and the job file, call :func:`~knorm_gen.batch.job.run_batch`."""

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
    EXIT_IO_ERROR,
    EXIT_USAGE,
    BatchOptions,
    BatchUsageError,
    Interrupted,
    run_batch,
)
from ..batch.sources import DEFAULT_GLOBS, PDF_EXTRA
from ..generation.admission import parse_size
from ..tuning.calibrate import settle
from .job_file import auto_layout, build_configs, load_job, rows_config
from .options import (
    HELP,
    OPTION_FIELDS,
    Command,
    UsageFailure,
    config_options,
    model_option,
    preset_option,
    run_options,
    verbose_option,
)


class _BatchCommand(Command):
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
    from ..batch.rows import RowError, parse_row

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
    from ..batch.distributed import PeerLost
    from ..batch.distributed import group as launch_group

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


def resume_command(argv: list[str]) -> str:
    """The command line that resumes an interrupted run: the same, without --overwrite."""
    return shlex.join(["knorm-batch", *(a for a in argv if a != "--overwrite")])
