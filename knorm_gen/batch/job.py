"""The ``knorm-batch`` job: JSONL rows (or a folder's files) in, one durable JSONL record per row out.

Each record is written whole and fsynced as its row finishes. Rerunning over
the same output resumes: a row counts as done when the output holds a
successful record for its id *made from the same row and settings* (the
record's ``fingerprint``); failed records are dropped and retried; a torn last
line is cut away. Before any work the job refuses what would lose or mix up
work: side files that are the input, a second run on a locked output, an
output whose records no longer match the input.
This module owns the options, the summary and exit codes, the files and locks,
and the run loop (one process, or one rank of a process group); the resume plan
and the merge of a group's parts are :mod:`knorm_gen.batch.resume`, the input's rows
come from :mod:`knorm_gen.batch.sources` (a JSONL file or a folder), the rows run in
:mod:`knorm_gen.batch.runner`, and :mod:`knorm_gen.batch.sink` writes their records.

Exit statuses (:attr:`BatchSummary.exit_code`, and ``knorm-batch``'s):

- 0 (``EXIT_OK``): every row ok. An input with no rows (an empty file, or only
  blank lines) is 0 too: nothing failed. The run then warns ``no rows in
  FILE`` on stderr and in the summary's ``warnings``, so a wrong path or an
  empty pipe is not mistaken for finished work;
- 1 (``EXIT_ROWS_FAILED``): some rows failed; each has an error record in the
  output, and the summary prints the first few (id, line, message);
- 2 (``EXIT_USAGE``): a usage error found before any row ran (options, input,
  output, locks, an output made with other settings, the model); nothing ran;
- 3 (``EXIT_IO_ERROR``): an I/O error such as a full disk; rerun to resume;
- 4 (``EXIT_INTERNAL_ERROR``): a bug (``knorm-batch`` prints the traceback);
- 130 (``EXIT_INTERRUPTED``): SIGINT or SIGTERM; rerun to resume;
- 141 (``EXIT_PIPE_CLOSED``): the output pipe was closed by its reader.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Optional

from tqdm import tqdm

from ..eviction.config import EvictionConfig, GenerationConfig, RowsConfig
from ..eviction.memory import kv_memory, mib
from ..generation.admission import default_kv_limit
from ..generation.engine import DEFAULT_BATCH_SIZE
from ..generation.tunings import auto_config, run_ratio
from ..models.load import ModelUsageError, get_model, with_run_options
from ..models.support import describe_model
from ..platform.files import (
    FileLock,
    FileUsageError,
    LockHeld,
    check_distinct_files,
    check_writable,
    default_output,
    is_stream,
    remove_stale_temps,
    rewrite_atomically,
    write_failure,
)
from . import records as rec
from .distributed import Group, part_path, shard_of, share
from .resume import Outputs, ResumePlan, Wanted, merge_group, plan_run
from .rows import Row
from .runner import RowRunner, RowSettings
from .sink import FIRST_ERRORS, Interrupted, Signals, Sink, row_name, stderr_log
from .sources import InputSource, open_source

__all__ = [
    "BatchOptions", "BatchSummary", "BatchUsageError", "Interrupted", "run_batch",
    "EXIT_OK", "EXIT_ROWS_FAILED", "EXIT_USAGE", "EXIT_IO_ERROR",
    "EXIT_INTERNAL_ERROR", "EXIT_INTERRUPTED", "EXIT_PIPE_CLOSED",
]

EXIT_OK = 0
EXIT_ROWS_FAILED = 1
EXIT_USAGE = 2
EXIT_IO_ERROR = 3
EXIT_INTERNAL_ERROR = 4
EXIT_INTERRUPTED = 130
EXIT_PIPE_CLOSED = 141  # 128 + SIGPIPE, what a shell reports for a writer whose reader left

class BatchUsageError(FileUsageError):
    """A problem found before any row runs (options, input, output, model)."""


@dataclass
class BatchOptions:
    """Everything a run needs besides its rows. Defaults are the command's."""

    model: str = "default"
    eviction: EvictionConfig = field(default_factory=EvictionConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    batch_size: int = DEFAULT_BATCH_SIZE
    overwrite: bool = False
    accept_old_records: bool = False
    limit: Optional[int] = None
    stats_log: Optional[str] = None
    summary_json: Optional[str] = None
    texts: Optional[str] = None  # a Markdown file of every record's texts, written as the run ends
    rows: RowsConfig = field(default_factory=RowsConfig)
    # A folder INPUT: the file name patterns to read (``--glob``); () = sources.DEFAULT_GLOBS. Not in a
    # record's config: its id (the file's path) and content are, and resume compares those
    globs: tuple = ()
    max_kv_memory: Optional[int] = None  # bytes of KV memory in flight; None: admission.default_kv_limit()
    # As mlx_lm.generate takes them: stop tokens added to the tokenizer's eos tokens, keyword
    # arguments for apply_chat_template, LoRA adapters and trust_remote_code for mlx_lm's loader
    extra_eos_tokens: tuple = ()
    chat_template_config: Optional[dict] = None
    adapter_path: Optional[str] = None
    trust_remote_code: bool = False
    verbose: bool = False  # one line per finished row on stderr
    # --preset auto: the layout fields the user gave beside it (None: no auto preset); the
    # rest of the layout comes from the model's saved tuning once the model is loaded
    auto_layout: Optional[tuple] = None
    # --calibrate N: without a saved tuning for the model (and a layout set by the user), the
    # layout is chosen by measuring the quick candidates on the first N rows' documents
    # (knorm_gen.tuning.calibrate), saved as the model's tuning, and runs every row
    calibrate: Optional[int] = None

    def run_config(self) -> dict:
        """What the run options that change outputs add to every record's ``config`` (and
        so to its fingerprint): only those set, so records of runs without them keep theirs."""
        out: dict[str, Any] = {}
        if self.extra_eos_tokens:
            out["extra_eos_tokens"] = [str(t) for t in self.extra_eos_tokens]
        if self.chat_template_config:
            out["chat_template_config"] = self.chat_template_config
        if self.adapter_path is not None:
            out["adapter_path"] = str(self.adapter_path)
        return out

    def check(self) -> None:
        """Raise :class:`BatchUsageError` for a bad runner setting (the configs check themselves)."""
        if isinstance(self.extra_eos_tokens, (str, bytes)) or not all(
                isinstance(t, (str, int)) and not isinstance(t, bool) for t in self.extra_eos_tokens):
            raise BatchUsageError(f"extra_eos_tokens must be a list of tokens (text or ids), got "
                                  f"{self.extra_eos_tokens!r}")
        if self.chat_template_config is not None and not isinstance(self.chat_template_config, dict):
            raise BatchUsageError("chat_template_config must be a JSON object (keyword arguments for the chat "
                                  f"template), got {self.chat_template_config!r}")
        if self.adapter_path is not None and (not isinstance(self.adapter_path, (str, os.PathLike))
                                              or not str(self.adapter_path)):
            raise BatchUsageError(f"adapter_path must be a path, got {self.adapter_path!r}")
        if not isinstance(self.eviction, EvictionConfig) or not isinstance(self.generation, GenerationConfig):
            raise BatchUsageError("eviction and generation must be EvictionConfig and GenerationConfig")
        if not isinstance(self.rows, RowsConfig):
            raise BatchUsageError("rows must be a RowsConfig")
        if isinstance(self.globs, str) or not all(isinstance(g, str) for g in self.globs):
            raise BatchUsageError(f"globs must be a list of file name patterns, got {self.globs!r}")
        if self.max_kv_memory is not None and (isinstance(self.max_kv_memory, bool)
                                               or not isinstance(self.max_kv_memory, int) or self.max_kv_memory < 1):
            raise BatchUsageError(f"max_kv_memory must be a number of bytes > 0, got {self.max_kv_memory!r}")
        if self.limit is not None and (isinstance(self.limit, bool) or not isinstance(self.limit, int)
                                       or self.limit < 0):
            raise BatchUsageError(f"limit must be an integer >= 0, got {self.limit!r}")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise BatchUsageError(f"batch_size must be an integer >= 1, got {self.batch_size!r}")
        if self.calibrate is not None and (isinstance(self.calibrate, bool) or not isinstance(self.calibrate, int)
                                           or self.calibrate < 1):
            raise BatchUsageError(f"calibrate must be a number of rows >= 1, got {self.calibrate!r}")


@dataclass
class BatchSummary:
    """What a run did. ``compression_*`` and token sums cover this run's successful rows."""

    input: str
    output: str
    model: str
    rows: int = 0
    ok: int = 0
    failed: int = 0
    skipped: int = 0
    tokens_seen: int = 0
    tokens_kept: int = 0
    generated_tokens: int = 0
    compression_mean: Optional[float] = None
    compression_min: Optional[float] = None
    compression_max: Optional[float] = None
    wall_s: float = 0.0
    tokens_per_s: float = 0.0
    generated_tokens_per_s: float = 0.0
    interrupted: bool = False
    io_error: Optional[str] = None
    pipe_closed: bool = False
    errors: dict = field(default_factory=dict)  # error type -> count
    ranks: list = field(default_factory=list)  # a distributed run: each rank's own numbers
    kv_ceiling_bytes: Optional[int] = None  # per row, for the run's settings; None: no ceiling
    kv_growth_bytes_per_token: int = 0  # what each token adds in layers that keep every token
    kv_memory: str = ""  # the same, in words
    kv_limit_bytes: Optional[int] = None  # --max-kv-memory: what the rows in flight may reach together
    kv_peak_bytes: int = 0  # the most the rows in flight could reach at once in this run
    first_errors: list = field(default_factory=list)  # the first FIRST_ERRORS failed rows: id, line, type, message
    warnings: list = field(default_factory=list)  # said once per run (no rows, a budget far below the prompts)
    layout: Optional[dict] = None  # --calibrate: {"name", "why"} of the layout that ran

    @property
    def exit_code(self) -> int:
        if self.pipe_closed:
            return EXIT_PIPE_CLOSED
        if self.io_error:
            return EXIT_IO_ERROR
        if self.interrupted:
            return EXIT_INTERRUPTED
        return EXIT_ROWS_FAILED if self.failed else EXIT_OK

    def to_dict(self) -> dict:
        return {**asdict(self), "exit_code": self.exit_code}

    def warn(self, message: str, log: Optional[Callable[[str], None]] = None) -> None:
        """A warning, once per run: in the summary, and through ``log`` now (a run that shows progress)."""
        if message in self.warnings:
            return
        self.warnings.append(message)
        if log:
            log(f"knorm-batch: warning: {message}")

    def text(self, warnings: bool = True, memory: bool = True) -> str:
        """The summary for stderr; ``warnings=False`` leaves out the warnings (a run
        with a progress display has said them as they arose), ``memory=False`` the KV
        memory line (such a run said it as it started)."""
        lines = [f"knorm-batch: {self.rows} rows: {self.ok} ok, {self.failed} failed, {self.skipped} skipped "
                 f"(already done) -> {self.output}"]
        if self.errors:
            lines.append("  errors: " + ", ".join(f"{k} {v}" for k, v in sorted(self.errors.items())))
            for error in self.first_errors:
                lines.append(f"    {error_line(error)}")
            if self.failed > len(self.first_errors):
                lines.append(f"    ... {self.failed - len(self.first_errors)} more: see the error records in "
                             f"{self.output}")
        if self.ok:
            lines.append(f"  tokens seen {self.tokens_seen}, kept {self.tokens_kept}, generated "
                         f"{self.generated_tokens}; compression mean {self.compression_mean:.2f}x "
                         f"(min {self.compression_min:.2f}x, max {self.compression_max:.2f}x)")
        lines.append(f"  wall {self.wall_s:.1f} s; {self.tokens_per_s:.1f} tokens/s processed, "
                     f"{self.generated_tokens_per_s:.1f} tokens/s generated")
        if self.kv_memory and memory:
            lines.append(f"  {self.kv_memory}")
        if self.layout:
            lines.append(f"  layout: {self.layout['name']}: {self.layout['why']}")
        if self.kv_limit_bytes:
            lines.append(f"  KV memory in flight: peak {mib(self.kv_peak_bytes)} of the {mib(self.kv_limit_bytes)} "
                         "limit (--max-kv-memory)")
        for r, numbers in enumerate(self.ranks):
            lines.append(f"  rank {r}: {numbers['rows']} rows ({numbers['ok']} ok, {numbers['failed']} failed, "
                         f"{numbers['skipped']} skipped), {numbers['generated_tokens']} tokens generated, "
                         f"{numbers['generated_tokens_per_s']:.1f} tokens/s, wall {numbers['wall_s']:.1f} s")
        if self.io_error:
            lines.append(f"  stopped: {self.io_error}")
        if warnings:
            lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)


