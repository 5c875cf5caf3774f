"""Resume: what an earlier output holds, whether it still fits the input, and the
merge of a process group's part files into the final output.

A row counts as done when the output holds a successful record for its id
*made from the same row and settings* (the record's ``fingerprint``); failed
records are dropped and retried; a torn last line (a kill mid-write) is cut
away. :func:`scan_output` reads one output file; :func:`check_resume` refuses
records made from other rows or settings, or whose ids left the input;
:func:`plan_run` does both for a run (one process: its output and the parts an
earlier group left; a group: every rank's records, exchanged) and keeps the
stats log in step; :func:`merge_group` has rank 0 write the final output from
every rank's part file once the ranks have finished.

Every refusal is a :class:`ResumeRefused` (a :class:`~knorm_gen.platform.files.FileUsageError`):
nothing has run when it is raised.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Union

from ..platform.files import FileUsageError, is_stream, rewrite_atomically
from . import records as rec
from .distributed import Group, local_parts
from .rows import Row


class ResumeRefused(FileUsageError):
    """An earlier output this run must not resume as it is (nothing was run)."""


class OutputCorrupt(ResumeRefused):
    """An existing output has a line that a kill could not have left, or an id twice."""


# ------------------------------------------------------------------ one output file


@dataclass
class ResumeState:
    """What an existing output holds.

    ``records`` maps each id (as text) with a successful record to
    ``(fingerprint, raw line)``, in file order, lines byte for byte;
    ``dropped_errors`` counts failed records (their rows are retried);
    ``torn`` says the last line was unterminated or unreadable.
    """

    records: dict[str, tuple[Optional[str], bytes]] = field(default_factory=dict)
    dropped_errors: int = 0
    torn: bool = False
    dropped_edited: int = 0  # records of rows edited since (see :func:`drop_edited`)

    @property
    def needs_rewrite(self) -> bool:
        return self.torn or self.dropped_errors > 0 or self.dropped_edited > 0


def scan_output(path: Union[str, Path]) -> ResumeState:
    """Read an earlier output for resume; a missing file is an empty state.

    A kill can only leave the *last* line incomplete, so a bad last line is
    torn and will be cut; a bad line anywhere else, or a successful id that
    appears twice (two runs wrote the same file), raises :class:`OutputCorrupt`.
    """
    state = ResumeState()
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return state
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    if tail:
        _check_torn(path, tail, ours=bool(lines))
        state.torn = True
    first_line: dict[str, int] = {}
    for i, line in enumerate(lines, 1):
        record = rec.parse_record(line)
        if record is None:
            if i == len(lines) and not tail:
                _check_torn(path, line, ours=i > 1)
                state.torn = True
                break
            raise OutputCorrupt(f"{path} line {i} is not a knorm-batch record; "
                                "use --overwrite or another --output")
        if record["error"] is None and record["id"] is not None:
            key = rec.id_key(record["id"])
            if key in first_line:
                raise OutputCorrupt(
                    f"{path} holds a successful record for id {record['id']!r} twice (lines {first_line[key]} "
                    f"and {i}), which one run never writes: two runs wrote this file at once. Keep the lines "
                    "you want and delete the rest, or use --overwrite or another --output")
            first_line[key] = i
            fingerprint = record.get("fingerprint")
            state.records[key] = (fingerprint if isinstance(fingerprint, str) else None, line + b"\n")
        else:
            state.dropped_errors += 1
    return state


def _check_torn(path: Union[str, Path], line: bytes, ours: bool) -> None:
    """A bad last line is cut as torn (a kill mid-write) only in a file that is
    recognisably ours: records above it (``ours``), or the line begins as a record
    does. Anything else is someone's file, which a run must not cut."""
    if ours or (rec.looks_ours(line) and not _is_json(line)):  # a torn record is never whole JSON
        return
    raise OutputCorrupt(f"{path} is not a knorm-batch records file (its only line is not a record), and this "
                        "run would replace it; to replace it use --overwrite, or write to another file with -o")


def _is_json(line: bytes) -> bool:
    try:
        json.loads(line)
    except (ValueError, RecursionError):
        return False
    return True


_STATS_KEYS = {"id", "line", "error"}  # what every stats-log entry holds (records.stats_entry)


