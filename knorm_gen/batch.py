"""The batch runner: JSONL rows in, one durable JSONL record per row out.

Rows are processed in input order, one at a time. Each record is written
whole and fsynced before the next row starts. Rerunning over the same output
resumes: rows whose id already has a successful record are skipped, failed
records are dropped and retried, a torn last line is cut away.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO, Callable, Optional, Sequence

from tqdm import tqdm

from . import records as rec
from .cache import EvictionConfig, default_skip_layers

EXIT_OK = 0
EXIT_ROWS_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

STATS_FIELDS = (
    "finish_reason", "prompt_tokens", "generated_tokens", "tokens_seen", "tokens_kept", "compression_ratio",
    "kept_bytes", "full_bytes", "prefill_s", "decode_s", "prompt_tps", "generation_tps", "peak_memory_gb",
)
RECORD_FIELDS = ("id", "completion", "answers", *STATS_FIELDS, "model", "config", "meta", "error")
ANSWER_FIELDS = ("question", "answer", "finish_reason", "prompt_tokens", "generated_tokens", "tokens_seen",
                 "tokens_kept", "compression_ratio", "prefill_s", "decode_s", "generation_tps")


_DEFAULTS = EvictionConfig()


def _layers(value) -> Optional[tuple[int, ...]]:
    return None if value is None else tuple(value)


class BatchUsageError(ValueError):
    """A problem found before any row runs (options, input, output, model)."""


@dataclass
class BatchOptions:
    """Everything a run needs besides its rows. Defaults are the command's."""

    model: str = "default"
    budget: Optional[int] = _DEFAULTS.budget
    n_sink: int = _DEFAULTS.n_sink
    recent: Optional[int] = None  # None: the library's automatic window (budget // 8)
    keep: str = _DEFAULTS.keep
    skip_layers: Optional[tuple[int, ...]] = None  # None: the library default for the model
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: Optional[int] = None
    chat: Optional[bool] = None
    prefill_step_size: int = 512
    overwrite: bool = False
    limit: Optional[int] = None
    stats_log: Optional[str] = None
    summary_json: Optional[str] = None

    def check(self) -> None:
        """Raise :class:`BatchUsageError` with the library's message for a bad setting."""
        try:
            EvictionConfig(budget=self.budget, n_sink=self.n_sink, recent=self.recent, keep=self.keep,
                           skip_layers=_layers(self.skip_layers))
            from .generate import _check_sampling

            _check_sampling(self.max_tokens, self.temperature, self.top_p)
        except ValueError as e:
            raise BatchUsageError(str(e)) from None
        if self.limit is not None and self.limit < 0:
            raise BatchUsageError(f"limit must be >= 0, got {self.limit}")

    def generation_kwargs(self, overrides: Optional[dict] = None) -> dict:
        kw = dict(budget=self.budget, n_sink=self.n_sink, recent=self.recent, keep=self.keep,
                  skip_layers=_layers(self.skip_layers), max_tokens=self.max_tokens,
                  temperature=self.temperature, top_p=self.top_p, seed=self.seed,
                  prefill_step_size=self.prefill_step_size, chat=self.chat)
        kw.update(overrides or {})
        return kw


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
    errors: dict = field(default_factory=dict)  # error type -> count

    @property
    def exit_code(self) -> int:
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
        return "\n".join(lines)


# ------------------------------------------------------------------ models

_MODELS: dict[str, tuple[Any, Any]] = {}


def get_model(spec: str = "default") -> tuple[Any, Any]:
    """``load_model(spec)``, cached per spec for the life of the process."""
    key = spec or "default"
    if key not in _MODELS:
        from .models import load_model

        try:
            _MODELS[key] = load_model(key)
        except Exception as e:  # any loader failure is a usage error: nothing has run yet
            raise BatchUsageError(f"cannot load model {key!r}: {e}") from e
    return _MODELS[key]


# ------------------------------------------------------------------ records


def empty_record(row_id: Any, options: BatchOptions, config: dict, meta: Optional[dict]) -> dict:
    """The one record shape: every field present, numbers null until known."""
    record = dict.fromkeys(RECORD_FIELDS)
    record.update(id=row_id, model=options.model, config=config, meta=meta)
    return record


