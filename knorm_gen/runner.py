"""The row loop: input items in, records written as each row finishes.

One row at a time (``batch_size=1``, on mlx_lm's ``stream_generate``) or several
decoded together (:class:`~knorm_gen.batched.BatchEngine`). Every record is built
here, whole, with its fingerprint; :mod:`knorm_gen.batch` decides which rows run
and where the records go.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any, BinaryIO, Callable, Iterator, Optional, Sequence

from tqdm import tqdm

from . import records as rec
from .config import EvictionConfig, GenerationConfig, full_attention_layers, make_configs
from .distributed import Group, shard_of
from .files import FileUsageError

EXIT_OK = 0
EXIT_ROWS_FAILED = 1
EXIT_USAGE = 2
EXIT_IO_ERROR = 3
EXIT_INTERNAL_ERROR = 4
EXIT_INTERRUPTED = 130
EXIT_PIPE_CLOSED = 141  # 128 + SIGPIPE, what a shell reports for a writer whose reader left

STATS_FIELDS = (
    "finish_reason", "prompt_tokens", "generated_tokens", "tokens_seen", "tokens_kept", "compression_ratio",
    "kept_bytes", "full_bytes", "kv_ceiling_bytes", "prefill_s", "decode_s", "prompt_tps", "generation_tps",
    "peak_memory_gb",
)
RECORD_FIELDS = ("id", "completion", "answers", *STATS_FIELDS, "model", "config", "meta", "fingerprint", "error")
ANSWER_FIELDS = ("question", "answer", "finish_reason", "prompt_tokens", "generated_tokens", "tokens_seen",
                 "tokens_kept", "compression_ratio", "prefill_s", "decode_s", "generation_tps")


class BatchUsageError(FileUsageError):
    """A problem found before any row runs (options, input, output, model)."""


@dataclass
class BatchOptions:
    """Everything a run needs besides its rows. Defaults are the command's."""

    model: str = "default"
    eviction: EvictionConfig = field(default_factory=EvictionConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    batch_size: int = 8
    overwrite: bool = False
    accept_old_records: bool = False
    limit: Optional[int] = None
    stats_log: Optional[str] = None
    summary_json: Optional[str] = None

    def check(self) -> None:
        """Raise :class:`BatchUsageError` for a bad runner setting (the configs check themselves)."""
        if not isinstance(self.eviction, EvictionConfig) or not isinstance(self.generation, GenerationConfig):
            raise BatchUsageError("eviction and generation must be EvictionConfig and GenerationConfig")
        if self.limit is not None and (isinstance(self.limit, bool) or not isinstance(self.limit, int)
                                       or self.limit < 0):
            raise BatchUsageError(f"limit must be an integer >= 0, got {self.limit!r}")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise BatchUsageError(f"batch_size must be an integer >= 1, got {self.batch_size!r}")


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

    def text(self) -> str:
        lines = [f"knorm-batch: {self.rows} rows: {self.ok} ok, {self.failed} failed, {self.skipped} skipped "
                 f"(already done) -> {self.output}"]
        if self.errors:
            lines.append("  errors: " + ", ".join(f"{k} {v}" for k, v in sorted(self.errors.items())))
        if self.ok:
            lines.append(f"  tokens seen {self.tokens_seen}, kept {self.tokens_kept}, generated "
                         f"{self.generated_tokens}; compression mean {self.compression_mean:.2f}x "
                         f"(min {self.compression_min:.2f}x, max {self.compression_max:.2f}x)")
        lines.append(f"  wall {self.wall_s:.1f} s; {self.tokens_per_s:.1f} tokens/s processed, "
                     f"{self.generated_tokens_per_s:.1f} tokens/s generated")
        if self.kv_memory:
            lines.append(f"  {self.kv_memory}")
        for r, numbers in enumerate(self.ranks):
            lines.append(f"  rank {r}: {numbers['rows']} rows ({numbers['ok']} ok, {numbers['failed']} failed, "
                         f"{numbers['skipped']} skipped), {numbers['generated_tokens']} tokens generated, "
                         f"{numbers['generated_tokens_per_s']:.1f} tokens/s, wall {numbers['wall_s']:.1f} s")
        if self.io_error:
            lines.append(f"  stopped: {self.io_error}")
        return "\n".join(lines)


# ------------------------------------------------------------------ records


def row_configs(options: BatchOptions, row: Optional[rec.Row] = None) -> tuple[EvictionConfig, GenerationConfig]:
    """A row's effective settings: the run's, with its per-row overrides. ValueError names a bad one."""
    return make_configs(options.eviction, options.generation, **(row.overrides if row else {}))


def record_config(eviction: EvictionConfig, generation: GenerationConfig) -> dict:
    """The ``config`` a record reports (the same dict a GenerationResult carries)."""
    from .generate import result_config

    return result_config(eviction, generation)


def fingerprint(row: rec.Row, config: dict, model: str) -> str:
    """What produced a record: the row's content, its effective settings and the model spec."""
    text = json.dumps({"row": row.digest, "config": config, "model": model}, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def empty_record(row_id: Any, options: BatchOptions, config: dict, meta: Optional[dict]) -> dict:
    """The one record shape: every field present, numbers null until known."""
    record = dict.fromkeys(RECORD_FIELDS)
    record.update(id=row_id, model=options.model, config=config, meta=meta)
    return record


@dataclass
class _Context:
    """What every row of a run shares once the model is loaded."""

    options: BatchOptions
    model: Any
    tokenizer: Any
    eviction: EvictionConfig  # resolved for the model
    base_config: dict

    @cached_property
    def full_layers(self) -> list[int]:
        return full_attention_layers(self.model)  # once per run, not once per row of the resume scan

    def row_settings(self, row: rec.Row) -> tuple[EvictionConfig, GenerationConfig, dict]:
        eviction, generation = row_configs(self.options, row)
        eviction = eviction.resolved(len(self.model.layers), self.full_layers)
        return eviction, generation, record_config(eviction, generation)

    def expected_fingerprint(self, row: rec.Row) -> Optional[str]:
        try:
            _, _, config = self.row_settings(row)
        except ValueError:
            return None  # a bad override: the row fails, nothing to resume
        return fingerprint(row, config, self.options.model)


def error_record(err: rec.RowError, ctx: _Context) -> dict:
    record = empty_record(err.id, ctx.options, ctx.base_config, err.meta)
    record["error"] = err.to_dict()
    return record


def _failed(record: dict, kind: str, message: str, line: int) -> dict:
    record["error"] = {"type": kind, "message": f"line {line}: {message}", "line": line}
    for name in STATS_FIELDS:
        record[name] = None
    record["completion"] = record["answers"] = None
    return record


def _row_error(row: rec.Row, ctx: _Context, config: Optional[dict], e: BaseException) -> dict:
    """The error record of a row whose settings, prompt or generation failed."""
    from .generate import PromptTooLongError

    record = empty_record(row.id, ctx.options, config or ctx.base_config, row.meta)
    if config is not None:
        record["fingerprint"] = fingerprint(row, config, ctx.options.model)
    if isinstance(e, ValueError):
        kind = rec.PROMPT_TOO_LONG if isinstance(e, PromptTooLongError) else rec.INVALID_ROW
        return _failed(record, kind, str(e), row.line)
    return _failed(record, rec.GENERATION_ERROR, f"{type(e).__name__}: {e}", row.line)


def row_record(row: rec.Row, ctx: _Context, config: dict, result: Any) -> dict:
    """The record of a prompt row from its GenerationResult."""
    record = empty_record(row.id, ctx.options, config, row.meta)
    record["fingerprint"] = fingerprint(row, config, ctx.options.model)
    record["completion"] = result.text
    record.update({k: getattr(result, k) for k in STATS_FIELDS})
    return _finite(record)


def run_row(row: rec.Row, ctx: _Context) -> dict:
    """Generate for one row alone; a ValueError or any other failure becomes the record's error."""
    from .batched import answer_questions
    from .generate import generate_with_eviction

    config = None
    try:
        eviction, generation, config = ctx.row_settings(row)
        kw = dict(eviction=eviction, generation=generation)
        if row.kind == "questions":
            results = answer_questions(ctx.model, ctx.tokenizer, row.context, row.questions,
                                       batch_size=ctx.options.batch_size, **kw)
            record = empty_record(row.id, ctx.options, config, row.meta)
            record["fingerprint"] = fingerprint(row, config, ctx.options.model)
            record.update(_question_numbers(results))
            return _finite(record)
        return row_record(row, ctx, config, generate_with_eviction(ctx.model, ctx.tokenizer, row.prompt, **kw))
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 - one bad row must not stop an overnight run
        return _row_error(row, ctx, config, e)


def _finite(record: dict) -> dict:
    """Output is strict JSON: a non-finite number (a rate over zero seconds) becomes null."""
    for name in STATS_FIELDS:
        value = record.get(name)
        if isinstance(value, float) and not math.isfinite(value):
            record[name] = None
    for answer in record.get("answers") or ():
        for name, value in answer.items():
            if isinstance(value, float) and not math.isfinite(value):
                answer[name] = None
    return record


def _question_numbers(results: Sequence[Any]) -> dict:
    """Top-level numbers of a question row: cache numbers from the answer that saw
    the most tokens; token counts and times summed, the context prefill once."""
    answers = [{"question": r.question, "answer": r.text, **{k: getattr(r, k) for k in ANSWER_FIELDS[2:]}}
               for r in results]
    peak = max(results, key=lambda r: r.tokens_seen)
    context_s = results[0].context_prefill_s or 0.0
    prefill_s = context_s + sum(r.prefill_s - (r.context_prefill_s or 0.0) for r in results)
    decode_s = sum(r.decode_s for r in results)
    generated = sum(r.generated_tokens for r in results)
    reasons = [r.finish_reason for r in results if r.finish_reason != "stop"]
    return {
        "answers": answers,
        "finish_reason": reasons[0] if reasons else "stop",
        "prompt_tokens": peak.prompt_tokens,
        "generated_tokens": generated,
        "tokens_seen": peak.tokens_seen,
        "tokens_kept": peak.tokens_kept,
        "compression_ratio": peak.compression_ratio,
        "kept_bytes": peak.kept_bytes,
        "full_bytes": peak.full_bytes,
        "kv_ceiling_bytes": peak.kv_ceiling_bytes,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "prompt_tps": peak.prompt_tps,
        "generation_tps": generated / decode_s if decode_s > 0 else 0.0,
        "peak_memory_gb": max(r.peak_memory_gb for r in results),
    }


def stats_entry(record: dict, line: int) -> dict:
    """A record without its texts (``completion``, ``answers``, ``meta``), for --stats-log."""
    entry = {"id": record["id"], "line": line}
    entry.update({k: record[k] for k in STATS_FIELDS})
    entry["answers"] = len(record["answers"]) if record["answers"] is not None else None
    entry.update(model=record["model"], config=record["config"],
                 error=record["error"]["type"] if record["error"] else None)
    return entry


# ------------------------------------------------------------------ signals


class _Signals:
    """SIGINT and SIGTERM. Before rows run they abort at once (nothing to lose);
    while rows run the first one sets ``stop`` (the runner finishes and writes
    the row in flight, then stops) and a second aborts."""

    def __init__(self, notify: Callable[[str], None]):
        self.stop = False
        self.graceful = False
        self._notify = notify
        self._old: dict = {}

    def __enter__(self) -> "_Signals":
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


def _items(stream: BinaryIO, limit: Optional[int], group: Optional[Group] = None) -> Iterator[Any]:
    """Input items (rows and row errors) up to ``limit``, this process's share only."""
    for n, item in enumerate(rec.read_rows(stream)):
        if limit is not None and n >= limit:
            return
        if group is None or shard_of(n, group.size) == group.rank:
            yield item


class _Sink:
    """Writes each finished record whole, and counts it in the summary and the bar.
    A closed output pipe or an I/O error sets ``stopped``: the run ends there."""

    def __init__(self, writer, stats, summary: BatchSummary, bar):
        self.writer, self.stats, self.summary, self.bar = writer, stats, summary, bar
        self.ratios: list[float] = []
        self.decode_s = 0.0
        self.stopped = False

    def skip(self) -> None:
        self.summary.rows += 1
        self.summary.skipped += 1
        self.bar.update(1)

    def emit(self, record: dict, line: int) -> None:
        summary = self.summary
        try:
            self.writer.write(record)
            if self.stats:
                self.stats.write(stats_entry(record, line))
        except BrokenPipeError:
            summary.pipe_closed = self.stopped = True
            _silence_stdout()
            return
        except OSError as e:
            summary.io_error = f"cannot write: {e.strerror or e} ({e.filename or 'output'})"
            self.stopped = True
            return
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
            if not self.bar.disable:  # per-row notes only beside a live progress bar
                tqdm.write(f"error: {record['error']['message']}", file=sys.stderr)
        self.bar.set_postfix({"ok": summary.ok, "failed": summary.failed,
                              "tok/s": f"{summary.generated_tokens / self.decode_s:.1f}" if self.decode_s else "-",
                              "compress": f"{sum(self.ratios) / len(self.ratios):.2f}x" if self.ratios else "-"},
                             refresh=False)
        self.bar.update(1)

    def finish(self, wall_s: float) -> None:
        summary = self.summary
        summary.wall_s = wall_s
        if self.ratios:
            summary.compression_mean = sum(self.ratios) / len(self.ratios)
            summary.compression_min, summary.compression_max = min(self.ratios), max(self.ratios)
        if wall_s > 0:
            summary.tokens_per_s = summary.tokens_seen / wall_s
            summary.generated_tokens_per_s = summary.generated_tokens / wall_s


def _loop(stream, writer, stats, done, ctx: _Context, summary: BatchSummary, total, progress, signals,
          group: Group) -> None:
    tic = time.perf_counter()
    label = f"rank 0/{group.size}" if group.distributed else None
    bar = tqdm(total=total, unit="row", file=sys.stderr, dynamic_ncols=True, desc=label,
               disable=not (progress and sys.stderr.isatty()))
    sink = _Sink(writer, stats, summary, bar)
    items = _items(stream, ctx.options.limit, group)
    with bar:
        try:
            if ctx.options.batch_size == 1:
                _run_alone(items, done, ctx, sink, signals)
            else:
                _run_batched(items, done, ctx, sink, signals)
        except KeyboardInterrupt:
            summary.interrupted = True
    if signals.stop:
        summary.interrupted = True
    sink.finish(time.perf_counter() - tic)


def _run_alone(items, done, ctx: _Context, sink: _Sink, signals) -> None:
    """One row at a time: each record is written before the next row starts."""
    for item in items:
        if isinstance(item, rec.Row) and item.key in done:
            sink.skip()
            continue
        record = error_record(item, ctx) if isinstance(item, rec.RowError) else run_row(item, ctx)
        sink.emit(record, item.line)
        if sink.stopped or signals.stop:
            return


def _run_batched(items, done, ctx: _Context, sink: _Sink, signals) -> None:
    """Prompt rows decode together, ``batch_size`` at a time (mlx_lm continuous
    batching), each record written as its row finishes, so records appear in
    finishing order. Rows whose eviction settings differ (a per-row ``budget``)
    run in their own batch. A question row batches its own questions."""
    from .batched import BatchEngine
    from .generate import _check_length, encode_prompt

    size = ctx.options.batch_size
    engine, engine_key = None, None
    flight: dict[int, tuple[rec.Row, dict]] = {}

    def step() -> None:
        nonlocal engine
        try:
            finished = engine.step()
        except KeyboardInterrupt:
            raise
        except Exception:  # noqa: BLE001 - the batch failed: run its rows alone, so only a bad one fails
            rows = [row for row, _ in flight.values()]
            flight.clear()
            engine = None
            for row in rows:
                sink.emit(run_row(row, ctx), row.line)
            return
        for line, result in finished:
            row, config = flight.pop(line)
            sink.emit(row_record(row, ctx, config, result), row.line)

    def drain() -> None:
        while engine is not None and len(engine) and not sink.stopped:
            step()

    for item in items:
        if isinstance(item, rec.Row) and item.key in done:
            sink.skip()
            continue
        if isinstance(item, rec.RowError):
            sink.emit(error_record(item, ctx), item.line)
        elif item.kind == "questions":
            sink.emit(run_row(item, ctx), item.line)
        else:
            config = None
            try:
                eviction, generation, config = ctx.row_settings(item)
                ids = encode_prompt(ctx.tokenizer, item.prompt, generation.chat)
                _check_length(ctx.model, len(ids))
            except Exception as e:  # noqa: BLE001 - a bad row never enters a batch
                sink.emit(_row_error(item, ctx, config, e), item.line)
            else:
                key = (eviction, generation.prefill_step_size)
                if engine is not None and key != engine_key:
                    drain()
                    engine = None
                if engine is None:
                    engine, engine_key = BatchEngine(ctx.model, ctx.tokenizer, eviction, batch_size=size,
                                                     prefill_step_size=generation.prefill_step_size,
                                                     seed=ctx.options.generation.seed), key
                engine.add(item.line, ids, generation)
                flight[item.line] = (item, config)
                while engine is not None and len(engine) >= size and not sink.stopped:
                    step()
        if sink.stopped or signals.stop:
            break
    drain()  # after a first Ctrl-C too: the rows in flight are finished and written


def _silence_stdout() -> None:
    # The reader left: point stdout at /dev/null so the interpreter's final flush
    # does not print a BrokenPipeError traceback.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


__all__ = [
    "BatchOptions", "BatchSummary", "BatchUsageError", "Interrupted", "run_row", "row_record", "EXIT_OK",
    "EXIT_ROWS_FAILED", "EXIT_USAGE", "EXIT_IO_ERROR", "EXIT_INTERNAL_ERROR", "EXIT_INTERRUPTED", "EXIT_PIPE_CLOSED",
]