def error_line(error: dict) -> str:
    """One failed row on one line: its id, then its message (which starts with its line number)."""
    return f"{row_name(error.get('id'))}: {error.get('type')}: {error.get('message')}"


# ------------------------------------------------------------------ the model


def _load(options: BatchOptions) -> tuple[Any, Any]:
    try:
        return get_model(options.model, adapter_path=options.adapter_path,
                         trust_remote_code=options.trust_remote_code)
    except ModelUsageError as e:
        raise BatchUsageError(str(e)) from e


def prepare_tokenizer(tokenizer: Any, options: "BatchOptions") -> Any:
    """The tokenizer with the run's extra eos tokens and chat template config (a copy
    when there are any: the cached model's own is left as it is)."""
    try:
        return with_run_options(tokenizer, options.extra_eos_tokens, options.chat_template_config)
    except ValueError as e:
        raise BatchUsageError(str(e)) from None


# ------------------------------------------------------------------ the run


def run_batch(
    input_path: str,
    output_path: Optional[str] = None,
    options: Optional[BatchOptions] = None,
    *,
    model: Any = None,
    tokenizer: Any = None,
    progress: bool = True,
    log: Optional[Callable[[str], None]] = None,
    stdout: Optional[BinaryIO] = None,
    group: Optional[Group] = None,
    calibrator: Optional[Callable[..., Any]] = None,
) -> BatchSummary:
    """Run every row of ``input_path`` (``-`` = stdin; a folder: one row per file
    matching ``options.globs``) into ``output_path``.

    Everything that can be checked before work starts (options, input,
    output, locks, an output that no longer matches the input, the model)
    raises :class:`BatchUsageError`; a signal before work raises
    :class:`Interrupted`. Row failures become error records. Returns the
    summary; its ``exit_code`` is one of the ``EXIT_*`` statuses.

    With a ``group`` of more than one process (``mlx.launch``; see
    :mod:`knorm_gen.batch.distributed`), this process runs its share of the rows
    into its part file, and rank 0 writes the final output, stats log and
    summary once every rank has finished.

    ``options.calibrate`` needs ``calibrator``: the tuner's
    :func:`knorm_gen.tuning.calibrate.settle` (``knorm-batch --calibrate`` passes it), so the job
    itself does not import the tuner.
    """
    try:
        return _run_batch(input_path, output_path, options or BatchOptions(), model=model, tokenizer=tokenizer,
                          progress=progress, log=log or stderr_log, stdout=stdout, group=group or Group(),
                          calibrator=calibrator)
    except FileUsageError as e:
        if isinstance(e, BatchUsageError):
            raise
        raise BatchUsageError(str(e)) from None


