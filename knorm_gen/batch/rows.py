"""JSONL rows in: one JSON object per line, each a :class:`Row` or a :class:`RowError`.

A UTF-8 BOM at the start and CRLF line endings are accepted; blank lines are
skipped (they still count for line numbers); a line that is not UTF-8, not
JSON, too long, or not a valid row becomes a :class:`RowError` naming the line,
and reading goes on.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Iterator, Optional, Union

from ..eviction.config import RowsConfig
from .records import DUPLICATE_ID, INVALID_JSON, INVALID_ROW, INVALID_UTF8, LINE_TOO_LONG, dump_record, id_key

MAX_LINE_BYTES = 64 * 1024 * 1024
"""Longer input lines are skipped unread and reported as ``line_too_long``."""

BOM = b"\xef\xbb\xbf"
OVERRIDE_FIELDS = ("max_tokens", "temperature", "budget", "ratio", "top_k", "min_p", "repetition_penalty",
                   "pin_prefix_chars", "kv_bits", "kv_group_size")
ROW_FIELDS = ("id", "prompt", "messages", "context", "question", "questions", *OVERRIDE_FIELDS)

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
    path: Optional[str] = None  # a folder's file: its path under the folder (``line`` is then its number)

    @property
    def key(self) -> str:
        return id_key(self.id)

    @property
    def where(self) -> str:
        """Where the row came from, as its error messages start: ``line 3``, or a folder file's path."""
        return self.path if self.path is not None else f"line {self.line}"


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


def read_rows(stream: BinaryIO, max_bytes: Optional[int] = None,
              shape: Optional[RowsConfig] = None) -> Iterator[Union[Row, RowError]]:
    """Parse every non-blank line into a :class:`Row` or a :class:`RowError`
    (``shape``: where the document is, and the job's questions).

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
        item = parse_line(raw, number, shape)
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


def parse_line(raw: bytes, number: int, shape: Optional[RowsConfig] = None) -> Union[Row, RowError]:
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
        row = parse_row(obj, number, shape)
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


def parse_row(obj: dict, number: int, shape: Optional[RowsConfig] = None,
              where: Optional[str] = None) -> Union[Row, RowError]:
    """Validate a decoded row object. ``shape.context_field`` names the field holding
    a document; ``shape.questions`` are asked of a document with no question of its own.
    An error's message starts with ``where`` (default ``line N``)."""
    shape = shape or RowsConfig()
    where = where or f"line {number}"
    consumed = (set(ROW_FIELDS) - {"context"}) | {shape.context_field}
    meta = {k: v for k, v in obj.items() if k not in consumed}
    row_id = obj.get("id", number)
    problem = _id_error(row_id)
    if problem:
        return RowError(number, INVALID_ROW, f"{where}: {problem}", meta=meta)
    row = Row(number, row_id, "prompt", meta=meta)
    problem = _body_error(obj, row, shape) or _overrides_error(obj, row)
    if problem:
        return RowError(number, INVALID_ROW, f"{where}: {problem}", id=row_id, meta=meta)
    return row


def _id_error(row_id: Any) -> Optional[str]:
    if isinstance(row_id, int) and not isinstance(row_id, bool) and abs(row_id) >= 2**63:
        return "field 'id' is an integer too large to be an id (use a string)"
    if isinstance(row_id, bool) or not isinstance(row_id, (str, int)) or row_id == "":
        return f"field 'id' must be a non-empty string or an integer, got {_show(row_id)}"
    return None


DOCUMENT_FIELDS = ("text", "article", "body", "document", "content")
"""Fields that often hold a row's document: a row with one of them and no prompt,
messages or document field gets a hint naming ``--context-field``."""


def _document_hint(obj: dict, shape: RowsConfig) -> str:
    """``; use --context-field text --question "..."`` for a row whose document sits in a
    field that is not the --context-field; empty when there is none."""
    found = next((k for k in DOCUMENT_FIELDS if k != shape.context_field and isinstance(obj.get(k), str)), None)
    if found is None:
        return ""
    question = "" if shape.questions or "question" in obj or "questions" in obj else ' --question "..."'
    return (f"; this row has a {found!r} field: to use it as the document, use --context-field {found}{question} "
            f"(or context_field = \"{found}\" under [rows] in a job file)")