def check_stats_log(path: Optional[str]) -> None:
    """Refuse to resume into a stats log that is someone's file (a resume rewrites it): its
    first line must be a stats entry, or the torn start of one."""
    if path is None or is_stream(path):
        return
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 20)
    except FileNotFoundError:
        return
    first, newline, _ = data.partition(b"\n")
    if not newline:
        ours = rec.looks_ours(first) and not _is_json(first)
    else:
        try:
            entry = json.loads(first)
        except (ValueError, RecursionError):
            entry = None
        ours = not first.strip() or (isinstance(entry, dict) and _STATS_KEYS <= set(entry))
    if not ours:
        raise ResumeRefused(f"the stats log {path} is not a knorm-batch stats log, and this run would rewrite it; "
                            "to replace it use --overwrite, or give another --stats-log")


def repair_torn_tail(path: Union[str, Path]) -> bool:
    """Cut an unterminated last line (a kill mid-write) from a JSONL file, atomically.
    Returns whether anything was cut."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return False
    if not data or data.endswith(b"\n"):
        return False
    keep = data[: data.rfind(b"\n") + 1]
    rewrite_atomically(path, [keep])
    return True


# ------------------------------------------------------------------ does it still fit the input?


@dataclass
class ResumePlan:
    """Which ids are done, and which earlier lines a rewrite keeps."""

    done: set[str] = field(default_factory=set)
    keep: list[bytes] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)  # the id of each line of ``keep``
    rewrite: bool = False
    torn: bool = False
    retried: int = 0
    edited: int = 0  # records dropped because their rows were edited since: run again


def check_resume(records: dict, expected: dict[str, Optional[str]], accept_old: bool, where: str,
                 configs: Optional[dict] = None, model: Optional[str] = None) -> None:
    """Refuse earlier records made from another row or other settings than the
    input and options give now, or whose id is no longer in the input, unless
    ``accept_old`` keeps them as done. ``records`` maps id -> (fingerprint, line).
    With ``configs`` (id -> the ``config`` a record of it would carry now) and
    ``model`` (the spec now), the refusal names the settings that differ
    (``budget: 512 -> 128``) or says that the rows themselves changed."""
    changed = [k for k, (fp, _) in records.items() if k in expected and fp != expected[k]]
    gone = [k for k in records if k not in expected]
    if (changed or gone) and not accept_old:
        parts = []
        if changed:
            parts.append(f"{len(changed)} finished record(s) were made from another row or other settings than "
                         f"the input and options give now (first: id {changed[0]!r})")
            if configs is not None:
                parts += _what_changed([(k, records[k][1]) for k in changed], configs, model)
        if gone:
            parts.append(f"{len(gone)} record(s) have ids that are no longer in the input (first: id {gone[0]!r})")
        raise ResumeRefused(f"{where}: " + "; ".join(parts) + ". Nothing was run. Use --overwrite to start "
                            "over, -o to write another file, or --accept-old-records to keep the old records "
                            "as they are (counted as done).")


_UNSET = object()
_MAX_COMPARED = 1000  # changed records whose settings a refusal compares (each is parsed again)


def _shown(value: Any) -> str:
    if value is _UNSET:
        return "(not set)"
    if value is None:
        return "none"
    if isinstance(value, str) and value and value.strip() == value and "->" not in value:
        return value
    return json.dumps(value, ensure_ascii=False)


def settings_changes(old: dict, config: dict, model: Optional[str]) -> list[str]:
    """``name: old -> new`` for each setting (and the model) where an earlier record
    ``old`` differs from the ``config`` a record would carry now."""
    changes = []
    if model is not None and old.get("model") != model:
        changes.append(f"model: {_shown(old.get('model'))} -> {_shown(model)}")
    before = old.get("config") if isinstance(old.get("config"), dict) else {}
    now = json.loads(json.dumps(config))  # tuples as lists, keys as text: as the record holds it
    for name in [*now, *(k for k in before if k not in now)]:
        a, b = before.get(name, _UNSET), now.get(name, _UNSET)
        if a != b:
            changes.append(f"{name}: {_shown(a)} -> {_shown(b)}")
    return changes


def _what_changed(changed: list, configs: dict, model: Optional[str]) -> list[str]:
    """The settings that differ between the changed records and now, and the rows
    whose settings are the same (so their content changed)."""
    changes: dict[str, None] = {}
    same_settings: list[str] = []
    for key, line in changed[:_MAX_COMPARED]:
        old = rec.parse_record(line.rstrip(b"\n"))
        if old is None or key not in configs:
            continue
        found = settings_changes(old, configs[key], model)
        if found:
            changes.update(dict.fromkeys(found))
        else:
            same_settings.append(key)
    parts = []
    if changes:
        listed = list(changes)
        parts.append("settings that differ: " + ", ".join(listed[:8]) + (", ..." if len(listed) > 8 else ""))
    if same_settings:
        parts.append(f"{len(same_settings)} of them have the same settings, so their rows changed in the input "
                     f"(first: id {same_settings[0]!r})")
    return parts


def with_aliases(records: dict, aliases: Optional[dict]) -> dict:
    """``records`` (id -> (fingerprint, line)) with each fingerprint an older spelling of the same
    settings wrote (:attr:`Wanted.aliases`) read as today's."""
    if aliases:
        for key, (fp, line) in list(records.items()):
            records[key] = (aliases.get(fp, fp), line)
    return records