@dataclass
class _Files(Outputs):
    """The files one process reads and writes: the input, its own output and stats
    log (part files in a distributed run), and the final ones rank 0 assembles."""

    input: str

    @classmethod
    def plan(cls, input_path: str, output_path: Optional[str], options: BatchOptions, group: Group) -> "_Files":
        output = output_path or default_output(input_path)
        if not group.distributed:
            return cls(output, options.stats_log, output, options.stats_log, input=input_path)
        if input_path == "-" or (is_stream(input_path) and not os.path.isdir(input_path)) or is_stream(output):
            raise BatchUsageError("a run across several processes needs the input as a regular file or a folder, "
                                  "and the output as a regular file (each rank writes a part file beside it)")
        stats = options.stats_log
        if stats is not None and is_stream(stats):
            raise BatchUsageError("a run across several processes needs the stats log as a regular file")
        return cls(output, stats, part_path(output, group.rank, group.size),
                   part_path(stats, group.rank, group.size) if stats else None, input=input_path)

    def check(self, options: BatchOptions, group: Group) -> None:
        named = [("input", self.input), ("output", self.output), ("stats log", self.stats_log),
                 ("summary", options.summary_json), ("texts", options.texts)]
        if options.texts and is_stream(self.output):
            raise BatchUsageError("--texts reads the records back from the output file: give -o FILE "
                                  "(the output is stdout here)")
        if group.distributed:
            named += [("output part", self.own_output), ("stats log part", self.own_stats)]
        check_distinct_files(named)
        for path, what in ((self.own_output, "output"), (self.own_stats, "stats log"),
                           (options.summary_json, "summary"), (options.texts, "texts")):
            check_writable(path, what)
        if group.distributed and group.rank == 0:
            for path, what in ((self.output, "output"), (self.stats_log, "stats log")):
                check_writable(path, what)

    def lock(self, group: Group) -> list[FileLock]:
        paths = [self.own_output, self.own_stats]
        if group.distributed and group.rank == 0:
            paths += [self.output, self.stats_log]  # a second job on the same output stops at once
        locks = []
        try:
            for path in paths:
                if path is not None and not is_stream(path):
                    Path(path).parent.mkdir(parents=True, exist_ok=True)
                    locks.append(FileLock(path).acquire())
                    remove_stale_temps(path)  # a killed rewrite's copy: ours to remove, holding the lock
        except LockHeld as e:
            for lock in locks:
                lock.release()
            raise BatchUsageError(str(e)) from None
        return locks


