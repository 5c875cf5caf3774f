"""JSONL rows in, durable JSONL records out.

Reading: one JSON object per line. A UTF-8 BOM at the start and CRLF line
endings are accepted; blank lines are skipped (they still count for line
numbers); a line that is not UTF-8, not JSON, too long, or not a valid row
becomes a :class:`RowError` naming the line, and reading goes on.

Writing: :class:`RecordWriter` writes each record as one whole line, then
flushes and fsyncs, so a kill loses at most the record being written.
:func:`scan_output` reads an earlier output for resume and finds a torn last line.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Optional, Union

from .files import rewrite_atomically  # noqa: F401  (re-exported: it lived here first)

MAX_LINE_BYTES = 64 * 1024 * 1024
"""Longer input lines are skipped unread and reported as ``line_too_long``."""

BOM = b"\xef\xbb\xbf"
OVERRIDE_FIELDS = ("max_tokens", "temperature", "budget")
ROW_FIELDS = ("id", "prompt", "messages", "context", "question", "questions", *OVERRIDE_FIELDS)

# error.type values
INVALID_UTF8 = "invalid_utf8"
INVALID_JSON = "invalid_json"
LINE_TOO_LONG = "line_too_long"
INVALID_ROW = "invalid_row"
DUPLICATE_ID = "duplicate_id"
PROMPT_TOO_LONG = "prompt_too_long"
GENERATION_ERROR = "generation_error"

RowId = Union[str, int]


@dataclass
class Row:
    """A validated input row.

    ``kind`` is ``"prompt"`` (text), ``"messages"`` (chat list) or
    ``"questions"`` (``context`` plus one or more questions).
    """

    line: int
    id: RowId
    kind: str
    prompt: Any = None  # text or chat messages
    context: Optional[str] = None
    questions: Optional[list[str]] = None
    overrides: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    digest: str = ""  # content_digest of the row object, for record fingerprints

    @property
    def key(self) -> str:
        return id_key(self.id)


@dataclass
class RowError:
    """A line that could not become a row. ``id`` is None when unknown or duplicated."""

    line: int
    type: str
    message: str
    id: Optional[RowId] = None
    meta: Optional[dict] = None

    def to_dict(self) -> dict:
        return {"type": self.type, "message": self.message, "line": self.line}


def id_key(row_id: RowId) -> str:
    """Ids are compared as text: ``3`` and ``"3"`` are the same id."""
    return str(row_id)


# ------------------------------------------------------------------ reading


def iter_raw_lines(stream: BinaryIO, max_bytes: Optional[int] = None) -> Iterator[tuple[int, Optional[bytes]]]:
    """``(line_number, bytes)`` for each line, without its line ending.

    A line longer than ``max_bytes`` is read through in chunks and yielded as
    ``None`` so a single huge line never sits in memory.
    """
    limit = MAX_LINE_BYTES if max_bytes is None else max_bytes
    number = 0
    while True:
        chunk = stream.readline(limit + 1)
        if not chunk:
            return
        number += 1
        if len(chunk) > limit and not chunk.endswith(b"\n"):
            while chunk and not chunk.endswith(b"\n"):
                chunk = stream.readline(1 << 20)
            yield number, None
            continue
        if number == 1 and chunk.startswith(BOM):
            chunk = chunk[len(BOM):]
        yield number, chunk.rstrip(b"\r\n")


def count_rows(stream: BinaryIO) -> int:
    """Non-blank lines, the number of rows a file holds (for a progress total)."""
    return sum(1 for _, raw in iter_raw_lines(stream) if raw is None or raw.strip())


def read_rows(stream: BinaryIO, max_bytes: Optional[int] = None) -> Iterator[Union[Row, RowError]]:
    """Parse every non-blank line into a :class:`Row` or a :class:`RowError`.

    Duplicate ids (compared as text) make the later line a ``duplicate_id`` error.
    """
    seen: dict[str, int] = {}
    for number, raw in iter_raw_lines(stream, max_bytes):
        if raw is None:
            limit = MAX_LINE_BYTES if max_bytes is None else max_bytes
            yield RowError(number, LINE_TOO_LONG, f"line {number} is longer than the {limit}-byte limit")
            continue
        if not raw.strip():
            continue
        item = parse_line(raw, number)
        if isinstance(item, Row):
            first = seen.get(item.key)
            if first is not None:
                item = RowError(number, DUPLICATE_ID,
                                f"line {number}: duplicate id {item.id!r}, first used on line {first} "
                                "(ids are compared as text, so 3 and \"3\" are the same id)",
                                meta=item.meta)
            else:
                seen[item.key] = number
        yield item


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number (RFC 8259 has no NaN or Infinity)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:20]} is out of range for a float")
    return value


def loads_strict(text: str) -> Any:
    """``json.loads`` as RFC 8259 reads it: NaN, Infinity and numbers that
    overflow a float are errors, not values."""
    return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)


def parse_line(raw: bytes, number: int) -> Union[Row, RowError]:
    """One input line (bytes, no line ending) to a row or an error; never raises."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return RowError(number, INVALID_UTF8,
                        f"line {number} is not valid UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start})")
    try:
        obj = loads_strict(text)
    except json.JSONDecodeError as e:
        return RowError(number, INVALID_JSON, f"line {number} is not valid JSON: {e.msg} at column {e.colno}")
    except RecursionError:
        return RowError(number, INVALID_JSON, f"line {number} is nested too deeply to read")
    except ValueError as e:  # NaN, Infinity, 1e999, an integer of 5,000 digits
        return RowError(number, INVALID_JSON, f"line {number} is not valid JSON: {' '.join(str(e).split())[:200]}")
    except Exception as e:  # noqa: BLE001 - e.g. an integer of 5,000 digits: any parser failure is the row's
        return RowError(number, INVALID_JSON, f"line {number} is not valid JSON: {_one_line(e)}")
    if not isinstance(obj, dict):
        return RowError(number, INVALID_ROW, f"line {number}: expected a JSON object, got {_kind(obj)}")
    try:
        row = parse_row(obj, number)
        if isinstance(row, Row):
            row.digest = content_digest(obj)
        else:
            dump_record({"meta": row.meta})  # meta goes back out: it must be writable
        return row
    except Exception as e:  # noqa: BLE001 - whatever the content, a bad line never stops the run
        return RowError(number, INVALID_ROW, f"line {number}: cannot use this row: {_one_line(e)}")


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:200]}"