def plan_resume(output: str, expected: dict[str, Optional[str]], accept_old: bool,
                configs: Optional[dict] = None, model: Optional[str] = None, rerun_edited: bool = False,
                aliases: Optional[dict] = None, unusable: frozenset = frozenset()) -> ResumePlan:
    """Compare an earlier output with the input's rows (see :func:`check_resume`).

    ``expected`` maps each input row's id to the fingerprint a record of it
    would carry now. A record counts as done only when its fingerprint matches.
    ``rerun_edited``: the records of rows edited since are dropped (:func:`drop_edited`).
    """
    state = scan_output(output)
    with_aliases(state.records, aliases)
    if rerun_edited and not accept_old:
        state.dropped_edited = len(drop_edited(state.records, Wanted(expected, configs=configs or {}, model=model,
                                                                 unusable=set(unusable))))
    check_resume(state.records, expected, accept_old, output, configs, model)
    return ResumePlan(done=set(state.records), keep=[line for _, line in state.records.values()],
                      keys=list(state.records), rewrite=state.needs_rewrite, torn=state.torn,
                      retried=state.dropped_errors, edited=state.dropped_edited)


def drop_edited(records: dict, wanted: "Wanted") -> set[str]:
    """Take out of ``records`` (id -> (fingerprint, line)) those made with the settings and
    model of now from other row content (a folder's file edited since), so that their
    rows run again; returns their ids. So are the records of files that are there but can
    be no row now (emptied since): they run again, into the error an empty file gets.
    Records made with other settings stay, for :func:`check_resume` to refuse."""
    edited = {key for key in records if key in wanted.unusable}
    for key, (fp, line) in records.items():
        if key not in wanted.configs or fp == wanted.expected.get(key):
            continue
        old = rec.parse_record(line.rstrip(b"\n"))
        if old is not None and not settings_changes(old, wanted.configs[key], wanted.model):
            edited.add(key)
    for key in edited:
        del records[key]
    return edited


# ------------------------------------------------------------------ a run's plan


@dataclass
class Outputs:
    """The files a run writes and a resume reads: the final output and stats log,
    and this process's own (its part files in a run across processes; else the same)."""

    output: str
    stats_log: Optional[str]
    own_output: str
    own_stats: Optional[str]


@dataclass
class Wanted:
    """What the input and the options give now: for every input row's id, the
    fingerprint its record would carry, its line number and (rows with valid
    settings) the ``config`` its record would carry; the model spec; and whether
    a row edited since its record runs again (:func:`drop_edited`)."""

    expected: dict[str, Optional[str]] = field(default_factory=dict)
    lines: dict[str, int] = field(default_factory=dict)
    configs: dict[str, dict] = field(default_factory=dict)
    model: Optional[str] = None
    rerun_edited: bool = False  # a row edited since its record runs again (a folder's file), not refused
    # fingerprints of the same rows and settings as older versions spelled them (legacy.older_spelling),
    # mapped to today's: a record that carries one is done
    aliases: dict[str, str] = field(default_factory=dict)
    # ids of input items that are there but can be no row now (a folder's file emptied since)
    unusable: set[str] = field(default_factory=set)


def plan_run(files: Outputs, wanted: Wanted, *, accept_old: bool, overwrite: bool, group: Group,
         log: Optional[Callable[[str], None]] = None) -> ResumePlan:
    """What is already done. One process: its output. A group: every rank's earlier
    records (its part files and, on rank 0's machine, the final output), exchanged.
    ``overwrite`` starts over (removing the parts of earlier runs); ``log`` hears
    what a resume found."""
    if is_stream(files.own_output):
        return ResumePlan()
    if group.distributed:
        return _plan_group(files, wanted, accept_old, overwrite, group, log)
    return _plan_alone(files, wanted, accept_old, overwrite, log)