@dataclass
class _Prepared:
    """What a run has once every check before work has passed."""

    source: Optional[InputSource]
    locks: list
    runner: Optional[RowRunner] = None
    memory: Any = None
    wanted: Wanted = field(default_factory=Wanted)  # what a record of each input row would carry now
    total: int = 0  # rows this process will see
    limit: Optional[int] = None
    items: int = 0  # rows and bad lines in the whole input (0: an empty input)
    layout_note: Optional[str] = None  # --preset auto: which layout runs and where it came from
    layout: Optional[dict] = None  # --calibrate: {"name", "why"} for the summary and each record's meta


def _run_batch(input_path, output_path, options: BatchOptions, *, model, tokenizer, progress, log, stdout,
               group: Group, calibrator: Optional[Callable[..., Any]] = None) -> BatchSummary:
    options.check()
    if options.calibrate and calibrator is None:
        raise BatchUsageError("calibrate needs the tuner: pass calibrator=knorm_gen.tuning.calibrate.settle to run_batch "
                              "(knorm-batch --calibrate does)")
    files = _Files.plan(input_path, output_path, options, group)
    progress = progress and group.rank == 0  # rank 0 shows the bar; the others speak only of errors
    with Signals(log) as signals:
        ready = _prepare(files, options, model, tokenizer, group, log if progress else None, calibrator)
        try:
            try:
                plan = plan_run(files, ready.wanted, accept_old=options.accept_old_records,
                                overwrite=options.overwrite, group=group, log=log if progress else None)
            except OSError as e:  # a rewrite (a torn line cut) on a full disk
                raise BatchUsageError(f"cannot rewrite {e.filename or files.own_output}: {write_failure(e)}; "
                                      "nothing was run") from None
            writer = _open_writer(files.own_output, options.overwrite, stdout)
            stats = _open_writer(files.own_stats, options.overwrite, None) if files.own_stats else None
            for lock in ready.locks:
                lock.lock_file()  # the files as they are now: created, or replaced by a rewrite
        except BaseException as e:
            _release(ready)
            if isinstance(e, LockHeld):
                raise BatchUsageError(str(e)) from None
            if isinstance(e, KeyboardInterrupt) and not isinstance(e, Interrupted):
                raise Interrupted from None
            raise
        memory = ready.memory
        summary = BatchSummary(input=files.input, output=files.output, model=options.model,
                               kv_ceiling_bytes=memory.ceiling_bytes,
                               kv_growth_bytes_per_token=memory.growth_bytes_per_token, kv_memory=memory.describe(),
                               layout=ready.layout)
        if progress:
            log(describe_model(ready.runner.model, options.model))
            if ready.layout_note:
                log(ready.layout_note)
            log(memory.describe())  # before a long job: is this configuration bounded?
        if ready.items == 0 and options.limit != 0 and group.rank == 0:
            name = "stdin" if files.input == "-" else files.input
            summary.warn(f"no rows in {name}: the input is empty (or holds only blank lines), so nothing ran; "
                         "the exit status is 0", log if progress else None)
        try:
            signals.graceful = True
            _loop(ready, writer, stats, plan.done, summary, progress, signals, group, log, options.verbose)
        finally:
            signals.graceful = False
            for closing in (writer, stats):
                if closing is not None:
                    try:
                        closing.close()
                    except OSError:
                        pass  # a closed pipe or full disk: already recorded in the summary
        try:
            if group.distributed:
                summary = _finish_group(files, ready, plan, summary, options, group)
            _write_summary(options.summary_json if group.rank == 0 else None, summary)
            _write_texts(options.texts if group.rank == 0 else None, files.output, summary)
        finally:
            _release(ready)
    return summary


