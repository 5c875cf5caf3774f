"""Command line: ``knorm-batch`` (and ``knorm-probe``). Parse options, call the library."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import click
from click.core import ParameterSource

from . import __version__
from .batch import EXIT_USAGE, BatchOptions, BatchUsageError, run_batch
from .cache import KEEP_MODES

# Job file layout: top-level keys, and the keys of its [eviction] and [generation] tables.
JOB_KEYS = {
    None: ("input", "output", "model", "stats_log", "summary_json", "limit"),
    "eviction": ("budget", "n_sink", "recent", "keep", "skip_layers"),
    "generation": ("max_tokens", "temperature", "top_p", "seed", "chat"),
}
JOB_PATHS = ("input", "output", "stats_log", "summary_json")
JOB_TYPES = {"model": (str,), "limit": (int,), "n_sink": (int,), "recent": (int,), "keep": (str,),
             "max_tokens": (int,), "temperature": (int, float), "top_p": (int, float), "seed": (int,),
             "chat": (bool,)}


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
    except (TypeError, ValueError):
        raise ValueError(f"budget must be an integer >= 1 or 'none', got {value!r}") from None
    if budget < 1 or (isinstance(value, float) and value != budget):
        raise ValueError(f"budget must be an integer >= 1 or 'none', got {value!r}")
    return budget


def parse_skip_layers(value: Any) -> tuple[int, ...]:
    """``0,1``, ``0-8`` (a range, inclusive) or a list of integers; ``none`` or
    empty = compress every layer."""
    if isinstance(value, (list, tuple)):
        items = list(value)
    elif isinstance(value, str):
        if value.strip().lower() in ("none", ""):
            return ()
        items = []
        for part in (p.strip() for p in value.split(",")):
            lo, dash, hi = part.partition("-")
            if dash and lo.strip().isdigit() and hi.strip().isdigit():
                items.extend(range(int(lo), int(hi) + 1))
            else:
                items.append(part)
    else:
        raise ValueError(f"skip_layers must be a comma-separated list of layer indices or 'none', got {value!r}")
    message = f"skip_layers must be layer indices like '0,1' or '0-8', or 'none'; got {value!r}"
    if any(isinstance(i, (bool, float)) for i in items):
        raise ValueError(message)
    try:
        return tuple(int(i) for i in items)
    except (TypeError, ValueError):
        raise ValueError(message) from None


class _Budget(click.ParamType):
    name = "INT|none"

    def convert(self, value, param, ctx):
        try:
            return parse_budget(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


class _SkipLayers(click.ParamType):
    name = "LIST|none"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        try:
            return parse_skip_layers(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


def load_job(path: str) -> dict:
    """A job file's settings as a flat dict; relative paths resolve against the file's folder."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise UsageFailure("job files need Python 3.11+ or the 'tomli' package (pip install tomli)") from None
    job_path = Path(path)
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
        elif key in JOB_KEYS[None]:
            flat[key] = value
        else:
            allowed = ", ".join(JOB_KEYS[None]) + ", [eviction], [generation]"
            raise UsageFailure(f"job file {path}: unknown key '{key}'; allowed: {allowed}")
    for key in JOB_PATHS:
        if key in flat:
            if not isinstance(flat[key], str):
                raise UsageFailure(f"job file {path}: '{key}' must be a path string")
            if flat[key] != "-" and not Path(flat[key]).expanduser().is_absolute():
                flat[key] = os.path.normpath(job_path.parent / flat[key])
    for key, types in JOB_TYPES.items():
        value = flat.get(key)
        if key in flat and (not isinstance(value, types) or (bool not in types and isinstance(value, bool))):
            kind = " or ".join(t.__name__ for t in types)
            raise UsageFailure(f"job file {path}: '{key}' must be {kind}, got {value!r}")
    try:
        if "budget" in flat:
            flat["budget"] = parse_budget(flat["budget"])
        if "skip_layers" in flat:
            flat["skip_layers"] = parse_skip_layers(flat["skip_layers"])
    except ValueError as e:
        raise UsageFailure(f"job file {path}: {e}") from None
    if "keep" in flat and flat["keep"] not in KEEP_MODES:
        raise UsageFailure(f"job file {path}: keep must be one of {', '.join(KEEP_MODES)}; got {flat['keep']!r}")
    return flat


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("input_path", metavar="INPUT", required=False)
@click.option("-o", "--output", help="Output JSONL. Default: <input stem>.completions.jsonl beside INPUT; '-' = stdout.")
@click.option("--model", default="default", show_default=True,
              help="'default' (embedded SmolLM2-135M), a .gguf file, or an mlx_lm model path/id.")