def _plan_alone(files: Outputs, wanted: Wanted, accept_old: bool, overwrite: bool,
                log: Optional[Callable[[str], None]]) -> ResumePlan:
    parts = local_parts(files.output)
    if overwrite:
        for path in parts:
            path.unlink(missing_ok=True)
        return ResumePlan()
    check_stats_log(files.own_stats)
    plan = plan_resume(files.own_output, wanted.expected, accept_old, wanted.configs, wanted.model,
                       wanted.rerun_edited, wanted.aliases, frozenset(wanted.unusable))
    if parts:  # an earlier run across several processes stopped before its merge: take its records in
        have = set(plan.done)
        extra = with_aliases({k: (fp, line.encode("utf-8")) for k, fp, line in _local_records(files)
                              if k not in have}, wanted.aliases)
        if wanted.rerun_edited and not accept_old:
            drop_edited(extra, wanted)
        check_resume(extra, wanted.expected, accept_old, files.output, wanted.configs, wanted.model)
        plan.keep += [line for _, line in extra.values()]
        plan.keys += list(extra)
        plan.done |= set(extra)
        plan.rewrite = True
    if plan.rewrite:
        rewrite_atomically(files.own_output, plan.keep)
        for path in parts:
            path.unlink(missing_ok=True)
    if files.own_stats and not is_stream(files.own_stats):
        _reconcile_stats(files.own_stats, plan, wanted.lines)
    if (plan.done or plan.rewrite) and log:
        log(f"resuming {files.own_output}: {len(plan.done)} rows already done"
            + (f", {plan.retried} failed rows to retry" if plan.retried else "")
            + (f", {plan.edited} edited since to run again" if plan.edited else "")
            + (", cut a torn last line" if plan.torn else ""))
    return plan


def _stats_entries(data: bytes) -> list[tuple[bytes, Optional[dict]]]:
    """Each line of a stats log with its entry (None: a torn or unreadable line)."""
    out = []
    for raw in data.splitlines(keepends=True):
        try:
            entry = json.loads(raw) if raw.endswith(b"\n") else None
        except (ValueError, RecursionError):
            entry = None
        out.append((raw, entry))
    return out


def _upgraded(raw: bytes, entry: Any) -> bytes:
    """A stats-log line with an older log's entry renamed (``answers`` -> ``n_answers``)."""
    if isinstance(entry, dict) and "answers" in entry and "n_answers" not in entry:
        return rec.dump_record(rec.upgrade_stats_entry(entry))
    return raw


def _reconcile_stats(path: str, plan: ResumePlan, lines: dict) -> None:
    """Make the stats log hold exactly one entry per record the output keeps, in
    the output's order: the record's own entry where the log has one, else one
    rebuilt from the record (a kill between a record and its entry, a full disk
    under the stats log). Entries of dropped records and a torn line go."""
    data = _read(Path(path))
    entries: dict[str, bytes] = {}
    for raw, entry in _stats_entries(data):
        if isinstance(entry, dict) and "id" in entry and entry.get("error") is None:
            entries[rec.id_key(entry["id"])] = _upgraded(raw, entry)  # the latest entry of an id is its record's
    want = []
    for key, line in zip(plan.keys, plan.keep):
        raw = entries.get(key)
        if raw is None:
            record = {**dict.fromkeys(rec.RECORD_FIELDS), **json.loads(line)}  # an old record may lack some
            raw = rec.dump_record(rec.stats_entry(record, lines.get(key)))
        want.append(raw)
    if b"".join(want) != data:
        try:
            rewrite_atomically(path, want)
        except OSError as e:
            raise OSError(e.errno, e.strerror, path) from None  # name the stats log, not its temp file