def row_config(options: BatchOptions, overrides: Optional[dict] = None) -> dict:
    """The effective eviction and sampling settings of a row, as written in ``config``."""
    kw = options.generation_kwargs(overrides)
    eviction = dict(budget=kw["budget"], n_sink=kw["n_sink"], recent=kw["recent"], keep=kw["keep"],
                    skip_layers=_layers(kw["skip_layers"]))
    try:
        config = EvictionConfig(**eviction).to_dict()  # resolves the automatic recent window
    except ValueError:  # a bad per-row override: the record's error says why
        config = {**eviction, "skip_layers": None if eviction["skip_layers"] is None else list(eviction["skip_layers"])}
    for name in ("max_tokens", "temperature", "top_p", "seed", "prefill_step_size", "chat"):
        config[name] = kw[name]
    return config


def error_record(err: rec.RowError, options: BatchOptions) -> dict:
    record = empty_record(err.id, options, row_config(options), err.meta)
    record["error"] = err.to_dict()
    return record


def run_row(model: Any, tokenizer: Any, row: rec.Row, options: BatchOptions) -> dict:
    """Generate for one row; a ValueError or any other failure becomes the record's error."""
    from .generate import PromptTooLongError, answer_questions, generate_with_eviction

    kwargs = options.generation_kwargs(row.overrides)
    record = empty_record(row.id, options, row_config(options, row.overrides), row.meta)
    try:
        if row.kind == "questions":
            results = answer_questions(model, tokenizer, row.context, row.questions, **kwargs)
            record.update(_question_numbers(results))
        else:
            result = generate_with_eviction(model, tokenizer, row.prompt, **kwargs)
            record["completion"] = result.text
            record.update({k: getattr(result, k) for k in STATS_FIELDS})
    except KeyboardInterrupt:
        raise
    except ValueError as e:
        kind = rec.PROMPT_TOO_LONG if isinstance(e, PromptTooLongError) else rec.INVALID_ROW
        record["error"] = {"type": kind, "message": f"line {row.line}: {e}", "line": row.line}
    except Exception as e:  # noqa: BLE001 - one bad row must not stop an overnight run
        record["error"] = {"type": rec.GENERATION_ERROR, "message": f"line {row.line}: {type(e).__name__}: {e}",
                           "line": row.line}
    if record["error"] is not None:
        for name in STATS_FIELDS:
            record[name] = None
        record["completion"] = record["answers"] = None
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


# ------------------------------------------------------------------ the run


class _StopFlag:
    """First Ctrl-C: finish and write the current row, then stop. Second: abort now."""

    def __init__(self, notify: Callable[[str], None]):
        self.set = False
        self._notify = notify
        self._old = None

    def __enter__(self) -> "_StopFlag":
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.set:
            raise KeyboardInterrupt
        self.set = True
        self._notify("\nstopping after the current row is written (Ctrl-C again to abort it)")

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


def open_input(path: str) -> BinaryIO:
    """The input as a binary stream; ``-`` is stdin. Unreadable input is a usage error."""
    if path == "-":
        return sys.stdin.buffer
    p = Path(path)
    if p.is_dir():
        raise BatchUsageError(f"input {path} is a directory, not a JSONL file")
    try:
        return open(p, "rb")
    except OSError as e:
        raise BatchUsageError(f"cannot read input {path}: {e.strerror or e}") from None


def default_output(input_path: str) -> str:
    """``<input stem>.completions.jsonl`` beside the input; stdout for stdin."""
    if input_path == "-":
        return "-"
    p = Path(input_path)
    return str(p.with_name(p.stem + ".completions.jsonl"))