@click.option("--budget", type=_Budget(), default="512", show_default=True,
              help="Tokens kept per compressed layer; 'none' = full cache.")
@click.option("--n-sink", type=click.IntRange(min=0), default=4, show_default=True, help="Leading tokens never evicted.")
@click.option("--recent", type=click.IntRange(min=0), default=None,
              help="Most recent tokens never evicted.  [default: budget // 8]")
@click.option("--keep", type=click.Choice(KEEP_MODES), default="low", show_default=True,
              help="low = keep low key norms (the paper); high = ablation; random/recent = baselines.")
@click.option("--skip-layers", type=_SkipLayers(), default=None,
              help="Layers left uncompressed, e.g. '0,1' or '0-8'; 'none' compresses all.  "
                   "[default: the first 30% of layers, 0-8 on the embedded model]")
@click.option("--max-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True)
@click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=1.0, show_default=True)
@click.option("--seed", type=int, default=None, help="Sampling seed (set before each row).")
@click.option("--chat/--no-chat", default=None, help="Apply the chat template to text prompts. Default: when the tokenizer has one.")
@click.option("--stats-log", type=click.Path(dir_okay=False), help="Write per-row stats (no texts) as JSONL.")
@click.option("--summary-json", type=click.Path(dir_okay=False), help="Write the end-of-run summary as JSON.")
@click.option("--overwrite", is_flag=True, help="Start a fresh output instead of resuming.")
@click.option("--limit", type=click.IntRange(min=0), default=None, help="Run only the first N rows.")
@click.option("--job", "job_file", type=click.Path(dir_okay=False), help="TOML job file; command-line options override it.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar; only the final summary.")
@click.version_option(__version__, prog_name="knorm-batch")
@click.pass_context
def batch_command(ctx: click.Context, input_path: Optional[str], job_file: Optional[str], quiet: bool,
                  overwrite: bool, **opts: Any) -> None:
    """Run every row of the JSONL file INPUT ('-' = stdin) through the model with
    L2Norm KV-cache eviction and write one JSONL record per row.

    Rerunning the same command resumes where it stopped. Exit status: 0 all rows
    ok, 1 some rows failed (see their error records), 2 usage error (nothing
    run), 130 interrupted (rerun to resume).
    """
    settings: dict[str, Any] = {}
    if job_file:
        settings.update(load_job(job_file))
    given = {name for name in (*opts, "input_path")
             if ctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)}
    for name, value in opts.items():
        if name in given or name not in settings:
            settings[name] = value
    if input_path is not None:
        settings["input"] = input_path
    if not settings.get("input"):
        raise click.UsageError("missing INPUT (a JSONL file or '-'), or a --job file that names one")

    fields = BatchOptions.__dataclass_fields__
    options = BatchOptions(overwrite=overwrite, **{k: v for k, v in settings.items() if k in fields})
    try:
        summary = run_batch(settings["input"], settings.get("output"), options, progress=not quiet)
    except BatchUsageError as e:
        raise UsageFailure(str(e)) from None
    click.echo(summary.text(), err=True)
    if summary.interrupted:
        click.echo(f"interrupted after {summary.ok + summary.failed} rows; rerun the same command to resume",
                   err=True)
    ctx.exit(summary.exit_code)


def probe_command() -> None:
    """``knorm-probe``: the key-norm / attention probe (lives in :mod:`knorm_gen.probe`)."""
    from .probe import probe_cli

    probe_cli()


if __name__ == "__main__":
    batch_command(prog_name="knorm-batch")