def _plan_group(files: Outputs, wanted: Wanted, accept_old: bool, overwrite: bool, group: Group,
                log: Optional[Callable[[str], None]]) -> ResumePlan:
    if overwrite:
        for path in [*local_parts(files.output)] + ([*local_parts(files.stats_log)] if files.stats_log else []):
            if str(path) not in (files.own_output, files.own_stats):
                path.unlink(missing_ok=True)
        with group.during("the resume exchange"):
            group.barrier()  # nobody deletes a part another rank has started since
        return ResumePlan()
    check_stats_log(files.stats_log)
    union: dict[str, tuple[Optional[str], bytes]] = {}
    expected = wanted.expected
    with group.during("the resume exchange"):
        gathered = group.gather_json(_local_records(files))
    for records in gathered:
        for key, fp, line in records:
            fp = wanted.aliases.get(fp, fp)
            current = union.get(key)
            if current is None or (current[0] != expected.get(key) and fp == expected.get(key)):
                union[key] = (fp, line.encode("utf-8"))
    edited = drop_edited(union, wanted) if wanted.rerun_edited and not accept_old else set()
    check_resume(union, expected, accept_old, files.output, wanted.configs, wanted.model)
    state = scan_output(files.own_output)  # this rank's part: cut a torn line, drop failed and edited records
    state.dropped_edited = sum(state.records.pop(k, None) is not None for k in edited)
    if state.needs_rewrite:
        rewrite_atomically(files.own_output, [line for _, line in state.records.values()])
    if files.own_stats:
        repair_torn_tail(files.own_stats)
    if union and log:
        log(f"resuming {files.output}: {len(union)} rows already done (all ranks)")
    return ResumePlan(done=set(union), keep=[line for _, line in union.values()])


def _local_records(files: Outputs) -> list[tuple[str, Optional[str], str]]:
    """``(id, fingerprint, line)`` of every successful record on this machine:
    the final output (if it is here) and every part file, of any group size."""
    out = []
    for path in [Path(files.output), *local_parts(files.output)]:
        state = scan_output(path)
        out += [(key, fp, line.decode("utf-8")) for key, (fp, line) in state.records.items()]
    return out


# ------------------------------------------------------------------ the merge of a group's parts


def merge_group(files: Outputs, items: Callable[[], Iterable[Any]], plan: ResumePlan, expected: dict,
                accept_old: bool, group: Group, aliases: Optional[dict] = None) -> None:
    """Every rank's records to rank 0, which writes the final output in input order
    (``items()``: the input's items, read again) and the stats log; then each rank
    removes the part files the output now holds."""
    parts = [Path(files.own_output), *local_parts(files.output)]
    stats_parts = [Path(files.own_stats), *local_parts(files.stats_log)] if files.stats_log else []
    with group.during("the merge"):
        blobs = group.gather_bytes(b"".join(_read(p) for p in dict.fromkeys(parts)))
        stats_blobs = group.gather_bytes(b"".join(_read(p) for p in dict.fromkeys(stats_parts)))
    if group.rank == 0:
        rewrite_atomically(files.output, merge_records(items(), plan.keep, blobs, expected, accept_old, aliases))
        if files.stats_log:
            rewrite_atomically(files.stats_log, merge_stats(_upgrade_stats(_read(Path(files.stats_log))),
                                                            stats_blobs))
    with group.during("the merge"):
        group.barrier()  # rank 0 has written and fsynced the final files: the parts are redundant now
    for path in dict.fromkeys(parts + stats_parts):
        path.unlink(missing_ok=True)


def merge_records(items: Iterable[Any], earlier: list[bytes], blobs: list[bytes], expected: dict,
                  accept_old: bool, aliases: Optional[dict] = None) -> list[bytes]:
    """The final output: one line per input row, in input order. A row's
    successful record comes from the earlier records or any part (one whose
    fingerprint matches the input wins); else its error record from a part."""
    good: dict[str, bytes] = {}
    errors: dict[int, bytes] = {}
    for line in [*earlier, *(x + b"\n" for blob in blobs for x in blob.splitlines() if x.strip())]:
        record = rec.parse_record(line.rstrip(b"\n"))
        if record is None:
            continue  # a torn tail of a part this run did not own
        if record["error"] is None and record["id"] is not None:
            key = rec.id_key(record["id"])
            fp = record.get("fingerprint")
            fits = (aliases or {}).get(fp, fp) == expected.get(key) or accept_old
            if key not in good or fits:
                good[key] = line
        elif isinstance(record["error"], dict) and isinstance(record["error"].get("line"), int):
            errors[record["error"]["line"]] = line
    out = []
    for item in items:
        key = item.key if isinstance(item, Row) else None
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


def _upgrade_stats(data: bytes) -> bytes:
    """A stats log with the entries of older logs renamed (``answers`` -> ``n_answers``)."""
    if b'"answers"' not in data:
        return data
    return b"".join(_upgraded(raw, entry) for raw, entry in _stats_entries(data))


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return b""