def _prepare(files: _Files, options: BatchOptions, model, tokenizer, group: Group,
             log: Optional[Callable[[str], None]] = None,
             calibrator: Optional[Callable[..., Any]] = None) -> _Prepared:
    """Every check before work: files, locks, the model, the settings (the layout
    settled: --preset auto, --calibrate), the input's rows. In a group, every rank hears
    of any rank's failure and stops with it."""
    source, locks, error, ready = None, [], None, None
    try:
        files.check(options, group)
        source = open_source(files.input, options.rows, options.globs,
                             [("output", files.output), ("stats log", files.stats_log),
                              ("summary", options.summary_json), ("texts", options.texts)])
        locks = files.lock(group)
        if options.summary_json and group.rank == 0 and not is_stream(options.summary_json):
            remove_stale_temps(options.summary_json)
        if model is None:
            model, tokenizer = _load(options)
        tokenizer = prepare_tokenizer(tokenizer, options)
        eviction, note, layout = options.eviction, None, None
        if options.calibrate:
            settled = calibrator(model, tokenizer, options, _first_documents(source), distributed=group.distributed,
                                 log=log)
            eviction, note, layout = settled.eviction, settled.note, settled.layout
        elif options.auto_layout is not None:
            ratio = run_ratio(tokenizer, _first_documents(source), options.eviction)
            eviction, note = auto_config(model, options.eviction, options.auto_layout, ratio)
        try:
            runner = _Runner(model, tokenizer, model_spec=options.model, eviction=eviction,
                             generation=options.generation, batch_size=options.batch_size, rows=options.rows,
                             kv_limit_bytes=options.max_kv_memory or default_kv_limit(),
                             run_config=options.run_config(), layout=layout)
        except ValueError as e:
            raise BatchUsageError(str(e)) from None
        memory = kv_memory(model, runner.base.eviction)
        wanted, total, items = _scan_rows(source, runner, options.limit, group)
        ready = _Prepared(source, locks, runner, memory, wanted, total, options.limit, items, note, layout)
    except KeyboardInterrupt:
        error = Interrupted()
    except BaseException as e:  # noqa: BLE001 - in a group, every rank must hear of it (below)
        error = e
    try:
        if group.distributed:  # a rank that failed to start fails the launch, with its error, on every rank
            with group.during("the start"):
                failures = [(r, m) for r, m in enumerate(group.gather_json(_describe(error))) if m]
            if failures:
                if isinstance(error, KeyboardInterrupt):
                    raise Interrupted
                raise BatchUsageError("; ".join(f"rank {r}: {m}" for r, m in failures))
        elif error is not None:
            raise error
    except BaseException:
        _release(_Prepared(source, locks) if ready is None else ready)
        raise
    return ready