def _check_writable(path: Optional[str], what: str) -> None:
    if path is None or path == "-":
        return
    p = Path(path)
    if p.is_dir():
        raise BatchUsageError(f"{what} {path} is a directory")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "ab"):
            pass
    except OSError as e:
        raise BatchUsageError(f"cannot write {what} {path}: {e.strerror or e}") from None


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
) -> BatchSummary:
    """Run every row of ``input_path`` (``-`` = stdin) into ``output_path``.

    Everything that can be checked before work starts (options, input,
    output, existing output, model) raises :class:`BatchUsageError`. Row
    failures become error records. Returns the summary; its ``exit_code`` is
    0 (all ok), 1 (some rows failed) or 130 (interrupted).
    """
    options = options or BatchOptions()
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    options.check()
    output_path = output_path or default_output(input_path)
    to_stdout = output_path == "-"
    stream = open_input(input_path)
    try:
        total = None
        if input_path != "-":
            total = rec.count_rows(stream)
            stream.seek(0)
            if options.limit is not None:
                total = min(total, options.limit)
        for path, what in ((output_path, "output"), (options.stats_log, "stats log"),
                           (options.summary_json, "summary")):
            _check_writable(path, what)
        state = rec.ResumeState()
        if not to_stdout and not options.overwrite:
            try:
                state = rec.scan_output(output_path)
            except rec.OutputCorrupt as e:
                raise BatchUsageError(str(e)) from None
        if model is None:
            model, tokenizer = get_model(options.model)
        if options.skip_layers is None:  # records show the layers really left uncompressed
            options = replace(options, skip_layers=default_skip_layers(len(model.layers)))

        if to_stdout:
            writer = rec.RecordWriter(stdout or sys.stdout.buffer)
        else:
            if state.needs_rewrite:
                rec.rewrite_atomically(output_path, state.keep)
            writer = rec.RecordWriter.open(output_path, fresh=options.overwrite)
        if (state.done or state.needs_rewrite) and progress:
            log(f"resuming {output_path}: {len(state.done)} rows already done"
                + (f", {state.dropped_errors} failed rows to retry" if state.dropped_errors else "")
                + (", cut a torn last line" if state.torn else ""))
        stats = (rec.RecordWriter.open(options.stats_log, fresh=options.overwrite)
                 if options.stats_log else None)
        summary = BatchSummary(input=input_path, output=output_path, model=options.model)
        try:
            _loop(stream, writer, stats, state.done, options, model, tokenizer, summary, total, progress, log)
        finally:
            writer.close()
            if stats:
                stats.close()
    finally:
        if stream is not sys.stdin.buffer:
            stream.close()
    if options.summary_json:
        Path(options.summary_json).write_text(json.dumps(summary.to_dict(), indent=2) + "\n")
    return summary


def _loop(stream, writer, stats, done, options, model, tokenizer, summary, total, progress, log) -> None:
    ratios: list[float] = []
    decode_s = 0.0
    tic = time.perf_counter()
    bar = tqdm(total=total, unit="row", file=sys.stderr, dynamic_ncols=True,
               disable=not (progress and sys.stderr.isatty()))

    def say(message: str) -> None:  # per-row notes only beside a live progress bar
        if not bar.disable:
            tqdm.write(message, file=sys.stderr)

    with bar, _StopFlag(log) as stop:
        try:
            for n, item in enumerate(rec.read_rows(stream)):
                if options.limit is not None and n >= options.limit:
                    break
                if isinstance(item, rec.Row) and item.key in done:
                    summary.rows += 1
                    summary.skipped += 1
                    bar.update(1)
                    continue
                if isinstance(item, rec.RowError):
                    record = error_record(item, options)
                else:
                    record = run_row(model, tokenizer, item, options)
                writer.write(record)
                if stats:
                    stats.write(stats_entry(record, item.line))
                summary.rows += 1
                if record["error"] is None:
                    summary.ok += 1
                    summary.tokens_seen += record["tokens_seen"]
                    summary.tokens_kept += record["tokens_kept"]
                    summary.generated_tokens += record["generated_tokens"]
                    decode_s += record["decode_s"]
                    ratios.append(record["compression_ratio"])
                else:
                    summary.failed += 1
                    kind = record["error"]["type"]
                    summary.errors[kind] = summary.errors.get(kind, 0) + 1
                    say(f"error: {record['error']['message']}")
                bar.set_postfix({"ok": summary.ok, "failed": summary.failed,
                                 "tok/s": f"{summary.generated_tokens / decode_s:.1f}" if decode_s else "-",
                                 "compress": f"{sum(ratios) / len(ratios):.2f}x" if ratios else "-"},
                                refresh=False)
                bar.update(1)
                if stop.set:
                    summary.interrupted = True
                    break
        except KeyboardInterrupt:
            summary.interrupted = True
    summary.wall_s = time.perf_counter() - tic
    if ratios:
        summary.compression_mean = sum(ratios) / len(ratios)
        summary.compression_min, summary.compression_max = min(ratios), max(ratios)
    if summary.wall_s > 0:
        summary.tokens_per_s = summary.tokens_seen / summary.wall_s
        summary.generated_tokens_per_s = summary.generated_tokens / summary.wall_s


__all__ = [
    "BatchOptions", "BatchSummary", "BatchUsageError", "run_batch", "run_row", "get_model",
    "default_output", "EXIT_OK", "EXIT_ROWS_FAILED", "EXIT_USAGE", "EXIT_INTERRUPTED",
]
