"""The batch run: JSONL rows in, one durable JSONL record per row out.

Each record is written whole and fsynced as its row finishes. Rerunning over
the same output resumes: a row counts as done when the output holds a
successful record for its id *made from the same row and settings* (the
record's ``fingerprint``); failed records are dropped and retried; a torn last
line is cut away. Before any work the runner refuses what would lose or mix up
work: side files that are the input, a second run on a locked output, an
output whose records no longer match the input (see :func:`plan_resume`).
This module owns the files, the resume plan and the process group;
:mod:`knorm_gen.runner` runs the rows.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Optional


from . import records as rec
from .files import (
    FileLock,
    FileUsageError,
    LockHeld,
    check_distinct_files,
    check_writable,
    default_output,
    is_stream,
    open_input,
    repair_torn_tail,
    rewrite_atomically,
)
from .cache import kv_memory
from .distributed import Group, local_parts, part_path, shard_of

from .runner import (  # noqa: F401  (the runner's names are part of this module's API)
    ANSWER_FIELDS,
    EXIT_INTERNAL_ERROR,
    EXIT_INTERRUPTED,
    EXIT_IO_ERROR,
    EXIT_OK,
    EXIT_PIPE_CLOSED,
    EXIT_ROWS_FAILED,
    EXIT_USAGE,
    RECORD_FIELDS,
    STATS_FIELDS,
    BatchOptions,
    BatchSummary,
    BatchUsageError,
    Interrupted,
    _Context,
    _items,
    _loop,
    _Signals,
    record_config,
    run_row,
)

# ------------------------------------------------------------------ models

_MODELS: dict[str, tuple[Any, Any]] = {}


def _looks_like_path(spec: str) -> bool:
    # A hub id is "owner/name"; anything else with a separator, or a file suffix, is a path.
    return (spec.startswith(("/", ".", "~")) or spec.count("/") > 1 or spec.lower().endswith(".gguf")
            or os.sep != "/" and os.sep in spec)


def get_model(spec: str = "default") -> tuple[Any, Any]:
    """``load_model(spec)``, cached per spec for the life of the process."""
    key = spec or "default"
    if key not in _MODELS:
        from .models import load_model

        if _looks_like_path(key) and not Path(key).expanduser().exists():
            raise BatchUsageError(f"cannot load model {key!r}: the path {Path(key).expanduser()} does not exist")
        try:
            _MODELS[key] = load_model(key)
        except Exception as e:  # any loader failure is a usage error: nothing has run yet
            raise BatchUsageError(f"cannot load model {key!r}: {e}") from e
    return _MODELS[key]


# ------------------------------------------------------------------ resume


@dataclass
class ResumePlan:
    """Which ids are done, and which earlier lines a rewrite keeps."""

    done: set[str] = field(default_factory=set)
    keep: list[bytes] = field(default_factory=list)
    rewrite: bool = False
    torn: bool = False
    retried: int = 0


def check_resume(records: dict, expected: dict[str, Optional[str]], accept_old: bool, where: str) -> None:
    """Refuse earlier records made from another row or other settings than the
    input and options give now, or whose id is no longer in the input, unless
    ``accept_old`` keeps them as done. ``records`` maps id -> (fingerprint, line)."""
    changed = [k for k, (fp, _) in records.items() if k in expected and fp != expected[k]]
    gone = [k for k in records if k not in expected]
    if (changed or gone) and not accept_old:
        parts = []
        if changed:
            parts.append(f"{len(changed)} finished record(s) were made from another row or other settings than "
                         f"the input and options give now (first: id {changed[0]!r})")
        if gone:
            parts.append(f"{len(gone)} record(s) have ids that are no longer in the input (first: id {gone[0]!r})")
        raise BatchUsageError(f"{where}: " + "; ".join(parts) + ". Nothing was run. Use --overwrite to start "
                              "over, -o to write another file, or --accept-old-records to keep the old records "
                              "as they are (counted as done).")


def plan_resume(output: str, expected: dict[str, Optional[str]], accept_old: bool) -> ResumePlan:
    """Compare an earlier output with the input's rows (see :func:`check_resume`).

    ``expected`` maps each input row's id to the fingerprint a record of it
    would carry now. A record counts as done only when its fingerprint matches.
    """
    try:
        state = rec.scan_output(output)
    except rec.OutputCorrupt as e:
        raise BatchUsageError(str(e)) from None
    check_resume(state.records, expected, accept_old, output)
    return ResumePlan(done=set(state.records), keep=[line for _, line in state.records.values()],
                      rewrite=state.needs_rewrite, torn=state.torn, retried=state.dropped_errors)


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
) -> BatchSummary:
    """Run every row of ``input_path`` (``-`` = stdin) into ``output_path``.

    Everything that can be checked before work starts (options, input,
    output, locks, an output that no longer matches the input, the model)
    raises :class:`BatchUsageError`; a signal before work raises
    :class:`Interrupted`. Row failures become error records. Returns the
    summary; its ``exit_code`` is one of the ``EXIT_*`` statuses.

    With a ``group`` of more than one process (``mlx.launch``; see
    :mod:`knorm_gen.distributed`), this process runs its share of the rows
    into its part file, and rank 0 writes the final output, stats log and
    summary once every rank has finished.
    """
    try:
        return _run_batch(input_path, output_path, options or BatchOptions(), model=model, tokenizer=tokenizer,
                          progress=progress, log=log or _stderr, stdout=stdout, group=group or Group())
    except FileUsageError as e:
        if isinstance(e, BatchUsageError):
            raise
        raise BatchUsageError(str(e)) from None


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class _Files:
    """The files one process writes: its own output and stats log (part files
    in a distributed run), and the final ones rank 0 assembles."""

    input: str
    output: str
    stats_log: Optional[str]
    own_output: str
    own_stats: Optional[str]

    @classmethod
    def plan(cls, input_path: str, output_path: Optional[str], options: BatchOptions, group: Group) -> "_Files":
        output = output_path or default_output(input_path)
        if not group.distributed:
            return cls(input_path, output, options.stats_log, output, options.stats_log)
        if input_path == "-" or is_stream(input_path) or is_stream(output):
            raise BatchUsageError("a run across several processes needs the input and the output as regular files "
                                  "(each rank writes a part file beside the output)")
        stats = options.stats_log
        if stats is not None and is_stream(stats):
            raise BatchUsageError("a run across several processes needs the stats log as a regular file")
        return cls(input_path, output, stats, part_path(output, group.rank, group.size),
                   part_path(stats, group.rank, group.size) if stats else None)

    def check(self, options: BatchOptions, group: Group) -> None:
        named = [("input", self.input), ("output", self.output), ("stats log", self.stats_log),
                 ("summary", options.summary_json)]
        if group.distributed:
            named += [("output part", self.own_output), ("stats log part", self.own_stats)]
        check_distinct_files(named)
        for path, what in ((self.own_output, "output"), (self.own_stats, "stats log"),
                           (options.summary_json, "summary")):
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
        except LockHeld as e:
            for lock in locks:
                lock.release()
            raise BatchUsageError(str(e)) from None
        return locks


def _run_batch(input_path, output_path, options: BatchOptions, *, model, tokenizer, progress, log, stdout,
               group: Group) -> BatchSummary:
    options.check()
    files = _Files.plan(input_path, output_path, options, group)
    if group.rank:
        progress = False  # rank 0 shows the bar; the others speak only of errors
    locks: list[FileLock] = []
    stream = None
    with _Signals(log) as signals:
        error: Optional[BaseException] = None
        try:
            files.check(options, group)
            stream = open_input(files.input)
            locks = files.lock(group)
            if model is None:
                model, tokenizer = get_model(options.model)
            try:
                eviction = options.eviction.for_model(model)
            except ValueError as e:
                raise BatchUsageError(str(e)) from None
            ctx = _Context(options, model, tokenizer, eviction, record_config(eviction, options.generation))
            memory = kv_memory(model, eviction)
            expected, total = _scan_rows(stream, ctx, group)
        except KeyboardInterrupt:
            error = Interrupted()
        except BaseException as e:  # noqa: BLE001 - in a group, every rank must hear of it (below)
            error = e
        try:
            if group.distributed:  # a rank that failed to start fails the launch, with its error, on every rank
                failures = [(r, m) for r, m in enumerate(group.gather_json(_describe(error))) if m]
                if failures:
                    if isinstance(error, KeyboardInterrupt):
                        raise Interrupted
                    raise BatchUsageError("; ".join(f"rank {r}: {m}" for r, m in failures))
            elif error is not None:
                raise error
            plan = _plan(files, expected, options, group, log if progress else None)
            writer = _open_writer(files.own_output, options.overwrite, stdout)
            stats = _open_writer(files.own_stats, options.overwrite, None) if files.own_stats else None
        except BaseException as e:
            for lock in locks:
                lock.release()
            if stream is not None:
                stream.close()
            if isinstance(e, KeyboardInterrupt) and not isinstance(e, Interrupted):
                raise Interrupted from None
            raise
        summary = BatchSummary(input=files.input, output=files.output, model=options.model,
                               kv_ceiling_bytes=memory.ceiling_bytes,
                               kv_growth_bytes_per_token=memory.growth_bytes_per_token, kv_memory=memory.describe())
        if progress:
            log(memory.describe())  # before a long job: is this configuration bounded?
        try:
            signals.graceful = True
            _loop(stream, writer, stats, plan.done, ctx, summary, total, progress, signals, group)
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
                summary = _finish_group(files, stream, ctx, expected, plan, summary, group)
            _write_summary(options.summary_json if group.rank == 0 else None, summary)
        finally:
            stream.close()
            for lock in locks:
                lock.release()
    return summary


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
        summary.io_error = summary.io_error or f"cannot write summary {path}: {e}"


def _plan(files: _Files, expected: dict, options: BatchOptions, group: Group,
          log: Optional[Callable[[str], None]]) -> ResumePlan:
    """What is already done. One process: its output. A group: every rank's earlier
    records (its part files and, on rank 0's machine, the final output), exchanged."""
    if is_stream(files.own_output):
        return ResumePlan()
    if not group.distributed:
        parts = local_parts(files.output)
        if options.overwrite:
            for path in parts:
                path.unlink(missing_ok=True)
            return ResumePlan()
        plan = plan_resume(files.own_output, expected, options.accept_old_records)
        if parts:  # an earlier run across several processes stopped before its merge: take its records in
            have = set(plan.done)
            extra = [(k, fp, line.encode("utf-8")) for k, fp, line in _local_records(files) if k not in have]
            extra = list({k: (fp, line) for k, fp, line in extra}.items())
            check_resume(dict(extra), expected, options.accept_old_records, files.output)
            plan.keep += [line for _, (_, line) in extra]
            plan.done |= {k for k, _ in extra}
            plan.rewrite = True
        if plan.rewrite:
            rewrite_atomically(files.own_output, plan.keep)
            for path in parts:
                path.unlink(missing_ok=True)
        if files.own_stats and not is_stream(files.own_stats):
            repair_torn_tail(files.own_stats)
        if (plan.done or plan.rewrite) and log:
            log(f"resuming {files.own_output}: {len(plan.done)} rows already done"
                + (f", {plan.retried} failed rows to retry" if plan.retried else "")
                + (", cut a torn last line" if plan.torn else ""))
        return plan
    if options.overwrite:
        for path in [*local_parts(files.output)] + ([*local_parts(files.stats_log)] if files.stats_log else []):
            if str(path) not in (files.own_output, files.own_stats):
                path.unlink(missing_ok=True)
        group.barrier()  # nobody deletes a part another rank has started since
        return ResumePlan()
    mine = _local_records(files)
    union: dict[str, tuple[Optional[str], bytes]] = {}
    for records in group.gather_json(mine):
        for key, fp, line in records:
            current = union.get(key)
            if current is None or (current[0] != expected.get(key) and fp == expected.get(key)):
                union[key] = (fp, line.encode("utf-8"))
    check_resume(union, expected, options.accept_old_records, files.output)
    state = rec.scan_output(files.own_output)  # this rank's part: cut a torn line, drop failed records
    if state.needs_rewrite:
        rewrite_atomically(files.own_output, [line for _, line in state.records.values()])
    if files.own_stats:
        repair_torn_tail(files.own_stats)
    if union and log:
        log(f"resuming {files.output}: {len(union)} rows already done (all ranks)")
    return ResumePlan(done=set(union), keep=[line for _, line in union.values()])


def _local_records(files: _Files) -> list[tuple[str, Optional[str], str]]:
    """``(id, fingerprint, line)`` of every successful record on this machine:
    the final output (if it is here) and every part file, of any group size."""
    out = []
    for path in [Path(files.output), *local_parts(files.output)]:
        try:
            state = rec.scan_output(path)
        except rec.OutputCorrupt as e:
            raise BatchUsageError(str(e)) from None
        out += [(key, fp, line.decode("utf-8")) for key, (fp, line) in state.records.items()]
    return out


def _finish_group(files: _Files, stream, ctx: _Context, expected: dict, plan: ResumePlan, summary: BatchSummary,
                  group: Group) -> BatchSummary:
    """Every rank's records to rank 0, which writes the final output in input order;
    then each rank removes the part files the output now holds."""
    if summary.interrupted or summary.io_error:
        return summary  # the parts keep every finished record; rerunning the launch resumes
    parts = [Path(files.own_output), *local_parts(files.output)]
    stats_parts = [Path(files.own_stats), *local_parts(files.stats_log)] if files.stats_log else []
    blobs = group.gather_bytes(b"".join(_read(p) for p in dict.fromkeys(parts)))
    stats_blobs = group.gather_bytes(b"".join(_read(p) for p in dict.fromkeys(stats_parts)))
    summaries = group.gather_json(summary.to_dict())
    total = combine_summaries(summaries, files)
    if group.rank == 0:
        stream.seek(0)
        lines = merge_records(_items(stream, ctx.options.limit), plan.keep, blobs, expected,
                              ctx.options.accept_old_records)
        rewrite_atomically(files.output, lines)
        if files.stats_log:
            rewrite_atomically(files.stats_log, merge_stats(_read(Path(files.stats_log)), stats_blobs))
    group.barrier()  # rank 0 has written and fsynced the final files: the parts are redundant now
    for path in dict.fromkeys(parts + stats_parts):
        path.unlink(missing_ok=True)
    return total if group.rank == 0 else summary


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return b""


def merge_records(items: Iterator[Any], earlier: list[bytes], blobs: list[bytes], expected: dict,
                  accept_old: bool) -> list[bytes]:
    """The final output: one line per input row, in input order. A row's
    successful record comes from the earlier records or any part (one whose
    fingerprint matches the input wins); else its error record from a part."""
    good: dict[str, bytes] = {}
    errors: dict[int, bytes] = {}
    for line in [*earlier, *(x + b"\n" for blob in blobs for x in blob.splitlines() if x.strip())]:
        record = rec._as_record(line.rstrip(b"\n"))
        if record is None:
            continue  # a torn tail of a part this run did not own
        if record["error"] is None and record["id"] is not None:
            key = rec.id_key(record["id"])
            fits = record.get("fingerprint") == expected.get(key) or accept_old
            if key not in good or fits:
                good[key] = line
        elif isinstance(record["error"], dict) and isinstance(record["error"].get("line"), int):
            errors[record["error"]["line"]] = line
    out = []
    for item in items:
        key = item.key if isinstance(item, rec.Row) else None
        if key is not None and key in good:
            out.append(good[key])
        elif item.line in errors:
            out.append(errors[item.line])
    return out


def merge_stats(earlier: bytes, blobs: list[bytes]) -> list[bytes]:
    """The combined stats log: earlier entries, then new ones (each once) in input-line order."""
    seen = set(earlier.splitlines())
    fresh = []
    for blob in blobs:
        for line in blob.splitlines():
            if line.strip() and line not in seen:
                seen.add(line)
                try:
                    fresh.append((int(json.loads(line).get("line") or 0), line))
                except (ValueError, AttributeError):
                    continue
    fresh.sort(key=lambda item: item[0])
    return [earlier] + [line + b"\n" for _, line in fresh]


def combine_summaries(summaries: list[dict], files: _Files) -> BatchSummary:
    """One summary for the job: sums over ranks, and each rank's own numbers."""
    first = summaries[0]
    total = BatchSummary(input=files.input, output=files.output, model=first["model"],
                         kv_ceiling_bytes=first["kv_ceiling_bytes"],
                         kv_growth_bytes_per_token=first["kv_growth_bytes_per_token"], kv_memory=first["kv_memory"])
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


def _scan_rows(stream: BinaryIO, ctx: _Context, group: Group) -> tuple[dict[str, Optional[str]], int]:
    """Every input row's id -> the fingerprint its record would carry, and the
    number of rows this process will see (after --limit, in its share)."""
    expected: dict[str, Optional[str]] = {}
    total = 0
    limit = ctx.options.limit
    for n, item in enumerate(rec.read_rows(stream)):
        if isinstance(item, rec.Row):
            expected[item.key] = ctx.expected_fingerprint(item)
        if (limit is None or n < limit) and shard_of(n, group.size) == group.rank:
            total += 1
    stream.seek(0)
    return expected, total




__all__ = [
    "BatchOptions", "BatchSummary", "BatchUsageError", "Interrupted", "run_batch", "run_row", "get_model",
    "default_output", "plan_resume", "check_resume", "EXIT_OK", "EXIT_ROWS_FAILED", "EXIT_USAGE",
    "EXIT_IO_ERROR", "EXIT_INTERNAL_ERROR", "EXIT_INTERRUPTED", "EXIT_PIPE_CLOSED",
]