class _Runner(RowRunner):
    """The row runner, with the run options that change outputs (:meth:`BatchOptions.run_config`)
    in every record's ``config``, and so in its fingerprint; under ``--calibrate``, the layout
    that ran and why (``layout``) in the ``meta`` of each row's record (meta is not part of
    the fingerprint, and a row's own ``layout`` field stays)."""

    def __init__(self, *args: Any, run_config: dict, layout: Optional[dict] = None, **kwargs: Any):
        self.run_config, self.layout = run_config, layout
        super().__init__(*args, **kwargs)

    def result_record(self, row: Row, settings: RowSettings, results: list) -> dict:
        return self._with_layout(super().result_record(row, settings, results))

    def failure_record(self, row: Row, settings: Optional[RowSettings], e: BaseException) -> dict:
        return self._with_layout(super().failure_record(row, settings, e))

    def _with_layout(self, record: dict) -> dict:
        if self.layout is not None:
            record["meta"] = {"layout": self.layout, **(record.get("meta") or {})}
        return record

    def settings_for(self, overrides: dict) -> RowSettings:
        settings = super().settings_for(overrides)
        if self.run_config:
            settings.config.update(self.run_config)  # the cached settings' own dict: the same each time
        return settings


def _release(ready: _Prepared) -> None:
    for lock in ready.locks:
        lock.release()
    if ready.source is not None:
        ready.source.close()