def _body_error(obj: dict, row: Row, shape: RowsConfig) -> Optional[str]:
    """Fill ``row`` from the one of prompt / messages / document the object holds."""
    field = shape.context_field
    given = [k for k in ("prompt", "messages", field) if k in obj]
    if not given and shape.questions:
        return (f"field {field!r} (the document, --context-field) is missing; with --question every row needs "
                "it, or a 'prompt' or 'messages' of its own" + _document_hint(obj, shape))
    if len(given) != 1:
        what = "none" if not given else " and ".join(repr(k) for k in given)
        return (f"a row needs exactly one of 'prompt', 'messages', or {field!r} (with 'question' "
                f"or 'questions'); got {what}" + (_document_hint(obj, shape) if not given else ""))
    kind = given[0]
    if kind != field and ("question" in obj or "questions" in obj):
        return f"'question'/'questions' go with {field!r}, not with " + repr(kind)
    if kind == "prompt":
        row.prompt = obj["prompt"]
        return _text_error(obj["prompt"], "prompt")
    if kind == "messages":
        row.kind, row.prompt = "messages", obj["messages"]
        return _messages_error(obj["messages"])
    row.kind, row.context = "questions", obj[field]
    return _text_error(obj[field], field) or _questions_error(obj, row, shape)


def _questions_error(obj: dict, row: Row, shape: RowsConfig) -> Optional[str]:
    if "question" not in obj and "questions" not in obj and shape.questions:
        row.questions = list(shape.questions)  # the job's instruction, never evicted like any question
        return None
    if ("question" in obj) == ("questions" in obj):
        return (f"a {shape.context_field!r} row needs exactly one of 'question' (text) or 'questions' (list of "
                "text), or a job question (--question)")
    if "question" in obj:
        row.questions = [obj["question"]]
        return _text_error(obj["question"], "question")
    qs = obj["questions"]
    if not isinstance(qs, list) or not qs:
        return f"field 'questions' must be a non-empty list of text, got {_show(qs)}"
    for i, q in enumerate(qs):
        err = _text_error(q, f"questions[{i}]")
        if err:
            return err
    row.questions = list(qs)
    return None


def _overrides_error(obj: dict, row: Row) -> Optional[str]:
    for name in OVERRIDE_FIELDS:
        if name in obj:
            err = _override_error(name, obj[name])
            if err:
                return err
            row.overrides[name] = obj[name]
    return None


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


def _fits_float(value: Any) -> bool:
    try:
        float(value)
    except OverflowError:  # an integer of a few hundred digits
        return False
    return True


def _override_error(name: str, value: Any) -> Optional[str]:
    if name == "max_tokens" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        return f"field 'max_tokens' must be an integer >= 1, got {_show(value)}"
    if name == "temperature" and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
        return f"field 'temperature' must be a number >= 0, got {_show(value)}"
    if name == "temperature" and not _fits_float(value):
        return "field 'temperature' must be a number >= 0, got an integer too large for a float"
    if name == "budget" and value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        return (f"field 'budget' must be an integer >= 1 or null (no cap under a ratio; with \"ratio\": null, the "
                f"full cache), got {_show(value)}")
    if name == "ratio" and value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                                  or not _fits_float(value) or not value >= 1):
        return f"field 'ratio' must be a number >= 1 or null (a fixed budget), got {_show(value)}"
    if name == "kv_bits" and (value is not None and (isinstance(value, bool) or value not in (4, 8))):
        return f"field 'kv_bits' must be 4, 8 or null (full precision), got {_show(value)}"
    if name == "kv_group_size" and (isinstance(value, bool) or value not in (32, 64, 128)):
        return f"field 'kv_group_size' must be 32, 64 or 128, got {_show(value)}"
    return None
