"""Where a run's records go, and what it says while they do: the output sink and the signals.

:class:`Sink` writes each finished record whole (and its stats-log entry),
counts it in the run's summary and progress bar, and says what a run says as
rows finish (``--verbose`` lines, the first errors, a budget far below the
prompts); a closed output pipe or an I/O error stops it. :class:`Signals` turns
SIGINT and SIGTERM into a stop after the rows in flight, or an abort before any
row runs (:class:`Interrupted`).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any, Callable, Optional

from tqdm import tqdm

from ..platform.files import write_failure
from . import records as rec

FIRST_ERRORS = 3
"""Row errors the summary names one by one (id, line, message); the output has them all."""

LOW_BUDGET_SHARE = 0.25
"""Below this share of a prompt's tokens, a budget draws a warning (once per run):
on the embedded model, summaries drift off topic there (docs/results.md)."""


def budget_warning(budget: Optional[int], prompt_tokens: Optional[int], whose: str = "this row's",
                   ratio: Optional[float] = None) -> Optional[str]:
    """The warning for a budget that keeps under :data:`LOW_BUDGET_SHARE` of a
    prompt's tokens (under ``ratio``: a ratio above 1/LOW_BUDGET_SHARE, or a budget that
    caps it below that share), or None."""
    if ratio is not None and 1 / ratio < LOW_BUDGET_SHARE:
        return (f"--ratio {ratio:g} keeps {100 / ratio:.0f}% of each document; below about "
                f"{int(100 * LOW_BUDGET_SHARE)}% summaries drift off topic on the embedded model: lower --ratio or "
                "check a few rows against --ratio none --budget none")
    if ratio is not None and budget is not None and prompt_tokens and budget * ratio >= prompt_tokens:
        return None  # the ratio sets this row's budget, not a cap
    if budget is None or not prompt_tokens or budget >= LOW_BUDGET_SHARE * prompt_tokens:
        return None
    return (f"--budget {budget} keeps {int(100 * budget / prompt_tokens)}% of {whose} {prompt_tokens}-token "
            f"prompt; below about {int(100 * LOW_BUDGET_SHARE)}% summaries drift off topic on the embedded model: "
            "raise --budget or check against --budget none")


def row_name(row_id: Any) -> str:
    """``id 'a'`` (as the row wrote it), or ``no id``."""
    return "no id" if row_id is None else f"id {row_id!r}"


def stderr_log(msg: str) -> None:
    """A line on stderr, at once."""
    print(msg, file=sys.stderr, flush=True)


class Signals:
    """SIGINT and SIGTERM. Before rows run they abort at once (nothing to lose);
    while rows run the first one sets ``stop`` (the runner finishes and writes
    the row in flight, then stops) and a second aborts."""

    def __init__(self, notify: Callable[[str], None]):
        self.stop = False
        self.graceful = False
        self._notify = notify
        self._old: dict = {}

    def __enter__(self) -> "Signals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if not self.graceful or self.stop:
            raise KeyboardInterrupt
        self.stop = True
        name = signal.Signals(signum).name
        self._notify(f"\n{name}: stopping after the rows in flight are written (again to abort them)")

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


class Interrupted(KeyboardInterrupt):
    """Interrupted before any row ran: nothing was written."""


class Sink:
    """Writes each finished record whole, and counts it in the summary (the run's
    :class:`~knorm_gen.batch.job.BatchSummary`) and the bar.
    A closed output pipe or an I/O error sets ``stopped``: the run ends there."""

    def __init__(self, writer, stats, summary: Any, bar, kv=None, log: Optional[Callable[[str], None]] = None,
                 verbose: bool = False, live: bool = False, lines: bool = True):
        self.writer, self.stats, self.summary, self.bar = writer, stats, summary, bar
        self.lines = lines  # a row's number is a line of the input (JSONL), worth naming; a folder's file has its path
        self.kv = kv  # the runner's KVLimit: memory in flight for the bar and the summary
        self.log = log or stderr_log
        self.verbose = verbose  # a line per finished row
        self.live = live  # warnings said as they arise (else only in the summary)
        self.ratios: list[float] = []
        self.decode_s = 0.0
        self.stopped = False
        self.budget_warned = False

    def say(self, message: str) -> None:
        """A line on stderr, above the progress bar when there is one."""
        if not self.bar.disable:
            tqdm.write(message, file=sys.stderr)
        else:
            self.log(message)

    def emit(self, record: Optional[dict], line: int) -> None:
        """Write one finished record (None: a row skipped as already done)."""
        summary = self.summary
        if record is None:
            summary.rows += 1
            summary.skipped += 1
            self.bar.update(1)
            return
        try:
            self.writer.write(record)
        except BrokenPipeError:
            summary.pipe_closed = self.stopped = True
            silence_stdout()
            return
        except OSError as e:
            self._failed("output", self.writer, e)
            if not isinstance(e, rec.FileVanished):
                return  # not written (and cut off again)
            # written, to a file no name leads to any more: counted, and the message says so
        if self.stats and not self.stopped:
            try:
                self.stats.write(rec.stats_entry(record, line))
            except OSError as e:  # the record is written and counted; a resume rebuilds its entry
                self._failed("stats log", self.stats, e)
                self.stats = None
        summary.rows += 1
        if record["error"] is None:
            summary.ok += 1
            summary.tokens_seen += record["tokens_seen"]
            summary.tokens_kept += record["tokens_kept"]
            summary.generated_tokens += record["generated_tokens"]
            self.decode_s += record["decode_s"] or 0.0
            self.ratios.append(record["compression_ratio"])
        else:
            summary.failed += 1
            kind = record["error"]["type"]
            summary.errors[kind] = summary.errors.get(kind, 0) + 1
            if len(summary.first_errors) < FIRST_ERRORS:
                summary.first_errors.append({"id": record["id"], "line": record["error"].get("line", line),
                                             "type": kind, "message": record["error"]["message"]})
            if not self.bar.disable and not self.verbose:  # per-row notes only beside a live progress bar
                tqdm.write(f"error: {record['error']['message']}", file=sys.stderr)
        if self.verbose:
            self.say(row_line(record, line if self.lines else None))
        if record["error"] is None and not self.budget_warned:
            self._check_budget(record, line)
        self.bar.set_postfix({"ok": summary.ok, "failed": summary.failed,
                              "tok/s": f"{summary.generated_tokens / self.decode_s:.1f}" if self.decode_s else "-",
                              "compress": f"{sum(self.ratios) / len(self.ratios):.2f}x" if self.ratios else "-",
                              **({"kv": f"{self.kv.in_flight / 2**20:.0f}MiB"} if self.kv else {})},
                             refresh=False)
        self.bar.update(1)

    def _check_budget(self, record: dict, line: int) -> None:
        config = record.get("config") or {}
        message = budget_warning(config.get("budget"), record.get("prompt_tokens"), ratio=config.get("ratio"))
        if message:
            self.budget_warned = True
            where = f", line {line}" if self.lines else ""
            message += f" (first such row: {row_name(record['id'])}{where}; said once per run)"
            if self.live:
                self.summary.warn(message, self.say)
            else:
                self.summary.warnings.append(message)

    def _failed(self, what: str, writer, e: OSError) -> None:
        self.stopped = True
        if self.summary.io_error:
            return
        name = writer.path or "stdout"
        if isinstance(e, rec.FileVanished):
            lost = ("the records this run wrote to it are lost; rerun to write them again" if what == "output"
                    else "a rerun rebuilds it from the output")
            self.summary.io_error = f"the {what} {name} {e} while this run was writing it: {lost}"
        else:
            self.summary.io_error = f"cannot write the {what} {name}: {write_failure(e)}"

    def finish(self, wall_s: float) -> None:
        summary = self.summary
        for what, writer in (("output", self.writer), ("stats log", self.stats)):
            if writer is not None and not self.stopped:
                try:
                    writer.check()  # deleted after its last write: not a success either
                except rec.FileVanished as e:
                    self._failed(what, writer, e)
        summary.wall_s = wall_s
        if self.kv is not None:
            summary.kv_limit_bytes, summary.kv_peak_bytes = self.kv.limit, self.kv.peak
        if self.ratios:
            summary.compression_mean = sum(self.ratios) / len(self.ratios)
            summary.compression_min, summary.compression_max = min(self.ratios), max(self.ratios)
        if wall_s > 0:
            summary.tokens_per_s = summary.tokens_seen / wall_s
            summary.generated_tokens_per_s = summary.generated_tokens / wall_s


def row_line(record: dict, line: Optional[int]) -> str:
    """``--verbose``: one finished row on one line (id, line unless None, tokens seen and kept,
    compression, seconds)."""
    name = f"row {row_name(record['id']).removeprefix('id ')}"
    if record["error"] is not None:  # its message starts with its line number (or a folder file's path)
        return f"{name}: failed: {record['error']['type']}: {record['error']['message']}"
    if line is not None:
        name += f" (line {line})"
    seconds = (record.get("prefill_s") or 0.0) + (record.get("decode_s") or 0.0)
    ratio = record.get("compression_ratio")
    return (f"{name}: {record['tokens_seen']} tokens seen, {record['tokens_kept']} kept, "
            f"{f'{ratio:.2f}x' if ratio is not None else '-'}, {seconds:.2f} s")


def silence_stdout() -> None:
    # The reader left: point stdout at /dev/null so the interpreter's final flush
    # does not print a BrokenPipeError traceback.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