def _loop(ready: _Prepared, writer, stats, done: set, summary: BatchSummary, progress: bool, signals,
          group: Group, log: Optional[Callable[[str], None]] = None, verbose: bool = False) -> None:
    tic = time.perf_counter()
    label = f"rank 0/{group.size}" if group.distributed else None
    bar = tqdm(total=ready.total, unit="row", file=sys.stderr, dynamic_ncols=True, desc=label,
               disable=not (progress and sys.stderr.isatty()))
    sink = Sink(writer, stats, summary, bar, kv=ready.runner.kv, log=log or stderr_log, verbose=verbose,
                 live=progress, lines=ready.source.lines)
    items = share(ready.source.items(), ready.limit, group.rank, group.size)
    with bar:
        try:
            ready.runner.run(items, done, sink.emit, stop_reading=lambda: signals.stop,
                             stop_now=lambda: sink.stopped)
        except KeyboardInterrupt:
            summary.interrupted = True
    if signals.stop:
        summary.interrupted = True
    sink.finish(time.perf_counter() - tic)


def _describe(error: Optional[BaseException]) -> Optional[str]:
    if error is None:
        return None
    if isinstance(error, KeyboardInterrupt):
        return "interrupted before any row ran"
    if isinstance(error, FileUsageError):
        return str(error)
    return f"{type(error).__name__}: {error}"


def _write_summary(path: Optional[str], summary: BatchSummary) -> None:
    if not path:
        return
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        rewrite_atomically(path, [(json.dumps(summary.to_dict(), indent=2) + "\n").encode()])
    except OSError as e:
        summary.io_error = summary.io_error or f"cannot write summary {path}: {write_failure(e)}"


def _write_texts(path: Optional[str], output: str, summary: BatchSummary) -> None:
    """Every record of ``output`` (this run's and earlier runs') as Markdown in ``path``."""
    if not path or summary.io_error:
        return
    try:
        with open(output, "rb") as f:
            records = [r for r in map(rec.parse_record, f) if r is not None]
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        rewrite_atomically(path, [rec.texts_markdown(records, f"Texts of {output}").encode()])
    except OSError as e:
        summary.io_error = f"cannot write texts {path}: {write_failure(e)}"


def _finish_group(files: _Files, ready: _Prepared, plan: ResumePlan, summary: BatchSummary,
                  options: BatchOptions, group: Group) -> BatchSummary:
    """Every rank's summary and records to rank 0, which writes the final output in
    input order (:func:`~knorm_gen.batch.resume.merge_group`) and reports the whole job."""
    if summary.interrupted or summary.io_error:
        return summary  # the parts keep every finished record; rerunning the launch resumes

    def items():
        return share(ready.source.items(), options.limit)

    with group.during("the merge"):
        total = combine_summaries(group.gather_json(summary.to_dict()), files)
    merge_group(files, items, plan, ready.wanted.expected, options.accept_old_records, group,
                ready.wanted.aliases)
    return total if group.rank == 0 else summary


