"""JSONL records out: one durable record per row, and reading them back for resume.

Writing: :class:`RecordWriter` writes each record as one whole line, then
flushes and fsyncs, so a kill loses at most the record being written. Every
record has the same keys (:data:`RECORD_FIELDS`), built here from a row and its
:class:`~knorm_gen.generation.results.GenerationResult` (or its error), with the
``fingerprint`` of what produced it.

Reading: :func:`parse_record` reads one line back (:mod:`knorm_gen.batch.resume`
reads whole outputs).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Optional, Sequence, Union

# error.type values
INVALID_UTF8 = "invalid_utf8"
INVALID_JSON = "invalid_json"
LINE_TOO_LONG = "line_too_long"
FILE_TOO_LARGE = "file_too_large"  # a folder's file over the byte limit of one input line
UNREADABLE_FILE = "unreadable_file"  # a folder's file (or subfolder) not readable, or a PDF pypdf cannot parse
INVALID_ROW = "invalid_row"
DUPLICATE_ID = "duplicate_id"
PROMPT_TOO_LONG = "prompt_too_long"
GENERATION_ERROR = "generation_error"
KV_MEMORY_EXCEEDED = "kv_memory_exceeded"  # a row that cannot fit --max-kv-memory even alone
ERROR_TYPES = (INVALID_UTF8, INVALID_JSON, LINE_TOO_LONG, FILE_TOO_LARGE, UNREADABLE_FILE, INVALID_ROW, DUPLICATE_ID,
               PROMPT_TOO_LONG, KV_MEMORY_EXCEEDED, GENERATION_ERROR)
"""Every ``error.type`` a record can carry, as the README's record table lists them
(``tests/test_records.py`` holds the two together)."""

STATS_FIELDS = (
    "finish_reason", "prompt_tokens", "generated_tokens", "tokens_seen", "tokens_kept", "tokens_pinned",
    "compression_ratio", "token_ratio", "kept_bytes", "full_bytes", "saved_bytes", "kv_ceiling_bytes", "prefill_s", "decode_s", "prompt_tps", "generation_tps",
    "peak_memory_gb",
)
RECORD_FIELDS = ("id", "completion", "answers", *STATS_FIELDS, "long_document", "model", "config", "meta", "fingerprint",
                 "error")
ANSWER_FIELDS = ("question", "answer", "finish_reason", "prompt_tokens", "generated_tokens", "tokens_seen",
                 "tokens_kept", "compression_ratio", "prefill_s", "decode_s", "generation_tps")


def id_key(row_id: Any) -> str:
    """Ids are compared as text: ``3`` and ``"3"`` are the same id."""
    return str(row_id)


# ------------------------------------------------------------------ building


def fingerprint(row_digest: str, config: dict, model: str) -> str:
    """What produced a record: the row's content, its effective settings and the model spec."""
    text = json.dumps({"row": row_digest, "config": config, "model": model}, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]


def empty_record(row_id: Any, model: str, config: dict, meta: Optional[dict]) -> dict:
    """The one record shape: every field present, numbers null until known."""
    record = dict.fromkeys(RECORD_FIELDS)
    record.update(id=row_id, model=model, config=config, meta=meta)
    return record


def failed(record: dict, kind: str, message: str, line: int, where: Optional[str] = None) -> dict:
    """``record`` as a failure: the error named, every number null. The message starts
    with ``where`` the row came from (default ``line N``; a folder's file: its path)."""
    record["error"] = {"type": kind, "message": f"{where or f'line {line}'}: {message}", "line": line}
    for name in STATS_FIELDS:
        record[name] = None
    record["completion"] = record["answers"] = None
    return record


def completion_numbers(result: Any) -> dict:
    """The fields of a prompt row's record from its GenerationResult."""
    return {"completion": result.text, **{k: getattr(result, k) for k in STATS_FIELDS}}


def question_numbers(results: Sequence[Any]) -> dict:
    """The fields of a question row's record: cache numbers from the answer that
    saw the most tokens; token counts and times summed, the context prefill once.
    A row of one question has its answer as its ``completion`` too (where a reader
    looks first); a row of several has them in ``answers`` only."""
    answers = [{"question": r.question, "answer": r.text, **{k: getattr(r, k) for k in ANSWER_FIELDS[2:]}}
               for r in results]
    peak = max(results, key=lambda r: r.tokens_seen)
    context_s = results[0].context_prefill_s or 0.0
    prefill_s = context_s + sum(r.prefill_s - (r.context_prefill_s or 0.0) for r in results)
    decode_s = sum(r.decode_s for r in results)
    generated = sum(r.generated_tokens for r in results)
    reasons = [r.finish_reason for r in results if r.finish_reason != "stop"]
    return {
        "completion": answers[0]["answer"] if len(answers) == 1 else None,
        "answers": answers,
        "finish_reason": reasons[0] if reasons else "stop",
        "prompt_tokens": peak.prompt_tokens,
        "generated_tokens": generated,
        "tokens_seen": peak.tokens_seen,
        "tokens_kept": peak.tokens_kept,
        "tokens_pinned": peak.tokens_pinned,
        "compression_ratio": peak.compression_ratio,
        "token_ratio": peak.token_ratio,
        "kept_bytes": peak.kept_bytes,
        "full_bytes": peak.full_bytes,
        "saved_bytes": peak.saved_bytes,
        "kv_ceiling_bytes": None if any(r.kv_ceiling_bytes is None for r in results)
        else max(r.kv_ceiling_bytes for r in results),
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "prompt_tps": peak.prompt_tps,
        "generation_tps": generated / decode_s if decode_s > 0 else 0.0,
        "peak_memory_gb": max(r.peak_memory_gb for r in results),
    }


