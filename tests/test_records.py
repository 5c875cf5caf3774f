"""Durable record writing and the resume scanner (no model needed)."""

import io
import json
import os

import pytest

from knorm_gen import records as rec
from knorm_gen import rows
from knorm_gen.files import rewrite_atomically


def rows_of(data: bytes, **kw):
    return list(rows.read_rows(io.BytesIO(data), **kw))


def test_writer_writes_whole_lines_and_fsyncs(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    path = tmp_path / "out.jsonl"
    w = rec.RecordWriter.open(path)
    w.write({"id": 1, "text": "caf\u00e9\nline"})
    assert path.read_bytes() == '{"id": 1, "text": "caf\u00e9\\nline"}\n'.encode()
    w.write({"id": 2})
    w.close()
    assert len(synced) == 2
    # a stream that is not a file (stdout, a pipe) is flushed but not fsynced
    buf = io.BytesIO()
    rec.RecordWriter(buf).write({"id": 3})
    assert buf.getvalue() == b'{"id": 3}\n' and len(synced) == 2


def record_line(row_id, error=None):
    return rec.dump_record({"id": row_id, "completion": "x", "error": error})


def test_scan_output_torn_tail_failed_records_and_corruption(tmp_path):
    path = tmp_path / "out.jsonl"
    assert rec.scan_output(path).records == {}
    ok1, ok2 = record_line("a"), record_line(2)
    failed = record_line("b", {"type": "invalid_row", "message": "m", "line": 2})
    path.write_bytes(ok1 + failed + ok2 + b'{"id": "c", "compl')
    state = rec.scan_output(path)
    assert state.torn and state.dropped_errors == 1 and state.needs_rewrite
    keep = [line for _, line in state.records.values()]
    assert keep == [ok1, ok2] and set(state.records) == {"a", "2"}
    rewrite_atomically(path, keep)
    assert path.read_bytes() == ok1 + ok2
    assert not rec.scan_output(path).needs_rewrite
    assert [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]  # no temp file left

    path.write_bytes(ok1 + b'{"id": "c"\n')  # a terminated but unreadable last line is torn too
    assert rec.scan_output(path).torn
    path.write_bytes(ok1 + b"garbage\n" + ok2)
    with pytest.raises(rec.OutputCorrupt, match="line 2 is not a knorm-batch record"):
        rec.scan_output(path)
    path.write_bytes(b'{"not": "a record"}\n' + ok1)
    with pytest.raises(rec.OutputCorrupt):
        rec.scan_output(path)


def test_records_are_one_json_object_per_line():
    line = rec.dump_record({"id": "x", "completion": "two\nlines \u2028 and \r"})
    assert line.count(b"\n") == 1 and json.loads(line)["completion"] == "two\nlines \u2028 and \r"