def combine_summaries(summaries: list[dict], files: _Files) -> BatchSummary:
    """One summary for the job: sums over ranks, and each rank's own numbers."""
    first = summaries[0]
    total = BatchSummary(input=files.input, output=files.output, model=first["model"],
                         kv_ceiling_bytes=first["kv_ceiling_bytes"],
                         kv_growth_bytes_per_token=first["kv_growth_bytes_per_token"], kv_memory=first["kv_memory"],
                         kv_limit_bytes=first["kv_limit_bytes"],
                         kv_peak_bytes=max(s["kv_peak_bytes"] for s in summaries))  # the limit is per rank
    for name in ("rows", "ok", "failed", "skipped", "tokens_seen", "tokens_kept", "generated_tokens"):
        setattr(total, name, sum(s[name] for s in summaries))
    oks = [(s["ok"], s) for s in summaries if s["ok"]]
    if oks:
        total.compression_mean = sum(n * s["compression_mean"] for n, s in oks) / sum(n for n, _ in oks)
        total.compression_min = min(s["compression_min"] for _, s in oks)
        total.compression_max = max(s["compression_max"] for _, s in oks)
    total.wall_s = max(s["wall_s"] for s in summaries)
    if total.wall_s > 0:
        total.tokens_per_s = total.tokens_seen / total.wall_s
        total.generated_tokens_per_s = total.generated_tokens / total.wall_s
    for s in summaries:
        for kind, n in s["errors"].items():
            total.errors[kind] = total.errors.get(kind, 0) + n
    errors = sorted((e for s in summaries for e in s.get("first_errors", ())), key=lambda e: e.get("line") or 0)
    total.first_errors = errors[:FIRST_ERRORS]
    total.warnings = list(dict.fromkeys(w for s in summaries for w in s.get("warnings", ())))
    total.layout = first.get("layout")
    total.ranks = [{k: s[k] for k in ("rows", "ok", "failed", "skipped", "tokens_seen", "generated_tokens",
                                      "wall_s", "generated_tokens_per_s")} for s in summaries]
    return total


def _open_writer(path: str, fresh: bool, stdout: Optional[BinaryIO]) -> rec.RecordWriter:
    if path == "-":
        return rec.RecordWriter(stdout or sys.stdout.buffer)
    try:
        return rec.RecordWriter.open(path, fresh=fresh)
    except OSError as e:
        raise BatchUsageError(f"cannot write {path}: {e.strerror or e}") from None


def _first_documents(source: InputSource, limit: int = 64) -> list:
    """The documents (context, else prompt) of the input's first ``limit`` rows, for
    ``--preset auto``'s check of the run's compression."""
    texts = []
    for item in source.items():
        if isinstance(item, Row):
            texts.append(item.context if item.context is not None else item.prompt)
        if len(texts) >= limit:
            break
    return texts


def _scan_rows(source: InputSource, runner: RowRunner, limit: Optional[int],
               group: Group) -> tuple[Wanted, int, int]:
    """What a record of each input row would carry now (its fingerprint, line and
    config), the number of rows this process will see (after --limit, in its
    share), and the number of items (rows and bad lines) in the whole input."""
    wanted = Wanted(model=runner.model_spec, rerun_edited=source.rerun_edited)
    total = items = 0
    for n, item in enumerate(source.items()):
        items += 1
        if isinstance(item, Row):
            fingerprint = wanted.expected[item.key] = runner.fingerprint(item)
            legacy = runner.legacy_fingerprint(item)
            if legacy is not None:
                wanted.aliases[legacy] = fingerprint
            wanted.lines[item.key] = item.line
            if fingerprint is not None:
                wanted.configs[item.key] = runner.settings_for(item.overrides).config  # shared by rows alike
        elif item.id is not None and source.rerun_edited:
            wanted.unusable.add(rec.id_key(item.id))
        if (limit is None or n < limit) and shard_of(n, group.size) == group.rank:
            total += 1
    return wanted, total, items