def finite(record: dict) -> dict:
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


def stats_entry(record: dict, line: int) -> dict:
    """A record without its texts (``completion``, ``answers``, ``meta``), for --stats-log.
    ``n_answers`` counts a question row's answers (null for a prompt row); older logs
    called it ``answers``, the name of the output's list (:func:`upgrade_stats_entry`)."""
    entry = {"id": record["id"], "line": line}
    entry.update({k: record[k] for k in STATS_FIELDS})
    entry["n_answers"] = len(record["answers"]) if record["answers"] is not None else None
    entry.update(model=record["model"], config=record["config"],
                 error=record["error"]["type"] if record["error"] else None)
    return entry


def upgrade_stats_entry(entry: dict) -> dict:
    """A stats-log entry of an older log (its count of answers named ``answers``, as the
    output names the list) with the field named ``n_answers``, in the same place."""
    if "answers" not in entry or "n_answers" in entry:
        return entry
    return {("n_answers" if k == "answers" else k): v for k, v in entry.items()}


# ------------------------------------------------------------------ writing


RECORD_START = b'{"id": '
"""How every line of a records file and of a stats log begins (:func:`dump_record`)."""


def looks_ours(data: bytes) -> bool:
    """Whether ``data`` (a file's start, or one line) begins as a records file or stats
    log of ours does, or is blank: a torn line of such a file may be cut, another file not."""
    data = data.lstrip(b" \t\r\n")
    return not data or data.startswith(RECORD_START) or RECORD_START.startswith(data)


def dump_record(record: dict) -> bytes:
    """One record as one JSONL line (UTF-8, ending in a newline)."""
    return (json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")


class FileVanished(OSError):
    """The path a writer was opened on no longer names the file it writes
    (deleted, its folder removed, or replaced): what it wrote is not there."""


class RecordWriter:
    """Append whole lines to a binary stream, durable one at a time.

    Each line is written, flushed and fsynced (when the stream is a regular
    file) before :meth:`write` returns. A regular file opened by :meth:`open`
    is written straight to its descriptor: a line that fails (a full disk) is
    cut off again, so it never leaves a torn line; and after each line the
    path must still name the open file (:meth:`check`).
    """

    def __init__(self, stream: BinaryIO, close: bool = False, path: Optional[Union[str, Path]] = None):
        self.stream = stream
        self._close = close
        self.path = path
        self._ident: Optional[tuple[int, int]] = None
        try:
            self._fd: Optional[int] = stream.fileno()
            st = os.fstat(self._fd)
            if not stat.S_ISREG(st.st_mode):
                self._fd = None  # pipes and terminals cannot be fsynced
            elif path is not None:
                self._ident = (st.st_dev, st.st_ino)
        except (AttributeError, OSError, ValueError):
            self._fd = None

    @classmethod
    def open(cls, path: Union[str, Path], fresh: bool = False) -> "RecordWriter":
        return cls(open(path, "wb" if fresh else "ab"), close=True, path=path)

    def write(self, record: dict) -> None:
        data = dump_record(record)
        if self._ident is None:
            self.stream.write(data)
            self.stream.flush()
            if self._fd is not None:
                os.fsync(self._fd)
            return
        start = os.lseek(self._fd, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
            os.fsync(self._fd)
        except OSError:
            try:
                os.ftruncate(self._fd, start)  # no torn line: the record was not written
                os.lseek(self._fd, start, os.SEEK_SET)
            except OSError:
                pass
            raise
        self.check()

    def check(self) -> None:
        """Raise :class:`FileVanished` when the path no longer names the open file."""
        if self._ident is None:
            return
        try:
            st = os.stat(self.path)
        except OSError:
            raise FileVanished("was deleted (or its folder was)") from None
        if (st.st_dev, st.st_ino) != self._ident:
            raise FileVanished("was replaced by another file")

    def close(self) -> None:
        if self._close:
            self.stream.close()


# ------------------------------------------------------------------ reading


def parse_record(line: bytes) -> Optional[dict]:
    """A line of an output as a record (a JSON object with ``id`` and ``error``), or None."""
    try:
        record = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError):
        return None
    if not isinstance(record, dict) or "id" not in record or "error" not in record:
        return None
    return record




def texts_markdown(records: Iterable[dict], title: str) -> str:
    """The texts of ``records`` as Markdown a reader can open: a section per row (its id),
    the completion, or each question in bold and its answer; a failed row says its error."""
    out = [f"# {title}", ""]
    for record in records:
        out += [f"## {record.get('id')}", ""]
        error = record.get("error")
        if error:
            out += [f"*failed ({error.get('type')}): {error.get('message')}*", ""]
        elif record.get("answers") is not None:
            for answer in record["answers"]:
                out += [f"**{(answer.get('question') or '').strip()}**", "", (answer.get("answer") or "").strip(), ""]
        else:
            out += [(record.get("completion") or "").strip(), ""]
    return "\n".join(out)