def content_digest(obj: Any) -> str:
    """sha256 of a value's canonical JSON (sorted keys, no spaces)."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def parse_row(obj: dict, number: int) -> Union[Row, RowError]:
    """Validate a decoded row object."""
    meta = {k: v for k, v in obj.items() if k not in ROW_FIELDS}
    row_id = obj.get("id", number)
    if isinstance(row_id, int) and not isinstance(row_id, bool) and abs(row_id) >= 2**63:
        return RowError(number, INVALID_ROW,
                        f"line {number}: field 'id' is an integer too large to be an id (use a string)", meta=meta)
    if isinstance(row_id, bool) or not isinstance(row_id, (str, int)) or row_id == "":
        return RowError(number, INVALID_ROW,
                        f"line {number}: field 'id' must be a non-empty string or an integer, got {_show(row_id)}",
                        meta=meta)

    def bad(message: str) -> RowError:
        return RowError(number, INVALID_ROW, f"line {number}: {message}", id=row_id, meta=meta)

    given = [k for k in ("prompt", "messages", "context") if k in obj]
    if len(given) != 1:
        what = "none" if not given else " and ".join(repr(k) for k in given)
        return bad(f"a row needs exactly one of 'prompt', 'messages', or 'context' (with 'question' "
                   f"or 'questions'); got {what}")
    kind = given[0]
    if kind != "context" and ("question" in obj or "questions" in obj):
        return bad("'question'/'questions' go with 'context', not with " + repr(kind))

    row = Row(number, row_id, kind, meta=meta)
    if kind == "prompt":
        err = _text_error(obj["prompt"], "prompt")
        if err:
            return bad(err)
        row.prompt = obj["prompt"]
    elif kind == "messages":
        err = _messages_error(obj["messages"])
        if err:
            return bad(err)
        row.prompt = obj["messages"]
    else:
        row.kind = "questions"
        err = _text_error(obj["context"], "context")
        if err:
            return bad(err)
        row.context = obj["context"]
        if ("question" in obj) == ("questions" in obj):
            return bad("a 'context' row needs exactly one of 'question' (text) or 'questions' (list of text)")
        if "question" in obj:
            err = _text_error(obj["question"], "question")
            if err:
                return bad(err)
            row.questions = [obj["question"]]
        else:
            qs = obj["questions"]
            if not isinstance(qs, list) or not qs:
                return bad(f"field 'questions' must be a non-empty list of text, got {_show(qs)}")
            for i, q in enumerate(qs):
                err = _text_error(q, f"questions[{i}]")
                if err:
                    return bad(err)
            row.questions = list(qs)

    for name in OVERRIDE_FIELDS:
        if name in obj:
            err = _override_error(name, obj[name])
            if err:
                return bad(err)
            row.overrides[name] = obj[name]
    return row


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number", type(None): "null"}.get(type(value), type(value).__name__)


def _show(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return f"{_kind(value)} {text[:40] + '...' if len(text) > 40 else text}"


def _text_error(value: Any, name: str) -> Optional[str]:
    if not isinstance(value, str):
        return f"field '{name}' must be text, got {_show(value)}"
    if not value.strip():
        return f"field '{name}' is empty"
    return None


def _messages_error(value: Any) -> Optional[str]:
    if not isinstance(value, list) or not value:
        return f"field 'messages' must be a non-empty list of {{role, content}} objects, got {_show(value)}"
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            return f"messages[{i}] must be an object with 'role' and 'content', got {_show(m)}"
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                return f"messages[{i}].{key} must be text, got {_show(m.get(key))}"
    if not any(m["content"].strip() for m in value):
        return "field 'messages' has no non-empty content"
    return None


def _override_error(name: str, value: Any) -> Optional[str]:
    if name == "max_tokens" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        return f"field 'max_tokens' must be an integer >= 1, got {_show(value)}"
    if name == "temperature" and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
        return f"field 'temperature' must be a number >= 0, got {_show(value)}"
    if name == "budget" and value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        return f"field 'budget' must be an integer >= 1 or null (full cache), got {_show(value)}"
    return None


# ------------------------------------------------------------------ writing


def dump_record(record: dict) -> bytes:
    """One record as one JSONL line (UTF-8, ending in a newline)."""
    return (json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")


class RecordWriter:
    """Append whole lines to a binary stream, durable one at a time.

    Each line is written, flushed and fsynced (when the stream is a regular
    file) before :meth:`write` returns.
    """

    def __init__(self, stream: BinaryIO, close: bool = False):
        self.stream = stream
        self._close = close
        try:
            self._fd: Optional[int] = stream.fileno()
            if not stat.S_ISREG(os.fstat(self._fd).st_mode):
                self._fd = None  # pipes and terminals cannot be fsynced
        except (AttributeError, OSError, ValueError):
            self._fd = None

    @classmethod
    def open(cls, path: Union[str, Path], fresh: bool = False) -> "RecordWriter":
        return cls(open(path, "wb" if fresh else "ab"), close=True)

    def write(self, record: dict) -> None:
        self.stream.write(dump_record(record))
        self.stream.flush()
        if self._fd is not None:
            os.fsync(self._fd)

    def close(self) -> None:
        if self._close:
            self.stream.close()


# ------------------------------------------------------------------ resume


class OutputCorrupt(ValueError):
    """An existing output has a line that a kill could not have left, or an id twice."""


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

    @property
    def needs_rewrite(self) -> bool:
        return self.torn or self.dropped_errors > 0


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
        state.torn = True
    first_line: dict[str, int] = {}
    for i, line in enumerate(lines, 1):
        record = _as_record(line)
        if record is None:
            if i == len(lines) and not tail:
                state.torn = True
                break
            raise OutputCorrupt(f"{path} line {i} is not a knorm-batch record; "
                                "use --overwrite or another --output")
        if record["error"] is None and record["id"] is not None:
            key = id_key(record["id"])
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


def _as_record(line: bytes) -> Optional[dict]:
    try:
        record = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError):
        return None
    if not isinstance(record, dict) or "id" not in record or "error" not in record:
        return None
    return record


